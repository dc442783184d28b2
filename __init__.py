"""tensorstow: stowage plans for training models far larger than GPU memory.

The package is laid out by pipeline stage: `tensorstow.ir` (trace a model into the
tensor-lifetime IR), `tensorstow.planner` (hardware, cost model, policies, simulator, plan
JSON, CLI) and `tensorstow.executor` (replay a plan every step). The Python API is
`tensorstow.plan(...)`, `tensorstow.Plan` and `tensorstow.Executor(plan, model)` (see
`tensorstow.api`).
"""

__version__ = "0.1.0"


class TensorstowError(ValueError):
    """Bad input from a user: a message that names the problem and how to fix it."""


def __getattr__(name):  # the Python API, imported on first use (torch is slow to import)
    if name in ("plan", "Plan", "Executor"):
        from tensorstow import api
        return getattr(api, name)
    raise AttributeError(f"module 'tensorstow' has no attribute {name!r}")
