"""The GPU compute model a probe calibrates: matmuls and attention at the rates measured at their
sizes and precision (`GPU.matmul_rates`, `GPU.attention_rates`, their `_fp32` twins), the other
ops at `GPU.elementwise_bw`, every kernel at least the launch floor (`GPU.kernel_s`); specs
without them (the papers' presets) priced as before."""
import dataclasses
import math
import time

import pytest
import torch

from tensorstow import calibrate
from tensorstow.ir.graph import attention_flops
from tensorstow.planner import cost
from tensorstow.planner.presets import load_hardware
from tensorstow.planner.problem import build_problem
from tensorstow.schema.hardware import CPU_GPU_NAME, Hardware
from tensorstow.schema.options import Options


def _with(hw, **gpu):
    return dataclasses.replace(hw, gpus=(dataclasses.replace(hw.gpus[0], **gpu),))


def test_a_matmul_runs_at_the_rate_interpolated_at_its_size():
    """Log-log interpolation between the probed points, held at the ends; fp32 ops and ops that
    are not matmuls keep the peak."""
    hw = load_hardware("lohan-rtx4090")
    peak = hw.gpus[0].flops
    probed = _with(hw, matmul_rates=((1e9, peak / 8), (1e11, peak / 2)))
    t = lambda flops, **kw: cost.op_time(flops, 0, probed, **kw)  # noqa: E731
    assert t(1e9, kind="matmul") == pytest.approx(1e9 / (peak / 8))
    assert t(1e8, kind="matmul") == pytest.approx(1e8 / (peak / 8))  # held below the first point
    assert t(1e12, kind="matmul") == pytest.approx(1e12 / (peak / 2))  # held above the last
    # halfway in log FLOPs: the geometric mean of the two rates
    assert t(1e10, kind="matmul") == pytest.approx(1e10 / math.sqrt(peak / 8 * peak / 2))
    assert t(1e10) == pytest.approx(1e10 / peak)
    assert t(1e10, kind="matmul", fp32=True) == pytest.approx(1e10 / hw.gpus[0].flops_fp32)


def test_attention_uses_its_own_curve_keyed_by_the_forward():
    """A backward op looks the rate up at its forward's FLOPs (2.5x fewer, head dims equal); with
    no attention curve, attention runs at the matmul rates."""
    hw = load_hardware("lohan-rtx4090")
    peak = hw.gpus[0].flops
    q = (8, 12, 1024, 64)
    fwd, bwd = attention_flops(q, q, q), attention_flops(q, q, q, backward=True)
    assert bwd == 2.5 * fwd
    probed = _with(hw, matmul_rates=((1.0, peak / 2),), attention_rates=((fwd / 10, peak / 8), (fwd * 10, peak / 4)))
    rate = cost.measured_rate(probed.gpus[0], "attention", fwd)
    assert rate == pytest.approx(math.sqrt(peak / 8 * peak / 4))
    assert cost.op_time(bwd, 0, probed, kind="attention_bwd") == pytest.approx(bwd / rate)
    only_mm = _with(hw, matmul_rates=((1.0, peak / 2),))
    assert cost.op_time(fwd, 0, only_mm, kind="attention") == pytest.approx(fwd / (peak / 2))


def test_every_kernel_takes_at_least_the_launch_floor():
    hw = load_hardware("lohan-rtx4090")
    floored = _with(hw, kernel_s=5e-6)
    assert cost.op_time(0, 0, floored) == 0.0  # a view launches nothing
    assert cost.op_time(0, 1024, floored) == 5e-6
    assert cost.op_time(10 ** 13, 0, floored) == cost.op_time(10 ** 13, 0, hw) > 5e-6


@pytest.mark.parametrize("target, kind", [("aten.mm.default", "matmul"), ("aten.addmm.default", "matmul"),
                                          ("aten.bmm.default", "matmul"), ("aten.add.Tensor", ""),
                                          ("aten._scaled_dot_product_flash_attention_for_cpu.default", "attention"),
                                          ("aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
                                           "attention_bwd"),
                                          ("aten._scaled_dot_product_efficient_attention.default", "attention")])
def test_op_kind_by_aten_name(target, kind):
    assert cost.op_kind(target) == kind


def test_a_block_is_priced_at_the_probed_rates():
    """A GPT block's forward time on a spec with curves: each op's roofline computed here from the
    IR (matmuls at the matmul rate, the attention at its own, the rest at memory bandwidth, all
    floored) equals the profile's."""
    hw = load_hardware("lohan-rtx4090")
    g = hw.gpus[0]
    probed = _with(hw, matmul_rates=((1.0, g.flops / 5),), attention_rates=((1.0, g.flops / 9),), kernel_s=3e-6)
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", batch=2, seq=32, precision="bf16-mixed")
    p, base = build_problem(o, probed), build_problem(o, hw)
    b = "b1"
    ops = [op for op in p.graph.ops if op.block == b and op.phase == "fwd"]
    mm = [op for op in ops if op.target.startswith(("aten.mm", "aten.addmm"))]
    attn = [op for op in ops if "attention" in op.target]
    assert mm and attn
    expect = 0.0
    for op in ops:
        rate = g.flops / 5 if op in mm else g.flops / 9 if op in attn else g.flops
        mem = (op.bytes_in + op.bytes_out) / g.mem_bw
        t = max(op.flops / rate, mem)
        expect += max(t, 3e-6) if op.flops or op.bytes_in + op.bytes_out else t
    assert p.profiles[b].fwd_time_s == pytest.approx(expect, rel=1e-9)
    assert p.profiles[b].fwd_time_s > base.profiles[b].fwd_time_s


def test_the_curves_travel_in_the_spec_and_stay_out_when_empty():
    hw = load_hardware("lohan-rtx4090")
    j = hw.to_json()["gpus"][0]
    assert not {"matmul_rates", "attention_rates", "kernel_s"} & set(j)
    probed = _with(hw, matmul_rates=((1e9, 1e14), (1e12, 3e14)), matmul_rates_unaligned=((1e12, 1.2e14),),
                   attention_rates=((1e9, 5e13),), kernel_s=4e-6)
    assert Hardware.from_json(probed.to_json()) == probed
    assert "matmul_rates_unaligned" not in _with(hw, matmul_rates=((1e9, 1e14),)).to_json()["gpus"][0]


def _wall(fn) -> float:
    fn()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def test_the_probe_sweeps_give_ascending_positive_curves():
    """The probe's sweeps (run on the CPU at tiny shapes with a wall-clock timer; on CUDA they
    time `GPU_LINEAR_SHAPES` and `GPU_ATTENTION_SHAPES` with CUDA events): one point per
    distinct FLOP count, shapes of equal FLOPs pooled."""
    shapes = [(64, 32, 32), (64, 32, 128), (64, 128, 32), (128, 64, 256), (64, 32, 127)]
    linear = calibrate._linear_rates("cpu", torch.float32, shapes, _wall)
    assert [f for f, _ in linear] == sorted({2.0 * m * k * n for m, k, n in shapes})
    assert all(r > 0 for _, r in linear)
    attn = calibrate._attention_rates("cpu", torch.float32, [(1, 2, 64, 16), (2, 2, 128, 32)], _wall)
    assert [f for f, _ in attn] == [attention_flops(s, s, s) for s in [(1, 2, 64, 16), (2, 2, 128, 32)]]
    assert all(r > 0 for _, r in attn)
    assert 0 < calibrate._kernel_floor("cpu", _wall) < 1e-2


def test_pooled_points_average_their_times():
    """Two shapes of equal FLOPs make one point at their FLOPs over their mean time."""
    assert calibrate._curve([(100, 1.0), (100, 3.0), (10, 1.0)]) == ((10.0, 10.0), (100.0, 50.0))


def test_a_matmul_with_a_dimension_off_the_tensor_core_grain_runs_at_the_unaligned_rates():
    """The LM head of a 50257-token vocabulary (forward and both backward matmuls) is priced at
    `matmul_rates_unaligned`; the blocks' matmuls, whose dimensions are multiples of 8, at
    `matmul_rates`; a spec without the unaligned curve prices both at the aligned one."""
    hw = load_hardware("lohan-rtx4090")
    g = hw.gpus[0]
    aligned, slow = g.flops / 2, g.flops / 12
    probed = _with(hw, matmul_rates=((1.0, aligned),), matmul_rates_unaligned=((1.0, slow),))
    o = Options(model="gpt3-125m", hardware="lohan-rtx4090", batch=1, seq=32, precision="bf16-mixed")  # vocab 50257
    p = build_problem(o, probed)
    tensors = {t.name: t for t in p.graph.tensors}
    mms = [op for op in p.graph.ops if cost.op_kind(op.target) == "matmul"]
    head = [op for op in mms if op.block == "post"]
    blocks = [op for op in mms if op.block.startswith("b")]
    assert len(head) >= 3 and blocks
    assert {cost.matmul_kind(op, tensors) for op in head} == {"matmul_unaligned"}
    assert {cost.matmul_kind(op, tensors) for op in blocks} == {"matmul"}
    op = head[0]
    assert cost.op_time(op.flops, 0, probed, kind="matmul_unaligned") == pytest.approx(op.flops / slow)
    assert cost.op_time(op.flops, 0, _with(hw, matmul_rates=((1.0, aligned),)), kind="matmul_unaligned") == \
        pytest.approx(op.flops / aligned)
    # the post block's compute prices its head at the slow curve: slower than with one curve
    one_curve = build_problem(o, _with(hw, matmul_rates=((1.0, aligned),)))
    assert p.profiles["post"].fwd_time_s > one_curve.profiles["post"].fwd_time_s
    assert p.profiles["b0"].fwd_time_s == pytest.approx(one_curve.profiles["b0"].fwd_time_s, rel=1e-12)


def test_fp32_ops_take_the_fp32_curves_and_never_the_16_bit_ones():
    """An fp32 matmul or attention runs at `matmul_rates_fp32` / `attention_rates_fp32` where the
    spec has them, else at `flops_fp32`; a 16-bit curve never prices an fp32 op (a CPU without
    native bf16 runs the two precisions 20x apart). Guards the CPU device tier, whose block-wide
    fp32 rate from a d-512 block priced gpt3-2.7b's compute 1.16x too slow."""
    hw = load_hardware("lohan-rtx4090")
    g = hw.gpus[0]
    sixteen = _with(hw, matmul_rates=((1.0, g.flops / 3),), attention_rates=((1.0, g.flops / 5),))
    assert cost.op_time(1e10, 0, sixteen, fp32=True, kind="matmul") == pytest.approx(1e10 / g.flops_fp32)
    assert cost.op_time(1e10, 0, sixteen, fp32=True, kind="attention") == pytest.approx(1e10 / g.flops_fp32)
    both = _with(sixteen, matmul_rates_fp32=((1e9, g.flops_fp32 / 4), (1e11, g.flops_fp32 / 2)),
                 attention_rates_fp32=((1.0, g.flops_fp32 / 7),))
    t = lambda flops, **kw: cost.op_time(flops, 0, both, **kw)  # noqa: E731
    assert t(1e9, fp32=True, kind="matmul") == pytest.approx(1e9 / (g.flops_fp32 / 4))
    assert t(1e11, fp32=True, kind="matmul_unaligned") == pytest.approx(1e11 / (g.flops_fp32 / 2))
    assert t(1e10, fp32=True, kind="attention") == pytest.approx(1e10 / (g.flops_fp32 / 7))
    assert t(1e10, fp32=True) == pytest.approx(1e10 / g.flops_fp32)  # not a matmul: the peak
    assert t(1e10, kind="matmul") == pytest.approx(1e10 / (g.flops / 3))  # 16-bit: its own curve


def test_an_fp32_matmul_on_few_tokens_takes_its_row_factor_of_the_rate():
    """`GPU.matmul_row_factors` (the CPU device tier): an fp32 matmul whose output has few rows or
    columns runs at the factor interpolated at them (log-log, held at the ends), one with as many
    as the last point at the full rate; 16-bit matmuls and the other ops never take it. In a traced
    fp32 GPT of 48 tokens, a forward's and an input gradient's output has 48 rows and a weight
    gradient's the weight's (64 and up), so the forward prices slower and the weight gradient as
    before.
    Guards the 3B QLoRA step at 128 tokens, whose matmuls ran 1.03-1.18x the 512-token curve."""
    hw = load_hardware("lohan-rtx4090")
    g = hw.gpus[0]
    curve = _with(hw, matmul_rates_fp32=((1.0, g.flops_fp32 / 2),), matmul_rates=((1.0, g.flops / 2),))
    rows = _with(curve, matmul_row_factors=((32.0, 0.5), (128.0, 0.8), (512.0, 1.0)))
    t = lambda spec, **kw: cost.op_time(1e10, 0, spec, **kw)  # noqa: E731
    full = t(curve, fp32=True, kind="matmul")
    assert t(rows, fp32=True, kind="matmul", matmul_rows=128) == pytest.approx(full / 0.8)
    assert t(rows, fp32=True, kind="matmul", matmul_rows=64) == pytest.approx(full / math.sqrt(0.5 * 0.8))
    assert t(rows, fp32=True, kind="matmul", matmul_rows=8) == pytest.approx(full / 0.5)
    assert t(rows, fp32=True, kind="matmul", matmul_rows=4096) == pytest.approx(full)
    assert t(rows, kind="matmul", matmul_rows=128) == pytest.approx(t(curve, kind="matmul"))  # 16-bit
    assert t(rows, fp32=True, kind="attention", matmul_rows=128) == t(curve, fp32=True, kind="attention")
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", batch=1, seq=48, precision="fp32")
    graph = build_problem(o, curve).graph
    tensors = {t.name: t for t in graph.tensors}
    mms = [op for op in graph.ops if op.block.startswith("b") and cost.op_kind(op.target) == "matmul"
           and len(tensors[op.outputs[0]].shape) == 2]
    fwd = [op for op in mms if op.phase == "fwd"]
    wgrad = [op for op in mms if op.phase == "bwd" and cost.matmul_rows(op, tensors) > 48]
    assert fwd and wgrad and {cost.matmul_rows(op, tensors) for op in fwd} == {48.0}
    slow = _with(hw, matmul_rates_fp32=((1.0, 1e9),))  # a CPU's rate: its FLOPs, not its bytes, decide
    tiny_rows = _with(slow, matmul_row_factors=((16.0, 0.5), (48.0, 0.8), (64.0, 1.0)))  # gpt-tiny: d 64
    assert cost.ir_op_time(fwd[0], tensors, tiny_rows) == pytest.approx(fwd[0].flops / 0.8e9)
    assert cost.ir_op_time(fwd[0], tensors, slow) == pytest.approx(fwd[0].flops / 1e9)
    assert cost.ir_op_time(wgrad[0], tensors, tiny_rows) == cost.ir_op_time(wgrad[0], tensors, slow)


def test_ops_without_flops_move_their_bytes_at_the_elementwise_bandwidth():
    """The ops between the matmuls (GELU, norms, softmax, adds) at `elementwise_bw` where the
    spec has one; a matmul's bytes, and every op of a spec without it, at `mem_bw`."""
    hw = load_hardware("lohan-rtx4090")
    g = hw.gpus[0]
    slow = _with(hw, elementwise_bw=g.mem_bw / 5)
    assert cost.op_time(0, 10**6, slow) == pytest.approx(10**6 / (g.mem_bw / 5))
    assert cost.op_time(0, 10**6, hw) == pytest.approx(10**6 / g.mem_bw)
    assert cost.op_time(1, 10**9, slow, kind="matmul") == pytest.approx(10**9 / g.mem_bw)


def test_the_op_timer_counts_what_moves_between_the_matmuls():
    """The CPU tier's `elementwise_bw` times ops as they dispatch: an add's inputs and output
    count, a view (moves nothing) and a matmul (priced by its curve) do not."""
    a = torch.randn(2**20)
    w = torch.randn(64, 64)
    with calibrate._op_timer() as t:
        a + a
        a.view(2, -1)
        w @ w
    assert t.bytes == 3 * 4 * 2**20
    assert t.seconds > 0


def test_the_probe_times_the_bytes_the_cost_model_prices():
    """Over one step of the probe's joint graph the timed ops move the bytes the IR gives its ops
    without FLOPs (within the few ops they classify apart), so the cost model, dividing the IR's
    bytes by `elementwise_bw`, prices those ops at the time they took."""
    from tensorstow.ir.models import GPT, GPTConfig
    from tensorstow.ir.trace import trace
    config = GPTConfig(n_layer=1, n_head=4, n_embd=64, vocab_size=64, block_size=32)
    step = calibrate._joint_step(config, 2, 32)
    step()
    with calibrate._op_timer() as t:
        step()
    torch.manual_seed(0)
    graph = trace(GPT(config), batch=2, seq=32, precision="fp32", model_name="probe").graph
    priced = sum(o.bytes_in + o.bytes_out for o in graph.ops if o.phase in ("fwd", "bwd") and not o.flops)
    assert t.bytes == pytest.approx(priced, rel=0.05)


def test_cpu_devices_that_share_the_machine_split_every_rate():
    """`--gpus 2` on a CPU spec: two processes share the cores the probe measured, so each gets
    half of every rate, its curves and elementwise bandwidth included."""
    hw = _with(load_hardware("lohan-rtx4090"), name=CPU_GPU_NAME, matmul_rates_fp32=((1.0, 8e10),),
               attention_rates=((1.0, 4e10),), elementwise_bw=4e9)
    g = hw.gpus[0]
    for half in hw.with_overrides(gpus=2).gpus:
        assert half.matmul_rates_fp32 == ((1.0, 4e10),) and half.attention_rates == ((1.0, 2e10),)
        assert half.elementwise_bw == 2e9 and half.flops == g.flops / 2 and half.mem_bw == g.mem_bw / 2
