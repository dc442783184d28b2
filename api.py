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

import torch.nn as nn

from tensorstow.executor.runtime import Executor
from tensorstow.planner.plan import make_plan
from tensorstow.planner.problem import PlanResult
from tensorstow.schema.options import Options
from tensorstow.schema.plan import Plan

__all__ = ["plan", "Plan", "Executor"]


def plan(model_or_spec, *, hw: str = "local", policy: str = "auto", batch: int = 0, seq: int = 0,
         precision: str | None = None, gpu_mem: int | str | None = None, dram: int | str | None = None,
         ssds: int | None = None, optimizer: str = "adamw", lr: float = 1e-4,
         betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
         exact_optimizer: bool = False, init_scale: float = 65536.0, growth_interval: int = 2000,
         gpus: int | None = None, microbatches: int = 0, mapping: str = "cross") -> PlanResult:
    """Trace the model and plan one training step for the hardware `hw` (a preset, a spec file
    or "local"); the same options as `tensorstow plan` (precision defaults to bf16-mixed). Sizes are bytes or strings ("200MB").
    Returns the planning result: `.to_plan()` is the typed `Plan` (what the file holds),
    `.dumps()` its text, `.fits`, `.sim.step_time_s` the simulation; raises TensorstowError
    with one line naming the problem when it cannot."""
    from tensorstow.calibrate import hardware_for
    from tensorstow.ir.hf import wrap
    from tensorstow.schema.hardware import parse_size

    module = wrap(model_or_spec) if isinstance(model_or_spec, nn.Module) else None
    name = f"<{type(model_or_spec).__name__}>" if module is not None else str(model_or_spec)
    size = lambda v: parse_size(v) if isinstance(v, str) else v  # noqa: E731
    o = Options(model=name, hardware=hw, policy=policy, batch=batch, seq=seq,
                **({"precision": precision} if precision else {}), gpu_mem=size(gpu_mem), dram=size(dram), ssds=ssds, optimizer=optimizer, lr=lr,
                betas=tuple(betas), eps=eps, weight_decay=weight_decay, exact_optimizer=exact_optimizer,
                init_scale=init_scale, growth_interval=growth_interval, gpus=gpus, microbatches=microbatches,
                mapping=mapping)
    return make_plan(o, hardware_for(o), model=module)
