"""One module per policy; all share `plan(problem) -> Decisions` (see planner/policy.py)."""
