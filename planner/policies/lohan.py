"""`lohan`: the Fuyou / LoHan policy for one consumer GPU with DRAM and NVMe SSDs.

Model states: the fp16 parameters P, the fp32 master M and the Adam states OS all live on SSD
(DRAM when the machine has no SSD) and the optimizer runs on the CPU. Updates are
*overlapped* with the backward (LoHan §IV-C active gradient offloading: a block's update
consumes its gradient as soon as the gradient reaches DRAM) and *not serialized*: the
read / update / write pipeline of LoHan Fig. 3b falls out of stream ordering, because the
SSD reads and writes of consecutive subgroups sit on separate streams.

Activations: the search starts from ZeRO-Infinity's choice -- every layer block's input X is
checkpointed to DRAM and everything saved inside the block is recomputed -- and then switches
layer blocks from recompute to swap, in order of offloading benefit (LoHan Eq. 6). It never
goes below the inter-block checkpoints (LoHan §IV-D Case 1, Fuyou D_start).

Granularity: a block is swapped or recomputed as a whole, and a swapped block moves only what is
costly to make again (`BlockDecision.reforward`): the outputs of its FLOP-bearing ops, Fuyou Table
2's linear layers (and attention), while the FLOP-free rest (norms, GELU, residual sums) is made
again from them before the backward (planner/cost.py `reforward_split`). That is LoHan Eq. 6's and
Fuyou's per-layer selection inside a block, where every layer with FLOPs is swapped. The search
also runs with whole-block swaps, and the faster plan wins (on a CPU device tier a swap is a
memcpy and the re-forward can cost more than it saves). The pre and
post blocks (embedding, head + loss) keep their activations on the GPU, as in ZeRO-Infinity.

The swap amount A_G2M is chosen on the real yardstick: every candidate is lowered and
simulated (`schedule(problem, decisions).sim.step_time_s`) and must fit every tier
(`Plan.over_capacity()`). LoHan §IV-D shows T_iter(A_G2M) is convex when the candidates are
taken in decreasing OB order, so over whole-block prefixes the step times are unimodal.
Instead of Algorithm 1's linear scan (up to 97 simulations for GPT-3 175B) we bisect on the
sign of the forward difference T(k+1) - T(k) over the prefix length k: ~2 log2(n) simulations,
exact for a unimodal sequence, and on a plateau it keeps the smaller swap amount (Case 1:
"swap as little as is safe"). The plan returned is the best of all prefixes evaluated, so a
simulator that is not exactly convex can only make the answer less than optimal, never
infeasible when a feasible prefix was seen; among prefixes within REL_TOL (0.5 %) of the best
step time the smallest swap amount wins.

Three tiers (LoHan Eq. 3): swapped activations go to DRAM while they fit in the DRAM left
free by the no-swap plan (MEM_M^avail), the rest to SSD (swap_ssd); if the simulated DRAM
peak still overflows, more of them move to SSD.

Prefetch depth (Fuyou §4.4 GPU-memory-aware FIFO prefetch: the FIFO gets the GPU memory the
rest of the plan leaves free): once the swap amount is fixed, the largest depth in 1..8 whose
plan still fits (bisection, the GPU peak grows with the depth), kept only if it is not slower
in simulation than depth 1.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tensorstow.planner.passes import schedule
from tensorstow.planner.problem import Problem
from tensorstow.planner.result import fmt_bytes
from tensorstow.planner.lower import swap_bytes
from tensorstow.schema.schedule import BlockDecision, Decisions, SEARCH_NOTE

MAX_PREFETCH = 8
"""Deepest parameter prefetch considered (Fuyou §4.4 FIFO)."""
DRAM_RETRIES = 2
"""Extra simulations allowed per swap count to move DRAM-swapped blocks on to SSD."""
SCAN_ALL = 12
"""Layer blocks up to which every swap count is simulated rather than bisected for."""
REL_TOL = 0.005
"""Swap more only for a gain above this fraction of the step time: smaller gains are within
the wiggle that discrete-event ordering adds to a flat T_iter, and every swapped byte is PCIe
and DRAM/SSD traffic (LoHan Case 1: swap as little as is safe)."""


@dataclass(frozen=True)
class _Eval:
    step_time_s: float
    over: dict[str, tuple[int, int]]
    """Tiers above capacity: tier -> (peak, capacity)."""
    dram_peak: int
    n_dram: int
    """How many of the swapped blocks went to DRAM (the rest to SSD)."""

    @property
    def fits(self) -> bool:
        return not self.over

    @property
    def key(self) -> tuple:
        """Feasible plans by step time, before every infeasible one (least overflow first)."""
        if self.fits:
            return (0, self.step_time_s)
        excess = max((peak - cap) / max(cap, 1) for peak, cap in self.over.values())
        return (1, excess, self.step_time_s)


def by_offloading_benefit(problem: Problem, reforward: bool = True) -> list[str]:
    """Layer blocks with saved activations, highest offloading benefit first.

    LoHan Eq. 6: OB = FLOP / A, FLOP = what recomputing the block's activations costs (its
    whole forward: that is what a `recompute` instruction runs), A = bytes of its saved
    activations. Equal OB (every replicated layer) is ordered to spread over the depth: by the
    bit-reversed position of the layer, so any prefix of k swaps layers spaced evenly apart and
    each swapped block's transfer overlaps the compute of the recomputed blocks next to it, as
    LoHan's per-tensor swapping spreads its traffic over every layer. (Swapping the first k
    layers in forward order instead makes the forward wait on the device-to-host link while those
    run back to back: 13B at batch 32 on the RTX 4090, 21 blocks: 23.3 s, spread: see RESULTS.)
    """
    def ob(b: str) -> float:
        p = problem.profiles[problem.profile_of[b]]
        return p.fwd_flops / swap_bytes(p, reforward)  # LoHan Eq. 6: OB = FLOP_layer / A_layer

    layers = [b for b in problem.order if problem.graph.block(b).kind == "layer"
              and problem.profiles[problem.profile_of[b]].saved_bytes > 0]
    bits = max(1, (len(layers) - 1).bit_length())
    spread = {b: int(f"{k:0{bits}b}"[::-1], 2) for k, b in enumerate(layers)}
    return sorted(layers, key=lambda b: (-ob(b), spread[b]))


class _Search:
    def __init__(self, problem: Problem, reforward: bool = True, split: bool = False, wait: bool = False):
        self.problem = problem
        self.reforward = reforward
        """Swapped blocks swap partially (Fuyou Table 2) or whole."""
        self.split = split
        """Layer blocks run their backward in two parts (`BlockDecision.bwd_cut`)."""
        self.wait = wait
        """Candidates are replayed with copies that wait for room (`passes.schedule(wait=True)`): the
        search `plan` makes again where no candidate fits without."""
        self.params_home, self.states_home = problem.home("params"), problem.home("optimizer")
        self.acts_to_ssd = problem.on_ssd("activations")
        """LoHan Eq. 3's overflow of swapped activations may go to SSD (`Options.ssd_for`)."""
        self.ranked = by_offloading_benefit(problem, reforward)
        self.size = [swap_bytes(problem.profiles[problem.profile_of[b]], reforward) for b in self.ranked]
        self.memo: dict[tuple[int, int, int, int], _Eval] = {}
        base = self.evaluate(0, 0, 1)  # ZeRO-Infinity's activations + active gradient offloading
        self.by_count: dict[int, _Eval] = {0: base}
        # LoHan Eq. 3-4 MEM_M^avail: the DRAM left free at the peak of the no-swap ("profiling") plan.
        self.mem_avail = max(0, problem.hw.dram.capacity_bytes - base.dram_peak)

    def decisions(self, k: int, n_dram: int, prefetch: int, kept: int = 0, notes: tuple[str, ...] = ()) -> Decisions:
        """The first k blocks in OB order swapped (the first n_dram of them to DRAM), then the
        first `kept` blocks of `keep_order(k)` keeping their activations on the GPU instead."""
        swap = {b: ("swap_dram" if i < n_dram else "swap_ssd") for i, b in enumerate(self.ranked[:k])}
        on_gpu = set(self.keep_order(k)[:kept])
        blocks = {}
        for b in self.problem.order:
            layer = self.problem.graph.block(b).kind == "layer" and b not in on_gpu
            acts = swap.get(b, "recompute") if layer else "keep"
            cut = self.problem.profiles[self.problem.profile_of[b]].bwd_cut if self.split and layer else 0
            blocks[b] = BlockDecision(params=self.params_home, states=self.states_home, optimizer="cpu",
                                      activations=acts, checkpoint="dram" if layer else "gpu",
                                      reforward=self.reforward and b in swap, bwd_cut=cut)
        return Decisions(policy="lohan", blocks=blocks, prefetch=prefetch, overlap_optimizer=True,
                         serialize_optimizer=False, notes=notes)

    def keep_order(self, k: int) -> list[str]:
        """Layer blocks in the order they keep their activations on the GPU when it has room:
        the recomputed ones first, most FLOP saved per byte held first (LoHan Eq. 6's OB), then
        the swapped ones from the lowest OB up (every swapped byte is the same PCIe traffic)."""
        return self.ranked[k:] + self.ranked[:k][::-1]

    def evaluate(self, k: int, n_dram: int, prefetch: int, kept: int = 0) -> _Eval:
        key = (k, n_dram, prefetch, kept)
        if key not in self.memo:
            plan = schedule(self.problem, self.decisions(k, n_dram, prefetch, kept), wait=self.wait)
            self.memo[key] = _Eval(plan.sim.step_time_s, plan.over_capacity(), plan.peak("dram"), n_dram)
        return self.memo[key]

    def dram_share(self, k: int) -> int:
        """LoHan Eq. 3: alpha*A_G2M = max(0, A_G2M - MEM_M^avail) goes to SSD; returns how many
        of the first k blocks stay in DRAM."""
        if not self.acts_to_ssd:
            return k
        n, total = 0, 0
        while n < k and total + self.size[n] <= self.mem_avail:
            total += self.size[n]
            n += 1
        return n

    def count(self, k: int) -> _Eval:
        """Step time with the first k OB-ranked blocks swapped (at prefetch depth 1)."""
        if k in self.by_count:
            return self.by_count[k]
        n_dram = self.dram_share(k)
        r = self.evaluate(k, n_dram, 1)
        for _ in range(DRAM_RETRIES):
            if "dram" not in r.over or n_dram == 0 or not self.acts_to_ssd:
                break
            excess = r.over["dram"][0] - r.over["dram"][1]
            while n_dram > 0 and excess > 0:  # LoHan Eq. 3: the overflow goes to SSD
                n_dram -= 1
                excess -= self.size[n_dram]
            r = self.evaluate(k, n_dram, 1)
        self.by_count[k] = r
        return r

    def best_count(self) -> int:
        """Bisection on the sign of T(k+1) - T(k) over the OB-ordered prefixes (T convex,
        LoHan §IV-D), then the smallest prefix among all evaluated whose step time is within
        REL_TOL of the best. Every prefix is evaluated when there are at most SCAN_ALL (LoHan
        Algorithm 1's linear scan, cheap there), else, where the bisection's point is no faster than
        no swap, the scan from 0 while it gains (GPT-3 13B at batch 32 on the A100 preset: 0..3
        swapped fall 17.81 -> 17.59 s, 20 rise to 18.09 s, where the bisection settles); and
        swapping all of them always: on a few layers T need not be convex (gpt-small's 6 with
        the spread order: 3 swapped simulate 0.2221 s, all 6 0.2073 s)."""
        n = len(self.ranked)
        lo, hi = 0, n
        while lo < hi:
            m = (lo + hi) // 2
            if self.count(m + 1).key < self.count(m).key:
                lo = m + 1
            else:
                hi = m
        for k in range(n + 1) if n <= SCAN_ALL else (lo, n):
            self.count(k)
        if self.count(lo).key >= self.count(0).key:  # the bisection found nothing better than no swap:
            k = 0  # Algorithm 1's scan from 0, as long as each block swapped more gains (T is not convex
            while k < n and self.count(k + 1).key < self.count(k).key:  # at its start where the first
                k += 1  # swaps cut recompute on a communication-bound backward, Fuyou §5.6)
        best = min(self.by_count.values(), key=lambda e: e.key)
        if not best.fits:
            return min(self.by_count, key=lambda k: (self.by_count[k].key, k))
        # LoHan §IV-D Case 1: among (near-)equal times, the smallest swap amount.
        return min(k for k, e in self.by_count.items()
                   if e.fits and e.step_time_s <= best.step_time_s * (1 + REL_TOL))

    def best_kept(self, k: int, n_dram: int) -> int:
        """How many layer blocks keep their activations on the GPU (`keep_order`): LoHan Eq. 3
        splits the swapped activations between DRAM and SSD by what each tier has free; the GPU
        is the tier above both, and what it holds is neither moved nor recomputed. The most
        blocks whose plan still fits (bisection: each block kept adds its activations to the
        GPU peak), if that plan is not slower in simulation than keeping none by more than
        REL_TOL (LoHan §IV-D Case 1: the least traffic among near-equal times). Without this,
        gpt-small at 90 MB of device memory swapped all six blocks' activations through host
        memory (150 MB of copies a step) where every one of them fit beside the parameter window."""
        if not self.evaluate(k, n_dram, 1, 1).fits:
            return 0
        lo = _most_that_fits(1, len(self.ranked), lambda m: self.evaluate(k, n_dram, 1, m).fits)
        none = self.evaluate(k, n_dram, 1)
        return lo if self.evaluate(k, n_dram, 1, lo).step_time_s <= none.step_time_s * (1 + REL_TOL) else 0

    def best_prefetch(self, k: int, n_dram: int, kept: int = 0) -> tuple[int, str]:
        """Fuyou §4.4: the deepest FIFO the memory allows, if it is not slower than depth 1."""
        lo = _most_that_fits(1, MAX_PREFETCH, lambda m: self.evaluate(k, n_dram, m, kept).fits)
        why = f"the deepest of 1..{MAX_PREFETCH} that fits"
        if self.evaluate(k, n_dram, lo, kept).key > self.evaluate(k, n_dram, 1, kept).key:
            return 1, f"depth {lo} fits ({why}) but simulates slower"
        return lo, why


def _most_that_fits(lo: int, hi: int, fits) -> int:
    """The largest m in [lo, hi] with fits(m), by bisection (fits holds up to some m and not
    after: the GPU peak grows with m); lo when none above it does."""
    while lo < hi:
        m = (lo + hi + 1) // 2
        if fits(m):
            lo = m
        else:
            hi = m - 1
    return lo


def _search(problem: Problem, reforward: bool, split: bool = False,
            keep: bool = False, wait: bool = False) -> tuple[_Search, int, int, int, int, str]:
    s = _Search(problem, reforward, split, wait)
    k = s.best_count()
    n_dram = s.by_count[k].n_dram
    prefetch, why = s.best_prefetch(k, n_dram)
    kept = s.best_kept(k, n_dram) if keep else 0
    if kept:  # the room kept activations take is the FIFO's: the faster of the two wins
        depth, why_kept = s.best_prefetch(k, n_dram, kept)
        if s.evaluate(k, n_dram, depth, kept).step_time_s <= s.evaluate(k, n_dram, prefetch).step_time_s * (1 + REL_TOL):
            return s, k, n_dram, kept, depth, why_kept
    return s, k, n_dram, 0, prefetch, why


def fuyou(problem: Problem) -> Decisions:
    """Fuyou's system: the same search without cutting any backward. Fuyou keeps a layer's
    intermediate values on the GPU (§5.2: "a larger model brings a larger intermediate value size
    within a layer, which is not offloaded to CPU and SSDs"), so a swapped block's activations
    come back only beside the whole backward before it; LoHan swaps layer by layer."""
    return dataclasses.replace(plan(problem, split=False, keep=False), policy="fuyou")


def plan(problem: Problem, split: bool = True, keep: bool = True) -> Decisions:
    """The search with partial swaps, and with whole-block swaps where a block has a partial one;
    the faster plan wins (partial on a tie). On a GPU partial swaps win when the host link is busy
    (their re-forward is a few % of a forward); on a CPU device tier, where a swap is a memcpy, the
    re-forward can cost more than the bytes it saves. `keep`: layer blocks the GPU has room for
    keep their activations there (`_Search.best_kept`); the papers' systems (`fuyou`) do not."""
    runs, times, best = _runs(problem, split, keep)
    waited = False
    if not times[best].fits:  # no candidate fits unless copies wait for room: search among those
        w_runs, w_times, w_best = _runs(problem, split, keep, wait=True)
        if w_times[w_best].fits:
            runs, times, best, waited = w_runs, w_times, w_best, True
    s, k, n_dram, kept, prefetch, why = runs[best]
    final = times[best]

    on_gpu = set(s.keep_order(k)[:kept])
    a_dram = sum(n for b, n in zip(s.ranked[:n_dram], s.size) if b not in on_gpu)
    a_ssd = sum(n for b, n in zip(s.ranked[n_dram:k], s.size[n_dram:]) if b not in on_gpu)
    swapped = k - len(on_gpu & set(s.ranked[:k]))
    recomputed = len(s.ranked) - k - len(on_gpu - set(s.ranked[:k]))
    searched = ", ".join(f"{c}:{'%.4g' % e.step_time_s}s{'' if e.fits else '(over)'}"
                         for c, e in sorted(s.by_count.items()))
    how = ("a swapped block moves its FLOP-bearing ops' outputs and re-forwards the rest (Fuyou Table 2)"
           if s.reforward else "a swapped block moves all it saves")
    if len(runs) > 1:
        how += (f"; best with partial swaps {'%.4g' % times[0].step_time_s}s, with whole-block swaps "
                f"{'%.4g' % times[1].step_time_s}s")
    if len(runs) > 2:
        how += (f", with partial swaps and each backward cut in two (LoHan's layer-by-layer swapping) "
                f"{'%.4g' % times[2].step_time_s}s")
    if s.split:
        how += "; each layer block's backward runs in two parts, the first releasing what only it reads"
    homes = (f"P, M, OS on {s.params_home}" if s.params_home == s.states_home else
             f"P on {s.params_home}, M, OS on {s.states_home}")
    notes = (
        f"{homes}; CPU Adam overlapped with backward (LoHan §IV-C active gradient "
        f"offloading), SSD read/update/write pipelined (LoHan Fig. 3b)",
        f"of {len(s.ranked)} layer blocks, {len(on_gpu)} keep their activations on the GPU "
        f"(the most it has room for, LoHan Eq. 3 one tier up), {swapped} swap theirs (A_G2M "
        f"{fmt_bytes(a_dram + a_ssd)}: {fmt_bytes(a_dram)} to DRAM, {fmt_bytes(a_ssd)} to SSD, "
        f"LoHan Eq. 3) and {recomputed} recompute from inputs checkpointed to DRAM; blocks ranked "
        f"by FLOP/byte (LoHan Eq. 6); {how}",
        f"{SEARCH_NOTE}swap count by bisection over OB-ordered prefixes (T_iter convex, LoHan §IV-D); "
        f"simulated k:step_time {searched}",
        f"prefetch depth {prefetch}: {why} (Fuyou §4.4 GPU-memory-aware FIFO)",
    )
    if waited:
        notes += ("no candidate fits every tier unless copies wait for room; searched among those",)
    elif not final.fits:
        notes += ("no candidate fits every tier; this is the least-overflowing one",)
    return s.decisions(k, n_dram, prefetch, kept, notes)


def _runs(problem: Problem, split: bool, keep: bool, wait: bool = False) -> tuple[list, list[_Eval], int]:
    """The searches `plan` compares (partial swaps, whole-block swaps, cut backwards): each's
    result, its replay, and which wins (the faster; the earlier on a tie)."""
    runs = [_search(problem, True, keep=keep, wait=wait)]
    if any(problem.profiles[problem.profile_of[b]].rest for b in runs[0][0].ranked):
        runs.append(_search(problem, False, keep=keep, wait=wait))
    if split and any(not e.fits for s, *_ in runs for e in s.by_count.values()) and all(
            problem.profiles[problem.profile_of[b]].bwd_cut for b in runs[0][0].ranked):
        # Swaps that did not fit: with each backward cut in two, the next swapped block's
        # activations load into what the first part releases (LoHan's layer-by-layer swapping).
        runs.append(_search(problem, True, split=True, keep=keep, wait=wait))
    times = [s.evaluate(k, n, pf, kept) for s, k, n, kept, pf, _ in runs]
    return runs, times, min(range(len(runs)), key=lambda i: (times[i].key, i))
