"""Replay a plan's static schedule every training step: a dispatch table and a flat loop.

`Executor(plan, model)` compiles the plan against the model (`executor.program`: re-traces it,
refuses a plan whose fingerprint differs, builds the runtime tables), opens its tiers, places
every buffer on its home tier (`executor.training`: parameters from the model, Adam states zero, or
a resumed checkpoint) and then, per `step(idx, targets)`, runs the plan's instructions, one
handler per kind (`HANDLERS`):

  compute / recompute   interpret a segment of the joint graph on the device tier
  load / store          copy a buffer between tiers (gpuK <-> dram <-> ssd), never aliasing
  send                  a stage boundary to or from another rank's GPU (multi-GPU plans)
  free                  drop a tier's copy
  optimizer_step        torch.optim.Adam/AdamW (foreach=False) on one block's fp32 masters

The executor makes no decisions: what moves where and when is the plan's. `mode="sync"`
runs the instructions one at a time in program order (the reference); `mode="overlap"`
runs one worker per stream, each instruction waiting only for the instructions in its
`deps` (and its stream's earlier ones), so the plan's dependencies must be sufficient. Both
modes compute the same bits.

Buffer contents (schema.schedule names the kinds):
  P:<b>  the block's trainable parameter placeholders (compute precision); for fp32 the master
  C:<b>  its frozen parameters and buffers (read-only: placed from the model, never written)
  G:<b>  storage roots of their gradients (joint-graph outputs after the loss)
  M:<b>  fp32 master copies (mixed precision only)    OS:<b>  exp_avg and exp_avg_sq
  A:<b>  saved storages produced in b (planner.cost BlockProfile.saved; a partial swap: .swapped)
  R:<b>  a partial swap's rest, made again by segment refwd:<b> (BlockProfile.rest)
  X:<b>  values other blocks' forward made that b reads (BlockProfile.inputs)
  T:<b>  values b's backward carries to a later backward (BlockProfile.carried)
  H:<b>  values b's backward hands to the next backward, the activation gradient (BlockProfile.handed)
  AE:<b>, RE:<b>  with a cut backward (segments bwd1:/bwd2:<b>), the part of A:/R:<b> only bwd1 reads
  K:<b>  what bwd1:<b> makes for bwd2:<b> and the block's G/T/H (BlockProfile.handoff)
Anything else a segment makes is a temporary: it stays on the device until the last
instruction that reads it (program order on the compute stream), then it is freed.
Adam's `step` count is not stored: every subgroup is updated once per step, so it is the
executor's step counter (`steps_done`, which `commit` records in the SSD store).
"""
from __future__ import annotations

import contextlib
import os
import time
import weakref
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.nn as nn

from tensorstow.errors import TensorstowError
from tensorstow.executor.adam import SubgroupAdam
from tensorstow.executor.amp import LossScaler, distinct
from tensorstow.executor.cuda import cap_allocator, check_device, lanes_for, out_of_memory, resolve_device
from tensorstow.executor.device_ops import check_portable, targets_for
from tensorstow.executor.graphs import Graphs
from tensorstow.executor.lanes import LaneThreads, lane_cores, optimizer_threads, pin_off_compute, unpin
from tensorstow.executor.training import TrainingState
from tensorstow.executor.lr import LRSchedule
from tensorstow.executor.malloc import give_back_free_heap, tune as tune_malloc
from tensorstow.executor.program import Program
from tensorstow.executor.ssd import SSDStore
from tensorstow.executor import statedir
from tensorstow.executor.statedir import rng_bytes, set_rng
from tensorstow.executor.stores import DeviceMemoryError, DeviceTier, HostCopy, HostPool, HostTier, RoomWait, SSDTier
from tensorstow.ir.hf import wrap
from tensorstow.ir.models import build_for_execution, resolve_model
from tensorstow.ir.trace import Traced
from tensorstow.planner.simulate import SimResult, perfetto_trace
from tensorstow.schema.plan import as_plan
from tensorstow.schema.schedule import (CPU_OPTIMIZER, BufferKind, Instr, InstrKind, block_of, buffer_kind, gpu_index, resource_of,
                                        split_segment)

MODES = ("sync", "overlap")


class ExecutionError(TensorstowError):
    """An instruction could not run as the plan says (names the instruction)."""


def _state_dir_store(state_dir, plan, comm) -> tuple[Path, SSDStore]:
    """`Executor(state_dir=...)`: the directory, claimed for `plan` (executor.statedir), and its store."""
    if comm is not None:
        raise TensorstowError("state_dir= keeps one process's state: a multi-GPU plan's ranks each pass "
                              "ssd_store= (tensorstow execute --state-dir does)")
    d, owner = statedir.claim(state_dir, plan)
    return d, SSDStore(d, statedir.store_sizes(plan), owner=statedir.fingerprint(owner), shared=True)


class Executor:
    def __init__(self, plan, model: nn.Module, *, mode: str = "sync", state_dir=None,
                 ssd_store=None, resume: bool = False, device_budget: int | None = None,
                 traced: Traced | None = None, checkpoint_every: int = 1, init_values=None,
                 device: str | torch.device | None = None, rank: int | None = None, comm=None,
                 lr_schedule: LRSchedule | None = None, total_steps: int | None = None, seed: int = 0,
                 graphs: str = "auto"):
        """`state_dir`: the run's directory, as `tensorstow execute --state-dir` keeps it, for any
        plan: the SSD tier's buffers and a full checkpoint every `checkpoint_every` steps in a
        crash-safe `SSDStore` (`checkpoint()` commits on demand), the plan and a description of
        the state that `tensorstow export` reads. `ssd_store`: a store of your own instead (then
        no description is written). `resume`: continue from the step the SSD store committed last
        (every P/M/OS buffer must live on SSD; the model's values are then not used); without
        it a store holding committed state is refused rather than overwritten.
        `device_budget`: bytes the device tier may hold (default: the plan's GPU capacity).
        `traced`: a trace of this very model (`ir.trace.trace` with the plan's batch, seq and
        precision) to skip re-tracing; it is checked against the plan's fingerprint and the
        model's parameters like a fresh trace. A store made with `executor.statedir.store_sizes`
        is a full checkpoint: every `checkpoint_every` steps the state that lives off SSD and the
        random generator are written too, and resuming needs nothing else. `init_values`: an
        iterator of (name, value) of the parameters in parameter order, or a mapping name ->
        value read on demand, used instead of the model's parameters (which may then live on the
        meta device: out-of-core initialisation). `device`: where the device tier lives, "cuda"
        or "cpu" (budgeted host memory); default the environment's TENSORSTOW_DEVICE, else CUDA
        when there is one. `rank`, `comm`: a multi-GPU plan runs one executor per GPU: this one
        replays GPU `rank`'s share of the plan (its stages' instructions, their DRAM and SSD work,
        both ends of its `send`s) and moves stage boundaries through `comm`
        (executor.distributed.Comm). `model` may also be a model as plans name it (a preset,
        `hf:DIR`, `pkg.module:factory`): built as `tensorstow execute` builds it, with the weights
        `torch.manual_seed(seed); factory()` gives, or an `hf:` checkpoint's, streamed into the
        tiers block by block (never the whole model in host memory). `lr_schedule`: each update's learning rate (executor.lr);
        default the plan's (`Options.lr_scheduler`, its warmup and min lr ratio, peak `lr`), whose
        linear and cosine forms need the run's length in optimizer steps, `total_steps`.
        `graphs`: "auto" captures the step as a CUDA graph after a few eager steps and replays it
        where nothing in the step needs the host (executor.graphs: every buffer resident, the
        optimizer on the GPU), "on" refuses a plan where it cannot, "off" never captures."""
        self._graphs_setting = graphs
        self._lane_threads = LaneThreads()  # overlap mode's lanes, kept from step to step
        # collected: its lanes end; at exit they are daemons (a step interrupted there never joins)
        weakref.finalize(self, self._lane_threads.close).atexit = False
        if mode not in MODES:
            raise TensorstowError(f"unknown executor mode '{mode}': use one of {list(MODES)}")
        tune_malloc()  # freed buffers are reused, not unmapped and faulted in again each step
        if isinstance(model, str):
            if init_values is not None:
                raise TensorstowError("init_values is for a model object; a model named by a string brings its own")
            o = as_plan(plan).options  # the plan's LoRA adapters go on the model it names
            model, init_values = build_for_execution(resolve_model(model, o.lora if model == o.model else None), seed)
        model = wrap(model)
        self.program = prog = Program(plan, model, rank=rank, comm=comm, traced=traced)
        """The plan compiled against the traced model: every table below is its."""
        self.plan, self.M, self.rank, self.gpu, self.comm = prog.plan, prog.M, prog.rank, prog.gpu, comm
        self.mode = mode
        # the tables the handlers read
        self.instrs, self.plan_id, self.joint, self.layouts, self.members = (
            prog.instrs, prog.plan_id, prog.joint, prog.layouts, prog.members)
        self.homes, self.carried, self.block_gpu = prog.homes, prog.carried, prog.block_gpu
        self.block_params, self.block_consts, self.frozen = prog.block_params, prog.block_consts, prog.frozen
        self.mixed, self.fp32_grads, self.keep, self.vocab = prog.mixed, prog.fp32_grads, prog.keep, prog.vocab
        self._ignored = torch.tensor(sorted(prog.ignore_index), dtype=torch.long)  # labels the loss leaves out
        self.rng_states: dict[str, torch.Tensor] = {}
        """Per recomputed segment that draws random numbers, the generator state its first run
        started from (`Program.random_segments`)."""
        self.state_dir = None
        """Where `state_dir=` keeps the run: a crash-safe store of every checkpoint, described for
        `tensorstow export` (None: no state dir, or the caller's `ssd_store`)."""
        if state_dir is not None and ssd_store is None:
            self.state_dir, ssd_store = _state_dir_store(state_dir, prog.plan, comm)
        try:
            self._init(model, device, device_budget, ssd_store, lr_schedule, total_steps, resume, init_values,
                       checkpoint_every, state_dir or ssd_store)
        except BaseException:
            if self.state_dir is not None:  # its directory lock
                ssd_store.close()
            raise
        if self.state_dir is not None:
            self.describe(self.state_dir, model)

    def _init(self, model, device, device_budget, ssd_store, lr_schedule, total_steps, resume, init_values,
              checkpoint_every, where) -> None:
        prog = self.program
        self._open_tiers(device, device_budget, ssd_store)
        o = self.plan.options
        self.lr_schedule = lr_schedule or LRSchedule(o.lr_scheduler, o.lr, o.warmup_steps, total_steps or 0,
                                                     o.min_lr_ratio)
        """Each update's learning rate, from the updates taken before it (`opt_steps`); None: the
        rate `set_lr` gave."""
        self._lr_step = 0  # the update the schedule last gave its rate for
        self.lr = self.lr_schedule(0)
        """The learning rate of the last step's update (of the next one before the first step)."""
        self.adam = {b: SubgroupAdam(self.plan.options) for b in self.block_params if self.block_params[b]}
        self.scaler = LossScaler(self.plan.options, self.device) if prog.precision == "fp16-mixed" else None
        """fp16-mixed: dynamic loss scaling (executor.amp, GradScaler's semantics)."""
        self.evaluating = False
        """Within `evaluate`: steps leave their updates out."""
        self.max_grad_norm = self.plan.options.max_grad_norm
        self._norms: dict[str, torch.Tensor] = {}
        """This step's gradient norms by parameter, as each block's backward makes them."""
        self._clip: torch.Tensor | None = None
        self.grad_norm: float | None = None
        """The last step's global gradient norm (clip_grad_norm_'s total_norm, before clipping;
        fp16-mixed: of the unscaled gradients; with microbatches, of their sum); None before
        the first step, and for plans on several processes (not computed yet)."""
        self.state = TrainingState(prog, self.dev, self.host, self.ssd, self.scaler)
        """The training state between steps: homes, checkpoints, resume (executor.training)."""
        self.steps_done = 0
        self.opt_steps = 0
        """Optimizer updates taken: Adam's step count (fewer than steps_done when fp16 loss
        scaling skipped some)."""
        self.timeline: list[tuple[int, float, float]] = []
        self.commit_s = 0.0
        """Seconds the last step's commit to the SSD store took (0: it committed nothing)."""
        self.early_sync_s = 0.0
        """Seconds the SSD store's early syncs (`SSDStore(early_sync=True)`) ran between the last
        step's start and its end: the disk flushing what the step wrote, beside its instructions."""
        self.loss: float | None = None
        self._rng_at_end: torch.Tensor | None = None
        self._loss: list[torch.Tensor] = []
        self._weights: list[float] = [1.0]
        """This step's microbatch weights (`micro_weights`)."""
        self._redoing = False
        """Running the redo program: SSD reads take the last commit's version, updates clip."""
        self.speculation: str | None = None
        """A speculating plan's last step: "held" (the clip did not fire: the speculated updates
        stand) or "redone" (they were redone from the last commit with the clipped gradients)."""
        self.inputs: dict[str, list[torch.Tensor]] = {}
        """Per graph input, its value for each microbatch."""
        self._sends: list = []  # this step's transfers in flight to other ranks
        if checkpoint_every < 1:
            raise TensorstowError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        if checkpoint_every > 1 and prog.speculated:
            raise TensorstowError(f"checkpoint every {checkpoint_every} steps: this plan redoes its speculated "
                                  f"updates from the last commit, so it commits every step; leave "
                                  f"--checkpoint-every out, or plan with --clip-rate 1 (updates wait for the norm)")
        self.checkpoint_every = checkpoint_every
        self._start(model, resume, init_values, where)
        self.graphs = Graphs(self, self._graphs_setting)
        """Whether the step replays as a captured graph, and the one it replays (executor.graphs)."""

    def describe(self, d, model: nn.Module) -> None:
        """layout.json (what each persistent buffer holds, by the model's own names) and, for an
        `hf:` model, its config.json, in state dir `d`: what `tensorstow export` needs besides the
        store."""
        from tensorstow.ir.hf import CausalLM
        names = {ph: name for name, ph in self.joint.placeholder.items()}
        layouts = {n: self.layouts[n] for n in sorted(self.homes)}
        hf = isinstance(model, CausalLM)
        inner = model.model if hf else model
        peft = None
        if hasattr(inner, "peft_config") and hasattr(inner, "active_adapter"):  # a PEFT model: its adapter's config
            name = inner.active_adapter if isinstance(inner.active_adapter, str) else inner.active_adapter[0]
            peft = (name, inner.peft_config[name].to_dict())
        statedir.write_description(Path(d), layouts, names, self.frozen, "model." if hf else "",
                                model.model.config if hf else None, peft)


    # ---- the step ---------------------------------------------------------------------------
    def _open_tiers(self, device, device_budget: int | None, ssd_store) -> None:
        """The device tier under the plan's budget, the DRAM arena the plan sizes, the SSD tier
        (a store also for checkpoints where nothing lives on SSD), and the lanes."""
        pred = self.plan.predicted
        self.device = resolve_device(device, self.rank)
        cuda = self.device.type == "cuda"
        if cuda:
            check_device(self.plan, self.device, self.rank)
        check_portable(self.program.traced.gm, self.device)
        self.joint.targets = targets_for(self.device)
        budget = min(pred.capacity_bytes["gpu"], self.plan.hardware.spec.gpus[self.rank].plan_bytes)  # this GPU's
        self.dev = DeviceTier(budget if device_budget is None else device_budget, self.device, self.gpu)
        self.lanes = lanes_for(self.instrs, self.device, overlap=self.mode == "overlap")
        """Orders the instructions: host time on the CPU, streams and events on CUDA (executor.cuda)."""
        self._side_lanes: dict[str, object] = {}
        """The same for the programs run besides the step (`_side_program`), made at their first run."""
        self.alloc_limit: int | None = None
        """CUDA: the bytes the caching allocator may reserve (the plan's budget + workspaces)."""
        self._fraction: float | None = None  # CUDA: the allocator's cap before this executor's
        self._base = None
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
        self.pool = HostPool(self.program.pool_bytes(self.mode), pin=cuda)
        """The DRAM tier's arena, as large as the plan's `pools` say."""
        self.host = HostTier(pin=cuda, pool=self.pool)
        uses_ssd = bool(self.plan.ssd_sizes())
        if ssd_store is None and uses_ssd:
            raise TensorstowError("the plan keeps buffers on the SSD tier: pass state_dir= "
                                  "(a directory on the SSD) or ssd_store=")
        self.ssd = SSDTier(ssd_store)  # a checkpoint store also when nothing lives on SSD
        if isinstance(ssd_store, SSDStore):  # what a step swaps out and reads back is not its state
            bufs = self.plan.buffers
            ssd_store.set_transient(n for n in ssd_store.sizes if n in bufs and not bufs[n].home)
        self.tiers = {self.gpu: self.dev, "dram": self.host, "ssd": self.ssd}

    def _start(self, model: nn.Module, resume: bool, init_values, where) -> None:
        """Each home's first copy: the SSD store's last commit (`resume`), else the model's
        values or `init_values`; a store that holds a commit is never overwritten."""
        store = self.ssd.store
        committed = store.committed_step() if store is not None else None
        if resume:
            self.opt_steps = self.state.resume(committed)
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
            self._fraction, self.alloc_limit = cap_allocator(self.device, self.dev.budget, self._base[1])

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step (forward, backward, optimizer) exactly as the plan schedules it. A
        pipeline's step takes M microbatches of the plan's batch (rows [k*batch, (k+1)*batch) are
        microbatch k) and trains as eager gradient accumulation does: each microbatch's loss / M
        back-propagated, the gradients summed, one update; it returns the mean loss.

        The step runs in `torch.inference_mode` (as does each lane's thread): the joint graph
        computes gradients itself, so nothing needs autograd, and its ops skip the autograd
        dispatch, view tracking and version counters (a 12-layer 64-wide model, host-bound: a
        step 7-10% faster on the CPU). Tensors a step creates are inference tensors: read them
        freely outside; only a step updates them in place."""
        with torch.inference_mode():
            return self._step(idx, targets)

    def evaluate(self, batches) -> float:
        """The mean loss over `batches` ((idx, targets) pairs of the plan's shape) with the current
        parameters, as eager computes it under `model.eval()` and `torch.no_grad()` (the mean of
        the batches' losses; the perplexity is its exp). Nothing changes: no update, no step
        counted, no commit, the random generator as it was.

        Each batch runs the plan's forward-only program (`Plan.eval_instructions`: the parameters
        streamed through the tiers as the step streams them, no saved activations, gradients or
        updates), or for a plan without one (pipelines, older plans) the step's schedule with its
        updates left out. With microbatches (`grad_accum`) a batch is that many, its loss weighted
        as the step's. The model's forward must not draw random numbers (dropout > 0 computes
        differently from eval mode): such a model is refused."""
        if self.program.forward_draws_random:
            raise TensorstowError("evaluate: the model's forward draws random numbers (dropout), which eval mode "
                                  "turns off; set its dropout to 0 to evaluate it here")
        if self.graphs.graph is not None:  # the eager evaluation would stack its memory on the graph's
            self.graphs.drop(self)
        rng, norm, clip = rng_bytes(), self.grad_norm, self._clip
        prog = self.program
        program = (self._side_program("eval", prog.eval_instrs, prog.eval_keep, prog.eval_plan_id) if prog.eval_instrs
                   else contextlib.nullcontext())
        losses = []
        self.evaluating = True
        try:
            with program, torch.inference_mode():
                for x, y in batches:
                    losses.append(self._step(x, y))
        finally:
            self.evaluating = False
            set_rng(rng)
            self.grad_norm, self._clip = norm, clip
        if not losses:
            raise TensorstowError("evaluate: no batches")
        return sum(losses) / len(losses)  # as an eager loop sums them

    def _step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        m = self.plan.model
        rows = m.batch * self.M
        for what, t in (("idx", idx), ("targets", targets)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (rows, m.seq) \
                    or t.dtype != torch.long:
                raise TensorstowError(f"{what} must be an int64 tensor of shape ({rows}, {m.seq}) "
                                      + (f"({self.M} microbatches of {m.batch}) " if self.M > 1 else "")
                                      + f"as planned, got {getattr(t, 'dtype', type(t))} "
                                      f"{tuple(getattr(t, 'shape', ()))}")
        if self.vocab is not None:
            ignored = self._ignored
            token = (targets >= 0) & (targets < self.vocab)
            if not bool(((idx >= 0) & (idx < self.vocab)).all()) or not bool((token | torch.isin(targets, ignored)).all()):
                raise TensorstowError(f"idx/targets hold token ids outside the model's vocabulary "
                                      f"[0, {self.vocab}) (labels its loss ignores: "
                                      f"{', '.join(map(str, ignored.tolist()))})")
        self._weights = self.micro_weights(targets)
        self.loss, self._loss = None, [None] * self.M
        self._backward_begun = False
        if self.lr_schedule is not None:
            self._lr_step = self.opt_steps
            self._apply_lr(self.lr_schedule(self.opt_steps))
        if self.scaler is not None:
            self.scaler.begin_step()
        self._norms.clear()
        self._clip, self.grad_norm = None, None
        self.commit_s = 0.0
        synced = self._early_sync_total()
        if isinstance(self.ssd.store, SSDStore):  # sync writes early only in a step that commits
            self.ssd.store.sync_early = (self.steps_done + 1) % self.checkpoint_every == 0
        graph = self.graphs.for_step(self)
        self.graphs.replayed = None
        if graph is not None:
            graph.feed(self, idx, targets, self._weights)
            if graph.ready:
                self._loss, self._norms = list(graph.loss), dict(graph.norms)
            elif not self.graphs.capture(self, graph):
                graph = None
        if graph is None:
            self.run_step(self.step_inputs(idx, targets), self.lanes, self.mode)
        else:
            graph.replay()
            self.graphs.replayed, self.timeline = graph, []
        self.loss = self._mean_loss()
        if self.evaluating:  # `evaluate`: nothing of the step is kept
            self._check_end_state()
            return self.loss
        if self._norms:
            self.grad_norm = float(self._total_norm())
        if self.program.speculated:
            self._validate()
        self._check_end_state()
        if self.carried and self.state.full_checkpoint:  # what the next step's commit records of this one
            self._rng_at_end = rng_bytes()
        self.steps_done += 1
        if self.scaler is None or not self.scaler.update():
            self.opt_steps += 1
        if self.steps_done % self.checkpoint_every == 0 and not self.carried:  # else the next step commits it
            t0 = time.perf_counter()
            if self.checkpoint(wait=not self.state.commits_in_background):
                self.commit_s = time.perf_counter() - t0
        self.early_sync_s = self._early_sync_total() - synced
        return self.loss

    def step_inputs(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """The step's inputs on the device, per graph input one value per microbatch: the rows of
        idx and targets, the loss tangent (eager's (loss * w_k).backward()), the graph's constants."""
        j, b = self.joint, self.plan.model.batch
        tdtype, tshape = j.meta(j.inputs[2])
        tangent = (self.scaler.tangent(tshape, tdtype) if self.scaler is not None
                   else torch.ones(tshape, dtype=tdtype, device=self.device))
        consts = tuple(c.to(self.device, copy=True) for c in j.constants.values())
        inputs: dict[str, list[torch.Tensor]] = {}
        for k in range(self.M):
            t_k = tangent if self.M == 1 else tangent * self._weights[k]
            vals = (idx[k * b:(k + 1) * b].to(self.device, copy=True),
                    targets[k * b:(k + 1) * b].to(self.device, copy=True), t_k)
            for name, v in zip((*j.inputs, *j.constants), vals + consts):
                inputs.setdefault(name, []).append(v)
        return inputs

    def run_step(self, inputs: dict[str, list[torch.Tensor]], lanes, mode: str) -> None:
        """Run the step's instructions on `inputs` through `lanes`, in `mode`'s order."""
        for name, vs in inputs.items():
            for v in vs:
                self.dev.hold(v, name)
        self.inputs, self.lanes = inputs, lanes
        lanes.begin()  # after the inputs: the lanes start from here
        ok = False
        try:
            (self._run_sync if mode == "sync" else self._run_overlap)()
            ok = True
        finally:
            try:
                self.timeline = lanes.end()  # every lane's work is done (CUDA: joined)
                for w in self._sends:  # transfers to other ranks complete before their copies go
                    w.wait()
            except Exception:
                if ok:
                    raise  # else the step's own error is the one to report
            finally:
                self._sends.clear()
                for vs in inputs.values():
                    for v in vs:
                        self.dev.release(v)
                self.inputs = {}

    def _validate(self) -> None:
        """A speculating plan's step, its norm now known: where the clip fires (or fp16 gradients
        overflowed), the redo program restores the speculated updates from the last commit and
        runs them again with the clipped gradients (after an overflow: leaves them as they were);
        else they stand and their kept gradients go. Nothing is committed before."""
        prog = self.program
        overflow = self.scaler is not None and self.scaler.skip()  # every gradient is checked by now
        if not overflow and (self.max_grad_norm <= 0 or float(self._clip_coef()) >= 1.0):
            for b in sorted(prog.speculated):
                self.host.drop(f"G:{b}")
            self.speculation = "held"
            return
        store = self.ssd.store
        if not isinstance(store, SSDStore):
            raise TensorstowError("this plan redoes speculated updates from the last commit, which needs the "
                                  "crash-safe SSD store: pass state_dir=")
        store.wait_background()  # the last commit is durable: its slots are the version to restore
        self._redoing = True
        try:
            with self._side_program("redo", prog.redo_instrs, {}, prog.redo_plan_id):
                self.lanes.begin()
                try:
                    (self._run_sync if self.mode == "sync" else self._run_overlap)()
                finally:
                    self.lanes.end()
        finally:
            self._redoing = False
        self.speculation = "redone"

    @contextlib.contextmanager
    def _side_program(self, name: str, instrs: list[Instr], keep: dict, plan_id: list[int]):
        """Within it, the executor replays a program besides the step (`Plan.eval_instructions`,
        `Plan.redo_instructions`) with lanes of its own; the step's program, lanes and measured
        timeline are back afterwards."""
        lanes = self._side_lanes.get(name)
        if lanes is None:
            lanes = self._side_lanes[name] = lanes_for(instrs, self.device, overlap=self.mode == "overlap")
        step = self.instrs, self.keep, self.plan_id, self.lanes, self.timeline
        self.instrs, self.keep, self.plan_id, self.lanes = instrs, keep, plan_id, lanes
        try:
            yield
        finally:
            self.instrs, self.keep, self.plan_id, self.lanes, self.timeline = step

    def _early_sync_total(self) -> float:
        return getattr(self.ssd.store, "early_sync_s", 0.0)

    def step_values(self) -> tuple[list, dict]:
        """The last run step's loss per microbatch and gradient norm per block (what a captured
        graph's replays then write: executor.graphs)."""
        return list(self._loss), dict(self._norms)

    def clear_step_values(self) -> None:
        """Forget the last step's losses, norms and clip factor (a dropped graph's replays wrote them)."""
        self._loss, self._norms, self._clip = [None] * self.M, {}, None

    def micro_weights(self, targets: torch.Tensor) -> list[float]:
        """Per microbatch k of a step's `targets`, the weight w_k of its loss (the mean over its
        labels) in the step's: its count of labels the loss does not ignore over the step's count,
        so the step's loss is the sum of every token loss over the count of labels in all M
        microbatches (the Hugging Face Trainer's `num_items_in_batch` normalisation; eager:
        `(loss_k * w_k).backward()` per microbatch). 1/M each where no label counts; [1.0] for one."""
        if self.M == 1:
            return [1.0]
        counts = [int((~torch.isin(t, self._ignored)).sum()) for t in targets.chunk(self.M)]
        total = sum(counts)
        return [n / total if total else 1 / self.M for n in counts]

    def _mean_loss(self) -> float:
        """The step's loss: sum over its microbatches of loss_k * w_k (`micro_weights`), in
        microbatch order, leaving out those whose every label is ignored (their mean is 0 / 0 and
        their weight 0); on a rank without the loss, the one the loss's rank sends."""
        here = None
        if all(v is not None for v in self._loss):
            here = float(self._loss[0]) if self.M == 1 else sum(
                float(v * w) for v, w in zip(self._loss, self._weights) if w)
        if self.comm is not None:
            return self.comm.share(here, gpu_index(self.block_gpu[self.program.loss_block()]))
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
        self.lr_schedule = None
        self._apply_lr(lr)

    def _record_norms(self, b: str, grads: dict[str, torch.Tensor]) -> None:
        """Block b's gradients' 2-norms as torch.nn.utils.clip_grad_norm_ takes them from eager's
        fp32 `.grad` (`torch._foreach_norm`): a 16-bit gradient cast to fp32, fp16-mixed's unscaled
        as GradScaler.unscale_ computes it (times 1/scale in fp32), one temporary copy at a time;
        for the step's global norm (`_total_norm`)."""
        j = self.joint
        inv = None if self.scaler is None else self.scaler.scale.double().reciprocal().float()
        for p in self.block_params.get(b, ()):
            if p not in j.grad:
                continue
            g = j.materialize(j.grad[p], grads.__getitem__).float()
            if inv is not None:
                g = g * inv.to(g.device)  # a copy: G itself is unscaled at its update
            self._norms[p] = torch._foreach_norm([g], 2.0)[0]

    def _total_norm(self) -> torch.Tensor:
        """clip_grad_norm_'s total_norm: the 2-norm of the parameters' norms stacked in the model's
        parameter order."""
        norms = [self._norms[p] for p in self.program.param_order if p in self._norms]
        dev = norms[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms]), 2.0)

    def _clip_coef(self) -> torch.Tensor:
        """clip_grad_norm_'s clip_coef_clamped, once a step (every gradient is in by the first
        update: the plan makes the updates wait for the last backward)."""
        if self._clip is None:
            self._clip = torch.clamp(self.max_grad_norm / (self._total_norm() + 1e-6), max=1.0)
        return self._clip

    def group_lr(self, scale: float) -> float:
        """The learning rate of a parameter group whose rate is lr x `scale` (`Options.param_groups`):
        as torch's LambdaLR, the group's base rate times the schedule's factor."""
        s = self.lr_schedule
        return self.lr * scale if s is None else (s.lr * scale) * s.factor(self._lr_step)

    def _apply_lr(self, lr: float) -> None:
        self.lr = lr
        for adam in self.adam.values():
            adam.lr = lr

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

    def _commit_previous(self, ins: Instr) -> None:
        """A step's `commit` instruction: the carried buffers are home, so the SSD holds the whole
        state of the step before; commit it when due (every `checkpoint_every` steps)."""
        if self.steps_done % self.checkpoint_every == 0 and self.ssd.store.committed_step() != self.steps_done:
            self.state.commit(self.steps_done, self.opt_steps, wait=not self.state.commits_in_background,
                              rng=self._rng_at_end)

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

    def _run_sync(self) -> None:
        for ins in self.instrs:
            self._dispatch(ins)

    def _run_overlap(self) -> None:
        """One worker per stream, in program order; an instruction waits for its deps only."""
        futures = [Future() for _ in self.instrs]
        lanes: dict[str, list[Instr]] = {}
        for ins in self.instrs:
            lanes.setdefault(ins.stream, []).append(ins)
        failures: list[tuple[int, BaseException]] = []
        nthreads = torch.get_num_threads()
        cores = lane_cores(self.device, nthreads)
        update_threads = optimizer_threads(self.device, nthreads, list(lanes))
        room = RoomWait(len(lanes))  # a copy the DRAM pool has no range for waits while a lane runs

        def lane(instrs: list[Instr]) -> None:
            k = 0
            try:
                # same intra-op split (and reduction order) as sync; the CPU optimizer's updates are
                # elementwise, so a smaller split changes no result
                torch.set_num_threads(update_threads if instrs[0].stream == CPU_OPTIMIZER else nthreads)
                if cores:
                    os.sched_setaffinity(0, cores[resource_of(instrs[0].stream).endswith(".compute")])
                # inference mode is thread-local: as in `step`; CUDA: the lane's stream
                with torch.inference_mode(), self.lanes.lane(instrs[0].stream):
                    for k, ins in enumerate(instrs):
                        for d in ins.deps:  # enqueued (device work) or done (host work)
                            if not futures[d].done():
                                with room.stall():
                                    futures[d].exception()
                            if futures[d].exception() is not None:
                                raise _Upstream()
                        self._dispatch(ins)
                        futures[ins.id].set_result(None)
            except BaseException as e:  # this and every later instruction of the lane fail
                if not isinstance(e, _Upstream):
                    failures.append((instrs[k].id, e))
                for rest in instrs[k:]:
                    if not futures[rest.id].done():
                        futures[rest.id].set_exception(_Upstream())
            finally:
                room.end()

        pinned = pin_off_compute(cores) if cores else {}
        self.host.room = room
        try:
            self._lane_threads.run({s: (lambda v=v: lane(v)) for s, v in lanes.items()})
        finally:
            self.host.room = None
            unpin(pinned)
        if failures:
            raise min(failures, key=lambda f: f[0])[1]

    def _dispatch(self, ins: Instr) -> None:
        self.lanes.before(ins)  # CUDA: waits for its dependencies' events
        try:
            HANDLERS[ins.kind](self, ins)
        except TensorstowError as e:
            raise type(e)(f"instruction {self.plan_id[ins.id]} ({_describe(ins)}): {e}") from None
        except torch.cuda.OutOfMemoryError:
            raise DeviceMemoryError(f"instruction {self.plan_id[ins.id]} ({_describe(ins)}): "
                                    f"{out_of_memory(self.alloc_limit, self.device)}") from None
        self.lanes.after(ins)

    def _check_end_state(self) -> None:
        want = set(self.homes.items()) | {(x, "dram") for x in self.carried}
        have = {(n, t) for t, tier in self.tiers.items() for n in tier.copies}
        if have != want:
            raise ExecutionError(
                f"the step did not return to its initial state: left {sorted(have - want)[:5]}, "
                f"lost {sorted(want - have)[:5]}; re-plan it")

    # ---- handlers ---------------------------------------------------------------------------
    def _compute(self, ins: Instr) -> None:
        """Run a segment. One that draws random numbers (dropout) and is recomputed later
        records, on its first run, the generator state it starts from; its recompute runs from
        that state and then puts the generator back, so the masks equal the original forward's
        and the rest of the step sees eager PyTorch's random stream."""
        if ins.segment not in self.program.random_segments:
            return self._run_segment(ins)
        gen = torch.cuda if self.device.type == "cuda" else torch
        if ins.kind == InstrKind.COMPUTE:
            self.rng_states[ins.segment] = gen.get_rng_state()
            return self._run_segment(ins)
        now = gen.get_rng_state()
        gen.set_rng_state(self.rng_states[ins.segment])
        try:
            self._run_segment(ins)
        finally:
            gen.set_rng_state(now)

    def _run_segment(self, ins: Instr) -> None:
        j = self.joint
        seg = j.segments[ins.segment]
        kept: dict[str, torch.Tensor] = {}

        passed: set[str] = set()  # kept roots whose hold went on to a buffer

        def fetch(root):
            return self._fetch(root, ins.micro)

        if self.device.type == "cpu" and not self._backward_begun and split_segment(ins.segment)[0] == "bwd":
            self._backward_begun = True  # the forward's heap pages go back before the backward's large gradients
            give_back_free_heap()
        try:
            j.run(seg, fetch=fetch, hold=self.dev.hold, release=self.dev.release,
                  keep=self.keep[ins.id], sink=kept.__setitem__, device=self.device)  # held: ours
            for a in ins.allocs:
                vals = {r: kept[r] if r in kept else fetch(r) for r in self.members[a]}
                grads = buffer_kind(a) is BufferKind.G
                if self.fp32_grads and grads:  # accumulated in fp32 (eager's .grad)
                    vals = {r: v.float() for r, v in vals.items()}
                ours = {r for r, v in vals.items() if r in kept and v is kept[r] and r not in passed}
                self.dev.put(a, vals, held=ours)
                passed |= ours
                if self.scaler is not None and grads:  # GradScaler's inf/NaN check
                    self.scaler.check(list(self.dev.get(a).values()))
                if grads and self.M == 1 and self.comm is None:  # final gradients, all here
                    self._record_norms(block_of(a), self.dev.get(a))
            for a in ins.accum:  # a later microbatch: eager's AccumulateGrad, .grad += this one's
                into = self.dev.get(a)
                for r in self.members[a]:  # a cut backward's first part hands some on (K:<b>)
                    into[r].add_(kept[r] if r in kept else self._fetch(r, ins.micro, besides=a))
                if self.scaler is not None:
                    self.scaler.check(list(into.values()))
                if ins.micro == self.M - 1 and self.comm is None:  # the sum is whole
                    self._record_norms(a[2:], into)
            if j.loss in kept:
                self._loss[ins.micro] = kept[j.loss]  # read when the step ends: no host wait here
        finally:
            for r, v in kept.items():
                if r not in passed:
                    self.dev.release(v)

    def _fetch(self, root: str, micro: int = 0, besides: str = "") -> torch.Tensor:
        """`root`'s value for microbatch `micro`: a step input, else the copy of a buffer on the
        device that holds it (but `besides`)."""
        v = self.inputs.get(root)
        if v is None:
            for h in self.program.holders_of(root, micro):
                c = self.dev.copies.get(h) if h != besides else None
                if c is not None:
                    return c[root]
            raise ExecutionError(
                f"{root} (in {', '.join(self.program.holders_of(root, micro) or ['no buffer'])}) is not on {self.gpu}; "
                f"the plan does not make it wait for the load that brings it")
        return v[micro]

    def _copy(self, ins: Instr) -> None:
        buf, src, dst = ins.tensor, ins.src, ins.dst
        layout = self.layouts[buf]
        if (src, dst) == (self.gpu, "dram"):  # CUDA: asynchronous, its readers wait for its event
            self.host.store_from(buf, layout, self.dev.get(buf), non_blocking=True)
        elif (src, dst) == ("dram", self.gpu):
            self.dev.load_from(buf, self.host.get(buf))
        elif (src, dst) == ("dram", "ssd"):
            self.ssd.write(buf, self.host.get(buf))
        else:
            self.ssd.read(buf, self.host, layout, first=ins.stream == "ssd.first", committed=self._redoing)

    def _send(self, ins: Instr) -> None:
        """A stage boundary: the sender stages the buffer in host memory and sends it with its
        strides; the receiver puts it on its device as it was (same strides, same bits)."""
        buf, layout = ins.tensor, self.layouts[ins.tensor]
        tag = 2 * self.plan_id[ins.id]  # the plan's id: the same on both ends
        at = self.device if self.comm.on_device else "cpu"  # NCCL sends device memory, gloo host memory
        if ins.src == self.gpu:
            c = HostCopy(layout, torch.empty(layout.nbytes, dtype=torch.uint8, device=at))
            for k, v in self.dev.get(buf).items():
                c.set(k, v)
            strides = torch.tensor([x for k in layout.keys() for x in c.strides[k]] or [0], dtype=torch.long,
                                   device=at)
            self._sends += self.comm.send([c.blob, strides], gpu_index(ins.dst), tag)
            return
        blob = torch.empty(layout.nbytes, dtype=torch.uint8, device=at)
        dims = [len(layout.slots[k].shape) for k in layout.keys()]
        strides = torch.empty(max(1, sum(dims)), dtype=torch.long, device=at)
        self.comm.recv([blob, strides], gpu_index(ins.src), tag)
        at, got = 0, {}
        for k, n in zip(layout.keys(), dims):
            got[k] = tuple(strides[at:at + n].tolist())
            at += n
        self.dev.load_from(buf, HostCopy(layout, blob, got))
        if self.device.type == "cuda":  # host work records no event: its readers find the copy done
            torch.cuda.current_stream(self.device).synchronize()

    def _free(self, ins: Instr) -> None:
        if ins.dst == self.gpu and ins.tensor in self.dev.copies:
            self.lanes.retire(self.dev.copies[ins.tensor].values())  # CUDA: other streams may still read it
        self.tiers[ins.dst].drop(ins.tensor)

    def _optimizer_step(self, ins: Instr) -> None:
        b = ins.segment
        on_dev = ins.dst != "cpu"
        tier = self.dev if on_dev else self.host
        j = self.joint
        ph = j.placeholder
        master = tier.get(f"M:{b}") if self.mixed else tier.get(f"P:{b}")
        trained = [p for p in self.block_params[b] if p in j.grad]  # no gradient: torch.optim skips it too
        # LoHan Table II: a mixed-precision update also produces the compute copy P from M; on the
        # CPU the fast kernel writes the 16-bit ones in the same pass (`out16`)
        fresh_p = None  # the copy P is written into; None: a new device copy, put below
        if self.mixed and f"P:{b}" not in ins.allocs:
            fresh_p = tier.get(f"P:{b}")
        elif self.mixed and not on_dev:
            fresh_p = self.host.alloc(f"P:{b}", self.layouts[f"P:{b}"])
        written: set[str] = set()
        speculative = b in self.program.speculated and not self._redoing  # validated after the step
        if not (self.evaluating or self.scaler is not None and not speculative and self.scaler.skip()):
            # fp16: inf/NaN changes nothing
            written = self._adam_update(b, ins, trained, master, fresh_p)
        if not self.mixed:
            return
        rest = [p for p in self.block_params[b] if ph[p] not in written]
        if fresh_p is None:  # a copy also for fp32 ones: P never aliases M
            self.dev.put(f"P:{b}", {ph[p]: master[p].to(j.meta(ph[p])[0], copy=True) for p in rest})
        else:
            # straight into P's memory, rounded as `.to` rounds: no temporary the size of the
            # parameter (an fp32 embedding's 412 MB, allocated and page-faulted each step, took
            # its update from 27 to 72 ms on an H200 host; benchmarks/RESULTS.md "On a GPU")
            for p in rest:
                fresh_p[ph[p]].copy_(master[p])

    def _adam_update(self, b: str, ins: Instr, trained: list[str], master, fresh_p) -> set[str]:
        """One Adam/AdamW update of block b's trained parameters; returns the compute-copy
        entries the update wrote itself (the fast CPU kernel's fused downcast)."""
        on_dev = ins.dst != "cpu"
        tier = self.dev if on_dev else self.host
        j = self.joint
        ph = j.placeholder
        grads_copy = tier.get(f"G:{b}")
        states = tier.get(f"OS:{b}")
        params, grads, moments, held = [], [], [], []
        # a speculated update's gradients are kept for a redo: unscaled on copies, never in place
        kept = self.scaler is not None and b in self.program.speculated and not self._redoing
        # the fast CPU update reads a 16-bit gradient in its width and scales it as it reads
        # (`adamw_steps_`): no fp32 copy of it is allocated and written first (17.9 ms for 50 M
        # parameters on an H200 host, the update itself 12; benchmarks/RESULTS.md "On a GPU")
        direct = self.mixed and not on_dev and not self.adam[b].exact and self.scaler is None
        clipping = self.max_grad_norm > 0 and (self._redoing or b not in self.program.speculated)
        try:
            for p in trained:
                g = j.materialize(j.grad[p], grads_copy.__getitem__)
                if kept and g.dtype == torch.float32:
                    g = g.clone()
                if self.mixed and g.dtype != torch.float32 and not direct:
                    g = g.float()
                    if on_dev:
                        self.dev.hold(g, f"{p} fp32 gradient")
                        held.append(g)
                params.append(master[p if self.mixed else ph[p]])
                grads.append(g)
                moments.append((states[f"{p}.exp_avg"], states[f"{p}.exp_avg_sq"]))
            if self.scaler is not None:
                self.scaler.unscale_(grads)
            grad_scale = 1.0
            if clipping and direct:
                grad_scale = float(self._clip_coef())
            elif clipping:
                # clip_grad_norm_: every gradient times min(1, max / (norm + 1e-6)); a speculated
                # update runs with factor 1 before the norm is known (`_validate`)
                unique = distinct(grads)
                torch._foreach_mul_(unique, self._clip_coef().to(unique[0].device))
            out16, written = None, set()
            if self.mixed and not on_dev and not self.adam[b].exact:
                out16 = [fresh_p[ph[p]] if fresh_p[ph[p]].dtype != torch.float32 else None for p in trained]
                written = {ph[p] for p, o in zip(trained, out16) if o is not None}
            # torch's single-tensor Adam allocates two parameter-sized temporaries (sqrt, denom)
            scratch = 2 * max((t.numel() * 4 for t in params), default=0) if on_dev and self.adam[b].exact else 0
            with self.dev.reserve(scratch, f"Adam scratch of {b}") if scratch else contextlib.nullcontext():
                g = self.graphs.capturing  # a captured update reads its step count and rates from memory
                self.adam[b].step(params, grads, moments, self.opt_steps if g is None else g.step_count, out16,
                                  groups=[self.program.groups[p] for p in trained], lr_of=self.group_lr,
                                  grad_scale=grad_scale, rates=None if g is None else g.rates)
        finally:
            for g in held:
                self.dev.release(g)
        return written

    # ---- results ----------------------------------------------------------------------------
    def parameters(self) -> dict[str, torch.Tensor]:
        """The parameters by qualified name, as fp32 CPU tensors: trainable ones from their
        masters, frozen ones from their constants (buffers are not parameters)."""
        out = {}
        for b, params in self.block_params.items():
            if not params or self.block_gpu[b] != self.gpu:  # another rank's stage
                continue
            buf = f"M:{b}" if self.mixed else f"P:{b}"
            copy = self.state.latest(buf)
            for p in params:
                out[p] = copy[p if self.mixed else self.joint.placeholder[p]].detach().float().cpu().clone()
        for b, consts in self.block_consts.items():
            frozen = [c for c in consts if c in self.frozen and self.block_gpu[b] == self.gpu]
            if frozen:
                copy = self.state.latest(f"C:{b}")
                for c in frozen:
                    out[c] = copy[self.joint.placeholder[c]].detach().float().cpu().clone()
        return dict(sorted(out.items()))

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
        self._lane_threads.close()
        if self.ssd.store is not None and hasattr(self.ssd.store, "close"):
            self.ssd.store.close()
        if self._fraction is not None:  # the allocator's cap is what it was before
            torch.cuda.set_per_process_memory_fraction(self._fraction, self.device)
            self._fraction = None

    @property
    def loss_scale(self) -> float | None:
        """fp16-mixed: the current loss scale (GradScaler.get_scale()); None otherwise."""
        return None if self.scaler is None else float(self.scaler.scale)

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


HANDLERS = {
    InstrKind.COMPUTE: Executor._compute,
    InstrKind.RECOMPUTE: Executor._compute,
    InstrKind.LOAD: Executor._copy,
    InstrKind.STORE: Executor._copy,
    InstrKind.FREE: Executor._free,
    InstrKind.OPTIMIZER_STEP: Executor._optimizer_step,
    InstrKind.SEND: Executor._send,
    InstrKind.COMMIT: Executor._commit_previous,
}


class _Upstream(Exception):
    """An instruction did not run because one it waits for failed."""


def _describe(ins: Instr) -> str:
    if ins.kind in (InstrKind.COMPUTE, InstrKind.RECOMPUTE):
        return f"{ins.kind} {ins.segment}"
    if ins.kind == InstrKind.OPTIMIZER_STEP:
        return f"optimizer_step {ins.segment} on {ins.dst}"
    if ins.kind == InstrKind.FREE:
        return f"free {ins.tensor} on {ins.dst}"
    if ins.kind == InstrKind.SEND:
        return f"send {ins.tensor} {ins.src}->{ins.dst}"
    return f"{ins.kind} {ins.tensor} {ins.src}->{ins.dst}"


