"""Tier stores: where the executor keeps each copy of a plan buffer.

A buffer (`P:b0`, `A:b3`, ...) is a fixed set of named tensors (its `Layout`). Each tier
holds at most one copy of it:

- `DeviceTier` ("gpu0"): a dict key -> tensor per buffer, on CUDA when there is a GPU, else
  CPU tensors held under the device's byte budget. Every tensor the executor keeps on the
  device (buffer copies, temporaries, a segment's intermediates) is counted once per
  storage; going over the budget raises `DeviceMemoryError`. `peak` is the high-water mark.
- `HostTier` ("dram"): one flat byte tensor per buffer (pinned with CUDA), the layout's
  tensors are views into it, so a whole buffer moves with one read or write.
- `SSDTier` ("ssd"): the same flat bytes in a store with the `write/read/commit/
  committed_step` interface (`executor.ssd.SSDStore`, or the `FileStore` fallback here).

Copies never alias: a load or store allocates (or overwrites) the destination and copies
bytes into it.
"""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from tensorstow.errors import TensorstowError
from tensorstow.executor.aio import aligned_empty, huge_empty
from tensorstow.ir.graph import numel
from tensorstow.planner.pools import DEVICE_ALIGN, BestFit, page


class DeviceMemoryError(TensorstowError):
    """The executor would hold more bytes on the device than the plan's hardware has."""


@dataclass(frozen=True)
class Slot:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Layout:
    """The tensors of one buffer, packed back to back in a flat byte tensor.

    Slots are ordered by element size (largest first, then by key) so every offset is a
    multiple of its dtype's size without padding: the flat size equals the plan's bytes.
    """

    def __init__(self, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        order = sorted(entries, key=lambda e: (-_itemsize(e[1]), e[0]))
        self.slots: dict[str, Slot] = {}
        off = 0
        for key, dtype, shape in order:
            n = numel(shape) * _itemsize(dtype)
            self.slots[key] = Slot(key, dtype, tuple(shape), off, n)
            off += n
        self.nbytes = off

    def keys(self):
        return self.slots.keys()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def contiguous_stride(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(out))


def kept_stride(t: torch.Tensor) -> tuple[int, ...]:
    """The stride a copy of `t` keeps: its own when dense (a permutation of contiguous), so
    kernels see the same memory layout after a round trip; else contiguous."""
    return tuple(t.stride()) if _dense(t.shape, t.stride()) else contiguous_stride(t.shape)


def _dense(shape, stride) -> bool:
    """True when the elements fill [0, numel) exactly once (a permuted contiguous layout)."""
    expected = 1
    for st, sz in sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1):
        if st != expected:
            return False
        expected *= sz
    return True


def _tensors(value):
    if isinstance(value, torch.Tensor):  # most ops return one tensor: no tree walk
        return (value,)
    if type(value) in (tuple, list) and not any(type(v) in (tuple, list, dict) for v in value):
        return [t for t in value if isinstance(t, torch.Tensor)]  # a multi-output op's flat tuple
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


# ---- device ---------------------------------------------------------------------------------

class DeviceTier:
    """The compute device's memory under a byte budget; counts each storage once."""

    def __init__(self, budget: int, device: torch.device, name: str = "gpu0"):
        self.name = name
        """The plan's tier this process drives ("gpuK")."""
        self.budget = int(budget)
        self.device = device
        self.copies: dict[str, dict[str, torch.Tensor]] = {}
        self.used = 0
        self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, references]
        self._lock = threading.Lock()
        self.parts: dict[str, list[tuple[str, str, tuple[int, int], tuple[int, ...]]]] = {}
        """Buffer -> (key, root, rows, the root's shape) of each member that is rows of a tensor the
        device holds whole (a unit's rows of an expert weight, or of its gradient): its copy is a view
        of that whole (`wholes`), which is counted whole from its first rows' buffer to its last, as
        the planner counts it (`planner.simulate._Joined`)."""
        self.wholes: dict[str, tuple[torch.Tensor, set[tuple[int, int]]]] = {}
        """Root -> (the tensor, the rows of it some buffer's copy holds)."""
        self.arena: torch.Tensor | None = None
        """The device arena (`open_arena`): every copy `place` makes is a range of it."""
        self.homes_at: dict[str, int] = {}
        """Buffer -> the offset of its home copy in the arena."""
        self.arena_note = ""
        """Why the tier has no arena (`executor.executor.open_device_arena`)."""
        self.ranges: dict[str, tuple[int, int]] = {}
        """Buffer -> the arena range [start, end) its copy takes."""

    def open_arena(self, nbytes: int, homes_at: dict[str, int]) -> None:
        """Allocate the device arena the plan sizes (`PoolSizes.device`), counted from here on, and
        place the homes of `homes_at` in it (buffer -> offset)."""
        arena = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.hold(arena, "the device arena")
        self.arena, self.homes_at = arena, dict(homes_at)

    # accounting ---------------------------------------------------------------------------
    def hold(self, value, what: str = "") -> None:
        """Count `value`'s tensors as live on the device (all or none of them)."""
        if type(value) is torch.Tensor:  # most values: one plain tensor
            self._hold_one(value, what)
            return
        done = []
        try:
            for t in _tensors(value):
                self._hold_one(t, what)
                done.append(t)
        except BaseException:
            for t in done:
                self.release(t)
            raise

    def _hold_one(self, t: torch.Tensor, what: str) -> None:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        with self._lock:
            rec = self._live.get(ptr)
            if rec is not None:  # a view of a held storage
                rec[1] += 1
                return
            n = st.nbytes()
            if n == 0:
                return
            self._grow(n, what)
            self._live[ptr] = [n, 1]

    def release(self, value) -> None:
        for t in (value,) if type(value) is torch.Tensor else _tensors(value):
            st = t.untyped_storage()
            ptr = st.data_ptr()
            with self._lock:
                rec = self._live.get(ptr)
                if rec is None:
                    if st.nbytes() == 0:
                        continue
                    raise RuntimeError("internal: released a device tensor that was not held")
                rec[1] -= 1
                if rec[1] == 0:
                    del self._live[ptr]
                    self.used -= rec[0]

    @contextmanager
    def reserve(self, nbytes: int, what: str):
        """Count `nbytes` of scratch that library code allocates out of our sight."""
        with self._lock:
            self._grow(nbytes, what)
        try:
            yield
        finally:
            with self._lock:
                self.used -= nbytes

    def _grow(self, n: int, what: str) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)
        if self.used > self.budget:
            used = self.used
            self.used -= n
            bufs = {b: sum(t.numel() * t.element_size() for t in c.values()) for b, c in list(self.copies.items())}
            top = ", ".join(f"{b} {v}" for b, v in sorted(bufs.items(), key=lambda kv: -kv[1])[:6])
            arena = 0 if self.arena is None else self.arena.numel()
            outside = sum(v for b, v in bufs.items() if b not in self.ranges)
            raise DeviceMemoryError(
                f"device tier {self.name} would hold {used} bytes > its budget of {self.budget} bytes "
                f"(allocating {what or 'a tensor'} of {n} bytes; buffers {top or 'none'}"
                + (f"; the device arena {arena}" if arena else "") + f"; temporaries "
                f"and inputs {max(used - n - arena - outside, 0)}): the plan under-estimates device "
                f"memory; re-plan with a smaller --gpu-mem so it leaves headroom (mode='sync', which "
                f"follows program order, usually needs less than mode='overlap')")

    # buffer copies --------------------------------------------------------------------------
    def has(self, buf: str) -> bool:
        return buf in self.copies

    def get(self, buf: str) -> dict[str, torch.Tensor]:
        c = self.copies.get(buf)
        if c is None:
            raise TensorstowError(f"buffer {buf} is not on {self.name}")
        return c

    def put(self, buf: str, values: dict[str, torch.Tensor], held: frozenset[str] | set[str] = frozenset()) -> None:
        """Make `values` buffer `buf`'s device copy. `held`: the keys whose values the caller
        holds already and whose holds pass to the buffer (a segment's kept roots), so they are
        counted once, not held again and released by the caller. A buffer of rows (`parts`) puts
        them into the tensor they are rows of (a view of it already: taken as it is)."""
        if buf in self.copies:
            raise TensorstowError(f"buffer {buf} is allocated twice on {self.name} (the plan must free it first)")
        if buf in self.parts:
            self.copies[buf] = self._put_rows(buf, values.__getitem__)
            return
        for k, v in values.items():
            if k not in held:
                self.hold(v, f"{buf}[{k}]")
        self.copies[buf] = values

    def place(self, buf: str, layout: "Layout", at: int, room: int, values=None,
              held: frozenset[str] | set[str] = frozenset(), non_blocking: bool = False,
              keep_strides: bool = True) -> dict[str, torch.Tensor]:
        """Make buffer `buf`'s device copy the arena's `room` bytes at offset `at` (`planner.pools.device_arena`):
        each member a view at the next multiple of DEVICE_ALIGN, with the strides of its value in
        `values` as `kept_stride` keeps them (`keep_strides`, else contiguous), which is copied in
        (cast to the layout's dtype); no values: contiguous and unwritten. `held`: keys whose values
        the caller holds, released here (the copy is the buffer's now). A range that overlaps a copy
        still here is refused before anything is written (the plan's order must keep them apart)."""
        if buf in self.copies:
            raise TensorstowError(f"buffer {buf} is allocated twice on {self.name} (the plan must free it first)")
        size = sum(-(-s.nbytes // DEVICE_ALIGN) * DEVICE_ALIGN for s in layout.slots.values())
        if size > room:
            raise TensorstowError(f"buffer {buf} takes {size} bytes on {self.name}, more than the {room} its "
                                  f"arena range has; re-plan it")
        self._claim(buf, at, room)
        out, off = {}, at
        try:
            for k, slot in layout.slots.items():
                v = None if values is None else values[k]
                flat = self.arena[off:off + slot.nbytes].view(slot.dtype)
                t = flat.as_strided(slot.shape, kept_stride(v) if v is not None and keep_strides
                                    else contiguous_stride(slot.shape))
                if v is not None:
                    t.copy_(v, non_blocking=non_blocking)
                self.hold(t, buf)  # a view: counted with the arena
                out[k] = t
                off += -(-slot.nbytes // DEVICE_ALIGN) * DEVICE_ALIGN
        except BaseException:
            for t in out.values():
                self.release(t)
            with self._lock:
                del self.ranges[buf]
            raise
        for k in held:
            self.release(values[k])
        self.copies[buf] = out
        return out

    def _claim(self, buf: str, at: int, room: int) -> None:
        """Take the arena range [at, at + room) for `buf`'s copy, refused where it overlaps a copy still here."""
        with self._lock:  # lanes place and drop side by side
            clash = next((b for b, (a, z) in self.ranges.items() if a < at + room and at < z), None)
            if clash is not None:
                raise TensorstowError(f"buffer {buf}'s arena range [{at}, {at + room}) overlaps {clash}'s, which is "
                                      f"still on {self.name}: the plan's order does not keep them apart; re-plan it")
            self.ranges[buf] = (at, at + room)

    def adopt_views(self, buf: str, views: dict[str, torch.Tensor], at: int, room: int) -> None:
        """Make `views` (of the arena's range [at, at + room), as `place` made them for an earlier step)
        buffer `buf`'s device copy again: a replayed segment writes them (`executor.graphs`)."""
        if buf in self.copies:
            raise TensorstowError(f"buffer {buf} is allocated twice on {self.name} (the plan must free it first)")
        self._claim(buf, at, room)
        for t in views.values():
            self.hold(t, buf)
        self.copies[buf] = dict(views)

    def put_home(self, buf: str, layout: "Layout", room: int, values: dict[str, torch.Tensor]) -> None:
        """Place a home copy on the device from `values` (host tensors): in the arena where it has one."""
        if buf in self.homes_at:
            self.place(buf, layout, self.homes_at[buf], room, values, keep_strides=False)
        else:
            self.put(buf, {k: clone_to(values[k], self.device) for k in layout.keys()})

    def load_from(self, buf: str, src: "HostCopy", at: int | None = None, room: int = 0) -> None:
        """Copy a host copy onto the device (overwriting the device copy if there is one), into the
        arena's `room` bytes at `at` where the plan places it there."""
        old = self.copies.get(buf)
        if old is not None:
            for k in src.layout.keys():
                old[k].copy_(src.get(k), non_blocking=self.device.type == "cuda")
            return
        if at is not None:
            self.place(buf, src.layout, at, room, {k: src.get(k) for k in src.layout.keys()},
                       non_blocking=self.device.type == "cuda")
            return
        if buf in self.parts:
            self.copies[buf] = self._put_rows(buf, src.get)
            return
        vals = {}
        try:
            for k in src.layout.keys():
                v = src.get(k)
                t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=self.device)
                self.hold(t, f"{buf}[{k}]")
                vals[k] = t
                t.copy_(v, non_blocking=self.device.type == "cuda")
        except BaseException:
            for t in vals.values():
                self.release(t)
            raise
        self.copies[buf] = vals

    def drop(self, buf: str) -> None:
        c = self.copies.pop(buf, None)
        if c is None:
            raise TensorstowError(f"free of {buf} on {self.name}, which does not hold it")
        with self._lock:
            self.ranges.pop(buf, None)
        if buf in self.parts:
            self._drop_rows(buf, c)
            return
        for v in c.values():
            self.release(v)

    # rows of a tensor held whole (`parts`) ---------------------------------------------------
    def adopt(self, root: str, t: torch.Tensor) -> None:
        """Make `t` the whole tensor of `root` whose rows buffers put next take (a gradient the
        backward made whole), counted from here until its last rows go; the caller's hold of it stays
        the caller's."""
        with self._lock:
            if root in self.wholes:
                raise TensorstowError(f"{root} is on {self.name} twice (the plan must free its rows first)")
            self._grow(t.numel() * t.element_size(), root)
            self.wholes[root] = (t, set())

    def whole(self, root: str) -> torch.Tensor | None:
        """The tensor `root` whose rows buffers hold, where every row is there; None where no
        buffer holds rows of it."""
        with self._lock:
            w = self.wholes.get(root)
            if w is None:
                return None
            t, rows = w[0], sorted(w[1])
        if not rows or rows[0][0] != 0 or rows[-1][1] != t.shape[0] or any(a[1] != b[0] for a, b in zip(rows, rows[1:])):
            raise TensorstowError(f"{root} is read on {self.name} with rows {rows} of {t.shape[0]} there: the plan "
                                  f"does not make the read wait for every unit's load")
        return t

    def _put_rows(self, buf: str, value_of) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        try:
            for key, root, (a, b), shape in self.parts[buf]:
                v = value_of(key)
                with self._lock:  # lanes load and free rows of one weight side by side
                    if root not in self.wholes:
                        w = torch.empty(shape, dtype=v.dtype, device=self.device)
                        self._grow(w.numel() * w.element_size(), f"{buf}[{key}]")
                        self.wholes[root] = (w, set())
                    t, present = self.wholes[root]
                    view = t[a:b]
                    present.add((a, b))
                out[key] = view
                if view.data_ptr() != v.data_ptr() or view.stride() != v.stride():
                    view.copy_(v, non_blocking=self.device.type == "cuda")
        except BaseException:
            self._drop_rows(buf, out)
            raise
        return out

    def _drop_rows(self, buf: str, c: dict[str, torch.Tensor]) -> None:
        for key, root, rows, _ in self.parts[buf]:
            if key not in c:
                continue
            with self._lock:
                t, present = self.wholes[root]
                present.discard(rows)
                if not present:
                    del self.wholes[root]
                    self.used -= t.numel() * t.element_size()


# ---- host -----------------------------------------------------------------------------------

class HostCopy:
    """One buffer in DRAM: a flat byte tensor plus the stride each tensor was stored with."""

    def __init__(self, layout: Layout, blob: torch.Tensor, strides: dict[str, tuple] | None = None,
                 pinned: bool = False):
        self.layout, self.blob = layout, blob
        self.strides = dict(strides or {})
        self.pinned = pinned
        """Page-locked: a copy from the GPU into it is asynchronous (executor.cuda orders its readers)."""
        self._views: dict[str, torch.Tensor] = {}  # the blob never moves: views are made once

    def get(self, key: str) -> torch.Tensor:
        v = self._views.get(key)
        if v is None:
            s = self.layout.slots[key]
            flat = self.blob[s.offset:s.offset + s.nbytes].view(s.dtype)
            v = self._views[key] = flat.as_strided(s.shape, self.strides.get(key) or contiguous_stride(s.shape))
        return v

    def set(self, key: str, t: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy `t` in. `non_blocking` from a GPU into pinned memory returns before the copy is
        done: only for copies the executor's lanes order (executor.cuda)."""
        self.strides[key] = kept_stride(t)
        self._views.pop(key, None)
        self.get(key).copy_(t, non_blocking=non_blocking and self.pinned and t.is_cuda)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.get(key)


def pinned_empty(nbytes: int) -> torch.Tensor:
    """Page-locked host memory of exactly `nbytes`, 4096-aligned: allocated here and registered
    with CUDA (cudaHostRegister), because torch's pinned allocator rounds every block up to a power
    of two (a 33 GB arena would lock 64 GB). Unregistered when the tensor is collected; torch's
    pinned allocator if registering fails. In huge pages (`aio.huge_empty`), as the SSD store's
    I/O wants them."""
    import weakref
    t = huge_empty(nbytes)
    if not nbytes:
        return t
    try:
        cudart = torch.cuda.cudart()
        ok = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)) == 0
    except (RuntimeError, AttributeError, TypeError):
        ok = False
    if not ok:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


class RoomWait:
    """Overlap mode's lanes as the DRAM pool's waiters see them. A lane runs ahead of the order the
    planner sized the pool for (the simulated one) as far as its dependencies let it, so a copy can
    find no free range long enough where the simulated step had one: it waits for another lane to
    give one back, as long as some lane can still run. Each lane reports when it is stalled (blocked
    on a dependency, waiting for room, or done); when every lane is, no range can come back and the
    request is served from a fresh allocation (`HostPool.overflow_bytes`), as after ROOM_WAIT_S."""

    def __init__(self, lanes: int):
        self.lanes = lanes
        self.stalled = 0
        self._lock = threading.Lock()

    @contextmanager
    def stall(self):
        """The calling lane waits (a dependency, room) for the duration."""
        with self._lock:
            self.stalled += 1
        try:
            yield
        finally:
            with self._lock:
                self.stalled -= 1

    def end(self) -> None:
        """The calling lane has run its last instruction of the step."""
        with self._lock:
            self.stalled += 1

    def anyone_running(self) -> bool:
        return self.stalled < self.lanes


ROOM_WAIT_S = 10.0
"""The longest a copy waits for room in the DRAM pool before it is allocated outside it: a bound
for a lane blocked where it does not report it (a lane's wait for room normally ends within a
block's computation)."""
ROOM_POLL_S = 0.01
"""How often a waiting copy looks again whether every lane has stalled (a range given back wakes
it at once)."""


class HostPool:
    """The DRAM tier's memory: one arena allocated up front (pinned with CUDA) as large as the plan
    says (`Plan.pools`), carved into page-aligned ranges best-fit and given back on free
    (`planner.pools.BestFit`), so every step reuses the same bytes and no copy allocates
    (STRONGHOLD §3.4 buffer pools). In overlap mode a request that finds no free range long enough
    waits for one (`RoomWait`); one that cannot get room is served from a fresh allocation and
    counted in `overflow_bytes`."""

    def __init__(self, nbytes: int, pin: bool = False):
        self.size = page(nbytes)
        self.arena = pinned_empty(self.size) if pin else huge_empty(self.size)
        self.ranges = BestFit(self.size)
        self.overflow_bytes = 0
        self.room_wait_s = 0.0
        """Time copies waited for room, over the run."""
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)

    @property
    def free(self) -> list[list[int]]:
        """Free ranges [offset, length], by offset, coalesced."""
        return self.ranges.free

    @property
    def high_water(self) -> int:
        return self.ranges.high_water

    def take(self, nbytes: int, room: RoomWait | None = None) -> tuple[int, torch.Tensor] | None:
        """(offset, bytes) of a range of at least `nbytes`, or None if no free range is long enough
        (with `room`: none came back while another lane could run, or within ROOM_WAIT_S)."""
        with self._room:
            off = self.ranges.take(nbytes)
            if off is None and room is not None:
                t0 = time.monotonic()
                with room.stall():
                    while off is None and room.anyone_running() and time.monotonic() - t0 < ROOM_WAIT_S:
                        self._room.wait(ROOM_POLL_S)
                        off = self.ranges.take(nbytes)
                self.room_wait_s += time.monotonic() - t0
        return None if off is None else (off, self.arena[off:off + nbytes])

    def give(self, off: int, nbytes: int) -> None:
        with self._room:
            self.ranges.give(off, nbytes)
            self._room.notify_all()


class HostTier:
    """DRAM: a flat byte range per buffer copy, carved from the preallocated pool (or, without
    one, allocated per copy: pinned with CUDA); tracks its peak."""

    name = "dram"

    def __init__(self, pin: bool, pool: HostPool | None = None):
        self.pin = pin
        self.pool = pool
        self.copies: dict[str, HostCopy] = {}
        self.ranges: dict[str, tuple[int, int]] = {}
        self.used = 0
        self.peak = 0
        self.room: RoomWait | None = None
        """Set while overlap mode's lanes run: a copy the pool has no range for waits for one."""
        self._lock = threading.Lock()

    def has(self, buf: str) -> bool:
        return buf in self.copies

    def get(self, buf: str) -> HostCopy:
        c = self.copies.get(buf)
        if c is None:
            raise TensorstowError(f"buffer {buf} is not in dram")
        return c

    def footprint(self, nbytes: int) -> int:
        """Bytes a copy really takes: CUDA's caching host allocator rounds pinned blocks up to a
        power of two, so a pinned copy outside a pool is accounted at that size (else as asked)."""
        return 1 << max(nbytes - 1, 0).bit_length() if self.pin and nbytes and self.pool is None else nbytes

    def alloc(self, buf: str, layout: Layout) -> HostCopy:
        """The copy of `buf` to write into: the existing one (overwritten in place) or a new one."""
        c = self.copies.get(buf)
        if c is not None:
            return c
        # 4096-aligned, so the SSD store's O_DIRECT I/O moves it in place (no staging copy)
        got = self.pool.take(layout.nbytes, self.room) if self.pool is not None and layout.nbytes else None
        if got is not None:
            self.ranges[buf] = (got[0], layout.nbytes)
            blob = got[1]
        else:
            if self.pool is not None:
                self.pool.overflow_bytes += layout.nbytes
            blob = (torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=True) if self.pin
                    else aligned_empty(layout.nbytes))
        with self._lock:
            self.used += self.footprint(layout.nbytes)
            self.peak = max(self.peak, self.used)
        c = self.copies[buf] = HostCopy(layout, blob, pinned=self.pin)
        return c

    def store_from(self, buf: str, layout: Layout, values: dict[str, torch.Tensor],
                   non_blocking: bool = False) -> None:
        c = self.alloc(buf, layout)
        for k in layout.keys():
            c.set(k, values[k], non_blocking)

    def drop(self, buf: str) -> None:
        c = self.copies.pop(buf, None)
        if c is None:
            raise TensorstowError(f"free of {buf} in dram, which does not hold it")
        r = self.ranges.pop(buf, None)
        if r is not None:
            self.pool.give(*r)
        with self._lock:
            self.used -= self.footprint(c.layout.nbytes)


# ---- SSD ------------------------------------------------------------------------------------

class SSDTier:
    """Which buffers have a valid copy in the store, and the strides they were written with."""

    name = "ssd"

    def __init__(self, store):
        self.store = store
        self.copies: dict[str, dict[str, tuple]] = {}

    def has(self, buf: str) -> bool:
        return buf in self.copies

    def write(self, buf: str, src: HostCopy) -> None:
        self._need_store(buf)
        self.store.write(buf, src.blob)
        self.copies[buf] = dict(src.strides)

    def read(self, buf: str, host: HostTier, layout: Layout, first: bool = False, committed: bool = False) -> None:
        """`first`: a computation waits for it (the plan's `ssd.first` stream): it goes ahead of
        the store's queued writes. `committed`: the version the last commit holds, not this
        step's write (a speculative update's redo restores from it; `executor.ssd.SSDStore`)."""
        if buf not in self.copies:
            raise TensorstowError(f"load of {buf} from ssd, which does not hold it")
        dst = host.alloc(buf, layout)
        if committed:
            self.store.read(buf, dst.blob, first=first, committed=True)
        else:
            self.store.read(buf, dst.blob, first=first)
        dst.strides = dict(self.copies[buf])

    def drop(self, buf: str) -> None:
        if self.copies.pop(buf, None) is None:
            raise TensorstowError(f"free of {buf} on ssd, which does not hold it")

    def _need_store(self, buf: str) -> None:
        if self.store is None:
            raise TensorstowError(f"the plan moves {buf} to the SSD tier but the executor has no "
                                  f"SSD store: pass state_dir= (or ssd_store=)")


class FileStore:
    """Fallback SSD store: one preallocated file per buffer under `root`, synchronous
    `os.pwrite`/`os.preadv` of the tensor's bytes. `commit(step)` fsyncs the files and
    atomically replaces COMMITTED (a JSON file naming the step).

    Unlike `executor.ssd.SSDStore` it overwrites buffers in place: a crash in the middle of a
    step leaves a mix of old and new bytes (use SSDStore for crash-consistent training).
    """

    COMMIT = "COMMITTED"

    def __init__(self, root):
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TensorstowError(f"SSD state dir {self.root}: cannot create it ({e})") from None
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def _path(self, name: str) -> Path:
        return self.root / (name.replace("/", "_").replace(":", "-") + ".bin")

    def _fd(self, name: str, nbytes: int | None) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                path = self._path(name)
                if nbytes is None and not path.exists():
                    raise TensorstowError(f"SSD store {self.root}: buffer '{name}' was never written")
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                self._fds[name] = fd
                self._sizes[name] = os.fstat(fd).st_size
            if nbytes is not None and self._sizes[name] < nbytes:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    raise TensorstowError(f"SSD store {self.root}: cannot preallocate {nbytes} bytes "
                                          f"for '{name}' ({e}); free disk space or use another state dir") from None
                self._sizes[name] = nbytes
            return fd

    def write(self, name: str, t: torch.Tensor) -> None:
        mv = _byte_view(t)
        fd = self._fd(name, len(mv))
        done = 0
        while done < len(mv):
            done += os.pwrite(fd, mv[done:], done)

    def read(self, name: str, out: torch.Tensor, first: bool = False) -> None:
        """`first` is for the asynchronous store's queue; here every read runs at once."""
        if not out.is_contiguous() or out.device.type != "cpu":
            raise TensorstowError(f"SSD store: read of '{name}' needs a contiguous CPU tensor")
        mv = _byte_view(out)
        fd = self._fd(name, None)
        if self._sizes[name] < len(mv):
            raise TensorstowError(f"SSD store {self.root}: '{name}' holds {self._sizes[name]} bytes, "
                                  f"{len(mv)} requested; the state dir belongs to another plan")
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], done)
            if n == 0:
                raise TensorstowError(f"SSD store {self.root}: '{name}' is truncated")
            done += n

    def commit(self, step: int) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.fsync(fd)
        tmp = self.root / (self.COMMIT + ".tmp")
        tmp.write_text(json.dumps({"step": int(step)}))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.root / self.COMMIT)

    def committed_step(self) -> int | None:
        p = self.root / self.COMMIT
        if not p.exists():
            return None
        return int(json.loads(p.read_text())["step"])

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _byte_view(t: torch.Tensor) -> memoryview:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise TensorstowError("SSD store: tensors must be contiguous CPU tensors")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def clone_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous copy of `t` on `device` (the layout every tier copy has)."""
    out = torch.empty_strided(t.shape, contiguous_stride(t.shape), dtype=t.dtype, device=device)
    out.copy_(t)
    return out


@dataclass
class Tiers:
    """One executor's tiers: the device tier (CUDA, or budgeted host memory), the DRAM tier and its
    arena, and the SSD tier, each also by the plan's tier name (`by_name`: "gpuK", "dram", "ssd")."""
    device: torch.device
    gpu: str
    dev: DeviceTier
    pool: HostPool
    host: HostTier
    ssd: SSDTier
    by_name: dict = field(init=False)

    def __post_init__(self):
        self.by_name = {self.gpu: self.dev, "dram": self.host, "ssd": self.ssd}
