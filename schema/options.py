"""What a plan is asked for: the model, the hardware and the training recipe, as one typed,
keyword-only dataclass (a docstring under each field). The plan file records it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tensorstow.schema.typed import decode


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str
    """Preset name, `hf:DIR`, `pkg.module:factory`, or `<ClassName>` for a module given to the
    Python API (such a plan is executed from Python: `tensorstow.Executor(plan, model)`)."""
    hardware: str
    """Preset name, spec file, or "local"."""
    policy: str = "auto"
    batch: int = 0
    """Micro-batch size (0: the preset's default, else 1)."""
    seq: int = 0
    """Sequence length (0: the model's block_size)."""
    precision: str = "bf16-mixed"
    """fp32, bf16-mixed or fp16-mixed: each op in the dtype CUDA autocast gives it, fp32 masters
    and optimizer states, 16-bit compute copies of the weights autocast only reads cast."""
    gpu_mem: int | None = None
    dram: int | None = None
    ssds: int | None = None
    optimizer: str = "adamw"
    """Optimizer semantics of torch.optim.Adam / AdamW."""
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    exact_optimizer: bool = False
    """False (default): the fast update (csrc/adam.cpp on the CPU, with the fused downcast of the
    fresh compute copy; torch's fused kernel on a GPU), within a few ulps of torch's. True:
    torch.optim.Adam/AdamW(foreach=False), bit-identical with eager's default CPU path."""
    init_scale: float = 65536.0
    """fp16-mixed: dynamic loss scaling with torch.amp.GradScaler's semantics and defaults
    (initial scale, growth factor, backoff factor, growth interval); ignored otherwise."""
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    gpus: int | None = None
    """Override the hardware's GPU count (the first N GPUs; more repeat the last one)."""
    microbatches: int = 0
    """Pipelines: microbatches per step (0: as many as GPUs, Mobius §3.1); the step's batch is
    microbatches x batch."""
    mapping: str = "cross"
    """Pipelines: stage -> GPU mapping, cross (Mobius §3.3) or sequential."""

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        for k, default in _LATER_OPTIONS.items():  # keys added later appear once set, so older
            if d[k] == default:                    # plans keep their bytes
                del d[k]
        return d

    @staticmethod
    def from_json(d: dict, where: str = "plan options") -> "Options":
        return decode(Options, d, where)


_LATER_OPTIONS = {"gpus": None, "microbatches": 0, "mapping": "cross"}
