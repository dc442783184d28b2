"""glibc's malloc set up for a step that frees and re-allocates the same buffers every step.

An executor step allocates every activation, intermediate and device-tier copy of a block and
frees it again soon after (the static schedule's `free`), the next step the same sizes. Under
glibc's defaults each allocation of 128 KiB and up (its threshold grows with what was freed, up to
32 MiB) is a fresh `mmap` and each free an `munmap`, so every step faults in and zeroes its pages
again: on the 2-core VM that was 0.03 s of a 0.27 s gpt-small step (benchmarks/RESULTS.md).
`tune()` serves those sizes from the heap and keeps freed memory for reuse, which is what jemalloc
with `retain:true` and PyTorch's CUDA caching allocator do for their memory.

What it changes: the mmap threshold (fixed at glibc's maximum, 32 MiB on 64-bit: larger tensors
are still mapped, and given back, each time), the trim threshold (freed heap is kept up to
128 MiB: at 1 GiB an out-of-core gpt-medium run's peak RSS went from 0.56 to 0.82-1.59 GB, past its
--dram + --gpu-mem budget, tests/test_scale.py, for no measurable speed: gpt-small 0.2192 s per step
at 128 MiB, 0.2204 s at 1 GiB, same plan) and the top pad (a heap grows 256 MiB at a time: address space, its pages are only resident
once used). Memory the plan budgets is unaffected: the DRAM tier is one preallocated pool and the
device tier counts every tensor it holds. Under another allocator (LD_PRELOAD=jemalloc) glibc's
settings are unused and `tune()` changes nothing. TENSORSTOW_MALLOC=default leaves glibc as it is.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX with 8-byte longs
TRIM_THRESHOLD = 128 << 20
TOP_PAD = 256 << 20

_tuned: bool | None = None


def tune() -> bool:
    """Set glibc's thresholds once per process; True when they were set."""
    global _tuned
    if _tuned is None:
        _tuned = False
        if os.environ.get("TENSORSTOW_MALLOC", "tuned") != "default":
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt
            except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
                return False
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _tuned = all([mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                          mallopt(M_TOP_PAD, TOP_PAD)])
    return _tuned
