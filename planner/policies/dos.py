"""`dos`: Deep Optimizer States (Maurya et al., Middleware'24): interleaved CPU/GPU updates.

DOS §4 as tensorstow decisions:
- Optimizer subgroups = blocks (the planner's update granularity; DOS uses 100M-parameter
  subgroups and shows the subgroup size does not change k or the iteration time, Fig. 2).
- Optimizer states (fp32 master, m, v) live in DRAM. fp16 parameters stay resident on the GPU
  when they fit (DOS §5.3 precondition), else they are streamed from DRAM per use.
- Update stride k from DOS Eq. 1 (`update_stride`), used as the stride of Algorithm 1
  (§4.3, §5.4: "k = 2: every alternate subgroup on the GPU"), not as Eq. 1's CPU:GPU ratio
  (which would put 1/(k+1) on the GPU); docs/paper-equations.md §4.3 weighs the two readings.
  Counting subgroups in update (= backward) order from 0, subgroup i is updated on the GPU when
  (i+1) % k == 0: `lower()` moves its M/OS from DRAM to the GPU, updates, and writes them back
  (Algorithm 1's prefetch and flush); its gradient stays on the GPU (§4.1). The others are
  updated by the CPU from gradients sent to DRAM during backward.
- The update phase follows backward (DOS builds on ZeRO-3: gradients leave asynchronously
  during backward, the optimizer step runs after it, Fig. 5-6), so `overlap_optimizer` is
  False; CPU and GPU subgroups interleave within that phase, the H2D/D2H of GPU subgroups'
  states overlapping the CPU updates. (With True, `lower()` runs each GPU update inside
  backward, right after the block, where it stalls the compute stream on its state load.)
- Static GPU-resident subgroups (states and update on the GPU for good) are the *last* ones in
  update order (§4.1, Fig. 5: S^7, S^8), added one at a time while the plan still fits. They
  form the tail of the update order, so the stride positions of the others do not change.
- Activations [OURS, per the tensorstow design]: kept on the GPU when the plan fits, else each
  layer's input checkpoint goes to DRAM and the layer is recomputed (DOS §5.2 always uses
  activation checkpointing).
"""
from __future__ import annotations

import dataclasses
import math

from tensorstow.planner import cost
from tensorstow.planner.passes import schedule
from tensorstow.schema.schedule import BlockDecision, Decisions

DOWNCAST_BYTES_PER_PARAM = 6
"""CPU fp32 -> fp16 downcast traffic per parameter: read 4 B, write 2 B (DOS D_c is
memory-bound, so D_c = DRAM bandwidth / 6 B)."""


def stride_eq1(B: float, U_g: float, U_c: float, D_c: float) -> float:
    """DOS Eq. 1, all rates in parameters/s; math.inf when no k balances the two sides.

    B: H2D = D2H throughput of fp32 parameters; U_g / U_c: GPU / CPU update throughput;
    D_c: CPU fp32 -> fp16 downcast throughput."""
    # DOS Eq. 1:  k·(S/U_c + S/D_c) = 3S/B + k·S/(2B) + S/U_g
    #         =>  k = (3/B + 1/U_g) / (1/U_c + 1/D_c − 1/(2B))
    den = 1 / U_c + 1 / D_c - 1 / (2 * B)
    if den <= 0:  # the CPU's fp16 H2D stream alone saturates the link (digest §4.1 [OURS])
        return math.inf
    return (3 / B + 1 / U_g) / den


def stride_inputs(hw) -> dict[str, float]:
    """Eq. 1's inputs from a hardware spec, parameters/s (docs/hardware-presets.md, DOS Eq. 1).

    B: the slower host-link direction / 4 B (fp32); U_g: GPU memory bandwidth / the bytes one
    GPU Adam step moves per parameter (the cost model's GPU optimizer time); U_c: the whole CPU's
    Adam rate (the only reading that reproduces the paper's k = 2); D_c: DRAM bandwidth / 6 B."""
    g = hw.gpu
    return {"B": min(g.h2d_bw, g.d2h_bw) / 4, "U_g": g.mem_bw / cost.GPU_ADAM_BYTES_PER_PARAM,
            "U_c": hw.cpu.adam_rate, "D_c": hw.dram.bandwidth / DOWNCAST_BYTES_PER_PARAM}


def update_stride(hw) -> tuple[float, int | None]:
    """(k from Eq. 1, the stride used): rounded to nearest (the only rule matching both of the
    paper's k = 2 cases), at least 1; None when Eq. 1 has no solution (no dynamic GPU updates)."""
    k_float = stride_eq1(**stride_inputs(hw))
    if math.isinf(k_float):
        return k_float, None
    return k_float, max(1, math.floor(k_float + 0.5))


def decisions(problem, k: int | None, params: str, activations: str, resident: frozenset[str],
              notes: tuple[str, ...] = ()) -> Decisions:
    """Stride-k GPU updates among the non-resident subgroups; `resident` keep states on the GPU."""
    update_order = [b for b in reversed(problem.order) if _params(problem, b)]
    dynamic = [b for b in update_order if b not in resident]
    on_gpu = {b for i, b in enumerate(dynamic) if k is not None and (i + 1) % k == 0}  # DOS Alg. 1
    blocks = {}
    for b in problem.order:
        layer = problem.graph.block(b).kind == "layer"
        acts, ckpt = ("recompute", "dram") if activations == "recompute" and layer else ("keep", "gpu")
        if b in resident:
            states, opt = "gpu", "gpu"
        else:
            states, opt = "dram", "gpu" if b in on_gpu else "cpu"
        blocks[b] = BlockDecision(params=params, states=states, optimizer=opt,
                                  activations=acts, checkpoint=ckpt)
    return Decisions(policy="dos", blocks=blocks, prefetch=1, overlap_optimizer=False,
                     serialize_optimizer=False, notes=notes)


def plan(problem) -> Decisions:

    def fits(d: Decisions) -> bool:
        return not schedule(problem, d).over_capacity()

    k_float, k = update_stride(problem.hw)
    inputs = stride_inputs(problem.hw)
    eq1 = (f"DOS Eq. 1: B {inputs['B']:.4g}, U_g {inputs['U_g']:.4g}, U_c {inputs['U_c']:.4g}, "
           f"D_c {inputs['D_c']:.4g} P/s -> k = {k_float:.3g}; "
           + (f"stride {k}: subgroups {k - 1}, {2 * k - 1}, ... (0-based, update order) on the GPU "
              f"(Algorithm 1, §5.4)"
              if k else "no k balances Eq. 1: every dynamic subgroup on the CPU"))

    # Memory levels from most to least GPU memory: fp16 parameters resident, then activation
    # recomputation, then streamed parameters.
    levels = (("gpu", "keep"), ("gpu", "recompute"), ("dram", "recompute"))
    for params, acts in levels:
        d = decisions(problem, k, params, acts, frozenset())
        if fits(d):
            break
    else:  # nothing fits: the smallest-memory decisions, so make_plan reports the byte breakdown
        return dataclasses.replace(d, notes=(eq1, "does not fit GPU memory even with streamed "
                                                  "parameters and recomputed activations"))

    # DOS §4.1: static GPU-resident subgroups are the last ones in update order.
    resident: frozenset[str] = frozenset()
    for b in [b for b in problem.order if _params(problem, b)]:
        trial = decisions(problem, k, params, acts, resident | {b})
        if not fits(trial):
            break
        resident, d = resident | {b}, trial
    notes = (
        eq1,
        "optimizer subgroups = blocks; optimizer states in DRAM; update phase after backward, "
        "CPU and GPU subgroups interleaved (DOS §4.1, Fig. 5)",
        "compute-precision parameters resident on the GPU" if params == "gpu" else
        "compute-precision parameters streamed from DRAM (they do not fit next to the activations)",
        "activations kept on the GPU" if acts == "keep" else
        "layer inputs checkpointed to DRAM, layers recomputed in backward",
        f"{len(resident)} static GPU-resident subgroups (the last in update order, DOS §4.1)"
        + (f": {', '.join(b for b in problem.order if b in resident)}" if resident else ""))
    return dataclasses.replace(d, notes=notes)


def _params(problem, b: str) -> int:
    return problem.profiles[problem.profile_of[b]].param_count
