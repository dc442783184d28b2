"""The DRAM arena each executor process preallocates (STRONGHOLD §3.4 buffer pools), sized here so
the plan carries it (`Plan.pools`) and the executor allocates exactly that.

Every DRAM copy a step makes is a page-aligned range of one arena, carved best-fit and given back
on free (`BestFit`), so a step allocates nothing. The arena must hold the best-fit high-water mark
of the process's DRAM allocations: placing the homes block by block (an SSD or GPU home is staged
through DRAM), the buffers carried across steps, then two steps, the second the steady state. The
instructions run in program order in sync mode; in overlap mode lanes run ahead of it, so DRAM
also holds what the simulated replay holds (the order of the simulated start times): the overlap
arena is the larger of the two. (Lanes whose real timing differs from both can fragment the arena
otherwise: a copy that finds no range waits for another lane to give one back, `stores.RoomWait`.)
"""
from __future__ import annotations

from dataclasses import dataclass

from tensorstow.schema.plan import PoolSizes
from tensorstow.schema.schedule import (PAGE_BYTES, STATE_KINDS, Buffer, BufferKind, Decisions, Instr, InstrKind,
                                        Stream, block_gpus, carried_buffers, home_tiers, member_rows, runs_on,
                                        units_by_block)


def page(n: int) -> int:
    """`n` bytes rounded up to whole pages (every host range is O_DIRECT-aligned)."""
    return -(-n // PAGE_BYTES) * PAGE_BYTES


class BestFit:
    """Free ranges of an arena of `size` bytes, carved best-fit in whole pages and coalesced on
    give-back (the executor's `HostPool` carves its pinned or huge-page arena with it; `arena_bytes`
    replays a step's events on one to size that arena)."""

    def __init__(self, size: int):
        self.free: list[list[int]] = [[0, size]] if size else []
        """Free ranges [offset, length], by offset, coalesced."""
        self.high_water = 0

    def take(self, nbytes: int) -> int | None:
        """The offset of a range of at least `nbytes`, or None if no free range is long enough."""
        n = page(nbytes)
        fits = [r for r in self.free if r[1] >= n]
        if not fits:
            return None
        r = min(fits, key=lambda r: (r[1], r[0]))
        off = r[0]
        r[0], r[1] = r[0] + n, r[1] - n
        if not r[1]:
            self.free.remove(r)
        self.high_water = max(self.high_water, off + n)
        return off

    def give(self, off: int, nbytes: int) -> None:
        n = page(nbytes)
        k = next((i for i, r in enumerate(self.free) if r[0] > off), len(self.free))
        self.free.insert(k, [off, n])
        if k + 1 < len(self.free) and off + n == self.free[k + 1][0]:  # merge with the next
            self.free[k][1] += self.free.pop(k + 1)[1]
        if k and self.free[k - 1][0] + self.free[k - 1][1] == off:  # and with the previous
            self.free[k - 1][1] += self.free.pop(k)[1]


def arena_bytes(events) -> int:
    """Arena bytes for ("alloc", name, nbytes) / ("free", name) events replayed best-fit in this
    order: the DRAM peak plus what fragmentation adds."""
    pool = BestFit(sum(page(e[2]) for e in events if e[0] == "alloc"))
    held = {}
    for e in events:
        if e[0] == "alloc":
            held[e[1]] = (pool.take(e[2]), e[2])
        else:
            pool.give(*held.pop(e[1]))
    return pool.high_water


def dram_events(order: list[Instr], blocks: list[str], buffers: dict[str, Buffer], homes: dict[str, str],
                carried: list[str], resume: bool) -> list[tuple]:
    """The DRAM allocations and frees of one process with its instructions in `order`: placing
    its homes (`homes`: buffer -> tier) block by block in forward order (or, `resume`, reading
    them back), its carried buffers, then two steps."""
    events, here = [], set()

    def alloc(n):
        if n not in here:
            here.add(n)
            events.append(("alloc", n, buffers[n].bytes))

    def free(n):
        here.discard(n)
        events.append(("free", n))
    units = units_by_block(x.block for x in buffers.values())  # a block's expert groups, placed after it
    for b in blocks:
        for n in (f"{k}:{o}" for o in (b, *units.get(b, ())) for k in STATE_KINDS):
            home = buffers[n].home if n in homes else None
            if home == "dram" or home == "ssd" and not resume or home == "gpu" and resume:
                alloc(n)
                if home != "dram":  # staged through DRAM on its way home
                    free(n)
    for n in carried:
        alloc(n)
    for _ in range(2):
        for ins in order:
            if ins.kind in (InstrKind.LOAD, InstrKind.STORE) and ins.dst == "dram":
                alloc(ins.tensor)
            elif ins.kind == InstrKind.FREE and ins.dst == "dram" and ins.tensor in here:
                free(ins.tensor)
            elif ins.kind == InstrKind.OPTIMIZER_STEP and ins.dst == "cpu":
                for a in ins.allocs:
                    alloc(a)
    return events


def process_pools(instrs: list[Instr], start: list[float], buffers: dict[str, Buffer], decisions: Decisions,
                  blocks: list[str], block_gpu: dict[str, str], side: tuple[list[Instr], ...] = ()) -> dict[str, PoolSizes]:
    """Per GPU process (by its tier, `gpuK`), the DRAM arena its sync and overlap replays need,
    placing the homes afresh or resuming them (the larger of the two), and its device arena (the
    largest of the step's and the programs in `side`: the evaluation's, the redo's)."""
    out = {}
    for gpu in sorted(set(block_gpu.values())):
        mine = [i for i in instrs if runs_on(i, gpu, block_gpu, buffers)]
        simulated = sorted(mine, key=lambda i: (start[i.id], i.id))
        homes = {n: t for n, t in home_tiers(buffers, decisions, blocks).items() if block_gpu[buffers[n].block] == gpu}
        on_gpu = [n for n, t in homes.items() if t == gpu]
        device = max(device_arena([i for i in prog if runs_on(i, gpu, block_gpu, buffers)], buffers, gpu,
                                  on_gpu).nbytes for prog in (mine, *side))
        carried = [x for x in carried_buffers(decisions, buffers) if x in homes]

        def need(order):
            return max(arena_bytes(dram_events(order, blocks, buffers, homes, carried, resume))
                       for resume in (False, True))
        sync = need(mine)
        out[gpu] = PoolSizes(sync=sync, overlap=max(sync, need(simulated)), device=device)
    return out


# ---- the device arena ---------------------------------------------------------------------------

DEVICE_ALIGN = 512
"""Every device copy's members start at a multiple of this (as the caching allocator's blocks do):
kernels read them aligned."""


def device_bytes(buf: Buffer) -> int:
    """The arena bytes a device copy of `buf` takes: room for each member aligned (`DEVICE_ALIGN`)."""
    n = buf.bytes + DEVICE_ALIGN * max(1, len(buf.members))
    return -(-n // DEVICE_ALIGN) * DEVICE_ALIGN


def in_device_arena(buf: Buffer) -> bool:
    """Whether the device copies of `buf` are ranges of the device arena: all but workspaces (a
    segment's temporaries, which the framework allocates) and a unit's rows of a weight or gradient
    the device holds whole (`stores.DeviceTier.parts`)."""
    kind = buf.buffer_kind
    if kind is BufferKind.W:
        return False
    return kind in (BufferKind.M, BufferKind.OS) or all(member_rows(m)[1] is None for m in buf.members)


@dataclass(frozen=True)
class DeviceArena:
    """Where one GPU process's device copies live in its arena (`device_arena`)."""
    homes: dict[str, int]
    """Buffer -> its offset: the copies on the GPU between steps, packed from 0 in name order."""
    at: dict[tuple[int, str], int]
    """(instruction, buffer) -> the offset of the copy the instruction makes (a load, a received
    send, a segment's output, an update's new P)."""
    nbytes: int
    """The arena's size: its homes and the highest end of a copy."""


def arena_allocs(ins: Instr, gpu: str, buffers: dict[str, Buffer]) -> list[str]:
    """The device copies on `gpu` instruction `ins` makes, of buffers `in_device_arena`."""
    if ins.kind in (InstrKind.LOAD, InstrKind.SEND):
        made = [ins.tensor] if ins.dst == gpu else []
    elif ins.kind in (InstrKind.COMPUTE, InstrKind.RECOMPUTE, InstrKind.OPTIMIZER_STEP):
        made = list(ins.allocs) if Stream.of(ins.stream).device == gpu else []
    else:
        made = []
    return [b for b in made if in_device_arena(buffers[b])]


def device_arena(instrs: list[Instr], buffers: dict[str, Buffer], gpu: str, homes: list[str]) -> DeviceArena:
    """Offsets of one process's device copies in its arena, for a program `instrs` (ids in program
    order) that it replays in program order (sync mode) or lane by lane, each instruction after its
    dependencies (overlap mode). Its homes are packed from 0 in name order. Two copies a step makes
    may share bytes only where one is gone before the other is made in both modes: its free and its
    readers (the instructions on this GPU that depend on its make, before the free) end before the
    other's make starts, through dependencies or earlier on the same stream (`_happens_before`). No
    dependency is added and no copy waits for room: the arena holds what the schedule's order lets be
    live at once. Copies are placed largest first, each in the smallest gap the copies it may not
    share with leave (greedy by size, as TFLite's arena planner places tensors: offline it packs
    close to the live peak, where best-fit in arrival order leaves up to 17% more, mixtral-8x7b's
    golden plan)."""
    home_at, base = {}, 0
    for n in sorted(homes):
        if in_device_arena(buffers[n]):
            home_at[n] = base
            base += device_bytes(buffers[n])
    before = _happens_before(instrs)
    copies = _arena_copies(instrs, buffers, gpu, homes)

    def apart(x, y) -> bool:
        return (x[2] is not None and not x[2] & ~before[y[1]]) or (y[2] is not None and not y[2] & ~before[x[1]])
    at: dict[tuple[int, str], int] = {}
    placed: list[tuple[int, tuple]] = []
    top = base
    for c in sorted(copies, key=lambda c: (-c[3], c[1], c[0])):
        taken = sorted((o, o + p[3]) for o, p in placed if not apart(p, c))
        o = _best_fit(taken, c[3], base)
        at[c[1], c[0]] = o
        placed.append((o, c))
        top = max(top, o + c[3])
    return DeviceArena(homes=home_at, at=at, nbytes=top)


def _arena_copies(instrs: list[Instr], buffers: dict[str, Buffer], gpu: str, homes: list[str]) -> list[tuple]:
    """The device copies in the arena a program makes: (buffer, the instruction that makes it, the
    bitmask of its free and readers, None where it outlives the program, its bytes)."""
    users: dict[int, int] = {}  # an instruction -> its dependents on this GPU, as a bitmask of ids
    for i in instrs:
        if Stream.of(i.stream).device == gpu:
            for d in i.deps:
                users[d] = users.get(d, 0) | 1 << i.id
    out: list[list] = []
    live: dict[str, int] = {}  # buffer -> its copy in `out`
    present = set(homes)
    for i in instrs:
        if i.kind == InstrKind.FREE and i.dst == gpu:
            present.discard(i.tensor)
            k = live.pop(i.tensor, None)
            if k is not None:
                made = out[k][1]
                out[k][2] = users.get(made, 0) & ((1 << i.id) - 1) & ~((2 << made) - 1) | 1 << i.id
            continue
        for b in arena_allocs(i, gpu, buffers):
            if b not in present:  # else a load over the copy there, in place
                live[b] = len(out)
                out.append([b, i.id, None, device_bytes(buffers[b])])
        if i.kind in (InstrKind.LOAD, InstrKind.SEND) and i.dst == gpu:
            present.add(i.tensor)
        elif Stream.of(i.stream).device == gpu:
            present.update(i.allocs)
    return [tuple(c) for c in out]


def device_transient(instrs: list[Instr], buffers: dict[str, Buffer], gpu: str) -> int:
    """The most device bytes beside the arena while a segment runs: its workspace (the temporaries the
    framework allocates) and the values its buffers keep, made before they are copied into their
    ranges; the largest over the segments of `instrs` on `gpu`."""
    return max(((buffers[i.workspace].bytes if i.workspace else 0)
                + sum(buffers[b].bytes for b in arena_allocs(i, gpu, buffers))
                for i in instrs if i.kind in (InstrKind.COMPUTE, InstrKind.RECOMPUTE)
                and Stream.of(i.stream).device == gpu), default=0)


def arena_need(plan, gpu: str) -> int:
    """Device bytes GPU process `gpu` of `plan` (`schema.plan.Plan`) holds at most with its device arena:
    the arena, the most a segment holds beside it in any of its programs (`device_transient`), and a
    step's tokens and labels (int64)."""
    block_gpu = block_gpus(plan)
    beside = max(device_transient([i for i in prog if runs_on(i, gpu, block_gpu, plan.buffers)], dict(plan.buffers), gpu)
                 for prog in (plan.instructions, plan.eval_instructions, plan.redo_instructions))
    return plan.pools[gpu].device + beside + 2 * plan.decisions.grad_accum * plan.model.batch * plan.model.seq * 8


def _best_fit(taken: list[tuple[int, int]], n: int, base: int) -> int:
    """The start of the shortest gap of at least `n` bytes above `base` between the sorted, possibly
    overlapping ranges `taken` (the lowest of equal ones), else the end of the last."""
    best, end = None, base
    for a, b in taken:
        if a - end >= n and (best is None or a - end < best[0]):
            best = (a - end, end)
        end = max(end, b)
    return best[1] if best is not None else end


def _happens_before(instrs: list[Instr]) -> dict[int, int]:
    """Instruction -> the instructions that end before it starts in either replay order, as a
    bitmask of ids: its dependencies, the one before it on its stream, and theirs."""
    out: dict[int, int] = {}
    last: dict[str, int] = {}
    for i in instrs:
        m = 0
        for d in (*i.deps, last.get(i.stream)):
            if d is not None:
                m |= out.get(d, 0) | 1 << d
        out[i.id] = m
        last[i.stream] = i.id
    return out
