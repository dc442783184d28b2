"""A step captured once as a CUDA graph and replayed every step after.

A plan whose step is device work only (every buffer resident on the GPU, the optimizer there)
leaves the host nothing to do between kernels but launch them, and launching is what limits
such a step: per instruction the executor's bookkeeping, per op PyTorch's dispatch, the GPU idle
while the host catches up (benchmarks/RESULTS.md "On a GPU"). The schedule is static, so after `WARMUP` eager
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

from tensorstow.errors import TensorstowError
from tensorstow.executor.cuda import HostLanes, on_host
from tensorstow.executor.program import draws_random_node
from tensorstow.planner.pools import arena_need
from tensorstow.schema.run import GRAPHS
from tensorstow.schema.schedule import InstrKind

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
    def capture(self, shared=None):
        """`shared`: a segment's capture (`SegmentGraphs`), in the pool the segments share and in
        thread-local mode (the other lanes go on enqueuing their copies meanwhile)."""
        # torch.cuda.graph synchronizes, returns the cached blocks of the eager steps (the graph
        # allocates from a pool of its own, under the same allocator cap) and captures on the side
        # stream; all of it on the executor's GPU, whichever is current
        kw, stream = {}, self._stream
        if shared is not None:  # one stream and one pool for every segment: a block one frees, the next reuses
            with torch.cuda.device(self.device):
                shared.pool = shared.pool if shared.pool is not None else torch.cuda.graph_pool_handle()
                shared.stream = shared.stream if shared.stream is not None else torch.cuda.Stream(self.device)
            kw, stream = {"pool": shared.pool, "capture_error_mode": "thread_local"}, shared.stream
        before = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.device(self.device), torch.cuda.graph(self.graph, stream=stream, **kw):
                yield
        finally:  # a failed capture leaves the thread on the capturing stream
            torch.cuda.set_stream(before)

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
    prog, out = ex.program, []
    if ex.device.type not in BACKENDS:
        out.append(f"the device tier is {ex.device.type} memory (graphs are CUDA's)")
    host = sorted({_HOST_WORK.get((i.kind, i.dst if i.kind != InstrKind.LOAD else i.src), i.kind)
                   for i in ex.instrs if on_host(i)})
    if host:
        out.append(f"the step has host work ({', '.join(host)})")
    elif any(i.kind in (InstrKind.LOAD, InstrKind.STORE) for i in ex.instrs):  # a replay would copy at the capture's host addresses
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


_HOST_WORK = {(InstrKind.OPTIMIZER_STEP, "cpu"): "the CPU optimizer", (InstrKind.FREE, "dram"): "DRAM frees",
              (InstrKind.FREE, "ssd"): "SSD frees", (InstrKind.STORE, "ssd"): "SSD writes",
              (InstrKind.LOAD, "ssd"): "SSD reads", (InstrKind.COMMIT, "ssd"): "SSD commits"}


class Graphs:
    """Whether executor `ex`'s steps replay as a graph (`setting`: auto, on, off), and the graph
    they replay: the first WARMUP steps run instruction by instruction, the next is captured and
    replayed, and every one after replayed while the persistent buffers stay where they were."""

    def __init__(self, ex, setting: str):
        if setting not in GRAPHS:
            raise TensorstowError(f"unknown graphs setting '{setting}': use one of {list(GRAPHS)}")
        self.setting = setting
        self.blockers = ["graphs are off"] if setting == "off" else blockers(ex)
        """Why the step is not captured (empty: it is, after WARMUP steps)."""
        if setting == "on" and self.blockers:
            raise TensorstowError(f"graphs on: this plan's step cannot be captured as a CUDA graph: "
                                  f"{'; '.join(self.blockers)}; use --graphs auto, which captures where it can")
        self.captured = 0
        """Steps captured so far (one, unless an evaluation or a moved buffer came in between)."""
        self.graph: StepGraph | None = None
        self.replayed: StepGraph | None = None
        """The graph the last step replayed (None: it ran instruction by instruction)."""
        self._runs = 0  # training steps the executor ran

    def for_step(self, ex) -> StepGraph | None:
        """The graph this step replays (or captures), or None: the step runs instruction by
        instruction (graphs off or blocked, an evaluation, a warmup step, a graph given up)."""
        if self.blockers or ex.evaluating:
            return None
        self._runs += 1
        if self._runs <= WARMUP:
            return None
        if self.graph is not None and self.graph.bound != storages(ex):  # a buffer moved since: capture anew
            self.graph = None
        if self.graph is None:
            self.graph = StepGraph(ex, BACKENDS[ex.device.type])
        return self.graph

    def capture(self, ex, graph: StepGraph) -> bool:
        """Record this step of `ex` into `graph`, one instruction after another on the capturing
        stream (host timings only: no event may be recorded or waited for there); False where
        the capture failed (graphs auto: this step and every one after run instruction by
        instruction). A step that leaves a persistent buffer in other memory than it found it is
        replayed this once and not again."""
        try:
            with graph.capture(ex):  # its update reads its step count and rates from memory
                ex.run_step(graph.inputs, HostLanes(), "sync", scalars=graph)
        except Exception as e:  # nothing ran on the device: the state is the step's start, less what it allocated
            first = e.__context__  # CUDA reports a call that broke the capture when the capture ends
            why = f"{type(e).__name__}: {e}" + (f"; first {type(first).__name__}: {first}" if first else "")
            self.drop(ex, homes_only=True)
            if storages(ex) != graph.bound:
                raise TensorstowError(f"capturing the step as a CUDA graph failed ({why}) and moved a persistent "
                                      f"buffer; resume from the last commit with --graphs off") from None
            if self.setting == "on":
                raise TensorstowError(f"capturing the step as a CUDA graph failed ({why}); run with --graphs off "
                                      f"or auto") from None
            self.blockers = [f"capturing the step failed ({why})"]
            return False
        moved = sorted({buf for buf, *_ in set(graph.bound) ^ set(storages(ex))})
        if moved:
            self.blockers = [f"the step re-allocates persistent buffers ({', '.join(moved[:3])})"]
            self.graph = None
        graph.ready = True
        self.captured += 1
        return True

    def drop(self, ex, homes_only: bool = False) -> None:
        """Let the graph go, and with it the memory its replays keep (the next step captures
        again). `homes_only`: after a failed capture, also drop the device copies the step made
        before it failed (a capture runs nothing, so the homes are as the step found them)."""
        if homes_only:
            for buf in [b for b in ex.dev.copies if ex.homes.get(b) != ex.gpu]:
                ex.dev.drop(buf)
        self.graph = self.replayed = None
        ex.clear_step_values()
        if ex.device.type == "cuda":
            torch.cuda.empty_cache()


class StepGraph:
    """The step's captured device work and the memory its replays read: static inputs, the
    update's scalars, the storages of the persistent buffers it was captured on."""

    def __init__(self, ex, backend: type):
        dev = ex.device
        self.backend = backend(dev)
        rows = (ex.plan.model.batch * ex.M, ex.plan.model.seq)
        blank = torch.zeros(rows, dtype=torch.long)
        self.inputs = ex.step_inputs(blank, blank, blank if ex.plan.options.packing else None)
        """The step's inputs as the eager path makes them, kept: each step's values are copied in."""
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

    def feed(self, ex, idx: torch.Tensor, targets: torch.Tensor, weights: list[float],
             positions: torch.Tensor | None = None) -> None:
        """Copy a step's values into the static inputs and scalars (enqueued before the replay)."""
        j, b = ex.joint, ex.plan.model.batch
        for k in range(ex.M):
            for name, t in zip(j.inputs, [t for t in (idx, targets, positions) if t is not None]):
                self.inputs[name][k].copy_(t[k * b:(k + 1) * b])
            if ex.M > 1:  # eager's (loss * w_k).backward(): the tangent ones x w_k, rounded as fill_ rounds
                self.inputs[j.inputs[-1]][k].fill_(weights[k])
        self.step_count.fill_(float(ex.opt_steps + 1))
        for scale, t in self.rates.items():
            t.fill_(ex.lr if scale == 1.0 else ex.group_lr(scale))

    @contextlib.contextmanager
    def capture(self, ex):
        """Record the step run inside (its device work; on CUDA nothing of it runs yet)."""
        self.bound = storages(ex)
        with self.backend.capture():
            yield
        self.loss, self.norms = ex.step_values()

    def replay(self) -> None:
        self.backend.replay()

    def seconds(self) -> float:
        return self.backend.seconds()


def storages(ex) -> tuple:
    """The persistent device buffers' tensors, by buffer, root and address: what a replay reads."""
    return tuple((buf, r, t.untyped_storage().data_ptr(), t.storage_offset())
                 for buf, values in sorted(ex.dev.copies.items()) for r, t in sorted(values.items()))


class SegmentGraphs:
    """Where the step cannot be one graph (host work between its segments: an offloaded plan), each
    of its segments captured once and replayed every step after: the compute lane launches one
    graph a segment instead of dispatching op by op, while copies, frees and CPU updates run
    around them as the schedule orders them (their events).

    A segment's replay reads its inputs and writes its outputs at the capture's addresses, so
    those must not move: the buffers live in the device arena (`--arena`: each copy at the
    offset the plan gives it, the same every step), the step's inputs in static tensors each
    step's values are copied into (`feed`). What the segment leaves for the host is taken from
    the capture: its buffers' views in the arena (placed again before each replay, through the
    arena's overlap check), its loss, its gradients' norms. The segments' graphs share one memory
    pool, captured in program order and replayed in it, so their temporaries take what the largest
    takes (`planner.pools.device_transient`). A segment that draws random numbers or whose ops'
    outputs the host reads runs eagerly (where the pool beside them would exceed the budget, no
    segment is captured), as does every segment of an evaluation; an evaluation lets the graphs go
    (its eager memory would stack on theirs). A capture that fails anyway stops the run in one line
    (rerun with --graphs off): CUDA's allocator is then in no known state."""

    def __init__(self, ex, setting: str, step_blockers: list[str]):
        self.blockers = segment_blockers(ex, setting, step_blockers)
        """Why segments are not captured (empty: they are, after WARMUP steps)."""
        self.graphs: dict[int, SegmentGraph] = {}
        """Step instruction -> its segment's graph."""
        self.inputs: dict[str, list[torch.Tensor]] | None = None
        self.pool = None  # CUDA: the memory pool the graphs share
        self.stream = None  # CUDA: the stream every segment is captured on
        self.eager = {name for name, seg in ex.joint.segments.items() if any(_host_decides(n) for n in seg.nodes)}
        """Segments interpreted every step: they draw random numbers (dropout: the host steps the
        generator) or have an op whose output's size or value the host reads (a replay cannot)."""
        if not self.blockers and any(i.segment in self.eager for i in ex.instrs if i.kind in SEGMENT_KINDS) and \
                arena_need(ex.plan, ex.gpu) + (arena_need(ex.plan, ex.gpu) - ex.plan.pools[ex.gpu].device) > ex.dev.budget:
            self.blockers = ["the graphs' pool beside the segments that run eagerly would exceed the device budget"]
        self.captured = 0
        self.replays = 0
        """Segments the last step replayed."""
        self._steps = 0

    @property
    def on(self) -> bool:
        return not self.blockers

    def begin(self) -> None:
        """A training step starts: its segments are captured or replayed once WARMUP steps ran."""
        self._steps += 1
        self.replays = 0

    def feed(self, inputs: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """The step's inputs in the static tensors the graphs read (the first step's become them)."""
        if self.inputs is None:
            self.inputs = inputs
        else:
            for name, vs in inputs.items():
                for s, v in zip(self.inputs[name], vs):
                    s.copy_(v)
        return self.inputs

    def drop(self, device) -> None:
        """Let every graph go and give their pool back (an evaluation comes): the next training step
        captures them again."""
        had = bool(self.graphs)
        self.graphs, self.pool = {}, None  # the pool goes with the last graph that holds it
        if had and device.type == "cuda":
            torch.cuda.empty_cache()

    def run(self, rt, ins, interpret) -> None:
        """Run step instruction `ins` (a segment) on runtime `rt`: replayed, captured now and
        replayed, or interpreted (`interpret()`) during the warmup, an evaluation, or where its
        segment draws random numbers or failed to capture."""
        g = self.graphs.get(ins.id)
        if self.blockers or self._steps <= WARMUP or rt.sem.evaluating or ins.segment in self.eager:
            return interpret()
        if g is None:
            return self._capture(rt, ins, interpret)
        for buf, (views, at, room) in g.views.items():
            rt.dev.adopt_views(buf, views, at, room)
        g.replay()
        if g.loss is not None:
            rt.sem.losses[ins.micro] = g.loss
        rt.sem.norms.update(g.norms)
        self.replays += 1

    def _capture(self, rt, ins, interpret) -> None:
        dev, sem = rt.dev, rt.sem
        g = SegmentGraph(BACKENDS[rt.device.type](rt.device), self)
        # with a process group the norms are taken by the reduce lane, beside this one: none here
        norms = dict(sem.norms) if rt.comm is None else None
        loss = sem.losses[ins.micro]
        try:
            with g.capture():
                interpret()
        except TensorstowError:
            raise  # the step's own error (a plan that does not fit, a missing load)
        except Exception as e:  # a failed CUDA capture leaves the allocator's pool state unknown: stop here
            raise TensorstowError(f"capturing segment {ins.segment} as a CUDA graph failed ({type(e).__name__}: "
                                  f"{e}); rerun the same command with --graphs off") from None
        g.views = {buf: (dict(dev.get(buf)), dev.ranges[buf][0], dev.ranges[buf][1] - dev.ranges[buf][0])
                   for buf in ins.allocs if buf in dev.ranges}
        g.loss = sem.losses[ins.micro] if sem.losses[ins.micro] is not loss else None
        g.norms = {} if norms is None else {p: t for p, t in sem.norms.items() if norms.get(p) is not t}
        g.replay()  # the capture computed nothing: this step's work runs now
        self.graphs[ins.id] = g
        self.captured += 1
        self.replays += 1


class SegmentGraph:
    """One segment's captured device work and what it leaves: its buffers' views in the arena (buffer
    -> (views, offset, bytes)), its loss, its gradients' norms."""

    def __init__(self, backend, graphs: SegmentGraphs):
        self.backend = backend
        self._graphs = graphs
        self.views: dict[str, tuple[dict, int, int]] = {}
        self.loss: torch.Tensor | None = None
        self.norms: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def capture(self):
        with self.backend.capture(shared=self._graphs):
            yield

    def replay(self) -> None:
        self.backend.replay()


SEGMENT_KINDS = (InstrKind.COMPUTE, InstrKind.RECOMPUTE)


def _host_decides(node) -> bool:
    """Whether a traced op draws random numbers or makes an output whose size or value the host reads."""
    tags = getattr(node.target, "tags", ())
    return draws_random_node(node) or torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags


def segment_blockers(ex, setting: str, step_blockers: list[str]) -> list[str]:
    """Why executor `ex`'s segments are not captured one by one."""
    if setting == "off":
        return ["graphs are off"]
    if setting == "on" or not step_blockers:
        return ["the whole step replays as one graph"]
    if ex.device.type not in BACKENDS:
        return [f"the device tier is {ex.device.type} memory (graphs are CUDA's)"]
    if ex.dev.arena is None:
        return [f"the device tier has no arena ({ex.dev.arena_note}): the segments' buffers move from step to step"]
    return []
