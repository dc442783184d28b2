"""The zero-infinity baseline holds DRAM as DeepSpeed really does (planner/policies/zero_infinity.py):
its pinned swap buffers, gradient buffer and optimizer initialisation on top of the schedule's own
buffers, so the largest model it trains follows the CPU memory as Fuyou §5.2 / Fig. 4 measured."""
import dataclasses

import pytest

from tensorstow import TensorstowError
from tensorstow.api import plan
from tensorstow.planner.policies.zero_infinity import _pinned, deepspeed_host_bytes


def test_pinned_allocations_round_up_to_a_power_of_two():
    assert [_pinned(n) for n in (0, 1, 4096, 4097, 4 * 10 ** 9)] == [0, 1, 4096, 8192, 1 << 32]


def test_deepspeed_host_bytes_follow_its_allocations():
    """13B in fp16 with DeepSpeed's defaults: sub-groups of 1e9 (+ the largest parameter), 4 pinned
    fp32 optimizer swap buffers, 5 x 1e8 parameter swap elements."""
    n, largest = 13 * 10 ** 9, 257 * 10 ** 6
    got = deepspeed_host_bytes(n, 2, largest)
    sub = 10 ** 9 + largest
    assert got["optimizer swap buffers"] == 4 * (1 << 33)  # 4 x 5.0 GB rounded to 8 GiB
    assert got["parameter swap buffers"] == 1 << 30
    assert got["gradient buffer (pinned)"] == 1 << 35  # 26 GB rounded up to 32 GiB
    assert got["gradient buffer: unpinned source while pinned"] == 2 * n
    assert got["optimizer initialisation (fp32 master, gradient, moments)"] == 16 * sub
    unpinned = deepspeed_host_bytes(n, 2, largest, pin_memory=False)
    assert unpinned["gradient buffer (pinned)"] == 2 * n and unpinned["gradient buffer: unpinned source while pinned"] == 0


def test_the_baselines_dram_peak_counts_deepspeeds_host_memory():
    r = plan("gpt-tiny", hw="lohan-rtx4090", policy="zero-infinity", batch=2, seq=32, precision="fp32")
    own = sum(r.breakdown("dram").values())
    assert r.decisions.host_reserved > 0 and r.peak("dram") == own + r.decisions.host_reserved
    assert r.to_plan().predicted.peak_bytes["dram"] == r.peak("dram")


@pytest.mark.parametrize("model, dram, fits", [
    ("gpt3-13b", "128GB", False),   # Fuyou §5.2: fails 13B with 128 GB (by 0.2 GB here)
    ("gpt3-6b", "128GB", True),
    ("gpt3-65b", "256GB", False),   # Fuyou Fig. 1a / §3.1: 65B needs 512 GB
    ("gpt3-65b", "512GB", True),
    ("gpt3-135b", "512GB", False),
    ("gpt3-135b", "768GB", True),   # Fuyou §5.2: 805B / 5.96 and 276B / 2.04 = 135B at 768 GB
    ("gpt3-175b", "768GB", False),  # Fuyou §5.3: every baseline fails 175B on its 768 GB server
])
def test_the_largest_model_zero_infinity_trains_follows_fuyous_measurements(model, dram, fits):
    """Batch 1 as Fuyou §5.2 ran it, on the A100 server (the 4090 gives the same: the limit is
    DRAM)."""
    try:
        ok = plan(model, hw="fuyou-a100-80g", policy="zero-infinity", batch=1, dram=dram).fits
    except TensorstowError as e:
        assert "dram needs" in str(e)
        ok = False
    assert ok == fits


def test_the_baselines_copies_block_its_compute_as_deepspeeds_do():
    """DeepSpeed 0.9.3 copies a block's input checkpoint to DRAM before the block runs and back as
    its backward starts (CPU_CHECKPOINT's blocking `.to()`), and each gradient's copy to DRAM holds
    up the next backward (`insert_tensor`'s blocking `copy_`): Fuyou Fig. 2a's serialized timeline.
    Other policies' copies overlap the compute."""
    from tensorstow.schema.options import Options
    from tensorstow.planner.plan import make_plan
    from tensorstow.calibrate import hardware_for
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="zero-infinity", batch=2, seq=32)
    plan = make_plan(o, hardware_for(o))
    assert plan.decisions.blocking_copies
    ins, sim = plan.instructions, plan.sim
    comp = [i for i in ins if i.stream == "gpu0.compute" and i.kind in ("compute", "recompute")]
    checked = 0
    for i in ins:
        if i.kind == "store" and i.tensor.startswith("X:") and i.src == "gpu0":  # before its block runs
            fwd = next(c for c in comp if c.segment == f"fwd:{i.tensor[2:]}" and c.kind == "compute")
            assert sim.start[fwd.id] >= sim.end[i.id] - 1e-15
            checked += 1
        if i.src == "gpu0" and i.dst == "dram" and i.tensor.startswith("G:"):  # before the next backward
            later = [c for c in comp if c.id > i.id]
            if later:
                assert sim.start[later[0].id] >= sim.end[i.id] - 1e-15
                checked += 1
        if i.kind == "load" and i.tensor.startswith("X:") and i.dst == "gpu0":  # after the last backward
            before = [c for c in comp if c.id < i.id and c.segment.startswith("bwd:")]
            if before:
                assert sim.start[i.id] >= sim.end[before[-1].id] - 1e-15
                checked += 1
    assert checked >= 6
    lohan = make_plan(dataclasses.replace(o, policy="lohan"), hardware_for(o))
    assert not lohan.decisions.blocking_copies and "blocking_copies" not in lohan.to_json()["decisions"]


@pytest.mark.parametrize("hardware", ["dos-jlse-4xh100", "lohan-rtx4090"])
def test_without_ssds_the_baselines_gradient_flush_is_deepspeeds_converting_copy(hardware):
    """With no SSD the optimizer is in DRAM (ZeRO-Offload in Fuyou §5.1) and DeepSpeed copies each
    16-bit gradient into its fp32 host gradient by the blocking, CPU-converting `copy_` (stage3.py
    `partition_grads`): DOS's measured 2.5 GB/s, not the pinned link (55 GB/s on DOS's H100s, 25 on
    the RTX 4090), on DOS's preset and, as an estimate, on the others (docs/hardware-presets.md)."""
    from tensorstow.schema.options import Options
    from tensorstow.planner.plan import make_plan
    from tensorstow.calibrate import hardware_for
    o = Options(model="gpt-tiny", hardware=hardware, policy="zero-infinity", batch=2, seq=32, ssds=0,
                precision="bf16-mixed")
    hw = hardware_for(o)
    plan = make_plan(o, hw)
    assert not plan.decisions.swap_grads
    flush = [i for i in plan.instructions if i.kind == "store" and i.tensor.startswith("G:") and i.src == "gpu0"]
    assert flush
    g = hw.gpus[0]
    assert g.d2h_convert_bw == 2.5e9 < g.d2h_bw
    for i in flush:
        assert plan.durations[i.id] == pytest.approx(plan.buffers[i.tensor].bytes / g.d2h_convert_bw)


def test_with_ssds_the_gradient_takes_the_same_converting_copy_and_the_next_backward_waits():
    """With the optimizer's sub-groups on NVMe DeepSpeed's gradient reaches the host by the same
    blocking path (stage3.py `partition_grads`: the 16-bit partition to a host buffer, `.float()`
    there, then `swap_out_gradients`): the plan's fp32 G store from the GPU costs the 16-bit bytes
    at `d2h_convert_bw`, and the next block's backward starts only after it (LoHan §II measured
    ZeRO-Infinity's backward stage as its compute plus its transfers, almost serial)."""
    from tensorstow.schema.options import Options
    from tensorstow.planner.plan import make_plan
    from tensorstow.calibrate import hardware_for
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="zero-infinity", batch=2, seq=32,
                precision="bf16-mixed")
    hw = hardware_for(o)
    plan = make_plan(o, hw)
    assert plan.decisions.swap_grads and plan.decisions.fp32_grads(True)
    flush = [i for i in plan.instructions if i.kind == "store" and i.tensor.startswith("G:") and i.src == "gpu0"]
    assert len(flush) > 1
    for i in flush:
        assert plan.durations[i.id] == pytest.approx(plan.buffers[i.tensor].bytes / 2 / hw.gpus[0].d2h_convert_bw)
    backwards = [i for i in plan.instructions if i.kind == "compute" and i.segment.startswith("bwd")]
    for earlier, later in zip(flush, flush[1:]):
        nxt = next(b for b in backwards if b.id > earlier.id)
        assert plan.sim.start[nxt.id] >= plan.sim.end[earlier.id] - 1e-12
        assert later.id > nxt.id
