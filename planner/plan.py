"""Planning: model + hardware + options -> decisions -> static schedule -> predictions.

`make_plan()` is the whole `plan` pipeline: trace -> profiles -> policy decisions ->
lowering -> simulation -> memory check -> `PlanResult` (planner.problem), whose `to_plan()` is
the typed plan file (`schema.plan.Plan`). Same inputs give byte-identical JSON.
"""
from __future__ import annotations

import dataclasses
import gc
import threading
from contextlib import contextmanager

from tensorstow.errors import TensorstowError
from tensorstow.planner import cost
from tensorstow.planner.policies import HEURISTICS, ilp, lohan, mobius, planned
from tensorstow.planner.problem import Problem, build_problem, data_parallel_share
from tensorstow.planner.result import PlanResult, infeasible_message
from tensorstow.schema.hardware import Hardware
from tensorstow.schema.options import Options

POLICIES = {**HEURISTICS, "fuyou": lohan.fuyou, "ilp": ilp.plan, "mobius": mobius.plan, "gpipe": mobius.gpipe,
            "zero3-dp": mobius.zero3_dp}
"""Every policy by name: `plan(problem) -> Decisions`."""
BASELINES = ("gpipe", "zero3-dp")
"""Multi-GPU baselines for comparison (Mobius §4): planned when named, never chosen by `auto`."""
SUBSUMED = ("fuyou",)
"""Policies `auto` leaves out because another one's search includes all their plans (lohan's)."""


def check_policy(name: str) -> None:
    if name != "auto" and name not in POLICIES:
        raise TensorstowError(f"unknown policy '{name}': use one of {sorted(POLICIES) + ['auto']}")


def policy_plan(problem: Problem, name: str) -> PlanResult:
    """One policy's plan for `problem`, computed once per problem."""
    return planned(problem, name, POLICIES[name])


def plan_problem(problem: Problem, policy: str) -> PlanResult:
    """Plan with one policy, or with `auto`: every policy, keeping the fastest feasible; with
    `--expert-groups 0`, with the group count it chooses (`expert_groups_chosen`). The replays
    the search kept (`Problem.replays`) go once it is done."""
    try:
        with fewer_collections():
            if problem.options.expert_groups == 0:
                plan = expert_groups_chosen(problem, policy)
            else:
                plan = _plan_with(problem, policy)
        plan.problem.replays.clear()  # a problem made for the plan (data parallel, expert groups)
        return plan
    finally:
        problem.replays.clear()


def _plan_with(problem: Problem, policy: str) -> PlanResult:
    table = POLICIES
    micro = problem.options.microbatches
    if micro > 1 and policy not in ("auto", "mobius"):  # refused, never ignored
        raise TensorstowError(f"--microbatches {micro}: the {policy} policy trains one microbatch a step; gradient "
                              f"accumulation over microbatches is the mobius policy's (--policy mobius, or auto), "
                              f"or leave --microbatches out")
    accum = problem.options.grad_accum
    if accum > 1 and (micro > 1 or policy in ("mobius", *BASELINES)):
        raise TensorstowError(f"--grad-accum {accum}: " + (
            "a pipeline accumulates over --microbatches instead; give one of the two" if micro > 1 else
            f"the {policy} policy pipelines microbatches over GPUs; accumulate with its --microbatches, or plan "
            f"--grad-accum with a one-GPU policy (auto, lohan, zero-infinity, ...)"))
    dp = problem.options.dp
    if dp > 1 and policy in ("mobius", *BASELINES):  # refused, never ignored
        raise TensorstowError(f"--dp {dp}: each rank runs a one-GPU plan; plan it with a one-GPU policy (auto, lohan, "
                              f"zero-infinity, ilp, ...), not {policy}")
    groups = problem.options.expert_groups
    if groups > 1 and (micro > 1 or policy in ("mobius", *BASELINES) or len(problem.hw.gpus) > 1):  # refused, never ignored
        raise TensorstowError(f"--expert-groups {groups}: pipelines place whole layers; plan the groups on one GPU "
                              f"(--gpus 1) with a one-GPU policy (auto, lohan, zero-infinity, ilp, ...)"
                              + (" and no --microbatches (--grad-accum accumulates)" if micro > 1 else ""))
    if policy == "auto":  # Mobius only where there are several GPUs or microbatches; baselines never
        names = [n for n in sorted(table) if n not in BASELINES + SUBSUMED
                 and (n != "mobius" or (len(problem.hw.gpus) > 1 and accum == 1) or micro > 1)
                 and (n == "mobius" or micro <= 1)]
        gpus = len(problem.hw.gpus)
        replicas = gpus > 1 and dp == 1 and micro <= 1 and groups == 1  # every GPU a replica of a one-GPU plan
        plans = {}
        for name in names:
            try:
                plans[name] = policy_plan(problem, name)
            except TensorstowError:
                if not (replicas and name == "mobius"):  # no pipeline fits: data parallel may
                    raise
        if replicas:
            plans[f"data-parallel x{gpus}"] = _plan_with(data_parallel(problem, gpus), "auto")
        feasible = {n: p for n, p in plans.items() if p.fits}
        if not feasible:
            return min(plans.values(), key=lambda p: sum(n for n, _ in p.over_capacity().values()))
        name = min(sorted(feasible), key=lambda n: feasible[n].time_per_sample)  # a pipeline's step has M microbatches
        times = ", ".join(f"{n} {p.sim.step_time_s:.4g} s" + (f"/{p.samples} samples" if p.samples > 1 else "")
                          + ("" if p.fits else " (does not fit)") for n, p in sorted(plans.items()))
        return with_note(feasible[name], f"auto chose {name}: {times}")
    check_policy(policy)
    return policy_plan(problem, policy)


def data_parallel(problem: Problem, ranks: int) -> Problem:
    """`problem` as `ranks` data-parallel replicas on its machine's GPUs (`Options.dp`), each
    planned on its share (`data_parallel_share`)."""
    o = dataclasses.replace(problem.options, dp=ranks, nodes=1, gpus=ranks)
    return dataclasses.replace(problem, options=o, hw=data_parallel_share(o, problem.hw), machine=problem.hw)


ARENA_TRIES = 6
"""Plannings `make_plan` makes at most to fit the DRAM arenas in the DRAM budget."""


def arena_bytes(plan: PlanResult) -> int:
    """DRAM the executor processes of the plan allocate up front: each one's arena for overlap mode
    (at least sync mode's), all of them on the one host."""
    return sum(p.overlap for p in plan.pools.values())


EXPERT_GROUP_CHOICES = (1, 2, 4, 8)
"""The group counts `--expert-groups 0` plans with (those a layer has experts for)."""


def make_plan(options: Options, hw: Hardware, model=None) -> PlanResult:
    problem = build_problem(options, hw, model)
    plan = plan_problem(problem, options.policy)
    over = plan.over_capacity()
    if over:
        raise TensorstowError(infeasible_message(plan, over))
    return _within_arena(plan, problem, options.policy)


PLANNING_GC_THRESHOLD = 50_000
"""Allocations between two collections of the garbage collector's youngest generation while
planning (`fewer_collections`; Python's default: 700)."""

_collections = threading.Lock()
_planning = 0
"""Plannings in progress (`fewer_collections`)."""
_thresholds = gc.get_threshold()
"""The collector's thresholds from before the plannings in progress."""


@contextmanager
def fewer_collections():
    """Python's garbage collector collecting its youngest generation every PLANNING_GC_THRESHOLD
    allocations while planning, its thresholds restored after. A plan's search allocates millions
    of short-lived objects (instructions, their replays' events) beside a large long-lived heap
    (torch, the traced model): at the default threshold enough of them live through two young
    collections to set off a full one every few replays, a fifth to a quarter of the planning
    time. Planning makes little cyclic garbage, which is then collected a little later. A
    collector made to collect nothing (threshold 0) stays so."""
    global _planning, _thresholds
    with _collections:
        if not _planning:
            _thresholds = gc.get_threshold()
            if _thresholds[0]:
                gc.set_threshold(max(PLANNING_GC_THRESHOLD, _thresholds[0]), *_thresholds[1:])
        _planning += 1
    try:
        yield
    finally:
        with _collections:
            _planning -= 1
            if not _planning:
                gc.set_threshold(*_thresholds)


def with_note(plan: PlanResult, note: str) -> PlanResult:
    return dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, notes=(*plan.decisions.notes, note)))


def expert_groups_chosen(problem: Problem, policy: str) -> PlanResult:
    """`--expert-groups 0`: the plan with each count of EXPERT_GROUP_CHOICES the model's layers have
    experts for (one GPU, no pipeline: otherwise 1 only), the fastest that fits (the fewer groups
    on a tie), with a note that says so. The plan's options keep the 0 asked for (replanning it,
    as `check` and the DRAM arena's tighter budgets do, chooses again); its units are the chosen
    count's."""
    o = problem.options
    one_gpu = len(problem.hw.gpus) == 1 and o.microbatches <= 1 and policy not in ("mobius", *BASELINES)
    tries = []
    for n in EXPERT_GROUP_CHOICES if one_gpu else (1,):
        profiles = cost.profiles(problem.graph, problem.hw, n) if n > 1 else problem.profiles
        if n > 1 and not any(len(p.units) == n for p in profiles.values()):
            break  # a layer has fewer experts than n, or the model none
        tries.append((n, _plan_with(dataclasses.replace(problem, profiles=profiles), policy)))
    n, best = min([t for t in tries if t[1].fits] or tries, key=lambda t: (t[1].sim.step_time_s, t[0]))
    if not one_gpu:
        return with_note(best, "--expert-groups 0: one group a layer (pipelines place whole layers)")
    steps = ", ".join(f"{k}: {r.sim.step_time_s:.4g} s" + ("" if r.fits else " (does not fit)") for k, r in tries)
    return with_note(best, f"--expert-groups 0 chose {n} ({steps})")


def _within_arena(plan: PlanResult, problem: Problem, policy: str) -> PlanResult:
    """`plan`, or where its DRAM arenas (`arena_bytes`: the simulated peak and the pages best-fit
    placement leaves between copies in overlap mode's order) exceed the DRAM budget, a plan made
    with DRAM held back from what the policy may fill, until they fit (gpt3-2.7b from SSD under
    --dram 6GB: 5.91 GB simulated peak, a 6.17 GB arena). The plan keeps the budget it was asked
    for; a note says what was held back, or, where no plan fits that way, by how much the arena
    exceeds the budget."""
    if plan.problem.machine is not None and problem.machine is None:  # auto chose data parallel: its ranks' terms
        problem, policy = plan.problem, "auto"
    cap = problem.capacity()["dram"]
    first, held = arena_bytes(plan), 0
    arena = first
    for _ in range(ARENA_TRIES):
        if arena <= cap:
            break
        # at least the excess more, and at least doubling: a policy fills what it is given, and
        # the pages between small copies can be a large share of it
        held = max(held + arena - cap, 2 * held)
        if held >= cap:
            break
        dram = dataclasses.replace(problem.hw.dram, capacity_bytes=cap - held)
        tighter = plan_problem(dataclasses.replace(problem, hw=dataclasses.replace(problem.hw, dram=dram)), policy)
        if not tighter.fits:
            break
        arena = arena_bytes(tighter)
        if arena <= cap:
            plan = dataclasses.replace(tighter, problem=dataclasses.replace(tighter.problem, hw=problem.hw))
    if arena <= cap and held:
        note = (f"planned with {held / 1e6:.4g} MB of DRAM held back, so the overlap-mode arena "
                f"({arena / 1e6:.4g} MB) fits --dram")
    elif first > cap:
        note = (f"the overlap-mode DRAM arena ({first / 1e6:.4g} MB) exceeds --dram by {(first - cap) / 1e6:.4g} MB: "
                f"the pages best-fit placement leaves between copies; no plan with DRAM held back fits")
    else:
        return plan
    return dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, notes=(*plan.decisions.notes, note)))
