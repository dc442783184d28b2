"""Calibration: `tensorstow probe` measures this machine, the executor's own machinery included
(its copies, SSD store, Adam kernel, the lanes' contention), into a `Hardware` spec named
"local"; `hardware_for` resolves the hardware an `Options` names. It sits above the planner and
the executor, whose code it times.

Everything is measured, nothing is looked up in a table:

* GPU (torch.cuda available): memory from the device properties (NVML, when it loads, only
  adds names and driver info to `source`), matmul FLOP/s at bf16 (fp16 where bf16 is not
  supported): the peak of a large square matmul, and the rates a training step's kernels reach
  at its sizes (a linear layer's three matmuls and causal attention's forward + backward over a
  sweep of transformer shapes, the per-kernel launch floor), device-to-device copy bandwidth,
  pinned host<->device bandwidth per direction, and GPU->GPU bandwidth when peer access exists.
* No CUDA: the "device tier" is budgeted CPU memory, so the spec holds one pseudo-GPU
  "cpu (no CUDA)" with a quarter of total RAM (the CLI usually overrides it with --gpu-mem),
  the FLOP/s a GPT block's fp32 forward + backward reaches (LoHan's THP_G is a block peak, not
  the matmul peak), the same matmul and attention sweeps as on a GPU at CPU sizes in bf16 and
  fp32, what the ops between the matmuls reach in the executor (`elementwise_bw`) and memcpy
  bandwidth. Its budget is taken out of the DRAM capacity (both tiers live in the same RAM).
* DRAM: capacity = MemAvailable, bandwidth = measured memcpy.
* SSD: sequential O_DIRECT write (+fsync) and read of a temp file in `disk_dir` (default:
  a temp dir on the current directory's filesystem) with a few threads of pwrite/preadv,
  like the executor's I/O pool. Where O_DIRECT is refused (tmpfs, some network file
  systems) it falls back to buffered I/O + fsync + POSIX_FADV_DONTNEED and says so in
  `source`. The temp file is always removed.
* CPU: os.cpu_count() and the measured AdamW rate of the single-tensor path the executor runs
  (not fused: the executor stays bit-identical with eager's CPU default) on one fp32 tensor.

Bandwidth conventions (all bytes/s): h2d/d2h and SSD numbers are bytes *moved* per second;
`GPU.mem_bw` and `DRAM.bandwidth` are memory *traffic* (a copy of n bytes reads n and
writes n, so 2n/t), the convention of datasheets and STREAM.

Every host timing is the median of several short repetitions, as the disk's is: a plan replays
its copies, kernels and updates every step at the machine's typical rate, and the best of six
ran 2-4% (a GPT block), 5-7% (per-op dispatch) and 7-18% (memcpy) faster than their median on
a 2-core CPU VM (benchmarks/RESULTS.md "The probe"), an optimism every prediction inherited. GPU
kernels (CUDA events) are steady and keep the best of their repetitions, as the CPU tier's
matmul and attention curves do (`CPU_CURVE_REPS`). A quick probe takes
~12 s on a 2-core CPU VM without CUDA (a quarter of it the device tier's contention figures),
including ~1.5 s the first time an optimizer steps in a process (torch imports its compiler
stack then). Results are cached per (disk_dir, quick) per process.
"""
from __future__ import annotations

import datetime
import functools
import gc
import glob
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import xxhash

from tensorstow.errors import TensorstowError
from tensorstow.ir.graph import attention_flops
from tensorstow.planner.presets import load_hardware
from tensorstow.schema.hardware import CPU, CPU_GPU_NAME, CUDA_WORKSPACE_BYTES, DRAM, GPU, SSD, GiB, Hardware
from tensorstow.schema.options import Options

MiB = 2**20


CPU_GPU_FRACTION = 4
"""Without CUDA the pseudo-GPU gets 1/CPU_GPU_FRACTION of total RAM."""


@dataclass(frozen=True)
class _Params:
    """Sizes and repetition counts for one probe mode."""

    cpu_block_reps: int
    memcpy_bytes: int
    memcpy_reps: int
    disk_bytes: int
    disk_chunk: int
    disk_reps: int
    adam_numel: int
    adam_reps: int
    gpu_mm_n: int
    gpu_mm_iters: int
    gpu_mm_reps: int
    gpu_copy_bytes: int
    gpu_copy_reps: int
    gloo_bytes: int = 16 * MiB
    gloo_reps: int = 5


_QUICK = _Params(cpu_block_reps=6, memcpy_bytes=128 * MiB, memcpy_reps=6,
                 disk_bytes=256 * MiB, disk_chunk=16 * MiB, disk_reps=3,
                 adam_numel=8 * MiB, adam_reps=6,
                 gpu_mm_n=4096, gpu_mm_iters=5, gpu_mm_reps=3,
                 gpu_copy_bytes=256 * MiB, gpu_copy_reps=3)
_FULL = _Params(cpu_block_reps=12, memcpy_bytes=256 * MiB, memcpy_reps=10,
                disk_bytes=512 * MiB, disk_chunk=16 * MiB, disk_reps=4,
                adam_numel=16 * MiB, adam_reps=10,
                gpu_mm_n=8192, gpu_mm_iters=10, gpu_mm_reps=5,
                gpu_copy_bytes=1 * GiB, gpu_copy_reps=5)


# --------------------------------------------------------------------------------------
# public API


def probe(*, disk_dir: str | None = None, quick: bool = True) -> Hardware:
    """Measure this machine; see the module docstring. Cached per (disk_dir, quick).

    `disk_dir`: directory on the filesystem whose disk is measured (default: the current
    working directory). A temp dir is created inside it and removed afterwards.
    """
    if disk_dir is None:
        base = os.getcwd()
    else:
        base = os.fspath(disk_dir)
        if not os.path.isdir(base):
            raise TensorstowError(f"probe: disk_dir '{base}' is not an existing directory")
    return _probe_cached(os.path.realpath(base), bool(quick), disk_dir is None)


def clear_cache() -> None:
    """Forget cached probe results (the next `probe()` measures again)."""
    _probe_cached.cache_clear()


# --------------------------------------------------------------------------------------
# other processes

BUSY_CORES_WARN = 0.25
"""Cores' worth of CPU other processes (or the hypervisor: steal) may use while the probe times the
CPU before it warns: its FLOP rate and `host_contention` then measure a shared machine. (On a
2-core CPU VM a compiler running beside the probe doubled `host_contention`, 0.19 -> 1.08, and the
planner chose to recompute every block rather than swap.)"""


class ProbeWarning(UserWarning):
    """The probe measured a machine other processes were using: its figures may be pessimistic."""


def _machine_cpu_s() -> tuple[float, float] | None:
    """CPU seconds the whole machine has spent busy and stolen (by the hypervisor) since boot,
    from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / tick, steal / tick


class _OtherLoad:
    """Cores' worth of CPU that other processes and the hypervisor took while it ran (`with`
    blocks; they add up): the machine's busy and stolen CPU time less this process's own."""

    def __init__(self):
        self.other_s = self.wall_s = 0.0

    def __enter__(self):
        self._start = (_machine_cpu_s(), time.process_time(), time.perf_counter())
        return self

    def __exit__(self, *exc):
        machine0, own0, t0 = self._start
        machine1 = _machine_cpu_s()
        if machine0 is not None and machine1 is not None:
            busy, steal = machine1[0] - machine0[0], machine1[1] - machine0[1]
            self.other_s += max(0.0, busy - (time.process_time() - own0)) + steal
            self.wall_s += time.perf_counter() - t0

    @property
    def cores(self) -> float:
        return self.other_s / self.wall_s if self.wall_s > 0 else 0.0


# --------------------------------------------------------------------------------------
# orchestration


@functools.lru_cache(maxsize=None)
def _probe_cached(base: str, quick: bool, default_dir: bool) -> Hardware:
    """Measure this machine (`probe`): the disk first, then the host's CPU figures, then the GPUs
    (without CUDA: the CPU device tier), into a `Hardware` named "local" whose `source` says how each
    figure was measured."""
    import torch

    p = _past_the_cache(_QUICK if quick else _FULL, last_level_cache_bytes())
    t0 = time.perf_counter()
    notes: list[str] = []

    mem = _meminfo()
    total_ram, avail_ram = mem["total"], mem["available"]

    # Host measurements first (the GPU path needs nothing from them, the no-CUDA path does). The
    # disk goes first of all: see `_disk_bw` on memory freed just before.
    disk, disk_dir = _probe_disk(base, default_dir, p, notes)
    other = _OtherLoad()  # what else runs while the CPU is timed (the disk's I/O is left out)
    with other:
        copy_bw = _cpu_memcpy_bw(p.memcpy_bytes, p.memcpy_reps)  # bytes moved per second
        adam_rate, adam_kind = _adam_rate(p.adam_numel, p.adam_reps)
        adam_tensor_s = _adam_tensor_s(p.adam_reps)
    dram = DRAM(capacity_bytes=avail_ram, bandwidth=2 * copy_bw)
    cores = os.cpu_count() or 1

    nvml_note = _nvml_summary()
    gpu_result = None
    if torch.cuda.is_available():
        try:
            gpu_result = _probe_cuda(p)
        except Exception as e:  # a broken driver/runtime must not kill the probe
            notes.append(f"CUDA probe failed ({type(e).__name__}: {e}); using CPU pseudo-GPU")
    gloo_bw = gloo_gather_bw = gloo_step_s = 0.0  # GPUs reduce over their own links (`cost.collective_bw`)
    if gpu_result is not None:
        gpus, p2p_bw, gpu_notes = gpu_result
        notes += gpu_notes
    else:
        gpus, dram = _cpu_device_tier(p, total_ram, copy_bw, dram, disk_dir, other, notes)
        p2p_bw = 0.0
        gloo_bw, gloo_gather_bw, gloo_step_s = _gloo_rates(p.gloo_bytes, p.gloo_reps)
        notes.append(f"gloo between 2 processes: all-reduce {gloo_bw / 1e9:.3g} GB/s bus bandwidth, all-gather "
                     f"{gloo_gather_bw / 1e9:.3g} GB/s ({p.gloo_bytes // MiB} MiB, median of {p.gloo_reps}), a ring step "
                     f"{gloo_step_s * 1e6:.0f} us (half an all-reduce of one element, median of {8 * p.gloo_reps})")
    if nvml_note:
        notes.append(nvml_note)
    _note_other_load(other, cores, gpu_result is not None, notes)

    ssd = SSD(count=1, read_bw=disk.read_bw, write_bw=disk.write_bw, capacity_bytes=disk.capacity,
              request_s=disk.request_s, commit_s=disk.commit_s, sync_s=disk.sync_s, flush_bw=disk.flush_bw)
    cpu = CPU(cores=cores, adam_rate=adam_rate, adam_tensor_s=adam_tensor_s, gloo_bw=gloo_bw,
              gloo_gather_bw=gloo_gather_bw, gloo_step_s=gloo_step_s)
    source = _source(p, quick, t0, notes, mem, disk, adam_kind, adam_tensor_s)
    return Hardware(name="local", gpus=gpus, dram=dram, ssd=ssd, cpu=cpu,
                    gpu_p2p_bw=p2p_bw, source=source)


def _probe_disk(base: str, default_dir: bool, p: _Params, notes: list[str]) -> tuple[_DiskResult, str]:
    """The disk under `base` (`_disk_bw`) and the directory measured: where the current directory
    (`default_dir`) is not writable, the system temp dir's disk instead, with a note."""
    try:
        return _disk_bw(base, p.disk_bytes, p.disk_chunk, p.disk_reps), base
    except TensorstowError:
        if not default_dir:
            raise
    # The current directory is not writable: measure the system temp dir instead.
    disk_dir = os.path.realpath(tempfile.gettempdir())
    disk = _disk_bw(disk_dir, p.disk_bytes, p.disk_chunk, p.disk_reps)
    notes.append(f"current directory {base} not writable, measured {disk_dir}")
    return disk, disk_dir


def _cpu_device_tier(p: _Params, total_ram: int, copy_bw: float, dram: DRAM, disk_dir: str, other: _OtherLoad,
                     notes: list[str]) -> tuple[tuple[GPU, ...], DRAM]:
    """Without CUDA: the pseudo-GPU (budgeted CPU memory, the FLOP/s of a GPT block, the executor's
    per-op and per-tensor costs, its contention beside copies and SSD reads) and the DRAM tier less
    its budget, with a note on how each was measured."""
    import torch

    with other:
        flops = _cpu_block_flops(p.cpu_block_reps)
        bf16 = _cpu_bf16_ratio()
        curves = _cpu_rate_curves(flops, bf16)
        row_factors = _cpu_row_factors()
        elementwise_bw = _cpu_elementwise_bw(p.cpu_block_reps)
        dequant = _cpu_dequant_rate(p.cpu_block_reps)
        op_s = _op_dispatch_s(p.cpu_block_reps)
        per_tensor = _copy_tensor_s(p.memcpy_reps)
        contention = _host_contention(p.cpu_block_reps)
        ssd_contention = _ssd_contention(p.cpu_block_reps, disk_dir)
    budget = total_ram // CPU_GPU_FRACTION
    gpus = (GPU(name=CPU_GPU_NAME, memory_bytes=budget, flops=flops * bf16, flops_fp32=flops, mem_bw=2 * copy_bw,
                h2d_bw=copy_bw, d2h_bw=copy_bw, op_s=op_s, copy_tensor_s=per_tensor, host_contention=contention,
                ssd_contention=ssd_contention, elementwise_bw=min(elementwise_bw, 2 * copy_bw), dequant_rate=dequant,
                matmul_row_factors=row_factors, **curves),)
    # Device tier and DRAM tier share the same RAM: do not count it twice.
    dram = DRAM(capacity_bytes=max(0, dram.capacity_bytes - budget), bandwidth=dram.bandwidth)
    notes.append(f"no CUDA: device tier = CPU memory, 1/{CPU_GPU_FRACTION} of RAM "
                 f"({budget / GiB:.1f} GiB, taken out of DRAM capacity); "
                 f"flops_fp32 = fp32 GPT block (d {CPU_BLOCK[0]}, batch {CPU_BLOCK[2]} x seq {CPU_BLOCK[3]}) "
                 f"forward + backward on {torch.get_num_threads()} thread(s), flops = that x a bf16 "
                 f"{'x'.join(map(str, MM16))} matmul's rate / an fp32 one's ({bf16:.3g}); "
                 f"{_curves_note(curves)}; matmul_row_factors = a {CPU_ROWS_LAYER[0]} -> {CPU_ROWS_LAYER[1]} "
                 f"linear layer's forward and input gradient (fp32) at {'/'.join(map(str, CPU_ROWS))} tokens, each "
                 f"rate over the {CPU_ROWS_FULL}-token one ({' '.join(f'{f:.2f}' for _, f in row_factors)}); "
                 f"elementwise_bw = the bytes over the time of the ops besides matmuls and "
                 f"attention in the executor's run of that block's joint graph ({gpus[0].elementwise_bw / 1e9:.2f} GB/s); "
                 + (f"dequant_rate = the weights over the time of the NF4 dequantizations (bitsandbytes) in the "
                    f"executor's run of a one-layer d-{DEQUANT_BLOCK[0]} GPT's joint graph ({dequant / 1e9:.3g} G "
                    f"weights/s); " if dequant else "")
                 + f"op_s = the executor's "
                 f"segment runner per op on a tiny GPT ({op_s * 1e6:.1f} us); copy_tensor_s = the executor's "
                 f"stores per tensor of a copy ({per_tensor * 1e6:.1f} us); host_contention = that block beside a "
                 f"{CONTENTION_COPY_BYTES // MiB} MiB copy loop / alone, less 1 ({contention:.3f}); "
                 f"ssd_contention = the same beside verified 16 MiB SSD store reads ({ssd_contention:.3f})")
    return gpus, dram


def _note_other_load(other: _OtherLoad, cores: int, cuda: bool, notes: list[str]) -> None:
    """Where other processes kept more than `BUSY_CORES_WARN` cores busy while the CPU was timed: a
    note, and a `ProbeWarning` (reported at `probe`, as from the cached probe it calls)."""
    if other.cores <= BUSY_CORES_WARN:
        return
    busy = (f"other processes kept {other.cores:.2f} of {cores} cores busy while the probe timed the CPU, "
            f"so its CPU figures (AdamW, memcpy{'' if cuda else ', the device tier FLOPS and host_contention'})"
            f" may be pessimistic")
    notes.append(busy)
    warnings.warn(ProbeWarning(f"{busy}: probe again when the machine is idle (`tensorstow probe -o spec.json`, "
                               f"then plan with `--hw spec.json`)"), stacklevel=3)


def _source(p: _Params, quick: bool, t0: float, notes: list[str], mem: dict[str, int], disk: _DiskResult,
            adam_kind: str, adam_tensor_s: float) -> str:
    """`Hardware.source` of a probe that started at `t0`: when, how long, the notes, and how the
    DRAM, SSD and CPU figures were measured."""
    import torch

    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return "; ".join([
        f"tensorstow probe {stamp} ({'quick' if quick else 'full'}, torch {torch.__version__}, "
        f"{time.perf_counter() - t0:.1f} s)",
        *notes,
        f"DRAM: MemAvailable {mem['available'] / GiB:.1f} of {mem['total'] / GiB:.1f} GiB, "
        f"bandwidth = 2x memcpy of {p.memcpy_bytes // MiB} MiB (read+write traffic)",
        f"SSD: {disk.method} on {disk.fs_dir}, through the executor's store, buffers in huge pages: "
        f"reads and writes of {', '.join(f'{n / MiB:g}' for n in LONE_REQUEST_SIZES if n <= p.disk_chunk)} MiB "
        f"one at a time, each after {REQUEST_PROBE_IDLE_S * 1e3:.0f} ms without I/O, fitted as "
        f"request_s ({disk.request_s * 1e6:.0f} us, the mean of the reads' and writes' fixed cost) + bytes at "
        f"read_bw / write_bw; a commit {disk.commit_s * 1e3:.2f} ms + {disk.sync_s * 1e3:.2f} ms per "
        f"buffer written (1 and {COMMIT_PROBE_BUFFERS} buffers of 4 KiB committed through that store) + the "
        f"written bytes at {disk.flush_bw / 1e9:.2f} GB/s (the commit after {p.disk_bytes // MiB} MiB written in "
        f"{p.disk_chunk // MiB} MiB buffers all at once)",
        f"CPU: AdamW {adam_kind} on {p.adam_numel // MiB}Mi fp32 params (memcpy and AdamW past twice the "
        f"{last_level_cache_bytes() // MiB} MiB last-level cache); adam_tensor_s = the executor's "
        f"update per tensor besides its elements, through its host copies and kernel ({adam_tensor_s * 1e6:.1f} us)",
        f"host timings the median of {p.memcpy_reps}/{p.adam_reps} reps (memcpy/adam), the disk's of {p.disk_reps}",
    ])


# --------------------------------------------------------------------------------------
# host memory


def _meminfo() -> dict[str, int]:
    """Total and available RAM in bytes (/proc/meminfo; os.sysconf elsewhere)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = out.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * page
    avail = out.get("MemAvailable")
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * page
        except (ValueError, OSError):
            avail = total
    return {"total": int(total), "available": int(min(avail, total))}


def _typical_time(fn, reps: int, warmup: int = 1, pick=statistics.median) -> float:
    """Seconds `fn` takes: the median (or `pick`) of `reps` timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return max(pick(times), 1e-9)


def _cpu_memcpy_bw(nbytes: int, reps: int) -> float:
    """Bytes moved per second by a torch tensor copy_ (both buffers pre-faulted)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.fill_(0)
    try:
        return nbytes / _typical_time(lambda: dst.copy_(src), reps)
    finally:
        del src, dst


CPU_BLOCK = (512, 8, 4, 128)
"""(d, heads, batch, seq) of the transformer block whose throughput is the CPU device's `flops`."""


_GLOO_RANK = """
import statistics, sys, time, torch, torch.distributed as dist
rank, port, nbytes, reps = map(int, sys.argv[1:])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
t, one = torch.ones(nbytes // 4), torch.ones(1)
half, out = torch.ones(nbytes // 8), torch.empty(nbytes // 8 * 2)
def median(fn, n):
    fn()
    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
print(median(lambda: dist.all_reduce(t), reps), median(lambda: dist.all_gather_into_tensor(out, half), reps),
      median(lambda: dist.all_reduce(one), 8 * reps))
dist.barrier()
dist.destroy_process_group()
"""


def _gloo_rates(nbytes: int, reps: int) -> tuple[float, float, float]:
    """(`CPU.gloo_bw`, `CPU.gloo_gather_bw`, `CPU.gloo_step_s`) between two processes on this
    machine, one torch thread each as data-parallel ranks on the CPU run: the bus bandwidths of an
    all-reduce of `nbytes` and of an all-gather into `nbytes` (2 (N - 1) / N and (N - 1) / N x
    bytes over the median time, N = 2), and half the median all-reduce of one element (its
    2 (N - 1) ring steps). Zeros where the two processes could not meet."""
    import socket
    import subprocess
    import sys
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_RANK, str(r), str(port), str(nbytes), str(reps)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        return 0.0, 0.0, 0.0
    try:
        reduce_s, gather_s, one_s = map(float, outs[0].split())
    except ValueError:
        return 0.0, 0.0, 0.0
    if min(reduce_s, gather_s) <= 0:
        return 0.0, 0.0, 0.0
    return nbytes / reduce_s, nbytes / 2 / gather_s, one_s / 2


def _cpu_block_flops(reps: int) -> float:
    """LoHan's THP_G for the CPU device tier (`GPU.flops_fp32`, the rate of the ops no curve
    prices): the FLOP/s a GPT block's forward and backward reach here (ir.models.Block at
    CPU_BLOCK, fp32), counted as 3x the forward's 2*(12 d^2 + 2 T d) per token. On a CPU the
    matmul peak is far from what a block gets: small matmuls, attention and the memory-bound ops
    between them run below it, as the GPU presets' block peaks sit below their datasheets."""
    d, _heads, batch, seq = CPU_BLOCK
    blk, x = _cpu_block()

    def step():
        blk(x).sum().backward()
    step()  # warm-up: allocations, kernel selection
    flops = 3 * batch * seq * 2 * (12 * d * d + 2 * seq * d)
    return flops / _typical_time(step, reps)


DEQUANT_SHAPE = (4096, 4096)
"""The NF4 weight whose dequantization gives a GPU's `dequant_rate`: a 7B model's attention projection."""
DEQUANT_BLOCK = (2048, 16, 1, 64)
"""(d, heads, batch, seq) of the one-layer GPT whose NF4 linear layers give the CPU device tier's
`dequant_rate`: weights of 4-17 M parameters, as a 3B-70B model's."""


def _has_bitsandbytes() -> bool:
    from tensorstow.ir import quant
    try:
        quant.bitsandbytes_functional()
    except TensorstowError:
        return False
    return True


def _dequant_rate(device, timed) -> float:
    """A GPU's `dequant_rate`: weights a second `ir.quant.dequantized` makes of an NF4 weight of
    DEQUANT_SHAPE on `device` (`timed(fn)`: its seconds; the caching allocator reuses its output's
    memory, as in a step); 0 where bitsandbytes is not installed (the `qlora` extra)."""
    import torch

    from tensorstow.ir import quant
    if not _has_bitsandbytes():
        return 0.0
    w = torch.randn(DEQUANT_SHAPE, generator=torch.Generator().manual_seed(0)) * 0.02
    parts = {k: v.to(device) for k, v in quant.quantized_parts(w, quant.Quantization("nf4")).items()}
    return w.numel() / timed(lambda: quant.dequantized(parts, "nf4"))


def _cpu_dequant_rate(reps: int) -> float:
    """The CPU device tier's `dequant_rate`, in place: the weights the NF4 linear layers of a
    one-layer GPT of DEQUANT_BLOCK's shape make over the seconds their dequantizations take in the
    executor's run of its joint graph (each timed as it dispatches, as `_cpu_elementwise_bw` times
    the other ops; the median of `reps` steps). A lone call timed over and over ran 1.6-1.9 G
    weights/s where its output's pages stayed mapped and 0.33 where they were fresh each time; a 3B
    QLoRA step's ran 0.45-1.75 by size (benchmarks/RESULTS.md "QLoRA larger than DRAM"). 0 where
    bitsandbytes is not installed."""
    from tensorstow.executor import malloc
    from tensorstow.ir.models import GPTConfig
    if not _has_bitsandbytes():
        return 0.0
    malloc.tune()  # the executor's allocator settings: where a step's large outputs come from
    d, heads, batch, seq = DEQUANT_BLOCK
    step = _joint_step(GPTConfig(n_layer=1, n_head=heads, n_embd=d, vocab_size=64, block_size=seq), batch, seq,
                       quantize="nf4")
    step()  # warm-up
    timed = []
    for _ in range(reps):
        with _op_timer(dequant=True) as t:
            step()
        timed.append(t)
    return timed[0].weights / max(statistics.median(t.seconds for t in timed), 1e-9)


def _cpu_elementwise_bw(reps: int) -> float:
    """`GPU.elementwise_bw` of the CPU device tier: the executor's segment runner over the joint
    graph of a one-layer GPT of CPU_BLOCK's width and tokens, each op timed as it dispatches
    (`_op_timer`); the bytes the ops besides matmuls and attention read and write (as the IR counts
    them: views move none) over their seconds, the median of `reps` steps. Timed in place, not as
    the block's time less its matmuls' (a residual of two timings, which swung several-fold between
    probes where this stays within 10%: benchmarks/RESULTS.md "The probe")."""
    from tensorstow.ir.models import GPTConfig
    d, heads, batch, seq = CPU_BLOCK
    step = _joint_step(GPTConfig(n_layer=1, n_head=heads, n_embd=d, vocab_size=64, block_size=seq), batch, seq)
    step()  # warm-up
    timed = []
    for _ in range(reps):
        with _op_timer() as t:
            step()
        timed.append(t)
    return timed[0].bytes / max(statistics.median(t.seconds for t in timed), 1e-9)


def _op_timer(dequant: bool = False):
    """A TorchDispatchMode that sums the seconds and bytes (inputs and outputs) of the aten ops
    dispatched under it that are not views, matmuls or attention (`cost.op_kind`); with `dequant`,
    of the 4-bit dequantizations (`cost.DEQUANT_4BIT`) only, and the weights they make (`weights`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from tensorstow.planner.cost import DEQUANT_4BIT, op_kind

    class OpTimer(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seconds, self.bytes, self.weights = 0.0, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            dt = time.perf_counter() - t
            if str(func).startswith(DEQUANT_4BIT) if dequant else not func.is_view and not op_kind(str(func)):
                self.seconds += dt
                self.bytes += sum(a.nbytes for a in tree_leaves((args, kwargs, out)) if isinstance(a, torch.Tensor))
                self.weights += out.numel() if dequant else 0
            return out

    return OpTimer()


def _joint_step(config, batch: int, seq: int, quantize: str | None = None):
    """A callable that runs the traced joint graph of `GPT(config)` (seeded) once, forward and
    backward, through the executor's segment runner and a device tier of CPU memory; `quantize`:
    its linear layers but the LM head frozen and stored so (`ir.quant`, as a QLoRA base)."""
    import torch

    from tensorstow.executor.segments import Joint
    from tensorstow.executor.stores import DeviceTier
    from tensorstow.ir.models import GPT
    from tensorstow.ir.trace import trace
    torch.manual_seed(0)
    model = GPT(config)
    if quantize:
        from tensorstow.ir import quant
        quant.quantize_linears(model, quant.Quantization.parse(quantize))
    traced = trace(model, batch=batch, seq=seq, precision="fp32", model_name="probe")
    joint = Joint(traced)
    start = {joint.placeholder[n]: p.detach() for n, p in model.named_parameters()}
    idx, targets, tangent = joint.inputs
    start.update(joint.constants)
    start.update({idx: torch.zeros(batch, seq, dtype=torch.long), targets: torch.zeros(batch, seq, dtype=torch.long),
                  tangent: torch.ones(())})
    blocks = [b.name for b in traced.graph.blocks]
    order = [s for s in [f"fwd:{b}" for b in blocks] + [f"bwd:{b}" for b in reversed(blocks)]
             if s in joint.segments]
    device = DeviceTier(1 << 40, torch.device("cpu"))

    def step():
        values = dict(start)
        for name in order:
            seg = joint.segments[name]
            joint.run(seg, fetch=values.__getitem__, hold=device.hold, release=device.release,
                      keep=seg.produced, sink=values.__setitem__)
    step.ops = sum(1 for o in traced.graph.ops if o.phase in ("fwd", "bwd"))
    return step


def _cpu_block():
    """(block, input) of CPU_BLOCK's shape, seeded: what the CPU tier's block probes time."""
    import torch

    from tensorstow.ir.models import Block, GPTConfig
    d, heads, batch, seq = CPU_BLOCK
    torch.manual_seed(0)
    return Block(GPTConfig(n_layer=1, n_head=heads, n_embd=d)), torch.randn(batch, seq, d, requires_grad=True)


CONTENTION_COPY_BYTES = 64 * MiB
"""Buffers of the copy loop `_host_contention` runs beside the block: far larger than the caches,
as the copies between tiers and the SSD store's staging are."""


def _host_contention(reps: int) -> float:
    """`GPU.host_contention` of the CPU device tier: the GPT block of `_cpu_block_flops` timed alone
    and beside a thread that copies CONTENTION_COPY_BYTES in a loop (torch `copy_`, as the
    executor's copy lanes do), in alternating rounds; the medians' ratio less 1. The two share the
    memory system (and, with fewer cores than threads, the cores): a copy loop beside the block
    slows it far more than Adam does (benchmarks/RESULTS.md "Host contention on the CPU device
    tier")."""
    import torch

    src = torch.ones(CONTENTION_COPY_BYTES, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    return _slowdown_beside(reps, lambda: dst.copy_(src))


SSD_CONTENTION_BUFFERS = 4
"""Buffers of 16 MiB that `_ssd_contention` reads in a loop."""


def _ssd_contention(reps: int, base: str) -> float:
    """`GPU.ssd_contention`: the block timed alone and beside a thread reading SSD_CONTENTION_BUFFERS
    buffers of 16 MiB through `SSDStore` in a loop (O_DIRECT where it can, the aio engine, each read
    verified against its checksum), as the executor's SSD lanes do, on the disk under `base`."""
    from tensorstow.executor.aio import huge_empty
    from tensorstow.executor.ssd import SSDStore

    tmpdir = tempfile.mkdtemp(prefix=".tensorstow-probe-", dir=base)
    try:
        sizes = {f"b{i}": 16 * MiB for i in range(SSD_CONTENTION_BUFFERS)}
        bufs = {name: huge_empty(n) for name, n in sizes.items()}  # as the executor's DRAM pool
        with SSDStore(os.path.join(tmpdir, "contention"), sizes, early_sync=False) as store:
            for name, t in bufs.items():
                store.write(name, t)
            store.commit(0)

            def reads():
                for name, t in bufs.items():
                    store.read(name, t)
            return _slowdown_beside(reps, reads)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _slowdown_beside(reps: int, work) -> float:
    """How much slower `_cpu_block`'s forward + backward runs while another thread calls `work()` in
    a loop: alternating rounds alone and beside it, the medians' ratio less 1 (at least 0). Where
    torch's threads leave cores to spare, the block runs on the compute lane's cores and the loop
    and every thread working for it (the SSD store's I/O and checksum threads) on the others, as
    the executor's overlap mode pins them (`lanes.lane_cores`, `pin_off_compute`): the block in
    a thread of its own on the compute cores, whose intra-op threads start there, as the compute
    lane's do (the caller's own intra-op threads keep the affinity they had). One round per
    repetition: with 4 the SSD store's figure ranged 0.00-0.22 from probe to probe on a 2-core CPU VM,
    where 16 rounds put it at 0.02-0.04 (benchmarks/RESULTS.md "The probe")."""
    import threading

    import torch

    from tensorstow.executor.lanes import lane_cores, pin_off_compute, unpin

    blk, x = _cpu_block()
    stop = threading.Event()
    cores = lane_cores(torch.device("cpu"), torch.get_num_threads())

    def loop():
        if cores:
            os.sched_setaffinity(0, cores[0])
        while not stop.is_set():
            work()

    def timed() -> float:
        t = time.perf_counter()
        blk(x).sum().backward()
        return time.perf_counter() - t

    alone, beside = [], []

    def rounds():
        if cores:  # a compute lane of its own: its intra-op threads start on its cores, as the executor's
            os.sched_setaffinity(0, cores[1])
        timed()  # warm-up
        for _ in range(max(2, reps)):
            alone.append(timed())
            stop.clear()
            th = threading.Thread(target=loop, daemon=True)
            th.start()
            moved = pin_off_compute(cores) if cores else {}
            try:
                beside.append(timed())
            finally:
                stop.set()
                th.join()
                unpin(moved)
    if cores:  # its error, if any, is raised here
        with ThreadPoolExecutor(1, thread_name_prefix="tensorstow-probe-compute") as lane:
            lane.submit(rounds).result()
    else:
        rounds()
    return max(0.0, statistics.median(beside) / statistics.median(alone) - 1.0)


def _op_dispatch_s(reps: int) -> float:
    """Host seconds per op the executor spends besides the kernel: its segment runner
    (executor.segments.Joint.run, compiled segments, with the device tier's accounting) over the joint graph of a GPT
    so small (d 8, 4 tokens) that its kernels take next to nothing, divided by its IR ops, the unit
    the cost model charges it per (`cost.op_time`). It is what makes a narrow model (gpt-small at
    2 x 32 tokens) run well below a block's FLOP rate."""
    from tensorstow.ir.models import GPTConfig
    step = _joint_step(GPTConfig(n_layer=2, n_head=1, n_embd=8, vocab_size=16, block_size=4), 1, 4)
    return _typical_time(step, reps) / step.ops


MM16 = (128, 512, 2048)
"""(m, k, n) of the matmuls whose bf16 / fp32 rate ratio scales the CPU block's rate to its 16-bit
one: a block's MLP matmul (d 512 -> 4d) on 128 tokens. A CPU without native bf16 runs bf16 matmuls
at a rate that barely grows with their size (AMD EPYC, AVX2: 0.3-1.3 GFLOP/s from 128x512x512 to
512x2048x2048) while fp32 grows (4-127), so the ratio is taken at a block's own size; smaller
shapes overstate bf16 (0.30 at 128x512x512 against 0.047 here)."""


def _cpu_bf16_ratio() -> float:
    """A bf16 matmul's rate over an fp32 one's on this CPU (what a mixed-precision plan's 16-bit
    matmuls run at on the CPU device tier, relative to the fp32 block rate `_cpu_block_flops`
    measures): near 1 or above with native bf16 (AVX512-BF16, AMX), ~0.05 without (an AMD EPYC
    with AVX2)."""
    import torch

    m, k, n = MM16
    rate = {}
    for dt in (torch.float32, torch.bfloat16):
        a, b = torch.randn(m, k).to(dt), torch.randn(k, n).to(dt)
        rate[dt] = 1.0 / _typical_time(lambda: torch.mm(a, b), 2)  # ~1 s a bf16 call without native bf16
    return min(1.0, rate[torch.bfloat16] / rate[torch.float32])


CPU_ROWS_FULL = 512
"""Tokens of every linear layer the CPU device tier's matmul curves time; fewer take
`GPU.matmul_row_factors` of their rate."""
CPU_LINEAR_SHAPES = ((CPU_ROWS_FULL, 256, 256), (CPU_ROWS_FULL, 512, 2048), (CPU_ROWS_FULL, 2048, 8192))
"""(tokens, in features, out features) of the linear layers whose matmuls give the CPU device
tier's `matmul_rates` (bf16) and `matmul_rates_fp32`: from a small model's projection to a
1.3B model's MLP (one core of a 2-core Xeon VM: fp32 120-155 GFLOP/s, bf16 77-83)."""
CPU_ROWS = (32, 64, 128, 256, CPU_ROWS_FULL)
CPU_ROWS_LAYER = (1024, 4096)
"""Rows, and (in, out) features of the linear layer, at which the CPU device tier's
`matmul_row_factors` are timed (its forward and input gradient, fp32): a 3B-70B model's
fine-tuning batches of 128-2048 tokens run many microbatches of few tokens."""
CPU_ATTENTION_SHAPES = ((1, 8, 128, 64), (1, 16, 512, 128))
"""(batch, heads, seq, head dim) of the causal attentions that give the CPU device tier's
`attention_rates` and `attention_rates_fp32`."""
CPU_CURVE_STEP_S = 1.0
"""Longest a shape's step may take, estimated from the block's rate and the bf16 ratio, for the
CPU tier's curves to time it; larger shapes are left out and take the largest timed one's rate
(the curves hold at their ends). A CPU without native bf16 runs bf16 matmuls ~20x slower than
fp32 (`MM16`), where timing the 1.3B-wide shape would take ~30 s."""
CPU_CURVE_REPS = 3
"""Timed calls per shape of the CPU tier's curves, the fastest kept: on a VM, neighbours slow a
core's matmuls for a second or so at a time (one core of a 2-core Xeon VM, 512x2048x8192, five
calls in a row: 114-142, 133-142, 120-142, 125-138 GFLOP/s), and a long run averages near the
fastest (gpt3-1.3b's compute ran at ~145 where a median of two calls gave 123 and priced it 1.16x
slow). A GPU's curves keep the best of theirs too."""


def _cpu_rate_curves(block_flops: float, bf16: float) -> dict[str, tuple[tuple[float, float], ...]]:
    """The CPU device tier's matmul and attention rates at both precisions (`GPU.matmul_rates`,
    `attention_rates`, `matmul_rates_fp32`, `attention_rates_fp32`): each shape of
    CPU_LINEAR_SHAPES / CPU_ATTENTION_SHAPES timed as on a GPU, the fastest of CPU_CURVE_REPS
    calls (the first warms up), the smallest always and larger ones while their step is expected to take
    under CPU_CURVE_STEP_S."""
    import torch

    timer = functools.partial(_typical_time, reps=CPU_CURVE_REPS, warmup=0, pick=min)  # the fastest: no warm-up needed
    curves = {}
    for dtype, suffix, rate in ((torch.bfloat16, "", block_flops * bf16), (torch.float32, "_fp32", block_flops)):
        def quick(shapes, step_flops):
            return [s for i, s in enumerate(shapes) if i == 0 or step_flops(s) / rate < CPU_CURVE_STEP_S]
        curves["matmul_rates" + suffix] = _linear_rates(
            "cpu", dtype, quick(CPU_LINEAR_SHAPES, lambda s: 6 * s[0] * s[1] * s[2]), timer)
        curves["attention_rates" + suffix] = _attention_rates(
            "cpu", dtype, quick(CPU_ATTENTION_SHAPES, lambda s: 3.5 * attention_flops(s, s, s)), timer)
        e, k, n = CPU_GROUPED_SHAPE
        curves["grouped_mm_rates" + suffix], curves["grouped_mm_wgrad_rates" + suffix] = _grouped_rates(
            "cpu", dtype, CPU_GROUPED_SHAPE, quick(CPU_GROUPED_ROWS, lambda r: 6 * e * r * k * n), timer)
    return curves


def _cpu_row_factors() -> tuple[tuple[float, float], ...]:
    """`GPU.matmul_row_factors`: a CPU_ROWS_LAYER linear layer's forward and input gradient in fp32
    at each of CPU_ROWS tokens, timed together (the fastest of CPU_CURVE_REPS calls, as the curves
    are), each rate over the one at CPU_ROWS_FULL."""
    import torch

    k, n = CPU_ROWS_LAYER
    w = torch.randn(n, k)
    rates = []
    for r in CPU_ROWS:
        x, dy = torch.randn(r, k), torch.randn(r, n)
        rates.append(r / _typical_time(lambda: (torch.mm(x, w.t()), torch.mm(dy, w)), reps=CPU_CURVE_REPS, warmup=0,
                                       pick=min))
    return tuple((float(r), rate / rates[-1]) for r, rate in zip(CPU_ROWS, rates))


CPU_GROUPED_SHAPE = (8, 1024, 1024)
"""(groups, in features, out features) of the grouped linear layer whose matmuls give the CPU device
tier's `grouped_mm_rates` and `grouped_mm_wgrad_rates` (at both precisions). On one core of a
2-core AMD EPYC VM the rate at a given rows per group was the same within 8% at 8 or 24 groups and
1024 x 1024 or 2048 x 768 weights (fp32); 512 x 512 weights, whose gradients stay in the caches,
ran the weight gradient faster."""
CPU_GROUPED_ROWS = (16, 64, 256)
"""Rows per group at which the CPU tier's grouped curves are timed: the experts of an MoE batch
get tokens x top-k / experts rows each (Qwen3-30B-A3B at 2048 tokens: 128)."""


def _grouped_rates(device, dtype, shape, rows, timer) -> tuple[tuple[tuple[float, float], ...], ...]:
    """(`GPU.grouped_mm_rates`, `GPU.grouped_mm_wgrad_rates`): for each rows per group, a grouped
    linear layer of `shape` (groups, in, out)'s forward and input gradient (2-D x 3-D), timed
    together, and its weight gradient (2-D x 2-D), as `torch._grouped_mm` runs them in a training
    step, each keyed by the rows per group."""
    import torch

    e, k, n = shape
    mm, wgrad = [], []
    for r in rows:
        x = torch.randn(e * r, k, device=device, dtype=dtype)
        w = torch.randn(e, k, n, device=device, dtype=dtype)
        dy = torch.randn(e * r, n, device=device, dtype=dtype)
        offs = torch.arange(1, e + 1, device=device, dtype=torch.int32) * r
        flops = 2 * e * r * k * n

        def forward(x=x, w=w, dy=dy, offs=offs):
            torch._grouped_mm(x, w, offs=offs)
            torch._grouped_mm(dy, w.transpose(-1, -2), offs=offs)

        mm.append((float(r), 2 * flops / timer(forward)))
        wgrad.append((float(r), flops / timer(lambda x=x, dy=dy, offs=offs: torch._grouped_mm(x.t(), dy, offs=offs))))
        del x, w, dy
    return tuple(mm), tuple(wgrad)


def _curves_note(curves) -> str:
    """How the CPU tier's rate curves were measured, with their ranges, for `source`."""
    def span(c):
        return f"{min(r for _, r in c) / 1e9:.0f}-{max(r for _, r in c) / 1e9:.0f} GFLOP/s at {len(c)} sizes"
    return (f"matmul_rates[_fp32] = a linear layer's three matmuls, the fastest of {CPU_CURVE_REPS} calls (bf16 {span(curves['matmul_rates'])}, fp32 "
            f"{span(curves['matmul_rates_fp32'])}), attention_rates[_fp32] = causal attention forward + backward "
            f"(bf16 {span(curves['attention_rates'])}, fp32 {span(curves['attention_rates_fp32'])}), "
            f"grouped_mm[_wgrad]_rates[_fp32] = a grouped linear layer ({'x'.join(map(str, CPU_GROUPED_SHAPE))}) at "
            f"{'/'.join(str(int(r)) for r, _ in curves['grouped_mm_rates_fp32'])} rows a group (fp32 forward and input "
            f"gradient {span(curves['grouped_mm_rates_fp32'])}, weight gradient {span(curves['grouped_mm_wgrad_rates_fp32'])})")


ADAM_BYTES_PER_PARAM = 16
"""Bytes an fp32 AdamW step reads per parameter: the parameter, its gradient and two moments."""


def _past_the_cache(p: _Params, llc: int) -> _Params:
    """`p` with its memcpy and AdamW working sets at least twice the last-level cache: a step
    streams its state through DRAM."""
    return dataclasses.replace(p, memcpy_bytes=max(p.memcpy_bytes, -(-2 * llc // MiB) * MiB),
                               adam_numel=max(p.adam_numel, -(-2 * llc // (ADAM_BYTES_PER_PARAM * MiB)) * MiB))


def last_level_cache_bytes() -> int:
    """Bytes of this CPU's largest cache (Linux sysfs; 0 where it does not say). The probe's
    memcpy and AdamW run on working sets of twice that: on a host whose cache holds them (260
    MiB of L3 is common on servers) they time the cache, 3-6x faster than a training step, whose
    optimizer state streams from DRAM."""
    best = 0
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(d, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMGB")
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best


def _adam_rate(numel: int, reps: int) -> tuple[float, str]:
    """Parameters/s of AdamW steps on one fp32 tensor, at the rate of what the executor runs
    by default: its fused update (csrc/adam.cpp) runs at torch's fused AdamW's rate, 0.92-0.99x
    in the executor's own lane (benchmarks/bench_adam.py --lane). torch's fused AdamW is timed
    here (the planner does not load the executor's kernel); where it is missing, the for-loop
    path. Plans with exact_optimizer run torch's for-loop path, ~5x slower on a CPU."""
    import torch

    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.randn(numel) * 1e-3
    opt = None
    kind = ""
    for kind, kw in (("fused", {"fused": True}), ("for-loop", {"foreach": False})):
        try:
            opt = torch.optim.AdamW([param], lr=1e-4, **kw)
            opt.step()  # also the warm-up; state (m, v) is allocated here
            break
        except (RuntimeError, TypeError, ValueError):
            opt = None
    if opt is None:  # pragma: no cover - every torch >= 2.4 has the for-loop variant
        raise RuntimeError("probe: torch.optim.AdamW does not step on this machine")
    try:
        return numel / _typical_time(opt.step, reps, warmup=0), kind
    finally:
        del opt, param
        gc.collect()


# --------------------------------------------------------------------------------------
# disk


@dataclass(frozen=True)
class _DiskResult:
    read_bw: float
    write_bw: float
    capacity: int
    method: str
    fs_dir: str
    request_s: float = 0.0
    commit_s: float = 0.0
    sync_s: float = 0.0
    flush_bw: float = 0.0


def _fill_random(arr) -> None:
    """Fill a uint8 numpy array with random bytes. Content matters on these VMs: zero or tiled
    data reads back ~2x slower than random data (the host dedupes/compresses), and tensors look
    random."""
    import numpy as np

    gen = np.random.default_rng(0).bit_generator
    piece = 8 * MiB
    whole = len(arr) // 8 * 8
    for off in range(0, whole, piece):
        n = min(piece, whole - off)
        arr[off:off + n] = gen.random_raw(n // 8).view(np.uint8)
    arr[whole:] = 0x5A


LONE_REQUEST_SIZES = (256 * 1024, 1 * MiB, 4 * MiB, 16 * MiB)
"""Request sizes (bytes, at most the probe's buffer) `_disk_bw` fits its per-request cost and
rate over."""


def _fit_requests(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """(fixed seconds, bytes per second) of requests of `sizes` bytes that took `seconds`: the
    least-squares line. Where noise makes the slope or the fixed cost negative, no fixed cost and
    the largest request's mean rate."""
    import numpy as np
    x, y = np.array(sizes, dtype=float), np.array(seconds, dtype=float)
    slope, fixed = np.polyfit(x, y, 1) if len(x) > 1 else (y[0] / x[0], 0.0)
    if slope <= 0 or fixed < 0:
        return 0.0, float(x[-1] / y[-1])
    return float(fixed), float(1 / slope)


def _disk_bw(base: str, size: int, chunk: int, reps: int) -> _DiskResult:
    """The disk under `base` as the executor's SSD lanes use it: through its own SSD store
    (O_DIRECT where the filesystem allows it, the aio engine's workers, a checksum per buffer,
    buffers in huge pages as the executor's DRAM pool), one request at a time, each after
    REQUEST_PROBE_IDLE_S without I/O (a lane issues a request, waits for it, and mostly goes
    idle or waits on another lane before its next one). Reads and writes of LONE_REQUEST_SIZES,
    the median of 3 x `reps` each, fitted by least squares as a fixed cost + bytes / rate: the
    rates are `read_bw` / `write_bw`, the mean of the two fixed costs `request_s`. Lone requests move
    less than many in flight, and the executor's requests pay the lone request's rate
    (benchmarks/RESULTS.md "The probe").
    The commit is timed after `size` bytes in buffers of `chunk` written all at once (the
    written bytes' flush: `flush_bw`); `_ssd_commit_costs` times the commit's fixed and per-file
    parts. Medians, not the best: a plan replays every step at the disk's typical rate, and a
    VM's disk jitters (benchmarks/RESULTS.md "The probe"). Raises OSError or
    TensorstowError on failure; the temp dir goes either way.

    The probe runs it before anything else, and its buffers are a fresh mapping in huge pages
    (`aio.huge_empty`): on a 2-core CPU VM buffers malloc had recycled (4 KiB pages, scattered) moved
    1.0-1.3 GB/s where fresh or huge-page buffers moved 2.0-2.9 (benchmarks/RESULTS.md
    "SSD store")."""
    from tensorstow.executor.aio import huge_empty
    from tensorstow.executor.ssd import SSDStore

    try:
        tmpdir = tempfile.mkdtemp(prefix=".tensorstow-probe-", dir=base)
    except OSError as e:
        raise TensorstowError(f"probe: cannot create a temp dir in '{base}' to measure the "
                              f"disk ({e.strerror}); pass a writable directory "
                              f"(disk_dir / --disk-dir)") from None
    try:
        capacity = shutil.disk_usage(tmpdir).free
        sizes = {f"b{i}": min(chunk, size - off) for i, off in enumerate(range(0, size, chunk))}
        arena = huge_empty(size)  # as the executor's DRAM pool holds what its SSD I/O moves
        bufs = {name: arena[off:off + n] for (name, n), off in zip(sizes.items(), range(0, size, chunk))}
        _fill_random(arena.numpy())
        lone = [n for n in LONE_REQUEST_SIZES if n <= chunk] or [chunk]
        with SSDStore(os.path.join(tmpdir, "bandwidth"), {**sizes, **{f"lone{n}": n for n in lone}},
                      early_sync=False) as store:
            method = store.io_mode_reason
            for n in lone:
                store.write(f"lone{n}", arena[:n])
            flushes = []
            for r in range(reps + 1):  # the first round allocates the files' blocks
                for op in [store.write_async(name, t) for name, t in bufs.items()]:
                    op.wait()
                t0 = time.perf_counter()
                store.commit(r)  # what a step's commit adds for those bytes
                if r:
                    flushes.append(time.perf_counter() - t0)
            # the median: a commit now and then finds the host already flushed (10-300 ms here)
            flush_t = statistics.median(flushes)
            times: dict[tuple[str, int], list[float]] = {}
            for _ in range(3 * reps):
                for n in lone:
                    for kind in ("read", "write"):
                        time.sleep(REQUEST_PROBE_IDLE_S)  # the I/O workers go idle, as between a lane's requests
                        t0 = time.perf_counter()
                        (store.read if kind == "read" else store.write)(f"lone{n}", arena[:n])
                        times.setdefault((kind, n), []).append(time.perf_counter() - t0)

        (read_fixed, read_bw), (write_fixed, write_bw) = (
            _fit_requests(lone, [statistics.median(times[kind, n]) for n in lone]) for kind in ("read", "write"))
        commit_s, sync_s = _ssd_commit_costs(tmpdir, reps)
        # the bulk commit's time beyond its fixed and per-file parts is the written bytes' flush
        flush = flush_t - commit_s - len(sizes) * sync_s
        flush_bw = size / flush if flush > 0 else 0.0
        return _DiskResult(read_bw=read_bw, write_bw=write_bw, capacity=int(capacity), method=method,
                           fs_dir=base, request_s=(read_fixed + write_fixed) / 2, commit_s=commit_s,
                           sync_s=sync_s, flush_bw=flush_bw)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


REQUEST_PROBE_IDLE_S = 0.005
"""Seconds without I/O before each request `_disk_bw` times: a request to I/O workers that sat
idle took 420-440 us on a 2-core CPU VM where one right after another took 290 (4 KiB;
benchmarks/RESULTS.md "The probe")."""

COMMIT_PROBE_BYTES = 4096
"""Size of each buffer written before the probe's commits: one O_DIRECT block, so the times are
per call, not per byte."""

COMMIT_PROBE_BUFFERS = 8
"""Buffers written before the probe's larger commit (`SSD.sync_s` is the slope over 1 and these)."""


def _ssd_commit_costs(tmpdir: str, reps: int) -> tuple[float, float]:
    """(`SSD.commit_s`, `SSD.sync_s`), through one executor SSD store of COMMIT_PROBE_BYTES
    buffers: the commit timed after writing 1 and after writing `COMMIT_PROBE_BUFFERS` buffers,
    the median of `reps` each after one warm-up: the difference per extra buffer is the sync of
    a written file (sync_s), the rest the commit's own work (manifest, rename, directory sync)."""
    from tensorstow.executor.ssd import SSDStore
    from tensorstow.executor.stores import aligned_empty

    t = aligned_empty(COMMIT_PROBE_BYTES)
    t.fill_(7)
    n = COMMIT_PROBE_BUFFERS
    step = 0
    with SSDStore(os.path.join(tmpdir, "calls"), {f"c{i}": COMMIT_PROBE_BYTES for i in range(n)},
                  early_sync=False) as store:
        def commit_time(k: int) -> float:
            nonlocal step
            times = []
            for r in range(reps + 1):
                for i in range(k):
                    store.write(f"c{i}", t)
                step += 1
                t0 = time.perf_counter()
                store.commit(step)
                if r:  # the first round is the warm-up
                    times.append(time.perf_counter() - t0)
            return statistics.median(times)
        one, many = commit_time(1), commit_time(n)
    sync_s = max(0.0, (many - one) / (n - 1))
    return max(0.0, one - sync_s), sync_s


def _adam_tensor_s(reps: int) -> float:
    """Host seconds per parameter tensor of the executor's CPU update besides its elements
    (`CPU.adam_tensor_s`): 16 tiny tensors whose master, gradient and moments are views of host
    copies made anew each round (a step's loaded buffers arrive as new copies), updated through the
    executor's `adamw_steps_` (its fused kernel, called once per tensor), so the time is the
    per-tensor work, not the elements. The executor's handler also rebuilds each gradient from
    its recipe, which this leaves out: a lower bound."""
    import torch

    from tensorstow.executor.adam import adamw_steps_
    from tensorstow.executor.stores import HostCopy, Layout, aligned_empty
    n = 16
    keys = [f"t{k}" for k in range(n)]
    params = Layout([(k, torch.float32, (16,)) for k in keys])
    states = Layout([(f"{k}.{m}", torch.float32, (16,)) for k in keys for m in ("exp_avg", "exp_avg_sq")])
    blobs = [aligned_empty(lay.nbytes).zero_() for lay in (params, params, states)]

    def update():
        for _ in range(10):
            p, g, s = (HostCopy(lay, blob) for lay, blob in zip((params, params, states), blobs))
            adamw_steps_([p[k] for k in keys], [g[k] for k in keys], [s[f"{k}.exp_avg"] for k in keys],
                         [s[f"{k}.exp_avg_sq"] for k in keys], 1, 1e-4, (0.9, 0.999), 1e-8, 0.0)
    return _typical_time(update, reps) / (10 * n)


def _copy_tensor_s(reps: int, device=None, pin: bool = False) -> float:
    """Host seconds per tensor of a copy between DRAM and the device tier (`GPU.copy_tensor_s`),
    through the executor's own stores: a buffer of 16 tiny tensors stored to a host copy and
    loaded back (and dropped), so the time is the per-tensor work, not the bytes."""
    import torch

    from tensorstow.executor.stores import DeviceTier, HostTier, Layout
    device = device or torch.device("cpu")
    n = 16
    layout = Layout([(f"t{k}", torch.float32, (16,)) for k in range(n)])
    dev = DeviceTier(1 << 30, device)
    host = HostTier(pin=pin)
    dev.put("B", {f"t{k}": torch.ones(16, device=device) for k in range(n)})
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def round_trip():
        for _ in range(10):
            host.store_from("H", layout, dev.get("B"), non_blocking=device.type == "cuda")
            dev.load_from("L", host.get("H"))
            dev.drop("L")
        sync()
    try:
        return _typical_time(round_trip, reps) / (2 * 10 * n)
    finally:
        host.drop("H")
        dev.drop("B")


# --------------------------------------------------------------------------------------
# GPU


def _nvml_summary() -> str:
    """A note on what NVML sees ('' when it does not load, e.g. no GPU/driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return ""
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            total = pynvml.nvmlDeviceGetMemoryInfo(h).total
            names.append(f"{name} {total / GiB:.0f} GiB")
        driver = pynvml.nvmlSystemGetDriverVersion()
        if isinstance(driver, bytes):
            driver = driver.decode(errors="replace")
        return f"NVML (driver {driver}) sees {len(names)} GPU(s): {', '.join(names) or 'none'}"
    except Exception as e:
        return f"NVML error: {type(e).__name__}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _cuda_best(fn, reps: int, warmup: int = 1) -> float:
    """Best elapsed seconds of `fn` on the current CUDA stream (CUDA events)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return max(best, 1e-9)


GPU_LINEAR_SHAPES = tuple((m, k, n) for m in (2048, 8192) for d in (512, 1024, 2048, 4096, 8192)
                          for k, n in ((d, d), (d, 4 * d)))
"""(tokens, in features, out features) of the linear layers whose matmuls give `GPU.matmul_rates`:
transformer projections and MLPs (d -> d, d -> 4d) from 512 to 8192 wide at 2 K and 8 K tokens."""
GPU_UNALIGNED_SHAPES = ((8192, 512, 8191), (8192, 768, 50257), (8192, 2048, 50257), (8192, 4096, 50257))
"""(tokens, in features, out features) of linear layers whose output width is not a multiple of
8, as a vocabulary of 50257: their matmuls give `GPU.matmul_rates_unaligned`."""
GPU_ATTENTION_SHAPES = ((8, 8, 512, 64), (8, 12, 1024, 64), (8, 16, 1024, 128), (4, 32, 2048, 128), (2, 32, 4096, 128))
"""(batch, heads, seq, head dim) of the causal attentions that give `GPU.attention_rates`."""
KERNEL_FLOOR_OPS = 500
"""Tiny ops launched back to back whose time per op gives `GPU.kernel_s`."""


def _curve(points) -> tuple[tuple[float, float], ...]:
    """(FLOPs, seconds) measurements as ascending (FLOPs, FLOP/s) points, one per distinct size
    (shapes of equal FLOPs pooled)."""
    pooled: dict[float, list[float]] = {}
    for flops, secs in points:
        pooled.setdefault(float(flops), []).append(secs)
    return tuple((f, f * len(ts) / sum(ts)) for f, ts in sorted(pooled.items()))


def _linear_rates(device, dtype, shapes, timer) -> tuple[tuple[float, float], ...]:
    """`GPU.matmul_rates`: for each (tokens, in, out), a linear layer's three matmuls (forward,
    input gradient, weight gradient: the layouts a training step runs) timed together by
    `timer(fn) -> seconds`, keyed by one matmul's FLOPs."""
    import torch

    points = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        dy = torch.randn(m, n, device=device, dtype=dtype)

        def step(x=x, w=w, dy=dy):
            torch.mm(x, w.t())
            torch.mm(dy, w)
            torch.mm(dy.t(), x)

        points.append((2 * m * k * n, timer(step) / 3))
        del x, w, dy
    return _curve(points)


def _attention_rates(device, dtype, shapes, timer) -> tuple[tuple[float, float], ...]:
    """`GPU.attention_rates`: for each (batch, heads, seq, head dim), a causal scaled-dot-product
    attention's forward and backward timed together, FLOPs as `ir.graph.attention_flops` counts
    them, keyed by the forward's."""
    import torch
    import torch.nn.functional as F

    points = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        g = torch.randn(b, h, s, d, device=device, dtype=dtype)

        def step(q=q, k=k, v=v, g=g):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), g)

        fwd = attention_flops(q.shape, k.shape, v.shape)
        both = fwd + attention_flops(q.shape, k.shape, v.shape, backward=True)
        points.append((fwd, timer(step) * fwd / both))
        del q, k, v, g
    return _curve(points)


def _kernel_floor(device, timer) -> float:
    """`GPU.kernel_s`: seconds per tiny op launched back to back from Python."""
    import torch

    x = torch.zeros(1, device=device)

    def step():
        for _ in range(KERNEL_FLOOR_OPS):
            x.add_(1)

    return timer(step) / KERNEL_FLOOR_OPS


def _probe_one_cuda(dev: int, p: _Params) -> tuple[GPU, str]:
    import torch

    with torch.cuda.device(dev):
        props = torch.cuda.get_device_properties(dev)
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        n = p.gpu_mm_n
        # Keep the matmul and copies well inside free memory on small GPUs.
        free, _total = torch.cuda.mem_get_info(dev)
        while n > 1024 and 3 * n * n * 2 > free // 4:
            n //= 2
        nbytes = min(p.gpu_copy_bytes, max(MiB, free // 8))

        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        c = torch.empty(n, n, device=dev, dtype=dtype)

        def mm():
            for _ in range(p.gpu_mm_iters):
                torch.mm(a, b, out=c)

        flops = 2 * n**3 * p.gpu_mm_iters / _cuda_best(mm, p.gpu_mm_reps, warmup=2)
        del a, b, c
        timer = functools.partial(_cuda_best, reps=p.gpu_mm_reps, warmup=2)
        fits = lambda shapes: [(m, k, n) for m, k, n in shapes if 2 * (m * k + n * k + m * n) < free // 4]  # noqa: E731
        linear = _linear_rates(dev, dtype, fits(GPU_LINEAR_SHAPES), timer)
        unaligned = _linear_rates(dev, dtype, fits(GPU_UNALIGNED_SHAPES), timer)
        attention = _attention_rates(dev, dtype, GPU_ATTENTION_SHAPES, timer)
        kernel_s = _kernel_floor(dev, timer)
        dequant = _dequant_rate(torch.device("cuda", dev), lambda fn: _cuda_best(fn, p.gpu_copy_reps))
        grouped, grouped_note = _cuda_grouped_rates(dev, dtype, timer)
        torch.cuda.empty_cache()

        d_src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
        d_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        mem_bw = 2 * nbytes / _cuda_best(lambda: d_dst.copy_(d_src), p.gpu_copy_reps)
        del d_dst
        h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(2)
        h2d = nbytes / _cuda_best(lambda: d_src.copy_(h, non_blocking=True), p.gpu_copy_reps)
        d2h = nbytes / _cuda_best(lambda: h.copy_(d_src, non_blocking=True), p.gpu_copy_reps)
        del d_src, h
        # DeepSpeed ZeRO-3's converting copies (GPU.d2h_convert_bw, h2d_convert_bw): blocking, so
        # PyTorch converts on the CPU through an unpinned 16-bit host tensor; wall-clock timed.
        g16 = torch.ones(nbytes // 4, dtype=dtype, device=dev)
        h32 = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
        d2h_conv = g16.nbytes / _typical_time(lambda: h32.copy_(g16), p.gpu_copy_reps)
        h2d_conv = g16.nbytes / _typical_time(lambda: g16.copy_(h32), p.gpu_copy_reps)
        del g16, h32
        per_tensor = _copy_tensor_s(p.gpu_copy_reps, torch.device("cuda", dev), pin=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # what this process cannot use: the context and kernel images (and other processes' memory)
        free, total = torch.cuda.mem_get_info(dev)
        context = max(0, total - free - torch.cuda.memory_reserved(dev))
    note = (f"cuda:{dev} {props.name}: {str(dtype).removeprefix('torch.')} mm {n}^2, "
            f"copies {nbytes // MiB} MiB (pinned host; converting fp32 <-> 16-bit blocking copies "
            f"{nbytes // 4 // MiB} Mi elements); context and other processes {context / MiB:.0f} MiB "
            f"+ {CUDA_WORKSPACE_BYTES // MiB} MiB workspaces reserved")
    note += (f"; matmul_rates: a linear layer's three matmuls at {len(linear)} sizes "
             f"({linear[0][1] / 1e12:.0f}-{max(r for _, r in linear) / 1e12:.0f} TFLOPS), unaligned ones (out width "
             f"not a multiple of 8) at {len(unaligned)} ({min((r for _, r in unaligned), default=0) / 1e12:.0f}-"
             f"{max((r for _, r in unaligned), default=0) / 1e12:.0f}); attention_rates: causal "
             f"attention forward + backward at {len(attention)} sizes ({attention[0][1] / 1e12:.0f}-"
             f"{max(r for _, r in attention) / 1e12:.0f} TFLOPS); kernel_s {kernel_s * 1e6:.1f} us; {grouped_note}"
             + (f"; dequant_rate: an NF4 {DEQUANT_SHAPE[0]}x{DEQUANT_SHAPE[1]} weight by bitsandbytes "
                f"({dequant / 1e9:.3g} G weights/s)" if dequant else ""))
    return GPU(name=props.name, memory_bytes=int(props.total_memory), flops=flops, mem_bw=mem_bw, h2d_bw=h2d,
               matmul_rates=linear, matmul_rates_unaligned=unaligned, attention_rates=attention, kernel_s=kernel_s,
               dequant_rate=dequant, **grouped,
               d2h_bw=d2h, d2h_convert_bw=d2h_conv, h2d_convert_bw=h2d_conv, copy_tensor_s=per_tensor,
               reserved_bytes=context + CUDA_WORKSPACE_BYTES,
               compute_capability=float(f"{props.major}.{props.minor}")), note


GPU_GROUPED_SHAPE = (8, 4096, 2048)
"""(groups, in features, out features) of the grouped linear layer whose 16-bit matmuls give a
GPU's `grouped_mm_rates` and `grouped_mm_wgrad_rates`: a mixture of experts' expert of Mixtral's
and Qwen3's widths."""
GPU_GROUPED_ROWS = (64, 256, 1024, 4096)
"""Rows per group at which a GPU's grouped curves are timed."""


def _cuda_grouped_rates(dev: int, dtype, timer) -> tuple[dict[str, tuple], str]:
    """The grouped curves of CUDA device `dev` (`GPU.grouped_mm_rates`, `grouped_mm_wgrad_rates` at
    `dtype` and their `_fp32`: a mixture of experts' experts compute in fp32 under autocast, whose
    lists leave `_grouped_mm` out) and a note; a precision's curves are left empty where this GPU or
    torch runs no `torch._grouped_mm` at it, its grouped matmuls then priced at the matmul curves."""
    import torch

    curves, parts = {}, []
    for dt, suffix in ((dtype, ""), (torch.float32, "_fp32")):
        name = str(dt).removeprefix("torch.")
        try:
            mm, wgrad = _grouped_rates(torch.device("cuda", dev), dt, GPU_GROUPED_SHAPE, GPU_GROUPED_ROWS, timer)
        except (RuntimeError, NotImplementedError, TypeError) as e:
            parts.append(f"{name} not timed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        curves["grouped_mm_rates" + suffix], curves["grouped_mm_wgrad_rates" + suffix] = mm, wgrad
        span = lambda c: f"{min(r for _, r in c) / 1e12:.0f}-{max(r for _, r in c) / 1e12:.0f}"  # noqa: E731
        parts.append(f"{name} forward and input gradient {span(mm)}, weight gradient {span(wgrad)} TFLOPS")
    return curves, (f"grouped_mm[_wgrad]_rates[_fp32]: a grouped linear layer ({'x'.join(map(str, GPU_GROUPED_SHAPE))}) "
                    f"at {'/'.join(map(str, GPU_GROUPED_ROWS))} rows a group: " + "; ".join(parts))


def _probe_p2p(p: _Params) -> float:
    import torch

    if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
        return 0.0
    nbytes = p.gpu_copy_bytes
    src = torch.empty(nbytes, dtype=torch.uint8, device=0).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=1)
    with torch.cuda.device(0):
        bw = nbytes / _cuda_best(lambda: dst.copy_(src, non_blocking=True), p.gpu_copy_reps)
    del src, dst
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    for d in (0, 1):
        with torch.cuda.device(d):
            torch.cuda.empty_cache()
    return bw


def _probe_cuda(p: _Params) -> tuple[tuple[GPU, ...], float, list[str]]:
    import torch

    gpus, notes = [], []
    for dev in range(torch.cuda.device_count()):
        g, note = _probe_one_cuda(dev, p)
        gpus.append(g)
        notes.append(note)
    if not gpus:
        raise RuntimeError("torch.cuda.is_available() but no devices")
    p2p = _probe_p2p(p)
    notes.append(f"GPU P2P {'measured 0->1' if p2p else 'none (peer traffic via DRAM)'}")
    return tuple(gpus), p2p, notes


def hardware_for(o: Options, reprobe: bool = False) -> Hardware:
    """The hardware an Options names, with its overrides: a preset, a spec file, or "local" (this
    machine's quick probe, from the probe cache where it holds one: `local_hardware`)."""
    hw = local_hardware(reprobe) if o.hardware == "local" else load_hardware(o.hardware)
    gpus = o.gpus if o.gpus is not None or o.dp <= 1 else max(1, o.dp // max(1, o.nodes))  # a machine's share
    return hw.with_overrides(gpu_mem=o.gpu_mem, dram=o.dram, ssds=o.ssds, gpus=gpus)


probe_cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tensorstow" / "probe"
"""Where `local_hardware` keeps this machine's quick probes, one file per `machine_key`."""


def local_hardware(reprobe: bool = False) -> Hardware:
    """This machine's quick probe (`--hw local`): the one cached under `probe_cache_dir` for what the
    probe would measure (`machine_key`), with its capacities read again (the DRAM available and the
    disk's free space change between runs, the rates do not), else a new probe, which the cache then
    keeps. `reprobe`: measure again and replace the cached one."""
    base = os.path.realpath(os.getcwd())
    path = probe_cache_dir / f"local-{machine_key(base)}.json"
    if not reprobe and path.is_file():
        try:
            return _current_capacities(load_hardware(str(path)), base)
        except (TensorstowError, OSError, ValueError):  # damaged, unreadable or older: measured again, replaced
            pass
    if reprobe:
        clear_cache()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", ProbeWarning)
        hw = probe()
    for w in said:  # said again, to the caller's filters
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if any(issubclass(w.category, ProbeWarning) for w in said):
        return hw  # measured on a busy machine: not kept for the next plan
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(hw.to_json(), indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only means the next plan probes again
    return hw


def machine_key(base: str) -> str:
    """What a quick probe measures, hashed: this code (the probe and its C++ kernels), torch's version
    and threads, the CPU (model, cores this process may use), the RAM, the GPUs (name, memory), and
    the disk under `base` (its device). A change in any of them is a new key: a new probe."""
    import torch

    here = Path(__file__).resolve().parent  # the probe times the executor's own machinery too
    code = [Path(__file__).read_bytes()] + [f.read_bytes() for d in ("csrc", "executor")
                                            for f in sorted((here / d).glob("*")) if f.is_file()]
    cpu = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    gpus = ([(torch.cuda.get_device_name(k), torch.cuda.get_device_properties(k).total_memory)
             for k in range(torch.cuda.device_count())] if torch.cuda.is_available() else [])
    dev = os.stat(base).st_dev
    what = [xxhash.xxh3_64_hexdigest(b"".join(code)), torch.__version__, torch.get_num_threads(), cpu,
            sorted(os.sched_getaffinity(0)), _meminfo()["total"], gpus, [os.major(dev), os.minor(dev)]]
    return xxhash.xxh3_64_hexdigest(json.dumps(what, default=str).encode())


def _read_lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def _current_capacities(hw: Hardware, base: str) -> Hardware:
    """`hw` (a cached probe) with the DRAM available now (less the CPU device tier's budget, as the
    probe takes it) and the free space of `base`'s disk now."""
    cpu_tier = hw.gpus and hw.gpus[0].name == CPU_GPU_NAME
    budget = sum(g.memory_bytes for g in hw.gpus) if cpu_tier else 0
    dram = dataclasses.replace(hw.dram, capacity_bytes=max(0, _meminfo()["available"] - budget))
    ssd = dataclasses.replace(hw.ssd, capacity_bytes=int(shutil.disk_usage(base).free))
    return dataclasses.replace(hw, dram=dram, ssd=ssd)


if __name__ == "__main__":  # pragma: no cover - manual use: python -m tensorstow.calibrate
    import sys

    print(json.dumps(probe(quick="--full" not in sys.argv).to_json(), indent=2))
