"""Lowering: a policy's decisions (`schema.schedule.Decisions`) turned into the static schedule.

A policy returns `Decisions` only; `lower()` turns them into the instruction list,
deterministically (Checkmate's `schedule_from_rs`). Every policy shares this lowering, so
their plans differ only where their decisions differ and are compared on one yardstick.

The buffer kinds and the names they use are `schema.schedule`'s.
"""
from __future__ import annotations

import functools

from tensorstow.planner.cost import BlockProfile, shard_count
from tensorstow.schema.schedule import (CPU_OPTIMIZER, OPTIMIZER_INPUTS, TIERS, BlockDecision, Buffer, BufferKind, Decisions,
                                        Instr, InstrKind, Stream, block_of, buffer_kind, carried_buffers, member_rows,
                                        parent_of, rows_member, tier_class, unit_name)


def ssd_read_stream(buf: str, first: bool) -> str:
    """With `first` (`Decisions.ssd_reads_first`): `ssd.first` for what a computation waits for
    (parameters, activations), which the aio engine runs ahead of queued writes and the simulator
    lets pause the write in progress; `ssd.read` for the update pipeline's reads, which queue with
    the writes in order (ahead of them they would fill DRAM with states whose write-back keeps
    being put off), on a stream of their own so a read that waits for DRAM room there holds up no
    parameter read. Each of those waits for the `ssd.first` read emitted before it
    (`Emitter.emit`), the pace one shared stream gave them. Without: all on `ssd.read`."""
    return "ssd.first" if first and buffer_kind(buf) not in OPTIMIZER_INPUTS else "ssd.read"


def buffers_for(order: list[str], prof: dict[str, BlockProfile], profile_of: dict[str, str],
                decisions: Decisions, mixed: bool) -> dict[str, Buffer]:
    """The buffers of every block, with their home tiers from the decisions."""
    out = {}
    for b in order:
        p, d = prof[profile_of[b]], decisions.blocks[b]
        n = p.param_count
        for u, own in ((b, p.own()), *((unit_name(b, k), unit_state(x)) for k, x in enumerate(p.units))):
            out.update(state_buffers(u, own, decisions.of(u), decisions.fp32_grads(mixed), mixed, decisions.dp))
        for k, x in enumerate(p.units):
            if decisions.of(unit_name(b, k)).optimizer == "gpu":
                out[f"W:opt:{unit_name(b, k)}"] = Buffer(f"W:opt:{unit_name(b, k)}", x.opt_workspace, unit_name(b, k))
        if p.const_bytes:
            out[f"C:{b}"] = Buffer(f"C:{b}", p.const_bytes, b, d.params, p.consts)
        if p.carried_bytes:
            out[f"T:{b}"] = Buffer(f"T:{b}", p.carried_bytes, b, members=p.carried)
        if p.handed_bytes:
            out[f"H:{b}"] = Buffer(f"H:{b}", p.handed_bytes, b, members=p.handed)
        if p.input_bytes:
            out[f"X:{b}"] = Buffer(f"X:{b}", p.input_bytes, b, members=p.inputs)
        size = dict(p.sizes)
        cut = split_backward(p, d)
        early = set(p.early) if cut else set()

        def saved(kind: str, members) -> None:
            """A:/R:<b>, and with a cut backward its early part AE:/RE:<b>."""
            for k, names in ((kind, [n for n in members if n not in early]),
                             (f"{kind}E", [n for n in members if n in early])):
                if names:
                    out[f"{k}:{b}"] = Buffer(f"{k}:{b}", sum(size[n] for n in names), b,
                                             members=tuple(names))
        if p.saved_bytes and partial_swap(p, d):
            saved("A", p.swapped)
            saved("R", p.rest)
            if p.refwd_workspace:
                out[f"W:refwd:{b}"] = Buffer(f"W:refwd:{b}", p.refwd_workspace, b)
        elif p.saved_bytes:
            saved("A", [n for n, _, _ in p.saved])
        if cut and p.handoff:
            out[f"K:{b}"] = Buffer(f"K:{b}", p.handoff_bytes, b, members=p.handoff)
        ws_opt = p.opt_workspace if d.optimizer == "gpu" else 0
        phases = (("bwd1", p.bwd1_workspace), ("bwd2", p.bwd2_workspace)) if cut else (("bwd", p.bwd_workspace),)
        if decisions.dp > 1 and mixed and n:  # the 16-bit gradients the backward makes, beside their fp32 G
            phases = (*phases[:-1], (phases[-1][0], phases[-1][1] + p.grad_bytes))
        for ph, ws in (("fwd", p.fwd_workspace), *phases, ("opt", ws_opt)):
            if ws:
                out[f"W:{ph}:{b}"] = Buffer(f"W:{ph}:{b}", ws, b)
        if decisions.grad_accum > 1 and n:
            # A later microbatch's backward makes its gradient (compute dtype) before adding it into
            # G: one more gradient in the workspace of the segment that makes G.
            out[f"W:acc:{b}"] = Buffer(f"W:acc:{b}", phases[-1][1] + p.grad_bytes, b)
    return out


def state_buffers(b: str, own: dict, d: BlockDecision, fp32_grads: bool, mixed: bool, ranks: int = 1
                  ) -> dict[str, Buffer]:
    """P:, G:, M: (mixed precision) and OS:<b> of a block's own trainable state, or of a unit's
    (`own`: `BlockProfile.own`, `unit_state`), with the homes `d` gives them; none without any.
    Data parallel over `ranks`: M: and OS: hold one rank's shard (`cost.shard_count`)."""
    n, params = own["param_count"], own["params"]
    if not n:
        return {}
    if ranks > 1:
        n = shard_count(own["shapes"], ranks)
    out = {f"P:{b}": Buffer(f"P:{b}", own["param_bytes"], b, d.params, params),
           f"G:{b}": Buffer(f"G:{b}", own["grad_fp32_bytes"] if fp32_grads else own["grad_bytes"], b,
                            members=own["grads"])}
    if mixed:
        out[f"M:{b}"] = Buffer(f"M:{b}", 4 * n, b, d.states, _state_members(tuple(params), (".master",)))
    out[f"OS:{b}"] = Buffer(f"OS:{b}", 8 * n, b, d.states, _state_members(tuple(params), (".exp_avg", ".exp_avg_sq")))
    return out


@functools.lru_cache(maxsize=4096)
def _state_members(params: tuple[str, ...], suffixes: tuple[str, ...]) -> tuple[str, ...]:
    """The members of the optimizer state of `params` (`_state_member`), each parameter's
    `suffixes` in turn. Made once per block: every candidate a search replays has them."""
    return tuple(_state_member(q, s) for q in params for s in suffixes)


def _state_member(param: str, suffix: str) -> str:
    """The member of a parameter's optimizer state: `w.exp_avg`, for rows of it `w.exp_avg[2:4]`."""
    name, rows = member_rows(param)
    return f"{name}{suffix}" if rows is None else rows_member(f"{name}{suffix}", rows)


def unit_state(u) -> dict:
    """A `UnitProfile`'s state as `BlockProfile.own` gives a block's."""
    return dict(params=u.params, grads=u.grads, param_count=u.param_count, param_bytes=u.param_bytes,
                grad_bytes=u.grad_bytes, grad_fp32_bytes=u.grad_fp32_bytes)


def units_of(b: str, prof: BlockProfile) -> list[str]:
    """The placement units of block b (`schema.schedule.UNIT`), in order."""
    return [unit_name(b, k) for k in range(len(prof.units))]


def split_backward(p: BlockProfile, d: BlockDecision) -> bool:
    """Whether the block's backward runs in two parts (the decision's cut, which must be its
    profile's)."""
    if d.bwd_cut and d.bwd_cut != p.bwd_cut:
        raise ValueError(f"block {p.name}: a backward cut after {d.bwd_cut} ops, but its profile cuts "
                         f"after {p.bwd_cut}")
    return bool(d.bwd_cut)


def activation_buffers(b: str, has) -> tuple[list[str], list[str]]:
    """(A:<b> and AE:<b>, R:<b> and RE:<b>): the saved-activation buffers a swap moves and a
    recompute makes, and those a partial swap's re-forward makes; the ones the plan has."""
    return ([x for x in (f"A:{b}", f"AE:{b}") if has(x)], [x for x in (f"R:{b}", f"RE:{b}") if has(x)])


def partial_swap(p: BlockProfile, d: BlockDecision) -> bool:
    """Whether the block's swap moves only `p.swapped` and re-forwards the rest (R:<b>)."""
    return d.reforward and d.activations in ("swap_dram", "swap_ssd") and bool(p.rest)


def swap_bytes(p: BlockProfile, reforward: bool) -> int:
    """Bytes a swap of the block moves: all it saves, or with `reforward` the part a partial swap
    moves."""
    return p.swap_bytes if reforward and p.rest else p.saved_bytes


@functools.cache
def _routes(gpu: str) -> tuple[dict, dict]:
    """How `Emitter.move` copies to and from GPU tier `gpu`: (src, dst) -> the tiers a copy goes
    through where not straight (SSD <-> GPU through DRAM), and (src, dst) of a hop -> (its
    `InstrKind`, load towards the device or store away from it; its stream, None for an SSD read,
    whose stream depends on the buffer: `ssd_read_stream`)."""
    paths = {("ssd", gpu): ("ssd", "dram", gpu), (gpu, "ssd"): (gpu, "dram", "ssd")}
    hops = {}
    for (a, b), stream in {("ssd", "dram"): None, ("dram", "ssd"): "ssd.write", ("dram", gpu): f"{gpu}.h2d",
                           (gpu, "dram"): f"{gpu}.d2h"}.items():
        kind = InstrKind.LOAD if TIERS.index(tier_class(b)) < TIERS.index(tier_class(a)) else InstrKind.STORE
        hops[(a, b)] = (kind, stream)
    return paths, hops


class Emitter:
    """Appends instructions to one step's list and tracks where each buffer's copies are, so
    every copy waits for what it needs: the copy it is made from, and the release of the previous
    copy of the same buffer on its destination tier (a tier holds one copy of a buffer at a time).
    The lowerings (`lower`, `planner.pipeline`) decide what runs and in which order; the emitter
    adds the dependencies that follow from where the copies are."""

    def __init__(self, gpu: str, reads_first: bool = False):
        self.gpu = gpu
        """The tier of the GPU being scheduled (`gpuK`): `move`'s device end, `free`'s default stream."""
        self.reads_first = reads_first
        """`Decisions.ssd_reads_first`."""
        self.instrs: list[Instr] = []
        """The step's instructions so far; an instruction's id is its index."""
        self.where: dict[tuple[str, str], int | None] = {}
        """(buffer, tier) -> the instruction that made that copy present (None: present from the
        step's start, a home copy); absent: no copy there."""
        self.freed: dict[tuple[str, str], int] = {}
        """(buffer, tier) -> the free that released the latest copy there."""
        self.last_first: int | None = None
        """The latest `ssd.first` read so far: `ssd.read` loads follow it."""
        self.commit: int | None = None
        """`Decisions.deferred_writes`: the commit of the previous step, which updates and SSD
        writes follow."""
        self.reads: dict[str, str] = {}
        """Buffer -> the stream its SSD reads go on (`ssd_read_stream`)."""

    def emit(self, kind, stream, deps=(), **kw) -> int:
        """Append one instruction (an `Instr`'s fields in `kw`) after `deps`; returns its id.
        A copy may only appear where the previous copy of the same buffer is gone, so it also waits
        for that copy's free; an `ssd.read` waits for the latest `ssd.first` read
        (`ssd_read_stream`), and an update or SSD write for the previous step's commit."""
        after = set(deps)
        freed = self.freed
        allocs = kw.get("allocs")
        if allocs:
            dev = Stream.of(stream).device if stream != CPU_OPTIMIZER else "dram"
            after.update([freed.get((a, dev)) for a in allocs])
        if kind in (InstrKind.LOAD, InstrKind.STORE, InstrKind.SEND):
            after.add(freed.get((kw["tensor"], kw["dst"])))
        if self.reads_first and stream == "ssd.read":  # paced by the reads for computations
            after.add(self.last_first)
        if kind == "optimizer_step" or stream == "ssd.write":  # the previous step is committed first
            after.add(self.commit)
        after.discard(None)
        i = len(self.instrs)
        self.instrs.append(Instr(id=i, kind=kind, stream=stream, deps=tuple(sorted(after)), **kw))
        if stream == "ssd.first":
            self.last_first = i
        return i

    def move(self, buf: str, src: str, dst: str, deps=()) -> int:
        """Copy buf src -> dst, through DRAM when needed; returns the last instruction."""
        paths, hops = _routes(self.gpu)
        path = paths.get((src, dst)) or (src, dst)
        last = None
        for a, b in zip(path, path[1:]):
            kind, stream = hops[(a, b)]
            if stream is None:
                stream = self.reads.get(buf)
                if stream is None:
                    stream = self.reads[buf] = ssd_read_stream(buf, self.reads_first)
            last = self.emit(kind, stream, (*deps, last, self.where.get((buf, a))), tensor=buf, src=a, dst=b)
            self.where[(buf, b)] = last
            if a != src:  # an intermediate hop: release it once the next hop is done
                self.free(buf, a, (last,))
        return last

    def free(self, buf: str, tier: str, deps=(), on: int | None = None) -> int:
        """Release a copy. It runs on the stream of the instruction that releases it (its latest
        dependency, else `on`, the one expected to end last), so bookkeeping never makes one
        stream wait for another's transfers."""
        deps = [d for d in (*deps, on) if d is not None]
        if deps:
            stream = self.instrs[on if on is not None else max(deps)].stream
        else:
            stream = f"{self.gpu}.compute" if tier == self.gpu else ("cpu.opt" if tier == "dram" else "ssd.write")
        i = self.emit(InstrKind.FREE, stream, deps, tensor=buf, dst=tier)
        self.where.pop((buf, tier), None)
        self.freed[(buf, tier)] = i
        return i


def lower_eval(order: list[str], prof: dict[str, BlockProfile], profile_of: dict[str, str],
               decisions: Decisions, buffers: dict[str, Buffer], gpu: str = "gpu0", *, mixed: bool) -> list[Instr]:
    """One evaluation batch's forward-only program (single GPU, `Plan.eval_instructions`): per
    microbatch, every block's forward with its parameters streamed as the step streams them (the
    same homes and prefetch FIFO), keeping only the next block's input X (no saved activations,
    gradients or updates); what the previous step left in DRAM for the next one to write home
    (`Decisions.deferred_writes`) is read there and left there."""
    return _SidePrograms(order, prof, profile_of, decisions, buffers, gpu, mixed, updates_wait=False).lower_eval()


def lower_redo(order: list[str], prof: dict[str, BlockProfile], profile_of: dict[str, str],
               decisions: Decisions, buffers: dict[str, Buffer], gpu: str = "gpu0", *, mixed: bool) -> list[Instr]:
    """A speculating plan's redo program (`Plan.redo_instructions`, `Decisions.speculated`): after
    a step whose clip fired, each speculated block in update order reads its state back from its
    SSD home (the executor reads the last commit's version, from before the step), updates it
    again with the gradient it kept in DRAM (now clipped), writes it home and releases the
    gradient."""
    return _SidePrograms(order, prof, profile_of, decisions, buffers, gpu, mixed, updates_wait=True).lower_redo()


def lower(order: list[str], prof: dict[str, BlockProfile], profile_of: dict[str, str],
          decisions: Decisions, buffers: dict[str, Buffer], gpu: str = "gpu0", *, mixed: bool) -> list[Instr]:
    """Turn per-block decisions into one step's instruction list (single GPU). `mixed`: mixed
    precision (an fp32 master M:<b> beside each compute-precision P:<b>).

    `Decisions.updates_wait` (fp16 loss scaling, clipping by the global norm): an update depends on
    every gradient (whether the step is skipped, the clip factor), so every optimizer step waits for
    the last backward instead of overlapping it, and the subgroups' state reads are double-buffered
    (a read waits for the write-back of the subgroup two before it) so DRAM never holds more than
    two subgroups' states in flight."""
    return _Lowering(order, prof, profile_of, decisions, buffers, gpu, mixed, updates_wait=decisions.updates_wait).lower()


class _Lowering:
    """One GPU's step, emitted phase by phase (`lower`): the previous step's deferred write-backs,
    the forward block by block, the backward block by block in reverse with each block's update
    right after it (overlapped), else every update after the backward. With gradient accumulation
    (`Decisions.grad_accum` K) the forward and backward run K times, microbatch after microbatch;
    each backward but the first adds into G, which waits on its `BlockDecision.accum` tier between
    them, and only the last one's gradients go on to the updates.

    Per block the forward loads its streamed parameters (a FIFO `prefetch` blocks ahead: each load
    waits for the release of the block `prefetch` + 1 before it, Fuyou §4.4), runs, and sends its
    activations and input checkpoint where the decisions keep them; the backward brings them back
    (or recomputes them), runs, sends its gradient to the update's device, and releases what it read."""

    def __init__(self, order: list[str], prof: dict[str, BlockProfile], profile_of: dict[str, str],
                 decisions: Decisions, buffers: dict[str, Buffer], gpu: str, mixed: bool, *, updates_wait: bool):
        self.order, self.prof, self.profile_of, self.buffers = order, prof, profile_of, buffers
        self.decisions = decisions
        self.dec = decisions.blocks
        """Block -> its `BlockDecision`."""
        self.gpu = gpu
        self.comp = f"{gpu}.compute"
        """The GPU's compute stream."""
        self.updates_wait = updates_wait
        """Updates wait for the last backward, state reads double-buffered (`lower`)."""
        self.units = {b: units_of(b, prof[profile_of[b]]) for b in order}
        """Block -> its placement units (`schema.schedule.UNIT`)."""
        self.e = Emitter(gpu, decisions.ssd_reads_first)
        """The instructions so far, and where each buffer's copies are."""
        self.home = {n: (gpu if b.home == "gpu" else b.home) for n, b in buffers.items() if b.home}
        """Buffer -> its home tier (`gpuK` for a GPU-resident one), for the buffers that have one."""
        for n, t in self.home.items():
            self.e.where[(n, t)] = None
        self.streamed = [b for b in order if self.streams(b)]
        """Blocks whose P:/C: are loaded for each use, in forward order (the forward's prefetch FIFO)."""
        self.bwd_streamed = self.streamed[::-1]
        """The same in backward order (the backward's prefetch FIFO)."""
        self.last_fwd = order[-1]
        """The last block's forward and backward run back to back: its parameters stay between."""
        self.mixed = mixed
        """Mixed precision: an fp32 master M:<b> beside the compute-precision P:<b>."""
        self.keep = decisions.keep_params_for_update and not self.mixed
        """`Decisions.keep_params_for_update` (fp32 only)."""
        self.overlap = decisions.overlap_optimizer and not updates_wait
        """Each block's update runs once its gradient is ready, during the backward (LoHan's active
        gradient offloading); else all of them after the last backward."""
        self.carried = carried_buffers(decisions, buffers)
        """Buffers the previous step left in DRAM, written home at this step's start
        (`Decisions.deferred_writes`)."""
        self.written_back: dict[str, int] = {}
        """Carried buffer -> its write home (a carried P's DRAM copy goes once it is also home)."""
        self.borrowed: list[str] = []
        """Other blocks' P:/C: copies loaded for the segment being emitted, released after it."""
        self.frees_fwd: dict[str, int] = {}
        """Streamed block -> the release of its parameters after its forward (gates later loads)."""
        self.swap_outs: dict[str, int] = {}
        """Block -> the last release of its activations or checkpoint on the GPU after its forward
        (back-pressure: a forward runs at most prefetch + 1 blocks ahead of them)."""
        self.frees_bwd: dict[str, int] = {}
        """Streamed block -> the release of its parameters after its backward."""
        self.grads_ready: dict[str, int] = {}
        """Block -> the instruction after which its gradient is where its update reads it."""
        self.cpu_grads: list[str] = []
        """CPU-updated blocks whose gradient took a DRAM slot (`Decisions.grad_buffers`), in order."""
        self.g_freed: dict[str, int] = {}
        """Block -> the release of its gradient by its update (frees a gradient slot)."""
        self.writes: list[int] = []
        """Each update's last write-back, in update order."""
        self.carry_until = {b: prof[profile_of[b]].carried_until for b in order if self.has(f"T:{b}")}
        """Block with a T:<b> -> the profile whose backward last reads it (then T:<b> is released)."""
        self.handed_to = {order[order.index(b) - 1]: f"H:{b}" for b in order[1:] if self.has(f"H:{b}")}
        """Block -> the H: buffer the next block's backward hands to it (released after its backward)."""
        self.held: int | None = None
        """`Decisions.blocking_copies`: what the next backward waits for (the last gradient's copy
        to DRAM, else the last backward)."""
        self.room: int | None = None
        """A cut backward's release of its early part: the next swapped-in block's load waits for it."""
        self.micro = 0
        """The microbatch being emitted (`Decisions.grad_accum`)."""
        self.last_micro = True
        """Whether it is the step's last: its gradients are whole and go on to the updates."""
        self.last_comp: int | None = None
        """The latest computation emitted: an accumulated gradient's load back waits for it."""
        self.spec = set(decisions.speculated)
        """Blocks updated as their gradient arrives before the norm is known (`Decisions.speculated`):
        they keep their gradient in DRAM for the redo program."""
        self.redoing = False
        """Emitting the redo program (`lower_redo`): the kept gradients are released."""

    # ---- helpers ------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        """Whether the plan has the buffer."""
        return name in self.buffers

    def ws(self, phase: str, b: str) -> str:
        """The workspace buffer of b's `phase` segment, or "" where it needs none."""
        return f"W:{phase}:{b}" if self.has(f"W:{phase}:{b}") else ""

    def state(self, b: str) -> list[str]:
        """The block's parameter-like buffers: what its segments read of its own state (its units'
        parameters included)."""
        return [x for x in (f"P:{b}", f"C:{b}", *(f"P:{u}" for u in self.units[b])) if self.has(x)]

    def off_gpu(self, b: str) -> list[str]:
        """The block's parameter-like buffers that live off the GPU and are loaded for each use."""
        return [x for x in self.state(b) if self.home[x] != self.gpu]

    def streams(self, b: str) -> bool:
        """Whether some of the block's P:/C: live off the GPU and are loaded for each use."""
        return bool(self.off_gpu(b))

    def owners(self, b: str) -> list[str]:
        """The block and its units: what has a gradient G:<x> and an update of its own."""
        return [b, *self.units[b]]

    def gate(self, done: dict[str, int], seq: list[str], b: str, lag: int) -> int | None:
        """`done` of the block `lag` places before b in `seq` (None where there is none): what a
        FIFO of depth `lag` makes b's copy wait for."""
        k = seq.index(b) - lag
        return done.get(seq[k]) if k >= 0 else None

    def load_state(self, b: str, *gates, for_update: bool = False) -> int | None:
        """Bring the block's P:/C: to the GPU after `gates`; returns the last load.
        `for_update`: the block's last load before its update; with `keep` an fp32 P read from
        SSD for a CPU update stays in DRAM for it (`update` finds it there). A carried P is taken
        from its DRAM copy, which goes once it is also home."""
        e, gpu = self.e, self.gpu
        last = None
        for x in self.off_gpu(b):
            if x in self.written_back and (x, "dram") in e.where:
                last = e.move(x, "dram", gpu, gates)
                e.free(x, "dram", (last,), on=self.written_back[x])
            elif (for_update and self.keep and buffer_kind(x) is BufferKind.P and self.home[x] == "ssd"
                  and self.decisions.of(block_of(x)).optimizer == "cpu"):
                last = e.move(x, "dram", gpu, (e.move(x, "ssd", "dram", gates),))
            else:
                last = e.move(x, self.home[x], gpu, gates)
        return last

    def free_state(self, b: str, after: int) -> int | None:
        """Release the block's P:/C: on the GPU after `after`; returns the last release."""
        last = None
        for x in self.off_gpu(b):
            last = self.e.free(x, self.gpu, (after,))
        return last

    def load_foreign(self, b: str) -> list[int]:
        """Bring the other blocks' P:/C: buffers that b reads (tied or shared weights); returns
        the loads, to wait for, and records which copies b must release after it runs."""
        e, gpu = self.e, self.gpu
        ready = []
        for o in self.prof[self.profile_of[b]].reads:
            for x in self.state(o):
                if (x, gpu) in e.where:  # resident, or loaded and not yet released by its owner
                    if e.where[(x, gpu)] is not None:
                        ready.append(e.where[(x, gpu)])
                    continue
                ready.append(e.move(x, self.home[x], gpu))
                self.borrowed.append(x)
        return ready

    def release_foreign(self, after: int) -> None:
        """Release the copies `load_foreign` brought for the segment `after`."""
        while self.borrowed:
            self.e.free(self.borrowed.pop(), self.gpu, (after,))

    # ---- the step -----------------------------------------------------------------------------
    def lower(self) -> list[Instr]:
        """The step's instructions, phase after phase."""
        self.write_back_carried()
        carry_until, handed_to = dict(self.carry_until), dict(self.handed_to)
        k = self.decisions.grad_accum
        for m in range(k):
            self.micro, self.last_micro = m, m == k - 1
            self.carry_until, self.handed_to = dict(carry_until), dict(handed_to)
            for b in self.order:
                self.forward(b)
            for b in reversed(self.order):
                self.backward(b)
        if not self.overlap:
            self.optimizer()
        return self.e.instrs

    def write_back_carried(self) -> None:
        """The previous step's deferred write-backs (`Decisions.deferred_writes`), then the commit
        every update and SSD write of this step waits for. Adam's states first: their DRAM is
        released as soon as they are home."""
        e = self.e
        for x in self.carried:
            e.where[(x, "dram")] = None
            self.written_back[x] = e.move(x, "dram", "ssd")
            if buffer_kind(x) is not BufferKind.P:
                e.free(x, "dram", (self.written_back[x],))
        if self.carried:
            e.commit = e.emit(InstrKind.COMMIT, "ssd.commit", tuple(self.written_back.values()))

    def forward(self, b: str) -> None:
        """Block b's forward: its loads, its compute, then its activations and input checkpoint
        sent to the tiers the decisions keep them on."""
        e, gpu, d, has = self.e, self.gpu, self.dec[b], self.has
        prefetch = self.decisions.prefetch
        p_ready = checkpointed = None
        if self.decisions.blocking_copies and has(f"X:{b}") and d.checkpoint != "gpu":  # before b runs
            checkpointed = e.move(f"X:{b}", gpu, d.checkpoint)
        if self.streams(b):
            gate = self.gate(self.frees_fwd, self.streamed, b, 1 + prefetch)
            p_ready = self.load_state(b, gate, checkpointed, for_update=b == self.last_fwd and self.last_micro)
        foreign = self.load_foreign(b)
        acts, _ = activation_buffers(b, has)
        allocs = list(acts) if d.activations != "recompute" else []
        nxt = self.order[self.order.index(b) + 1] if b != self.last_fwd else None
        if nxt and has(f"X:{nxt}"):
            allocs.append(f"X:{nxt}")
        # Back-pressure: a forward may run at most prefetch+1 blocks ahead of the swap-outs.
        gate_swap = self.gate(self.swap_outs, self.order, b, 2 + prefetch)
        c = self.last_comp = e.emit(InstrKind.COMPUTE, self.comp, (p_ready, gate_swap, checkpointed, *foreign),
                                    segment=f"fwd:{b}", allocs=tuple(allocs), workspace=self.ws("fwd", b),
                                    micro=self.micro)
        self.release_foreign(c)
        for a in allocs:
            e.where[(a, gpu)] = c
        if self.streams(b) and b != self.last_fwd:
            self.frees_fwd[b] = self.free_state(b, c)
        self.offload(b, acts, c, checkpointed)

    def offload(self, b: str, acts: list[str], c: int, checkpointed: int | None) -> None:
        """After b's forward `c`: its swapped activations and its input checkpoint to their tiers,
        their GPU copies released (`checkpointed`: the checkpoint's copy made before b ran)."""
        e, gpu, d = self.e, self.gpu, self.dec[b]
        if d.activations in ("swap_dram", "swap_ssd"):
            for x in acts:
                s = e.move(x, gpu, "dram" if d.activations == "swap_dram" else "ssd", (c,))
                self.swap_outs[b] = e.free(x, gpu, (s,))
        if self.has(f"X:{b}") and d.checkpoint != "gpu":
            s = checkpointed if checkpointed is not None else e.move(f"X:{b}", gpu, d.checkpoint, (c,))
            f = e.free(f"X:{b}", gpu, (s, c))
            self.swap_outs[b] = max(f, self.swap_outs.get(b, f))

    def backward(self, b: str) -> None:
        """Block b's backward: what it reads brought back, its compute, the releases after it, its
        gradient sent to its update's device and, overlapped, its update."""
        if self.prof[self.profile_of[b]].bwd_ops[0] < 0:
            return  # nothing below needs a gradient and nothing here trains (frozen embeddings)
        deps = self.backward_inputs(b)
        c, allocs = self.backward_compute(b, deps)
        self.backward_release(b, c, allocs)
        flushed = self.send_gradient(b, c)
        if self.decisions.blocking_copies:  # the gradient's copy to DRAM, else the backward itself
            self.held = flushed if flushed is not None else c

    def backward_inputs(self, b: str) -> list[int]:
        """Bring what b's backward reads: its parameters (FIFO prefetch), other blocks' weights, its
        input checkpoint, its activations (swapped in, or recomputed from the checkpoint, and a
        partial swap's rest re-forwarded); returns what the backward waits for."""
        e, gpu, d, has = self.e, self.gpu, self.dec[b], self.has
        deps = [self.held] if self.held is not None else []
        x_in = None
        if self.decisions.blocking_copies and has(f"X:{b}") and d.checkpoint != "gpu":  # first, as b's backward starts
            x_in = e.move(f"X:{b}", d.checkpoint, gpu, (self.held,))
        if self.streams(b) and b != self.last_fwd:
            gate = self.gate(self.frees_bwd, self.bwd_streamed, b, 1 + self.decisions.prefetch)
            deps.append(self.load_state(b, gate, x_in, for_update=self.last_micro))
        deps += self.load_foreign(b)
        if has(f"X:{b}") and d.checkpoint != "gpu":
            deps.append(x_in if x_in is not None else e.move(f"X:{b}", d.checkpoint, gpu))
        acts, rests = activation_buffers(b, has)
        if acts:
            if d.activations in ("swap_dram", "swap_ssd"):
                self.swap_in(b, acts, deps)
                if rests:  # the rest of what the backward reads, made again from X and A
                    deps.append(e.emit(InstrKind.RECOMPUTE, self.comp, tuple(deps), segment=f"refwd:{b}", allocs=tuple(rests),
                                       workspace=self.ws("refwd", b), micro=self.micro))
            elif d.activations == "recompute":
                r = e.emit(InstrKind.RECOMPUTE, self.comp, tuple(deps), segment=f"fwd:{b}", allocs=tuple(acts),
                           workspace=self.ws("fwd", b), micro=self.micro)
                deps.append(r)
        if has(f"X:{b}") and d.checkpoint != "gpu":
            e.free(f"X:{b}", d.checkpoint, (deps[-1] if deps else None,))
        for o in self.owners(b):
            if self.micro and has(f"G:{o}") and d.accum != "gpu":  # the sum so far, back to be added into
                deps.append(e.move(f"G:{o}", d.accum, gpu, (self.last_comp,)))
                e.free(f"G:{o}", d.accum, (deps[-1],))
        return deps

    def swap_in(self, b: str, acts: list[str], deps: list[int]) -> None:
        """Bring b's swapped activations back to the GPU, appending each load to `deps`; after a cut
        backward (`room`) the DRAM hop waits for the room its early part left."""
        e, gpu = self.e, self.gpu
        src = "dram" if self.dec[b].activations == "swap_dram" else "ssd"
        for x in acts:
            if self.room is None:
                deps.append(e.move(x, src, gpu))
            else:  # into the room the cut backward before this one left: the DRAM hop waits for it
                if src == "ssd":
                    e.move(x, "ssd", "dram")
                deps.append(e.move(x, "dram", gpu, (self.room,)))
                if src == "ssd":
                    e.free(x, "dram", (deps[-1],))
            e.free(x, src, (deps[-1],))

    def backward_compute(self, b: str, deps: list[int]) -> tuple[int, tuple[str, ...]]:
        """b's backward after `deps` (a cut one in two parts, LoHan §IV-D, releasing what only the
        first part reads between them); returns its last compute and the buffers it makes."""
        e, gpu, d, has = self.e, self.gpu, self.dec[b], self.has
        adds = self.micro > 0 and has(f"G:{b}")
        grads = tuple(f"G:{o}" for o in self.owners(b) if has(f"G:{o}"))
        allocs = tuple(x for x in (*grads, f"T:{b}", f"H:{b}") if has(x) and not (adds and x in grads))
        accum = grads if adds else ()
        grad_buffers = self.decisions.grad_buffers
        if grad_buffers and has(f"G:{b}") and d.optimizer == "cpu" and self.last_micro:
            if len(self.cpu_grads) >= grad_buffers and self.overlap:
                deps.append(self.g_freed[self.cpu_grads[-grad_buffers]])
            self.cpu_grads.append(b)
        self.room = None
        if split_backward(self.prof[self.profile_of[b]], d):  # LoHan §IV-D: release what only the first part reads
            c1 = e.emit(InstrKind.COMPUTE, self.comp, tuple(deps), segment=f"bwd1:{b}",
                        allocs=(f"K:{b}",) if has(f"K:{b}") else (), workspace=self.ws("bwd1", b), micro=self.micro)
            self.room = c1
            for x in (f"AE:{b}", f"RE:{b}"):
                if has(x):
                    self.room = e.free(x, gpu, (c1,))
            c = e.emit(InstrKind.COMPUTE, self.comp, (c1,), segment=f"bwd2:{b}", allocs=allocs, accum=accum,
                       workspace=self.ws("acc" if adds else "bwd2", b), micro=self.micro)
            if has(f"K:{b}"):
                e.free(f"K:{b}", gpu, (c,))
        else:
            c = e.emit(InstrKind.COMPUTE, self.comp, tuple(deps), segment=f"bwd:{b}", allocs=allocs, accum=accum,
                       workspace=self.ws("acc" if adds else "bwd", b), micro=self.micro)
        self.last_comp = c
        return c, allocs

    def backward_release(self, b: str, c: int, allocs: tuple[str, ...]) -> None:
        """After b's backward `c`: release what it read (borrowed weights, activations, checkpoint,
        values carried or handed to it, its parameters) and record what it made."""
        e, gpu, has = self.e, self.gpu, self.has
        self.release_foreign(c)
        for a in allocs:
            e.where[(a, gpu)] = c
        for x in (f"A:{b}", f"R:{b}", f"X:{b}"):
            if has(x):
                e.free(x, gpu, (c,))
        for t in sorted(t for t, until in self.carry_until.items() if until == self.profile_of[b]):
            e.free(f"T:{t}", gpu, (c,))
            del self.carry_until[t]
        if b in self.handed_to:  # the gradient the next block's backward handed to this one
            e.free(self.handed_to.pop(b), gpu, (c,))
        if self.streams(b):
            self.frees_bwd[b] = self.free_state(b, c)

    def send_gradient(self, b: str, c: int) -> int | None:
        """The gradients of b and its units, each to its update's device (`send_one`); returns the
        last copy to DRAM."""
        flushed = None
        for o in self.owners(b):
            s = self.send_one(o, c)
            flushed = s if s is not None else flushed
        return flushed

    def send_one(self, b: str, c: int) -> int | None:
        """b's gradient (a block's or a unit's) to its update's device (a CPU update: to DRAM, and
        on to SSD with `swap_grads`), then, overlapped, the update; returns the gradient's copy to
        DRAM."""
        e, gpu, d = self.e, self.gpu, self.decisions.of(b)
        if not self.has(f"G:{b}"):
            return None
        if not self.last_micro:  # a partial sum: to where it waits for the next microbatch
            if d.accum == "gpu":
                return None
            s = e.move(f"G:{b}", gpu, d.accum, (c,))
            e.free(f"G:{b}", gpu, (s,))
            return s
        flushed = None
        if self.decisions.dp > 1:  # summed over the ranks where the backward made it
            c = e.emit(InstrKind.REDUCE, f"{gpu}.reduce", (c,), tensor=f"G:{b}", src=gpu, dst=gpu)
        if d.optimizer == "cpu":
            s = e.move(f"G:{b}", gpu, "dram", (c,))
            e.free(f"G:{b}", gpu, (s,))
            flushed = s
            if self.decisions.swap_grads:
                s = e.move(f"G:{b}", "dram", "ssd", (s,))
                e.free(f"G:{b}", "dram", (s,))
            self.grads_ready[b] = s
        else:
            self.grads_ready[b] = c
        if self.overlap or parent_of(b) in self.spec:
            self.update(b, (self.grads_ready[b],))
        return flushed

    def optimizer(self) -> None:
        """Every update after the last backward, in backward order (not overlapped)."""
        last_bwd = len(self.e.instrs) - 1
        for b in reversed(self.order):
            for o in self.owners(b):
                if self.has(f"G:{o}") and b not in self.spec:
                    self.update(o, (self.grads_ready[o], last_bwd))

    def update(self, b: str, start: tuple) -> None:
        """One subgroup's update after `start` (its gradient first): bring its states to the
        update's device, update, write the results home."""
        e, gpu, d, has, home = self.e, self.gpu, self.decisions.of(b), self.has, self.home
        if self.decisions.serialize_optimizer:
            start = (*start, self.writes[-1] if self.writes else None)
        elif self.updates_wait and len(self.writes) >= 2:
            start = (*start, self.writes[-2])
        dev = "cpu" if d.optimizer == "cpu" else gpu
        tier = "dram" if dev == "cpu" else gpu
        states = [s for s in (f"M:{b}", f"OS:{b}") if has(s)]
        p_here = not self.mixed  # fp32: P is the master and is updated in place
        ready = list(start)
        # Overlapped: read the states while the block's backward still runs (Fuyou §4.3);
        # only the serialized baseline waits for the gradient before reading.
        read_after = start[1:] if self.decisions.overlap_optimizer else start
        for s in states + ([f"P:{b}"] if p_here or home[f"P:{b}"] == tier else []):
            if home[s] != tier and (s, tier) not in e.where:
                ready.append(e.move(s, home[s], tier, read_after))
            elif home[s] != tier:  # kept from the backward's load (keep_params_for_update)
                ready.append(e.where[(s, tier)])
        if self.decisions.swap_grads and dev == "cpu":  # the gradient comes back from SSD with the states
            g_in = e.move(f"G:{b}", "ssd", "dram", start)
            e.free(f"G:{b}", "ssd", (g_in,))
            ready.append(g_in)
        fresh = (f"P:{b}",) if self.mixed and home[f"P:{b}"] != tier else ()
        u = e.emit(InstrKind.OPTIMIZER_STEP, "cpu.opt" if dev == "cpu" else self.comp, tuple(ready), segment=b,
                   dst=dev, allocs=fresh, workspace=self.ws("opt", b))
        if parent_of(b) not in self.spec or self.redoing:  # a speculated update's gradient waits for the norm
            self.g_freed[parent_of(b)] = e.free(f"G:{b}", tier, (u,))
        p_done = u
        if self.decisions.dp > 1:  # the other ranks' rows of P, where the update left it
            p_done = e.emit(InstrKind.GATHER, f"{self.gpu}.gather", (u,), tensor=f"P:{b}", src=tier, dst=tier)
        self.writes.append(self.write_home(b, states, tier, u, p_done))

    def write_home(self, b: str, states: list[str], tier: str, u: int, p_done: int) -> int:
        """After b's update `u` on `tier` (and `p_done`, P whole there: `u`, or data parallel its
        gather): its states and parameters home (a carried one stays in DRAM for the next step to
        write); returns the last write."""
        e, home = self.e, self.home
        last = p_done
        for s in states + [f"P:{b}"]:
            after = p_done if s == f"P:{b}" else u
            if home[s] == tier:
                continue
            if s in self.carried:  # stays in DRAM: the next step writes it home
                e.where[(s, tier)] = after
                continue
            if s == f"P:{b}" and self.mixed:
                # LoHan Table II: the optimizer produces P16 from P32; send it to P's home.
                last = write_new(e, s, tier, home[s], after, self.gpu)
            else:
                last = e.move(s, tier, home[s], (after,))
                e.free(s, tier, (last,))
        return last


def write_new(e: Emitter, buf: str, at: str, home: str, after: int, gpu: str) -> int:
    """The optimizer wrote a fresh copy of `buf` on tier `at`; move it home and drop the rest."""
    e.where[(buf, at)] = after
    w = e.move(buf, at, home, (after,))
    e.free(buf, at, (w,))
    return w


class _SidePrograms(_Lowering):
    """The programs a plan runs besides its step, emitted with the step's machinery (the same
    homes, prefetch FIFO and updates): one evaluation batch (`lower_eval`) and a speculating
    plan's redo (`lower_redo`)."""

    def lower_eval(self) -> list[Instr]:
        """`lower_eval`'s instructions."""
        e, gpu = self.e, self.gpu
        for x in self.carried:  # the latest version: read from its DRAM copy, which stays
            e.where[(x, "dram")] = None
            self.home[x] = "dram"
        prefetch = self.decisions.prefetch
        for m in range(self.decisions.grad_accum):
            frees: dict[str, int] = {}
            x_made: dict[str, int] = {}
            for b in self.order:
                ready = None
                if self.streams(b):
                    gate = self.gate(frees, self.streamed, b, 1 + prefetch)
                    for x in self.off_gpu(b):
                        ready = e.move(x, self.home[x], gpu, (gate,))
                foreign = self.load_foreign(b)
                nxt = self.order[self.order.index(b) + 1] if b != self.last_fwd else None
                allocs = (f"X:{nxt}",) if nxt and self.has(f"X:{nxt}") else ()
                c = e.emit(InstrKind.COMPUTE, self.comp, (ready, *foreign, x_made.get(b)), segment=f"fwd:{b}",
                           allocs=allocs, workspace=self.ws("fwd", b), micro=m)
                self.release_foreign(c)
                for a in allocs:
                    e.where[(a, gpu)] = c
                    x_made[nxt] = c
                if self.has(f"X:{b}"):
                    e.free(f"X:{b}", gpu, (c,))
                if self.streams(b):
                    frees[b] = self.free_state(b, c)
        return e.instrs

    def lower_redo(self) -> list[Instr]:
        """`lower_redo`'s instructions."""
        self.redoing = True
        e = self.e
        for x in self.carried:  # the speculated update's result, which the redo replaces
            e.where[(x, "dram")] = None
        for b in reversed(self.order):
            if b in self.spec:
                for o in self.owners(b):
                    e.where[(f"G:{o}", "dram")] = None
                    for x in self.carried:
                        if block_of(x) == o:  # read again from the commit this step made of the one before
                            e.free(x, "dram")
                    self.update(o, ())
        return e.instrs
