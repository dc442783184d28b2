"""SSD I/O throughput: the aio engines and SSDStore vs an fio-style baseline, same run, same files.

Baseline (what `fio --rw=write/read --direct=1 --bs=1M --numjobs=1 --iodepth=1` does): one
thread, O_DIRECT, a sequential loop of pwrite / pread of `--block-kib` blocks from one
aligned buffer. Every method moves the same `--size-mib` file; writes include the final
fdatasync; O_DIRECT reads bypass the page cache. Each round runs every method once
(interleaved, so drift of the disk hits all alike) after an untimed warm-up pass; the
table shows the median over rounds and the ratio to the baseline.

    python benchmarks/bench_io.py [--dir DIR] [--size-mib 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tensorstow.executor import aio
from tensorstow.executor.ssd import SSDStore


def baseline(fd: int, buf: torch.Tensor, block: int, write: bool) -> None:
    view = memoryview(buf.numpy())
    for off in range(0, len(view), block):
        chunk = view[off : off + block]
        n = os.pwritev(fd, [chunk], off) if write else os.preadv(fd, [chunk], off)
        assert n == len(chunk)
    if write:
        os.fdatasync(fd)


def engine_io(engine, fd: int, buf: torch.Tensor, write: bool) -> None:
    submit = engine.submit_write if write else engine.submit_read
    engine.wait(submit(fd, buf, 0))
    if write:
        os.fdatasync(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--block-kib", type=int, default=1024, help="block size of the baseline and the engines")
    ap.add_argument("--threads", type=int, default=aio.DEFAULT_THREADS)
    ap.add_argument("--queue-depth", type=int, default=aio.DEFAULT_QUEUE_DEPTH)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    nbytes = args.size_mib << 20
    block = args.block_kib << 10
    work = Path(tempfile.mkdtemp(prefix="tensorstow-bench-io-", dir=args.dir))
    buf = aio.aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))

    engines = {"python fallback": aio.PythonEngine(args.threads, block, args.queue_depth)}
    try:
        engines["C++ engine"] = aio.build_extension().Engine(args.threads, block, args.queue_depth)
    except RuntimeError as e:
        print(f"C++ engine unavailable: {e}", file=sys.stderr)

    fds = {}
    for name in ["baseline", *engines]:
        path = work / (name.replace(" ", "_") + ".bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        os.posix_fallocate(fd, 0, nbytes)
        fds[name] = fd
    stores = {name: SSDStore(work / f"store-{name.replace(' ', '_')}", {"w": nbytes}, engine=e)
              for name, e in engines.items()}
    out = aio.aligned_empty(nbytes)

    methods = {("write", "baseline"): lambda: baseline(fds["baseline"], buf, block, True),
               ("read", "baseline"): lambda: baseline(fds["baseline"], out, block, False)}
    for name, e in engines.items():
        methods[("write", name)] = lambda e=e, fd=fds[name]: engine_io(e, fd, buf, True)
        methods[("read", name)] = lambda e=e, fd=fds[name]: engine_io(e, fd, out, False)
        s = stores[name]
        methods[("write", f"SSDStore.write+commit ({name})")] = lambda s=s: (s.write("w", buf), s.commit(1))
        methods[("read", f"SSDStore.read+verify ({name})")] = lambda s=s: s.read("w", out)

    times: dict = {k: [] for k in methods}
    for rnd in range(args.rounds + 1):  # round 0: warm-up (first write into fallocated extents)
        for key in sorted(methods, key=lambda k: k[0] != "write"):  # writes first: reads need data
            t0 = time.perf_counter()
            methods[key]()
            dt = time.perf_counter() - t0
            if rnd:
                times[key].append(dt)

    print(f"# bench_io: {args.size_mib} MiB file, block {args.block_kib} KiB, {args.threads} threads, "
          f"queue depth {args.queue_depth}, median of {args.rounds} rounds, dir {work}")
    print(f"# {aio.engine_info()}")
    print(f"# SSD store io mode: {next(iter(stores.values())).io_mode_reason}")
    print(f"{'op':<6} {'method':<40} {'GB/s':>7} {'min..max GB/s':>15} {'vs baseline':>12}")
    for op in ("write", "read"):
        base = statistics.median(times[(op, "baseline")])
        for (o, name), ts in times.items():
            if o != op:
                continue
            med = statistics.median(ts)
            print(f"{op:<6} {name:<40} {nbytes / med / 1e9:7.2f} "
                  f"{nbytes / max(ts) / 1e9:7.2f}..{nbytes / min(ts) / 1e9:<7.2f} {base / med:11.2f}x")

    for s in stores.values():
        s.close()
    for fd in fds.values():
        os.close(fd)
    for p in sorted(work.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    work.rmdir()


if __name__ == "__main__":
    main()
