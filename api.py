"""The Python API: `tensorstow.plan(...)`, `tensorstow.Plan` and `tensorstow.Executor(plan, model)`.

    plan = tensorstow.plan("hf:./tiny-llama", hw="local", gpu_mem="64MB", batch=4, seq=128)
    ex = tensorstow.Executor(plan, model)      # the model the plan was made for
    loss = ex.step(x, y)                       # one training step, as the plan schedules it
    tensorstow.Plan.load("p.json")             # a plan file, typed and immutable (what `Executor` also takes)

`model_or_spec` is what the CLI takes (a preset, `hf:DIR`, `pkg.module:factory`) or an
`nn.Module` itself; a Hugging Face causal LM (or a PEFT model around one) gets the loss
contract of `tensorstow.ir.hf`.
"""
from __future__ import annotations

import dataclasses
import inspect
import textwrap

import torch.nn as nn

from tensorstow.executor.executor import Executor, ExecutorConfig
from tensorstow.planner.plan import make_plan
from tensorstow.planner.result import PlanResult
from tensorstow.schema.options import asked, from_asked
from tensorstow.schema.plan import Plan

__all__ = ["plan", "Plan", "Executor", "ExecutorConfig"]


def plan(model_or_spec, **options) -> PlanResult:
    """Trace the model and plan one training step; the options are `tensorstow plan`'s (the fields
    of `tensorstow.schema.options.Options`, `hw` for hardware; listed below with their defaults).
    Sizes are bytes or strings ("200MB"). An unknown keyword raises one TensorstowError naming it.
    Returns the planning result: `.to_plan()` is the typed `Plan` (what the file holds),
    `.dumps()` its text, `.fits`, `.sim.step_time_s` the simulation; raises TensorstowError
    with one line naming the problem when it cannot."""
    from tensorstow.calibrate import hardware_for
    from tensorstow.ir.hf import wrap

    module = wrap(model_or_spec) if isinstance(model_or_spec, nn.Module) else None
    name = f"<{type(model_or_spec).__name__}>" if module is not None else str(model_or_spec)
    o = from_asked(name, options, "tensorstow.plan")
    return make_plan(o, hardware_for(o), model=module)


def _signature_and_doc(fn) -> None:
    """`fn(model_or_spec, *, OPTION=DEFAULT, ...)` as `inspect.signature` and `help()` show it,
    and the options' docstrings under its own: derived from `Options`, not written twice."""
    params = [inspect.Parameter("model_or_spec", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    lines = ["", "", "    Options (keyword=default: meaning):", ""]
    for o in asked():
        if o.default is dataclasses.MISSING:
            continue
        tp = o.type | None if o.optional else o.type
        params.append(inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default,
                                        annotation=(int | str | None) if o.size else tp))
        lines += textwrap.wrap(f"{o.name}={o.default!r}: {o.doc}", 100, initial_indent="        ",
                               subsequent_indent="            ")
    fn.__signature__ = inspect.Signature(params, return_annotation=PlanResult)
    fn.__doc__ = (fn.__doc__ or "") + "\n".join(lines)  # None under python -OO


_signature_and_doc(plan)
