"""Lowering: a policy's decisions (`schema.schedule.Decisions`) turned into the static schedule.

A policy returns `Decisions` only; `lower()` turns them into the instruction list,
deterministically (Checkmate's `schedule_from_rs`). Every policy shares this lowering, so
their plans differ only where their decisions differ and are compared on one yardstick.

The buffer kinds and the names they use are `schema.schedule`'s.
"""
from __future__ import annotations

from tensorstow.planner.cost import BlockProfile
from tensorstow.schema.schedule import (OPTIMIZER_INPUTS, TIERS, BlockDecision, Buffer, Decisions, Instr, buffer_kind,
                                        carried_buffers, tier_class)


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
        if n:
            out[f"P:{b}"] = Buffer(f"P:{b}", p.param_bytes, "parameter", b, d.params, p.params)
            g = p.grad_fp32_bytes if decisions.fp32_grads(mixed) else p.grad_bytes
            out[f"G:{b}"] = Buffer(f"G:{b}", g, "gradient", b, members=p.grads)
            if mixed:
                out[f"M:{b}"] = Buffer(f"M:{b}", 4 * n, "optimizer_state", b, d.states,
                                       tuple(f"{q}.master" for q in p.params))
            out[f"OS:{b}"] = Buffer(f"OS:{b}", 8 * n, "optimizer_state", b, d.states,
                                    tuple(f"{q}{s}" for q in p.params for s in (".exp_avg", ".exp_avg_sq")))
        if p.const_bytes:
            out[f"C:{b}"] = Buffer(f"C:{b}", p.const_bytes, "constant", b, d.params, p.consts)
        if p.carried_bytes:
            out[f"T:{b}"] = Buffer(f"T:{b}", p.carried_bytes, "temporary", b, members=p.carried)
        if p.handed_bytes:
            out[f"H:{b}"] = Buffer(f"H:{b}", p.handed_bytes, "temporary", b, members=p.handed)
        if p.input_bytes:
            out[f"X:{b}"] = Buffer(f"X:{b}", p.input_bytes, "saved_activation", b, members=p.inputs)
        size = dict(p.sizes)
        cut = split_backward(p, d)
        early = set(p.early) if cut else set()

        def saved(kind: str, members) -> None:
            """A:/R:<b>, and with a cut backward its early part AE:/RE:<b>."""
            for k, names in ((kind, [n for n in members if n not in early]),
                             (f"{kind}E", [n for n in members if n in early])):
                if names:
                    out[f"{k}:{b}"] = Buffer(f"{k}:{b}", sum(size[n] for n in names), "saved_activation", b,
                                             members=tuple(names))
        if p.saved_bytes and partial_swap(p, d):
            saved("A", p.swapped)
            saved("R", p.rest)
            if p.refwd_workspace:
                out[f"W:refwd:{b}"] = Buffer(f"W:refwd:{b}", p.refwd_workspace, "temporary", b)
        elif p.saved_bytes:
            saved("A", [n for n, _, _ in p.saved])
        if cut and p.handoff:
            out[f"K:{b}"] = Buffer(f"K:{b}", p.handoff_bytes, "temporary", b, members=p.handoff)
        ws_opt = p.opt_workspace if d.optimizer == "gpu" else 0
        phases = (("bwd1", p.bwd1_workspace), ("bwd2", p.bwd2_workspace)) if cut else (("bwd", p.bwd_workspace),)
        for ph, ws in (("fwd", p.fwd_workspace), *phases, ("opt", ws_opt)):
            if ws:
                out[f"W:{ph}:{b}"] = Buffer(f"W:{ph}:{b}", ws, "temporary", b)
    return out


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


class Emitter:
    def __init__(self, gpu: str, reads_first: bool = False):
        self.gpu = gpu
        self.reads_first = reads_first
        """`Decisions.ssd_reads_first`."""
        self.instrs: list[Instr] = []
        self.where: dict[tuple[str, str], int] = {}   # (buffer, tier) -> instr that made it present
        self.freed: dict[tuple[str, str], int] = {}   # (buffer, tier) -> the free that released it
        self.last_first: int | None = None  # the latest `ssd.first` so far: `ssd.read` loads follow it
        self.commit: int | None = None  # `Decisions.deferred_writes`: updates and SSD writes follow it

    def emit(self, kind, stream, deps=(), **kw) -> int:
        # A copy may only appear where the previous copy of the same buffer is gone.
        made = [(a, stream.split(".")[0] if stream != "cpu.opt" else "dram") for a in kw.get("allocs", ())]
        if kind in ("load", "store", "send"):
            made.append((kw["tensor"], kw["dst"]))
        deps = (*deps, *(self.freed.get(m) for m in made))
        if self.reads_first and stream == "ssd.read":  # paced by the reads for computations
            deps = (*deps, self.last_first)
        if kind == "optimizer_step" or stream == "ssd.write":  # the previous step is committed first
            deps = (*deps, self.commit)
        i = len(self.instrs)
        self.instrs.append(Instr(id=i, kind=kind, stream=stream,
                                 deps=tuple(sorted({d for d in deps if d is not None})), **kw))
        if stream == "ssd.first":
            self.last_first = i
        return i

    def move(self, buf: str, src: str, dst: str, deps=()) -> int:
        """Copy buf src -> dst, through DRAM when needed; returns the last instruction."""
        g = self.gpu
        path = {("ssd", g): ["ssd", "dram", g], (g, "ssd"): [g, "dram", "ssd"]}.get((src, dst), [src, dst])
        last = None
        for a, b in zip(path, path[1:]):
            stream = {("ssd", "dram"): ssd_read_stream(buf, self.reads_first), ("dram", "ssd"): "ssd.write",
                      ("dram", g): f"{g}.h2d", (g, "dram"): f"{g}.d2h"}[(a, b)]
            kind = "load" if TIERS.index(tier_class(b)) < TIERS.index(tier_class(a)) else "store"
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
        i = self.emit("free", stream, deps, tensor=buf, dst=tier)
        self.where.pop((buf, tier), None)
        self.freed[(buf, tier)] = i
        return i


def lower(order: list[str], prof: dict[str, BlockProfile], profile_of: dict[str, str],
          decisions: Decisions, buffers: dict[str, Buffer], gpu: str = "gpu0",
          loss_scaling: bool = False) -> list[Instr]:
    """Turn per-block decisions into one step's instruction list (single GPU).

    `loss_scaling` (fp16-mixed): whether the step is skipped depends on every gradient
    (executor.amp), so every optimizer step waits for the last backward instead of overlapping
    it, and the subgroups' state reads are double-buffered (a read waits for the write-back of
    the subgroup two before it) so DRAM never holds more than two subgroups' states in flight."""
    e = Emitter(gpu, decisions.ssd_reads_first)
    comp = f"{gpu}.compute"
    has = buffers.__contains__
    home = {n: (gpu if b.home == "gpu" else b.home) for n, b in buffers.items() if b.home}
    for n, t in home.items():
        e.where[(n, t)] = None
    dec = decisions.blocks

    def state(b: str) -> list[str]:
        """The block's parameter-like buffers: what its segments read of its own state."""
        return [x for x in (f"P:{b}", f"C:{b}") if has(x)]

    streamed = [b for b in order if state(b) and dec[b].params != "gpu"]
    last_fwd = order[-1]
    mixed = any(n.startswith("M:") for n in buffers)

    keep = decisions.keep_params_for_update and not mixed

    # ---- the previous step's deferred write-backs (Decisions.deferred_writes) ----------------
    carried = carried_buffers(decisions, buffers)
    written_back: dict[str, int] = {}
    for x in carried:  # Adam's states first: their DRAM is released as soon as they are home
        e.where[(x, "dram")] = None
        written_back[x] = e.move(x, "dram", "ssd")
        if not x.startswith("P:"):
            e.free(x, "dram", (written_back[x],))
    if carried:
        e.commit = e.emit("commit", "ssd.commit", tuple(written_back.values()))

    def load_state(b: str, *gates, for_update: bool = False) -> int | None:
        """`for_update`: the block's last load before its update; with `keep` an fp32 P read from
        SSD for a CPU update stays in DRAM for it (opt_step finds it there). A carried P is taken
        from its DRAM copy, which goes once it is also home."""
        last = None
        for x in state(b):
            if x in written_back and (x, "dram") in e.where:
                last = e.move(x, "dram", gpu, gates)
                e.free(x, "dram", (last,), on=written_back[x])
            elif for_update and keep and x == f"P:{b}" and home[x] == "ssd" and dec[b].optimizer == "cpu":
                last = e.move(x, "dram", gpu, (e.move(x, "ssd", "dram", gates),))
            else:
                last = e.move(x, home[x], gpu, gates)
        return last

    def free_state(b: str, after: int) -> int | None:
        last = None
        for x in state(b):
            last = e.free(x, gpu, (after,))
        return last

    borrowed: list[str] = []  # other blocks' P:/C: copies loaded for the segment being emitted

    def load_foreign(b: str) -> list[int]:
        """Bring the other blocks' P:/C: buffers that b reads (tied or shared weights); returns
        the loads, to wait for, and records which copies b must release after it runs."""
        ready = []
        for o in prof[profile_of[b]].reads:
            for x in state(o):
                if (x, gpu) in e.where:  # resident, or loaded and not yet released by its owner
                    if e.where[(x, gpu)] is not None:
                        ready.append(e.where[(x, gpu)])
                    continue
                ready.append(e.move(x, home[x], gpu))
                borrowed.append(x)
        return ready

    def release_foreign(after: int) -> None:
        while borrowed:
            e.free(borrowed.pop(), gpu, (after,))

    # ---- forward ----------------------------------------------------------------------------
    frees_fwd: dict[str, int] = {}
    swap_outs: dict[str, int] = {}
    for b in order:
        d = dec[b]
        p_ready = checkpointed = None
        if decisions.blocking_copies and has(f"X:{b}") and d.checkpoint != "gpu":  # before b runs
            checkpointed = e.move(f"X:{b}", gpu, d.checkpoint)
        if state(b) and d.params != "gpu":
            k = streamed.index(b)
            gate = frees_fwd.get(streamed[k - 1 - decisions.prefetch]) if k - 1 - decisions.prefetch >= 0 else None
            p_ready = load_state(b, gate, checkpointed, for_update=b == last_fwd)
        foreign = load_foreign(b)
        acts, _ = activation_buffers(b, has)
        allocs = list(acts) if d.activations != "recompute" else []
        nxt = order[order.index(b) + 1] if b != last_fwd else None
        if nxt and has(f"X:{nxt}"):
            allocs.append(f"X:{nxt}")
        # Back-pressure: a forward may run at most prefetch+1 blocks ahead of the swap-outs.
        k_fwd = order.index(b)
        gate_swap = swap_outs.get(order[k_fwd - 2 - decisions.prefetch]) if k_fwd - 2 - decisions.prefetch >= 0 else None
        c = e.emit("compute", comp, (p_ready, gate_swap, checkpointed, *foreign), segment=f"fwd:{b}",
                   allocs=tuple(allocs), workspace=f"W:fwd:{b}" if has(f"W:fwd:{b}") else "")
        release_foreign(c)
        for a in allocs:
            e.where[(a, gpu)] = c
        if state(b) and d.params != "gpu" and b != last_fwd:
            frees_fwd[b] = free_state(b, c)
        if d.activations in ("swap_dram", "swap_ssd"):
            for x in acts:
                s = e.move(x, gpu, "dram" if d.activations == "swap_dram" else "ssd", (c,))
                swap_outs[b] = e.free(x, gpu, (s,))
        if has(f"X:{b}") and d.checkpoint != "gpu":
            s = checkpointed if checkpointed is not None else e.move(f"X:{b}", gpu, d.checkpoint, (c,))
            f = e.free(f"X:{b}", gpu, (s, c))
            swap_outs[b] = max(f, swap_outs.get(b, f))

    # ---- backward (+ optimizer) -------------------------------------------------------------
    bwd_order = list(reversed(order))
    frees_bwd: dict[str, int] = {}
    bwd_streamed = [b for b in bwd_order if b in streamed]
    grads_ready: dict[str, int] = {}
    cpu_grads: list[str] = []
    g_freed: dict[str, int] = {}
    prev_write = [None]

    writes: list[int] = []
    overlap = decisions.overlap_optimizer and not loss_scaling

    def opt_step(b: str, start: tuple) -> None:
        """One subgroup's update: bring its states to the device, update, write results home."""
        d = dec[b]
        if decisions.serialize_optimizer:
            start = (*start, prev_write[0])
        elif loss_scaling and len(writes) >= 2:
            start = (*start, writes[-2])
        dev = "cpu" if d.optimizer == "cpu" else gpu
        tier = "dram" if dev == "cpu" else gpu
        states = [s for s in (f"M:{b}", f"OS:{b}") if has(s)]
        p_here = not mixed  # fp32: P is the master and is updated in place
        ready = list(start)
        # Overlapped: read the states while the block's backward still runs (Fuyou §4.3);
        # only the serialized baseline waits for the gradient before reading.
        read_after = start[1:] if decisions.overlap_optimizer else start
        for s in states + ([f"P:{b}"] if p_here or home[f"P:{b}"] == tier else []):
            if home[s] != tier and (s, tier) not in e.where:
                ready.append(e.move(s, home[s], tier, read_after))
            elif home[s] != tier:  # kept from the backward's load (keep_params_for_update)
                ready.append(e.where[(s, tier)])
        if decisions.swap_grads and dev == "cpu":  # the gradient comes back from SSD with the states
            g_in = e.move(f"G:{b}", "ssd", "dram", start)
            e.free(f"G:{b}", "ssd", (g_in,))
            ready.append(g_in)
        fresh = (f"P:{b}",) if mixed and home[f"P:{b}"] != tier else ()
        u = e.emit("optimizer_step", "cpu.opt" if dev == "cpu" else comp, tuple(ready), segment=b,
                   dst=dev, allocs=fresh, workspace=f"W:opt:{b}" if has(f"W:opt:{b}") else "")
        g_freed[b] = e.free(f"G:{b}", tier, (u,))
        last = u
        for s in states + [f"P:{b}"]:
            if home[s] == tier:
                continue
            if s in carried:  # stays in DRAM: the next step writes it home
                e.where[(s, tier)] = u
                continue
            if s == f"P:{b}" and mixed:
                # LoHan Table II: the optimizer produces P16 from P32; send it to P's home.
                last = write_new(e, s, tier, home[s], u, gpu)
            else:
                last = e.move(s, tier, home[s], (u,))
                e.free(s, tier, (last,))
        prev_write[0] = last
        writes.append(last)

    carry_until = {b: prof[profile_of[b]].carried_until for b in order if has(f"T:{b}")}
    handed_to = {order[order.index(b) - 1]: f"H:{b}" for b in order[1:] if has(f"H:{b}")}
    held = None  # blocking_copies: what the next backward waits for
    room = None  # a cut backward's release of its early part: the next swapped block's load waits for it
    for b in bwd_order:
        d = dec[b]
        if prof[profile_of[b]].bwd_ops[0] < 0:
            continue  # nothing below needs a gradient and nothing here trains (frozen embeddings)
        deps = [held] if held is not None else []
        x_in = flushed = None
        if decisions.blocking_copies and has(f"X:{b}") and d.checkpoint != "gpu":  # first, as b's backward starts
            x_in = e.move(f"X:{b}", d.checkpoint, gpu, (held,))
        if state(b) and d.params != "gpu" and b != last_fwd:
            k = bwd_streamed.index(b)
            gate = frees_bwd.get(bwd_streamed[k - 1 - decisions.prefetch]) if k - 1 - decisions.prefetch >= 0 else None
            deps.append(load_state(b, gate, x_in, for_update=True))
        deps += load_foreign(b)
        if has(f"X:{b}") and d.checkpoint != "gpu":
            deps.append(x_in if x_in is not None else e.move(f"X:{b}", d.checkpoint, gpu))
        acts, rests = activation_buffers(b, has)
        if acts:
            if d.activations in ("swap_dram", "swap_ssd"):
                src = "dram" if d.activations == "swap_dram" else "ssd"
                for x in acts:
                    if room is None:
                        deps.append(e.move(x, src, gpu))
                    else:  # into the room the cut backward before this one left: the DRAM hop waits for it
                        if src == "ssd":
                            e.move(x, "ssd", "dram")
                        deps.append(e.move(x, "dram", gpu, (room,)))
                        if src == "ssd":
                            e.free(x, "dram", (deps[-1],))
                    e.free(x, src, (deps[-1],))
                if rests:  # the rest of what the backward reads, made again from X and A
                    deps.append(e.emit("recompute", comp, tuple(deps), segment=f"refwd:{b}", allocs=tuple(rests),
                                       workspace=f"W:refwd:{b}" if has(f"W:refwd:{b}") else ""))
            elif d.activations == "recompute":
                r = e.emit("recompute", comp, tuple(deps), segment=f"fwd:{b}", allocs=tuple(acts),
                           workspace=f"W:fwd:{b}" if has(f"W:fwd:{b}") else "")
                deps.append(r)
        if has(f"X:{b}") and d.checkpoint != "gpu":
            e.free(f"X:{b}", d.checkpoint, (deps[-1] if deps else None,))
        allocs = tuple(x for x in (f"G:{b}", f"T:{b}", f"H:{b}") if has(x))
        if decisions.grad_buffers and has(f"G:{b}") and d.optimizer == "cpu":
            if len(cpu_grads) >= decisions.grad_buffers and overlap:
                deps.append(g_freed[cpu_grads[-decisions.grad_buffers]])
            cpu_grads.append(b)
        room = None
        if split_backward(prof[profile_of[b]], d):  # LoHan §IV-D: release what only the first part reads
            c1 = e.emit("compute", comp, tuple(deps), segment=f"bwd1:{b}", allocs=(f"K:{b}",) if has(f"K:{b}") else (),
                        workspace=f"W:bwd1:{b}" if has(f"W:bwd1:{b}") else "")
            room = c1
            for x in (f"AE:{b}", f"RE:{b}"):
                if has(x):
                    room = e.free(x, gpu, (c1,))
            c = e.emit("compute", comp, (c1,), segment=f"bwd2:{b}", allocs=allocs,
                       workspace=f"W:bwd2:{b}" if has(f"W:bwd2:{b}") else "")
            if has(f"K:{b}"):
                e.free(f"K:{b}", gpu, (c,))
        else:
            c = e.emit("compute", comp, tuple(deps), segment=f"bwd:{b}", allocs=allocs,
                       workspace=f"W:bwd:{b}" if has(f"W:bwd:{b}") else "")
        release_foreign(c)
        for a in allocs:
            e.where[(a, gpu)] = c
        for x in (f"A:{b}", f"R:{b}", f"X:{b}"):
            if has(x):
                e.free(x, gpu, (c,))
        for t in sorted(t for t, until in carry_until.items() if until == profile_of[b]):
            e.free(f"T:{t}", gpu, (c,))
            del carry_until[t]
        if b in handed_to:  # the gradient the next block's backward handed to this one
            e.free(handed_to.pop(b), gpu, (c,))
        if state(b) and d.params != "gpu":
            frees_bwd[b] = free_state(b, c)
        if has(f"G:{b}"):
            if d.optimizer == "cpu":
                s = e.move(f"G:{b}", gpu, "dram", (c,))
                e.free(f"G:{b}", gpu, (s,))
                flushed = s
                if decisions.swap_grads:
                    s = e.move(f"G:{b}", "dram", "ssd", (s,))
                    e.free(f"G:{b}", "dram", (s,))
                grads_ready[b] = s
            else:
                grads_ready[b] = c
            if overlap:
                opt_step(b, (grads_ready[b],))
        if decisions.blocking_copies:  # the gradient's copy to DRAM, else the backward itself
            held = flushed if flushed is not None else c
    if not overlap:
        last_bwd = len(e.instrs) - 1
        for b in bwd_order:
            if has(f"G:{b}"):
                opt_step(b, (grads_ready[b], last_bwd))
    return e.instrs


def write_new(e: Emitter, buf: str, at: str, home: str, after: int, gpu: str) -> int:
    """The optimizer wrote a fresh copy of `buf` on tier `at`; move it home and drop the rest."""
    e.where[(buf, at)] = after
    w = e.move(buf, at, home, (after,))
    e.free(buf, at, (w,))
    return w
