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

from tensorstow import TensorstowError
from tensorstow.planner.mobius import StageProblem, _solve_k, cross_mapping, sequential_mapping
from tensorstow.planner.schedule import BlockDecision, Decisions, Pipeline

MAX_CANDIDATES = 8
"""Partitions (best MIP objective first) lowered and simulated before giving up on fitting."""


def microbatches(problem) -> int:
    return problem.options.microbatches or len(problem.hw.gpus)


def stage_problem(problem, M: int) -> StageProblem:
    """Mobius Table 2's constants from the blocks' profiles (one microbatch: the traced batch)."""
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
        gpus=len(hw.gpus), microbatches=M, capacity=min(g.plan_bytes for g in hw.gpus), bandwidth=bw)


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


def _decisions(problem, kind, stages, gpus, M, mapping, block, notes, prefetch=1) -> Decisions:
    return Decisions(policy={"mobius": "mobius", "gpipe": "gpipe", "data-parallel": "zero3-dp"}[kind],
                     blocks={b: block for b in problem.order}, prefetch=prefetch,
                     overlap_optimizer=kind != "data-parallel", notes=tuple(notes),
                     pipeline=Pipeline(kind=kind, stages=tuple(stages), gpus=tuple(gpus), microbatches=M,
                                       mapping=mapping))


MOBIUS_BLOCK = BlockDecision(params="dram", states="dram", optimizer="cpu", activations="swap_dram",
                             checkpoint="dram")


def plan(problem) -> Decisions:
    from tensorstow.planner.plan import schedule
    if problem.options.mapping not in ("cross", "sequential"):
        raise TensorstowError(f"unknown --mapping '{problem.options.mapping}': use cross or sequential")
    if problem.options.precision == "fp16-mixed":
        raise TensorstowError("the mobius policy does not do fp16 loss scaling over microbatches yet: "
                              "use --precision bf16-mixed or fp32")
    hw, M = problem.hw, microbatches(problem)
    N = len(hw.gpus)
    sp = stage_problem(problem, M)
    rcs = tuple(g.root_complex for g in hw.gpus)
    tied = ties(problem)
    index = {b: i for i, b in enumerate(problem.order)}
    found, notes = [], []
    for K in range(1, sp.layers + 1):
        r = _solve_k(sp, K, time_limit_s=30.0)
        if not r.feasible:
            notes.append(f"K={K}: {r.message}")
            continue
        gpus = cross_mapping(K, rcs) if problem.options.mapping == "cross" else sequential_mapping(K, N)
        stage = [j for j, (lo, hi) in enumerate(r.stages) for _ in range(lo, hi)]
        split = [(a, b) for a, b in tied if gpus[stage[index[a]]] != gpus[stage[index[b]]]]
        if split:
            notes.append(f"K={K}: {split[0][0]} and {split[0][1]} share weights but land on different GPUs")
            continue
        found.append((r.time_s, K, r.stages, gpus))
        if len(found) >= MAX_CANDIDATES and K >= N + MAX_CANDIDATES:
            break
    if not found:
        raise TensorstowError(f"{problem.options.model}: no Mobius partition fits {N} GPU(s) of "
                              f"{min(g.plan_bytes for g in hw.gpus) / 1e9:.3g} GB ({'; '.join(notes[:3])}); "
                              f"use a smaller --batch, more --gpu-mem or another policy")
    last = None
    for t, K, stages, gpus in sorted(found)[:MAX_CANDIDATES]:
        why = [f"Mobius MIP (Eq. 3-11): {K} stages {[hi - lo for lo, hi in stages]} blocks, objective {t:.4g} s",
               f"{problem.options.mapping} mapping (Eq. 12-13): stage -> GPU {list(gpus)}",
               f"{M} microbatches; parameters and optimizer states in DRAM, activations swapped to DRAM, "
               f"CPU Adam per block once its gradient has every microbatch"]
        for prefetch in (1, 0):
            d = _decisions(problem, "mobius", stages, gpus, M, problem.options.mapping, MOBIUS_BLOCK,
                           why + ([] if prefetch else ["no prefetch: the next stage does not fit beside this one"]),
                           prefetch)
            last = d
            if schedule(problem, d).fits:
                return d
    return last  # does not fit: make_plan names the tier


def gpipe(problem) -> Decisions:
    """One stage per GPU, contiguous, balanced by forward + backward time (the classic linear
    partition, by dynamic programming); sequential mapping; everything resident."""
    hw, M = problem.hw, microbatches(problem)
    N = min(len(hw.gpus), len(problem.order))
    t = [problem.profiles[problem.profile_of[b]].fwd_time_s + problem.profiles[problem.profile_of[b]].bwd_time_s
         for b in problem.order]
    stages = balanced(t, N)
    block = BlockDecision(params="gpu", states="gpu", optimizer="gpu", activations="keep", checkpoint="gpu")
    return _decisions(problem, "gpipe", stages, range(N), M, "sequential", block,
                      [f"GPipe: {N} stages {[hi - lo for lo, hi in stages]} blocks balanced by compute time, "
                       f"every stage resident on its GPU, {M} microbatches"])


def zero3_dp(problem) -> Decisions:
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
