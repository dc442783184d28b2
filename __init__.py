"""tensorstow: stowage plans for training models far larger than GPU memory.

The package is laid out by pipeline stage, each layer importing only the ones before it:
`tensorstow.ir` (trace a model into the tensor-lifetime IR), `tensorstow.schema` (the plan's
typed contract), `tensorstow.planner` (cost model, policies, lowering, simulator),
`tensorstow.executor` (replay a plan every step), `tensorstow.calibrate` (measure this machine,
the executor's own machinery included), and on top `tensorstow.cli` and `tensorstow.api`. The Python API is
`tensorstow.plan(...)`, `tensorstow.Plan` and `tensorstow.Executor(plan, model)` (see
`tensorstow.api`).
"""

__version__ = "0.1.0"

from tensorstow.errors import TensorstowError  # noqa: F401  (re-exported for users)


def __getattr__(name):  # the Python API, imported on first use (torch is slow to import)
    if name in ("plan", "Plan", "Executor", "ExecutorConfig"):
        from tensorstow import api
        return getattr(api, name)
    raise AttributeError(f"module 'tensorstow' has no attribute {name!r}")
