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

from tensorstow.schema.plan import PoolSizes
from tensorstow.schema.schedule import (PAGE_BYTES, STATE_KINDS, Buffer, Decisions, Instr, InstrKind, carried_buffers,
                                        home_tiers, runs_on, units_by_block)


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


def host_pools(instrs: list[Instr], start: list[float], buffers: dict[str, Buffer], decisions: Decisions,
               blocks: list[str], block_gpu: dict[str, str]) -> dict[str, PoolSizes]:
    """Per GPU process (by its tier, `gpuK`), the arena its sync and overlap replays need, placing
    the homes afresh or resuming them (the larger of the two)."""
    out = {}
    for gpu in sorted(set(block_gpu.values())):
        mine = [i for i in instrs if runs_on(i, gpu, block_gpu, buffers)]
        simulated = sorted(mine, key=lambda i: (start[i.id], i.id))
        homes = {n: t for n, t in home_tiers(buffers, decisions, blocks).items() if block_gpu[buffers[n].block] == gpu}
        carried = [x for x in carried_buffers(decisions, buffers) if x in homes]

        def need(order):
            return max(arena_bytes(dram_events(order, blocks, buffers, homes, carried, resume))
                       for resume in (False, True))
        sync = need(mine)
        out[gpu] = PoolSizes(sync=sync, overlap=max(sync, need(simulated)))
    return out
