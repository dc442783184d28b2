"""Dispatch: replay a program's instructions through one handler per kind (`HANDLERS`).

A `Replay` is a program as the runtime runs it: its instructions (this process's share, numbered
0.. in program order), the values each compute leaves on the device (its keep-sets), each
instruction's id in the plan, and the lanes that order them (executor.cuda). The step, the
forward-only evaluation and a speculating plan's redo are three such values; the runtime holds
no program of its own. `Runtime.run(replay, inputs)` runs one, handler by handler:

  compute / recompute   interpret a segment of the joint graph on the device tier
  load / store          copy a buffer between tiers (gpuK <-> dram <-> ssd), never aliasing
  send                  a stage boundary to or from another rank's GPU (multi-GPU plans)
  free                  drop a tier's copy
  optimizer_step        one block's Adam/AdamW update (executor.semantics) on its fp32 masters
  commit                the step before is whole on SSD: commit it when due

The runtime makes no decisions: what moves where and when is the plan's. `mode="sync"`
runs the instructions one at a time in program order (the reference); `mode="overlap"`
runs one lane per stream (a long-lived thread each: executor.lanes), each instruction waiting
only for the instructions in its `deps` (and its stream's earlier ones), so the plan's
dependencies must be sufficient. Both modes compute the same bits.

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
"""
from __future__ import annotations

import os
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from tensorstow.errors import TensorstowError
from tensorstow.executor.cuda import lanes_for, out_of_memory
from tensorstow.executor.lanes import LaneThreads, lane_cores, optimizer_threads, pin_off_compute, unpin
from tensorstow.executor.malloc import give_back_free_heap
from tensorstow.executor.program import Program
from tensorstow.executor.semantics import StepSemantics
from tensorstow.executor.stores import DeviceMemoryError, HostCopy, RoomWait, Tiers
from tensorstow.planner.pools import device_arena, device_bytes, in_device_arena
from tensorstow.schema.schedule import (CPU_OPTIMIZER, BufferKind, Instr, InstrKind, Stream, block_of, buffer_kind,
                                        gpu_index, is_gpu, split_segment)

MODES = ("sync", "overlap")


class ExecutionError(TensorstowError):
    """An instruction could not run as the plan says (names the instruction)."""


@dataclass(frozen=True)
class Replay:
    """A program the runtime runs (the module docstring)."""
    instrs: list[Instr]
    keep: dict[int, frozenset]
    """Per compute instruction, the values its segment leaves on the device."""
    plan_id: list[int]
    """Each instruction's id in the plan (what errors name)."""
    lanes: object
    """What orders the instructions: host time on the CPU, streams and events on CUDA."""
    arena: dict[tuple[int, str], int] | None = None
    """(instruction, buffer) -> the offset in the device arena of the copy it makes
    (`planner.pools.device_arena`); None: the device tier allocates each copy."""


class Runtime:
    """Runs `Replay`s on one executor's tiers (the module docstring). `on_commit`: called by a
    step's `commit` instruction, once the step before is whole on SSD."""

    def __init__(self, program: Program, tiers: Tiers, semantics: StepSemantics, mode: str,
                 comm=None, on_commit: Callable[[], None] = lambda: None):
        if mode not in MODES:
            raise TensorstowError(f"unknown executor mode '{mode}': use one of {list(MODES)}")
        self.program, self.tiers, self.sem, self.mode, self.comm = program, tiers, semantics, mode, comm
        self.device, self.dev, self.host, self.ssd = tiers.device, tiers.dev, tiers.host, tiers.ssd
        self.on_commit = on_commit
        self.alloc_limit: int | None = None
        """CUDA: the bytes the caching allocator may reserve (named when a copy runs out)."""
        self.rng_states: dict[str, torch.Tensor] = {}
        """Per recomputed segment that draws random numbers, the generator state its first run
        started from (`Program.random_segments`)."""
        self.threads = LaneThreads()  # overlap mode's lanes, kept from run to run
        # collected: its lanes end; at exit they are daemons (a step interrupted there never joins)
        weakref.finalize(self, self.threads.close).atexit = False
        self.replay: Replay | None = None
        """The program running now."""
        self.inputs: dict[str, list[torch.Tensor]] = {}
        """Per graph input, its value for each microbatch."""
        self.scalars = None
        """A captured graph's update scalars, read from memory (executor.graphs); None: eager."""
        self.backward_begun = False
        self._sends: list = []  # this run's transfers in flight to other ranks
        self.segment_graphs = None
        """Where segments are captured one by one (executor.graphs.SegmentGraphs)."""
        self.step_instrs = program.instrs
        """The step's instructions: the program whose segments may be captured."""

    def replay_of(self, instrs: list[Instr], keep: dict, plan_id: list[int]) -> Replay:
        """A program of these instructions, with lanes of its own in this runtime's mode, and where
        the device tier has an arena, the offsets of the copies it makes there."""
        arena = None
        if self.dev.arena is not None:
            p = self.program
            placed = device_arena(instrs, p.plan.buffers, p.gpu, [n for n, t in p.homes.items() if t == p.gpu])
            if placed.nbytes > self.dev.arena.numel():
                raise TensorstowError(f"the plan's device arena ({self.dev.arena.numel()} bytes) does not hold its "
                                      f"program's copies ({placed.nbytes} bytes); re-plan it")
            if placed.homes != self.dev.homes_at:
                raise TensorstowError("the plan's programs place its homes on the device differently; re-plan it")
            arena = placed.at
        return Replay(instrs, keep, plan_id, lanes_for(instrs, self.device, overlap=self.mode == "overlap"), arena)

    def _room(self, ins: Instr, buf: str) -> tuple[int | None, int]:
        """Where the copy of `buf` that `ins` makes goes in the device arena, and its bytes (None: the
        tier has no arena, the buffer is kept outside it, or `ins` writes over the copy there)."""
        arena = self.replay.arena
        if arena is None:
            return None, 0
        spec = self.program.plan.buffers[buf]
        at = arena.get((ins.id, buf))
        if at is None:
            if buf in self.dev.copies or not in_device_arena(spec):
                return None, 0
            raise ExecutionError(f"{buf} is made on {self.tiers.gpu} where the device arena has no range for it; "
                                 f"re-plan it")
        return at, device_bytes(spec)

    def _put(self, ins: Instr, buf: str, values: dict[str, torch.Tensor], held=frozenset()) -> None:
        """Make `values` the device copy of `buf` that `ins` makes: in its arena range, else the values themselves."""
        at, room = self._room(ins, buf)
        if at is None:
            self.dev.put(buf, values, held=held)
        else:
            self.dev.place(buf, self.program.layouts[buf], at, room, values, held)

    def run(self, replay: Replay, inputs: dict[str, list[torch.Tensor]], mode: str | None = None,
            scalars=None) -> list[tuple[int, float, float]]:
        """Run `replay` on `inputs` (held on the device for the run) in `mode` (default the
        runtime's); returns the measured timeline: (instruction, start, end) per instruction the
        lanes timed."""
        for name, vs in inputs.items():
            for v in vs:
                self.dev.hold(v, name)
        self.replay, self.inputs, self.scalars = replay, inputs, scalars
        self.backward_begun = False
        replay.lanes.begin()  # after the inputs: the lanes start from here
        ok, timeline = False, []
        try:
            (self._run_sync if (mode or self.mode) == "sync" else self._run_overlap)()
            ok = True
        finally:
            try:
                timeline = replay.lanes.end()  # every lane's work is done (CUDA: joined)
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
                self.inputs, self.scalars = {}, None
        return timeline

    def check_end_state(self) -> None:
        """Every buffer is back where the step found it: its homes, and the carried DRAM copies."""
        p = self.program
        want = set(p.homes.items()) | {(x, "dram") for x in p.carried}
        have = {(n, t) for t, tier in self.tiers.by_name.items() for n in tier.copies}
        if have != want:
            raise ExecutionError(
                f"the step did not return to its initial state: left {sorted(have - want)[:5]}, "
                f"lost {sorted(want - have)[:5]}; re-plan it")

    def close(self) -> None:
        self.threads.close()

    # ---- the two orders ---------------------------------------------------------------------
    def _run_sync(self) -> None:
        for ins in self.replay.instrs:
            self.dispatch(ins)

    def _run_overlap(self) -> None:
        """One worker per stream, in program order; an instruction waits for its deps only."""
        instrs, run_lanes = self.replay.instrs, self.replay.lanes
        futures = [Future() for _ in instrs]
        lanes: dict[str, list[Instr]] = {}
        for ins in instrs:
            lanes.setdefault(ins.stream, []).append(ins)
        failures: list[tuple[int, BaseException]] = []
        nthreads = torch.get_num_threads()
        cores = lane_cores(self.device, nthreads)
        update_threads = optimizer_threads(self.device, nthreads, list(lanes))
        room = RoomWait(len(lanes))  # a copy the DRAM pool has no range for waits while a lane runs

        def lane(mine: list[Instr]) -> None:
            k = 0
            try:
                # same intra-op split (and reduction order) as sync; the CPU optimizer's updates are
                # elementwise, so a smaller split changes no result
                torch.set_num_threads(update_threads if mine[0].stream == CPU_OPTIMIZER else nthreads)
                if cores:
                    os.sched_setaffinity(0, cores[Stream.of(mine[0].stream).lane == "compute"])
                # inference mode is thread-local: as in `Executor.step`; CUDA: the lane's stream
                with torch.inference_mode(), run_lanes.lane(mine[0].stream):
                    for k, ins in enumerate(mine):
                        for d in ins.deps:  # enqueued (device work) or done (host work)
                            if not futures[d].done():
                                with room.stall():
                                    futures[d].exception()
                            if futures[d].exception() is not None:
                                raise _Upstream()
                        self.dispatch(ins)
                        futures[ins.id].set_result(None)
            except BaseException as e:  # this and every later instruction of the lane fail
                if not isinstance(e, _Upstream):
                    failures.append((mine[k].id, e))
                for rest in mine[k:]:
                    if not futures[rest.id].done():
                        futures[rest.id].set_exception(_Upstream())
            finally:
                room.end()

        pinned = pin_off_compute(cores) if cores else {}
        self.host.room = room
        try:
            self.threads.run({s: (lambda v=v: lane(v)) for s, v in lanes.items()})
        finally:
            self.host.room = None
            unpin(pinned)
        if failures:
            raise min(failures, key=lambda f: f[0])[1]

    def dispatch(self, ins: Instr) -> None:
        """Run one instruction of the running replay through its handler."""
        lanes, plan_id = self.replay.lanes, self.replay.plan_id
        lanes.before(ins)  # CUDA: waits for its dependencies' events
        try:
            HANDLERS[ins.kind](self, ins)
        except TensorstowError as e:
            raise type(e)(f"instruction {plan_id[ins.id]} ({_describe(ins)}): {e}") from None
        except torch.cuda.OutOfMemoryError:
            raise DeviceMemoryError(f"instruction {plan_id[ins.id]} ({_describe(ins)}): "
                                    f"{out_of_memory(self.alloc_limit, self.device)}") from None
        lanes.after(ins)

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
        """Run a segment: replayed or captured as a graph of its own where the executor captures
        segments (`executor.graphs.SegmentGraphs`, the step's only), else interpreted."""
        if self.segment_graphs is not None and self.replay.instrs is self.step_instrs:
            return self.segment_graphs.run(self, ins, lambda: self._interpret(ins))
        self._interpret(ins)

    def _interpret(self, ins: Instr) -> None:
        prog, sem = self.program, self.sem
        j = prog.joint
        kept: dict[str, torch.Tensor] = {}
        passed: set[str] = set()  # kept roots whose hold went on to a buffer

        def fetch(root):
            return self._fetch(root, ins.micro)

        if self.device.type == "cpu" and not self.backward_begun and split_segment(ins.segment)[0] == "bwd":
            self.backward_begun = True  # the forward's heap pages go back before the backward's large gradients
            give_back_free_heap()
        try:
            j.run(j.segments[ins.segment], fetch=fetch, hold=self.dev.hold, release=self.dev.release,
                  keep=self.replay.keep[ins.id], sink=kept.__setitem__, device=self.device)  # held: ours
            for a in ins.allocs:
                grads = buffer_kind(a) is BufferKind.G
                if a in prog.parts:  # a unit's rows of gradients the device holds whole
                    self._put_rows(a, kept, passed, fetch, fp32=prog.fp32_grads and grads)
                    if sem.scaler is not None and grads:
                        sem.scaler.check(list(self.dev.get(a).values()))
                    continue
                vals = {r: kept[r] if r in kept else fetch(r) for r in prog.members[a]}
                if prog.fp32_grads and grads and self._room(ins, a)[0] is None:  # accumulated in fp32 (eager's .grad)
                    vals = {r: v.float() for r, v in vals.items()}  # (an arena copy casts as it copies)
                ours = {r for r, v in vals.items() if r in kept and v is kept[r] and r not in passed}
                self._put(ins, a, vals, held=ours)
                passed |= ours
                if sem.scaler is not None and grads:  # GradScaler's inf/NaN check
                    sem.scaler.check(list(self.dev.get(a).values()))
                if grads and prog.M == 1 and self.comm is None:  # final gradients, all here
                    sem.record_norms(block_of(a), self.dev.get(a))
            for a in ins.accum:  # a later microbatch: eager's AccumulateGrad, .grad += this one's
                into = self.dev.get(a)
                for key, r, rows in _keys(prog, a):  # a cut backward's first part hands some on (K:<b>)
                    v = kept[r] if r in kept else self._fetch(r, ins.micro, besides=a)
                    into[key].add_(v if rows is None else v[rows[0]:rows[1]])
                if sem.scaler is not None:
                    sem.scaler.check(list(into.values()))
                if ins.micro == prog.M - 1 and self.comm is None and a not in prog.parts:  # the sum is whole
                    sem.record_norms(block_of(a), into)
            if self.comm is None and ins.micro == prog.M - 1:  # units' gradients: their weights' norms, whole
                for a in ins.allocs + ins.accum:
                    if a in prog.parts and buffer_kind(a) is BufferKind.G:
                        sem.record_norms(block_of(a), self.dev.wholes)
            if j.loss in kept:
                sem.losses[ins.micro] = kept[j.loss]  # read when the step ends: no host wait here
        finally:
            for r, v in kept.items():
                if r not in passed:
                    self.dev.release(v)

    def _put_rows(self, a: str, kept: dict, passed: set, fetch, fp32: bool) -> None:
        """Buffer `a`, rows of values a segment made (a unit's rows of a gradient): each value is
        held whole on the device (`DeviceTier.adopt`), its bytes counted by the rows' buffers from
        here on (the segment's hold of it ends)."""
        for _, root, _, _ in self.program.parts[a]:
            if root in self.dev.wholes:
                continue
            v = kept[root] if root in kept else fetch(root)
            whole = v.float() if fp32 else v  # accumulated in fp32 (eager's .grad)
            if root in kept and root not in passed and whole is v:
                self.dev.release(v)
                passed.add(root)
            self.dev.adopt(root, whole)
        self.dev.put(a, {key: self.dev.wholes[root][0][r0:r1] for key, root, (r0, r1), _ in self.program.parts[a]})

    def _fetch(self, root: str, micro: int = 0, besides: str = "") -> torch.Tensor:
        """`root`'s value for microbatch `micro`: a step input, else the copy of a buffer on the
        device that holds it (but `besides`); a value units hold in rows, whole."""
        v = self.inputs.get(root)
        if v is None:
            holders, parts = self.program.holders_of(root, micro), self.program.parts
            for h in holders:
                c = self.dev.copies.get(h) if h != besides and h not in parts else None
                if c is not None:
                    return c[root]
            # rows units hold (a weight's; a gradient's are the sum being accumulated into, never read)
            if besides not in parts and root in self.dev.wholes:
                return self.dev.whole(root)
            raise ExecutionError(
                f"{root} (in {', '.join(holders or ['no buffer'])}) is not on {self.tiers.gpu}; "
                f"the plan does not make it wait for the load that brings it")
        return v[micro]

    def _copy(self, ins: Instr) -> None:
        buf, src, dst, gpu = ins.tensor, ins.src, ins.dst, self.tiers.gpu
        layout = self.program.layouts[buf]
        if (src, dst) == (gpu, "dram"):  # CUDA: asynchronous, its readers wait for its event
            self.host.store_from(buf, layout, self.dev.get(buf), non_blocking=True)
        elif (src, dst) == ("dram", gpu):
            self.dev.load_from(buf, self.host.get(buf), *self._room(ins, buf))
        elif (src, dst) == ("dram", "ssd"):
            self.ssd.write(buf, self.host.get(buf))
        else:
            self.ssd.read(buf, self.host, layout, first=ins.stream == "ssd.first", committed=self.sem.redoing)

    def _send(self, ins: Instr) -> None:
        """A stage boundary: the sender stages the buffer in host memory and sends it with its
        strides; the receiver puts it on its device as it was (same strides, same bits)."""
        buf, layout = ins.tensor, self.program.layouts[ins.tensor]
        tag = 2 * self.replay.plan_id[ins.id]  # the plan's id: the same on both ends
        at = self.device if self.comm.on_device else "cpu"  # NCCL sends device memory, gloo host memory
        if ins.src == self.tiers.gpu:
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
        self.dev.load_from(buf, HostCopy(layout, blob, got), *self._room(ins, buf))
        if self.device.type == "cuda":  # host work records no event: its readers find the copy done
            torch.cuda.current_stream(self.device).synchronize()

    def _free(self, ins: Instr) -> None:
        if ins.dst == self.tiers.gpu and ins.tensor in self.dev.copies:
            self.replay.lanes.retire(self.dev.copies[ins.tensor].values())  # CUDA: other streams may still read it
        self.tiers.by_name[ins.dst].drop(ins.tensor)

    def _optimizer_step(self, ins: Instr) -> None:
        prog, b = self.program, ins.segment
        key = prog.row_key(b)
        on_dev = ins.dst != "cpu"
        tier = self.dev if on_dev else self.host
        master = tier.get(BufferKind.M.of(b) if prog.mixed else BufferKind.P.of(b))
        p_buf = BufferKind.P.of(b)
        # LoHan Table II: a mixed-precision update also produces the compute copy P from M; on the
        # CPU the fast kernel writes the 16-bit ones in the same pass (`out16`)
        fresh_p = None  # the copy P is written into; None: a new device copy, put below
        if prog.mixed and p_buf not in ins.allocs:
            fresh_p = tier.get(p_buf)
        elif prog.mixed and not on_dev:
            fresh_p = self.host.alloc(p_buf, prog.layouts[p_buf])
        written: set[str] = set()
        if self.sem.updates(b):  # fp16: inf/NaN changes nothing
            written = self.sem.update(b, tier.get(BufferKind.G.of(b)), tier.get(BufferKind.OS.of(b)), master,
                                      on_dev, self.dev, fresh_p, self.scalars)
        if not prog.mixed:
            return
        ph = prog.joint.placeholder
        rest = [p for p in prog.block_params[b] if key(ph[p]) not in written]
        room = self._room(ins, p_buf) if fresh_p is None else (None, 0)  # the new P's arena range, if any
        if prog.dp > 1:  # this rank's rows of P from its shard of M, then the other ranks' rows
            if fresh_p is None and room[0] is not None:
                fresh_p = self.dev.place(p_buf, prog.layouts[p_buf], *room)
            elif fresh_p is None:
                self.dev.put(p_buf, {ph[p]: torch.empty(tuple(prog.joint.meta(ph[p])[1]), dtype=prog.joint.meta(ph[p])[0],
                                                         device=self.dev.device) for p in prog.block_params[b]})
                fresh_p = self.dev.get(p_buf)
            for p in rest:
                a, z = prog.shard(p)
                fresh_p[ph[p]].view(-1)[a:z].copy_(master[p].view(-1)[:z - a])
        elif fresh_p is None and room[0] is not None:  # cast as it is copied in
            self.dev.place(p_buf, prog.layouts[p_buf], *room, {key(ph[p]): master[key(p)] for p in rest})
        elif fresh_p is None:  # a copy also for fp32 ones: P never aliases M
            self.dev.put(p_buf, {key(ph[p]): master[key(p)].to(prog.joint.meta(ph[p])[0], copy=True) for p in rest})
        else:
            # straight into P's memory, rounded as `.to` rounds: no temporary the size of the
            # parameter, allocated and page-faulted each step (benchmarks/RESULTS.md "On a GPU")
            for p in rest:
                fresh_p[key(ph[p])].copy_(master[key(p)])

    def _gather(self, ins: Instr) -> None:
        """Data parallel: the other ranks' rows of block b's parameters into its copy of P:b on the
        update's tier (this rank's rows updated there), one parameter at a time (an all-gather of
        each rank's shard of it: a temporary of the parameter's size, padded)."""
        prog, b = self.program, block_of(ins.tensor)
        params = self.tiers.by_name[ins.dst].get(ins.tensor)
        ph = prog.joint.placeholder
        for p in prog.block_params[b]:
            flat = params[ph[p]].view(-1)
            n = prog.shard_numel(p)
            a, z = prog.shard(p)
            mine = flat.new_zeros(n)
            mine[:z - a] = flat[a:z]
            every = self.comm.all_gather(mine)
            for r in range(prog.dp):
                lo, hi = min(flat.numel(), r * n), min(flat.numel(), (r + 1) * n)
                if r != prog.rank:
                    flat[lo:hi] = every[r * n:r * n + hi - lo]
        self._device_done(ins.dst)

    def _device_done(self, tier: str) -> None:
        """CUDA: the collective's work on this lane's stream done before its readers on other
        streams run (host instructions record no event for them to wait on), as a send's receive."""
        if self.device.type == "cuda" and is_gpu(tier):
            torch.cuda.current_stream(self.device).synchronize()

    def _reduce(self, ins: Instr) -> None:
        """Data parallel: a block's gradient summed over the ranks (every rank then holds the sum one
        process accumulating all their microbatches holds), its inf/NaN check and norms taken of it."""
        grads = self.dev.get(ins.tensor)
        self.comm.all_reduce(list(grads.values()), in_order=self.program.plan.options.exact_optimizer)
        if self.sem.scaler is not None:  # any rank's overflow is in the sum: every rank skips alike
            self.sem.scaler.check(list(grads.values()))
        self.sem.record_norms(block_of(ins.tensor), grads)
        self._device_done(ins.dst)

    def _commit_previous(self, ins: Instr) -> None:
        """A step's `commit` instruction: the carried buffers are home, so the SSD holds the whole
        state of the step before (`on_commit` commits it when due)."""
        self.on_commit()


def _keys(prog, buf: str) -> list[tuple[str, str, tuple[int, int] | None]]:
    """(layout key, joint-graph root, rows or None) of each member of a buffer a segment makes."""
    if buf in prog.parts:
        return [(key, root, rows) for key, root, rows, _ in prog.parts[buf]]
    return [(r, r, None) for r in prog.members[buf]]


HANDLERS = {
    InstrKind.COMPUTE: Runtime._compute,
    InstrKind.RECOMPUTE: Runtime._compute,
    InstrKind.LOAD: Runtime._copy,
    InstrKind.STORE: Runtime._copy,
    InstrKind.FREE: Runtime._free,
    InstrKind.OPTIMIZER_STEP: Runtime._optimizer_step,
    InstrKind.SEND: Runtime._send,
    InstrKind.COMMIT: Runtime._commit_previous,
    InstrKind.REDUCE: Runtime._reduce,
    InstrKind.GATHER: Runtime._gather,
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
    if ins.kind in (InstrKind.REDUCE, InstrKind.GATHER):
        return f"{ins.kind} {ins.tensor} over the ranks"
    return f"{ins.kind} {ins.tensor} {ins.src}->{ins.dst}"
