"""Replay a plan's static schedule every training step: a dispatch table and a flat loop.

`Executor(plan, model)` re-traces `model` exactly as the planner did, refuses a plan whose
model fingerprint differs, places every buffer on its home tier (parameters from the
model, Adam states zero) and then, per `step(idx, targets)`, runs the plan's instructions:

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

Buffer contents (see planner/schedule.py for the names):
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
import dataclasses
import os
import queue
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.nn as nn

from tensorstow.errors import TensorstowError
from tensorstow.executor.aio import aligned_empty
from tensorstow.executor.amp import AMP, LossScaler
from tensorstow.executor.cuda import cap_allocator, check_device, lanes_for, out_of_memory, resolve_device
from tensorstow.executor.device_ops import check_portable, targets_for
from tensorstow.executor.malloc import tune as tune_malloc
from tensorstow.executor.segments import Joint
from tensorstow.executor.ssd import SSDStore
from tensorstow.executor.state import RNG, rng_bytes, set_rng
from tensorstow.executor.stores import (DeviceMemoryError, DeviceTier, FileStore, HostCopy, HostPool, HostTier, Layout,
                                        SSDTier, contiguous_stride)
from tensorstow.ir.trace import Traced, model_dims, trace_model
from tensorstow.schema.plan import as_plan
from tensorstow.schema.schedule import (Instr, block_gpus, block_of, carried_buffers, home_tiers, resource_of,
                                        split_micro)

MODES = ("sync", "overlap")
KINDS = ("compute", "recompute", "load", "store", "free", "optimizer_step", "send", "commit")


HELD_KINDS = ("P", "C", "G", "A", "R", "X", "T", "H", "AE", "RE", "K")
"""Buffer kinds whose members are joint-graph roots a segment may read (by `_holders`)."""
MADE_BY_COMPUTE = ("A", "R", "X", "G", "T", "H", "AE", "RE", "K")
"""Buffer kinds a compute or recompute instruction may create on the device."""


class ExecutionError(TensorstowError):
    """An instruction could not run as the plan says (names the instruction)."""


def lane_cores(device: torch.device, nthreads: int) -> tuple[set[int], set[int]] | None:
    """(the other lanes' cores, the compute lane's cores) when the device tier is the CPU and the
    compute's `nthreads` leave cores to spare; None otherwise. On a CPU device the copy, SSD and
    optimizer lanes (and the I/O and checksum threads they start) would otherwise preempt the
    compute thread on its own core; pinned apart, each runs where the simulator puts it: on a
    resource of its own."""
    if device.type != "cpu" or not hasattr(os, "sched_getaffinity"):
        return None
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) <= nthreads:
        return None
    return set(mine[nthreads:]), set(mine[:nthreads])


def pin_off_compute(cores: tuple[set[int], set[int]]) -> dict[int, set[int]]:
    """Move every thread of this process but the main thread and the compute lane's (those whose
    affinity is the compute cores: the lane and the intra-op threads it started) onto the other
    lanes' cores; returns {thread id: its affinity before} for `unpin`. `lane_cores` pins the lanes
    themselves, but the threads that work for them were mostly started elsewhere (the checksum
    and sync pools and the aio engine's workers: by the store, in the main thread), so they could
    run on -- and take -- the compute lane's core: gpt-small's SSD plan stepped 2-4% faster with
    them moved off it in 2 of 3 alternating runs (benchmarks/RESULTS.md "Host memory and threads")."""
    others, compute = cores
    main = threading.main_thread().native_id
    before: dict[int, set[int]] = {}
    try:
        tids = [int(e.name) for e in os.scandir("/proc/self/task")]
    except OSError:  # no procfs
        return before
    for tid in tids:
        if tid == main:
            continue
        try:
            now = os.sched_getaffinity(tid)
            if now <= others or now == compute:
                continue
            os.sched_setaffinity(tid, others)
            before[tid] = now
        except OSError:  # it ended meanwhile
            continue
    return before


def unpin(before: dict[int, set[int]]) -> None:
    """Give each thread `pin_off_compute` moved its affinity back (one that ended is skipped)."""
    for tid, cores in before.items():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            continue


class _LaneThreads:
    """One long-lived thread per stream of the plan, which overlap mode runs that stream's lane
    on, step after step. A thread made anew each step starts with cold per-thread state: its
    allocator's thread cache and arena (under jemalloc gpt-small's all-resident compute ran 12%
    slower in a new thread each step than in the main thread: 272-287 vs 241-257 ms a step, the
    same under glibc: benchmarks/RESULTS.md "Host memory and threads"), torch's thread-local
    state, a CUDA thread's stream and handles. The threads wait on their queues between steps and
    end when `close` (or the Executor's garbage collection) stops them."""

    def __init__(self):
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []

    def run(self, jobs: dict[str, Callable[[], None]]) -> None:
        """Run each stream's job on that stream's thread, all at once; return when all are done.
        A job handles its own errors (`Executor._run_overlap`'s lanes record them); one that
        escapes is raised here, and its thread serves the next step all the same."""
        done = [(threading.Event(), []) for _ in jobs]
        for (stream, job), (ev, error) in zip(sorted(jobs.items()), done):
            q = self._queues.get(stream)
            if q is None:
                q = self._queues[stream] = queue.SimpleQueue()
                t = threading.Thread(target=self._serve, args=(q,), name=f"tensorstow-{stream}", daemon=True)
                t.start()
                self._threads.append(t)
            q.put((job, ev, error))
        for ev, _ in done:
            ev.wait()
        for _, error in done:
            if error:
                raise error[0]

    @staticmethod
    def _serve(q) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            job, ev, error = item
            del item  # waiting for the next job must not keep this one's Executor alive
            try:
                job()
            except BaseException as e:
                error.append(e)
            finally:
                del job, error
                ev.set()

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        self._queues, self._threads = {}, []


class Executor:
    def __init__(self, plan, model: nn.Module, *, mode: str = "sync", state_dir=None,
                 ssd_store=None, resume: bool = False, device_budget: int | None = None,
                 traced: Traced | None = None, checkpoint_every: int = 1, init_values=None,
                 device: str | torch.device | None = None, rank: int | None = None, comm=None):
        """`state_dir`: directory for the fallback `FileStore` when the plan uses the SSD tier and
        no `ssd_store` is given. `resume`: continue from the step the SSD store committed last
        (every P/M/OS buffer must live on SSD; the model's values are then not used); without
        it a store holding committed state is refused rather than overwritten.
        `device_budget`: bytes the device tier may hold (default: the plan's GPU capacity).
        `traced`: a trace of this very model (`ir.trace.trace` with the plan's batch, seq and
        precision) to skip re-tracing; it is checked against the plan's fingerprint and the
        model's parameters like a fresh trace. A store made with `executor.state.store_sizes`
        is a full checkpoint: every `checkpoint_every` steps the state that lives off SSD and the
        random generator are written too, and resuming needs nothing else. `init_values`: an
        iterator of (name, value) of the parameters in parameter order, or a mapping name ->
        value read on demand, used instead of the model's parameters (which may then live on the
        meta device: out-of-core initialisation). `device`: where the device tier lives, "cuda"
        or "cpu" (budgeted host memory); default the environment's TENSORSTOW_DEVICE, else CUDA
        when there is one. `rank`, `comm`: a multi-GPU plan runs one executor per GPU: this one
        replays GPU `rank`'s share of the plan (its stages' instructions, their DRAM and SSD work,
        both ends of its `send`s) and moves stage boundaries through `comm`
        (executor.distributed.Comm)."""
        self._lane_threads = _LaneThreads()  # overlap mode's lanes, kept from step to step
        # collected: its lanes end; at exit they are daemons (a step interrupted there never joins)
        weakref.finalize(self, self._lane_threads.close).atexit = False
        if mode not in MODES:
            raise TensorstowError(f"unknown executor mode '{mode}': use one of {list(MODES)}")
        tune_malloc()  # freed buffers are reused, not unmapped and faulted in again each step
        from tensorstow.ir.hf import wrap
        plan = as_plan(plan)  # the typed plan, as its file would read (a dict is validated)
        model = wrap(model)
        pl = plan.decisions.pipeline
        if pl is not None and pl.kind == "data-parallel":
            raise TensorstowError("a zero3-dp plan is a simulated baseline (the Mobius comparison), not "
                                  "executable: execute a mobius, gpipe or single-GPU plan")
        self.M = pl.microbatches if pl else 1
        """Microbatches per step: `step` takes M x the plan's batch."""
        self.block_gpu = block_gpus(plan)
        gpus = sorted({int(g[3:]) for g in self.block_gpu.values()})
        if rank is None:
            if gpus != [0]:
                n = len(plan.hardware.spec.gpus)
                raise TensorstowError(f"this plan runs on {n} GPUs: execute it with one process per GPU "
                                      f"(`tensorstow execute PLAN --nproc {n}`)")
            rank = 0
        self.rank, self.gpu, self.comm = rank, f"gpu{rank}", comm
        """The GPU this executor drives: the plan's tier "gpuK"."""
        order = [b.name for b in plan.model.blocks]
        self.homes = {n: t for n, t in home_tiers(dict(plan.buffers), plan.decisions, order).items()
                      if self.block_gpu[plan.buffers[n].block] == self.gpu}
        """This executor's buffers with a home tier -> that tier: the training state it holds."""
        self.carried = [x for x in carried_buffers(plan.decisions, dict(plan.buffers)) if x in self.homes]
        """SSD-homed buffers whose latest version stays in DRAM between steps
        (`Decisions.deferred_writes`): each step writes them home first, then commits the step
        before (its `commit` instruction)."""
        self.mode = mode
        self.plan = plan
        m = plan.model
        if traced is None:  # a replicated plan runs its block templates (ir.template)
            traced = trace_model(model, batch=m.batch, seq=m.seq, precision=m.precision,
                                 model_name=m.name, template=plan.replicated)
        self.traced = traced
        _check_model_graph(m, traced)
        self.graph = self.traced.graph
        self.joint = Joint(self.traced)
        shapes = {n: tuple(p.shape) for n, p in model_state(model).items()}
        if sorted(shapes) != self.joint.param_names or any(
                shapes[n] != self.joint.meta(self.joint.placeholder[n])[1] for n in shapes):
            raise TensorstowError(f"the model's parameters and buffers do not match the traced graph of "
                                  f"{m.name}; pass the model the trace was made from")
        self.precision = m.precision
        self.mixed = self.precision != "fp32"
        self.fp32_grads = plan.decisions.fp32_grads(self.mixed)
        """G holds fp32 gradients (`Decisions.fp32_grads`: accumulated over microbatches, or on
        their way to SSD)."""
        self.instrs = self._read_instructions(plan)
        self.block_params = {b: ps for b, (ps, _) in self.joint.block_state.items()}
        """Trainable parameters per block (P, G, M, OS, the optimizer)."""
        self.block_consts = {b: cs for b, (_, cs) in self.joint.block_state.items() if cs}
        """Frozen parameters and buffers per block (C: read, never written)."""
        self.frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        self.layouts, self.members = self._buffers(plan)
        self._add_reforwards()
        self._add_backward_parts()
        self._check_references()
        self.holders: dict[str, list[str]] = defaultdict(list)
        for buf, roots in self.members.items():
            if buf.split(":")[0] in HELD_KINDS:
                for r in roots:
                    self.holders[r].append(buf)
        self._holders_of: dict[tuple[str, int], list[str]] = {}  # `_holders`, made once per key
        self.rng_states: dict[str, torch.Tensor] = {}
        recomputed = {i.segment for i in self.instrs if i.kind == "recompute"}
        self.random_segments = {name for name in recomputed if _draws_random(self.joint.segments[name])}
        """Recomputed segments that draw random numbers (dropout): their recompute replays the
        generator state their first run started from, so masks equal the original forward's."""

        pred = plan.predicted
        if pred.peak_bytes["gpu"] > pred.capacity_bytes["gpu"]:
            raise TensorstowError(f"the plan does not fit its GPU ({pred.peak_bytes['gpu']} bytes at peak > "
                                  f"{pred.capacity_bytes['gpu']} capacity); re-plan it")
        self.device = resolve_device(device, rank)
        cuda = self.device.type == "cuda"
        if cuda:
            check_device(plan, self.device, rank)
        check_portable(self.traced.gm, self.device)
        self.joint.targets = targets_for(self.device)
        budget = min(pred.capacity_bytes["gpu"], plan.hardware.spec.gpus[rank].plan_bytes)  # this GPU's
        self.dev = DeviceTier(budget if device_budget is None else device_budget, self.device, self.gpu)
        self.lanes = lanes_for(self.instrs, self.device, overlap=mode == "overlap")
        """Orders the instructions: host time on the CPU, streams and events on CUDA (executor.cuda)."""
        self.alloc_limit: int | None = None
        """CUDA: the bytes the caching allocator may reserve (the plan's budget + workspaces)."""
        self._fraction: float | None = None  # CUDA: the allocator's cap before this executor's
        self._base = None
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))
        self.pool = HostPool(max(HostPool.needed(self._dram_events(resume, order))
                                 for order in self._orders()), pin=cuda)
        self.host = HostTier(pin=cuda, pool=self.pool)
        uses_ssd = bool(plan.ssd_sizes())
        if ssd_store is None and uses_ssd:
            if state_dir is None:
                raise TensorstowError("the plan keeps buffers on the SSD tier: pass state_dir= "
                                      "(a directory on the SSD) or ssd_store=")
            ssd_store = FileStore(state_dir)
        self.ssd = SSDTier(ssd_store)  # a checkpoint store also when nothing lives on SSD
        if isinstance(ssd_store, SSDStore):  # what a step swaps out and reads back is not its state
            ssd_store.set_transient(n for n in ssd_store.sizes if n in plan.buffers and not plan.buffers[n].home)
        self.tiers = {self.gpu: self.dev, "dram": self.host, "ssd": self.ssd}

        self.keep = self._kept_values()
        self.adam = {b: _Adam(plan.options) for b in self.block_params if self.block_params[b]}
        self.scaler = LossScaler(plan.options, self.device) if self.precision == "fp16-mixed" else None
        """fp16-mixed: dynamic loss scaling (executor.amp, GradScaler's semantics)."""
        self.vocab = model_dims(model)[0]
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
        self.inputs: dict[str, list[torch.Tensor]] = {}
        """Per graph input, its value for each microbatch."""
        self._sends: list = []  # this step's transfers in flight to other ranks
        if checkpoint_every < 1:
            raise TensorstowError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        store = self.ssd.store
        self.full_checkpoint = RNG in (getattr(store, "sizes", None) or {})
        committed = store.committed_step() if store is not None else None
        if resume:
            self._resume(committed)
            if not self.full_checkpoint:
                self._place_homes(model, kinds=("C",), skip_ssd=True)  # never trained: from the model
        elif committed is not None:
            raise TensorstowError(
                f"the SSD store ({state_dir or ssd_store}) holds training state committed at step "
                f"{committed}: pass resume=True to continue from it, or use an empty state dir")
        else:
            self._place_homes(model, values=init_values)
        for x in self.carried:  # the DRAM copies a step starts from
            self.ssd.read(x, self.host, self.layouts[x])
        self.host.peak = self.host.used
        if cuda:  # last: a refused executor leaves the allocator as it was
            self._fraction, self.alloc_limit = cap_allocator(self.device, self.dev.budget, self._base[1])

    # ---- setup ------------------------------------------------------------------------------
    def _read_instructions(self, plan) -> list[Instr]:
        """This executor's share of the plan's instructions, checked against what it drives (the
        plan's own consistency, ids, deps and buffer names, `Plan.from_json` has checked), numbered
        0.. in program order (`plan_id` maps back); dependencies on other ranks' instructions are
        dropped: what crosses ranks is a `send`, which both ends replay."""
        g = self.gpu
        links = {(g, "dram"), ("dram", g), ("dram", "ssd"), ("ssd", "dram")}
        mine: list[Instr] = []
        local: dict[int, int] = {}
        self.plan_id: list[int] = []
        for k, ins in enumerate(plan.instructions):
            if ins.kind not in KINDS:
                raise TensorstowError(f"plan instruction {k}: unknown kind '{ins.kind}' (this executor "
                                      f"runs {', '.join(KINDS)})")
            if not self._mine(ins):
                continue
            if ins.kind in ("compute", "recompute") and not self._known_segment(ins):
                raise TensorstowError(f"plan instruction {k}: unknown segment '{ins.segment}'")
            if ins.kind in ("compute", "recompute") and ins.stream != f"{g}.compute":
                raise TensorstowError(f"plan instruction {k}: segments run on {g}.compute, not "
                                      f"'{ins.stream}' (one device, one compute stream)")
            if ins.kind in ("load", "store") and (ins.src, ins.dst) not in links:
                raise TensorstowError(f"plan instruction {k}: no copy {ins.src} -> {ins.dst} (this executor "
                                      f"drives {g}, with dram and ssd)")
            if ins.kind == "send" and (self.comm is None or not (ins.src.startswith("gpu") and ins.dst.startswith("gpu"))):
                raise TensorstowError(f"plan instruction {k}: a send {ins.src} -> {ins.dst} needs one process "
                                      f"per GPU (`tensorstow execute PLAN --nproc N`)")
            if ins.kind == "free" and ins.dst not in (g, "dram", "ssd"):
                raise TensorstowError(f"plan instruction {k}: unknown tier '{ins.dst}'")
            if ins.kind == "optimizer_step" and ins.dst not in ("cpu", g):
                raise TensorstowError(f"plan instruction {k}: optimizer device '{ins.dst}' is not cpu or {g}")
            if ins.micro >= self.M:
                raise TensorstowError(f"plan instruction {k}: microbatch {ins.micro} of {self.M}")
            local[k] = len(mine)
            self.plan_id.append(k)
            mine.append(dataclasses.replace(ins, id=local[k], deps=tuple(local[d] for d in ins.deps if d in local)))
        return mine

    def _mine(self, ins: Instr) -> bool:
        """Whether this executor replays `ins`: its GPU's streams, both ends of a send touching it,
        and the host work (DRAM, SSD, CPU optimizer) of its blocks."""
        if ins.kind == "send":
            return self.gpu in (ins.src, ins.dst)
        if ins.kind == "commit":
            return True
        dev = ins.stream.split(".")[0]
        if dev.startswith("gpu"):
            return dev == self.gpu
        return self.block_gpu[ins.segment if ins.kind == "optimizer_step" else self.plan.buffers[ins.tensor].block] == self.gpu

    def _orders(self) -> list[list[Instr]]:
        """The orders the instructions may run in: program order (sync mode), and in overlap mode
        also the order of their simulated start times (the plan's own timing: lanes run ahead of
        program order, so DRAM holds what the simulated replay holds at its peak)."""
        if self.mode == "sync":
            return [self.instrs]
        from tensorstow.planner.simulate import simulate_plan
        start = simulate_plan(self.plan).start
        return [self.instrs, sorted(self.instrs, key=lambda i: (start[self.plan_id[i.id]], i.id))]

    def _dram_events(self, resume: bool, order: list[Instr]) -> list[tuple]:
        """The DRAM tier's allocations and frees with the instructions in `order`: placing the
        homes (block by block; an SSD home passes through DRAM), then two steps, the second the
        steady state the pool must hold (`HostPool.needed` sizes the arena from them)."""
        bufs, events, here = self.plan.buffers, [], set()

        def alloc(n):
            if n not in here:
                here.add(n)
                events.append(("alloc", n, self.layouts[n].nbytes))

        def free(n):
            here.discard(n)
            events.append(("free", n))
        for blk in self.graph.blocks:
            for n in (f"{k}:{blk.name}" for k in ("P", "C", "M", "OS")):
                home = bufs[n].home if n in self.homes else None
                if home == "dram" or home == "ssd" and not resume or home == "gpu" and resume:
                    alloc(n)
                    if home != "dram":  # staged through DRAM on its way home
                        free(n)
        for n in self.carried:
            alloc(n)
        for _ in range(2):
            for ins in order:
                if ins.kind in ("load", "store") and ins.dst == "dram":
                    alloc(ins.tensor)
                elif ins.kind == "free" and ins.dst == "dram" and ins.tensor in here:
                    free(ins.tensor)
                elif ins.kind == "optimizer_step" and ins.dst == "cpu":
                    for a in ins.allocs:
                        alloc(a)
        return events

    def _known_segment(self, ins: Instr) -> bool:
        """A traced segment, or a partial swap's re-forward of a block that has a forward (built
        from the plan's buffers by `_add_reforwards`)."""
        seg = ins.segment
        if seg in self.joint.segments:
            return True
        phase, _, b = seg.partition(":")
        if phase in ("bwd1", "bwd2"):  # a cut backward (`_add_backward_parts`)
            return ins.kind == "compute" and f"bwd:{b}" in self.joint.segments
        return ins.kind == "recompute" and phase == "refwd" and f"fwd:{b}" in self.joint.segments

    def _add_reforwards(self) -> None:
        """The `refwd:<b>` segments a partial swap's recompute runs: the part of b's forward that
        makes R:<b> again from what A:<b> brought back (and X, P)."""
        for ins in self.instrs:
            if ins.kind != "recompute" or not ins.segment.startswith("refwd:") or ins.segment in self.joint.segments:
                continue
            b = ins.segment.split(":", 1)[1]
            given = [r for x in (f"A:{b}", f"AE:{b}") for r in self.members.get(x, ())]
            if not ins.allocs or set(ins.allocs) - {f"R:{b}", f"RE:{b}"} or not given:
                raise TensorstowError(f"plan instruction {ins.id}: recompute {ins.segment} needs buffers A:{b} "
                                      f"and R:{b}; re-plan it")
            seg = self.joint.add_reforward(b, [r for x in ins.allocs for r in self.members[x]], given)
            if _draws_random(seg):
                raise TensorstowError(f"plan instruction {ins.id}: {ins.segment} would draw random numbers "
                                      f"again (dropout); a block that draws them is swapped whole; re-plan it")

    def _add_backward_parts(self) -> None:
        """The `bwd1:<b>` / `bwd2:<b>` segments of a cut backward: the first `bwd_cut` ops of b's
        backward in the traced graph's order (`BlockDecision.bwd_cut`, as the planner's profile
        counted them), and the rest."""
        cut = {ins.segment.split(":", 1)[1] for ins in self.instrs if ins.segment.startswith("bwd1:")}
        for b in sorted(cut):
            if f"bwd1:{b}" in self.joint.segments:
                continue
            n = self.plan.decisions.blocks[b].bwd_cut if b in self.plan.decisions.blocks else 0
            profile = self.joint.inst.profile.get(b, b)
            ops = [o.name for o in self.graph.ops if o.block == profile and o.phase == "bwd"]
            if not 0 < n < len(ops):
                raise TensorstowError(f"the plan runs block {b}'s backward in two parts but cuts it after {n} "
                                      f"of its {len(ops)} ops; re-plan it")
            self.joint.add_backward_parts(b, set(ops[:n]))

    def _check_references(self) -> None:
        """Every buffer an instruction names exists, and each kind creates what it can."""
        for ins in self.instrs:
            named = [ins.tensor] if ins.kind in ("load", "store", "free") else []
            for n in named + list(ins.allocs):
                if n not in self.layouts:
                    raise TensorstowError(f"plan instruction {ins.id}: unknown buffer '{n}'; re-plan it")
            if ins.kind in ("compute", "recompute"):
                bad = [a for a in ins.allocs if a.split(":")[0] not in MADE_BY_COMPUTE]
            elif ins.kind == "optimizer_step":
                if not self.block_params.get(ins.segment):
                    raise TensorstowError(f"plan instruction {ins.id}: '{ins.segment}' is not a block "
                                          f"with parameters")
                bad = [a for a in ins.allocs if a != f"P:{ins.segment}"]
            else:
                bad = list(ins.allocs)
            if bad:
                raise TensorstowError(f"plan instruction {ins.id} ({ins.kind}) cannot create {bad}")

    def _buffers(self, plan):
        """Layout (named tensors) of every data buffer, read from the plan's `members` (by the
        profile's names; a replicated layer's are its own instances), checked against the traced
        model and the plan's bytes."""
        j, inst = self.joint, self.joint.inst
        layouts: dict[str, Layout] = {}
        members: dict[str, list[str]] = {}
        for name, spec in sorted(plan.buffers.items()):
            kind, b = name.split(":")[0], block_of(name)
            if kind == "W":
                continue  # a workspace: the segment's real temporaries, counted as they are made
            if kind not in (*HELD_KINDS, "M", "OS") or b not in inst.profile:
                raise TensorstowError(f"plan buffer {name} names nothing in the traced model; re-plan it")
            if not spec.members:
                raise TensorstowError(f"plan buffer {name} does not list its members (a plan of an older "
                                      f"tensorstow); re-plan it")
            entries, roots = [], []
            for m in spec.members:
                try:
                    key, meta = self._member(kind, b, m)
                    dtype, shape = j.meta(meta)
                except KeyError:
                    raise TensorstowError(f"plan buffer {name} holds {m}, which the traced model does not "
                                          f"have; re-plan it") from None
                fp32 = kind in ("M", "OS") or kind == "G" and self.fp32_grads
                entries.append((key, torch.float32 if fp32 else dtype, shape))
                if kind not in ("M", "OS"):
                    roots.append(key)
            layouts[name] = Layout(entries)
            if roots:
                members[name] = roots
            if layouts[name].nbytes != spec.bytes:
                raise TensorstowError(f"plan buffer {name}: {spec.bytes} bytes in the plan, "
                                      f"{layouts[name].nbytes} in the traced model; re-plan it")
        for b, params in self.block_params.items():
            want = {"P": [j.placeholder[p] for p in params], "C": [j.placeholder[c] for c in self.block_consts.get(b, ())],
                    "G": sorted({r for p in params if p in j.grad for r in j.roots_of(j.grad[p])})}
            if self.block_gpu[b] != self.gpu:
                continue
            for kind, names in want.items():
                if sorted(members.get(f"{kind}:{b}", [])) != sorted(names):
                    raise TensorstowError(f"plan buffer {kind}:{b} does not hold what block {b} of the traced "
                                          f"model has for it; re-plan it")
        return layouts, members

    def _member(self, kind: str, b: str, m: str) -> tuple[str, str]:
        """(layout key, traced node giving its dtype and shape) of a plan member of buffer kind:b."""
        j, inst = self.joint, self.joint.inst
        if kind in ("P", "C"):
            ph = j.placeholder[inst.state_name(b, m)]
            return ph, ph
        if kind in ("M", "OS"):
            q, _, suffix = m.rpartition(".")
            if kind == "M" and suffix != "master" or kind == "OS" and suffix not in ("exp_avg", "exp_avg_sq"):
                raise KeyError(m)
            real = inst.state_name(b, q)
            return (real if kind == "M" else f"{real}.{suffix}"), j.placeholder[real]
        name = inst.name(b, m)
        j.node[inst.template_of(name)[0]]  # KeyError: not in the trace
        return name, name

    def _kept_values(self) -> dict[int, frozenset]:
        """Per compute instruction, the values its segment leaves on the device: what its
        `allocs` buffers hold (and the loss). Nothing else outlives a segment: every value read
        across segments is in a planned buffer (X, A, G, T, H), and this walk over the
        instructions in program order, tracking which buffers are on the device, refuses a plan under
        which a segment would read one that is not there.
        """
        j, g = self.joint, self.gpu
        present = set(self.homes.items())
        last_made: dict[str, int] = {}
        for ins in self.instrs:
            if ins.kind in ("load", "store", "send"):
                present.add((ins.tensor, ins.dst))
            elif ins.kind == "free":
                present.discard((ins.tensor, ins.dst))
            elif ins.kind == "optimizer_step":
                for a in ins.allocs:
                    present.add((a, "dram" if ins.dst == "cpu" else ins.dst))
            elif ins.kind in ("compute", "recompute"):
                seg = j.segments[ins.segment]
                need = set(seg.ext_roots)
                for a in ins.allocs + ins.accum:
                    need |= set(self.members.get(a, ())) - seg.produced
                for r in sorted(need):
                    if r in j.inputs or r in j.constants or any((h, g) in present
                                                                 for h in self._holders(r, ins.micro)):
                        continue
                    where = self.holders.get(r)
                    if where:
                        why = (f"in {', '.join(where)} but none of them (for microbatch {ins.micro}) is on {g} "
                               f"at that point of the schedule: the plan is missing a load")
                    elif r in last_made:
                        why = (f"made by instruction {last_made[r]} but held by no buffer of the plan in "
                               f"between (every value that crosses segments is planned: X, A, G, T or H)")
                    else:
                        why = ("in no buffer of the plan (X:<b> holds only what the block and the blocks "
                               "after it read), so a recompute cannot get it")
                    raise TensorstowError(f"plan instruction {self.plan_id[ins.id]} ({ins.kind} {ins.segment}) reads {r}, "
                                          f"which is {why}; re-plan it")
                for r in seg.produced:
                    last_made[r] = ins.id
                for a in ins.allocs:
                    present.add((a, g))
        keep = {}
        loss_done: dict[int, bool] = {}
        for ins in self.instrs:
            if ins.kind not in ("compute", "recompute"):
                continue
            seg = j.segments[ins.segment]
            k = set()
            for a in ins.allocs + ins.accum:
                k |= set(self.members.get(a, ())) & seg.produced
            if j.loss in seg.produced and ins.kind == "compute" and not loss_done.get(ins.micro):
                k.add(j.loss)
                loss_done[ins.micro] = True
            keep[ins.id] = frozenset(k)
        if len(loss_done) < self.M and self.block_gpu[self._loss_block()] == self.gpu:
            raise TensorstowError("the plan never computes the segment that produces the loss; re-plan it")
        return keep

    def _loss_block(self) -> str:
        """The block whose forward computes the loss."""
        for name, seg in self.joint.segments.items():
            if name.startswith("fwd:") and self.joint.loss in seg.produced:
                return name[4:]
        raise TensorstowError("the traced model has no segment that produces the loss")

    def _holders(self, root: str, micro: int) -> list[str]:
        """The buffers that may hold `root` for microbatch `micro` (per-microbatch copies of the
        others' microbatches excluded). Every fetch asks: made once per (root, micro)."""
        out = self._holders_of.get((root, micro))
        if out is None:
            out = self._holders_of[root, micro] = [h for h in self.holders.get(root, ())
                                                   if split_micro(h)[1] in (None, micro)]
        return out

    def _place_homes(self, model: nn.Module, kinds=("P", "C", "M", "OS"), skip_ssd: bool = False,
                     values=None) -> None:
        """Every buffer with a home tier gets its initial copy there, block by block in forward
        order: P and C from the model's state (cast to the dtype the trace gives them), M the
        fp32 parameters, OS zeros. `values`: an iterator of (name, parameter value) in parameter
        order to take the parameters from instead of the model (out-of-core initialisation, e.g.
        `ir.models.gpt_init_stream`); each block's values are dropped once it is placed."""
        source = _Source(model, values)
        ph = self.joint.placeholder
        for blk in self.graph.blocks:
            b = blk.name
            todo = [f"{k}:{b}" for k in ("P", "C", "M", "OS") if k in kinds]
            todo = [n for n in todo if n in self.homes and not (skip_ssd and self.homes[n] == "ssd")]
            if not todo:
                if self.block_gpu[b] != self.gpu:  # another rank's block: an init stream is sequential
                    source.take(self.block_params[b] + self.block_consts.get(b, []))
                continue
            state = source.take(self.block_params[b] + self.block_consts.get(b, []))
            for name in todo:
                kind, home = name.split(":")[0], self.homes[name]
                if kind == "OS" and home != self.gpu:  # zeros, written in place: no temporaries
                    self.host.alloc(name, self.layouts[name]).blob.zero_()
                    if home == "ssd":
                        self.ssd.write(name, self.host.get(name))
                        self.host.drop(name)
                    continue
                vals = {}
                for p in self.block_consts.get(b, ()) if kind == "C" else self.block_params[b]:
                    w = state[p].detach()
                    if kind in ("P", "C"):
                        vals[ph[p]] = w.to(self.joint.meta(ph[p])[0])
                    elif kind == "M":
                        vals[p] = w.float()
                    else:
                        vals[f"{p}.exp_avg"] = torch.zeros_like(w, dtype=torch.float32)
                        vals[f"{p}.exp_avg_sq"] = torch.zeros_like(w, dtype=torch.float32)
                layout = self.layouts[name]
                if home == self.gpu:
                    self.dev.put(name, {k: _clone_to(vals[k], self.device) for k in layout.keys()})
                else:
                    self.host.store_from(name, layout, vals)
                    if home == "ssd":
                        self.ssd.write(name, self.host.get(name))
                        self.host.drop(name)
            del state
        self.host.peak = self.host.used
        if self.comm is not None and "P" in kinds:
            # Every rank drew the same initial values; from here each draws its own random numbers
            # (dropout), not the same masks in every stage: a seed from the shared stream, plus the rank.
            torch.manual_seed(int(torch.randint(2**62, (1,))) + self.rank)
        if self.ssd.store is not None and "OS" in kinds:
            if self.full_checkpoint:
                self._write_checkpoint(constants=True)
            self._write_scaler(0)
            self.ssd.store.commit(0)

    def _write_scaler(self, opt_steps: int) -> None:
        """fp16: the loss scaler's state goes with every commit, when the store has room for it
        (a store sized with `executor.state.store_sizes`, or a FileStore); without it the run
        trains but cannot be resumed (`_resume` says so)."""
        if self.scaler is not None and self._store_takes(AMP):
            self.ssd.store.write(AMP, self.scaler.state_bytes(opt_steps))

    def _store_takes(self, name: str) -> bool:
        """Whether the SSD store has room for `name` (a sized store only for what it was made
        with; a FileStore for anything)."""
        sizes = getattr(self.ssd.store, "sizes", None)
        return sizes is None or name in sizes

    def _write_checkpoint(self, constants: bool = False, rng: torch.Tensor | None = None) -> None:
        """Write the training state that lives off SSD, and the random generator, into the store
        (SSD-resident buffers are the store's own). Constants never change: written at step 0."""
        st = self.ssd.store
        for name in sorted(self.homes):
            home = self.homes[name]
            if home == "ssd" or (name.startswith("C:") and not constants):
                continue
            if home == "dram":
                st.write(name, self.host.get(name).blob)
                continue
            layout = self.layouts[name]
            c = HostCopy(layout, aligned_empty(layout.nbytes))
            for k, v in self.dev.get(name).items():
                c.set(k, v)
            st.write(name, c.blob)
        st.write(RNG, rng_bytes() if rng is None else rng)

    def _resume(self, committed: int | None) -> None:
        if committed is None:
            raise TensorstowError("resume=True but the SSD store holds no committed step "
                                  "(or the plan does not use the SSD tier)")
        if not self.full_checkpoint:
            elsewhere = sorted(n for n, t in self.homes.items() if n.split(":")[0] in ("P", "M", "OS") and t != "ssd")
            if elsewhere:
                raise TensorstowError(f"cannot resume: the plan keeps {', '.join(elsewhere[:4])} outside the "
                                      f"SSD tier and this store is not a full checkpoint (make it with "
                                      f"executor.state.store_sizes, as `tensorstow execute` does)")
        for n in sorted(self.homes):
            home = self.homes[n]
            if home == "ssd":
                self.ssd.copies[n] = {}  # written contiguous (from parameters or an update)
            elif self.full_checkpoint:
                layout = self.layouts[n]
                c = self.host.alloc(n, layout)
                self.ssd.store.read(n, c.blob)
                if home == self.gpu:
                    self.dev.put(n, {k: _clone_to(c[k], self.device) for k in layout.keys()})
                    self.host.drop(n)
        if self.full_checkpoint:
            blob = torch.empty(self.ssd.store.sizes[RNG], dtype=torch.uint8)
            self.ssd.store.read(RNG, blob)
            set_rng(blob)
        self.host.peak = self.host.used
        self.steps_done = self.opt_steps = committed
        if self.scaler is not None:
            blob = torch.empty(16, dtype=torch.uint8)
            try:
                if not self._store_takes(AMP):
                    raise KeyError(AMP)
                self.ssd.store.read(AMP, blob)
            except (KeyError, OSError, TensorstowError):
                raise TensorstowError("cannot resume an fp16-mixed run: the store holds no loss-scaler state "
                                      "(AMP); size it with executor.state.store_sizes(plan), as "
                                      "`tensorstow execute` does") from None
            self.opt_steps = self.scaler.load_state(blob)

    # ---- the step ---------------------------------------------------------------------------
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

    def _step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        j = self.joint
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
            ok = (idx >= 0) & (idx < self.vocab)
            if not bool(ok.all()) or not bool((((targets >= 0) & (targets < self.vocab)) | (targets == -100)).all()):
                raise TensorstowError(f"idx/targets hold token ids outside the model's vocabulary "
                                      f"[0, {self.vocab})")
        tdtype, tshape = j.meta(j.inputs[2])
        tangent = (self.scaler.tangent(tshape, tdtype) if self.scaler is not None
                   else torch.ones(tshape, dtype=tdtype, device=self.device))
        if self.M > 1:
            tangent = tangent / self.M  # eager's (loss / M).backward(): DivBackward hands 1 / M on
        consts = tuple(c.to(self.device, copy=True) for c in j.constants.values())
        for k in range(self.M):
            rows_k = slice(k * m.batch, (k + 1) * m.batch)
            vals = (idx[rows_k].to(self.device, copy=True), targets[rows_k].to(self.device, copy=True), tangent)
            for name, v in zip((*j.inputs, *j.constants), vals + consts):
                self.dev.hold(v, name)
                self.inputs.setdefault(name, []).append(v)
        self.loss, self._loss = None, [None] * self.M
        if self.scaler is not None:
            self.scaler.begin_step()
        self.commit_s = 0.0
        synced = self._early_sync_total()
        if isinstance(self.ssd.store, SSDStore):  # sync writes early only in a step that commits
            self.ssd.store.sync_early = (self.steps_done + 1) % self.checkpoint_every == 0
        self.lanes.begin()  # after the inputs: the lanes start from here
        ok = False
        try:
            (self._run_sync if self.mode == "sync" else self._run_overlap)()
            ok = True
        finally:
            try:
                self.timeline = self.lanes.end()  # every lane's work is done (CUDA: joined)
                for w in self._sends:  # transfers to other ranks complete before their copies go
                    w.wait()
            except Exception:
                if ok:
                    raise  # else the step's own error is the one to report
            finally:
                self._sends.clear()
                for vs in self.inputs.values():
                    for v in vs:
                        self.dev.release(v)
                self.inputs.clear()
        self.loss = self._mean_loss()
        self._check_end_state()
        if self.carried and self.full_checkpoint:  # what the next step's commit records of this one
            self._rng_at_end = rng_bytes()
        self.steps_done += 1
        if self.scaler is None or not self.scaler.update():
            self.opt_steps += 1
        if self.steps_done % self.checkpoint_every == 0 and not self.carried:  # else the next step commits it
            t0 = time.perf_counter()
            if self.checkpoint(wait=not self._commits_in_background):
                self.commit_s = time.perf_counter() - t0
        self.early_sync_s = self._early_sync_total() - synced
        return self.loss

    def _early_sync_total(self) -> float:
        return getattr(self.ssd.store, "early_sync_s", 0.0)

    def _mean_loss(self) -> float:
        """The step's loss: the microbatches' mean (eager's sum of loss / M, in microbatch order);
        on a rank without the loss, the one the loss's rank sends."""
        here = None
        if all(v is not None for v in self._loss):
            here = float(self._loss[0]) if self.M == 1 else sum(float(v / self.M) for v in self._loss)
        if self.comm is not None:
            return self.comm.share(here, int(self.block_gpu[self._loss_block()][3:]))
        return here

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
        return self._commit(wait)

    def _commit_previous(self, ins: Instr) -> None:
        """A step's `commit` instruction: the carried buffers are home, so the SSD holds the whole
        state of the step before; commit it when due (every `checkpoint_every` steps)."""
        if self.steps_done % self.checkpoint_every == 0 and self.ssd.store.committed_step() != self.steps_done:
            self._commit(wait=not self._commits_in_background, rng=self._rng_at_end)

    def _commit(self, wait: bool, rng: torch.Tensor | None = None) -> bool:
        """`rng`: the random generator's state to record (default: now)."""
        if self.full_checkpoint:
            self._write_checkpoint(rng=rng)
        self._write_scaler(self.opt_steps)
        if wait or not self._commits_in_background:
            self.ssd.store.commit(self.steps_done)
        else:
            self.ssd.store.commit(self.steps_done, wait=False)
        if self.comm is not None:  # no rank writes the next step before every rank committed this one
            self.comm.barrier()
        return True

    @property
    def _commits_in_background(self) -> bool:
        """One process with the SSD store: `step` does not wait for its commit's syncs."""
        return self.comm is None and isinstance(self.ssd.store, SSDStore)

    def lane_busy(self) -> dict[str, float]:
        """Measured seconds each lane spent in the last step (same resource names as the simulator;
        the SSD's includes the store's early syncs and the part of the step's commit the step
        waited for, and "ssd.commit" the last commit's background part, as the simulator has them)."""
        from tensorstow.schema.schedule import resource_of
        out: dict[str, float] = {}
        for i, t0, t1 in self.timeline:
            r = resource_of(self.instrs[i].stream)
            out[r] = out.get(r, 0.0) + (t1 - t0)
        if self.commit_s or self.early_sync_s:
            out["ssd"] = out.get("ssd", 0.0) + self.commit_s + self.early_sync_s
        if self._commits_in_background and self.ssd.store.durable_s:
            out["ssd.commit"] = self.ssd.store.durable_s  # the last commit's syncs and manifest
        return dict(sorted(out.items()))

    def measured_trace(self) -> dict:
        """The last step's measured timeline in the simulator's Perfetto format."""
        from tensorstow.planner.simulate import SimResult, perfetto_trace
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

        def lane(instrs: list[Instr]) -> None:
            k = 0
            try:
                torch.set_num_threads(nthreads)  # same intra-op split (and reduction order) as sync
                if cores:
                    os.sched_setaffinity(0, cores[resource_of(instrs[0].stream).endswith(".compute")])
                # inference mode is thread-local: as in `step`; CUDA: the lane's stream
                with torch.inference_mode(), self.lanes.lane(instrs[0].stream):
                    for k, ins in enumerate(instrs):
                        for d in ins.deps:  # enqueued (device work) or done (host work)
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

        pinned = pin_off_compute(cores) if cores else {}
        try:
            self._lane_threads.run({s: (lambda v=v: lane(v)) for s, v in lanes.items()})
        finally:
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
        if ins.segment not in self.random_segments:
            return self._run_segment(ins)
        gen = torch.cuda if self.device.type == "cuda" else torch
        if ins.kind == "compute":
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

        try:
            j.run(seg, fetch=fetch, hold=self.dev.hold, release=self.dev.release,
                  keep=self.keep[ins.id], sink=kept.__setitem__, device=self.device)  # held: ours
            for a in ins.allocs:
                vals = {r: kept[r] if r in kept else fetch(r) for r in self.members[a]}
                if self.fp32_grads and a.startswith("G:"):  # accumulated in fp32 (eager's .grad)
                    vals = {r: v.float() for r, v in vals.items()}
                ours = {r for r, v in vals.items() if r in kept and v is kept[r] and r not in passed}
                self.dev.put(a, vals, held=ours)
                passed |= ours
                if self.scaler is not None and a.startswith("G:"):  # GradScaler's inf/NaN check
                    self.scaler.check(list(self.dev.get(a).values()))
            for a in ins.accum:  # a later microbatch: eager's AccumulateGrad, .grad += this one's
                into = self.dev.get(a)
                for r in self.members[a]:
                    into[r].add_(kept[r])
            if j.loss in kept:
                self._loss[ins.micro] = kept[j.loss]  # read when the step ends: no host wait here
        finally:
            for r, v in kept.items():
                if r not in passed:
                    self.dev.release(v)

    def _fetch(self, root: str, micro: int = 0) -> torch.Tensor:
        v = self.inputs.get(root)
        if v is None:
            for h in self._holders(root, micro):
                c = self.dev.copies.get(h)
                if c is not None:
                    return c[root]
            raise ExecutionError(
                f"{root} (in {', '.join(self._holders(root, micro) or ['no buffer'])}) is not on {self.gpu}; "
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
            self.ssd.read(buf, self.host, layout, first=ins.stream == "ssd.first")

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
            self._sends += self.comm.send([c.blob, strides], int(ins.dst[3:]), tag)
            return
        blob = torch.empty(layout.nbytes, dtype=torch.uint8, device=at)
        dims = [len(layout.slots[k].shape) for k in layout.keys()]
        strides = torch.empty(max(1, sum(dims)), dtype=torch.long, device=at)
        self.comm.recv([blob, strides], int(ins.src[3:]), tag)
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
        if not (self.scaler is not None and self.scaler.skip()):  # fp16: a step with inf/NaN changes nothing
            written = self._adam_update(b, ins, trained, master, fresh_p)
        if not self.mixed:
            return
        fresh = {ph[p]: master[p].to(j.meta(ph[p])[0], copy=True) for p in self.block_params[b]
                 if ph[p] not in written}  # a copy also for fp32 ones: P never aliases M
        if fresh_p is None:
            self.dev.put(f"P:{b}", fresh)
        else:
            for k, v in fresh.items():
                fresh_p[k].copy_(v)

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
        try:
            for p in trained:
                g = j.materialize(j.grad[p], grads_copy.__getitem__)
                if self.mixed and g.dtype != torch.float32:
                    g = g.float()
                    if on_dev:
                        self.dev.hold(g, f"{p} fp32 gradient")
                        held.append(g)
                params.append(master[p if self.mixed else ph[p]])
                grads.append(g)
                moments.append((states[f"{p}.exp_avg"], states[f"{p}.exp_avg_sq"]))
            if self.scaler is not None:
                self.scaler.unscale_(grads)
            out16, written = None, set()
            if self.mixed and not on_dev and not self.adam[b].exact:
                out16 = [fresh_p[ph[p]] if fresh_p[ph[p]].dtype != torch.float32 else None for p in trained]
                written = {ph[p] for p, o in zip(trained, out16) if o is not None}
            # torch's single-tensor Adam allocates two parameter-sized temporaries (sqrt, denom)
            scratch = 2 * max((t.numel() * 4 for t in params), default=0) if on_dev and self.adam[b].exact else 0
            with self.dev.reserve(scratch, f"Adam scratch of {b}") if scratch else contextlib.nullcontext():
                self.adam[b].step(params, grads, moments, self.opt_steps, out16)
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
            copy = self._home_copy(buf)
            for p in params:
                out[p] = copy[p if self.mixed else self.joint.placeholder[p]].detach().float().cpu().clone()
        for b, consts in self.block_consts.items():
            frozen = [c for c in consts if c in self.frozen and self.block_gpu[b] == self.gpu]
            if frozen:
                copy = self._home_copy(f"C:{b}")
                for c in frozen:
                    out[c] = copy[self.joint.placeholder[c]].detach().float().cpu().clone()
        return dict(sorted(out.items()))

    def load_into(self, model: nn.Module) -> None:
        """Copy the trained parameters into `model`."""
        params = self.parameters()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])

    def _home_copy(self, buf: str):
        """The buffer's latest version: its home copy, or a carried one's DRAM copy."""
        home = "dram" if buf in self.carried else self.homes[buf]
        if home == self.gpu:
            return self.dev.get(buf)
        if home == "dram":
            return self.host.get(buf)
        layout = self.layouts[buf]
        c = HostCopy(layout, torch.empty(layout.nbytes, dtype=torch.uint8), self.ssd.copies[buf])
        self.ssd.store.read(buf, c.blob)
        return c

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
    "compute": Executor._compute,
    "recompute": Executor._compute,
    "load": Executor._copy,
    "store": Executor._copy,
    "free": Executor._free,
    "optimizer_step": Executor._optimizer_step,
    "send": Executor._send,
    "commit": Executor._commit_previous,
}


class _Upstream(Exception):
    """An instruction did not run because one it waits for failed."""


class _Adam:
    """Adam/AdamW of one subgroup, on the tier copies of its tensors.

    exact (plan option `exact_optimizer`): one torch.optim.Adam/AdamW(foreach=False), pointed at
    the tier copies every step: bit-identical with eager's default CPU path. Otherwise the fast
    update: CPU tensors go through `executor.adam.adamw_step_` (csrc/adam.cpp: one pass over
    memory, the fresh 16-bit compute copy written in it; torch's fused kernel if the C++ build
    is unavailable), device tensors through torch's fused multi-tensor kernel. Both differ from
    torch's single-tensor step only in the rounding of sqrt (a correctly rounded one instead
    of MKL's, 1 ulp off for some inputs), see `executor/adam.py`.
    """

    def __init__(self, options):
        kind = options.optimizer
        if kind not in ("adam", "adamw"):
            raise TensorstowError(f"plan options: unknown optimizer '{kind}' (adam or adamw)")
        self.exact = options.exact_optimizer
        self.decoupled = kind == "adamw"
        self.lr, self.betas, self.eps, self.wd = options.lr, tuple(options.betas), options.eps, options.weight_decay
        if self.exact:
            cls = torch.optim.AdamW if self.decoupled else torch.optim.Adam
            self.opt = cls([torch.zeros(1)], lr=self.lr, betas=self.betas, eps=self.eps,
                           weight_decay=self.wd, foreach=False)

    def step(self, params, grads, moments, steps_done: int, out16=None) -> None:
        """One update of `params` (fp32) from `grads`; `steps_done` updates came before it.
        `out16`: per parameter, a 16-bit tensor to receive its updated value (fast CPU path)."""
        if not params:
            return
        if self.exact:
            return self._torch_step(params, grads, moments, steps_done)
        if params[0].device.type == "cpu":
            from tensorstow.executor.adam import adamw_steps_
            adamw_steps_(params, grads, [m for m, _ in moments], [v for _, v in moments], steps_done + 1,
                         self.lr, self.betas, self.eps, self.wd, out16, decoupled=self.decoupled)
            return
        fused = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        step = torch.full((), float(steps_done + 1), dtype=torch.float32, device=params[0].device)  # no host copy
        steps = [step] * len(params)  # read, not written, by the fused kernel
        grads = [g if g.stride() == p.stride() else torch.empty_like(p).copy_(g) for p, g in zip(params, grads)]
        fused(params, grads, [m for m, _ in moments], [v for _, v in moments], [], steps,
              lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=self.wd, eps=self.eps,
              amsgrad=False, maximize=False)

    def _torch_step(self, params, grads, moments, steps_done: int) -> None:
        from torch.optim.optimizer import _get_scalar_dtype

        group = self.opt.param_groups[0]
        group["params"] = params
        self.opt.state.clear()
        try:
            for p, g, (m, v) in zip(params, grads, moments):
                p.grad = g
                self.opt.state[p] = {"step": torch.tensor(float(steps_done), dtype=_get_scalar_dtype()),
                                     "exp_avg": m, "exp_avg_sq": v}
            self.opt.step()
        finally:
            for p in params:
                p.grad = None
            self.opt.state.clear()
            group["params"] = []


class _Source:
    """Initial values of the model state: the model's own tensors, or (parameters) the next
    items of a stream in parameter order, each handed out once, or a mapping read on demand
    (`ir.hf.Checkpoint`)."""

    def __init__(self, model: nn.Module, stream):
        self.state = model_state(model)
        self.buffers = dict(model.named_buffers())
        self.stream, self.pending = stream, {}

    def take(self, names: list[str]) -> dict[str, torch.Tensor]:
        if self.stream is None:
            return {n: self.state[n] for n in names}
        if not hasattr(self.stream, "__next__"):  # a mapping read on demand (a checkpoint)
            return {n: self.buffers[n] if n in self.buffers else self.stream[n] for n in names}
        out = {}
        for n in names:
            if n in self.buffers:
                out[n] = self.buffers[n]
                continue
            while n not in self.pending:
                try:
                    k, v = next(self.stream)
                except StopIteration:
                    raise TensorstowError(f"the initial values end before parameter {n}") from None
                self.pending[k] = v
            out[n] = self.pending.pop(n)
        return out


def _check_model_graph(m, traced: Traced) -> None:
    """The traced model is the one the plan was made for: same graph, same fingerprint. (A
    replicated plan's trace is its block template, so the fingerprint covers the traced layers;
    `trace_model` has checked that the other layers share the middle one's structure.)"""
    depth = len(traced.graph.layer_blocks())
    if depth != m.layers:
        raise TensorstowError(f"the model has {depth} layers but the plan for {m.name} describes "
                              f"{m.layers}; pass the model the plan was made for, or re-plan it")
    fp = traced.graph.fingerprint()
    if fp != m.fingerprint:
        raise TensorstowError(
            f"plan fingerprint mismatch: the plan was made for model graph {m.fingerprint} but "
            f"{m.name} (batch {m.batch}, seq {m.seq}, {m.precision}) traces to {fp} here (the model "
            f"code, its configuration or the torch version changed); re-plan it with "
            f"`tensorstow plan {m.name} ...`")


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, then buffers, by qualified name: the state inputs of the traced graph, in
    its placeholder order."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _draws_random(seg) -> bool:
    return any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in seg.nodes)


def _clone_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty_strided(t.shape, contiguous_stride(t.shape), dtype=t.dtype, device=device)
    out.copy_(t)
    return out


def _describe(ins: Instr) -> str:
    if ins.kind in ("compute", "recompute"):
        return f"{ins.kind} {ins.segment}"
    if ins.kind == "optimizer_step":
        return f"optimizer_step {ins.segment} on {ins.dst}"
    if ins.kind == "free":
        return f"free {ins.tensor} on {ins.dst}"
    if ins.kind == "send":
        return f"send {ins.tensor} {ins.src}->{ins.dst}"
    return f"{ins.kind} {ins.tensor} {ins.src}->{ins.dst}"
