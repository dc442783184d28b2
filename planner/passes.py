"""The one yardstick every policy's decisions are measured with, `schedule`, and the named passes
it runs: each decides one thing the policies leave open by lowering and simulating both ways.

    schedule            accumulating -> speculate_or_wait | reads_first
    accumulating        where accumulated gradients wait between microbatches (GPU, DRAM, SSD)
    speculating         which CPU updates may run before the clip's norm is known
    speculate_or_wait   the faster clipping form, by simulated time and the clip rate
    reads_first         SSD reads a computation waits for ahead of queued writes; copies that
                        wait for room (`wait_for_room`) for a policy's final plan
    keep_params         an fp32 CPU update reads the backward's DRAM copy of its parameters
    defer_writes        the last blocks' write-backs carried into the next step
    lower_and_simulate  decisions lowered (planner.lower, planner.pipeline), simulated, fenced
    check_fences        a final plan's memory fences change nothing of its replay
"""
from __future__ import annotations

import dataclasses

from tensorstow.planner import cost
from tensorstow.planner.lower import buffers_for, lower, units_of
from tensorstow.planner.pipeline import lower_pipeline, pipeline_buffers
from tensorstow.planner.problem import Problem, waits_for_every_gradient
from tensorstow.planner.result import PlanResult, durations, fmt_bytes
from tensorstow.planner.simulate import SimResult, compute_slowdown, contention, simulate
from tensorstow.schema.options import ssd_kinds
from tensorstow.schema.schedule import (TIERS, Decisions, Instr, InstrKind, carried_buffers, final_residency,
                                        initial_residency, is_gpu)


def schedule(problem: Problem, decisions: Decisions, wait: bool = False) -> PlanResult:
    """Lower decisions and simulate them: the one yardstick every policy is measured with.
    `wait` (a policy's final plan, `policy_plan`): a plan over capacity is replayed again with copies
    that wait for room (`wait_for_room`) and kept where that fits. Policies search without it: a
    candidate that fits only by waiting ranks as one that does not, as before, so waiting rescues a
    plan whose probed timings let a prefetch take the memory of what runs before it, and changes
    no plan that fits without it. What refines a chosen plan (ilp's homes, `defer_writes`) replays
    its candidates as that plan is replayed, waits included.
    A plan that reads from SSD runs the reads a computation waits for ahead of queued writes
    (`Decisions.ssd_reads_first`) where that still fits, else keeps every read in program order.
    An fp32 plan whose CPU updates read parameters from SSD is replayed both ways and keeps the
    backward's DRAM copy of them for the update (`Decisions.keep_params_for_update`) where
    that still fits and is not slower; the DeepSpeed baseline reads them again, as DeepSpeed does.
    With gradient accumulation (`Options.grad_accum`) the accumulated gradients wait between
    microbatches on the GPU, else in DRAM, else on SSD: the first of those that fits (each moves
    more than the one before it), unless the decisions already place them."""
    candidates = accumulating(problem, decisions)
    if len(candidates) > 1:
        for d in candidates:
            r = schedule(problem, d, wait)
            if r.fits:
                return r
        return r
    decisions = candidates[0]
    spec = speculating(problem, decisions)
    if spec is not None:  # deferred write-backs are decided for the speculating form (`speculate_or_wait`)
        return speculate_or_wait(problem, spec, dataclasses.replace(decisions, speculated=(), deferred_writes=()), wait)
    return reads_first(problem, dataclasses.replace(decisions, speculated=()), wait)


def reads_first(problem: Problem, decisions: Decisions, wait: bool) -> PlanResult:
    """`schedule` once the accumulation tiers and the speculation are decided."""
    reads_ssd = any("ssd" in (d.params, d.states, d.checkpoint) or d.activations == "swap_ssd"
                    for d in decisions.blocks.values())
    if reads_ssd and decisions.pipeline is None and not decisions.ssd_reads_first:
        first = keep_params(problem, dataclasses.replace(decisions, ssd_reads_first=True))
        if first.fits:
            return first
    r = keep_params(problem, decisions)
    if wait and not r.fits:
        waited = lower_and_simulate(problem, r.decisions, wait=True)
        if waited.fits:
            return waited
    return r


def accumulating(problem: Problem, decisions: Decisions) -> list[Decisions]:
    """The decisions with `Options.grad_accum`: as they are where they place every accumulated
    gradient already (or there is no accumulation), else one candidate per tier the accumulated
    gradients may wait on (`BlockDecision.accum`), fastest first."""
    k = problem.options.grad_accum
    if k <= 1 or decisions.pipeline is not None:
        return [decisions]
    if decisions.grad_accum == k and all(d.accum for d in decisions.blocks.values()):
        return [decisions]
    return [dataclasses.replace(decisions, grad_accum=k,
                                blocks={b: dataclasses.replace(d, accum=t) for b, d in decisions.blocks.items()})
            for t in TIERS if t != "ssd" or "optimizer" in ssd_kinds(problem.options)]


def speculating(problem: Problem, decisions: Decisions) -> Decisions | None:
    """With clipping or fp16 loss scaling (whose updates would wait for every gradient), the
    decisions that update speculatively every block whose update can be redone exactly
    (`Decisions.speculated`: CPU updates of state whose home is SSD, so the last commit still holds
    it: fp32's P, OS, mixed precision's M, OS); None where none can, or the plan cannot speculate
    (pipelines, updates after the backward by design)."""
    o = problem.options
    if not waits_for_every_gradient(o) or decisions.pipeline is not None or not decisions.overlap_optimizer:
        return None
    decisions = dataclasses.replace(decisions, deferred_writes=())
    bufs = buffers_for(problem.order, problem.profiles, problem.profile_of, decisions, problem.mixed)
    state = ("M", "OS") if problem.mixed else ("P", "OS")

    def redoable(b: str) -> bool:  # the block and each of its units (expert groups)
        owners = [b, *units_of(b, problem.profiles[problem.profile_of[b]])]
        return all(f"G:{o}" not in bufs or decisions.of(o).optimizer == "cpu"
                   and all(bufs[f"{k}:{o}"].home == "ssd" for k in state) for o in owners)
    blocks = tuple(b for b in problem.order if f"G:{b}" in bufs and redoable(b))
    return dataclasses.replace(decisions, speculated=blocks) if blocks else None


def speculate_or_wait(problem: Problem, spec: Decisions, waiting: Decisions, wait: bool) -> PlanResult:
    """The faster of the two clipping forms, by simulated time: every update waiting for the
    norm, or the speculated ones overlapped with the backward at the price of the redo program
    in the expected fraction of steps whose clip fires (`Options.clip_rate`). For a policy's final
    plan (`wait`) the speculating one is compared with its write-backs deferred where faster."""
    a = reads_first(problem, waiting, wait)
    b = reads_first(problem, spec, wait)
    if not b.fits:
        return a
    if wait:  # a policy's final plan: speculating, it may also defer its last write-backs (`defer_writes`)
        b = defer_writes(b)
    redo = b.redo_program[1]
    expected = b.sim.step_time_s + problem.options.clip_rate * redo
    if a.fits and a.sim.step_time_s <= expected:
        return a
    note = (f"clipping: {len(spec.speculated)} CPU updates speculate (overlapped with the backward, redone from "
            f"the last commit when the clip fires or fp16 gradients overflow): step {b.sim.step_time_s:.4g} s + clip rate "
            f"{problem.options.clip_rate:g} x redo {redo:.4g} s = {expected:.4g} s expected, against "
            f"{a.sim.step_time_s:.4g} s with every update waiting for the norm" + ("" if a.fits else " (does not fit)"))
    return dataclasses.replace(b, decisions=dataclasses.replace(b.decisions, notes=(*b.decisions.notes, note)))


DEFERRED_MAX = 4
"""Blocks `defer_writes` tries to carry across the step boundary, at most."""


def defer_writes(plan: PlanResult) -> PlanResult:
    """The plan with the write-backs of the blocks updated last run at the start of the next step
    (`Decisions.deferred_writes`): one block, then two, ... while each is faster and still fits.
    Their updates end the step after its last backward, and their parameters begin the next one,
    so the step's tail of SSD writes overlaps the next forward and its first read is gone. One-GPU
    plans whose updates overlap the backward (with clipping or fp16 loss scaling, speculated ones:
    a redo restores a carried block from the commit the step made of the one before); not the
    zero-infinity baseline (DeepSpeed writes every subgroup back before the step ends)."""
    d, problem = plan.decisions, plan.problem
    if (d.pipeline is not None or not d.overlap_optimizer or d.policy == "zero-infinity"
            or (d.updates_wait and not d.speculated)
            or d.deferred_writes or not plan.fits):
        return plan
    updated = [i.segment for i in plan.instructions if i.kind == InstrKind.OPTIMIZER_STEP]
    blocks = [b for b in reversed(updated)
              if carried_buffers(dataclasses.replace(d, deferred_writes=(b,)), plan.buffers)]
    best, wait = plan, bool(plan.over_unless_waiting)  # replayed as the plan was: its copies may wait for room
    for k in range(1, min(DEFERRED_MAX, len(blocks)) + 1):
        r = lower_and_simulate(problem, dataclasses.replace(d, deferred_writes=tuple(blocks[:k])), wait=wait)
        if not r.fits or r.sim.step_time_s >= best.sim.step_time_s:
            break
        best = r
    return best


def keep_params(problem: Problem, decisions: Decisions) -> PlanResult:
    plain = lower_and_simulate(problem, decisions)
    eligible = (not problem.mixed and decisions.pipeline is None and decisions.policy != "zero-infinity"
                and not decisions.keep_params_for_update
                and any(d.params == "ssd" and d.optimizer == "cpu" for d in decisions.blocks.values()))
    if not eligible:
        return plain
    kept = lower_and_simulate(problem, dataclasses.replace(decisions, keep_params_for_update=True))
    if kept.fits and (not plain.fits or kept.sim.step_time_s <= plain.sim.step_time_s):
        return kept
    return plain


WAIT_NOTE = "copies wait for room on "
"""How the note a plan whose copies wait for room (`wait_for_room`) carries begins."""


def lower_and_simulate(problem: Problem, decisions: Decisions, wait: bool = False) -> PlanResult:
    """The decisions lowered (planner.lower, planner.pipeline), simulated and fenced (`replay`),
    with their notes. A policy's search and the passes after it replay many decisions more than
    once: each replay is kept for the problem (`Problem.replays`) and reused for equal decisions;
    their notes change nothing of it."""
    micro = decisions.microbatches()
    inputs = sum(t.nbytes for t in problem.graph.tensors if t.kind == "input")
    notes = tuple(n for n in decisions.notes if not n.startswith(WAIT_NOTE))  # this replay's own, added below
    decisions = dataclasses.replace(decisions, notes=(), device_reserved=micro * inputs,
                                    updates_wait=waits_for_every_gradient(problem.options), dp=problem.options.dp)
    key, kept = repr(decisions), problem.replays
    r = kept.get((key, wait))
    if r is None and wait:  # a replay that fits waits for nothing
        plain = kept.get((key, False))
        r = plain if plain is not None and plain.fits else None
    if r is None and not wait:  # a waiting replay whose copies waited for nothing is the plain one
        waited = kept.get((key, True))
        r = waited if waited is not None and not waited.over_unless_waiting else None
    if r is None:
        r = replay(problem, decisions, wait)
        kept.put((key, wait), r, len(r.instructions))
    return dataclasses.replace(r, decisions=dataclasses.replace(r.decisions, notes=(*notes, *r.decisions.notes)))


def replay(problem: Problem, decisions: Decisions, wait: bool) -> PlanResult:
    """`lower_and_simulate` of decisions without notes: its only note says where copies wait for
    room (`wait_for_room`, with `wait`)."""
    if decisions.pipeline is None:
        bufs = buffers_for(problem.order, problem.profiles, problem.profile_of, decisions, problem.mixed)
        instrs = lower(problem.order, problem.profiles, problem.profile_of, decisions, bufs, mixed=problem.mixed)
    else:
        bufs = pipeline_buffers(problem.order, problem.profiles, problem.profile_of, decisions, problem.mixed)
        instrs = lower_pipeline(problem.order, problem.profiles, problem.profile_of, decisions, bufs,
                                problem.gpu_capacity(), mixed=problem.mixed)
    dur = durations(problem, instrs, bufs, decisions)
    initial = initial_residency(bufs, decisions, problem.order)
    sizes = {n: b.bytes for n, b in bufs.items()}
    reserved = decisions.reserved()
    commit = cost.commit_time(problem.hw, instrs)
    final = final_residency(bufs, decisions, problem.order)
    sim = simulate(instrs, dur, sizes, initial, links=contention(instrs, problem.hw), reserved=reserved,
                   commit_s=commit, slowdown=compute_slowdown(problem.hw), final=final)
    over = {}
    caps = {**problem.gpu_capacity(), "dram": problem.capacity()["dram"]}
    if wait and any(sim.peak_bytes.get(t, 0) > c for t, c in caps.items()):
        fitted = wait_for_room(problem, instrs, dur, sizes, initial, reserved, commit, caps, final)
        if fitted is not None:
            over = {"gpu" if is_gpu(t) else t: (sim.peak_bytes[t], c) for t, c in caps.items()
                    if sim.peak_bytes.get(t, 0) > c}
            instrs, sim = fitted
            decisions = dataclasses.replace(decisions, notes=(*decisions.notes, WAIT_NOTE + ", ".join(
                f"{t} (without the waits {fmt_bytes(n)} at peak > {fmt_bytes(c)})" for t, (n, c) in sorted(over.items()))))
    return PlanResult(problem, decisions, bufs, fenced(instrs, sim, dur), sim, dur, over_unless_waiting=over)


def fenced(instrs: list[Instr], sim: SimResult, dur: list[float]) -> list[Instr]:
    """The instructions with their memory fences among their dependencies (sorted, each once, as
    `Emitter.emit` makes them) and what contention added to their durations (`Instr.contended_s`);
    an instruction itself where neither changes it (most of a search's candidates: no fence, no
    contention).

    Memory fences: an allocation waits for the releases that preceded it in the replay, so an
    executor whose real timing differs (overlap mode) never holds more than the simulated peak.
    They change no start or end of this replay, which stands for the fenced schedule
    (`check_fences` replays a policy's final plan to make sure)."""
    fences, out = sim.fences, []
    for ins, ran, d in zip(instrs, sim.durations, dur):
        f = fences.get(ins.id)
        contended = max(0.0, ran - d)
        if f:
            out.append(replaced(ins, deps=tuple(sorted(set(ins.deps).union(f))), contended_s=contended))
        elif contended != ins.contended_s:
            out.append(replaced(ins, deps=ins.deps, contended_s=contended))
        else:
            out.append(ins)
    return out


def replaced(ins: Instr, **fields) -> Instr:
    """`dataclasses.replace(ins, **fields)` in short: an `Instr` is its fields alone (no checks,
    nothing derived from them), and a plan's replays make one per fenced or contended instruction."""
    return Instr(*[fields[k] if k in fields else getattr(ins, k) for k in INSTR_FIELDS])


INSTR_FIELDS = tuple(f.name for f in dataclasses.fields(Instr))
"""An `Instr`'s fields, in order."""


def check_fences(plan: PlanResult) -> None:
    """The plan's memory fences change nothing of its replay: its instructions, the fences among
    their dependencies, replayed with the durations they ran for (host contention's stretch
    included) start and end as the replay they were taken from."""
    problem, d, instrs = plan.problem, plan.decisions, plan.instructions
    sizes = {n: b.bytes for n, b in plan.buffers.items()}
    fenced = simulate(instrs, plan.sim.durations, sizes, initial_residency(plan.buffers, d, problem.order),
                      links=contention(instrs, problem.hw), reserved=d.reserved(),
                      commit_s=cost.commit_time(problem.hw, instrs), final=final_residency(plan.buffers, d, problem.order))
    if (fenced.start, fenced.end) != (plan.sim.start, plan.sim.end):
        raise RuntimeError(f"internal: memory fences change the replay of the {d.policy} plan "
                           f"({fenced.step_time_s} s against {plan.sim.step_time_s} s)")


def wait_for_room(problem, instrs, dur, sizes, initial, reserved, commit, caps, final):
    """A replay over capacity, again with copies that wait for room (Fuyou §4.4's memory-aware
    prefetch: a copy that ran ahead of the computations before it in program order took their
    memory, because the probed timings let it). The waits become dependencies: on the releases that
    made room (memory fences) and on the instructions it let go first, so the executor keeps them
    under any timing. The instructions and their replay where that fits, else None."""
    links = contention(instrs, problem.hw)
    slow = compute_slowdown(problem.hw)
    waiting = simulate(instrs, dur, sizes, initial, links=links, reserved=reserved, commit_s=commit, slowdown=slow,
                       capacity=caps, final=final)
    if any(waiting.peak_bytes.get(t, 0) > c for t, c in caps.items()):
        return None
    extra = {i: set(waiting.waited.get(i, ())) | set(waiting.fences.get(i, ())) for i in waiting.waited}
    waits = [dataclasses.replace(i, deps=tuple(sorted(set(i.deps) | extra[i.id]))) if i.id in extra else i
             for i in instrs]
    fitted = simulate(waits, dur, sizes, initial, links=links, reserved=reserved, commit_s=commit, slowdown=slow,
                      final=final)
    if any(fitted.peak_bytes.get(t, 0) > c for t, c in caps.items()):
        return None
    return waits, fitted


