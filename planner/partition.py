"""Mobius (Feng et al., ASPLOS'23): pipeline stages over heterogeneous memory, the solvers.

Stages are runs of consecutive layers whose parameters live in DRAM and are copied to a GPU
before they run; stage j shares GPU ((j-1) mod N) with stages j±N, so while stage j-N runs, stage
j's copy is prefetched into the memory j-N leaves free (Mobius §3.1). This module holds the two
decisions of Mobius §3.2-3.3 as pure functions of per-layer numbers (docs/paper-equations.md §5):

- `partition`: the number of stages and their layers, by the paper's mixed-integer program
  (Eq. 3-11, PuLP + HiGHS), one MIP per stage count K (an outer loop instead of "empty stages",
  which the paper leaves undefined under the j±N relation);
- `makespan`: the same timing model evaluated for one given partition by earliest start times
  (the yardstick the MIP is checked against);
- `cross_mapping`: stage -> GPU from the root-complex topology (Eq. 12-13, exhaustive).

Readings of the garbled equations (paper-equations.md §5.2): precedence constraints are >=, the
objective is the end of the first stage's backward on the last microbatch, Eq. 9 holds for j > N
(forward) and j + N <= K (backward), Eq. 11 starts the last stage's backward after its forward.
The first N stages are loaded before they start (nothing runs before them to hide the copy).
"""
from __future__ import annotations

import dataclasses
import itertools

import pulp

from tensorstow.ir.graph import lsum
from tensorstow.planner import highs
from tensorstow.schema.schedule import SEARCH_NOTE


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageProblem:
    """Mobius Table 2's constants; per layer i (in model order) and pass e in (f, b)."""
    t_f: tuple[float, ...]
    """Seconds of layer i's forward on one microbatch."""
    t_b: tuple[float, ...]
    """Seconds of layer i's backward on one microbatch."""
    s_f: tuple[float, ...]
    """GPU bytes layer i needs in the forward (parameters, saved activations of all microbatches)."""
    s_b: tuple[float, ...]
    """GPU bytes layer i needs in the backward (parameters, gradients, activations)."""
    a: tuple[float, ...]
    """Bytes of layer i's output activation for one microbatch (sent to the next stage)."""
    g: tuple[float, ...]
    """Bytes of the activation gradient layer i hands back to the previous layer, one microbatch."""
    gpus: int
    """N."""
    microbatches: int
    """M."""
    capacity: float
    """G: GPU memory per GPU, bytes."""
    bandwidth: float
    """B: GPU <-> DRAM (and stage-to-stage) bandwidth, bytes/s."""
    u: tuple[float, ...] = ()
    """[OURS] Seconds of layer i's CPU optimizer update (empty: the paper's model, which leaves the
    update out). With it, a stage's update starts once its backward has every microbatch and the
    CPU has updated the stages after it (one CPU, stages in backward order), and the objective is
    the end of the last update: the partition sees the optimizer that bounds offloaded training."""

    @property
    def layers(self) -> int:
        return len(self.t_f)


@dataclasses.dataclass(frozen=True)
class Partition:
    stages: tuple[tuple[int, int], ...]
    """Per stage, its layers [first, last) in model order."""
    time_s: float
    """The objective: end of the first stage's backward on the last microbatch."""
    feasible: bool = True
    message: str = ""


def _stage_sums(sp: StageProblem, stages) -> dict[str, list[float]]:
    return {k: [lsum(getattr(sp, k)[lo:hi]) for lo, hi in stages] for k in ("t_f", "t_b", "s_f", "s_b")}


def makespan(sp: StageProblem, stages: tuple[tuple[int, int], ...]) -> float | None:
    """Eq. 4-11 for a fixed partition: every start time as early as its constraints allow, every
    prefetch as large as Eq. 5-6 allow; None when a stage does not fit its GPU (Eq. 4)."""
    K, N, M, B, G = len(stages), sp.gpus, sp.microbatches, sp.bandwidth, sp.capacity
    c = _stage_sums(sp, stages)
    if max(c["s_f"] + c["s_b"]) > G:
        return None
    a = [sp.a[hi - 1] for _, hi in stages]          # a_j: the stage's last layer's output
    g = [sp.g[lo] for lo, _ in stages]              # g_j: the gradient its first layer hands back
    tf = [[0.0] * M for _ in range(K)]
    for j in range(K):
        if j >= N:  # Eq. 5, 6, 9: what was not prefetched while stage j-N ran is loaded after it
            d = c["t_f"][j - N] + tf[j - N][M - 1] - tf[j - N][0]                    # Eq. 7
            pre = max(0.0, min(G - c["s_f"][j - N], B * d, c["s_f"][j]))
            ready = tf[j - N][M - 1] + c["t_f"][j - N] + (c["s_f"][j] - pre) / B
        else:
            ready = c["s_f"][j] / B
        for m in range(M):
            t = ready
            if m:
                t = max(t, tf[j][m - 1] + c["t_f"][j])                                  # Eq. 10
            if j:
                t = max(t, tf[j - 1][m] + c["t_f"][j - 1] + a[j - 1] / B)            # Eq. 8
            tf[j][m] = t
    tb = [[0.0] * M for _ in range(K)]
    for j in reversed(range(K)):
        ready = tf[K - 1][M - 1] + c["t_f"][K - 1] if j == K - 1 else 0.0            # Eq. 11
        if j + N < K:
            d = c["t_b"][j + N] + tb[j + N][M - 1] - tb[j + N][0]
            pre = max(0.0, min(G - c["s_b"][j + N], B * d, c["s_b"][j]))
            ready = max(ready, tb[j + N][M - 1] + c["t_b"][j + N] + (c["s_b"][j] - pre) / B)
        for m in range(M):
            t = ready
            if m:
                t = max(t, tb[j][m - 1] + c["t_b"][j])
            if j < K - 1:
                t = max(t, tb[j + 1][m] + c["t_b"][j + 1] + g[j + 1] / B)
            tb[j][m] = t
    done = tb[0][M - 1] + c["t_b"][0]                                                   # Eq. 3
    if sp.u:
        upd, done = [lsum(sp.u[lo:hi]) for lo, hi in stages], 0.0
        for j in reversed(range(K)):  # [OURS] the CPU updates stage by stage in backward order
            done = max(done, tb[j][M - 1] + c["t_b"][j]) + upd[j]
    return done


def partition(sp: StageProblem, *, max_stages: int | None = None, time_limit_s: float = 30.0) -> Partition:
    """The Mobius MIP (Eq. 3-11), one per stage count K in [1, max_stages]; the best K wins."""
    L = sp.layers
    best: Partition | None = None
    notes = []
    for K in range(1, min(L, max_stages or L) + 1):
        r = solve_stages(sp, K, time_limit_s)
        notes.append(f"{SEARCH_NOTE}K={K}: {r.message}")
        if r.feasible and (best is None or r.time_s < best.time_s - 1e-12):
            best = r
    if best is None:
        return Partition((), 0.0, False, "no partition fits: " + "; ".join(notes))
    return dataclasses.replace(best, message="; ".join(notes))


def solve_stages(sp: StageProblem, K: int, time_limit_s: float, gap: float = 0.0, max_nodes: int = 0) -> Partition:
    """The MIP for exactly K stages; `gap`: stop within this relative gap of the optimum (0: exact);
    `max_nodes`: a branch-and-bound node limit (deterministic, unlike the time limit). A solve cut
    by a limit returns its best integer solution, if it has one. The model reads top to bottom as
    the paper's formulation, each constraint under its equation; `_solved` solves it."""
    L, N, M, G = sp.layers, sp.gpus, sp.microbatches, sp.capacity
    # Normalise units (STYLE: well-conditioned solver input): time in ms, bytes in MiB
    ms, mib = 1e3, 1 / 2**20
    B = sp.bandwidth * mib / ms            # MiB per ms
    G = G * mib
    tf_, tb_ = [x * ms for x in sp.t_f], [x * ms for x in sp.t_b]
    sf_, sb_ = [x * mib for x in sp.s_f], [x * mib for x in sp.s_b]
    a_, g_ = [x * mib for x in sp.a], [x * mib for x in sp.g]
    Ls, Ks, Ms = range(L), range(K), range(M)
    m = pulp.LpProblem(f"mobius_K{K}", pulp.LpMinimize)
    Bij = pulp.LpVariable.dicts("B", (Ls, Ks), cat="Binary")            # layer i in stage j
    last = pulp.LpVariable.dicts("last", (Ls, Ks), lowBound=0)        # i is stage j's last layer
    first = pulp.LpVariable.dicts("first", (Ls, Ks), lowBound=0)      # i is stage j's first layer
    t = {e: pulp.LpVariable.dicts(f"t{e}", (Ks, Ms), lowBound=0) for e in "fb"}
    P = {e: pulp.LpVariable.dicts(f"P{e}", Ks, lowBound=0) for e in "fb"}
    T = {"f": {j: pulp.lpSum(tf_[i] * Bij[i][j] for i in Ls) for j in Ks},
         "b": {j: pulp.lpSum(tb_[i] * Bij[i][j] for i in Ls) for j in Ks}}
    S = {"f": {j: pulp.lpSum(sf_[i] * Bij[i][j] for i in Ls) for j in Ks},
         "b": {j: pulp.lpSum(sb_[i] * Bij[i][j] for i in Ls) for j in Ks}}
    D = {e: {j: T[e][j] + t[e][j][M - 1] - t[e][j][0] for j in Ks} for e in "fb"}      # Eq. 7
    a_j = {j: pulp.lpSum(a_[i] * last[i][j] for i in Ls) for j in Ks}
    g_j = {j: pulp.lpSum(g_[i] * first[i][j] for i in Ls) for j in Ks}
    if sp.u:  # [OURS] the CPU's updates, stage by stage in backward order; the objective is the last
        u_ = [x * ms for x in sp.u]
        U = {j: pulp.lpSum(u_[i] * Bij[i][j] for i in Ls) for j in Ks}
        c = pulp.LpVariable.dicts("c", Ks, lowBound=0)
        for j in Ks:
            m += c[j] >= t["b"][j][M - 1] + T["b"][j] + U[j]
            if j + 1 < K:
                m += c[j] >= c[j + 1] + U[j]
        m += c[0]
    else:
        m += t["b"][0][M - 1] + T["b"][0]                                               # Eq. 3
    # every layer in one stage; stages non-empty, contiguous, in order (left implicit by the paper)
    for i in Ls:
        m += pulp.lpSum(Bij[i][j] for j in Ks) == 1
    for j in Ks:
        m += pulp.lpSum(Bij[i][j] for i in Ls) >= 1
    m += Bij[0][0] == 1
    m += Bij[L - 1][K - 1] == 1
    for i in range(L - 1):
        for j in Ks:
            m += Bij[i + 1][j] <= Bij[i][j] + (Bij[i][j - 1] if j else 0)
    for i in Ls:  # last/first indicators; the objective pushes them down to exactly 0/1
        for j in Ks:
            m += last[i][j] >= Bij[i][j] - (Bij[i + 1][j] if i + 1 < L else 0)
            m += first[i][j] >= Bij[i][j] - (Bij[i - 1][j] if i else 0)
    for j in Ks:
        for e in "fb":
            m += S[e][j] <= G                                                           # Eq. 4
            m += P[e][j] <= S[e][j]                                                     # Eq. 6
        if j >= N:
            m += P["f"][j] <= G - S["f"][j - N]                                         # Eq. 5
            m += P["f"][j] <= B * D["f"][j - N]                                         # Eq. 6
            m += t["f"][j][0] >= t["f"][j - N][M - 1] + T["f"][j - N] + (S["f"][j] - P["f"][j]) * (1 / B)  # Eq. 9
        else:
            m += t["f"][j][0] >= S["f"][j] * (1 / B)  # the first stage on each GPU: loaded up front
        if j + N < K:
            m += P["b"][j] <= G - S["b"][j + N]
            m += P["b"][j] <= B * D["b"][j + N]
            m += t["b"][j][0] >= t["b"][j + N][M - 1] + T["b"][j + N] + (S["b"][j] - P["b"][j]) * (1 / B)
        for mb in Ms:
            if mb:                                                                      # Eq. 10
                m += t["f"][j][mb] >= t["f"][j][mb - 1] + T["f"][j]
                m += t["b"][j][mb] >= t["b"][j][mb - 1] + T["b"][j]
            if j:                                                                       # Eq. 8
                m += t["f"][j][mb] >= t["f"][j - 1][mb] + T["f"][j - 1] + a_j[j - 1] * (1 / B)
            if j + 1 < K:
                m += t["b"][j][mb] >= t["b"][j + 1][mb] + T["b"][j + 1] + g_j[j + 1] * (1 / B)
    m += t["b"][K - 1][0] >= t["f"][K - 1][M - 1] + T["f"][K - 1]                        # Eq. 11
    return _solved(m, Bij, L, K, time_limit_s, gap, max_nodes, ms)


def _solved(m, Bij, L: int, K: int, time_limit_s: float, gap: float, max_nodes: int, ms: float) -> Partition:
    """Solve `solve_stages`' model `m` with HiGHS and read its stages from the assignment `Bij`."""
    Ls, Ks = range(L), range(K)
    m.solve(highs.solver(timeLimit=time_limit_s, **({"gapRel": gap} if gap else {}),
                         **({"mip_max_nodes": max_nodes} if max_nodes else {})))
    found = pulp.LpSolution[m.sol_status]  # LpStatus reads "Optimal" after a time limit too (DESIGN.md)
    if m.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return Partition((), 0.0, False, pulp.LpStatus[m.status] if m.status != 1 else found)
    owner = [max(Ks, key=lambda j: Bij[i][j].value() or 0) for i in Ls]
    stages = tuple((min(i for i in Ls if owner[i] == j), max(i for i in Ls if owner[i] == j) + 1) for j in Ks)
    how = "optimal" if m.sol_status == pulp.LpSolutionOptimal and not gap else (
        f"within {gap:.1%} of optimal" if m.sol_status == pulp.LpSolutionOptimal else f"time limit ({found})")
    return Partition(stages, pulp.value(m.objective) / ms, True, how)


def cross_mapping(stages: int, root_complex: tuple[int, ...]) -> tuple[int, ...]:
    """Stage -> GPU (Mobius §3.3, Eq. 12-13). Stages j and j+N share a GPU, so a mapping is a
    permutation of the GPUs over the first N stages; the one with the least total contention
    Σ_{i<j} shared(i, j) / |i - j| wins (exhaustive, ties to the lexicographically first), where
    shared(i, j) is the number of GPUs under the root complex both stages' GPUs hang off (0 if
    different). Two stages on one GPU count that complex's GPU count (docs: [OURS])."""
    return cross_mappings(stages, root_complex)[0]


def cross_mappings(stages: int, root_complex: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every mapping with the least Eq. 12-13 contention, one per pattern of root complexes
    (GPUs under one complex are interchangeable to the equation), lexicographically first first.
    The equation ties often (topo 1+3: 8 of 24 permutations); the planner breaks ties by simulation."""
    N = len(root_complex)
    size = {rc: root_complex.count(rc) for rc in set(root_complex)}

    def cost(perm) -> float:
        gpu = [perm[j % N] for j in range(stages)]
        return lsum((size[root_complex[gpu[i]]] if root_complex[gpu[i]] == root_complex[gpu[j]] else 0) / (j - i)
                   for i in range(stages) for j in range(i + 1, stages))
    perms = sorted(itertools.permutations(range(N)), key=lambda p: (cost(p), p))
    best, seen, out = cost(perms[0]), set(), []
    for p in perms:
        pattern = tuple(root_complex[g] for g in p)
        if cost(p) > best + 1e-12:
            break
        if pattern not in seen:
            seen.add(pattern)
            out.append(tuple(p[j % N] for j in range(stages)))
    return out


def sequential_mapping(stages: int, gpus: int) -> tuple[int, ...]:
    """Stage j on GPU j mod N (Mobius' baseline)."""
    return tuple(j % gpus for j in range(stages))
