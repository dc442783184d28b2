"""Asynchronous file I/O for the SSD tier: the C++ engine (csrc/aio.cpp) or a Python fallback.

Both engines have one API::

    engine.submit_read(fd, tensor, offset, first=False) -> int  # fill `tensor` from the file at `offset`
    engine.submit_write(fd, tensor, offset) -> int   # write `tensor`'s bytes at `offset`
    engine.wait(handle) -> None                      # block; OSError(errno, "... at file offset N ...")
    engine.done(handle) -> bool
    engine.num_threads, engine.block_size, engine.queue_depth

Tensors are CPU and contiguous; a request is split into `block_size` chunks that the worker
threads run in parallel. Reads submitted with `first` (what a computation waits for) go
ahead: a free worker takes their next chunk before any other request's, so they do not queue
behind a long write-back (the planner's simulator models this: such a read pauses the SSD write
in progress); everything else runs in order. At most `queue_depth` chunks of each kind are
queued or running at once. On an fd opened with O_DIRECT
the data pointer, byte count and offset must be multiples of 4096 (`aligned_empty` gives
such buffers). The caller keeps the fd open and leaves the tensor alone until `wait`.

`load_engine()` JIT-builds the C++ engine once (cached under $TENSORSTOW_CACHE, else
$TORCH_EXTENSIONS_DIR/tensorstow, else ~/.cache/tensorstow) and falls back to `PythonEngine`
when the build fails; `engine_info()` says which one is active and why.
`execute --io-engine python` forces the fallback, `--io-engine cpp` makes a failed build an error
(`engine_choice`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from tensorstow.errors import TensorstowError
from tensorstow.schema.schedule import PAGE_BYTES

ALIGN = PAGE_BYTES
"""O_DIRECT alignment (bytes) of data pointers, sizes and file offsets: the plan's page."""

DEFAULT_THREADS = 4
DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_QUEUE_DEPTH = 64

_CSRC = Path(__file__).resolve().parent.parent / "csrc" / "aio.cpp"
_EXT_NAME = "tensorstow_aio"


def round_up(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


def aligned_empty(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A 1-D CPU tensor of `nbytes` bytes whose data pointer is 4096-aligned.

    Over-allocates by one page and slices; the storage extends at least to the next multiple
    of 4096 past the end, so O_DIRECT I/O of the padded size stays inside the allocation.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes < 0 or nbytes % itemsize:
        raise ValueError(f"aligned_empty: {nbytes} bytes is not a whole number of {dtype} elements")
    raw = torch.empty(round_up(nbytes) + ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN
    out = raw[start : start + nbytes].view(dtype)
    assert out.data_ptr() % ALIGN == 0
    return out


HUGE_PAGE = 2 << 20
"""x86-64's transparent huge page (bytes)."""


def huge_empty(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of `nbytes` in a fresh anonymous mapping of its own, 2 MiB-aligned,
    with transparent huge pages asked for before any page is touched (`MADV_HUGEPAGE`: THP in
    `madvise` mode is the common default). For the long-lived host buffers SSD I/O moves: their
    physical pages come 2 MiB at a time, so each 1 MiB chunk the engine's workers move is a
    handful of contiguous segments: a virtio request over scattered 4 KiB pages has a segment per
    page, and memory carved from the heap after eager PyTorch has run is already faulted in small
    pages that a later `madvise` does not change (benchmarks/RESULTS.md "Huge pages"). The mapping
    is unmapped when the
    tensor (and every view of it) is collected. Where the platform has no `MADV_HUGEPAGE` (or no
    anonymous mmap) this is `aligned_empty`."""
    import mmap
    if nbytes <= 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return aligned_empty(max(nbytes, 0))
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    try:
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return aligned_empty(nbytes)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` while any view lives
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, size)  # advice: small pages where THP is off
    except OSError:
        pass
    return whole[start:start + nbytes]


def is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


class PythonEngine:
    """Pure-Python engine with the C++ engine's API: a thread pool of os.preadv/os.pwritev."""

    def __init__(self, num_threads: int = DEFAULT_THREADS, block_size: int = DEFAULT_BLOCK_SIZE,
                 queue_depth: int = DEFAULT_QUEUE_DEPTH):
        if not 1 <= num_threads <= 256:
            raise ValueError(f"aio Engine: num_threads must be in [1, 256], got {num_threads}")
        if block_size < ALIGN or block_size % ALIGN:
            raise ValueError("aio Engine: block_size must be a positive multiple of 4096 bytes "
                             f"(O_DIRECT alignment), got {block_size}")
        if queue_depth < 1:
            raise ValueError(f"aio Engine: queue_depth must be >= 1, got {queue_depth}")
        self.num_threads, self.block_size, self.queue_depth = num_threads, block_size, queue_depth
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tensorstow-aio")
        self._slots = (threading.BoundedSemaphore(queue_depth), threading.BoundedSemaphore(queue_depth))
        """Chunks that may be queued or running: `first` reads, the rest."""
        self._queues: tuple[deque, deque] = (deque(), deque())
        """Chunks no worker has taken yet, `first` reads and the rest: each pool task runs the next one."""
        self._lock = threading.Lock()
        self._requests: dict[int, tuple[torch.Tensor, list[Future]]] = {}
        self._next = 1

    def submit_read(self, fd: int, tensor: torch.Tensor, offset: int, first: bool = False) -> int:
        return self._submit(fd, tensor, offset, write=False, first=first)

    def submit_write(self, fd: int, tensor: torch.Tensor, offset: int) -> int:
        return self._submit(fd, tensor, offset, write=True)

    def wait(self, handle: int) -> None:
        with self._lock:
            if handle not in self._requests:
                raise ValueError(f"aio wait: unknown handle {handle} (never submitted, or already waited for)")
            _, futures = self._requests.pop(handle)
        errors = [f.result() for f in futures]  # every chunk finishes before wait returns
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise OSError(*first)

    def done(self, handle: int) -> bool:
        with self._lock:
            if handle not in self._requests:
                raise ValueError(f"aio done: unknown handle {handle} (never submitted, or already waited for)")
            return all(f.done() for f in self._requests[handle][1])

    def _submit(self, fd: int, tensor: torch.Tensor, offset: int, *, write: bool, first: bool = False) -> int:
        op = "submit_write" if write else "submit_read"
        if tensor.device.type != "cpu":
            raise ValueError(f"aio {op}: tensor must be on the CPU, got {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"aio {op}: tensor must be contiguous")
        if offset < 0:
            raise ValueError(f"aio {op}: file offset must be >= 0, got {offset}")
        if fd < 0:
            raise ValueError(f"aio {op}: invalid file descriptor {fd}")
        try:
            direct = is_direct(fd)
        except OSError as e:
            raise ValueError(f"aio {op}: fd {fd} is not an open file ({e.strerror})") from None
        nbytes = tensor.numel() * tensor.element_size()
        ptr = tensor.data_ptr()
        if direct and (ptr % ALIGN or nbytes % ALIGN or offset % ALIGN):
            raise ValueError(
                f"aio {op}: fd {fd} is open with O_DIRECT, so the data pointer, the byte count and the "
                f"file offset must all be multiples of 4096; got pointer {ptr:#x}, {nbytes} bytes, "
                f"offset {offset} (allocate with tensorstow.executor.aio.aligned_empty and pad to 4096)")
        view = _byte_view(tensor) if nbytes else memoryview(b"")
        futures = []
        for start in range(0, nbytes, self.block_size):
            q = 0 if first else 1
            self._slots[q].acquire()
            fut: Future = Future()
            with self._lock:
                self._queues[q].append((fut, q, fd, view[start : start + self.block_size], offset + start, write))
            self._pool.submit(self._next_chunk)
            futures.append(fut)
        with self._lock:
            handle = self._next
            self._next += 1
            self._requests[handle] = (tensor, futures)
        return handle

    def _next_chunk(self) -> None:
        """One pool task: run the oldest queued `first` chunk, else the oldest other one."""
        with self._lock:
            fut, q, fd, chunk, offset, write = (self._queues[0] or self._queues[1]).popleft()
        try:
            fut.set_result(self._run_chunk(fd, chunk, offset, write))
        except BaseException as e:  # noqa: BLE001 - the waiter re-raises it
            fut.set_exception(e)
        finally:
            self._slots[q].release()

    @staticmethod
    def _run_chunk(fd: int, chunk: memoryview, offset: int, write: bool):
        """Runs one chunk; returns None or the (errno, message) of its OSError."""
        name = "pwrite" if write else "pread"
        what = f"{name} of {len(chunk)} bytes at file offset {offset} (fd {fd})"
        done = 0
        while done < len(chunk):
            try:
                part = chunk[done:]
                n = os.pwritev(fd, [part], offset + done) if write else os.preadv(fd, [part], offset + done)
            except OSError as e:  # EINTR is retried by Python itself (PEP 475)
                return e.errno, f"{what} failed after {done} bytes: {e.strerror}"
            if n == 0:
                if write:
                    return errno.ENOSPC, f"{what} wrote nothing after {done} bytes: {os.strerror(errno.ENOSPC)}"
                return errno.EIO, f"{what} hit end of file after {done} bytes (file too short)"
            done += n
        return None


# ---------------------------------------------------------------------------------------------
# Loading the C++ engine

_load_lock = threading.Lock()
_default_lock = threading.Lock()
_module = None
_status: str | None = None  # why the active engine is the one it is
_default_engine = None
_default_info: str | None = None


def ext_cache_dir(name: str, source: Path) -> Path:
    """Where a C++ extension is built and cached: keyed by torch, Python, the environment (its
    prefix and torch's install path), the source's path and its hash. A build records its
    environment's paths and its source's path, and `cpp_extension.load` from another venv or
    another checkout would rebuild it, each undoing the other's (14-40 s a first step); checkouts
    with different sources never load each other's builds."""
    if os.environ.get("TENSORSTOW_CACHE"):
        root = Path(os.environ["TENSORSTOW_CACHE"])
    elif os.environ.get("TORCH_EXTENSIONS_DIR"):
        root = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "tensorstow"
    else:
        root = Path.home() / ".cache" / "tensorstow"
    import hashlib
    digest = hashlib.sha256(source.read_bytes() + str(source.resolve()).encode()).hexdigest()[:12]
    env = hashlib.sha256(f"{sys.prefix}|{Path(torch.__file__).parent}".encode()).hexdigest()[:8]
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info.major}{sys.version_info.minor}-{env}"
    return root / "torch_extensions" / tag / f"{name}-{digest}"


def cache_dir() -> Path:
    """Where the I/O engine is built and cached."""
    return ext_cache_dir(_EXT_NAME, _CSRC)


def compile_extension(name: str, source: Path, **load_kwargs):
    """`cpp_extension.load` of `source` into `ext_cache_dir(name, source)`: built once, then loaded.

    torch serializes builders with a lock *file* in the build directory that only a builder
    which finishes removes: one killed mid-build (Ctrl-C twice, SIGKILL, an OOM kill) leaves it
    behind, and every later load waits on it forever. Builders here first take an flock on a
    sidecar file, which the kernel releases when its holder dies; holding it, a torch lock file
    can only be a dead builder's, so it is removed. Returns (whatever load returns, build_dir).
    """
    from torch.utils import cpp_extension

    build_dir = ext_cache_dir(name, source)
    build_dir.mkdir(parents=True, exist_ok=True)
    bin_dir = os.path.dirname(sys.executable)  # pip's ninja lands next to the interpreter
    old_path = os.environ.get("PATH", "")
    if bin_dir not in old_path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + old_path
    try:
        with open(build_dir / "build.flock", "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released on close, or by the kernel if we die
            (build_dir / "lock").unlink(missing_ok=True)  # torch's baton, left by a killed builder
            module = cpp_extension.load(name=name, sources=[str(source)], build_directory=str(build_dir),
                                        verbose=False, **load_kwargs)
    finally:
        os.environ["PATH"] = old_path
    return module, build_dir


def build_extension():
    """The compiled `tensorstow_aio` module (built on first use, ~20 s; then loaded from cache).

    Raises RuntimeError (with the compiler's message) when it cannot be built. Thread-safe;
    concurrent processes are serialized by `compile_extension`'s lock.
    """
    global _module, _status
    with _load_lock:
        if _module is not None:
            return _module
        try:
            _module, build_dir = compile_extension(_EXT_NAME, _CSRC, extra_cflags=["-O3"])
        except Exception as e:  # the compiler, ninja or the loader: all mean "no C++ engine"
            raise RuntimeError(f"building the C++ aio engine from {_CSRC} in {cache_dir()} failed: "
                               f"{first_error_line(e)}") from e
        _status = f"C++ thread-pool engine (tensorstow_aio: pread/pwrite, io_uring not used), built/cached in {build_dir}"
        return _module


def first_error_line(e: BaseException) -> str:
    """The line of a failed build's message that says what failed (compilers print walls)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else repr(e))


ENGINES = ("auto", "cpp", "python")
engine_choice = "auto"
"""The engine `load_engine` gives (`execute --io-engine`): cpp, the C++ thread pool (built on first
use; a failed build is an error); python, the `PythonEngine`; auto, cpp where it builds."""


def load_engine(num_threads: int = DEFAULT_THREADS, block_size: int = DEFAULT_BLOCK_SIZE,
                queue_depth: int = DEFAULT_QUEUE_DEPTH):
    """A new engine: the C++ one when it builds (or is cached), else `PythonEngine`."""
    global _status
    choice = engine_choice
    if choice not in ENGINES:
        raise TensorstowError(f"I/O engine {choice!r}: use {', '.join(ENGINES)}")
    if choice == "python":
        _status = "Python fallback engine (os.preadv/os.pwritev thread pool): --io-engine python"
        return PythonEngine(num_threads, block_size, queue_depth)
    try:
        module = build_extension()
    except RuntimeError as e:
        if choice == "cpp":
            raise
        _status = f"Python fallback engine (os.preadv/os.pwritev thread pool): {e}"
        return PythonEngine(num_threads, block_size, queue_depth)
    return module.Engine(num_threads, block_size, queue_depth)


def default_engine():
    """One shared engine per process (the default of `SSDStore(engine=None)`)."""
    global _default_engine, _default_info
    with _default_lock:
        if _default_engine is None:
            _default_engine = load_engine()
            _default_info = _status
    return _default_engine


def engine_info() -> str:
    """Which engine `load_engine()` gives and why (builds or loads the C++ engine if needed)."""
    engine = default_engine()
    return (f"aio: {_default_info}; {engine.num_threads} threads, block {engine.block_size // 1024} KiB, "
            f"queue depth {engine.queue_depth}")
