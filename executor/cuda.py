"""How the executor orders a step's instructions: host time on the CPU, CUDA streams and events
on a GPU, the caching allocator held to the plan's budget, and the machine checked against the plan.

An instruction is *device work*, enqueued on its lane's CUDA stream (compute, recompute, the GPU
optimizer, copies to and from gpu0, frees on gpu0), or *host work* that its lane's thread does
itself (SSD reads and writes, the CPU optimizer, frees in DRAM and on SSD). In overlap mode
every lane (plan stream) has one CUDA stream for the executor's lifetime, and a dependency
becomes:

  device -> device  the consumer's stream waits on the producer's end event (no host wait)
  device -> host    the lane thread waits for that event (an SSD write of a buffer the GPU
                    copied into pinned DRAM with a non-blocking D2H copy, a DRAM free after
                    the H2D copy that read it)
  host -> anything  nothing: host work is done when its thread moves on

Host work also waits for its own lane's earlier device work (program order within a lane). A
step starts with every lane stream waiting on the event recorded after its inputs, and ends
with the caller's stream waiting for the lanes' streams and the host for one event after that:
no instruction is followed by a synchronize, and nothing waits for the whole device. A lane
keeps at most DEPTH device instructions queued ahead of the GPU (it waits for the one DEPTH
back before enqueuing another), so memory freed in host time is soon free on the GPU.
In sync mode all device work goes on the caller's stream, in program order, and host work
waits for that stream's pending work. Device work is not held to DEPTH there: on one stream the
caching allocator hands a freed block only to work enqueued after the free, which runs after
the work that used it, so what the allocator holds is what the host holds however far ahead
the host runs; the host waits only where a host instruction needs the device's results.

A gpu0 tensor freed while other lanes' streams may still read it is `record_stream`-ed on
every lane stream, so the caching allocator reuses its memory only after the work enqueued on
them so far has finished. Timings: device work between two CUDA events, host work in host
time, both relative to the step's start.
"""
from __future__ import annotations

import collections
import contextlib
import time

import torch

from tensorstow.errors import TensorstowError
from tensorstow.schema.hardware import CPU_GPU_NAME, CUDA_WORKSPACE_BYTES
from tensorstow.schema.schedule import InstrKind, Stream, is_gpu


def on_host(ins) -> bool:
    """Whether the instruction is host work (its lane's thread does it) rather than device work."""
    if ins.kind == InstrKind.OPTIMIZER_STEP:
        return ins.dst == "cpu"
    if ins.kind in (InstrKind.LOAD, InstrKind.STORE):
        return not (is_gpu(ins.src) or is_gpu(ins.dst))
    if ins.kind == InstrKind.FREE:
        return not is_gpu(ins.dst)
    return ins.kind in (InstrKind.SEND, InstrKind.COMMIT, InstrKind.REDUCE, InstrKind.GATHER)  # a transfer the lane's thread waits for; the SSD store's commit


class HostLanes:
    """The CPU: an instruction is done when its handler returns; timings are host time."""

    def __init__(self):
        self._times: dict[int, list[float]] = {}

    def begin(self) -> None:
        self._times = {}

    def lane(self, name: str):
        return contextlib.nullcontext()

    def before(self, ins) -> None:
        self._times[ins.id] = [time.perf_counter(), 0.0]

    def after(self, ins) -> None:
        self._times[ins.id][1] = time.perf_counter()

    def retire(self, tensors) -> None:
        """A device copy is dropped (nothing to do: CPU memory is freed with its last reference)."""

    def end(self) -> list[tuple[int, float, float]]:
        """The step's (instruction, start, end) in seconds, for those that finished."""
        return sorted((i, t0, t1) for i, (t0, t1) in self._times.items() if t1)


class CudaLanes:
    """Streams and events for one executor's instructions (`cuda`: the torch.cuda module; tests
    pass a recording stand-in)."""

    DEPTH = 2
    """Device instructions a lane may have queued ahead of the GPU in overlap mode: before
    enqueuing one more, the lane's thread waits for the one DEPTH back. The GPU always has work
    queued, and memory the host frees is free on the GPU soon after (a free `record_stream`-ed on
    the other lanes' streams waits for them), so the device tier's count (host time) stays close
    to what the allocator holds (GPU time). Sync mode has no such bound (module docstring). A deeper
    queue does not help a host-bound step: its host then waits in `Event.synchronize` while the GPU
    drains (benchmarks/RESULTS.md "On a GPU")."""

    def __init__(self, instrs, device, *, overlap: bool, cuda=torch.cuda):
        self.cuda, self.device = cuda, device
        self._record_stream = getattr(cuda, "record_stream", torch.Tensor.record_stream)
        self.host = [on_host(i) for i in instrs]
        self.key = [i.stream if overlap else "" for i in instrs]
        """The stream each instruction's device work goes on: its lane's, or "" (the caller's)."""
        self.streams: dict[str, object] = {}
        """One CUDA stream per lane, made on the first step and kept (overlap mode)."""
        self.overlap = overlap
        self._events: list[tuple | None] = [None] * len(instrs)  # (start, end) per instruction, made once
        self._start = None
        self._t0 = 0.0
        self._done: dict[int, object] = {}   # this step's device work: instruction -> its end event
        self._pending: dict[str, object] = {}  # stream key -> its last end event the host has not waited for
        self._joined = None  # recorded on the caller's stream when the step ends
        self._queued: dict[str, collections.deque] = {}  # stream key -> its last DEPTH end events
        self._host: dict[int, list[float]] = {}

    def _stream(self, key: str):
        return self.streams[key] if key else self.cuda.current_stream(self.device)

    def begin(self) -> None:
        """The step's inputs are enqueued on the caller's stream: mark the point lanes start from."""
        if self.overlap and not self.streams:
            self.streams = {k: self.cuda.Stream(self.device) for k in sorted(set(self.key))}
        if self._start is None:
            self._start = self.cuda.Event(enable_timing=True)
        self._start.record(self.cuda.current_stream(self.device))
        self._t0 = time.perf_counter()
        self._done, self._pending, self._host = {}, {}, {}
        self._queued = {k: collections.deque() for k in set(self.key)}

    @contextlib.contextmanager
    def lane(self, name: str):
        """Run a lane's instructions on its stream, which first waits for the step's inputs."""
        s = self.streams[name]
        s.wait_event(self._start)
        with self.cuda.stream(s):
            yield

    def before(self, ins) -> None:
        i, key = ins.id, self.key[ins.id]
        if self.host[i]:
            last = self._pending.pop(key, None)  # the lane's own earlier device work
            if last is not None:
                last.synchronize()
            for d in ins.deps:
                ev = self._done.get(d)
                if ev is not None and self.key[d] != key:
                    ev.synchronize()
            self._host[i] = [time.perf_counter(), 0.0]
            return
        s = self._stream(key)
        queued = self._queued[key]
        if self.overlap and len(queued) >= self.DEPTH:
            queued.popleft().synchronize()
        for d in ins.deps:
            ev = self._done.get(d)
            if ev is not None and self.key[d] != key:
                s.wait_event(ev)
        if self._events[i] is None:
            self._events[i] = (self.cuda.Event(enable_timing=True), self.cuda.Event(enable_timing=True))
        self._events[i][0].record(s)

    def after(self, ins) -> None:
        i, key = ins.id, self.key[ins.id]
        if self.host[i]:
            self._host[i][1] = time.perf_counter()
            return
        end = self._events[i][1]
        end.record(self._stream(key))
        self._done[i] = self._pending[key] = end
        if self.overlap:
            self._queued[key].append(end)

    def retire(self, tensors) -> None:
        """Device tensors are about to be dropped: keep their memory from the allocator until every
        lane stream has done the work enqueued on it so far (one stream: its order suffices)."""
        if not self.streams:
            return
        seen = set()
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            for s in self.streams.values():
                self._record_stream(t, s)

    def end(self) -> list[tuple[int, float, float]]:
        """Join the lanes: the caller's stream waits for everything enqueued on theirs (also the
        work of an instruction that failed half-way), and the host for the caller's stream at
        that point (the step's results are read next); returns the step's timings."""
        main = self.cuda.current_stream(self.device)
        for s in self.streams.values():
            main.wait_stream(s)
        if self._joined is None:
            self._joined = self.cuda.Event()
        self._joined.record(main)
        self._joined.synchronize()
        out = [(i, t0, t1) for i, (t0, t1) in self._host.items() if t1]
        for i in self._done:
            start, end = self._events[i]
            out.append((i, self._t0 + self._start.elapsed_time(start) / 1e3,
                        self._t0 + self._start.elapsed_time(end) / 1e3))
        return sorted(out)


default_device: str | None = None
"""The device tier's device where an executor names none (`Executor(device=None)`, `execute`
without `--device`): "cuda" or "cpu" for every executor of this process; None: CUDA where there is
one, else the CPU."""


def resolve_device(device, index: int = 0) -> torch.device:
    """The device tier's device: the argument, else `default_device`, else CUDA when there is one.
    `index`: of several processes, this one's GPU (rank K takes GPU K mod the GPUs there are)."""
    name = device if device is not None else default_device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(name)
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise TensorstowError(f"executor device '{name}' (--device, or the device= argument): "
                              f"use cuda or cpu")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise TensorstowError(f"executor device '{name}': this machine has no CUDA device; use cpu")
        return torch.device("cuda", index % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def lanes_for(instrs, device: torch.device, overlap: bool):
    return CudaLanes(instrs, device, overlap=overlap) if device.type == "cuda" else HostLanes()


def cap_allocator(device: torch.device, budget: int, base: int) -> tuple[float, int]:
    """Hold PyTorch's caching allocator to what the plan allows: `base` (what it had reserved
    before the executor), the plan's device budget, and CUDA_WORKSPACE_BYTES for library
    workspaces and block rounding. At that limit the allocator waits for other streams' pending
    frees and returns its cached blocks before it reports out of memory. Returns the cap it had
    before (a fraction, for `Executor.close` to put back) and the limit in bytes."""
    total = torch.cuda.get_device_properties(device).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = float(getter(device)) if getter is not None else 1.0
    limit = min(total, base + budget + CUDA_WORKSPACE_BYTES)
    torch.cuda.set_per_process_memory_fraction(limit / total, device)
    return before, limit


def out_of_memory(limit: int, device: torch.device) -> str:
    """Why a CUDA allocation failed under `cap_allocator`'s limit, and what to do."""
    return (f"CUDA out of memory: the caching allocator is held to {limit / 1e6:.1f} MB (the plan's gpu0 budget "
            f"+ {CUDA_WORKSPACE_BYTES >> 20} MiB for workspaces) and has {torch.cuda.memory_reserved(device) / 1e6:.1f} MB "
            f"reserved, {torch.cuda.memory_allocated(device) / 1e6:.1f} MB allocated; re-plan with a smaller "
            f"--gpu-mem to leave headroom, or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to cut "
            f"fragmentation")


def hardware_differences(plan, device: torch.device, rank: int = 0) -> list[str]:
    """How the device this process would run `plan` on differs from the hardware the plan was made
    for (`Plan.hardware`): on CUDA, GPU `rank`'s model and memory; without CUDA, a plan for a real
    GPU (the device tier is then budgeted CPU memory: `tensorstow probe` here names it
    `CPU_GPU_NAME`). Empty where they agree."""
    gpus = plan.hardware.spec.gpus
    g = gpus[rank % len(gpus)]  # data parallel over machines: the rank's GPU on its machine
    if device.type != "cuda":
        return [] if g.name == CPU_GPU_NAME else [f"GPU {g.name!r} vs this machine's CPU device tier"]
    index = 0 if device.index is None else device.index
    here, total = torch.cuda.get_device_name(index), torch.cuda.get_device_properties(index).total_memory
    out = []
    if g.name != here:
        out.append(f"GPU {g.name!r} vs {here!r}")
    if abs(g.memory_bytes - total) > 0.02 * total:
        out.append(f"GPU memory {g.memory_bytes / 1e9:.1f} GB vs {total / 1e9:.1f} GB")
    return out


def check_device(plan, device: torch.device | None = None, rank: int = 0) -> None:
    """On CUDA, the machine has what the plan was made for: as many GPUs as its instructions
    use (a multi-GPU plan's processes may share GPUs: rank K runs on GPU K mod the GPUs there
    are), and on this process's GPU at least the plan's device budget for GPU `rank` plus the
    memory the plan leaves to the CUDA context and workspaces (`GPU.reserved_bytes`). (Without
    CUDA the device tier is budgeted CPU memory, which any plan may use.)"""
    used = sorted({s.device for s in (Stream.of(i.stream) for i in plan.instructions) if s.on_gpu})
    have = torch.cuda.device_count()
    spec = plan.hardware.spec
    if len(used) > have and plan.decisions.pipeline is None:
        raise TensorstowError(f"the plan runs on {len(used)} GPU(s) ({', '.join(used)} of {plan.hardware.name}: "
                              f"{', '.join(g.name for g in spec.gpus[:len(used)])}) but this machine has {have}; "
                              f"re-plan it for this machine (--hw local)")
    index = 0 if device is None or device.index is None else device.index
    g = spec.gpus[rank % len(spec.gpus)]
    cap, reserved = min(plan.predicted.capacity_bytes["gpu"], g.plan_bytes), g.reserved_bytes
    total = torch.cuda.get_device_properties(index).total_memory
    if cap + reserved > total:
        raise TensorstowError(f"the plan gives gpu{rank} {cap / 1e9:.2f} GB + {reserved / 1e9:.2f} GB for the CUDA "
                              f"context and workspaces ({plan.hardware.name}: {g.name}) but cuda:{index} here "
                              f"({torch.cuda.get_device_name(index)}) has {total / 1e9:.2f} GB; re-plan it with "
                              f"--hw local, or with --gpu-mem at most {max(total - reserved, 0) / 1e9:.2f} GB")
