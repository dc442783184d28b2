"""`ilp`: one mixed-integer program over the decisions the heuristics make separately.

Decision space (per block, granularity documented in planner/lower.py): what happens to
its saved activations A (keep / swap to DRAM / swap to SSD / recompute), where its input
checkpoint X waits (GPU / DRAM / SSD), the home tier of its parameters P (GPU = resident,
else streamed in per use), the home tier of its fp32 states M + OS, and the device that
updates it (CPU / GPU). One such tuple is a `Combo`; combos that make no sense (a CPU
update of states that live on the GPU) are left out.

Compact formulation: blocks with the same similarity signature are interchangeable, so the
variables are counts x[g, c] = how many blocks of group g take combo c (Σ_c x[g, c] = n_g).
Every time and byte term is linear in the counts.

Objective (LoHan Eq. 1): T_iter = T_f + T_b, each phase bounded below by every resource it
uses (LoHan Eq. 2 forward, Eq. 5 backward; Fuyou Eq. 3-4: the host link is duplex, SSD
traffic simplex), with the CPU optimizer overlapped with backward (LoHan §IV-C):
    T_f >= Σ GPU_f,  T_f >= Σ H2D_f,  T_f >= Σ D2H_f,  T_f >= Σ (SSD_read_f + SSD_write_f)
    T_b >= Σ GPU_b (+ recompute, + GPU Adam),  T_b >= Σ H2D_b,  T_b >= Σ D2H_b,
    T_b >= Σ (SSD_read_b + SSD_write_b),  T_b >= Σ CPU Adam
Capacity (each row divided by its capacity; time in units of 1% of the model's compute time,
so the solver sees numbers near 1 whatever the model size): resident bytes per tier + the transient
working set (the largest run of prefetch+1 consecutive blocks' streamed params, the largest one
block's activations, inputs, workspace and gradient, DRAM's staging of two consecutive blocks)
<= capacity.

The analytic model ignores pipeline fill and drain, so the decisions are lowered and replayed
in the simulator (the one yardstick of every policy); a tier the simulator finds over
capacity is tightened by the overflow and the MIP re-solved (at most 5 rounds). This is done
for prefetch depths 1, 2 and 4 (the transient GPU memory depends on it) and the fastest
simulated plan is kept. Warm
start: the best heuristic's plan is the incumbent; its analytic objective is passed to
HiGHS as `objective_bound` (PuLP's HiGHS interface takes no start solution; with
solver="cbc" the incumbent is a real MIP start), and if the simulator ranks the
incumbent faster than the MIP's plan, the incumbent is returned and the notes say so.

The drain the analytic model ignores ends the backward with the last block's update, whose P and
states then go back home: from SSD a write-back (and its sync) after everything else. `refine_tail`
replays giving that block DRAM homes in exchange for other blocks' and keeps the faster plan
(benchmarks/RESULTS.md "Write-back ordering").
Last, `refine_homes` moves SSD homes into the DRAM the chosen plan leaves free, where that
replays no slower: the simulator sees hidden SSD traffic as free, the machine does not.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

import pulp

from tensorstow.ir.graph import lsum
from tensorstow.planner import highs
from tensorstow.planner.cost import GPU_ADAM_BYTES_PER_PARAM, BlockProfile, update_time
from tensorstow.planner.policies import heuristic_plans
from tensorstow.planner.passes import defer_writes, lower_and_simulate, schedule
from tensorstow.planner.result import fmt_bytes
from tensorstow.planner.lower import swap_bytes, units_of
from tensorstow.schema.schedule import ACTIVATION_CHOICES, UNIT, BlockDecision, Decisions, InstrKind, SEARCH_NOTE

MiB = 2**20
TIME_LIMIT_S = 20.0
"""Per MIP solve; a solve stopped by it returns its incumbent and says so."""
TOTAL_BUDGET_S = 60.0
"""All MIP solves of one `plan()` together."""
GAP_REL = 1e-3
ROUNDS = 5
PREFETCH_CANDIDATES = (1, 2, 4)
PHASE_TERMS = {"f": ("gpu_f", "h2d_f", "d2h_f", "ssd_f"), "b": ("gpu_b", "h2d_b", "d2h_b", "ssd_b", "cpu_b")}


@dataclass(frozen=True, order=True)
class Combo:
    act: str
    ck: str
    ph: str
    sh: str
    opt: str

    def decision(self) -> BlockDecision:
        return BlockDecision(params=self.ph, states=self.sh, optimizer=self.opt, activations=self.act,
                             checkpoint=self.ck, reforward=self.act in ("swap_dram", "swap_ssd"))


def combos(problem, *, choices: dict[str, tuple[str, ...]] | None = None) -> list[Combo]:
    """Every combination of a block's choices, the SSD only for what `Options.ssd_for` lets it hold."""
    def tiers(kind: str) -> tuple[str, ...]:
        return ("gpu", "dram", "ssd") if problem.on_ssd(kind) else ("gpu", "dram")
    acts = tuple(a for a in ACTIVATION_CHOICES if a != "swap_ssd" or problem.on_ssd("activations"))
    c = {"act": acts, "ck": tiers("activations"), "ph": tiers("params"), "sh": tiers("optimizer"),
         "opt": ("gpu", "cpu")} | (choices or {})
    out = [Combo(*t) for t in itertools.product(c["act"], c["ck"], c["ph"], c["sh"], c["opt"])]
    return [x for x in out if not (x.opt == "cpu" and x.sh == "gpu")]


def coefficients(p: BlockProfile, c: Combo, problem, last: bool) -> dict[str, float]:
    """Seconds per resource and phase, and bytes per tier, for one block taking combo c."""
    hw, g = problem.hw, problem.hw.gpu
    mixed = problem.mixed
    n = p.param_count
    # P: what the block's segments read (its constants included: frozen weights, buffers);
    # Pw: what an update writes back (trainable parameters only)
    P, Pw, G = p.param_bytes + p.const_bytes, p.param_bytes, p.grad_bytes
    S = (12 if mixed else 8) * n
    A, X = p.saved_bytes, p.input_bytes
    As = swap_bytes(p, True)  # a swap moves the FLOP-bearing ops' outputs, re-forwards the rest (Fuyou Table 2)
    rd = 1 / hw.ssd.read_total() if hw.ssd.count else 0.0
    wr = hw.ssd.write_s_per_byte() if hw.ssd.count else 0.0  # the state's writes and their flush
    wt = 1 / hw.ssd.write_total() if hw.ssd.count else 0.0  # a step's own swaps: not synced
    h2d, d2h = 1 / g.h2d_bw, 1 / g.d2h_bw
    streamed = c.ph != "gpu"
    swapped = c.act in ("swap_dram", "swap_ssd")
    k = {t: 0.0 for t in PHASE_TERMS["f"] + PHASE_TERMS["b"]}
    # forward (LoHan Eq. 2 terms)
    k["gpu_f"] = p.fwd_time_s
    k["h2d_f"] = P * h2d * streamed
    k["d2h_f"] = (As * swapped + X * (c.ck != "gpu")) * d2h
    k["ssd_f"] = P * rd * (c.ph == "ssd") + (As * (c.act == "swap_ssd") + X * (c.ck == "ssd")) * wt
    # backward + optimizer (LoHan Eq. 5 terms); the last block keeps its streamed params
    reload = streamed and not last
    k["gpu_b"] = p.bwd_time_s + p.fwd_time_s * (c.act == "recompute") + p.refwd_time_s * swapped
    k["gpu_b"] += n * GPU_ADAM_BYTES_PER_PARAM / g.mem_bw * (c.opt == "gpu")
    states_cross = c.opt == "gpu" and c.sh != "gpu"
    k["h2d_b"] = (P * reload + As * swapped + X * (c.ck != "gpu") + S * states_cross
                  + Pw * (c.opt == "cpu" and c.ph == "gpu")) * h2d
    k["d2h_b"] = (G * (c.opt == "cpu") + S * states_cross + Pw * (c.opt == "gpu" and streamed)) * d2h
    ssd_r = P * (c.ph == "ssd") * reload + As * (c.act == "swap_ssd") + X * (c.ck == "ssd") + S * (c.sh == "ssd")
    ssd_w = S * (c.sh == "ssd") + Pw * (c.ph == "ssd")
    if not mixed and c.ph == "ssd" and c.opt == "cpu":
        ssd_r += Pw  # fp32: the parameter is the master and is read for its update
    k["ssd_b"] = ssd_r * rd + ssd_w * wr
    k["cpu_b"] = update_time(p, "cpu", problem) * (c.opt == "cpu")
    # resident bytes per tier
    k["mem_gpu"] = (P * (c.ph == "gpu") + S * (c.sh == "gpu") + A * (c.act == "keep") + X * (c.ck == "gpu")) / MiB
    k["mem_dram"] = (P * (c.ph == "dram") + S * (c.sh == "dram") + As * (c.act == "swap_dram")
                     + X * (c.ck == "dram")) / MiB
    k["mem_ssd"] = (P * (c.ph == "ssd") + S * (c.sh == "ssd") + As * (c.act == "swap_ssd") + X * (c.ck == "ssd")) / MiB
    k["streamed"] = float(streamed)
    k["gpu_update_of_offloaded_states"] = float(states_cross)
    return k


@dataclass
class Groups:
    names: list[str]
    """Group keys (similarity signatures) in first-appearance order."""
    members: dict[str, list[str]]
    """Group -> its blocks in forward order."""
    coef: dict[str, dict[Combo, dict[str, float]]]
    last_group: str


def prune(coef: dict[Combo, dict[str, float]]) -> dict[Combo, dict[str, float]]:
    """Drop combos no optimal solution needs: exact duplicates of another combo's vector, and
    combos dominated term by term (every time, byte and flag term >= another's). Replacing a
    dominated combo by its dominator keeps every row feasible and never raises the objective."""
    items = sorted(coef.items())
    keys = sorted(items[0][1]) if items else []
    vecs = [(c, tuple(k[t] for t in keys)) for c, k in items]
    keep = {}
    for c, v in vecs:
        if v in {tuple(kv) for kv in keep.values()}:
            continue
        dominated = any(all(a <= b + 1e-15 for a, b in zip(w, v)) and w != v for _, w in vecs)
        if not dominated:
            keep[c] = v
    return {c: coef[c] for c in keep}


def groups(problem, cs: list[Combo]) -> Groups:
    """Blocks with equal signature share coefficients; the last block is its own group."""
    order = problem.order
    members: dict[str, list[str]] = {}
    for b in order:
        key = "last" if b == order[-1] else problem.graph.block(b).signature
        members.setdefault(key, []).append(b)
    coef = {}
    for key, blocks in members.items():
        prof = problem.profiles[problem.profile_of[blocks[0]]]
        coef[key] = {c: coefficients(prof, c, problem, last=key == "last") for c in cs}
    return Groups(list(members), members, coef, "last")


def transient(problem, prefetch: int = 1) -> dict[str, float]:
    """Working set on top of resident bytes (MiB): what the blocks in flight need. Blocks stream
    in their order (the backward in reverse), so what is in flight at once is a run of
    consecutive blocks: the largest sum over such a run, not the largest block times the run's
    length (a model's 154 MB embedding beside its 28 MB layers: two in flight are 182 MB, not
    308). One block's own working set (its activations, inputs and outputs, workspace and
    gradient, the size of its parameters) is the largest such sum over the blocks."""
    profs = [problem.profiles[problem.profile_of[b]] for b in problem.order]
    mixed = problem.mixed
    params = [p.param_bytes + p.const_bytes for p in profs]
    states = [p.param_count * (12 if mixed else 8) for p in profs]
    xs = [p.input_bytes + p.output_bytes for p in profs]
    own = max(p.saved_bytes + x + max(p.fwd_workspace, p.bwd_workspace + 2 * p.handed_bytes) + n
              for p, x, n in zip(profs, xs, params))
    return {"gpu": own / MiB, "gpu_stream": _run(params, prefetch + 1) / MiB, "gpu_states": max(states) / MiB,
            "dram": (_run(params, 2) + _run(states, 2) + _run([p.saved_bytes for p in profs], 2) + _run(xs, 2)) / MiB}


def _run(sizes: list[int], k: int) -> int:
    """The largest sum of k consecutive sizes (all of them when there are fewer)."""
    k = min(k, len(sizes))
    return max(sum(sizes[i:i + k]) for i in range(len(sizes) - k + 1))


@dataclass
class IlpResult:
    feasible: bool
    status: str
    """The solver's own verdict: "optimal", "time limit (incumbent)", "infeasible", ..."""
    objective: float | None
    counts: dict[str, dict[Combo, int]]
    message: str = ""


def solve(problem, *, choices=None, caps_mib: dict[str, float] | None = None, prefetch: int = 1,
          solver: str = "highs", time_limit: float = TIME_LIMIT_S, bound: float | None = None,
          start: dict[str, Combo] | None = None) -> IlpResult:
    cs = combos(problem, choices=choices)
    gr = groups(problem, cs)
    cap = caps_mib or {t: v / MiB for t, v in problem.capacity().items()}
    tr = transient(problem, prefetch)
    prob = pulp.LpProblem("tensorstow_placement", pulp.LpMinimize)
    live = {g: prune(gr.coef[g]) for g in gr.names}
    x = {(g, i): pulp.LpVariable(f"x_{gi}_{i}", lowBound=0, upBound=len(gr.members[g]), cat="Integer")
         for gi, g in enumerate(gr.names) for i, c in enumerate(cs) if c in live[g]}
    T_f = pulp.LpVariable("T_f", lowBound=0)
    T_b = pulp.LpVariable("T_b", lowBound=0)
    stream_any = pulp.LpVariable("stream_any", cat="Binary")
    states_any = pulp.LpVariable("gpu_update_of_offloaded_states_any", cat="Binary")
    # LoHan Eq. 1: T_iter = T_f + T_b
    prob += T_f + T_b
    # Well-conditioned units: time in units of 1% of the model's GPU compute time, each
    # capacity row divided by its capacity (solver tolerances are ~1e-7 absolute).
    tscale = max(lsum(gr.coef[g][cs[0]]["gpu_f"] + gr.coef[g][cs[0]]["gpu_b"] for g in gr.names), 1e-12) / 100
    mscale = {t: max(cap[t], 1e-9) for t in ("gpu", "dram", "ssd")}

    def total(term):
        unit = tscale if not term.startswith("mem_") else mscale[term[4:]]
        return pulp.lpSum(gr.coef[g][c][term] / unit * x[g, i] for g in gr.names for i, c in enumerate(cs)
                          if (g, i) in x and gr.coef[g][c][term])

    for g in gr.names:
        # every block takes exactly one combo
        prob += pulp.lpSum(x[g, i] for i in range(len(cs)) if (g, i) in x) == len(gr.members[g]), \
            f"one_combo_{gr.names.index(g)}"
        n = len(gr.members[g])
        prob += n * stream_any >= pulp.lpSum(x[g, i] for i, c in enumerate(cs) if (g, i) in x and c.ph != "gpu")
        prob += n * states_any >= pulp.lpSum(x[g, i] for i, c in enumerate(cs)
                                             if (g, i) in x and c.opt == "gpu" and c.sh != "gpu")
    # LoHan Eq. 2: T_f = max(T_f^G, T_f^M2G, T_f^G2M, T_f^S)
    for term in PHASE_TERMS["f"]:
        prob += T_f >= total(term), f"Tf_{term}"
    # LoHan Eq. 5 (+ CPU Adam overlapped with backward, LoHan §IV-C)
    for term in PHASE_TERMS["b"]:
        prob += T_b >= total(term), f"Tb_{term}"
    # capacity per tier: resident + transient working set <= capacity
    mg, md = mscale["gpu"], mscale["dram"]
    prob += (total("mem_gpu") + tr["gpu"] / mg + tr["gpu_stream"] / mg * stream_any
             + tr["gpu_states"] / mg * states_any <= cap["gpu"] / mg), "cap_gpu"
    prob += total("mem_dram") + tr["dram"] / md <= cap["dram"] / md, "cap_dram"
    prob += total("mem_ssd") <= cap["ssd"] / mscale["ssd"], "cap_ssd"

    if start is not None:
        for (g, i), var in x.items():
            var.setInitialValue(sum(start[b] == cs[i] for b in gr.members[g]))
    if solver == "cbc":
        s = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=GAP_REL, warmStart=start is not None)
    else:
        params = {"objective_bound": bound / tscale * (1 + 1e-6) + 1e-6} if bound is not None else {}
        s = highs.solver(timeLimit=time_limit, gapRel=GAP_REL, **params)
    prob.solve(s)
    status = pulp.LpStatus[prob.status]
    sol = pulp.LpSolution[prob.sol_status]  # LpStatus says "Optimal" after a time limit too
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return IlpResult(False, f"{status}: {sol}", None, {}, message=f"{solver}: {sol}")
    counts = {g: {c: int(round(x[g, i].value() or 0)) for i, c in enumerate(cs)
                  if (g, i) in x and round(x[g, i].value() or 0)} for g in gr.names}
    label = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "time limit (incumbent)"
    return IlpResult(True, label, float(pulp.value(prob.objective)) * tscale, counts, message=f"{solver}: {sol}")


def analytic(problem, assignment: dict[str, Combo], *, caps_mib=None, prefetch: int = 1) -> float | None:
    """The MIP's objective for a per-block assignment; None if it breaks a capacity row."""
    gr = groups(problem, sorted(set(assignment.values())))
    cap = caps_mib or {t: v / MiB for t, v in problem.capacity().items()}
    tr = transient(problem, prefetch)
    tot: dict[str, float] = {}
    for g in gr.names:
        for b in gr.members[g]:
            for term, v in gr.coef[g][assignment[b]].items():
                tot[term] = tot.get(term, 0.0) + v
    stream_any = any(c.ph != "gpu" for c in assignment.values())
    states_any = any(c.opt == "gpu" and c.sh != "gpu" for c in assignment.values())
    if tot["mem_gpu"] + tr["gpu"] + tr["gpu_stream"] * stream_any + tr["gpu_states"] * states_any > cap["gpu"] + 1e-6:
        return None
    if tot["mem_dram"] + tr["dram"] > cap["dram"] + 1e-6 or tot["mem_ssd"] > cap["ssd"] + 1e-6:
        return None
    return max(tot[t] for t in PHASE_TERMS["f"]) + max(tot[t] for t in PHASE_TERMS["b"])


def assign(problem, counts: dict[str, dict[Combo, int]]) -> dict[str, Combo]:
    """Counts -> blocks, deterministically, spreading each combo evenly over its group
    (largest-remainder sequencing: the k-th GPU update lands every n/k blocks, as in DOS)."""
    cs = combos(problem)
    gr = groups(problem, cs)
    out = {}
    for g in gr.names:
        blocks, want = gr.members[g], counts.get(g, {})
        n, got = len(blocks), {c: 0 for c in want}
        for i, b in enumerate(blocks):
            c = max(sorted(want), key=lambda c: (want[c] * (i + 1) / n - got[c]))
            got[c] += 1
            out[b] = c
    return out


def decisions_from(problem, assignment: dict[str, Combo], notes=(), prefetch: int = 1) -> Decisions:
    return Decisions(policy="ilp", blocks={b: assignment[b].decision() for b in problem.order}, prefetch=prefetch,
                     overlap_optimizer=True, serialize_optimizer=False, notes=tuple(notes))


TAIL_CANDIDATES = 4
"""Blocks `refine_tail` tries to exchange a home with, per tier kind (each a schedule + replay)."""


def refine_tail(problem, pl, schedule) -> tuple:
    """The analytic model has no pipeline drain: the backward ends with the last block's update,
    after which that block's parameters and states go back to their homes: from an SSD home, a
    write (and its sync) after everything else that the MIP does not see. Replayed in the
    simulator: give that block's P, then its states, the DRAM home of another block that has one
    (the two exchange tiers; the largest such blocks first, at most TAIL_CANDIDATES each), and keep
    the fastest plan that fits. Returns (the plan, notes). [OURS]"""
    last = next((i.segment for i in reversed(pl.instructions) if i.kind == InstrKind.OPTIMIZER_STEP), None)
    notes = []
    if last is not None and UNIT in last:
        return pl, ()  # a group of experts is updated last: refine_homes places units

    def size(b: str) -> int:  # a block's P and its states both scale with its parameters
        return problem.profiles[problem.profile_of[b]].param_bytes
    for field in ("params", "states"):
        if last is None or getattr(pl.decisions.blocks[last], field) != "ssd":
            continue
        others = sorted((b for b, d in pl.decisions.blocks.items() if b != last and getattr(d, field) == "dram"),
                        key=lambda b: (-size(b), b))[:TAIL_CANDIDATES]
        base = pl
        for other in others:
            blocks = dict(base.decisions.blocks)
            blocks[last] = replace(blocks[last], **{field: "dram"})
            blocks[other] = replace(blocks[other], **{field: "ssd"})
            cand = schedule(problem, replace(base.decisions, blocks=blocks))
            if cand.fits and cand.sim.step_time_s < pl.sim.step_time_s:
                pl, swapped = cand, other
        if pl is not base:
            notes.append(f"tail: {last}'s {field} home DRAM, {swapped}'s SSD (simulated "
                         f"{base.sim.step_time_s:.4g} -> {pl.sim.step_time_s:.4g} s: {last} is updated last)")
    return pl, tuple(notes)


HOME_KINDS = {"params": ("parameter", "constant"), "states": ("optimizer_state",)}
"""The kinds of buffer (`schedule.Buffer.kind`) a block's `params` / `states` decision homes: P and
C (frozen weights), M (mixed precision's fp32 master) and OS."""


def refine_homes(problem, pl, schedule) -> tuple:
    """Give SSD homes the DRAM the plan leaves free. The analytic model and the simulator see a
    block's SSD traffic hidden behind the computation, so they rank its P on SSD and in DRAM
    alike, and the MIP, or the incumbent from `lohan` (whose homes are all SSD, as LoHan's are),
    may leave the DRAM idle. On the machine that traffic is not free: the store's checksums and
    transfers stream host memory beside the computation and slow it (benchmarks/RESULTS.md "Host
    contention on the CPU device tier"), and it wears the SSD. So P first (fp32, a CPU update: read for the
    forward and again for the backward, written back: three bytes moved a step per byte of DRAM;
    states two), blocks in backward order (the blocks updated last are the ones `defer_writes`
    keeps in DRAM across the step boundary already), as many as the free DRAM holds, bisected for
    the most that still fit and replay no slower. Compared and returned without deferred writes
    (`plan` defers them again). Returns (the plan, notes). [OURS]"""

    if not any(buf.home == "ssd" for buf in pl.buffers.values()):
        return pl, ()
    if pl.decisions.deferred_writes:
        base = _undeferred(problem, pl.decisions, schedule)
        if not base.fits:
            return pl, ()
        pl = base
    cap, notes = problem.capacity()["dram"], []
    for field, kinds in HOME_KINDS.items():
        spare = cap - pl.sim.peak_bytes.get("dram", 0)
        on_ssd: dict[str, int] = {}
        for buf in pl.buffers.values():
            if buf.home == "ssd" and buf.kind in kinds:
                on_ssd[buf.block] = on_ssd.get(buf.block, 0) + buf.bytes
        sizes = [(u, on_ssd[u]) for b in reversed(problem.order)
                 for u in (*reversed(units_of(b, problem.profiles[problem.profile_of[b]])), b) if u in on_ssd]
        k, total = 0, 0
        while k < len(sizes) and total + sizes[k][1] <= spare:
            total += sizes[k][1]
            k += 1
        if not k:
            continue

        def moved(k: int):
            blocks = dict(pl.decisions.blocks)
            for b, _ in sizes[:k]:  # a unit (an expert group) gets a decision of its own
                blocks[b] = replace(pl.decisions.of(b), **{field: "dram"})
            cand = _undeferred(problem, replace(pl.decisions, blocks=blocks), schedule)
            return cand if cand.fits and cand.sim.step_time_s <= pl.sim.step_time_s else None

        best, lo = moved(k), k
        if best is None:  # bisect for the most blocks that still fit and are not slower
            lo, hi = 0, k
            while hi - lo > 1:
                mid = (lo + hi) // 2
                cand = moved(mid)
                if cand is None:
                    hi = mid
                else:
                    best, lo = cand, mid
        if best is not None:
            notes.append(f"homes: {field} of {lo} {'block(s) and expert group' if any(UNIT in b for b, _ in sizes) else 'block'}(s) "
                         f"from SSD to DRAM, which had "
                         f"{fmt_bytes(spare)} free ({', '.join(b for b, _ in sizes[:lo])}; simulated without "
                         f"deferred writes {pl.sim.step_time_s:.4g} -> {best.sim.step_time_s:.4g} s, SSD traffic "
                         f"{fmt_bytes(_ssd_traffic(pl))} -> {fmt_bytes(_ssd_traffic(best))} a step)")
            pl = best
    return pl, tuple(notes)


def _undeferred(problem, decisions: Decisions, schedule):
    """`decisions` scheduled as the policy's final plan is (`planned`: copies may wait for room, as
    they must where more homes in DRAM take the SSD's delay out of the prefetches), with no
    write-back deferred: what `refine_homes` compares (`plan` defers them again)."""
    r = schedule(problem, replace(decisions, deferred_writes=()), wait=True)
    if r.decisions.deferred_writes:  # a speculating final plan defers its own (`speculate_or_wait`)
        r = lower_and_simulate(problem, replace(r.decisions, deferred_writes=()), wait=True)
    return r


def _ssd_traffic(pl) -> int:
    return sum(n for k, n in pl.sim.traffic_bytes.items() if "ssd" in k.split("->"))


def plan(problem) -> Decisions:
    chosen = _choose(problem, heuristic_plans, schedule)
    refined, notes = refine_homes(problem, chosen, schedule)
    if not notes:
        return chosen.decisions
    deferred = defer_writes(refined)
    if not (deferred.fits and deferred.sim.step_time_s <= chosen.sim.step_time_s):
        return chosen.decisions
    return replace(deferred.decisions, notes=(*chosen.decisions.notes, *notes))


def _choose(problem, heuristic_plans, schedule):
    """The MIP's plan or the best heuristic's (the incumbent), whichever the simulator ranks
    faster, as a scheduled plan (policy "ilp")."""
    best, notes, incumbent = _solve_rounds(problem, heuristic_plans, schedule)
    if best is not None and (incumbent is None or best.sim.step_time_s <= incumbent[1].sim.step_time_s):
        return _with(best, notes + ["chosen: the MIP's plan"])
    if incumbent is not None:
        why = ("no MIP plan fit in the simulator within the rounds and time budget" if best is None else
               f"the simulator ranks it faster ({incumbent[1].sim.step_time_s:.4g} s vs {best.sim.step_time_s:.4g} s)")
        return _with(incumbent[1], notes + [f"chosen: the incumbent from {incumbent[0]}: {why}"])
    assignment = {b: Combo("recompute", problem.home("activations"), problem.home("params"),
                           problem.home("optimizer"), "cpu") for b in problem.order}
    dec = decisions_from(problem, assignment, notes=(*notes, "no feasible plan found; smallest-footprint decisions"))
    return schedule(problem, dec)


def _why_not(problem, res: IlpResult, prefetch: int, caps: dict[str, float], bound: float | None) -> str:
    """A note for a MIP that found no plan: what its capacity rows ask for beyond resident bytes."""
    if not res.status.startswith("Infeasible"):
        return f"{res.status} ({res.message})"
    tr = transient(problem, prefetch)
    beyond = (f"the blocks in flight need {tr['gpu'] + tr['gpu_stream']:.0f} MiB of the GPU's {caps['gpu']:.0f} "
              f"and {tr['dram']:.0f} MiB of DRAM's {caps['dram']:.0f} besides what stays resident")
    if bound is None:
        return f"no assignment fits the MIP's capacity rows ({beyond})"
    return (f"no assignment fits the MIP's capacity rows with an analytic time under the incumbent's "
            f"{bound:.4g} s ({beyond})")


def _with(pl, notes: list[str]):
    return replace(pl, decisions=replace(pl.decisions, policy="ilp", notes=tuple(notes)))


def _solve_rounds(problem, heuristic_plans, schedule):
    """The MIP's best plan over the prefetch depths and capacity rounds (None if none fit), its
    notes, and the incumbent (name, plan) or None."""
    incumbent = None
    for name, pl in heuristic_plans(problem).items():
        if pl.fits and (incumbent is None or pl.sim.step_time_s < incumbent[1].sim.step_time_s):
            incumbent = (name, pl)
    start, bound = None, None
    if incumbent is not None:
        cs = combos(problem)
        dec = incumbent[1].decisions.blocks
        start = {b: Combo(d.activations, d.checkpoint, d.params, d.states, d.optimizer) for b, d in dec.items()}
        if all(c in cs for c in start.values()):
            bound = analytic(problem, start)
        else:
            start = None
    best, notes = None, []
    deadline = time.monotonic() + TOTAL_BUDGET_S
    for prefetch in PREFETCH_CANDIDATES:  # the MIP's transient memory depends on the prefetch depth
        caps = {t: v / MiB for t, v in problem.capacity().items()}
        for rnd in range(ROUNDS):
            left = deadline - time.monotonic()
            if left <= 1:
                notes.append(f"{SEARCH_NOTE}prefetch {prefetch}: skipped, the MIP time budget ({TOTAL_BUDGET_S:.0f} s) is spent")
                break
            res = solve(problem, caps_mib=caps, prefetch=prefetch, bound=bound, start=start,
                        time_limit=min(TIME_LIMIT_S, left))
            if not res.feasible:
                notes.append(f"{SEARCH_NOTE}prefetch {prefetch}, MIP round {rnd + 1}: {_why_not(problem, res, prefetch, caps, bound)}")
                break
            assignment = assign(problem, res.counts)
            pl = schedule(problem, decisions_from(problem, assignment, prefetch=prefetch))
            over = pl.over_capacity()
            notes.append(f"{SEARCH_NOTE}prefetch {prefetch}, MIP round {rnd + 1}: {res.status}, analytic {res.objective:.4g} s, "
                         f"simulated {pl.sim.step_time_s:.4g} s" + (f", over capacity on {sorted(over)}" if over else ""))
            if not over:
                if best is None or pl.sim.step_time_s < best.sim.step_time_s:
                    best = pl
                break
            for tier, (need, cap) in over.items():
                caps[tier] -= (need - cap) * 1.05 / MiB + 1
    if best is not None:
        best, refined = refine_tail(problem, best, schedule)
        notes += refined
    return best, notes, incumbent
