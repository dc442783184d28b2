"""STRONGHOLD and Deep Optimizer States policies: feasibility, window size, update stride."""
import dataclasses
import functools
import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from tensorstow.planner import cost
from tensorstow.planner.presets import load_hardware, preset_names
from tensorstow.schema.options import Options
from tensorstow.planner.passes import schedule
from tensorstow.planner.problem import build_problem
from tensorstow.planner.policies import all_gpu, dos, stronghold

TINY_GPU = 2_000_000
"""Bytes: below gpt-tiny's all-GPU peak (~4.6 MB), above what the two policies need."""


@functools.lru_cache(maxsize=None)
def traced(model, hardware, batch):
    return build_problem(Options(model=model, hardware=hardware, batch=batch), load_hardware(hardware))


@functools.lru_cache(maxsize=None)
def problem(model, hardware, gpu_mem=None, batch=0):
    """Block profiles do not depend on the memory size: trace once, then swap the budget."""
    base = traced(model, hardware, batch)
    return dataclasses.replace(base, hw=base.hw.with_overrides(gpu_mem=gpu_mem),
                               options=dataclasses.replace(base.options, gpu_mem=gpu_mem))


def layers_of(p):
    return [b for b in p.order if p.graph.block(b).kind == "layer"]


# ---- (1) feasible plans -----------------------------------------------------------------------

def test_tiny_budget_rules_out_all_gpu_but_not_the_offloading_policies():
    p = problem("gpt-tiny", "lohan-rtx4090", TINY_GPU)
    assert schedule(p, all_gpu.plan(p)).over_capacity()
    for policy, name in ((stronghold, "stronghold"), (dos, "dos")):
        d = policy.plan(p)
        assert d.policy == name and list(d.blocks) == p.order
        assert not schedule(p, d).over_capacity(), name


@pytest.mark.parametrize("gpu_mem", [1_000_000, 1_500_000])
def test_stronghold_falls_back_to_recompute_when_memory_is_short(gpu_mem):
    p = problem("gpt-tiny", "lohan-rtx4090", gpu_mem)
    d = stronghold.plan(p)
    assert not schedule(p, d).over_capacity()
    assert {d.blocks[b].activations for b in layers_of(p)} == {"recompute"}
    assert all(d.blocks[b].checkpoint == "gpu" for b in p.order)


@pytest.mark.parametrize("policy", [stronghold, dos])
def test_nothing_fits_gives_smallest_memory_decisions_not_an_error(policy):
    p = problem("gpt-tiny", "lohan-rtx4090", 300_000)
    d = policy.plan(p)
    assert schedule(p, d).over_capacity()  # make_plan turns this into the byte breakdown
    assert {d.blocks[b].activations for b in layers_of(p)} == {"recompute"}


def test_stronghold_on_its_paper_machine():
    p = problem("gpt3-6b", "stronghold-v100-32g")
    d = stronghold.plan(p)
    plan = schedule(p, d)
    assert not plan.over_capacity()
    assert plan.peak("ssd") == 0  # STRONGHOLD keeps the SSD out of the loop
    assert d.overlap_optimizer and not d.serialize_optimizer
    for b in p.order:
        bd = d.blocks[b]
        if p.graph.block(b).kind == "layer":
            assert (bd.params, bd.states, bd.optimizer) == ("dram", "dram", "cpu")
        else:  # embedding and head pinned, updated on the GPU
            assert (bd.params, bd.optimizer) == ("gpu", "gpu")
    print(f"stronghold gpt3-6b/V100: m = {d.prefetch}, step {plan.sim.step_time_s:.3f} s, "
          f"GPU peak {plan.peak('gpu') / 1e9:.2f} GB")


@pytest.mark.parametrize("model", ["dos-7b", "dos-13b"])
def test_dos_on_its_paper_machine(model):
    p = problem(model, "dos-jlse-4xh100")
    d = dos.plan(p)
    plan = schedule(p, d)
    assert not plan.over_capacity()
    assert plan.peak("ssd") == 0
    assert {bd.states for bd in d.blocks.values()} <= {"dram", "gpu"}
    assert {d.blocks[b].optimizer for b in p.order} == {"cpu", "gpu"}
    print(f"dos {model}: step {plan.sim.step_time_s:.3f} s, GPU peak {plan.peak('gpu') / 1e9:.2f} GB, "
          f"{sum(bd.states == 'gpu' for bd in d.blocks.values())} static subgroups")


@pytest.mark.parametrize("policy", [stronghold, dos])
def test_deterministic(policy):
    p = problem("gpt-tiny", "lohan-rtx4090", TINY_GPU)
    assert json.dumps(policy.plan(p).to_json()) == json.dumps(policy.plan(p).to_json())


# ---- (2) DOS Eq. 1 ----------------------------------------------------------------------------

@pytest.mark.parametrize("B,U_g,U_c,D_c,k", [
    (3, 35, 2, 8.7, 2.2945),      # DOS §5.4, V100: exact inputs, k = 2
    (13, 25, 8, 15.5, 1.7925),    # digest §4.2, H100 readings
    (12, 25, 8, 15.5, 1.9615),
    (13, 25, 8, 31, 2.2793),
    (12, 100, 8, 15.5, 1.7585),
    (13, 25, 2, 15.5, 0.5147),
    (13.75, 25, 8, 31, 2.1356),   # docs/hardware-presets.md, the dos-jlse-4xh100 derivation
])
def test_eq1_on_raw_numbers(B, U_g, U_c, D_c, k):
    assert dos.stride_eq1(B * 1e9, U_g * 1e9, U_c * 1e9, D_c * 1e9) == pytest.approx(k, abs=1e-4)


def test_eq1_without_solution_is_infinite():
    # 1/U_c + 1/D_c <= 1/(2B): the CPU's fp16 uploads alone saturate the link.
    assert dos.stride_eq1(1e9, 1e9, 1e12, 1e12) == math.inf


def test_update_stride_v100_numbers_of_dos_5_4():
    v100 = load_hardware("stronghold-v100-32g")
    g = dataclasses.replace(v100.gpu, h2d_bw=4 * 3e9, d2h_bw=4 * 3e9,
                            mem_bw=35e9 * cost.GPU_ADAM_BYTES_PER_PARAM)
    dram = dataclasses.replace(v100.dram, bandwidth=8.7e9 * dos.DOWNCAST_BYTES_PER_PARAM)
    hw = dataclasses.replace(v100, gpus=(g,), cpu=dataclasses.replace(v100.cpu, adam_rate=2e9), dram=dram)
    assert dos.stride_inputs(hw) == pytest.approx({"B": 3e9, "U_g": 35e9, "U_c": 2e9, "D_c": 8.7e9})
    k_float, k = dos.update_stride(hw)
    assert k_float == pytest.approx(2.2945, abs=1e-4) and k == 2


def test_update_stride_dos_preset():
    k_float, k = dos.update_stride(load_hardware("dos-jlse-4xh100"))
    # B 13.75e9, U_g 3.35e12/30, U_c 8e9, D_c 614.4e9/6 P/s
    assert k_float == pytest.approx(2.308, abs=1e-3) and k == 2


def test_update_stride_clamps_to_one():
    hw = load_hardware("dos-jlse-4xh100")
    slow_cpu = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, adam_rate=1e9))
    k_float, k = dos.update_stride(slow_cpu)
    assert k_float < 1 and k == 1


@pytest.mark.parametrize("preset", [n for n in preset_names() if n != "local"])
def test_update_stride_rounds_to_nearest(preset):
    k_float, k = dos.update_stride(load_hardware(preset))
    assert k == max(1, math.floor(k_float + 0.5))


def test_dos_stride_positions_and_static_tail():
    p = problem("dos-13b", "dos-jlse-4xh100")
    d = dos.plan(p)
    _, k = dos.update_stride(p.hw)
    update_order = list(reversed(p.order))
    resident = [b for b in update_order if d.blocks[b].states == "gpu"]
    dynamic = [b for b in update_order if d.blocks[b].states != "gpu"]
    assert resident and update_order[-len(resident):] == resident  # DOS §4.1: the last subgroups
    assert all(d.blocks[b].optimizer == "gpu" for b in resident)
    assert [d.blocks[b].optimizer for b in dynamic] == [
        "gpu" if (i + 1) % k == 0 else "cpu" for i in range(len(dynamic))]  # DOS Algorithm 1


# ---- (3) STRONGHOLD window --------------------------------------------------------------------

def test_stronghold_window_meets_p1_p2_and_is_the_smallest():
    p = problem("gpt3-6b", "stronghold-v100-32g")
    d = stronghold.plan(p)
    m = d.prefetch
    layers = layers_of(p)
    acts = d.blocks[layers[0]].activations
    prof = p.profiles[p.profile_of[layers[0]]]  # identical layers
    t_fp = prof.fwd_time_s
    t_bp = prof.bwd_time_s + (prof.fwd_time_s if acts == "recompute" else 0.0)
    t_c2g = cost.transfer_time(prof.param_bytes + prof.const_bytes, "dram", "gpu0", p.hw)
    t_g2c = cost.transfer_time(prof.grad_bytes, "gpu0", "dram", p.hw)

    def p1(m):  # STRONGHOLD Eq. 1b
        return m * t_fp >= t_c2g

    def p2(m):  # STRONGHOLD Eq. 2b (fetch of j and offload of the last finished layer)
        return m * t_bp >= max(t_c2g, t_g2c)

    assert 1 < m < len(layers)
    assert p1(m) and p2(m)
    assert not (p1(m - 1) and p2(m - 1))
    print(f"t_fp {t_fp * 1e3:.2f} ms, t_bp {t_bp * 1e3:.2f} ms, t_c2g {t_c2g * 1e3:.2f} ms -> m = {m}")


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    *(st.lists(st.floats(0.1, 10), min_size=n, max_size=n) for _ in range(4)))))
def test_window_size_is_the_smallest_m_meeting_p1_p2(lists):
    t = stronghold.LayerTimes(*(tuple(x) for x in lists))
    n = len(t.t_fp)
    m = stronghold.window_size(t)
    assert 1 <= m <= n
    assert m == n or (stronghold.p1_holds(t, m) and stronghold.p2_holds(t, m))
    assert not any(stronghold.p1_holds(t, s) and stronghold.p2_holds(t, s) for s in range(1, m))


def test_prefetch_m_hides_the_fetch_that_p1_promises():
    """Compute-bound (t_fp > t_c2g, so m = 1): with prefetch = m the forward never waits for a
    layer after the first; with prefetch = m - 1 it waits for every one. This is why the window
    of m layers needs m+1 parameter buffers (Eq. 1c), i.e. prefetch = m."""
    p = problem("gpt3-6b", "stronghold-v100-32g", None, 8)
    d = stronghold.plan(p)
    assert d.prefetch == 1

    def forward_stalls(prefetch):
        plan = schedule(p, dataclasses.replace(d, prefetch=prefetch))
        fwd = [i for i in plan.instructions if i.kind == "compute" and i.segment.startswith("fwd:")]
        first = [i.segment for i in fwd].index(f"fwd:{layers_of(p)[0]}")
        return sum(plan.sim.start[b.id] - plan.sim.end[a.id] for a, b in zip(fwd[first:], fwd[first + 1:]))

    assert forward_stalls(d.prefetch) == pytest.approx(0, abs=1e-9)
    assert forward_stalls(d.prefetch - 1) > 0.1


# ---- (4) interleaving pays ------------------------------------------------------------------

# gpt-tiny is not a case: DOS Eq. 1 assumes equal subgroups of 2-byte compute copies, and
# under autocast gpt-tiny's embeddings (fp32, read in fp32) are 40% of its parameters in one
# subgroup; at its 0.1 ms step the interleaving then loses 3% to all-CPU updates.
@pytest.mark.parametrize("model,hardware,gpu_mem", [
    ("dos-7b", "dos-jlse-4xh100", None),
    ("dos-13b", "dos-jlse-4xh100", None),
])
def test_dos_beats_the_same_plan_with_every_subgroup_on_the_cpu(model, hardware, gpu_mem):
    p = problem(model, hardware, gpu_mem)
    d = dos.plan(p)
    all_cpu = dataclasses.replace(d, blocks={
        b: dataclasses.replace(bd, states="dram", optimizer="cpu") for b, bd in d.blocks.items()})
    t_dos, t_cpu = schedule(p, d).sim.step_time_s, schedule(p, all_cpu).sim.step_time_s
    print(f"{model}: dos {t_dos:.4g} s, all subgroups on the CPU {t_cpu:.4g} s")
    assert t_dos <= t_cpu
