"""The SSD store's files on disk (executor/ssd.py keeps the I/O and the commit protocol on them).

A store's directory holds, per buffer, two preallocated slot files (`slot_files`) and one
MANIFEST that names each buffer's committed slot and its checksums; MANIFEST.prev is the commit
before the last. A manifest is written to MANIFEST.tmp, fsynced, renamed over MANIFEST (the old one
kept as MANIFEST.prev) and the directory fsynced (`StoreFiles.write`); version 3 on, it carries a
checksum of itself. An open reads the newest valid one (`StoreFiles.load`: MANIFEST, else
MANIFEST.prev, which the first change then makes the manifest: `settle_recovery`). A LOCK file's
flock keeps one store (or one `--restart`) at a time in a directory.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import zlib
from pathlib import Path

import xxhash

from tensorstow.errors import TensorstowError
from tensorstow.executor import aio

log = logging.getLogger("tensorstow.executor.ssd")

MANIFEST = "MANIFEST"
PREVIOUS = "MANIFEST.prev"
"""The manifest of the commit before the last: `rollback()` returns to it (a multi-process run
whose other ranks did not commit the last step). A commit renames MANIFEST to it just before it
renames the new one in; a crash between the two leaves it alone, and it is the last commit."""
FORMAT = "tensorstow-ssd-store"
VERSION = 3
CHECKSUMS = {1: ("crc32", zlib.crc32), 2: ("xxh3_64", xxhash.xxh3_64_intdigest), 3: ("xxh3_64", xxhash.xxh3_64_intdigest)}
"""Manifest version -> (name, function) of the block checksum it records. XXH3 is about ten times
as fast as zlib's CRC-32 on one core (benchmarks/RESULTS.md "I/O engine"); both release the GIL. Version 3 adds the manifest's
checksum of itself (`SELF_CHECK`). A store keeps the version it was made with, so one made by an
older tensorstow resumes as it was written."""
CRC_BLOCK = 16 << 20
"""Bytes covered by one checksum in the manifest."""
SELF_CHECK = "manifest_xxh3"
"""The manifest's checksum of itself: XXH3-64 of its other keys as sorted JSON (version 3 on)."""


def manifest_sum(content: dict) -> int:
    """The manifest's checksum of itself (`SELF_CHECK`)."""
    rest = {k: v for k, v in content.items() if k != SELF_CHECK}
    return xxhash.xxh3_64_intdigest(json.dumps(rest, sort_keys=True).encode())


OWN_FILE = re.compile(r"(MANIFEST|MANIFEST\.tmp|MANIFEST\.prev|MANIFEST\.damaged|LOCK|\.direct-probe|.+\.slot[01]|"
                      r"(plan|layout|config|adapter_config)\.json(\.tmp)?)")
"""The store's files, and the state dir's description of them (executor/statedir.py)."""


def entry_key(version: int) -> str:
    """The manifest key of a buffer's checksum list."""
    return "crc32" if version == 1 else "checksums"


def manifest_content(version: int, owner: str | None, step: int | None, entries: dict) -> dict:
    """A manifest of `version` recording `step` (None: never committed) and each buffer's entry."""
    content = {"format": FORMAT, "version": version, "step": step, "crc_block": CRC_BLOCK, "buffers": entries,
               **({"checksum": CHECKSUMS[version][0]} if version > 1 else {}),
               **({"owner": owner} if owner is not None and version >= 3 else {})}
    if version >= 3:  # the manifest checks itself: an edited or torn one is not trusted
        content[SELF_CHECK] = manifest_sum(content)
    return content


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


SLOT_FILE = re.compile(r".+-[0-9a-f]{10}\.slot[01]")
"""A slot file's name as `slot_files` makes it (a user's `x.slot0` in a state dir is not one)."""


def slot_files(name: str) -> list[str]:
    """The two slot files of buffer `name`."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return [f"{safe}-{digest}.slot0", f"{safe}-{digest}.slot1"]


NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
"""What an open for writing fails with in a directory this user may not write (or a read-only
filesystem)."""


def describe_os_error(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return f"disk full ({e.strerror})"
    return str(e)


def not_writable(path, e: OSError) -> TensorstowError:
    return TensorstowError(f"SSD store: cannot write in {path} ({e.strerror}): give this user write access to it, "
                           f"or use another state directory")


def lock(d: Path, read_only: bool = False) -> int | None:
    """flock `d`/LOCK, exclusively, or refuse: one store (or `--restart`) at a time in a directory.
    Returns the lock's descriptor (closing it releases the lock); None for a reader of a directory
    it may not write and that holds no lock file (no process of this user can be writing it)."""
    path = d / "LOCK"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno not in NOT_WRITABLE:
            raise TensorstowError(f"SSD store: cannot open {path}: {e}") from None
        if not read_only:
            raise not_writable(d, e) from None
        try:  # a reader of a directory it may not write: the lock file read-only (flock takes any open file)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e2:
            raise TensorstowError(f"SSD store: cannot open {path}: {e2}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TensorstowError(f"SSD store {d} is locked by another tensorstow process or store object "
                              f"(an execute or export still running on it); wait for it to finish, "
                              f"or use another directory") from None
    return fd


@contextlib.contextmanager
def dir_lock(d: Path):
    """Hold `d`'s store lock while the caller changes its files (`--restart` deleting them)."""
    fd = lock(d)
    try:
        yield
    finally:
        os.close(fd)


class StoreFiles:
    """One store directory's files (the module docstring): its lock, its manifests, its slot files.
    `read_only`: nothing in the directory is created or changed; `shared`: a state dir, which may
    hold the user's own files too (else a new store wants an empty directory)."""

    def __init__(self, d, read_only: bool = False, shared: bool = False):
        self.dir, self.read_only, self.shared = Path(d), read_only, shared
        self.recovering = False
        """The committed state was read from MANIFEST.prev and the files still say otherwise
        (`settle_recovery`)."""
        self.recovered: str | None = None
        """How the manifest was recovered (`load`), where it had to be; else None."""
        self.lock_fd: int | None = None

    def open(self) -> None:
        """The directory (made where missing) and its lock."""
        if self.read_only and not self.dir.is_dir():
            raise TensorstowError(f"SSD store: {self.dir} is not a directory")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if e.errno in NOT_WRITABLE:
                raise not_writable(self.dir.parent, e) from None
            raise TensorstowError(f"SSD store: cannot create directory {self.dir}: {e}") from None
        self.lock_fd = lock(self.dir, self.read_only)

    def release(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = None

    def probe_direct(self, want: bool) -> tuple[bool, str]:
        """Whether the slot files open with O_DIRECT here, and why (or why not)."""
        if self.read_only:
            return False, "buffered reads: opened read-only"
        if not want:
            return False, "buffered I/O + fsync: direct=False was requested"
        path = self.dir / ".direct-probe"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644)
            try:
                page = aio.aligned_empty(aio.ALIGN)
                page.zero_()
                os.pwritev(fd, [memoryview(page.numpy())], 0)
                os.preadv(fd, [memoryview(page.numpy())], 0)
            finally:
                os.close(fd)
                path.unlink()
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk says nothing of O_DIRECT: the
                return False, f"buffered I/O + fsync: {self.dir} is full"  # first write reports it
            if e.errno in NOT_WRITABLE:  # says nothing of O_DIRECT either: the store cannot work here
                raise not_writable(self.dir, e) from None
            reason = (f"buffered I/O + fsync: the filesystem of {self.dir} refuses O_DIRECT "
                      f"({e.strerror})")
            log.warning("SSD store: %s", reason)
            return False, reason
        return True, "O_DIRECT"


    def load(self, path: Path | None = None) -> dict | None:
        """The newest valid manifest: MANIFEST, else MANIFEST.prev (a crash inside a commit leaves
        only it; a damaged or deleted MANIFEST leaves it as the last readable commit: `recovered`
        says so); None for a directory without a store. One holding store files but no valid
        manifest is refused: its committed state cannot be read."""
        if path is not None:
            return self.read(path)
        main, prev = self.dir / MANIFEST, self.dir / PREVIOUS
        why = f"{MANIFEST} is missing"
        try:
            d = self.read(main)
            if d is not None:
                return d
        except TensorstowError as e:
            why = str(e)
        try:
            d = self.read(prev)
        except TensorstowError as e:
            d, why = None, f"{why}; {e}"
        if d is not None:
            if self.read_only:
                self.recovered = f"{why.rstrip('.')}: read from {PREVIOUS} (step {d['step']})"
                return d
            # set right on disk by the first write, commit or rollback (`settle_recovery`): an open
            # that goes no further (a resume refused before any step) leaves the directory as it was
            self.recovering = True
            self.recovered = f"{why.rstrip('.')}: resumed from {PREVIOUS} (step {d['step']})"
            return d
        slots = sorted(p.name for p in self.dir.iterdir() if SLOT_FILE.fullmatch(p.name))
        if slots or main.exists():
            raise TensorstowError(
                f"SSD store {self.dir} holds {len(slots)} store files but no valid manifest ({why}): its committed "
                f"state cannot be read; restore {MANIFEST} or {PREVIOUS} from a backup, or start over in it "
                f"deliberately with `tensorstow execute ... --restart` (deletes the store)")
        return None


    def read(self, path: Path) -> dict | None:
        """The manifest at `path` (None where there is none); TensorstowError where it is invalid."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TensorstowError(f"SSD store: cannot read {path}: {e}") from None
        try:
            d = json.loads(raw)
            if d.get("format") != FORMAT:
                raise ValueError(f"format is {d.get('format')!r}, not {FORMAT!r}")
            if d.get("version") not in CHECKSUMS:
                raise ValueError(f"version {d.get('version')!r}; this tensorstow reads versions {sorted(CHECKSUMS)}")
            key = entry_key(d["version"])
            if d.get("crc_block") != CRC_BLOCK:
                raise ValueError(f"crc_block {d.get('crc_block')!r}, expected {CRC_BLOCK}")
            if not isinstance(d.get("buffers"), dict):
                raise ValueError("'buffers' is not an object")
            if d["version"] >= 3 and d.get(SELF_CHECK) != manifest_sum(d):
                raise ValueError("it fails its own checksum (edited or torn)")
            for name, e in d["buffers"].items():
                if not (isinstance(e, dict) and e.get("slot") in (0, 1) and isinstance(e.get("nbytes"), int)
                        and isinstance(e.get("files"), list) and len(e["files"]) == 2
                        and all(isinstance(f, str) and "/" not in f for f in e["files"])
                        and (e.get(key) is None or isinstance(e[key], list))):
                    raise ValueError(f"entry of buffer {name!r} is malformed")
        except (ValueError, AttributeError, TypeError) as e:  # not JSON, not an object, a wrong type
            raise TensorstowError(f"{path.name} is not a valid tensorstow SSD store manifest ({e})") from None
        return d


    def write(self, content: dict, what: str, last_step: int | None) -> OSError | None:
        """Atomically replace MANIFEST with `content`. Raises before the rename (naming `what` the
        caller could not do and the `last_step` committed); returns a directory-sync error after it."""
        body = json.dumps(content, sort_keys=True, indent=1).encode() + b"\n"
        tmp, final = self.dir / (MANIFEST + ".tmp"), self.dir / MANIFEST
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            if final.exists():  # kept for rollback(); a crash before the next rename leaves it as the last commit
                os.replace(final, self.dir / PREVIOUS)
            os.replace(tmp, final)
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            last = "none" if last_step is None else last_step
            raise TensorstowError(f"SSD store {self.dir}: cannot {what}: writing {final} failed: "
                                  f"{describe_os_error(e)}; the committed state (step {last}) is "
                                  "untouched") from None
        try:
            self.fsync_dir()
        except OSError as e:
            return e
        return None


    def fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def settle_recovery(self) -> None:
        """Where the open resumed from MANIFEST.prev, make that the manifest on disk (a damaged
        MANIFEST set aside as MANIFEST.damaged), before anything in the store changes."""
        if not self.recovering:
            return
        main = self.dir / MANIFEST
        if main.exists():
            os.replace(main, self.dir / (MANIFEST + ".damaged"))
        os.replace(self.dir / PREVIOUS, main)
        self.fsync_dir()
        self.recovering = False


    def prepare(self, files: dict[str, int]) -> None:
        """Before a new store's manifest: the directory holds nothing else (but a state dir), and
        the disk has room for `files` (name -> size) beyond what they hold already."""
        self.settle_recovery()
        strangers = [] if self.shared else sorted(p.name for p in self.dir.iterdir() if not OWN_FILE.fullmatch(p.name))
        if strangers:
            raise TensorstowError(f"SSD store: {self.dir} has no {MANIFEST} but holds other files "
                                  f"({', '.join(strangers[:3])}); give the store an empty directory")
        need = 0
        for f, size in files.items():
            p = self.dir / f
            need += max(0, size - (p.stat().st_size if p.exists() else 0))
        free = shutil.disk_usage(self.dir).free
        if need > free:
            raise TensorstowError(f"SSD store: {self.dir} needs {fmt_bytes(need)} more for "
                                  f"{len(files)} preallocated files but only {fmt_bytes(free)} is "
                                  "free; free space or choose a larger disk")

    def preallocate(self, path: Path, size: int) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                if size:
                    try:
                        os.posix_fallocate(fd, 0, size)
                    except OSError as e:
                        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                            raise
                os.ftruncate(fd, size)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise TensorstowError(f"SSD store: cannot preallocate {path} ({fmt_bytes(size)}): "
                                  f"{describe_os_error(e)}; free space or choose a larger disk") from None


    def check_slots(self, name: str, files: list[str], slot: int, nbytes: int) -> None:
        """A resumed buffer's slot files: the committed one whole, the shadow preallocated (made
        again where it is missing or short: it holds nothing committed)."""
        size_needed = aio.round_up(nbytes)
        for k, f in enumerate(files):
            p = self.dir / f
            size = p.stat().st_size if p.exists() else None
            if k != slot and (size is None or size < size_needed):  # the shadow holds nothing committed
                if not self.read_only:
                    self.preallocate(p, size_needed)
                continue
            if size is None or size < size_needed:
                state = "is missing" if size is None else f"has {size} bytes, expected {size_needed}"
                raise TensorstowError(f"SSD store {self.dir} is damaged: {p} (buffer '{name}') {state}; "
                                      "restore the directory from a backup or use a fresh one")
