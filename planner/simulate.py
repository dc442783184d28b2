"""Discrete-event replay of a plan's instruction list over the machine's resources.

The executor and the simulator interpret the very same instructions: here each one takes
its modeled duration (planner/cost.py). Streams are FIFO in program order (like CUDA
streams); an instruction starts when its stream is free, every instruction it depends on
has finished, and each of its resources has a free slot. Resources: each GPU's compute, H2D
and D2H engines, the SSDs (one simplex resource shared by reads and writes; a read on
`ssd.first` pauses the write in progress, `reads_ssd_first`), the CPU
optimizer; and shared links (`contention`): the uplink of each CPU root complex, per direction,
whose GPUs share its bandwidth (Mobius §3.3), and DRAM, which every host transfer crosses. A
shared link has as many slots as full-rate transfers fit in its bandwidth, so the transfers
running on it never add up to more than its bandwidth.

Memory: every (buffer, tier) pair is either present or not. Compute allocates its outputs
when it starts and its workspace while it runs; a load/store allocates the destination
copy when it starts (overwriting a copy already there costs nothing); `free` releases.
Buffers with a home tier are present at the start and must be present, alone, at the end.
"""
from __future__ import annotations

import bisect
import heapq
import json
import operator
from dataclasses import dataclass, field

from tensorstow.ir.graph import lsum
from tensorstow.planner.cost import commit_time
from tensorstow.schema.hardware import CPU_GPU_NAME
from tensorstow.schema.schedule import (CPU_OPTIMIZER, UNIT, BufferKind, Instr, InstrKind, Stream, block_of,
                                        buffer_kind, final_residency, gpu_index, initial_residency, is_gpu,
                                        parent_of, resource_of)


class ScheduleError(Exception):
    """The instruction list is inconsistent (a planner bug, not bad user input)."""


@dataclass
class SimResult:
    step_time_s: float
    start: list[float]
    end: list[float]
    busy_s: dict[str, float]
    traffic_bytes: dict[str, int]
    peak_bytes: dict[str, int]
    timeline: dict[str, list[tuple[float, int]]]
    """Per tier: (time, bytes live from then on), one point per change (several may share a time)."""
    order: list[int] = field(default_factory=list)
    """Instruction ids in the order they started."""
    peak_live: dict[str, list[str]] = field(default_factory=dict)
    """Per tier: the buffers live at its peak (for byte breakdowns)."""
    durations: list[float] = field(default_factory=list)
    """What each instruction took in the replay: its duration, stretched where `slowdown` applied."""
    fences: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Memory fences: for each instruction that allocates, the latest release per stream (earlier
    in program order) that preceded its allocation in this replay. Adding them as dependencies
    bounds real memory by the simulated peak under any timing, and changes no simulated time."""
    waited: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """With `capacity`: each copy that waited for room, and the instructions before it in program
    order that it let allocate first (made dependencies, they keep it from running ahead of them)."""

    @property
    def bottleneck(self) -> str:
        return max(sorted(self.busy_s), key=lambda r: self.busy_s[r])


HOST_CORE = "host.core"
"""The shared link of a process with one core and the CPU as its device tier (`contention`)."""


def on_one_core(hw) -> bool:
    """Whether the plan runs in one process with one core and the CPU as its device tier (a
    data-parallel rank's share of a small machine): its computations, copies between DRAM and the
    device tier, optimizer steps and collectives all run on that core. (Several CPU devices on one
    core, a pipeline's, already share its rates: `GPU.shared_by`.)"""
    return hw.cpu.cores == 1 and len(hw.gpus) == 1 and hw.gpus[0].name == CPU_GPU_NAME


def _host_work(ins: Instr) -> bool:
    """An instruction a CPU device tier's process runs on its cores (not the SSD's transfers, which
    the disk paces)."""
    if ins.kind in (InstrKind.LOAD, InstrKind.STORE):
        return "ssd" not in (ins.src, ins.dst)
    return ins.kind in (InstrKind.COMPUTE, InstrKind.RECOMPUTE, InstrKind.OPTIMIZER_STEP, InstrKind.REDUCE,
                        InstrKind.GATHER, InstrKind.SEND)


def contention(instrs: list[Instr], hw) -> tuple[list[tuple[str, ...]], dict[str, int]]:
    """Per instruction, the shared links it occupies besides its stream's engine, and each shared
    link's slots. A GPU <-> DRAM copy crosses its root complex's uplink (when the spec bounds it:
    `root_complex_bw`) and DRAM; a GPU -> GPU send without P2P goes through DRAM, so it takes the
    sender's D2H engine and uplink and the receiver's H2D engine and uplink; SSD I/O crosses DRAM.
    A process with one core and the CPU as its device tier (`on_one_core`) runs its host work one
    instruction at a time on HOST_CORE: its overlap mode's lanes share the core (where two ranks
    shared a 2-core VM, their overlapped steps ran 1.56x a prediction that let them run side by
    side, 1.04-1.10x one that does not, benchmarks/RESULTS.md "Data parallel")."""
    rc_bw, gpus = hw.root_complex_bw, hw.gpus
    slots: dict[str, int] = {HOST_CORE: 1} if on_one_core(hw) else {}
    if rc_bw:
        for rc in sorted({g.root_complex for g in gpus}):
            rate = min(rc_bw, max(max(g.h2d_bw, g.d2h_bw) for g in gpus if g.root_complex == rc))
            slots[f"rc{rc}.h2d"] = slots[f"rc{rc}.d2h"] = max(1, int(rc_bw / rate + 1e-9))
    rates = [r for g in gpus for r in (g.h2d_bw, g.d2h_bw)] + [hw.ssd.read_total(), hw.ssd.write_total()]
    if hw.dram.bandwidth:
        slots["dram"] = max(1, int(hw.dram.bandwidth / max(rates) + 1e-9))
    dram = ("dram",) if "dram" in slots else ()

    def up(k: int, way: str) -> tuple[str, ...]:
        return (f"rc{gpus[k].root_complex}.{way}",) if rc_bw else ()

    def links(ins: Instr) -> tuple[str, ...]:
        x: tuple[str, ...] = ()
        if ins.kind == InstrKind.SEND and not hw.gpu_p2p_bw:
            a, b = gpu_index(ins.src), gpu_index(ins.dst)
            x = (f"{ins.src}.d2h", f"{ins.dst}.h2d", *up(a, "d2h"), *up(b, "h2d"), *dram)
        elif ins.kind in (InstrKind.LOAD, InstrKind.STORE) and "ssd" in (ins.src, ins.dst):
            x = dram
        elif ins.kind in (InstrKind.LOAD, InstrKind.STORE):
            g, way = (ins.dst, "h2d") if is_gpu(ins.dst) else (ins.src, "d2h")
            x = (*up(gpu_index(g), way), *dram)
        if HOST_CORE in slots and _host_work(ins):
            x = (*x, HOST_CORE)
        return x

    extra, known = [], {}  # (kind, src, dst) -> the links of such an instruction
    for ins in instrs:
        key = (ins.kind, ins.src, ins.dst)
        x = known.get(key)
        if x is None:
            x = known[key] = links(ins)
        extra.append(x)
    return extra, slots


def simulate(instrs: list[Instr], duration: list[float], nbytes: dict[str, int],
             initial: dict[tuple[str, str], None] | set,
             links: tuple[list[tuple[str, ...]], dict[str, int]] | None = None,
             reserved: dict[str, int] | None = None, commit_s: float = 0.0,
             slowdown: dict[str, tuple[float, float]] | None = None,
             capacity: dict[str, int] | None = None, final: set | None = None) -> SimResult:
    """Replay `instrs` with `duration[i]` seconds each.

    nbytes: buffer -> bytes. initial: the (buffer, tier) pairs present at the start. links:
    `contention()`'s shared links per instruction and their slots (default: none). reserved:
    tier -> bytes held all step outside the plan's buffers (`Decisions.reserved()`). commit_s: the
    SSD store's commit (`cost.commit_time`). A plan on one GPU runs in one process, whose executor
    commits without waiting (`SSDStore.commit(wait=False)`): in the steady state the previous
    step's commit runs from this step's start, beside the instructions, and the first write to the
    SSD waits for it (busy as "ssd.commit"). A plan across GPUs runs one process per GPU, which
    commit, then wait for each other: there it runs after the last instruction, on the SSD.
    slowdown: compute stream -> how much slower its instructions run while a copy, or else an SSD
    transfer, runs beside them (`GPU.host_contention`, `GPU.ssd_contention`, `compute_slowdown`):
    the replay runs once, then again with each computation stretched by those times the shares of
    its time copies and (only) SSD transfers overlapped.
    capacity: tier -> bytes. Given, a copy waits for room on its destination tier (Fuyou §4.4's
    GPU-memory-aware FIFO prefetch): it starts only when the bytes live there, the copy's and what
    the instructions before it in program order that have not started will allocate there fit
    (those come first: a prefetch must not take the memory of the computation it runs ahead of).
    The copies that waited are in `SimResult.waited`. Where nothing could free room, the copy
    starts anyway and the peak shows the overflow.
    final: the (buffer, tier) pairs present at the end, where not `initial` (a speculating step
    ends with the gradients it keeps for its redo: `schema.schedule.final_residency`).

    The replay's parts: `_Dispatch` (the event loop over streams and resources), `_usage` (busy
    time and traffic per resource), `_memory_events` and `_Ledger` (bytes live per tier, the peaks,
    the memory fences), and the commit that ends the step.
    """
    n = len(instrs)
    for ins in instrs:
        for d in ins.deps:
            if not 0 <= d < n or d == ins.id:
                raise ScheduleError(f"instruction {ins.id} depends on invalid id {d}")
    extra, slots = links or ([()] * n, {})
    if any(i.kind == InstrKind.COMMIT for i in instrs):
        commit_s = 0.0  # the plan commits the previous step itself, where its state is whole on SSD
    background = commit_background(instrs)
    resource = {s: resource_of(s) for s in {ins.stream for ins in instrs}}
    uses = [(resource[ins.stream], *x) for ins, x in zip(instrs, extra)]
    mem = _Memory(instrs, nbytes, initial, reserved, capacity) if capacity else None
    dispatch = _Dispatch(instrs, uses, slots, mem, ssd_write_after=commit_s if background else 0.0)

    start, end, order = dispatch.run(duration)
    stretched = _stretched(instrs, duration, start, end, slowdown)
    if stretched is not None:
        duration = stretched
        start, end, order = dispatch.run(duration)

    busy, traffic = _usage(instrs, duration, uses, extra, slots, nbytes)
    ledger = _Ledger(instrs, nbytes, initial, reserved, final)
    ledger.replay(_memory_events(instrs, order, start, end))
    if background:
        makespan = max([commit_s, *end])
        if commit_s:
            busy["ssd.commit"] = commit_s
    else:
        makespan = max((e for e in end), default=0.0) + commit_s
        if commit_s:
            busy["ssd"] = busy.get("ssd", 0.0) + commit_s
    return SimResult(step_time_s=makespan, start=start, end=end, busy_s=busy, traffic_bytes=traffic,
                     peak_bytes=ledger.peak, timeline=ledger.timeline, order=order, peak_live=ledger.peak_live,
                     durations=list(duration),
                     fences={i: tuple(sorted(f)) for i, f in sorted(ledger.fences.items()) if f},
                     waited={i: tuple(sorted(w)) for i, w in sorted(mem.waited.items())} if mem else {})


class _Dispatch:
    """The event loop: instructions start in start-time order, each at the head of its stream once
    the stream is free, its dependencies have ended and each resource it uses (`uses`) has a free
    slot. SSD reads and writes share the SSD's slot, but a read on `ssd.first` pauses the write in
    progress (`reads_ssd_first`), which then ends later by the read's time; an SSD write waits for
    the background commit (`ssd_write_after`). With `mem` (`simulate`'s capacity) a copy also waits
    for room.

    A stream's head keeps its candidate (earliest start, instruction, stream) until a dispatch
    changes what that depends on: its stream, a dependency's end, or the slots of a resource it
    uses (`changed`); only the heads that changes are worked out again."""

    def __init__(self, instrs: list[Instr], uses: list[tuple[str, ...]], slots: dict[str, int],
                 mem: _Memory | None, ssd_write_after: float):
        self.instrs, self.uses, self.slots, self.mem = instrs, uses, slots, mem
        self.ssd_write_after = ssd_write_after
        """When SSD writes may start: after the background commit of the previous step (0: none)."""
        self.streams: dict[str, list[int]] = {}
        """Stream -> its instructions in program order (FIFO)."""
        self.dependents: dict[int, list[int]] = {}
        """Instruction -> the instructions that depend on it, where some do."""
        for ins in instrs:
            self.streams.setdefault(ins.stream, []).append(ins.id)
            for d in ins.deps:
                self.dependents.setdefault(d, []).append(ins.id)
        self.names = sorted(self.streams)
        self.users: dict[str, set[str]] = {}
        """Resource -> the streams with an instruction that uses it."""
        for s, u in {(ins.stream, u) for ins, u in zip(instrs, uses)}:
            for r in u:
                self.users.setdefault(r, set()).add(s)
        split = {u: (tuple(r for r in u if r != "ssd"), "ssd" in u) for u in set(uses)}
        ssd = {}  # (kind, stream, dst) -> (`reads_ssd_first`, `writes_ssd`) of such an instruction
        for ins in instrs:
            if (ins.kind, ins.stream, ins.dst) not in ssd:
                ssd[ins.kind, ins.stream, ins.dst] = (reads_ssd_first(ins), writes_ssd(ins))
        self.waits = [(ins.deps, *split[u], *ssd[ins.kind, ins.stream, ins.dst]) for ins, u in zip(instrs, uses)]
        """Per instruction, what `ready_time` reads of it: its dependencies, the resources it uses
        but the SSD, whether it uses the SSD, reads on `ssd.first`, writes to the SSD."""

    def run(self, duration: list[float]) -> tuple[list, list, list[int]]:
        """(start, end, dispatch order) of every instruction."""
        n = len(self.instrs)
        if self.mem is not None:
            self.mem.reset()
        self.head = {s: 0 for s in self.streams}
        """Stream -> the position of its next instruction."""
        self.cand: dict[str, tuple[float, int, str]] = {}
        """Stream -> its head's candidate, where its dependencies have started (`candidates`)."""
        self.stale = set(self.names)
        """Streams whose head's candidate is worked out again before the next dispatch."""
        self.stream_free = {s: 0.0 for s in self.streams}
        """Stream -> when its last started instruction ends."""
        self.res_free: dict[str, list[float]] = {r: [0.0] * k for r, k in self.slots.items()}
        """Resource -> when each of its slots is free."""
        self.end: list = [None] * n
        self.start: list = [None] * n
        self.order: list[int] = []
        self.writing = None
        """The SSD write last started (reads may pause it)."""
        self.reads_until = 0.0
        """The end of the last read that paused it."""
        now = 0.0  # start of the last instruction dispatched (dispatch is in start-time order)
        cand = self.cand
        for _ in range(n):
            self.candidates()
            if not cand:
                stuck = sorted(ids[self.head[s]] for s, ids in self.streams.items() if self.head[s] < len(ids))
                raise ScheduleError(f"deadlock: instructions {stuck[:8]} wait on each other")
            if self.mem is not None:
                best = self.mem.pick(sorted(cand.values()), now)
            else:
                best = min(cand.values())
            t, i, s = best
            now = t
            self.dispatch(t, i, s, duration)
        return self.start, self.end, self.order

    def candidates(self) -> None:
        """Work out again the (earliest start, instruction, stream) of each stale stream's head, a
        candidate where its dependencies have ended."""
        cand, end, streams, head, waits = self.cand, self.end, self.streams, self.head, self.waits
        for s in self.stale:
            cand.pop(s, None)
            ids = streams[s]
            if head[s] == len(ids):
                continue  # done
            i = ids[head[s]]
            for d in waits[i][0]:
                if end[d] is None:
                    break
            else:
                cand[s] = (self.ready_time(i, s), i, s)
        self.stale.clear()

    def ready_time(self, i: int, s: str) -> float:
        """When instruction i, the head of stream s, can start: its stream free, its dependencies
        ended, a slot of each resource free; on the SSD, a read on `ssd.first` may go inside the
        write in progress (pausing it) rather than after it."""
        deps, others, on_ssd, reads_first, writes = self.waits[i]
        end, res_free = self.end, self.res_free
        t = self.stream_free[s]
        for d in deps:
            if end[d] > t:
                t = end[d]
        for r in others:
            free = min(res_free.get(r, (0.0,)))
            if free > t:
                t = free
        if on_ssd:
            ssd = min(res_free.get("ssd", (0.0,)))
            w = self.writing
            if reads_first and w is not None and end[w] == ssd and self.start[w] <= t < ssd:
                t = max(t, self.reads_until)  # pauses the write (the aio engine runs it first)
            else:
                t = max(t, ssd)
        if writes:  # over the files the background commit is syncing
            t = max(t, self.ssd_write_after)
        return t

    def dispatch(self, t: float, i: int, s: str, duration: list[float]) -> None:
        """Start instruction i of stream s at t: its stream and a slot of each resource it uses are
        busy until it ends; a read on `ssd.first` that starts inside a write pauses it."""
        start, end, w, res_free = self.start, self.end, self.writing, self.res_free
        start[i] = t
        end[i] = done = t + duration[i]
        self.stream_free[s] = done
        _, _, _, reads_first, writes = self.waits[i]
        paused = reads_first and w is not None and t < end[w]
        if paused:  # the write finishes later by the read's time, on every resource it holds
            old, end[w] = end[w], end[w] + duration[i]
            self.stream_free[self.instrs[w].stream] = end[w]
            for r in self.uses[w]:
                free = res_free[r]
                free[free.index(old)] = end[w]
            self.reads_until = done
            self.changed(w)
        for r in self.uses[i]:
            if not (paused and r == "ssd"):  # a pausing read runs inside the write's SSD slot
                free = res_free.get(r)
                if free is None:
                    free = res_free[r] = [0.0]
                free[free.index(min(free))] = done
        if writes:
            self.writing = i
        if self.mem is not None:
            self.mem.start(i, t, done)
        self.head[s] += 1
        self.changed(i)
        self.order.append(i)

    def changed(self, i: int) -> None:
        """Instruction i started or its end moved: the heads on its stream, on a resource it uses
        or that wait on it are worked out again."""
        stale, instrs, users = self.stale, self.instrs, self.users
        stale.add(instrs[i].stream)
        for r in self.uses[i]:
            stale |= users[r]
        for j in self.dependents.get(i, ()):
            stale.add(instrs[j].stream)


def _usage(instrs: list[Instr], duration: list[float], uses: list[tuple[str, ...]], extra: list[tuple[str, ...]],
           slots: dict[str, int], nbytes: dict[str, int]) -> tuple[dict[str, float], dict[str, int]]:
    """(busy seconds per resource, bytes per copy direction and per root-complex link). A shared
    link's busy time is per slot; DRAM's is not reported."""
    busy: dict[str, float] = {}
    traffic: dict[str, int] = {}
    busied = {u: tuple((r, slots.get(r, 1)) for r in u if r != "dram") for u in set(uses)}
    crossed: dict[tuple, tuple[str, ...]] = {}  # (src, dst, links) -> the traffic keys of such a copy
    for ins in instrs:
        for r, k in busied[uses[ins.id]]:
            busy[r] = busy.get(r, 0.0) + duration[ins.id] / k
        if ins.kind in (InstrKind.LOAD, InstrKind.STORE, InstrKind.SEND):
            way = (ins.src, ins.dst, extra[ins.id])
            keys = crossed.get(way)
            if keys is None:
                keys = crossed[way] = (f"{ins.src}->{ins.dst}", *(r for r in extra[ins.id] if r.startswith("rc")))
            for key in keys:
                traffic[key] = traffic.get(key, 0) + nbytes[ins.tensor]
    return busy, traffic


def _memory_events(instrs: list[Instr], order: list[int], start: list, end: list) -> list[tuple]:
    """The replay's memory events in causal order, each ((time, rank, rank), what, buffer, tier,
    source tier, instruction): at one instant, workspaces of instructions that ended are released
    first, then instructions start in dispatch order (a dependent instruction is always dispatched
    after what it depends on); a zero-length instruction releases its workspace right after it
    starts."""
    events = []
    add = events.append
    devices: dict[str, str] = {}  # stream -> `_device_tier` of its instructions
    for k, i in enumerate(order):
        ins = instrs[i]
        at = (start[i], k, 0)
        if ins.kind == InstrKind.FREE:
            add((at, "free", ins.tensor, ins.dst, None, i))
        if ins.allocs or ins.workspace:
            dev = devices.get(ins.stream)
            if dev is None:
                dev = devices[ins.stream] = _device_tier(ins)
            for a in ins.allocs:
                add((at, "alloc", a, dev, None, i))
        if ins.kind in (InstrKind.LOAD, InstrKind.STORE, InstrKind.SEND):
            add((at, "copy", ins.tensor, ins.dst, ins.src, i))
        if ins.workspace:
            add((at, "alloc", ins.workspace, dev, None, i))
            key = (end[i], k, 1) if end[i] == start[i] else (end[i], -1, k)
            add((key, "free", ins.workspace, dev, None, i))
    events.sort(key=operator.itemgetter(0))
    return events


class _Joined:
    """Bytes a buffer takes on a tier: its own, but for a unit's rows of a weight or of its gradient
    on a GPU (`schema.schedule.UNIT`, P:/G:<b>/x<k>), which the device holds whole: the first of a
    block's row buffers there takes the whole, the last one released gives it back."""

    def __init__(self, nbytes: dict[str, int]):
        self.nbytes = nbytes
        self.group: dict[str, str] = {}
        self.total: dict[str, int] = {}
        for b, n in nbytes.items():
            if UNIT not in b:
                continue
            blk = block_of(b)
            if UNIT in blk and buffer_kind(b) in (BufferKind.P, BufferKind.G):
                g = self.group[b] = f"{buffer_kind(b)}:{parent_of(blk)}"
                self.total[g] = self.total.get(g, 0) + n
        self.count: dict[tuple[str, str], int] = {}

    def need(self, buf: str, tier: str) -> int:
        """What `add` would count."""
        g = self.group.get(buf)
        if g is None or not is_gpu(tier):
            return self.nbytes[buf]
        return 0 if self.count.get((g, tier)) else self.total[g]

    def add(self, buf: str, tier: str) -> int:
        """What `need` counts, and the buffer is there."""
        n = self.need(buf, tier)
        g = self.group.get(buf)
        if g is not None and is_gpu(tier):
            self.count[g, tier] = self.count.get((g, tier), 0) + 1
        return n

    def remove(self, buf: str, tier: str) -> int:
        g = self.group.get(buf)
        if g is None or not is_gpu(tier):
            return self.nbytes[buf]
        self.count[g, tier] -= 1
        return 0 if self.count[g, tier] else self.total[g]


class _Ledger:
    """Bytes live per tier as `simulate`'s memory events replay (`_memory_events`): the peaks, what
    is live at them, the timeline and the memory fences; it checks that every copy is made from a
    present one, nothing is allocated twice, and the step ends where it began."""

    def __init__(self, instrs: list[Instr], nbytes: dict[str, int], initial, reserved: dict[str, int] | None,
                 final=None):
        self.instrs, self.nbytes, self.initial = instrs, nbytes, initial
        self.final = set(initial if final is None else final)
        """What is present when the step ends."""
        self.live = set(initial)
        """The (buffer, tier) pairs present."""
        self.use: dict[str, int] = {t: v for t, v in (reserved or {}).items() if v}
        """Tier -> bytes live there (reserved bytes included)."""
        self.joined = _Joined(nbytes)
        for (b, t) in sorted(self.live):
            self.use[t] = self.use.get(t, 0) + self.joined.add(b, t)
        self.peak = dict(self.use)
        """Tier -> its peak bytes."""
        self.peak_live: dict[str, list[str]] = {}
        """Tier -> the buffers live at its peak, once `replay` has ended."""
        self.changes: dict[str, list[tuple[bool, str]]] = {}
        """Tier -> (added, buffer) per change of what is live there, in replay order."""
        self.peak_at = {t: 0 for t in self.use}
        """Tier -> how many of its `changes` had happened at its peak: what is live at a peak is
        worked out once, from those, rather than listed at every new peak."""
        self.timeline = {t: [(0.0, v)] for t, v in self.use.items()}
        """Tier -> (time, bytes live from then on), one point per change."""
        self.fences: dict[int, set[int]] = {}
        """Allocating instruction -> the latest release per stream before it (`SimResult.fences`)."""
        self.last_release: dict[str, dict[str, int]] = {}
        """Tier -> stream -> the latest instruction that released bytes there."""

    def replay(self, events: list[tuple]) -> None:
        """Apply the events in order, then check the step ended where it should (`final`). A
        release is recorded per stream; an allocation fences on the latest ones before it (`fence`)."""
        timeline, use, last_release, instrs = self.timeline, self.use, self.last_release, self.instrs
        for key, what, buf, tier, src, owner in events:
            if what == "free":
                releases = last_release.get(tier)
                if releases is None:
                    releases = last_release[tier] = {}
                releases[instrs[owner].stream] = owner
                self.release(buf, tier)
            else:
                if tier in last_release:
                    self.fence(tier, owner)
                if not self.make(what, buf, tier, src):
                    continue  # overwrite in place
            line = timeline.get(tier)
            if line is None:
                line = timeline[tier] = [(0.0, 0)]
            line.append((key[0], use[tier]))
        leftover = sorted(self.live - self.final)
        missing = sorted(self.final - self.live)
        if leftover or missing:
            raise ScheduleError(f"the step does not end in its final state: left {leftover[:5]}, "
                                f"lost {missing[:5]}")
        for t, k in self.peak_at.items():
            live = {b for b, tt in self.initial if tt == t}
            for added, b in self.changes.get(t, [])[:k]:
                if added:
                    live.add(b)
                else:
                    live.remove(b)
            self.peak_live[t] = sorted(live)

    def fence(self, tier: str, owner: int) -> None:
        """An allocation on `tier` by instruction `owner` fences on the latest release per stream
        there before it in program order that it does not already depend on."""
        deps = self.instrs[owner].deps
        fences = [r for r in self.last_release[tier].values() if r < owner and r not in deps]
        if fences:
            self.fences.setdefault(owner, set()).update(fences)

    def release(self, buf: str, tier: str) -> None:
        """A free: the copy must be there."""
        if (buf, tier) not in self.live:
            raise ScheduleError(f"free of {buf} on {tier}, which does not hold it")
        self.live.remove((buf, tier))
        self.use[tier] -= self.joined.remove(buf, tier)
        self.changes.setdefault(tier, []).append((False, buf))

    def make(self, what: str, buf: str, tier: str, src: str | None) -> bool:
        """An allocation or a copy's destination: False where the copy overwrites one already there."""
        if what == "copy" and (buf, src) not in self.live:
            raise ScheduleError(f"{buf} moved from {src}, which does not hold it")
        if (buf, tier) in self.live:
            if what == "alloc":
                raise ScheduleError(f"{buf} allocated twice on {tier}")
            return False
        self.live.add((buf, tier))
        self.use[tier] = self.use.get(tier, 0) + self.joined.add(buf, tier)
        changes = self.changes.setdefault(tier, [])
        changes.append((True, buf))
        if self.use[tier] > self.peak.get(tier, -1) or tier not in self.peak_at:
            self.peak[tier] = self.use[tier]
            self.peak_at[tier] = len(changes)
        return True


def simulate_plan(plan) -> SimResult:
    """Replay a plan file (`schema.plan.Plan`) as written: its instructions with their
    `est_s` (+ `contended_s`), its buffers' bytes, the homes as the initial placement, its
    hardware's links (a data-parallel rank's: its share of the machine)."""
    from tensorstow.planner.problem import data_parallel_share
    order = [b.name for b in plan.model.blocks]
    initial = initial_residency(dict(plan.buffers), plan.decisions, order)
    instrs = list(plan.instructions)
    hw = plan.hardware.spec  # a data-parallel plan's: the machine, whose ranks each have a share of it
    hw = data_parallel_share(plan.options, hw) if plan.options.dp > 1 else hw
    return simulate(instrs, [i.est_s + i.contended_s for i in instrs], {n: b.bytes for n, b in plan.buffers.items()},
                    initial, links=contention(instrs, hw), reserved=plan.decisions.reserved(),
                    commit_s=plan_commit_s(plan), final=final_residency(dict(plan.buffers), plan.decisions, order))


def compute_slowdown(hw) -> dict[str, tuple[float, float]]:
    """Compute stream -> (`GPU.host_contention`, `GPU.ssd_contention`) of its device, where either
    is not 0 (the CPU device tier): `simulate`'s `slowdown`."""
    return {f"gpu{k}.compute": (g.host_contention, g.ssd_contention) for k, g in enumerate(hw.gpus)
            if g.host_contention > 0 or g.ssd_contention > 0}


def host_traffic(ins: Instr) -> bool:
    """Whether an instruction streams host memory beside the computation: a copy between tiers or
    an SSD transfer (its staging, checksum and the disk's DMA). Not the CPU optimizer: Adam on the
    other core slowed the CPU device tier's block by 1%, a copy loop by 13-18% (RESULTS.md)."""
    return ins.kind in (InstrKind.LOAD, InstrKind.STORE, InstrKind.SEND)


def _is_ssd(ins: Instr) -> bool:
    return ins.src == "ssd" or ins.dst == "ssd"


def _spans(instrs: list[Instr], start: list, end: list, keep) -> tuple[list[list[float]], list[float]]:
    """The merged (start, end) intervals of the instructions `keep` picks, and their starts."""
    merged: list[list[float]] = []
    for a, b in sorted((start[i.id], end[i.id]) for i in instrs if keep(i) and end[i.id] > start[i.id]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged, [a for a, _ in merged]


def _covered(spans: tuple[list[list[float]], list[float]], s: float, e: float) -> float:
    """Seconds of [s, e] inside the merged intervals."""
    merged, starts = spans
    covered, k = 0.0, max(0, bisect.bisect_right(starts, s) - 1)
    while k < len(merged) and merged[k][0] < e:
        covered += max(0.0, min(e, merged[k][1]) - max(s, merged[k][0]))
        k += 1
    return covered


def _stretched(instrs: list[Instr], duration: list[float], start: list, end: list,
               slowdown: dict[str, tuple[float, float]] | None) -> list[float] | None:
    """The durations with each computation on a `slowdown` stream stretched: by its copy factor
    times the share of its replayed time a copy between tiers overlapped, plus its SSD factor times
    the share only SSD transfers overlapped; None where nothing changes."""
    if not slowdown:
        return None
    copies = _spans(instrs, start, end, lambda i: host_traffic(i) and not _is_ssd(i))
    either = _spans(instrs, start, end, host_traffic)
    if not either[0]:
        return None
    out = list(duration)
    for ins in instrs:
        c_copy, c_ssd = slowdown.get(ins.stream, (0.0, 0.0))
        s, e = start[ins.id], end[ins.id]
        if c_copy <= 0 and c_ssd <= 0 or ins.kind not in (InstrKind.COMPUTE, InstrKind.RECOMPUTE) or e <= s:
            continue
        by_copy = _covered(copies, s, e)
        by_ssd = _covered(either, s, e) - by_copy
        out[ins.id] = duration[ins.id] * (1.0 + (c_copy * by_copy + c_ssd * by_ssd) / (e - s))
    return out


def writes_ssd(ins: Instr) -> bool:
    return ins.kind == InstrKind.STORE and ins.dst == "ssd"


def reads_ssd_first(ins: Instr) -> bool:
    """A read on `ssd.first` (for a computation, `schedule.ssd_read_stream`): the aio engine runs
    its chunks before the queued chunks of a write-back (csrc/aio.cpp `first`), so it pauses the
    write in progress; `ssd.read` reads queue with the writes."""
    return ins.kind == InstrKind.LOAD and ins.stream == "ssd.first"


def commit_background(instrs: list[Instr]) -> bool:
    """Whether the step's SSD commit runs in the background (the plan runs in one process: its
    instructions use at most one GPU, and exchange nothing with data-parallel ranks) rather than
    after the last instruction (`simulate`)."""
    if any(i.kind in (InstrKind.REDUCE, InstrKind.GATHER) for i in instrs):
        return False
    return len({s.device for s in map(Stream.of, {i.stream for i in instrs}) if s.on_gpu}) <= 1


def sync_step_s(instrs: list[Instr], commit_s: float) -> float:
    """A step run one instruction after another (the executor's sync mode): their modeled
    durations summed, and the commit (`simulate`): in the background, the part of it the
    instructions before the first SSD write do not cover; else all of it, at the end."""
    total = lsum(i.est_s for i in instrs)
    if any(i.kind == InstrKind.COMMIT for i in instrs):
        return total
    if not commit_background(instrs):
        return total + commit_s
    before = 0.0
    for i in instrs:
        if writes_ssd(i):
            break
        before += i.est_s
    return total + max(0.0, commit_s - before)


def plan_commit_s(plan) -> float:
    """The SSD store's commit that ends a plan file's step (`cost.commit_time`)."""
    return commit_time(plan.hardware.spec, plan.instructions)


class _Memory:
    """Bytes live per tier while `simulate` dispatches, for copies that wait for room."""

    def __init__(self, instrs, nbytes, initial, reserved, capacity):
        self.instrs, self.nbytes, self.initial = instrs, nbytes, set(initial)
        self.reserved, self.capacity = dict(reserved or {}), dict(capacity)
        # what each instruction allocates when it starts, per tier, ignoring what it frees (an
        # upper bound for the instructions a waiting copy lets go first)
        self.grows: list[tuple[str, int]] = [
            (ins.dst, nbytes[ins.tensor]) if ins.kind in (InstrKind.LOAD, InstrKind.STORE, InstrKind.SEND) else
            (_device_tier(ins), sum(nbytes[a] for a in ins.allocs) + (nbytes[ins.workspace] if ins.workspace else 0))
            for ins in instrs]
        self.waited: dict[int, set[int]] = {}

    def reset(self) -> None:
        self.live = set(self.initial)
        self.use = dict(self.reserved)
        self.joined = _Joined(self.nbytes)
        for b, t in sorted(self.live):
            self.use[t] = self.use.get(t, 0) + self.joined.add(b, t)
        self.releases: list[tuple[float, str, int]] = []  # (time, tier, bytes): workspaces ending
        self.started = [False] * len(self.instrs)
        self.first = 0  # the lowest id not yet started

    def _settle(self, t: float) -> None:
        while self.releases and self.releases[0][0] <= t:
            _, tier, n = heapq.heappop(self.releases)
            self.use[tier] -= n

    def _room(self, i: int, t: float) -> tuple[bool, set[int]]:
        ins = self.instrs[i]
        tier = ins.dst
        if ins.kind not in (InstrKind.LOAD, InstrKind.STORE, InstrKind.SEND) or tier not in self.capacity or (ins.tensor, tier) in self.live:
            return True, set()
        self._settle(t)
        ahead = {j for j in range(self.first, i) if not self.started[j] and self.grows[j][0] == tier and self.grows[j][1]}
        need = self.use.get(tier, 0) + self.joined.need(ins.tensor, tier) + sum(self.grows[j][1] for j in ahead)
        return need <= self.capacity[tier], ahead

    def pick(self, cands: list[tuple[float, int, str]], now: float) -> tuple[float, int, str]:
        """The earliest (time, candidate) that may start: any instruction at its time but a copy
        only where it has room, which may come at a later time as a workspace ends; with nothing
        left that could make room, the first candidate (over capacity)."""
        cands = sorted((max(t, now), i, s) for t, i, s in cands)
        times = sorted({t for t, _, _ in cands} | {r[0] for r in self.releases if r[0] > cands[0][0]})
        for tau in times:
            for t, i, s in cands:
                if t > tau:
                    break
                ok, ahead = self._room(i, tau)
                if ok:
                    return tau, i, s
                self.waited.setdefault(i, set()).update(ahead)
        return cands[0]

    def start(self, i: int, t: float, end: float) -> None:
        ins = self.instrs[i]
        self._settle(t)
        self.started[i] = True
        while self.first < len(self.started) and self.started[self.first]:
            self.first += 1
        dev = _device_tier(ins)
        if ins.kind == InstrKind.FREE:
            if (ins.tensor, ins.dst) in self.live:
                self.live.remove((ins.tensor, ins.dst))
                self.use[ins.dst] -= self.joined.remove(ins.tensor, ins.dst)
        for a in ins.allocs:
            self.live.add((a, dev))
            self.use[dev] = self.use.get(dev, 0) + self.joined.add(a, dev)
        if ins.kind in (InstrKind.LOAD, InstrKind.STORE, InstrKind.SEND) and (ins.tensor, ins.dst) not in self.live:
            self.live.add((ins.tensor, ins.dst))
            self.use[ins.dst] = self.use.get(ins.dst, 0) + self.joined.add(ins.tensor, ins.dst)
        if ins.workspace:
            self.use[dev] = self.use.get(dev, 0) + self.nbytes[ins.workspace]
            heapq.heappush(self.releases, (end, dev, self.nbytes[ins.workspace]))
        if i in self.waited:  # it waited for these: only the ones that started before it count
            self.waited[i] = {j for j in self.waited[i] if self.started[j]}


def _device_tier(ins: Instr) -> str:
    """Compute and optimizer instructions allocate on the device their stream belongs to."""
    if ins.stream == CPU_OPTIMIZER:
        return "dram"
    return Stream.of(ins.stream).device


def perfetto_trace(instrs: list[Instr], sim: SimResult, title: str = "tensorstow") -> dict:
    """Chrome/Perfetto trace JSON: one track per stream, one counter per memory tier."""
    tids = {s: k for k, s in enumerate(sorted({i.stream for i in instrs}))}
    ev = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": title}}]
    ev += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": s}} for s, t in tids.items()]
    for ins in instrs:
        if ins.kind == InstrKind.FREE:
            continue
        label = ins.segment or ins.tensor
        ev.append({"name": f"{ins.kind} {label}", "ph": "X", "pid": 0, "tid": tids[ins.stream],
                   "ts": round(sim.start[ins.id] * 1e6, 3),
                   "dur": round((sim.end[ins.id] - sim.start[ins.id]) * 1e6, 3),
                   "args": {"id": ins.id, "deps": list(ins.deps)}})
    for tier, pts in sorted(sim.timeline.items()):
        for t, v in pts:
            ev.append({"name": f"mem {tier}", "ph": "C", "pid": 0, "ts": round(t * 1e6, 3),
                       "args": {"bytes": v}})
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def write_trace(path: str, trace: dict) -> None:
    with open(path, "w") as f:
        json.dump(trace, f)
