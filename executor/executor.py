"""`Executor(plan, model)`: train a model by replaying a plan's static schedule every step.

The executor puts the parts together; each part is readable on its own:

  executor.program    the plan compiled against the traced model: the runtime tables
  executor.stores     the tiers (device, DRAM and its arena, SSD), opened here (`open_tiers`)
  executor.training   the training state between steps: homes, checkpoints, commits, resume
  executor.semantics  what a step means besides its instructions: loss weights, norms and
                      clipping, the learning rate, loss scaling, the Adam update, speculation
  executor.runtime    dispatch: a program's instructions through one handler per kind
  executor.graphs     a step captured and replayed as one CUDA graph

Per `step(idx, targets)` the executor checks the batch, opens the step (`StepSemantics.begin`),
runs the step's program (`Runtime.run`, or replays its graph), decides a speculating plan's
updates (the redo program where the clip fired), counts the step and commits it when due.
Adam's `step` count is not stored: every subgroup is updated once per step, so it is the
executor's update counter (`opt_steps`, which a commit records in the SSD store).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from tensorstow.errors import TensorstowError
from tensorstow.executor import statedir
from tensorstow.executor.cuda import cap_allocator, check_device, resolve_device
from tensorstow.executor.device_ops import check_portable, targets_for
from tensorstow.executor.graphs import Graphs, SegmentGraphs
from tensorstow.executor.lr import LRSchedule
from tensorstow.executor.malloc import tune as tune_malloc
from tensorstow.executor.program import Program, compile_program
from tensorstow.executor.runtime import MODES, Replay, Runtime
from tensorstow.executor.semantics import StepSemantics
from tensorstow.executor.ssd import SSDStore
from tensorstow.executor.statedir import rng_bytes, set_rng
from tensorstow.executor.stores import DeviceTier, HostPool, HostTier, SSDTier, Tiers
from tensorstow.executor.training import TrainingState
from tensorstow.ir.trace import Traced
from tensorstow.planner.pools import arena_need, device_arena
from tensorstow.planner.simulate import SimResult, perfetto_trace
from tensorstow.schema.run import ARENA
from tensorstow.schema.schedule import BufferKind, gpu_index, resource_of


def _state_dir_store(state_dir, plan, comm) -> tuple[Path, SSDStore]:
    """`Executor(state_dir=...)`: the directory, claimed for `plan` (executor.statedir), and its store."""
    if comm is not None:
        raise TensorstowError("state_dir= keeps one process's state: a multi-GPU plan's ranks each pass "
                              "ssd_store= (tensorstow execute --state-dir does)")
    d, owner = statedir.claim(state_dir, plan)
    return d, SSDStore(d, statedir.store_sizes(plan), owner=statedir.fingerprint(owner), shared=True)


def open_tiers(prog: Program, device, device_budget: int | None, ssd_store, mode: str) -> Tiers:
    """The device tier under the plan's budget (`device_budget`: bytes instead; its arena is
    `open_device_arena`'s), the DRAM arena the plan sizes for `mode`, the SSD tier (a store also for
    checkpoints where nothing lives on SSD). A device the plan does not fit, or a plan on SSD
    without a store, is refused."""
    plan = prog.plan
    device = resolve_device(device, prog.rank)
    cuda = device.type == "cuda"
    if cuda:
        check_device(plan, device, prog.rank)
    check_portable(prog.traced.gm, device)
    prog.joint.targets = targets_for(device)
    budget = min(plan.predicted.capacity_bytes["gpu"], plan.hardware.spec.gpus[gpu_index(prog.gpu)].plan_bytes)  # this GPU's
    dev = DeviceTier(budget if device_budget is None else device_budget, device, prog.gpu)
    dev.parts = prog.parts
    if ssd_store is None and plan.ssd_sizes():
        raise TensorstowError("the plan keeps buffers on the SSD tier: pass state_dir= "
                              "(a directory on the SSD) or ssd_store=")
    if isinstance(ssd_store, SSDStore):  # what a step swaps out and reads back is not its state
        bufs = plan.buffers
        ssd_store.set_transient(n for n in ssd_store.sizes if n in bufs and not bufs[n].home)
    pool = HostPool(prog.pool_bytes(mode), pin=cuda)
    return Tiers(device, prog.gpu, dev, pool, HostTier(pin=cuda, pool=pool), SSDTier(ssd_store))


def _of(part: str, name: str, doc: str, settable: bool = False) -> property:
    """An executor attribute that is `part`'s (read, and set where `settable`)."""
    def get(self):
        return getattr(getattr(self, part), name)

    def put(self, value):
        setattr(getattr(self, part), name, value)
    return property(get, put if settable else None, doc=doc)


def open_device_arena(prog: Program, dev: DeviceTier, setting: str) -> None:
    """Allocate the device arena the plan sizes (`PoolSizes.device`) where `setting` says: "on"
    (refused, in one line, where it cannot be), "auto" (on a CUDA device, where it fits: on a CPU
    device tier copying segments' outputs in costs what the allocations it saves cost,
    benchmarks/RESULTS.md "Device arena"), "off". It fits where the arena, the most a segment holds
    beside it and the step's inputs (`planner.pools.arena_need`) fit the device budget; a plan
    with expert units keeps their rows outside it, unbounded, and has none. Where none is
    allocated, `dev.arena_note` says why."""
    if setting not in ARENA:
        raise TensorstowError(f"unknown device arena setting '{setting}': use one of {list(ARENA)}")
    if setting == "off":
        dev.arena_note = "off"
        return
    plan = prog.plan
    size = plan.pools[prog.gpu].device if prog.gpu in plan.pools else 0
    if not size:
        why = "the plan sizes no device arena (a plan of an older tensorstow): re-plan it"
    elif prog.parts:
        why = "the plan's expert units hold their rows of the expert weights outside it: run without one"
    elif setting == "auto" and dev.device.type != "cuda":
        why = "auto: not on a CPU device tier, where copying segments' outputs in costs what it saves"
    elif (need := arena_need(plan, prog.gpu)) > dev.budget:
        why = (f"the device arena ({size / 1e6:.1f} MB) and what a segment holds beside it "
               f"({(need - size) / 1e6:.1f} MB: its workspace, its outputs before they are "
               f"copied in, the inputs) exceed the device budget ({dev.budget / 1e6:.1f} MB)")
    else:
        homes = device_arena(prog.instrs, plan.buffers, prog.gpu, [n for n, t in prog.homes.items() if t == prog.gpu])
        dev.open_arena(size, homes.homes)
        return
    if setting == "on":
        raise TensorstowError(f"device arena on: {why[:1].lower() + why[1:]}")
    dev.arena_note = why


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    """How an `Executor` runs its plan: `Executor(plan, model, ExecutorConfig(...))`, or the same
    fields as keywords, `Executor(plan, model, mode="overlap", ...)`."""
    mode: str = "sync"
    """"sync" runs the instructions in program order, "overlap" one lane per stream
    (executor.runtime); both compute the same bits."""
    state_dir: str | Path | None = None
    """The run's directory, as `tensorstow execute --state-dir` keeps it, for any plan: the SSD
    tier's buffers and a full checkpoint every `checkpoint_every` steps in a crash-safe `SSDStore`
    (`Executor.checkpoint()` commits on demand), the plan and a description of the state that
    `tensorstow export` reads."""
    ssd_store: object = None
    """A store of your own instead of `state_dir`'s (then no description is written). One made with
    `executor.statedir.store_sizes` is a full checkpoint: every `checkpoint_every` steps the state
    that lives off SSD and the random generator are written too, and resuming needs nothing else."""
    resume: bool = False
    """Continue from the step the SSD store committed last (the model's values are then not used);
    without it a store holding committed state is refused rather than overwritten."""
    checkpoint_every: int = 1
    """Commit every this many steps."""
    device: str | torch.device | None = None
    """Where the device tier lives, "cuda" or "cpu" (budgeted host memory); default
    `executor.cuda.default_device`, else CUDA when there is one."""
    device_budget: int | None = None
    """Bytes the device tier may hold (default: the plan's GPU capacity)."""
    traced: Traced | None = None
    """A trace of this very model (`ir.trace.trace` with the plan's batch, seq and precision) to
    skip tracing; it is checked against the plan's fingerprint and the model's parameters like a
    fresh trace."""
    init_values: object = None
    """An iterator of (name, value) of the parameters in parameter order, or a mapping name ->
    value read on demand, used instead of the model's parameters (which may then live on the meta
    device: out-of-core initialisation)."""
    built_from: object = None
    """The `ir.models.ModelSpec` a module given as `model` was built from by `build_for_execution`
    (as `tensorstow execute` builds it): its trace is kept for the process (`ir.kept`). None: a
    module built otherwise, traced every time."""
    seed: int = 0
    """A model given as plans name it (a preset, `hf:DIR`, `pkg.module:factory`) is built as
    `tensorstow execute` builds it, with the weights `torch.manual_seed(seed); factory()` gives, or
    an `hf:` checkpoint's, streamed into the tiers block by block."""
    rank: int | None = None
    """A multi-GPU plan runs one executor per GPU: this one replays GPU `rank`'s share of the plan
    (its stages' instructions, their DRAM and SSD work, both ends of its `send`s)."""
    comm: object = None
    """The process group stage boundaries move through (executor.distributed.Comm)."""
    lr_schedule: LRSchedule | None = None
    """Each update's learning rate (executor.lr); default the plan's (`Options.lr_scheduler`, its
    warmup and min lr ratio, peak `lr`), whose linear and cosine forms need `total_steps`."""
    total_steps: int | None = None
    """The run's length in optimizer steps, for the plan's linear or cosine schedule."""
    device_arena: str = "auto"
    """Each copy on the device a range of one arena the plan sizes, at the offset the plan's order
    gives it (`open_device_arena`; `execute --arena`): "auto" (on a CUDA device where it fits), "on", "off"."""
    graphs: str = "auto"
    """"auto" captures the step as a CUDA graph after a few eager steps and replays it where nothing
    in the step needs the host (executor.graphs: every buffer resident, the optimizer on the GPU),
    "on" refuses a plan where it cannot, "off" never captures."""


class Executor:
    def __init__(self, plan, model: nn.Module, config: ExecutorConfig | None = None, **options):
        """Compile `plan` against `model` (a module, or a model as plans name it: `ExecutorConfig.seed`),
        open the tiers and place the training state, as `config` says (or `options`, its fields)."""
        if config is not None and (options or not isinstance(config, ExecutorConfig)):
            raise TypeError("Executor: pass an ExecutorConfig, or its fields as keywords, not both")
        c = config if config is not None else ExecutorConfig(**options)
        self.config = c
        mode, state_dir, ssd_store, checkpoint_every = c.mode, c.state_dir, c.ssd_store, c.checkpoint_every
        comm = c.comm
        if mode not in MODES:
            raise TensorstowError(f"unknown executor mode '{mode}': use one of {list(MODES)}")
        if checkpoint_every < 1:
            raise TensorstowError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        tune_malloc()  # freed buffers are reused, not unmapped and faulted in again each step
        prog, model, init_values = compile_program(plan, model, rank=c.rank, comm=comm, traced=c.traced,
                                                   init_values=c.init_values, seed=c.seed, built_from=c.built_from)
        self.program = prog
        """The plan compiled against the traced model (executor.program)."""
        if checkpoint_every > 1 and prog.speculated:
            raise TensorstowError(f"checkpoint every {checkpoint_every} steps: this plan redoes its speculated "
                                  f"updates from the last commit, so it commits every step; leave "
                                  f"--checkpoint-every out, or plan with --clip-rate 1 (updates wait for the norm)")
        self.plan, self.M, self.rank, self.gpu, self.comm, self.mode = prog.plan, prog.M, prog.rank, prog.gpu, comm, mode
        self.joint, self.layouts, self.homes, self.carried, self.vocab = (
            prog.joint, prog.layouts, prog.homes, prog.carried, prog.vocab)
        self.rows = prog.plan.model.batch * self.M * prog.dp
        """Rows a step takes: its microbatches', on every data-parallel rank."""
        self.checkpoint_every = checkpoint_every
        self.state_dir = None
        """Where `state_dir=` keeps the run: a crash-safe store of every checkpoint, described for
        `tensorstow export` (None: no state dir, or the caller's `ssd_store`)."""
        if state_dir is not None and ssd_store is None:
            self.state_dir, ssd_store = _state_dir_store(state_dir, prog.plan, comm)
        try:
            self._open(model, c.device, c.device_budget, ssd_store, c.lr_schedule, c.total_steps)
            self._start(model, c.resume, init_values, state_dir or ssd_store)
        except BaseException:
            if self.state_dir is not None:  # its directory lock
                ssd_store.close()
            raise
        self.graphs = Graphs(self, c.graphs)
        """Whether the step replays as a captured graph, and the one it replays (executor.graphs)."""
        self.segment_graphs = SegmentGraphs(self, c.graphs, self.graphs.blockers)
        """Where the step cannot be one graph, whether its segments are captured one by one (executor.graphs)."""
        self.runtime.segment_graphs = self.segment_graphs if self.segment_graphs.on else None
        if self.state_dir is not None:
            statedir.describe(self.state_dir, model, prog)

    def _open(self, model, device, device_budget, ssd_store, lr_schedule, total_steps) -> None:
        """The tiers, the step's semantics, the runtime and the training state."""
        prog = self.program
        self._base = None  # CUDA: the allocator's bytes before this executor's
        self._fraction: float | None = None  # CUDA: the allocator's cap before this executor's
        self.tiers = tiers = open_tiers(prog, device, device_budget, ssd_store, self.mode)
        self.device, self.dev, self.host, self.ssd, self.pool = tiers.device, tiers.dev, tiers.host, tiers.ssd, tiers.pool
        """`pool`: the DRAM tier's arena, as large as the plan's `pools` say."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
        open_device_arena(prog, self.dev, self.config.device_arena)  # CUDA: counted in this executor's peaks
        self.semantics = StepSemantics(prog, self.device, lr_schedule, total_steps)
        self.runtime = Runtime(prog, tiers, self.semantics, self.mode, self.comm, on_commit=self._commit_previous)
        self.step_replay: Replay = self.runtime.replay_of(prog.instrs, prog.keep, prog.plan_id)
        """The step's program as the runtime runs it."""
        self._side: dict[str, Replay] = {}  # the evaluation's and the redo's, made at their first run
        self.state = TrainingState(prog, self.dev, self.host, self.ssd, self.semantics.scaler)
        """The training state between steps: homes, checkpoints, resume (executor.training)."""
        self.steps_done = 0
        self.timeline: list[tuple[int, float, float]] = []
        """The last step's measured (instruction, start, end) per instruction."""
        self.commit_s = 0.0
        """Seconds the last step's commit to the SSD store took (0: it committed nothing)."""
        self.early_sync_s = 0.0
        """Seconds the SSD store's early syncs (`SSDStore(early_sync=True)`) ran between the last
        step's start and its end: the disk flushing what the step wrote, beside its instructions."""
        self.loss: float | None = None
        self._rng_at_end: torch.Tensor | None = None

    def _start(self, model: nn.Module, resume: bool, init_values, where) -> None:
        """Each home's first copy: the SSD store's last commit (`resume`), else the model's
        values or `init_values`; a store that holds a commit is never overwritten."""
        store = self.ssd.store
        committed = store.committed_step() if store is not None else None
        if resume:
            self.semantics.opt_steps = self.state.resume(committed)
            self.steps_done = committed
            if not self.state.full_checkpoint:
                self.state.place(model, kinds=(BufferKind.C,), skip_ssd=True)  # never trained: from the model
        elif committed is not None:
            raise TensorstowError(
                f"the SSD store ({where}) holds training state committed at step "
                f"{committed}: pass resume=True to continue from it, or use an empty state dir")
        else:
            self.state.place(model, values=init_values)
        for x in self.carried:  # the DRAM copies a step starts from
            self.ssd.read(x, self.host, self.layouts[x])
        self.host.peak = self.host.used
        if self.device.type == "cuda":  # last: a refused executor leaves the allocator as it was
            self._fraction, self.runtime.alloc_limit = cap_allocator(self.device, self.dev.budget, self._base[1])

    # ---- what the executor's parts hold -----------------------------------------------------
    lr = _of("semantics", "lr", "The learning rate of the last step's update (of the next one before the first).")
    lr_schedule = _of("semantics", "lr_schedule", "Each update's learning rate (executor.lr); None: `set_lr`'s.",
                      settable=True)
    grad_norm = _of("semantics", "grad_norm", "The last step's global gradient norm (`StepSemantics.grad_norm`).")
    opt_steps = _of("semantics", "opt_steps", "Optimizer updates taken: Adam's step count.")
    scaler = _of("semantics", "scaler", "fp16-mixed: the dynamic loss scaler (executor.amp); else None.")
    evaluating = _of("semantics", "evaluating", "Within `evaluate`: steps leave their updates out.")
    speculation = _of("semantics", "speculation", "A speculating plan's last step: \"held\" or \"redone\".")
    adam = _of("semantics", "adam", "Per block with parameters, its optimizer subgroup (executor.adam).")
    alloc_limit = _of("runtime", "alloc_limit", "CUDA: the bytes the caching allocator may reserve.")
    instrs = _of("step_replay", "instrs", "This process's share of the step's instructions, numbered 0..")

    @property
    def lanes(self):
        """What orders the step's instructions (executor.cuda); settable (an instrumented one)."""
        return self.step_replay.lanes

    @lanes.setter
    def lanes(self, lanes) -> None:
        self.step_replay = dataclasses.replace(self.step_replay, lanes=lanes)

    @property
    def loss_scale(self) -> float | None:
        """fp16-mixed: the current loss scale (GradScaler.get_scale()); None otherwise."""
        return None if self.scaler is None else float(self.scaler.scale)

    # ---- the step ---------------------------------------------------------------------------
    def step(self, idx: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> float:
        """One training step (forward, backward, optimizer) exactly as the plan schedules it. A
        pipeline's step takes M microbatches of the plan's batch (rows [k*batch, (k+1)*batch) are
        microbatch k) and trains as eager gradient accumulation does: each microbatch's loss / M
        back-propagated, the gradients summed, one update; it returns the mean loss. A packing plan
        (`Options.packing`) also takes each token's position in its document (`positions`, shaped
        as idx: `Examples.batches(..., positions=True)` gives them).

        The step runs in `torch.inference_mode` (as does each lane's thread): the joint graph
        computes gradients itself, so nothing needs autograd, and its ops skip the autograd
        dispatch, view tracking and version counters (benchmarks/RESULTS.md "Executor overhead").
        Tensors a step creates are inference tensors: read them freely outside; only a step
        updates them in place."""
        with torch.inference_mode():
            return self._step(idx, targets, positions)

    def evaluate(self, batches) -> float:
        """The mean loss over `batches` ((idx, targets) pairs of the plan's shape, with positions a
        third for a packing plan) with the current
        parameters, as eager computes it under `model.eval()` and `torch.no_grad()` (the mean of
        the batches' losses; the perplexity is its exp). Nothing changes: no update, no step
        counted, no commit, the random generator as it was.

        Each batch runs the plan's forward-only program (`Plan.eval_instructions`: the parameters
        streamed through the tiers as the step streams them, no saved activations, gradients or
        updates), or for a plan without one (pipelines, older plans) the step's schedule with its
        updates left out. With microbatches (`grad_accum`) a batch is that many, its loss weighted
        as the step's. The model's forward must not draw random numbers (dropout > 0 computes
        differently from eval mode): such a model is refused."""
        prog = self.program
        if prog.forward_draws_random:
            raise TensorstowError("evaluate: the model's forward draws random numbers (dropout), which eval mode "
                                  "turns off; set its dropout to 0 to evaluate it here")
        if self.graphs.graph is not None:  # the eager evaluation would stack its memory on the graph's
            self.graphs.drop(self)
        self.segment_graphs.drop(self.device)
        replay = self._side_replay("eval", prog.eval_instrs, prog.eval_keep, prog.eval_plan_id) if prog.eval_instrs \
            else self.step_replay
        rng, timeline, losses = rng_bytes(), self.timeline, []
        try:
            with self.semantics.evaluation(), torch.inference_mode():
                for x, y, *positions in batches:
                    losses.append(self._step(x, y, *(positions or [None]), replay=replay))
        finally:
            set_rng(rng)
            self.timeline = timeline
        if not losses:
            raise TensorstowError("evaluate: no batches")
        return sum(losses) / len(losses)  # as an eager loop sums them

    def _step(self, idx: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None,
              replay: Replay | None = None) -> float:
        sem = self.semantics
        sem.check_batch(idx, targets, positions)
        sem.begin(targets)
        self.loss = None
        self.commit_s = 0.0
        synced = self._early_sync_total()
        if isinstance(self.ssd.store, SSDStore):  # sync writes early only in a step that commits
            self.ssd.store.sync_early = (self.steps_done + 1) % self.checkpoint_every == 0
        self._run_or_replay(idx, targets, positions, replay or self.step_replay)
        self.loss = self._mean_loss()
        if sem.evaluating:  # `evaluate`: nothing of the step is kept
            self.runtime.check_end_state()
            return self.loss
        sem.measure_norm()
        if self.program.speculated:
            self._validate()
        self.runtime.check_end_state()
        if self.carried and self.state.full_checkpoint:  # what the next step's commit records of this one
            self._rng_at_end = rng_bytes()
        self.steps_done += 1
        sem.finish()
        if self.steps_done % self.checkpoint_every == 0 and not self.carried:  # else the next step commits it
            t0 = time.perf_counter()
            if self.checkpoint(wait=not self.state.commits_in_background):
                self.commit_s = time.perf_counter() - t0
        self.early_sync_s = self._early_sync_total() - synced
        return self.loss

    def _run_or_replay(self, idx: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None,
                       replay: Replay) -> None:
        """The step's device work: its captured graph's replay where there is one (captured now
        where due), else the program instruction by instruction."""
        graph = self.graphs.for_step(self)
        self.graphs.replayed = None
        if graph is not None:
            graph.feed(self, idx, targets, self.semantics.weights, positions)
            if graph.ready:
                self.semantics.losses, self.semantics.norms = list(graph.loss), dict(graph.norms)
            elif not self.graphs.capture(self, graph):
                graph = None
        if graph is None:
            inputs = self.step_inputs(idx, targets, positions)
            if self.segment_graphs.on and replay is self.step_replay and not self.semantics.evaluating:
                self.segment_graphs.begin()
                inputs = self.segment_graphs.feed(inputs)  # where the segments' graphs read them
            self.timeline = self.runtime.run(replay, inputs)
        else:
            graph.replay()
            self.graphs.replayed, self.timeline = graph, []

    def step_inputs(self, idx: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None
                    ) -> dict[str, list[torch.Tensor]]:
        """The step's inputs on the device, per graph input one value per microbatch: the rows of
        idx and targets (and of positions, for a packing plan), the loss tangent (eager's
        (loss * w_k).backward()), the graph's constants."""
        j, b, sem = self.joint, self.plan.model.batch, self.semantics
        tdtype, tshape = j.meta(j.inputs[-1])
        tangent = (sem.scaler.tangent(tshape, tdtype) if sem.scaler is not None
                   else torch.ones(tshape, dtype=tdtype, device=self.device))
        consts = tuple(c.to(self.device, copy=True) for c in j.constants.values())
        inputs: dict[str, list[torch.Tensor]] = {}
        first = self.rank * self.M if self.program.dp > 1 else 0  # data parallel: this rank's rows
        for k in range(self.M):
            t_k = tangent if self.M * self.program.dp == 1 else tangent * sem.weights[k]
            rows = [t[(first + k) * b:(first + k + 1) * b].to(self.device, copy=True)
                    for t in (idx, targets, positions) if t is not None]
            vals = (*rows, t_k)
            for name, v in zip((*j.inputs, *j.constants), vals + consts):
                inputs.setdefault(name, []).append(v)
        return inputs

    def run_step(self, inputs: dict[str, list[torch.Tensor]], lanes=None, mode: str | None = None,
                 scalars=None) -> None:
        """Run the step's instructions on `inputs` through `lanes` (default the step's) in `mode`'s
        order (default the executor's); `scalars`: a captured graph's update scalars."""
        replay = self.step_replay if lanes is None else dataclasses.replace(self.step_replay, lanes=lanes)
        self.timeline = self.runtime.run(replay, inputs, mode, scalars)

    def _validate(self) -> None:
        """A speculating plan's step, its norm now known: where the clip fires (or fp16 gradients
        overflowed), the redo program restores the speculated updates from the last commit and
        runs them again with the clipped gradients (after an overflow: leaves them as they were);
        else they stand and their kept gradients go. Nothing is committed before."""
        prog, sem = self.program, self.semantics
        if sem.speculation_stands():
            for b in sorted(prog.speculated):
                self.host.drop(BufferKind.G.of(b))
            sem.speculation = "held"
            return
        store = self.ssd.store
        if not isinstance(store, SSDStore):
            raise TensorstowError("this plan redoes speculated updates from the last commit, which needs the "
                                  "crash-safe SSD store: pass state_dir=")
        store.wait_background()  # the last commit is durable: its slots are the version to restore
        sem.redoing = True
        try:
            self.runtime.run(self._side_replay("redo", prog.redo_instrs, {}, prog.redo_plan_id), {})
        finally:
            sem.redoing = False
        sem.speculation = "redone"

    def _side_replay(self, name: str, instrs, keep: dict, plan_id: list[int]) -> Replay:
        """A program run besides the step (`Plan.eval_instructions`, `Plan.redo_instructions`),
        with lanes of its own, made at its first run."""
        if name not in self._side:
            self._side[name] = self.runtime.replay_of(instrs, keep, plan_id)
        return self._side[name]

    def _early_sync_total(self) -> float:
        return getattr(self.ssd.store, "early_sync_s", 0.0)

    def step_values(self) -> tuple[list, dict]:
        """The last run step's loss per microbatch and gradient norm per block (what a captured
        graph's replays then write: executor.graphs)."""
        return list(self.semantics.losses), dict(self.semantics.norms)

    def clear_step_values(self) -> None:
        """Forget the last step's losses, norms and clip factor (a dropped graph's replays wrote them)."""
        sem = self.semantics
        sem.losses, sem.norms, sem.clip = [None] * self.M, {}, None

    def micro_weights(self, targets: torch.Tensor) -> list[float]:
        """Per microbatch, the weight of its loss in the step's (`StepSemantics.micro_weights`)."""
        return self.semantics.micro_weights(targets)

    def group_lr(self, scale: float) -> float:
        """The learning rate of a parameter group whose rate is lr x `scale` (`StepSemantics.group_lr`)."""
        return self.semantics.group_lr(scale)

    def _mean_loss(self) -> float:
        """The step's loss (`StepSemantics.step_loss`); on a rank without the loss, the one the
        loss's rank sends."""
        if self.program.dp > 1:  # every rank's terms, summed in the order one process sums them
            sem = self.semantics
            terms = self.comm.gather_floats([t if w else 0.0 for t, w in zip(sem.loss_terms(), sem.weights)])
            return sum(t for t in terms if t)
        here = self.semantics.step_loss()
        if self.comm is not None:
            return self.comm.share(here, gpu_index(self.program.block_gpu[self.program.loss_block()]))
        return here

    def skip_step(self) -> None:
        """Count a step that trains nothing (every label of its batch left out of the loss, as the
        Trainer's step with no items): the step counter advances, and commits as `step` does; no
        update is taken, so the schedule does not advance."""
        self.steps_done += 1
        if self.steps_done % self.checkpoint_every == 0:
            self.checkpoint(wait=not self.state.commits_in_background)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next updates: the rate is the caller's from here (the schedule
        is dropped; `ex.lr_schedule = LRSchedule(...)` sets one again)."""
        self.semantics.lr_schedule = None
        self.semantics.apply_lr(lr)

    # ---- commits ----------------------------------------------------------------------------
    def checkpoint(self, wait: bool = True) -> bool:
        """Commit the current step to the store (a full checkpoint writes the off-SSD state too);
        `step` does it every `checkpoint_every` steps, in one process without waiting for the
        syncs (`SSDStore.commit(wait=False)`: they overlap the next step until its first SSD
        write). With carried buffers (`Decisions.deferred_writes`) the next step commits this one
        once it has written them home (its `commit` instruction); called between steps, this
        writes them home first. Returns whether it committed."""
        if self.ssd.store is None or self.ssd.store.committed_step() == self.steps_done:
            return False
        for x in self.carried:
            self.ssd.write(x, self.host.get(x))
        return self.state.commit(self.steps_done, self.opt_steps, wait)

    def _commit_previous(self) -> None:
        """A step's `commit` instruction ran: the SSD holds the whole state of the step before;
        commit it when due (every `checkpoint_every` steps)."""
        if self.steps_done % self.checkpoint_every == 0 and self.ssd.store.committed_step() != self.steps_done:
            self.state.commit(self.steps_done, self.opt_steps, wait=not self.state.commits_in_background,
                              rng=self._rng_at_end)

    # ---- measurements -----------------------------------------------------------------------
    def lane_busy(self) -> dict[str, float]:
        """Measured seconds each lane spent in the last step (same resource names as the simulator;
        the SSD's includes the store's early syncs and the part of the step's commit the step
        waited for, and "ssd.commit" the last commit's background part, as the simulator has them)."""
        out: dict[str, float] = {}
        if self.graphs.replayed is not None:  # one replay: its device time, on the lane if there is one
            lanes = {resource_of(i.stream) for i in self.instrs}
            out[lanes.pop() if len(lanes) == 1 else "graph"] = self.graphs.replayed.seconds()
        for i, t0, t1 in self.timeline:
            r = resource_of(self.instrs[i].stream)
            out[r] = out.get(r, 0.0) + (t1 - t0)
        if self.commit_s or self.early_sync_s:
            out["ssd"] = out.get("ssd", 0.0) + self.commit_s + self.early_sync_s
        if self.state.commits_in_background and self.ssd.store.durable_s:
            out["ssd.commit"] = self.ssd.store.durable_s  # the last commit's syncs and manifest
        return dict(sorted(out.items()))

    def measured_trace(self) -> dict:
        """The last step's measured timeline in the simulator's Perfetto format."""
        n = len(self.instrs)
        start, end = [0.0] * n, [0.0] * n
        base = min((t0 for _, t0, _ in self.timeline), default=0.0)
        for i, t0, t1 in self.timeline:
            start[i], end[i] = t0 - base, t1 - base
        sim = SimResult(step_time_s=max(end, default=0.0), start=start, end=end, busy_s=self.lane_busy(),
                        traffic_bytes={}, peak_bytes={}, timeline={})
        return perfetto_trace(self.instrs, sim, f"{self.plan.model.name} measured")

    @property
    def peak_bytes(self) -> dict[str, int]:
        """High-water marks the executor measured: device tier and DRAM; on CUDA also the caching
        allocator's since the executor was made (`gpu_allocated`: max_memory_allocated,
        `gpu_reserved`: max_memory_reserved, both less what was there before; they include
        library workspaces)."""
        out = {"gpu": self.dev.peak, "dram": self.host.peak}
        if self._base is not None:
            out["gpu_allocated"] = torch.cuda.max_memory_allocated(self.device) - self._base[0]
            out["gpu_reserved"] = torch.cuda.max_memory_reserved(self.device) - self._base[1]
        return out

    # ---- results ----------------------------------------------------------------------------
    def parameters(self) -> dict[str, torch.Tensor]:
        """The parameters by qualified name, as fp32 CPU tensors: trainable ones from their
        masters, frozen ones from their constants (buffers are not parameters)."""
        return self.state.parameters()

    def load_into(self, model: nn.Module) -> None:
        """Copy the trained parameters into `model`."""
        params = self.parameters()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])

    def close(self) -> None:
        """Close the SSD store and lift the CUDA allocator's cap. It commits nothing: steps after
        the last commit (`checkpoint_every`; with carried buffers the last step, which the next
        step would commit) need `checkpoint()` first, as `tensorstow execute` does."""
        self.runtime.close()
        if self.ssd.store is not None and hasattr(self.ssd.store, "close"):
            self.ssd.store.close()
        if self._fraction is not None:  # the allocator's cap is what it was before
            torch.cuda.set_per_process_memory_fraction(self._fraction, self.device)
            self._fraction = None
