"""The eager oracle every executor test compares with: plain PyTorch training."""
import contextlib

import torch

from tensorstow.ir.autocast import gpu_autocast
from tensorstow.ir.trace import PRECISIONS


def param_groups(model, weight_decay: float, decay_all: bool = False) -> list[dict]:
    """torch.optim parameter groups of the trainable parameters: weight decay on those with two or
    more dimensions, none on biases and norm weights (nanoGPT's `configure_optimizers`), or on
    every one (`decay_all`)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    if decay_all:
        return [{"params": trained, "weight_decay": weight_decay}]
    groups = [{"params": [p for p in trained if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def train_eager(model, data, *, lr, weight_decay=0.0, optimizer="adamw", loss=lambda m, x, y: m(x, y),
                precision="fp32", scaler=None, microbatches=1, decay_all=False, make_optimizer=None,
                scheduler=None, max_grad_norm=None, norms=None, ignore=(-100,)):
    """Train `model` on `data` ((x, y) batches) with torch.optim.Adam/AdamW over its trainable
    parameters (`param_groups`: weight decay on those with two or more dimensions, unless
    `decay_all`), or the one `make_optimizer(model)` returns; `scheduler(optimizer)`: a learning
    rate scheduler stepped after each update; returns (losses, parameters by name).

    Mixed precision is eager AMP: fp32 parameters, the forward under autocast with CUDA's op
    lists (`gpu_autocast`: what torch.autocast("cuda") does, on CPU tensors), and for fp16 a
    `torch.amp.GradScaler` (`scaler`: its keyword arguments; `scaler["scales"]`, a list, receives
    the scale after every step). `microbatches` M > 1: gradient accumulation, each batch cut into
    M equal microbatches in order, each one's loss x (its labels / the batch's labels, labels
    in `ignore` left out: the Hugging Face Trainer's num_items_in_batch) back-propagated, one
    update per batch.
    `max_grad_norm`: `clip_grad_norm_` before each update (after GradScaler.unscale_); `norms`, a
    list, receives the norm it returns each step."""
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    opt = (make_optimizer(model) if make_optimizer is not None
           else cls(param_groups(model, weight_decay, decay_all), lr=lr, betas=(0.9, 0.999), eps=1e-8))
    sched = scheduler(opt) if scheduler is not None else None
    kw = dict(scaler or {})
    scales = kw.pop("scales", None)
    amp = torch.amp.GradScaler("cpu", **kw) if precision == "fp16-mixed" else None
    losses = []
    for x, y in data:
        opt.zero_grad()
        xs, ys = x.chunk(microbatches), y.chunk(microbatches)
        counts = [int((~torch.isin(ym, torch.tensor(ignore))).sum()) for ym in ys]
        total = 0.0
        for xm, ym, n in zip(xs, ys, counts):
            with gpu_autocast(PRECISIONS[precision]) if precision != "fp32" else contextlib.nullcontext():
                value = loss(model, xm, ym)
            if microbatches > 1:  # the Trainer's num_items_in_batch: token losses over the step's labels
                value = value * (n / sum(counts) if sum(counts) else 1 / microbatches)
            (value if amp is None else amp.scale(value)).backward()
            if n or microbatches == 1:
                total += value.item()
        if amp is None:
            if max_grad_norm is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
            opt.step()
            if sched is not None:
                sched.step()
        else:
            if max_grad_norm is not None:
                amp.unscale_(opt)
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
            amp.step(opt)
            amp.update()
            if scales is not None:
                scales.append(amp.get_scale())
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
