"""A step captured once as a CUDA graph and replayed every step after.

A plan whose step is device work only (every buffer resident on the GPU, the optimizer there)
leaves the host nothing to do between kernels but launch them, and launching is what limits
such a step: per instruction the executor's bookkeeping, per op PyTorch's dispatch (an
all-resident gpt3-125m step on an H100 took 1.5-2.3x eager's, the GPU idle while the host
caught up; benchmarks/RESULTS.md "On a GPU"). The schedule is static, so after `WARMUP` eager
steps the executor records one step's device work into a graph and from then on launches
the whole step with one call.

A replay runs the recorded kernels on the recorded addresses with the recorded scalar
arguments, so whatever changes from step to step must reach it through memory:
- the step's inputs (idx, targets, the loss tangents, the graph's constants) live in static
  device tensors that each step's values are copied into before the replay;
- Adam's step count and each parameter group's learning rate are device tensors filled before
  the replay (torch's fused Adam reads both from memory: `SubgroupAdam.step`'s `rates`);
- the persistent buffers (P, M, OS, ...) must be the very tensors the capture read: the step
  updates them in place, and before each replay the executor compares their storages with the
  capture's, capturing again when one moved (a resume, a reload);
- the loss and the gradient norms a step leaves are the captured tensors, read after a replay.

Everything the host decides inside a step keeps a plan out of a graph (`blockers`).
"""
from __future__ import annotations

import contextlib

import torch

WARMUP = 2
"""Eager steps before the capture: the first runs build the segments' code, the library handles
and workspaces (cuBLAS, flash attention) that a capture must find in place."""


class CudaCapture:
    """torch.cuda's graph: `capture()` records the device work enqueued inside it (nothing runs),
    `replay()` launches all of it; `seconds()`, the last replay's device time."""

    def __init__(self, device: torch.device):
        self.device = device
        with torch.cuda.device(device):
            self.graph = torch.cuda.CUDAGraph()
            self._stream = torch.cuda.Stream(device)  # the capturing stream, on the executor's GPU
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    @contextlib.contextmanager
    def capture(self):
        # torch.cuda.graph synchronizes, returns the cached blocks of the eager steps (the graph
        # allocates from a pool of its own, under the same allocator cap) and captures on the side
        # stream; all of it on the executor's GPU, whichever is current
        with torch.cuda.device(self.device), torch.cuda.graph(self.graph, stream=self._stream):
            yield

    def replay(self) -> None:
        start, end = self._events
        with torch.cuda.device(self.device):
            start.record()
            self.graph.replay()
            end.record()

    def seconds(self) -> float:
        start, end = self._events
        end.synchronize()
        return start.elapsed_time(end) / 1e3


BACKENDS: dict[str, type] = {"cuda": CudaCapture}
"""The graph of each device tier's type: CUDA's only (tests add a CPU stand-in)."""


def blockers(ex) -> list[str]:
    """Why executor `ex`'s step cannot be captured: whatever in it the host decides or does."""
    from tensorstow.executor.cuda import on_host

    prog, out = ex.program, []
    if ex.device.type not in BACKENDS:
        out.append(f"the device tier is {ex.device.type} memory (graphs are CUDA's)")
    host = sorted({_HOST_WORK.get((i.kind, i.dst if i.kind != "load" else i.src), i.kind)
                   for i in ex.instrs if on_host(i)})
    if host:
        out.append(f"the step has host work ({', '.join(host)})")
    elif any(i.kind in ("load", "store") for i in ex.instrs):  # a replay would copy at the capture's host addresses
        out.append("the step copies buffers to and from DRAM")
    if ex.scaler is not None:
        out.append("fp16 loss scaling decides on the host whether a step updates")
    if prog.speculated:
        out.append("speculated updates are redone on the host's decision")
    if ex.comm is not None:
        out.append("the step exchanges stage boundaries with other processes")
    if prog.forward_draws_random:
        out.append("the forward draws random numbers (dropout), whose generator the host steps")
    if ex.plan.options.exact_optimizer:
        out.append("the exact optimizer (torch.optim's single-tensor step) keeps its step count on the host")
    return out


_HOST_WORK = {("optimizer_step", "cpu"): "the CPU optimizer", ("free", "dram"): "DRAM frees",
              ("free", "ssd"): "SSD frees", ("store", "ssd"): "SSD writes", ("load", "ssd"): "SSD reads",
              ("commit", "ssd"): "SSD commits"}


class StepGraph:
    """The step's captured device work and the memory its replays read: static inputs, the
    update's scalars, the storages of the persistent buffers it was captured on."""

    def __init__(self, ex, backend: type):
        dev = ex.device
        self.backend = backend(dev)
        j, m = ex.joint, ex.plan.model
        self.inputs: dict[str, list[torch.Tensor]] = {}
        for k in range(ex.M):
            idx = torch.empty((m.batch, m.seq), dtype=torch.long, device=dev)
            dtype, shape = j.meta(j.inputs[2])
            tangent = torch.ones(shape, dtype=dtype, device=dev)
            for name, v in zip(j.inputs, (idx, torch.empty_like(idx), tangent)):
                self.inputs.setdefault(name, []).append(v)
        for name, c in j.constants.items():
            self.inputs[name] = [c.to(dev, copy=True)] * ex.M
        # CUDA's fused Adam reads a float32 rate (torch.optim's capturable form), where a Python
        # float reaches it as a double: a replayed update may differ from an eager one in its last
        # bits. The CPU kernel reads its rate as a double: a float64 tensor gives it the very value
        rate = torch.float32 if dev.type == "cuda" else torch.float64
        self.step_count = torch.zeros((), dtype=torch.float32, device=dev)
        self.rates = {scale: torch.zeros((), dtype=rate, device=dev)
                      for scale in sorted({s for s, _ in ex.program.groups.values()} | {1.0})}
        self.bound: tuple = ()
        self.loss: list[torch.Tensor] = []
        self.norms: dict[str, torch.Tensor] = {}
        self.ready = False

    def feed(self, ex, idx: torch.Tensor, targets: torch.Tensor, weights: list[float]) -> None:
        """Copy a step's values into the static inputs and scalars (enqueued before the replay)."""
        j, b = ex.joint, ex.plan.model.batch
        for k in range(ex.M):
            self.inputs[j.inputs[0]][k].copy_(idx[k * b:(k + 1) * b])
            self.inputs[j.inputs[1]][k].copy_(targets[k * b:(k + 1) * b])
            if ex.M > 1:  # eager's (loss * w_k).backward(): the tangent ones x w_k, rounded as fill_ rounds
                self.inputs[j.inputs[2]][k].fill_(weights[k])
        self.step_count.fill_(float(ex.opt_steps + 1))
        for scale, t in self.rates.items():
            t.fill_(ex.lr if scale == 1.0 else ex._group_lr(scale))

    @contextlib.contextmanager
    def capture(self, ex):
        """Record the step run inside (its device work; on CUDA nothing of it runs yet)."""
        self.bound = storages(ex)
        with self.backend.capture():
            yield
        self.loss, self.norms = list(ex._loss), dict(ex._norms)

    def replay(self) -> None:
        self.backend.replay()

    def seconds(self) -> float:
        return self.backend.seconds()


def storages(ex) -> tuple:
    """The persistent device buffers' tensors, by buffer, root and address: what a replay reads."""
    return tuple((buf, r, t.untyped_storage().data_ptr(), t.storage_offset())
                 for buf, values in sorted(ex.dev.copies.items()) for r, t in sorted(values.items()))
