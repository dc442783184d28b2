"""`mobius` and its baselines on several GPUs: pipelines over heterogeneous memory (Mobius, ASPLOS'23).

- `mobius`: every block's parameters and optimizer state live in DRAM; the stages (runs of
  consecutive blocks) and their number come from the Mobius MIP (planner.mobius.partition, Eq.
  3-11) over the blocks' profiles, the stage -> GPU map from the root complexes (cross mapping,
  Eq. 12-13; `--mapping sequential` for the paper's baseline), and planner.pipeline lowers it:
  each stage is swapped in ahead of use, prefetched while the previous stage on its GPU runs
  (§3.1), activations go to DRAM between forward and backward, the CPU updates each block once
  its gradient has every microbatch.
- `gpipe`: GPipe (Mobius Fig. 3), the all-in-GPU-memory pipeline: one stage per GPU balanced by
  compute time, everything resident; plans only when the model fits the GPUs.
- `zero3-dp`: DeepSpeed ZeRO-3 with CPU offload, the paper's comparison: data parallel, every GPU
  streams every block's parameters (planner.pipeline._lower_data_parallel).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

from tensorstow.errors import TensorstowError
from tensorstow.planner import cost
from tensorstow.planner.partition import StageProblem, cross_mappings, sequential_mapping, solve_stages
from tensorstow.planner.passes import schedule
from tensorstow.schema.schedule import BlockDecision, Decisions, Pipeline, SEARCH_NOTE

MAX_CANDIDATES = 8
"""Partitions (best MIP objective first) lowered and simulated before giving up on fitting."""
MIP_GAP = 0.01
"""Each MIP stops within 1% of its optimum: deterministic, unlike a time limit, which is only a
safety net (MIP_TIME_LIMIT_S) so that a plan is the same on a slow machine."""
MIP_TIME_LIMIT_S = 120.0


def microbatches(problem) -> int:
    return problem.options.microbatches or len(problem.hw.gpus)


def stage_problem(problem, M: int) -> StageProblem:
    """Mobius Table 2's constants from the blocks' profiles (one microbatch: the traced batch), and
    each block's CPU update (the [OURS] term of planner.mobius: the updates bound these plans)."""
    profs = [problem.profiles[problem.profile_of[b]] for b in problem.order]
    act = [p.saved_bytes + p.input_bytes for p in profs]
    mixed_acc = problem.mixed and M > 1  # gradients accumulate in fp32 (planner.pipeline)
    grads = [p.grad_fp32_bytes if mixed_acc else p.grad_bytes for p in profs]
    hw = problem.hw
    bw = min(g.h2d_bw for g in hw.gpus)
    if hw.root_complex_bw:
        bw = min(bw, hw.root_complex_bw)
    return StageProblem(
        t_f=tuple(p.fwd_time_s for p in profs),
        t_b=tuple(p.bwd_time_s if p.bwd_ops[0] >= 0 else 0.0 for p in profs),
        s_f=tuple(p.param_bytes + p.const_bytes + p.fwd_workspace + a for p, a in zip(profs, act)),
        s_b=tuple(p.param_bytes + p.const_bytes + g + p.bwd_workspace + a + p.handed_bytes
                  + (p.grad_bytes if M > 1 else 0)  # a later microbatch's gradient before it is added in
                  for p, a, g in zip(profs, act, grads)),
        a=tuple(profs[i + 1].input_bytes if i + 1 < len(profs) else 0 for i in range(len(profs))),
        g=tuple(p.handed_bytes for p in profs),
        gpus=len(hw.gpus), microbatches=M, capacity=min(g.plan_bytes for g in hw.gpus), bandwidth=bw,
        u=tuple(cost.update_time(p, "cpu", problem) for p in profs))


def ties(problem) -> list[tuple[str, str]]:
    """Block pairs that must share a GPU: a block that reads another's parameters (tied weights)
    and a block whose backward carries a partial gradient to another's."""
    out = []
    for b in problem.order:
        p = problem.profiles[problem.profile_of[b]]
        out += [(b, o) for o in p.reads]
        if p.carried_bytes:
            out += [(b, o) for o in problem.order if problem.profile_of[o] == p.carried_until]
    return out


@functools.lru_cache(maxsize=256)
def solve_k(sp: StageProblem, K: int):
    """One stage count's MIP, cached: the topology and the mapping do not enter it, so the plans of
    one model on several topologies (or both mappings) share their solves."""
    return solve_stages(sp, K, time_limit_s=MIP_TIME_LIMIT_S, gap=MIP_GAP)


def _decisions(problem, kind, stages, gpus, M, mapping, block, notes, prefetch=1) -> Decisions:
    return Decisions(policy={"mobius": "mobius", "gpipe": "gpipe", "data-parallel": "zero3-dp"}[kind],
                     blocks={b: block for b in problem.order}, prefetch=prefetch,
                     overlap_optimizer=kind != "data-parallel", notes=tuple(notes),
                     pipeline=Pipeline(kind=kind, stages=tuple(stages), gpus=tuple(gpus), microbatches=M,
                                       mapping=mapping))


MOBIUS_BLOCK = BlockDecision(params="dram", states="dram", optimizer="cpu", activations="swap_dram",
                             checkpoint="dram")
MOBIUS_RECOMPUTE = dataclasses.replace(MOBIUS_BLOCK, activations="recompute")
"""Mobius §3.1: with checkpointing and recomputation the activation traffic is negligible; the
policy takes whichever of swapping and recomputing simulates faster."""


def plan(problem) -> Decisions:
    if problem.options.mapping not in ("cross", "sequential"):
        raise TensorstowError(f"unknown --mapping '{problem.options.mapping}': use cross or sequential")
    if problem.options.precision == "fp16-mixed":
        raise TensorstowError("the mobius policy does not do fp16 loss scaling over microbatches yet: "
                              "use --precision bf16-mixed or fp32")
    _no_clipping(problem, "mobius")
    hw, M = problem.hw, microbatches(problem)
    N = len(hw.gpus)
    sp = stage_problem(problem, M)
    rcs = tuple(g.root_complex for g in hw.gpus)
    tied = ties(problem)
    index = {b: i for i, b in enumerate(problem.order)}
    found, notes = [], []
    stale = 0  # stage counts since the objective last improved by more than 1%
    # Stage counts from the fewest whose stages can fit (total bytes / GPU memory) upwards; from the
    # first that fits, up to two per GPU (Mobius Fig. 4) or N more; the search stops early once two
    # more stages in a row improve the objective by less than 1%.
    fewest = max(1, math.ceil(max(sum(sp.s_f), sum(sp.s_b)) / sp.capacity))
    first = None
    for K in range(min(fewest, sp.layers), sp.layers + 1):
        if first is not None and K > max(2 * N, first + N):
            break
        r = solve_k(sp, K)
        if not r.feasible:
            notes.append(f"{SEARCH_NOTE}K={K}: {r.message}")
            continue
        maps = cross_mappings(K, rcs) if problem.options.mapping == "cross" else [sequential_mapping(K, N)]
        stage = [j for j, (lo, hi) in enumerate(r.stages) for _ in range(lo, hi)]
        ok = [g for g in maps if all(g[stage[index[a]]] == g[stage[index[b]]] for a, b in tied)]
        if not ok:  # the count range starts at the first K that gives a plan, ties included
            a, b = next((a, b) for a, b in tied if maps[0][stage[index[a]]] != maps[0][stage[index[b]]])
            notes.append(f"{SEARCH_NOTE}K={K}: {a} and {b} share weights but land on different GPUs")
            continue
        first = K if first is None else first
        best = min((t for t, *_ in found), default=None)
        stale = 0 if best is None or r.time_s < best * 0.99 else stale + 1
        found.append((r.time_s, K, r.stages, tuple(ok)))
        if stale >= 2 and found:
            break
    if not found:
        raise TensorstowError(f"{problem.options.model}: no Mobius partition fits {N} GPU(s) of "
                              f"{min(g.plan_bytes for g in hw.gpus) / 1e9:.3g} GB ({'; '.join(notes[:3])}); "
                              f"use a smaller --batch, more --gpu-mem or another policy")
    last = swapped = None
    for t, K, stages, maps in sorted(found)[:MAX_CANDIDATES]:
        for prefetch in (1, 0):
            fit = []
            for gpus, block in itertools.product(maps, (MOBIUS_BLOCK, MOBIUS_RECOMPUTE)):  # by simulated time
                why = [f"Mobius MIP (Eq. 3-11, with the CPU updates): {K} stages {[hi - lo for lo, hi in stages]} "
                       f"blocks, objective {t:.4g} s",
                       f"{problem.options.mapping} mapping (Eq. 12-13): stage -> GPU {list(gpus)}"
                       + (f" (the fastest of {len(maps)} mappings the equation ties)" if len(maps) > 1 else ""),
                       f"{M} microbatches; parameters and optimizer states in DRAM, activations "
                       + ("swapped to DRAM" if block is MOBIUS_BLOCK else "recomputed from DRAM checkpoints")
                       + " (the faster), CPU Adam per block once its gradient has every microbatch"]
                d = _decisions(problem, "mobius", stages, gpus, M, problem.options.mapping, block,
                               why + ([] if prefetch else ["no prefetch: the next stage does not fit beside this one"]),
                               prefetch)
                last = d
                r = schedule(problem, d)
                if r.fits:
                    fit.append((r.sim.step_time_s, gpus, block is MOBIUS_RECOMPUTE, d))
            if fit:
                swapped_s, *_, swapped = min(fit, key=lambda f: f[:3])
                break
        if swapped:
            break
    # Where every stage fits its GPU with its optimizer state, there is nothing to swap: one resident
    # stage per GPU (Mobius with S = N and the DRAM tier unused) wins whenever it is faster.
    resident = dataclasses.replace(gpipe(problem, strict=False), policy="mobius")
    r = schedule(problem, resident) if not _split(problem, resident.pipeline) else None
    if r is not None and r.fits and (swapped is None or r.sim.step_time_s < swapped_s):
        return dataclasses.replace(resident, notes=(
            *resident.notes, "every stage fits its GPU with its optimizer state: nothing is swapped, faster than "
            f"the swapped pipeline ({'does not fit' if swapped is None else 'simulated'})"))
    return swapped or last  # does not fit: make_plan names the tier


def _split(problem, pl) -> list[tuple[str, str]]:
    """The tied block pairs (`ties`) a pipeline puts on different GPUs."""
    gpu = {problem.order[i]: pl.gpus[j] for j, (lo, hi) in enumerate(pl.stages) for i in range(lo, hi)}
    return [(a, b) for a, b in ties(problem) if gpu[a] != gpu[b]]


def _no_clipping(problem, policy: str) -> None:
    if problem.options.max_grad_norm > 0:
        raise TensorstowError(f"the {policy} policy does not clip gradients over microbatches and GPUs yet: "
                              f"leave --max-grad-norm out, or plan one GPU with another policy")


def gpipe(problem, strict: bool = True) -> Decisions:
    """One stage per GPU, contiguous, balanced by forward + backward time (the classic linear
    partition, by dynamic programming); sequential mapping; everything resident. `strict`: refuse
    what the executor cannot run (fp16 loss scaling over microbatches, tied weights on two GPUs)."""
    if strict and problem.options.precision == "fp16-mixed":
        raise TensorstowError("the gpipe policy does not do fp16 loss scaling over microbatches: "
                              "use --precision bf16-mixed or fp32")
    if strict:
        _no_clipping(problem, "gpipe")
    hw, M = problem.hw, microbatches(problem)
    N = min(len(hw.gpus), len(problem.order))
    t = [problem.profiles[problem.profile_of[b]].fwd_time_s + problem.profiles[problem.profile_of[b]].bwd_time_s
         for b in problem.order]
    stages = balanced(t, N)
    block = BlockDecision(params="gpu", states="gpu", optimizer="gpu", activations="keep", checkpoint="gpu")
    d = _decisions(problem, "gpipe", stages, range(N), M, "sequential", block,
                   [f"GPipe: {N} stages {[hi - lo for lo, hi in stages]} blocks balanced by compute time, "
                    f"every stage resident on its GPU, {M} microbatches"])
    split = _split(problem, d.pipeline)
    if strict and split:
        raise TensorstowError(f"{problem.options.model}: GPipe's one stage per GPU puts {split[0][0]} and "
                              f"{split[0][1]}, which share weights, on different GPUs; use --policy mobius "
                              f"(it keeps them on one GPU)")
    return d


def zero3_dp(problem) -> Decisions:
    _no_clipping(problem, "zero3-dp")
    N = len(problem.hw.gpus)
    layer = {b: problem.graph.block(b).kind == "layer" for b in problem.order}
    blocks = {b: BlockDecision(params="dram", states="dram", optimizer="cpu",
                               activations="recompute" if layer[b] else "keep",
                               checkpoint="dram" if layer[b] else "gpu") for b in problem.order}
    return Decisions(policy="zero3-dp", blocks=blocks, prefetch=1, overlap_optimizer=False,
                     notes=(f"DeepSpeed ZeRO-3 + CPU offload: data parallel over {N} GPUs, one microbatch each; "
                            "every GPU streams every block's parameters from DRAM (no P2P: the all-gather "
                            "crosses the host links), recomputes from DRAM checkpoints, sends its gradients to "
                            "DRAM; the CPU sums them and updates",),
                     pipeline=Pipeline(kind="data-parallel", stages=((0, len(problem.order)),), gpus=tuple(range(N)),
                                       microbatches=N, mapping="sequential"))


def balanced(t: list[float], n: int) -> list[tuple[int, int]]:
    """Split `t` into n contiguous non-empty runs minimising the largest run's sum."""
    L = len(t)
    pre = [0.0]
    for x in t:
        pre.append(pre[-1] + x)
    best = {(0, 0): (0.0, None)}
    for k in range(1, n + 1):
        for i in range(k, L - (n - k) + 1):
            best[(k, i)] = min((max(best[(k - 1, h)][0], pre[i] - pre[h]), h) for h in range(k - 1, i)
                               if (k - 1, h) in best)
    cuts, i = [], L
    for k in range(n, 0, -1):
        h = best[(k, i)][1]
        cuts.append((h, i))
        i = h
    return cuts[::-1]
