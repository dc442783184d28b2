"""One module per policy, all with one signature: `plan(problem) -> Decisions` (decisions only;
`planner.passes.schedule` lowers and simulates them). The heuristics are registered here, so
the ILP can start from their plans; `planner.plan.POLICIES` lists every policy."""
from __future__ import annotations

from tensorstow.planner.policies import all_gpu, dos, lohan, stronghold, zero_infinity
from tensorstow.planner.passes import check_fences, defer_writes, schedule
from tensorstow.planner.problem import Problem
from tensorstow.planner.result import PlanResult

HEURISTICS = {"all-gpu": all_gpu.plan, "zero-infinity": zero_infinity.plan, "lohan": lohan.plan,
              "stronghold": stronghold.plan, "dos": dos.plan}
"""The heuristic policies by name, in the order `auto` and the ILP's incumbent search try them."""


def planned(problem: Problem, name: str, decide) -> PlanResult:
    """Policy `name`'s plan for `problem` (`decide(problem)` gives its decisions), scheduled once
    per problem: `auto` and the ILP's incumbent search both need every heuristic's plan."""
    cache = problem.plans
    if name not in cache:
        cache[name] = defer_writes(schedule(problem, decide(problem), wait=True))
        check_fences(cache[name])
    return cache[name]


def heuristic_plans(problem: Problem) -> dict[str, PlanResult]:
    """Every heuristic policy's plan for `problem` (feasible or not), by policy name."""
    return {name: planned(problem, name, decide) for name, decide in HEURISTICS.items()}
