"""glibc's malloc set up for a step that frees and re-allocates the same buffers every step.

An executor step allocates every activation, intermediate and device-tier copy of a block and
frees it again soon after (the static schedule's `free`), the next step the same sizes. Under
glibc's defaults each allocation of 128 KiB and up (its threshold grows with what was freed, up to
32 MiB) is a fresh `mmap` and each free an `munmap`, so every step faults in and zeroes its pages
again: on the 2-core VM that was 0.03 s of a 0.27 s gpt-small step (benchmarks/RESULTS.md).
`tune()` serves those sizes from the heap and keeps freed memory for reuse, which is what jemalloc
with `retain:true` and PyTorch's CUDA caching allocator do for their memory.

What it changes:
- no `mmap` of its own (`M_MMAP_MAX` 0; the threshold fixed at glibc's maximum, 32 MiB, where
  another setting lets it map): a tensor of 32 MiB and up comes from the heap too, a freed one's
  pages reused by the next. Mapped and given back each time, each such tensor faulted its pages in
  again: a QLoRA step's dequantized 96 MiB weights took 45-48 ms each against 14 ms from the heap,
  a 3B model's 64-token step 20.3 s against 17.0 (benchmarks/RESULTS.md "QLoRA larger than DRAM");
- no trimming as blocks are freed (`M_TRIM_THRESHOLD` -1): freed heap stays for the next step's
  blocks of its size, which its high-water mark had held anyway, and goes back to the system at
  one place a step instead (`give_back_free_heap`, below). Trimmed whenever 128 MiB at its top
  lay free, a 3B QLoRA step faulted 2.1 GB of pages in again (546,000 faults) and ran 27.6-31.1 s
  against 24.2-25.9 s without, its peak RSS the same 4855 MiB (benchmarks/RESULTS.md "QLoRA larger
  than DRAM"); gpt-medium from SSD under tests/test_scale.py's 200 MB budget peaked at the same
  RSS with and without;
- the top pad: a heap grows 256 MiB at a time (address space; its pages are resident once used);
- one arena for every thread (`M_ARENA_MAX` 1). glibc otherwise gives each thread that allocates
  an arena of its own, up to 8 per core, each keeping its own freed blocks: overlap mode runs each
  lane on its own thread, and a block one lane freed was not reused by another lane's allocation.
  A lane allocates a few hundred blocks a step, so the one arena's lock is not contended;
- CPU tensors from malloc, aligned by hand (`csrc/host_alloc.cpp`), not PyTorch's posix_memalign:
  glibc before 2.38 does not reuse a freed 64-byte-aligned block of 1-32 MiB once smaller
  allocations sit between such blocks (glibc bug 14581), so each step's blocks came from fresh
  heap. The two together keep the lanes' freed blocks for reuse instead of a third of them
  resident and unused (benchmarks/RESULTS.md "Host memory and threads").

- the heap's free pages given back where the backward begins (`give_back_free_heap`, CPU device
  tier): a heap keeps its high-water mark, so the forward's blocks under 32 MiB and the first
  backward's large mapped tensors (a large model's LM-head gradient) added up in RSS though
  never live together. Given back at every segment instead, the pages fault in again all step
  (gpt3-2.7b 61 -> 72 s).

Memory the plan budgets is unaffected: the DRAM tier is one preallocated pool and the device tier
counts every tensor it holds. Under another allocator (LD_PRELOAD=jemalloc) glibc's settings are
unused. `execute --malloc default` (`setting`) leaves glibc and PyTorch's allocator as they are.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
from pathlib import Path

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX with 8-byte longs
TRIM_THRESHOLD = -1
"""glibc's `M_TRIM_THRESHOLD` value that turns trimming off (mallopt(3))."""
HEAP_FREE_KEPT = 512 << 20
"""Free heap bytes `give_back_free_heap` leaves in place."""
TOP_PAD = 256 << 20
ARENAS = 1

_CSRC = Path(__file__).resolve().parent.parent / "csrc" / "host_alloc.cpp"
_EXT_NAME = "tensorstow_alloc"

_tuned: bool | None = None
_libc = None
_lock = threading.Lock()
allocator_status = "torch's (not replaced)"
"""Which allocator CPU tensors come from: set by `tune()`."""


setting = "tuned"
"""`execute --malloc`: tuned sets glibc's thresholds (the module docstring) the first time an
executor starts; default leaves the allocator as it is."""


def tune() -> bool:
    """Set glibc's thresholds once per process (thread-safe); True when they were set."""
    with _lock:
        return _tune()


def _tune() -> bool:
    global _tuned, _libc
    if _tuned is None:
        _tuned = False
        if setting != "default":
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt
            except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
                return False
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _tuned = all([mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), mallopt(M_MMAP_MAX, 0),
                          mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                          mallopt(M_TOP_PAD, TOP_PAD), mallopt(M_ARENA_MAX, ARENAS)])
            if _tuned:
                _use_malloc_allocator()
                if hasattr(libc, "mallinfo2") and hasattr(libc, "malloc_trim"):  # glibc 2.33+
                    libc.mallinfo2.restype = _MallInfo2
                    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
                    _libc = libc
    return _tuned


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def give_back_free_heap() -> bool:
    """Where more than HEAP_FREE_KEPT bytes of the tuned heap are free, return their pages to the
    system (`malloc_trim`; the addresses stay the heap's and fault in again when reused). True
    when it did."""
    if _libc is None or _libc.mallinfo2().fordblks <= HEAP_FREE_KEPT:
        return False
    _libc.malloc_trim(0)
    return True


def _use_malloc_allocator() -> None:
    """CPU tensors from then on come from malloc, aligned by hand (csrc/host_alloc.cpp: glibc
    before 2.38 does not reuse freed posix_memalign blocks, which torch's allocator asks for).
    Where the extension cannot be built (no compiler) torch's allocator stays, and
    `allocator_status` says why."""
    global allocator_status
    import torch

    from tensorstow.executor import aio
    try:
        _, build_dir = aio.compile_extension(_EXT_NAME, _CSRC, extra_cflags=["-O2"], is_python_module=False)
        ok = torch.ops.tensorstow_alloc.install() == 1
    except Exception as e:  # the compiler, ninja, the loader or the disk: torch's allocator stays
        allocator_status = f"torch's (the malloc allocator in {_CSRC.name} did not build: {aio.first_error_line(e)})"
        return
    allocator_status = f"malloc, aligned by hand ({_EXT_NAME}, built/cached in {build_dir})" if ok else \
        "torch's (another allocator of higher priority is installed)"
