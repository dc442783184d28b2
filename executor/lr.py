"""The learning rate of each optimizer step: a runtime input of the optimizer lane (it changes no
instruction), with the semantics and names of transformers' `get_scheduler`:

    constant              lr
    constant_with_warmup  lr * k / warmup during the first `warmup` steps, then lr
    linear                the warmup, then down to 0 at step `total`
    cosine                the warmup, then half a cosine period down to 0 at step `total`

k is the number of optimizer updates taken before this one (0 for the first, whose warmup rate is
0, as LambdaLR's first), so a resumed run, which restores that count, continues the schedule, and
an fp16 step whose update overflow skipped does not advance it (the Trainer steps its scheduler
only after an update). Past `total` (a run resumed with more steps and its schedule's length
kept: executor/record.py) linear and cosine stay at their end's rate. `min_lr_ratio` r > 0 ends linear and cosine at r * lr instead of 0:
factor -> factor * (1 - r) + r after the warmup (transformers' `cosine_with_min_lr`). The factor is
computed as transformers computes it and multiplied into lr as LambdaLR does, so the rates are
the same floats.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tensorstow.errors import TensorstowError
from tensorstow.schema.options import LR_SCHEDULERS as SCHEDULERS


@dataclass(frozen=True)
class LRSchedule:
    """One run's schedule (the module docstring)."""
    name: str
    """One of SCHEDULERS."""
    lr: float
    """The peak rate."""
    warmup_steps: int = 0
    total_steps: int = 0
    """Optimizer steps of the whole run (linear and cosine end there)."""
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if self.name not in SCHEDULERS:
            raise TensorstowError(f"unknown lr scheduler '{self.name}': use one of {', '.join(SCHEDULERS)}")
        if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.lr < math.inf:
            raise TensorstowError(f"lr schedule: need a finite lr >= 0, warmup steps >= 0 and 0 <= min lr ratio <= 1; got "
                                  f"lr {self.lr}, {self.warmup_steps} warmup steps, min lr ratio {self.min_lr_ratio}")
        if self.name == "constant" and self.warmup_steps:
            raise TensorstowError("the constant lr scheduler has no warmup: use constant_with_warmup")
        if self.name in ("linear", "cosine") and self.total_steps < 1:
            raise TensorstowError(f"the {self.name} lr scheduler needs the run's length in optimizer steps "
                                  f"(total_steps >= 1)")

    def factor(self, k: int) -> float:
        """lr's multiplier at the update after `k` updates."""
        if self.name == "constant":
            return 1.0
        if k < self.warmup_steps:
            return float(k) / float(max(1, self.warmup_steps))
        if self.name == "constant_with_warmup":
            return 1.0
        k = min(k, self.total_steps)  # past the end (a resumed run made longer): the end's rate
        span = float(max(1, self.total_steps - self.warmup_steps))
        if self.name == "linear":
            f = float(self.total_steps - k) / span
        else:
            f = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * (float(k - self.warmup_steps) / span)))
        if self.min_lr_ratio:
            f = f * (1 - self.min_lr_ratio) + self.min_lr_ratio
        return max(0.0, f)

    def __call__(self, k: int) -> float:
        return self.lr * self.factor(k)
