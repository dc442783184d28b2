"""Dynamic loss scaling for fp16-mixed plans, with torch.amp.GradScaler's semantics.

Eager PyTorch runs `scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`:
the backward starts from `loss * scale`, `step` unscales every gradient (`g * (1/scale)`,
fp32) and skips the optimizer if any is inf/NaN, `update` halves the scale after a skipped
step and doubles it after `growth_interval` clean ones. The executor does the same with the
gradients arriving block by block: the loss tangent is the scale (d(loss*scale)/dloss), each
backward segment's G buffer is checked for non-finite values on the device as it is made, and
the planner makes every optimizer step wait for the last backward (planner.lower), so the
skip is decided before any subgroup is updated or written back: a skipped step changes no
master, moment or compute copy, on any tier. Adam's step count advances only on steps taken.
"""
from __future__ import annotations

import torch

from tensorstow.schema.options import check_loss_scaling

AMP = "AMP"
"""Store buffer holding the scaler state at a commit: scale (fp32), growth tracker (int32) and
the number of optimizer steps taken (int64), 16 bytes."""


class LossScaler:
    def __init__(self, options, device: torch.device):
        self.growth_factor = float(options.growth_factor)
        self.backoff_factor = float(options.backoff_factor)
        self.growth_interval = int(options.growth_interval)
        check_loss_scaling(options)  # a plan file edited by hand: one line, as `plan` refuses it
        self.scale = torch.full((1,), float(options.init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        self._skip: bool | None = None

    def tangent(self, shape, dtype) -> torch.Tensor:
        """The loss tangent of a scaled backward: `scaler.scale(loss)` is loss * scale."""
        return self.scale.to(dtype).reshape(shape).clone()

    def check(self, grads: list[torch.Tensor]) -> None:
        """Record whether any of these gradients holds inf/NaN (multiplying by 1 changes none)."""
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, self._one)

    def skip(self) -> bool:
        """Whether this step's update is skipped (every gradient has been checked by now)."""
        if self._skip is None:
            self._skip = bool(self.found_inf.item())
        return self._skip

    def begin_step(self) -> None:
        """Forget a failed step's check: every step starts with no inf/NaN seen."""
        self.found_inf.zero_()
        self._skip = None

    def unscale_(self, grads32: list[torch.Tensor]) -> None:
        """GradScaler.unscale_: fp32 gradients times 1/scale, as its fused kernel computes it, on
        the gradients' own device (a CPU optimizer step's are host copies). Two parameters whose
        gradient is the same memory are unscaled once."""
        if not grads32:
            return
        unique = distinct(grads32)
        dev = grads32[0].device
        inv = self.scale.double().reciprocal().float().to(dev)
        torch._amp_foreach_non_finite_check_and_unscale_(unique, torch.zeros(1, device=dev), inv)

    def update(self) -> bool:
        """GradScaler.update at the end of a step; returns whether the step was skipped."""
        skipped = self.skip()
        torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)
        self.found_inf.zero_()
        self._skip = None
        return skipped

    def state_bytes(self, opt_steps: int) -> torch.Tensor:
        out = torch.zeros(16, dtype=torch.uint8)
        out[:4] = self.scale.cpu().view(torch.uint8)
        out[4:8] = self.growth_tracker.cpu().view(torch.uint8)
        out[8:] = torch.tensor([opt_steps], dtype=torch.int64).view(torch.uint8)
        return out

    def load_state(self, blob: torch.Tensor) -> int:
        """Restore the scale and tracker from `state_bytes`; returns the optimizer steps taken."""
        self.scale.copy_(blob[:4].clone().view(torch.float32))
        self.growth_tracker.copy_(blob[4:8].clone().view(torch.int32))
        return int(blob[8:].clone().view(torch.int64))


def distinct(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` without repeats of the same memory (a tied weight's gradient is scaled once)."""
    seen, out = set(), []
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out
