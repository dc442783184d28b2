"""Hardware specs: what the planner needs to know about a machine.

A spec is plain data (JSON on disk). Bandwidths are bytes/s, capacities bytes, FLOP/s are
the *measured* peak the papers use (LoHan THP_G), not the datasheet number.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from tensorstow.errors import TensorstowError
from tensorstow.ir.graph import stable_hash
from tensorstow.schema.typed import decode, encode

GB = 10**9
GiB = 2**30
MiB = 2**20

CUDA_CONTEXT_BYTES = 512 * MiB
"""GPU memory a CUDA process holds outside PyTorch's caching allocator: the context and the
kernel images it loads (CUDA 12 loads them lazily). `tensorstow probe` measures it; presets
state this value."""
CUDA_WORKSPACE_BYTES = 256 * MiB
"""Memory library code takes inside the caching allocator, outside the plan's tensors: the
cuBLAS/cuBLASLt workspaces (32 MiB per stream that runs matmuls on Hopper, 4-8 MiB before),
SDPA scratch, and the allocator's rounding of blocks. The executor lets the allocator reserve
the plan's device budget plus this much (executor.cuda.cap_allocator)."""
CUDA_RESERVED_BYTES = CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES


CPU_GPU_NAME = "cpu (no CUDA)"
"""Name of the pseudo-GPU that stands for budgeted CPU memory on a machine without CUDA
(`tensorstow probe` there): the device tier the executor emulates on the CPU."""


OMITTED_WHEN_ZERO = ("op_s", "matmul_rates", "matmul_rates_unaligned", "attention_rates", "matmul_rates_fp32",
                     "attention_rates_fp32", "grouped_mm_rates", "grouped_mm_wgrad_rates", "grouped_mm_rates_fp32",
                     "grouped_mm_wgrad_rates_fp32", "elementwise_bw", "kernel_s", "d2h_convert_bw", "h2d_convert_bw", "copy_tensor_s", "host_contention", "ssd_contention",
                     "compute_capability", "request_s", "commit_s", "sync_s", "flush_bw", "adam_tensor_s",
                     "gloo_bw", "gloo_gather_bw", "gloo_step_s", "dequant_rate", "matmul_row_factors")
"""GPU, SSD and CPU fields a spec's JSON leaves out when 0 (added after specs existed: their
fingerprints stay)."""


RATE_CURVES = ("matmul_rates", "matmul_rates_unaligned", "attention_rates", "matmul_rates_fp32", "attention_rates_fp32",
               "grouped_mm_rates", "grouped_mm_wgrad_rates", "grouped_mm_rates_fp32", "grouped_mm_wgrad_rates_fp32")
"""GPU fields that hold (size, FLOP/s) curves measured by `tensorstow probe`: FLOPs of one op, or
for the grouped matmuls rows per group."""


@dataclass(frozen=True, kw_only=True)
class GPU:
    name: str
    """Human name, e.g. "RTX 4090"."""
    memory_bytes: int
    """The GPU's memory (`total_memory`)."""
    flops: float
    """Measured peak FLOP/s at the compute precision (LoHan THP_G)."""
    flops_fp32: float = 0.0
    """Peak FLOP/s of fp32 matmuls (PyTorch's default: no TF32), for the ops a plan runs in fp32
    (an fp32 plan, or ops autocast keeps in fp32); 0: `flops`. The CPU device tier's probe measures
    it on a GPT block in fp32, and its `flops` is that scaled by this CPU's bf16 / fp32 matmul rate
    (a CPU without native bf16 runs bf16 matmuls hundreds of times slower)."""
    mem_bw: float
    """Device memory bandwidth, bytes/s (roofline for memory-bound ops)."""
    h2d_bw: float
    """Host (DRAM) -> device bandwidth, bytes/s (LoHan BW_G, one direction)."""
    d2h_bw: float
    """Device -> host bandwidth, bytes/s. The host link is duplex: h2d and d2h overlap."""
    root_complex: int = 0
    """Which CPU root complex the GPU hangs off (Mobius: GPUs on one complex share its bandwidth)."""
    reserved_bytes: int = 0
    """Memory a plan leaves to the CUDA context and library workspaces (CUDA_RESERVED_BYTES in
    the presets; measured by `tensorstow probe`; 0 for the CPU device tier). The plan's tensors
    get `plan_bytes`."""
    op_s: float = 0.0
    """Host seconds each op costs besides its kernel: the executor's segment runner and torch's
    dispatcher (measured by `tensorstow probe` on a tiny model; added to every op's time). 0 in
    the papers' presets, whose `flops` are measured block rates that include it. Left out of the
    spec's JSON when 0."""

    d2h_convert_bw: float = 0.0
    """Bytes/s, counted in the 16-bit tensor, of a blocking `host_fp32.copy_(device_16bit)`.
    PyTorch converts on the CPU for a blocking copy between devices (ATen cuda/Copy.cu,
    `copy_kernel_cuda`): it allocates an unpinned 16-bit host tensor, copies into it through
    pageable memory, then converts, one after the other. DeepSpeed ZeRO-3 flushes each gradient
    partition so when the optimizer is in DRAM (stage3.py `partition_grads`,
    `fp32_grad_tensor.copy_(grad_buffer)`, 0.9.3 and later): DOS §4.1 measured 2.5 GB/s on an H100
    whose pinned D2H runs 55 GB/s. `tensorstow probe` measures it on CUDA; 0: unknown, the pinned
    `d2h_bw` (optimistic). Left out of the spec's JSON when 0."""
    h2d_convert_bw: float = 0.0
    """Bytes/s, counted in the 16-bit tensor, of a blocking `device_16bit.copy_(host_fp32)`
    (converted on the CPU, then a pageable copy): DeepSpeed ZeRO-3's write-back of each sub-group's
    updated parameters (stage3.py `_reassign_or_swap_out_partitioned_parameters`). DOS Table 1:
    8 GB/s (H_32 -> G_16). 0: unknown, the pinned `h2d_bw`. Left out of the spec's JSON when 0."""
    copy_tensor_s: float = 0.0
    """Host seconds each tensor of a copy between DRAM and the device costs besides its bytes: the
    executor copies a buffer member by member (`executor.stores`: one `copy_` and, on arrival, one
    allocation and one accounting entry per tensor; on CUDA one copy launch each), so a buffer of
    many small tensors (a block's weights and biases) moves slower than its bytes at `h2d_bw`. Measured
    by `tensorstow probe` through those stores; 0 in the papers' presets (their links are measured
    transfer rates). Left out of the spec's JSON when 0."""
    host_contention: float = 0.0
    """How much slower the device computes while host memory traffic runs beside it: the
    fraction its ops take longer while a copy streams memory on another core. The CPU device
    tier computes in the same memory system as the copies between tiers and the SSD store's I/O
    (`tensorstow probe` times a GPT block alone and beside a 64 MiB copy loop: 0.1-0.2 on a
    2-core CPU VM); a GPU computes in its own memory: 0. Left out of the spec's JSON when 0."""
    ssd_contention: float = 0.0
    """`host_contention` beside the SSD store's transfers instead of a copy: the block timed beside
    verified 16 MiB reads through `SSDStore` in a loop. A transfer the disk paces costs the host
    its syscalls, checksums and DMA, about half what a copy does (+3% / +56% against +7% / +106%
    at 1 / 2 torch threads on a 2-core CPU VM, benchmarks/RESULTS.md "The probe"). 0 in the
    presets and in specs probed before it existed (their SSD transfers then stretch nothing).
    Left out of the spec's JSON when 0."""
    matmul_rates: tuple[tuple[float, float], ...] = ()
    """(FLOPs of one matmul, FLOP/s it runs at), ascending: what a 16-bit matmul of that size gets
    on this GPU. `tensorstow probe` times the three matmuls of linear layers of transformer shapes
    (forward, input gradient, weight gradient) at the compute precision; a plan's matmul is priced
    at the rate interpolated at its FLOPs (log-log, held at the ends). Small matmuls run far below
    the peak `flops` (on an H200: 160 model TFLOPS for gpt3-125m against a 723 TFLOPS 4096^2
    matmul, benchmarks/RESULTS.md "On a GPU"). Empty: `flops` (the papers' presets, whose `flops`
    are measured block rates). Left out of the spec's JSON when empty."""
    matmul_rates_unaligned: tuple[tuple[float, float], ...] = ()
    """As `matmul_rates`, for matmuls with a dimension that is not a multiple of 8 elements (a
    vocabulary such as GPT-2's 50257), which miss the aligned tensor-core kernels: `tensorstow
    probe` times linear layers whose output width is such a vocabulary (94-145 TFLOPS on an H200
    where an aligned one of the same FLOPs ran 693-767). Empty: `matmul_rates`. Left out of the
    spec's JSON when empty."""
    attention_rates: tuple[tuple[float, float], ...] = ()
    """(FLOPs of one attention forward, FLOP/s of its forward and backward together), ascending,
    as `matmul_rates`: causal scaled-dot-product attention (flash where the GPU runs it) timed by
    `tensorstow probe` at the compute precision, its FLOPs counted as torch's flop counter counts
    them (the whole score matrix). Empty: `matmul_rates`, then `flops`."""
    matmul_rates_fp32: tuple[tuple[float, float], ...] = ()
    attention_rates_fp32: tuple[tuple[float, float], ...] = ()
    """As `matmul_rates` and `attention_rates`, for the ops a plan runs in fp32. The CPU device
    tier's probe measures both precisions: there a block's matmuls run near one rate at every
    width (fp32 139-155 GFLOP/s on one core from 128x512x2048 to 512x2560x50304) while the
    memory-bound ops between them shrink from 17% of a d-512 block to 6% of a d-2048 one, so a
    block-wide rate probed at one width mispredicts the others (gpt3-2.7b's compute 0.86x its
    prediction from a d-512 block, benchmarks/RESULTS.md "Training state larger than DRAM").
    Empty: `flops_fp32`, then `flops`. Left out of the spec's JSON when empty."""
    grouped_mm_rates: tuple[tuple[float, float], ...] = ()
    grouped_mm_wgrad_rates: tuple[tuple[float, float], ...] = ()
    grouped_mm_rates_fp32: tuple[tuple[float, float], ...] = ()
    grouped_mm_wgrad_rates_fp32: tuple[tuple[float, float], ...] = ()
    """(rows per group, FLOP/s), ascending: what a grouped matmul (a mixture of experts' experts,
    `torch._grouped_mm`) gets at 16-bit or fp32 (`_fp32`) precision, in its two layouts: a 2-D
    input times one 3-D weight per group (the forward and the input gradient: `grouped_mm_rates`)
    and the weight gradient, 2-D x 2-D into one matrix per group, whose contracted dimension is the
    rows (`grouped_mm_wgrad_rates`). The rate follows the rows each group gets, not the FLOPs: on
    one core of a 2-core AMD EPYC VM, fp32 at 43 rows a group ran the forward at 77 GFLOP/s and the
    weight gradient at 34, where a dense matmul of one group's FLOPs runs 102 (benchmarks/RESULTS.md
    "A mixture of experts from SSD"). The CPU device tier's probe times the three calls of a grouped
    linear layer (8 groups, 1024 x 1024 weights) at 16, 64 and 256 rows a group; a CUDA probe an
    8 x 4096 x 2048 layer at 64-4096 rows, at each precision where the GPU runs `_grouped_mm`.
    Empty (the presets, a GPU without it): `matmul_rates` at one group's FLOPs. Left out of the
    spec's JSON when empty."""
    matmul_row_factors: tuple[tuple[float, float], ...] = ()
    """(rows, factor), ascending: the share of `matmul_rates_fp32` an fp32 matmul gets whose output
    has that few rows or columns (`cost.matmul_rows`: the tokens of a forward or an input
    gradient), against 512 rows (`calibrate.CPU_ROWS_FULL`), at which every point of the CPU
    device tier's curves is timed. A CPU's matmul kernel packs the weight once per call and reuses it for every row, so a
    few tokens pay the packing nearly alone: on one core of a 2-core AMD EPYC VM a linear layer's
    forward and input gradient ran 0.60 / 0.75 / 0.89 / 0.96 of their 512-row rate at 32 / 64 /
    128 / 256 rows, at d 1024 -> 4096 and 2048 -> 8192 alike (benchmarks/RESULTS.md "QLoRA larger
    than DRAM"). The CPU device tier's probe times that layer's two matmuls at those rows; log-log
    interpolation, held at the ends. Empty (the presets, a GPU, whose curves span the tokens its
    plans run): 1. Left out of the spec's JSON when empty."""
    elementwise_bw: float = 0.0
    """Bytes/s the ops without FLOPs (elementwise, norms, softmax, reductions) move, where it is
    below `mem_bw`. On a CPU they compute per element besides streaming memory: the CPU device
    tier's probe runs the executor over a GPT block's joint graph and times each op as it
    dispatches (below a memcpy's rate: benchmarks/RESULTS.md "The probe"). 0:
    `mem_bw`. Left out of the spec's JSON when 0."""
    dequant_rate: float = 0.0
    """Weights a second bitsandbytes' `dequantize_4bit` makes of a 4-bit (NF4/FP4) weight, as a
    QLoRA step dequantizes its base (`ir.quant.dequantized`), where bitsandbytes is installed: on a
    GPU `tensorstow probe` times a 4096 x 4096 NF4 weight; on the CPU device tier the NF4 linear
    layers of a one-layer d-2048 GPT in the executor's run of its joint graph (1.85 G weights/s on
    one core of a 2-core AMD EPYC VM, where the elementwise rate prices the op's bytes at 2.4;
    benchmarks/RESULTS.md "QLoRA larger than DRAM"). 0: priced as an elementwise op by its bytes.
    Left out of the spec's JSON when 0."""
    kernel_s: float = 0.0
    """Seconds an op that touches memory takes at least on the device's compute stream: tiny ops
    launched back to back from Python (kernel launch and the dispatcher; `tensorstow probe` times
    500 of them). 0: no floor (the presets, the CPU device tier, whose `op_s` holds its per-op
    cost). Left out of the spec's JSON when 0."""
    compute_capability: float = 0.0
    """CUDA compute capability, major.minor (8.9 for an RTX 4090); 0: not stated (the papers'
    presets of Ampere and newer GPUs, the CPU device tier). It decides which attention kernels run:
    PyTorch's flash attention needs 8.0 or newer; below that the executor's attention backward
    recomputes the attention forward (`executor.device_ops`), and the planner prices it. Measured
    by `tensorstow probe`. Left out of the spec's JSON when 0."""

    def shared_by(self, n: int) -> "GPU":
        """This device as one of `n` processes that share its cores and memory: every rate / n, and
        1/n of its memory."""
        def curve(c):
            return tuple((f, r / n) for f, r in c)
        return dataclasses.replace(self, memory_bytes=self.memory_bytes // n, flops=self.flops / n, flops_fp32=self.flops_fp32 / n, mem_bw=self.mem_bw / n,
                                   elementwise_bw=self.elementwise_bw / n, dequant_rate=self.dequant_rate / n,
                                   **{k: curve(getattr(self, k)) for k in RATE_CURVES})

    @property
    def plan_bytes(self) -> int:
        """What the plan's tensors may fill: the device tier's budget."""
        return max(0, self.memory_bytes - self.reserved_bytes)


@dataclass(frozen=True, kw_only=True)
class DRAM:
    capacity_bytes: int
    """Main memory the training job may use."""
    bandwidth: float
    """Main memory bandwidth, bytes/s."""


@dataclass(frozen=True, kw_only=True)
class SSD:
    count: int
    """Number of NVMe drives striped together (0 = no SSD tier)."""
    read_bw: float
    """Sequential read bandwidth of ONE drive, bytes/s."""
    write_bw: float
    """Sequential write bandwidth of ONE drive, bytes/s."""
    capacity_bytes: int
    """Capacity of ONE drive."""
    max_total_bw: float = 0.0
    """Cap on the aggregate bandwidth (PCIe / root complex limit); 0 = no cap."""
    request_s: float = 0.0
    """Seconds each read or write of a buffer costs besides its bytes: the store's submission,
    completion and checksum bookkeeping per request (`executor.ssd.SSDStore`), measured by
    `tensorstow probe` on a 4 KiB buffer through that store; 0 in the papers' presets. Left out of
    the spec's JSON when 0."""
    commit_s: float = 0.0
    """Seconds the store's commit at the end of a step costs besides its files' syncs: writing and
    renaming the manifest, syncing the directory (`SSDStore.commit`). The executor commits an
    SSD-resident plan's state after every step (`checkpoint_every` 1), the step waiting for it.
    Measured by `tensorstow probe` through that store; 0 in the papers' presets (their systems do not
    commit a crash-consistent state each step). Left out of the spec's JSON when 0."""
    sync_s: float = 0.0
    """Seconds a written buffer's `fdatasync` costs besides its bytes' flush (the store syncs each
    file as its write completes). Measured with `commit_s`; 0 in the papers' presets. Left out of
    the spec's JSON when 0."""
    flush_bw: float = 0.0
    """Bytes/s at which a sync makes written bytes durable: it waits for the disk (or, on a VM, the
    host) to flush them, so it grows with them. Measured by `tensorstow probe` as a commit after its
    bandwidth write pass (early syncs off), less `commit_s` and `sync_s`; 0: nothing to flush (the
    papers' presets). Left out of the spec's JSON when 0."""

    def read_total(self) -> float:
        bw = self.count * self.read_bw
        return min(bw, self.max_total_bw) if self.max_total_bw else bw

    def write_total(self) -> float:
        bw = self.count * self.write_bw
        return min(bw, self.max_total_bw) if self.max_total_bw else bw

    def write_s_per_byte(self) -> float:
        """Seconds the disk is busy per byte written to an SSD-resident buffer: the write, and the
        flush that makes it durable (`flush_bw`, where stated). The executor's store syncs each
        written file as soon as its write completes (`SSDStore(early_sync=True)`), so the flush
        follows the write on the disk, and a read queued behind it waits (a background commit's
        syncs held the next step's first read 53 ms on a 2-core CPU VM, benchmarks/RESULTS.md
        "SSD store"). [OURS]"""
        return 1 / self.write_total() + (1 / self.flush_bw if self.flush_bw else 0.0)


@dataclass(frozen=True, kw_only=True)
class CPU:
    cores: int
    """Physical cores available to the optimizer."""
    adam_rate: float
    """Adam/AdamW update rate of the whole CPU, parameters/s (fp32 master + m + v)."""
    adam_tensor_s: float = 0.0
    """Host seconds each parameter tensor of an update costs besides its elements: the executor's
    optimizer step finds the tensor's master, gradient and moments in their buffers (a view of
    each), rebuilds the gradient from its recipe and calls the fused kernel once per tensor: for a
    small model's many small tensors, a large part of the update (benchmarks/RESULTS.md "CPU
    Adam"). Measured by `tensorstow probe` through those stores and that kernel, without the recipe
    (a lower bound); 0 in the papers' presets (their rates are measured updates). Left out of the
    spec's JSON when 0."""
    gloo_bw: float = 0.0
    """Bus bandwidth of a ring all-reduce between processes on this machine over gloo (host
    memory and loopback TCP), bytes/s: data-parallel ranks whose device tier is the CPU reduce
    through it. Measured by `tensorstow probe`; left out of the spec's JSON when 0."""
    gloo_gather_bw: float = 0.0
    """The same for gloo's all-gather (`all_gather_into_tensor`), which reaches about half the
    all-reduce's bus bandwidth here (0.60-0.67 against 1.12-1.56 GB/s for 16 MiB between two
    processes on a 2-core AMD EPYC VM): the ranks gather the others' rows of P through it. 0: `gloo_bw`. Measured
    by `tensorstow probe`; left out of the spec's JSON when 0."""
    gloo_step_s: float = 0.0
    """Seconds each step of a ring collective over gloo costs besides its bytes (the alpha of the
    alpha-beta model: an all-reduce takes 2 (N - 1) steps, an all-gather N - 1): half an
    all-reduce of one element between two processes, 79-200 us on a 2-core AMD EPYC VM, which the
    executor pays once per tensor it reduces or gathers. Measured by `tensorstow probe`; left out
    of the spec's JSON when 0."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    """Preset name or a user label."""
    gpus: tuple[GPU, ...]
    dram: DRAM
    ssd: SSD
    cpu: CPU
    gpu_p2p_bw: float = 0.0
    """GPU<->GPU bandwidth when GPUDirect P2P exists (0: peer traffic goes through DRAM)."""
    root_complex_bw: float = 0.0
    """Bandwidth of one CPU root complex shared by its GPUs (Mobius contention); 0 = unlimited."""
    source: str = ""
    """Where the numbers come from (paper table, datasheet, `tensorstow probe`)."""

    @property
    def gpu(self) -> GPU:
        return self.gpus[0]

    def to_json(self) -> dict:
        d = {f.name: encode(getattr(self, f.name)) for f in dataclasses.fields(self)}  # JSON's lists
        d["gpus"] = [{k: v for k, v in g.items() if k not in OMITTED_WHEN_ZERO or v} for g in d["gpus"]]
        for part in ("ssd", "cpu"):
            d[part] = {k: v for k, v in d[part].items() if k not in OMITTED_WHEN_ZERO or v}
        return d

    @staticmethod
    def from_json(d: dict, where: str = "hardware spec") -> "Hardware":
        """Strict: unknown or missing keys, wrong types and negative numbers name the field."""
        if isinstance(d, dict) and d.get("gpus") == []:
            raise TensorstowError(f"{where}: field 'gpus': expected a non-empty list of GPU objects")
        return decode(Hardware, d, where, nonneg=True)

    def fingerprint(self) -> str:
        return stable_hash(self.to_json())

    def rank_share(self, ranks: int) -> "Hardware":
        """What one of `ranks` data-parallel processes on this machine has: its first GPU, and an
        equal share of the DRAM (capacity and bandwidth), the SSDs' bandwidth and capacity and the
        CPU's cores and Adam rate (every rank updates its shard beside the others)."""
        if ranks <= 1:
            return dataclasses.replace(self, gpus=self.gpus[:1])
        d, s, c = self.dram, self.ssd, self.cpu
        under = sum(g.root_complex == self.gpu.root_complex for g in self.gpus[:ranks])  # ranks sharing its uplink
        return dataclasses.replace(
            self, name=f"{self.name} (1 of {ranks} ranks)", gpus=self.gpus[:1],
            root_complex_bw=self.root_complex_bw / max(1, under),
            dram=dataclasses.replace(d, capacity_bytes=d.capacity_bytes // ranks, bandwidth=d.bandwidth / ranks),
            ssd=dataclasses.replace(s, read_bw=s.read_bw / ranks, write_bw=s.write_bw / ranks,
                                    max_total_bw=s.max_total_bw / ranks, capacity_bytes=s.capacity_bytes // ranks,
                                    flush_bw=s.flush_bw / ranks),
            cpu=dataclasses.replace(c, cores=max(1, c.cores // ranks), adam_rate=c.adam_rate / ranks))

    def with_overrides(self, *, gpu_mem: int | None = None, dram: int | None = None,
                       ssds: int | None = None, gpus: int | None = None) -> "Hardware":
        hw = self
        if gpus is not None:  # the first N GPUs; more than the spec has repeat its last one
            if gpus < 1:
                raise TensorstowError(f"--gpus must be >= 1, got {gpus}")
            picked = [hw.gpus[min(k, len(hw.gpus) - 1)] for k in range(gpus)]
            cpu = sum(g.name == CPU_GPU_NAME for g in picked)
            if cpu > 1:  # CPU "devices" (one process each) share the cores and memory the probe measured
                picked = [g.shared_by(cpu) if g.name == CPU_GPU_NAME else g for g in picked]
            hw = dataclasses.replace(hw, gpus=tuple(picked))
        if gpu_mem is not None:  # the plan's budget; the context and workspaces come on top
            hw = dataclasses.replace(hw, gpus=tuple(dataclasses.replace(g, memory_bytes=gpu_mem + g.reserved_bytes)
                                                    for g in hw.gpus))
        if dram is not None:
            hw = dataclasses.replace(hw, dram=dataclasses.replace(hw.dram, capacity_bytes=dram))
        if ssds is not None:
            if ssds < 0:
                raise TensorstowError(f"--ssds must be >= 0, got {ssds}")
            hw = dataclasses.replace(hw, ssd=dataclasses.replace(hw.ssd, count=ssds))
        return hw


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size written as a user writes it: 200MB, 24GB, 256GiB or a byte count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise TensorstowError(f"cannot read size '{text}': write e.g. 200MB, 24GB, 256GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
