"""SSD tier: a crash-consistent store for buffers whose master copy lives on SSD.

Every buffer has two preallocated files ("slots"), sizes rounded up to 4096. MANIFEST names,
per buffer, the committed slot and the checksums of its bytes (XXH3-64, one per 16 MiB block;
stores with manifest version 1, from earlier tensorstow releases, keep CRC-32); the other
slot is the shadow. `write` only ever touches the shadow slot and, once the write completes,
fdatasyncs it on a background thread (`early_sync`); `commit(step)` waits for the writes and
their syncs (or syncs the files itself), writes the new manifest to MANIFEST.tmp, fsyncs it,
renames it over MANIFEST and fsyncs the directory. Until that rename the old manifest and
the slots it names are untouched, so a crash at any point leaves the last committed step
readable, and a torn or corrupted block is caught by its checksum on read (DESIGN.md,
invariant 4).

Files are opened with O_DIRECT where the filesystem allows it (buffered I/O + fsync
otherwise; `io_mode_reason` says why). With O_DIRECT, tensors whose data pointer is
4096-aligned (`aio.aligned_empty`) move without a copy; others go through a staging buffer.

Transient buffers (`set_transient`: a step's swapped activations, checkpoints and gradients,
which the step writes before it reads them) are written and read the same way but never
synced and never committed: a step's crash-consistent state does not include them, so the
disk spends no flush on them, and after a commit (or a resume) they hold no data until written.

The directory holds one store at a time: a lock file (flock) refuses a second opener.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from tensorstow.errors import TensorstowError
from tensorstow.executor import aio
from tensorstow.executor.manifest import (CHECKSUMS, CRC_BLOCK, MANIFEST, NOT_WRITABLE, PREVIOUS, VERSION, StoreFiles,
                                          describe_os_error, entry_key, manifest_content, not_writable, slot_files)

log = logging.getLogger(__name__)

def _verify(data: torch.Tensor, n: int, fn, fn_name: str, crcs: list, what: str, path: Path, version: str) -> None:
    """The `n` bytes read into `data` match their checksums `crcs` (per CRC_BLOCK, by `fn`), or one
    error naming the bytes that do not, `what` was read and from where."""
    got = [f.result() for f in _crc_blocks(data, fn)]
    for i, (a, b) in enumerate(zip(got, crcs)):
        if a != b:
            lo, hi = i * CRC_BLOCK, min(n, (i + 1) * CRC_BLOCK)
            raise TensorstowError(
                f"{what} is corrupted in {path}: bytes {lo}..{hi} fail their checksum ({version}; {fn_name} "
                f"{a:#x}, expected {b:#x}). The file was torn or damaged outside tensorstow; restore the "
                "directory from a backup or restart training from scratch in a fresh directory")
    if len(got) != len(crcs):
        raise TensorstowError(f"{what}: MANIFEST lists {len(crcs)} checksums for {n} bytes; the manifest is damaged")


def _fix_step(bufs: list[_Buffer], step: int, key: str, d: Path, last: int | None) -> tuple[list[_Buffer], dict]:
    """A commit's first part, under every buffer's io_lock: wait for the step's writes and
    build the manifest's entries (`key`: its checksum key; `d`, `last`: the store's directory and
    committed step, for errors). Returns (the buffers written, entries)."""
    for b in bufs:
        if b.transient:  # left out of the state: done with, it holds nothing from now on
            for op in b.pending:
                op.complete()
            b.pending, b.last_write, b.synced, b.crc = [], None, None, None
    written = [b for b in bufs if b.last_write is not None]
    for b in written:
        b.last_write.complete()
    failed = [b for b in written if b.last_write.error is not None]
    if failed:
        raise TensorstowError(
            f"SSD store {d}: cannot commit step {step}: the write of "
            f"{', '.join(repr(b.name) for b in failed)} failed ({failed[0].last_write.error}); the "
            f"committed step {last} is untouched; write those buffers again, then commit")
    entries = {}
    for b in bufs:
        new = b.last_write is not None
        entries[b.name] = {"nbytes": b.nbytes, "files": b.files, "slot": 1 - b.slot if new else b.slot,
                           key: b.last_write.crcs if new else b.crc}
    return written, entries


def _check_resumable(d: Path, manifest: dict, owner: str | None, sizes: dict[str, int]) -> str | None:
    """The owner of the store `manifest` records in `d`, refused where it is not `owner` (None: any)
    or its buffers and sizes are not `sizes`."""
    held = manifest.get("owner")
    if owner is not None and held is not None and held != owner:
        raise TensorstowError(f"SSD store {d} holds the training state of another plan (fingerprint "
                              f"{held}, this plan {owner}): execute the plan it was trained with, or start "
                              f"over in it with `tensorstow execute ... --restart`")
    stored = {k: e["nbytes"] for k, e in manifest["buffers"].items()}
    if stored != sizes:
        raise TensorstowError(f"SSD store {d} was created for a different plan ({_differences(stored, sizes)}); "
                              "resume with the plan that created it, or use a fresh directory")
    return owner if owner is not None else held


def _differences(stored: dict[str, int], sizes: dict[str, int]) -> str:
    """What differs between a store's buffers and sizes and a plan's."""
    missing = sorted(set(sizes) - set(stored))
    extra = sorted(set(stored) - set(sizes))
    differ = sorted(k for k in set(sizes) & set(stored) if sizes[k] != stored[k])
    parts = []
    if missing:
        parts.append(f"not in the store: {', '.join(repr(k) for k in missing[:5])}")
    if extra:
        parts.append(f"not in the plan: {', '.join(repr(k) for k in extra[:5])}")
    if differ:
        parts.append("sizes differ: " + ", ".join(f"{k!r} stored {stored[k]} B, plan {sizes[k]} B" for k in differ[:5]))
    return "; ".join(parts)


_crc_pool = ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="tensorstow-crc")


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _crc_blocks(u8: torch.Tensor, fn) -> list:
    """Futures of the checksum `fn` of each CRC_BLOCK of a uint8 tensor."""
    view = memoryview(u8.numpy()) if u8.numel() else memoryview(b"")
    return [_crc_pool.submit(fn, view[a : a + CRC_BLOCK]) for a in range(0, len(view), CRC_BLOCK)]


class _Buffer:
    """Per-buffer state. `io_lock` serializes submissions on this buffer (and commit)."""

    def __init__(self, name: str, nbytes: int, files: list[str], slot: int, crc: list[int] | None):
        self.name, self.nbytes, self.files = name, nbytes, files
        self.slot = slot  # committed slot; the shadow is 1 - slot
        self.crc = crc  # committed checksums; None: never committed
        self.fds: list[int] = []
        self.io_lock = threading.Lock()
        self.pending: list[_Op] = []  # ops that may still be in flight
        self.last_write: _Op | None = None  # this step's latest write, if any
        self.synced: tuple[_Op, Future] | None = None
        """(a write, the future of its early sync: None once its file is synced, else the OSError)."""
        self.transient = False
        """Content that lives within a step: never synced nor committed (`SSDStore.set_transient`)."""


class _Op:
    """One store-level read or write: engine handles plus the work to finish it.

    `wait()` is idempotent and thread-safe: the first caller waits for the engine, runs the
    finishing step (copies, checksum) and records the result; later callers see the result.
    """

    def __init__(self, kind: str, what: str, engine, handles: list[int], keep: list, finish):
        self.kind, self.what = kind, what
        self.crcs: list[int] | None = None
        self.error: Exception | None = None
        self._engine, self._handles, self._keep, self._finish = engine, handles, keep, finish
        self._lock = threading.Lock()
        self._finished = False

    def wait(self) -> None:
        self.complete()
        if self.error is not None:
            raise self.error

    def complete(self) -> None:
        with self._lock:
            if self._finished:
                return
            try:
                first: OSError | None = None
                for h in self._handles:  # every handle, even after a failure: memory stays in use until then
                    try:
                        self._engine.wait(h)
                    except OSError as e:
                        first = first or e
                if first is not None:
                    self.error = TensorstowError(f"{self.what} failed: {describe_os_error(first)}")
                else:
                    self._finish(self)
            except Exception as e:  # recorded, so every waiter sees it, not only the first
                self.error = e
            finally:
                self._finished = True
                self._handles, self._keep, self._finish = [], [], None

    @property
    def done(self) -> bool:
        return self._finished

    @staticmethod
    def submit(engine, what: str, kind: str, fd: int, pieces, keep, finish, first: bool = False) -> _Op:
        """A read or write of `pieces` ((tensor, file offset) pairs) of file `fd`, submitted to `engine`."""
        handles: list[int] = []
        try:
            for tensor, offset in pieces:
                handles.append(engine.submit_write(fd, tensor, offset) if kind == "write"
                               else engine.submit_read(fd, tensor, offset, first=first))
        except BaseException:
            for h in handles:
                try:
                    engine.wait(h)
                except OSError:
                    pass
            raise
        return _Op(kind, what, engine, handles, keep, finish)


class _EarlySyncs:
    """Syncs each written shadow slot as soon as its write completes, on one thread, so a commit
    finds the step's data mostly flushed and the flush spreads over the step instead of stalling
    the next one's first reads (a flush holds the disk: a read queued behind it waits)."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tensorstow-sync")
        self.seconds = 0.0
        """Seconds the early syncs have taken so far, in all (the disk is busy flushing meanwhile)."""

    def start(self, buf: _Buffer, op: _Op, fd: int) -> None:
        """Sync `fd` once `op`, buffer `buf`'s write, completes (`buf.synced`)."""
        buf.synced = (op, self.pool.submit(self._sync, op, fd))

    def _sync(self, op: _Op, fd: int) -> OSError | None:
        op.complete()
        if op.error is not None:
            return None  # the commit reports the write's own error
        t0 = time.perf_counter()
        try:
            os.fdatasync(fd)
        except OSError as e:
            return e
        finally:
            self.seconds += time.perf_counter() - t0
        return None

    @staticmethod
    def for_commit(written: list[_Buffer], d: Path) -> list[tuple[int, Path, Future | None]]:
        """A commit's syncs: per written buffer its shadow slot's fd and path, and the future of
        its early sync when that covered the step's last write (the commit waits for it instead)."""
        out = []
        for b in written:
            early = b.synced[1] if b.synced is not None and b.synced[0] is b.last_write else None
            out.append((b.fds[1 - b.slot], d / b.files[1 - b.slot], early))
        return out

    @staticmethod
    def wait(bufs, forget: bool = False) -> None:
        """Wait for the early syncs of `bufs` (`forget`: and drop them, before their files close)."""
        for b in bufs:
            if b.synced is not None:
                b.synced[1].exception()  # waits; its result is the commit's to read
                if forget:
                    b.synced = None



def _direct_pieces(t: torch.Tensor, n: int):
    """Split the first n bytes of the byte tensor t into O_DIRECT-safe (tensor, file offset)
    pieces: its 4096-aligned prefix in place and the rest through a zero-padded aligned
    staging buffer (all of it when t itself is unaligned). Returns (pieces, staged), staged
    being (user bytes, staging view) pairs to copy in before a write or out after a read."""
    if t.data_ptr() % aio.ALIGN == 0:
        prefix = n - n % aio.ALIGN
        pieces = [(t[:prefix], 0)] if prefix else []
        if n == prefix:
            return pieces, []
        stage, at = aio.aligned_empty(aio.ALIGN), prefix
    else:
        pieces, stage, at = [], aio.aligned_empty(aio.round_up(n)), 0
    stage[n - at:].zero_()
    pieces.append((stage, at))
    return pieces, [(t[at:n], stage[:n - at])]

class SSDStore:
    """Crash-consistent two-slot store for SSD-resident buffers (see the module docstring).

    `sizes` maps buffer name -> byte count. Opening a directory that already holds a store
    resumes it (reads return the committed step's data); its buffers and sizes must equal
    `sizes`. Tensors passed to `write`/`read` are CPU, contiguous, with exactly that many
    bytes (any dtype). Async handles must be waited for before the tensor is reused.
    """

    def __init__(self, dir, sizes: dict[str, int], *, direct: bool = True, engine=None, verify: bool = True,
                 early_sync: bool = True, owner: str | None = None, read_only: bool = False,
                 shared: bool = False):
        self.dir = Path(dir)
        self.shared = shared
        """The directory is a state dir (executor/statedir.py), which tensorstow has vetted and which may
        hold the user's own files too; else the store wants an empty one to create itself in."""
        self.read_only = read_only
        """Open an existing store to read its committed state only (export, evaluate): nothing in
        the directory is created or changed, so it may be read-only for this user; writes,
        commits and rollbacks are refused."""
        self.owner = owner
        """What the store holds the state of (a plan's fingerprint, `executor.statedir.fingerprint`),
        recorded in the manifest: a store of another owner is refused. None: any (an older store's,
        or a caller that does not say)."""
        self._files = StoreFiles(self.dir, read_only, shared)
        """The directory's lock, manifests and slot files (executor.manifest)."""
        self.verify = verify
        """Check checksums on every read (committed data and data written in this step)."""
        self._syncer = _EarlySyncs() if early_sync else None
        self.sync_early = early_sync
        """Whether writes from now on sync early: a caller that commits only every few steps
        (`Executor(checkpoint_every=K)`) turns it off for the steps it will not commit, whose
        writes the next step overwrites anyway (their commit syncs what none covered)."""
        self._engine = engine if engine is not None else aio.default_engine()
        self._commit_lock = threading.Lock()
        self._durable: threading.Thread | None = None
        """A commit's background part (`commit(wait=False)`): its syncs and manifest."""
        self._durable_error: TensorstowError | None = None
        """Why a background commit failed; the store refuses writes and commits from then on."""
        self.durable_s = 0.0
        """Seconds the last commit's own syncs and manifest took (in the background for wait=False;
        not the early syncs it waited for: `early_sync_s` counts those)."""
        self._closed = True
        self._moved = threading.Lock()
        self.bytes_read = 0
        """Bytes of buffers read so far (data, not the files' padding): per-step I/O rates."""
        self.bytes_written = 0
        """Bytes of buffers written so far."""
        self._open(sizes, direct)

    def _open(self, sizes: dict[str, int], direct: bool) -> None:
        """The directory locked, the I/O mode probed, the store created or resumed, its files open."""
        for name, n in sizes.items():
            if not isinstance(name, str) or not name:
                raise TensorstowError(f"SSD store: buffer names must be non-empty strings, got {name!r}")
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise TensorstowError(f"SSD store: size of buffer '{name}' must be a byte count >= 0, got {n!r}")
        self._files.open()
        self._closed = False
        try:
            self.direct, self.io_mode_reason = self._files.probe_direct(direct)
            manifest = self._files.load()
            if manifest is None and self.read_only:
                raise TensorstowError(f"SSD store {self.dir} holds no store (no {MANIFEST}): nothing to read")
            self.version = VERSION if manifest is None else manifest["version"]
            """Manifest version: the checksum the store records (CHECKSUMS)."""
            self._sum_name, self._sum = CHECKSUMS[self.version]
            self._key = entry_key(self.version)
            fresh = manifest is not None and manifest["step"] is None and {
                k: e["nbytes"] for k, e in manifest["buffers"].items()} == sizes
            if (manifest is None or fresh) and not self.read_only:  # none, or never committed: nothing to keep
                self._create(sizes)
            else:
                self._resume(manifest, sizes)
            self._open_files()
        except BaseException:
            self.close()
            raise

    @property
    def early_sync_s(self) -> float:
        """Seconds the early syncs have taken so far, in all (the disk is busy flushing meanwhile)."""
        return 0.0 if self._syncer is None else self._syncer.seconds

    @property
    def recovered(self) -> str | None:
        """How the manifest was recovered (`StoreFiles.load`), where it had to be; else None."""
        return self._files.recovered

    # -- public API -------------------------------------------------------------------------

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write `tensor`'s bytes as the new version of buffer `name` (shadow slot)."""
        self.write_async(name, tensor).wait()

    def read(self, name: str, out: torch.Tensor, first: bool = False, committed: bool = False) -> None:
        """Fill `out` with the latest version of `name`: this step's write, else the committed one
        (`committed`: the committed one even after a write). `first`: a computation waits for it;
        it goes ahead of queued writes (`aio` engines)."""
        self.read_async(name, out, first, committed).wait()

    def write_async(self, name: str, tensor: torch.Tensor) -> _Op:
        buf = self._checked(name, tensor, "write")
        with self._moved:
            self.bytes_written += buf.nbytes
        self._wait_durable()  # a background commit's shadow slots are the last committed state until it is durable
        self._files.settle_recovery()
        with buf.io_lock:
            for op in buf.pending:  # earlier reads and writes of this buffer finish first
                op.complete()
            buf.pending = []
            slot = 1 - buf.slot
            fd, path = buf.fds[slot], self.dir / buf.files[slot]
            what = f"SSD store {self.dir}: writing buffer '{name}' to {path}"
            src = _bytes(tensor)
            n = buf.nbytes
            keep: list = [tensor]
            pieces: list[tuple[torch.Tensor, int]] = []  # (bytes, file offset)
            if self.direct and n:
                pieces, staged = _direct_pieces(src, n)
                for user, stage in staged:
                    stage.copy_(user)
            elif n:
                pieces.append((src, 0))
            keep += [p for p, _ in pieces]
            crc_futures = _crc_blocks(src, self._sum)

            def finish(op: _Op) -> None:
                op.crcs = [f.result() for f in crc_futures]

            op = _Op.submit(self._engine, what, "write", fd, pieces, keep, finish)
            buf.pending = [op]
            buf.last_write = op
            if self._syncer is not None and self.sync_early and not buf.transient:
                self._syncer.start(buf, op, fd)
            return op

    def read_async(self, name: str, out: torch.Tensor, first: bool = False, committed: bool = False) -> _Op:
        buf = self._checked(name, out, "read into")
        with self._moved:
            self.bytes_read += buf.nbytes
        with buf.io_lock:
            if buf.last_write is not None and not committed:
                buf.last_write.complete()
                if buf.last_write.error is not None:
                    raise TensorstowError(f"SSD store {self.dir}: cannot read buffer '{name}': its write in "
                                          f"this step failed ({buf.last_write.error}); write it again")
                slot, crcs, version = 1 - buf.slot, buf.last_write.crcs, "the version written in this step"
            elif buf.crc is not None:
                slot, crcs, version = buf.slot, buf.crc, f"committed step {self._step}"
            else:
                raise TensorstowError(f"SSD store {self.dir}: buffer '{name}' has no data yet: it was never "
                                      "written and committed; write it before reading it")
            buf.pending = [op for op in buf.pending if not op.done]
            fd, path = buf.fds[slot], self.dir / buf.files[slot]
            what = f"SSD store {self.dir}: reading buffer '{name}' ({version}) from {path}"
            dst = _bytes(out)
            n = buf.nbytes
            pieces: list[tuple[torch.Tensor, int]] = []
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (dst, src) after the I/O
            if self.direct and n:
                pieces, copies = _direct_pieces(dst, n)
            elif n:
                pieces.append((dst, 0))
            check = (self._sum, self._sum_name, crcs, f"SSD store {self.dir}: buffer '{name}'", path, version) \
                if self.verify else None

            def finish(op: _Op) -> None:
                for d, src in copies:
                    d.copy_(src)
                if check is not None:
                    _verify(dst, n, *check)

            op = _Op.submit(self._engine, what, "read", fd, pieces, [out, dst], finish, first)
            buf.pending.append(op)
            return op

    def wait(self, handle: _Op) -> None:
        """Block until a `write_async`/`read_async` finished; raise its TensorstowError, if any."""
        handle.wait()

    def commit(self, step: int, *, wait: bool = True) -> None:
        """Make this step's writes the committed state, atomically and durably.

        `wait=False` returns once the step's state is fixed (its writes complete, their checksums
        known) and makes it durable on a background thread (each written file's sync, then the
        manifest), so the caller's next step can compute and read meanwhile; the files it would
        write next hold the last durable commit, so the next write, commit, rollback or close
        waits for it first, as does `committed_step`. If it fails, those raise its error and the
        store takes no more writes: the last durable commit is untouched, resume from it."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise TensorstowError(f"SSD store: commit step must be an int >= 0, got {step!r}")
        self._check_open()
        self._check_writable("commit")
        with self._commit_lock:
            self._wait_durable()
            self._files.settle_recovery()
            bufs = [self._bufs[k] for k in sorted(self._bufs)]
            for b in bufs:  # sorted order: the only place that holds several io_locks
                b.io_lock.acquire()
            try:
                written, entries = _fix_step(bufs, step, self._key, self.dir, self._step)
                syncs = _EarlySyncs.for_commit(written, self.dir)  # shadow slots
                if wait:
                    replaced = self._sync_and_record(step, syncs, entries)
                    self._flip(step, written)
                    if replaced is not None:
                        raise self._dir_sync_error(step, replaced)
                    return
                self._flip(None, written)  # reads now see this step's data as committed
            finally:
                for b in reversed(bufs):
                    b.io_lock.release()

            def durable():
                try:
                    replaced = self._sync_and_record(step, syncs, entries)
                    self._step = step
                    if replaced is not None:
                        self._durable_error = self._dir_sync_error(step, replaced)
                except TensorstowError as e:
                    self._durable_error = e
                except BaseException as e:  # noqa: BLE001 - reported to the next caller, not lost on a thread
                    self._durable_error = TensorstowError(f"SSD store {self.dir}: committing step {step} failed: {e!r}")
            self._durable = threading.Thread(target=durable, name="tensorstow-commit", daemon=True)
            self._durable.start()

    def committed_step(self) -> int | None:
        self._wait_durable()
        return self._step

    def previous_step(self) -> int | None:
        """The step of the commit before the last (None: there is none)."""
        if self._files.recovering:  # MANIFEST.prev is the last commit
            return None
        d = self._files.read(self.dir / PREVIOUS)
        return None if d is None else d["step"]

    def rollback(self) -> int:
        """Make the commit before the last the committed state again; returns its step. Only
        before anything is written after the last commit (its shadow slots still hold that
        commit's bytes): a multi-process run commits, then waits for every rank, then writes."""
        self._check_open()
        self._check_writable("roll back")
        with self._commit_lock:
            self._wait_durable()
            self._files.settle_recovery()
            if any(b.last_write is not None for b in self._bufs.values()):
                raise TensorstowError(f"SSD store {self.dir}: cannot roll back: buffers were written "
                                      f"after the last commit")
            d = self._files.read(self.dir / PREVIOUS)
            if d is None:
                raise TensorstowError(f"SSD store {self.dir}: cannot roll back step {self._step}: no "
                                      f"earlier commit is kept")
            if d.get("version") != self.version:
                raise TensorstowError(f"SSD store {self.dir}: the earlier commit has another version")
            os.replace(self.dir / PREVIOUS, self.dir / MANIFEST)
            self._files.fsync_dir()
            _EarlySyncs.wait(getattr(self, "_bufs", {}).values(), forget=True)
            for b in self._bufs.values():
                for op in b.pending:  # reads in flight finish before their files close
                    op.complete()
                for fd in b.fds:
                    if fd >= 0:
                        os.close(fd)
                b.fds = []
            self._resume(d, self.sizes)
            self._open_files()
            return self._step

    def committed_path(self, name: str) -> Path:
        """The file holding `name`'s committed version."""
        buf = self._bufs[name]
        return self.dir / buf.files[buf.slot]

    @property
    def sizes(self) -> dict[str, int]:
        return {k: b.nbytes for k, b in self._bufs.items()}

    def close(self) -> None:
        """Wait for outstanding I/O, close the files and release the directory lock (no commit)."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_durable", None) is not None:
            # its files close below; an error it had was the caller's to collect. A store whose
            # last reference was the background commit's closes on that thread, which has ended
            if self._durable is not threading.current_thread():
                self._durable.join()
            self._durable = None
        _EarlySyncs.wait(getattr(self, "_bufs", {}).values(), forget=True)
        if getattr(self, "_syncer", None) is not None:
            self._syncer.pool.shutdown(wait=True)
        for buf in getattr(self, "_bufs", {}).values():
            for op in buf.pending:
                op.complete()
            for fd in buf.fds:
                if fd >= 0:
                    os.close(fd)
            buf.fds = []
        self._files.release()

    def __enter__(self) -> SSDStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()

    def __repr__(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered+fsync"
        return f"SSDStore({str(self.dir)!r}, {len(self._bufs)} buffers, {mode}, committed step {self._step})"

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TensorstowError(f"SSD store {self.dir} is closed")

    def _check_writable(self, verb: str) -> None:
        if self.read_only:
            raise TensorstowError(f"SSD store {self.dir} is open read-only: cannot {verb}")

    def _checked(self, name: str, tensor: torch.Tensor, verb: str) -> _Buffer:
        self._check_open()
        if not verb.startswith("read"):
            self._check_writable(f"{verb} buffer '{name}'")
        buf = self._bufs.get(name)
        if buf is None:
            raise TensorstowError(f"SSD store {self.dir}: unknown buffer '{name}' (the store holds "
                                  f"{len(self._bufs)} buffers: {', '.join(sorted(self._bufs)[:5])}...)")
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise TensorstowError(f"SSD store: cannot {verb} buffer '{name}': need a contiguous CPU tensor")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != buf.nbytes:
            raise TensorstowError(f"SSD store: cannot {verb} buffer '{name}': the tensor has {nbytes} bytes, "
                                  f"the buffer {buf.nbytes}")
        return buf

    def set_transient(self, names) -> None:
        """Mark buffers whose content lives only within a step (the executor: those of its plan
        that have no home, such as activations swapped to SSD): their writes are not synced and
        commits leave them out, so after a commit they hold no data until written again."""
        names = set(names)
        unknown = sorted(names - set(self._bufs))
        if unknown:
            raise TensorstowError(f"SSD store {self.dir}: no buffer {unknown[0]!r} to mark transient")
        for name, b in self._bufs.items():
            b.transient = name in names

    def wait_background(self) -> None:
        """Wait until none of the store's background work runs: the last commit's syncs and
        manifest (`commit(wait=False)`) and the early syncs of this step's writes. Changes no
        state; raises what a background commit failed with. (`benchmarks/bench_deepspeed.py`
        calls it between the turns of engines that take turns on one machine.)"""
        self._wait_durable()
        _EarlySyncs.wait(self._bufs.values())

    def _sync_and_record(self, step: int, syncs: list[tuple[int, Path, Future | None]], entries: dict) -> OSError | None:
        """Sync the written files, then replace the manifest: raises TensorstowError before the
        rename, returns the directory sync's error after it (None: durable)."""
        own = 0.0  # the syncs and manifest this commit runs itself, not the early syncs it waits for
        for fd, path, early in syncs:
            try:
                err = early.result() if early is not None else None
                if err is not None:
                    raise err  # a failed sync is not retried: the kernel may have dropped the pages
                if early is None:
                    t0 = time.perf_counter()
                    os.fdatasync(fd)
                    own += time.perf_counter() - t0
            except OSError as e:
                raise TensorstowError(
                    f"SSD store {self.dir}: cannot commit step {step}: syncing {path} failed: "
                    f"{describe_os_error(e)}; the committed step {self._step} is untouched") from None
        t0 = time.perf_counter()
        replaced = self._files.write(manifest_content(self.version, self.owner, step, entries),
                                     f"commit step {step}", self._step)
        self.durable_s = own + time.perf_counter() - t0
        return replaced

    def _dir_sync_error(self, step: int, e: OSError) -> TensorstowError:
        return TensorstowError(f"SSD store {self.dir}: step {step} was committed but syncing the directory "
                               f"failed ({describe_os_error(e)}); a crash now may bring back the previous "
                               "committed step; check the disk")

    def _flip(self, step: int | None, written: list[_Buffer]) -> None:
        """The written shadow slots become the buffers' current ones (`step`: now the durable one)."""
        for b in written:
            b.slot, b.crc, b.last_write = 1 - b.slot, b.last_write.crcs, None
        if step is not None:
            self._step = step

    def _wait_durable(self) -> None:
        """Wait for a background commit; raise (now and from then on) if it failed."""
        if self._durable is not None:
            self._durable.join()
            self._durable = None
        if self._durable_error is not None:
            raise TensorstowError(f"{self._durable_error} (in the background, after the step; the store takes "
                                  f"no more writes: close it and resume from the committed step)")

    def _create(self, sizes: dict[str, int]) -> None:
        """A new store: its manifest (never committed) first, then its preallocated slot files (a crash
        between leaves a store that never committed, which the next open creates again)."""
        self._bufs = {name: _Buffer(name, n, slot_files(name), 0, None) for name, n in sizes.items()}
        self._step = None
        self._files.prepare({f: aio.round_up(b.nbytes) for b in self._bufs.values() for f in b.files})
        entries = {b.name: {"nbytes": b.nbytes, "files": b.files, "slot": 0, self._key: None}
                   for b in self._bufs.values()}
        err = self._files.write(manifest_content(self.version, self.owner, None, entries), "create the store", None)
        if err is not None:
            raise TensorstowError(f"SSD store {self.dir}: syncing the directory failed: {describe_os_error(err)}")
        for b in self._bufs.values():
            for f in b.files:
                self._files.preallocate(self.dir / f, aio.round_up(b.nbytes))

    def _resume(self, manifest: dict, sizes: dict[str, int]) -> None:
        """The store a manifest records: it must be this owner's, of these buffers and sizes."""
        self.owner = _check_resumable(self.dir, manifest, self.owner, sizes)
        self._step = manifest["step"]
        self._bufs = {}
        for name, e in manifest["buffers"].items():
            self._files.check_slots(name, e["files"], e["slot"], e["nbytes"])
            self._bufs[name] = _Buffer(name, e["nbytes"], e["files"], e["slot"], e[self._key])

    def _open_files(self) -> None:
        flags = (os.O_RDONLY if self.read_only else os.O_RDWR) | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        for b in self._bufs.values():
            for k, f in enumerate(b.files):
                if self.read_only and k != b.slot:
                    b.fds.append(-1)  # the shadow: never read
                    continue
                try:
                    b.fds.append(os.open(self.dir / f, flags))
                except OSError as e:
                    if e.errno in NOT_WRITABLE:
                        raise not_writable(self.dir, e) from None
                    raise
