"""The static schedule's data: what a policy decides (`Decisions`), the buffers it moves
(`Buffer`), the instructions (`Instr`), and the names they use: buffer kinds, tiers, streams.

Buffers are per block and per kind (a block's activations move as one unit); a name is
`<kind>:<block>`, with `@<k>` for microbatch k's copy in a pipeline (`A:h.3@1`):
  P:<b>  parameters in compute precision        G:<b>  their gradient (compute precision)
  M:<b>  fp32 master copy (mixed precision)     OS:<b> Adam exp_avg + exp_avg_sq (fp32)
  C:<b>  constants: frozen parameters, buffers (read-only: loaded like P, never written back)
  X:<b>  the block's input checkpoint           A:<b>  activations saved inside the block
  R:<b>  saved activations a partial swap makes again before the backward (BlockDecision.reforward)
  T:<b>  values b's backward carries to a later backward (a tied weight's partial gradient)
  H:<b>  what b's backward hands to the next backward (the activation gradient)
  W:<phase>:<b>  transient workspace of a segment
  AE:<b>, RE:<b>  with a cut backward (BlockDecision.bwd_cut), the part of A:/R:<b> only the first
         part reads, released when it ends; K:<b> what the first part hands to the second
Tiers are `gpuK` (GPU K's memory; `gpu` in capacities and peaks: any GPU), `dram` and `ssd`;
an optimizer step's device is `cpu` or `gpuK`.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from tensorstow.schema.typed import freeze


class Tier(enum.StrEnum):
    """A memory tier. A plan names GPU K's memory `gpuK` (`gpu_tier`); capacities and peaks say
    `gpu` for any GPU (`tier_class`)."""
    GPU = "gpu"
    DRAM = "dram"
    SSD = "ssd"


TIERS = tuple(t.value for t in Tier)
"""Fastest first: a copy towards a later tier is a store, towards an earlier one a load."""


def gpu_tier(k: int) -> str:
    """GPU k's tier (and optimizer device, and the prefix of its streams): `gpu3`."""
    return f"gpu{k}"


def gpu_number(name: str) -> int | None:
    """The K of a GPU's name `gpuK` (a tier, an optimizer device, a stream's device); None for any
    other name: the one parser of GPU names."""
    head, k = name[:3], name[3:]
    return int(k) if head == "gpu" and k.isdigit() else None


def is_gpu(name: str) -> bool:
    """Whether `name` (a tier, an optimizer device, a stream's device) is a GPU's: `gpuK`."""
    return gpu_number(name) is not None


def gpu_index(tier: str) -> int:
    """`gpu3` -> 3."""
    k = gpu_number(tier)
    if k is None:
        raise ValueError(f"'{tier}' names no GPU (gpuK)")
    return k


def tier_class(tier: str) -> Tier:
    """`gpuK` -> Tier.GPU; `dram`, `ssd` -> themselves."""
    return Tier.GPU if is_gpu(tier) else Tier(tier)


@dataclass(frozen=True)
class Stream:
    """A stream's name, parsed: `gpu0.compute` -> Stream("gpu0", "compute"), `ssd.first` ->
    Stream("ssd", "first"), `cpu.opt` -> Stream("cpu", "opt") (`Instr.stream` lists them)."""
    device: str
    """gpuK, ssd or cpu."""
    lane: str

    @staticmethod
    @functools.cache
    def of(name: str) -> "Stream":
        device, _, lane = name.partition(".")
        return Stream(device, lane)

    @property
    def resource(self) -> str:
        """What the stream's work occupies: the SSD for every SSD stream, else the stream itself."""
        return "ssd" if self.device == "ssd" else f"{self.device}.{self.lane}" if self.lane else self.device

    @property
    def on_gpu(self) -> bool:
        return is_gpu(self.device)



class BufferKind(enum.StrEnum):
    """What a buffer holds: the part of its name before the colon (the module docstring lists them)."""
    P = "P"
    C = "C"
    G = "G"
    M = "M"
    OS = "OS"
    A = "A"
    R = "R"
    X = "X"
    T = "T"
    H = "H"
    W = "W"
    AE = "AE"
    RE = "RE"
    K = "K"

    def of(self, block: str, micro: int | None = None) -> str:
        """This kind's buffer of `block` (for microbatch `micro`): `BufferKind.A.of("h.3", 1)` -> `A:h.3@1`."""
        return f"{self}:{block}" if micro is None else f"{self}:{block}@{micro}"


class InstrKind(enum.StrEnum):
    """What an instruction does (`Instr.kind`; the executor's `runtime.HANDLERS` has one handler each)."""
    COMPUTE = "compute"
    """Run a segment of the joint graph on the device."""
    RECOMPUTE = "recompute"
    """Run a forward segment again, for what a backward reads and the step did not keep."""
    LOAD = "load"
    """Copy a buffer towards the device (ssd -> dram -> gpuK)."""
    STORE = "store"
    """Copy a buffer away from the device (gpuK -> dram -> ssd)."""
    SEND = "send"
    """A stage boundary to or from another rank's GPU (pipelines)."""
    FREE = "free"
    """Drop a tier's copy of a buffer."""
    OPTIMIZER_STEP = "optimizer_step"
    """Update one block's parameters (its optimizer subgroup)."""
    COMMIT = "commit"
    """Commit the step before to the SSD store once its deferred write-backs are home."""
    REDUCE = "reduce"
    """Data parallel: sum a block's gradient over the ranks, in place (all-reduce)."""
    GATHER = "gather"
    """Data parallel: the other ranks' updated rows of a block's parameters P, in place (all-gather)."""


STATE_KINDS = (BufferKind.P, BufferKind.C, BufferKind.M, BufferKind.OS)
"""The training state: a block's buffers with a home tier, placed before the first step."""
OPTIMIZER_INPUTS = (BufferKind.M, BufferKind.OS, BufferKind.G)
"""Buffers an SSD read brings for an update: the fp32 master, Adam's states, a swapped gradient."""
HELD_KINDS = (BufferKind.P, BufferKind.C, BufferKind.G, BufferKind.A, BufferKind.R, BufferKind.X, BufferKind.T,
              BufferKind.H, BufferKind.AE, BufferKind.RE, BufferKind.K)
"""Kinds whose members are joint-graph values a segment may read (all but M, OS and W)."""
MADE_BY_COMPUTE = (BufferKind.A, BufferKind.R, BufferKind.X, BufferKind.G, BufferKind.T, BufferKind.H,
                   BufferKind.AE, BufferKind.RE, BufferKind.K)
"""Kinds a compute or recompute instruction may create on the device."""
PER_MICRO = (BufferKind.A, BufferKind.X, BufferKind.H, BufferKind.T)
"""Kinds a pipeline holds one copy of per microbatch (`A:b@m`)."""


PAGE_BYTES = 4096
"""Every host range a plan's buffers take is aligned to this: the SSD tier's O_DIRECT reads and
writes land in them."""


def buffer_kind(name: str) -> BufferKind:
    """`A:h.3@1` -> BufferKind.A; `W:fwd:h.3` -> BufferKind.W."""
    return BufferKind(name.split(":", 1)[0])


SEARCH_NOTE = "search: "
"""The start of a `Decisions.notes` entry that traces the policy's search rather than states a reason:
`plan` and `show` print those with -v only."""


class Activations(enum.StrEnum):
    """What a block does with its saved activations A between its forward and its backward."""
    KEEP = "keep"
    """Kept on the GPU."""
    SWAP_DRAM = "swap_dram"
    """Swapped out to DRAM and back."""
    SWAP_SSD = "swap_ssd"
    """Swapped out to the SSD (through DRAM) and back."""
    RECOMPUTE = "recompute"
    """Made again from the block's checkpoint X before its backward."""


ACTIVATION_CHOICES = tuple(a.value for a in Activations)


class UpdateDevice(enum.StrEnum):
    """Where a block's optimizer subgroup is updated."""
    GPU = "gpu"
    CPU = "cpu"


@dataclass(frozen=True, kw_only=True)
class BlockDecision:
    params: Tier = Tier.GPU
    """Home tier of the compute-precision parameters P; not "gpu" = streamed in per use."""
    states: Tier = Tier.GPU
    """Home tier of the fp32 master copy and Adam states (M, OS)."""
    optimizer: UpdateDevice = UpdateDevice.GPU
    """Where the block's optimizer subgroup is updated: "gpu" or "cpu"."""
    activations: Activations = Activations.KEEP
    """Saved activations A: keep on GPU, swap to DRAM / SSD, or recompute from the checkpoint."""
    checkpoint: Tier = Tier.GPU
    """Tier holding the block's input X between forward and backward."""
    reforward: bool = False
    """With a swap: move only the outputs of the block's FLOP-bearing ops (A:<b>, the profile's
    `swapped`) and make the rest of its saved values again before its backward from those and X
    (R:<b>, a `recompute` of segment `refwd:<b>`): Fuyou Table 2's per-layer choice, the linear
    layers' outputs swapped and the FLOP-free ops recomputed."""
    bwd_cut: int = 0
    """The block's backward runs in two parts (segments `bwd1:<b>`, the first `bwd_cut` ops, and
    `bwd2:<b>`), and what only the first part reads of its saved activations (AE:/RE:<b>) is released
    between them, so the swapped block before it can load its activations into that room while the
    second part runs: LoHan's layer-by-layer swapping (§IV-D) at the granularity of the block's
    profile cut (`BlockProfile.bwd_cut`). 0: one segment, `bwd:<b>`."""
    accum: Tier | None = None
    """`Decisions.grad_accum` > 1: the tier holding the block's accumulated gradient G:<b> between
    its microbatches' backwards ("gpu": it stays there; "dram" or "ssd": it goes there after each
    backward and comes back for the next one, which adds into it); None without accumulation."""

    def __post_init__(self):
        # the vocabulary's types, whatever a caller passed (a policy may write "dram")
        for name, tp in (("params", Tier), ("states", Tier), ("checkpoint", Tier), ("optimizer", UpdateDevice),
                         ("activations", Activations)):
            object.__setattr__(self, name, tp(getattr(self, name)))
        object.__setattr__(self, "accum", Tier(self.accum) if self.accum else None)


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """A multi-GPU plan's structure (Mobius §3): runs of consecutive blocks (stages), the GPU each
    runs on, and the microbatches one step is cut into. A block's "gpu" tier is its stage's GPU."""
    kind: str
    """mobius (stages swapped in from DRAM), gpipe (every stage resident) or data-parallel
    (every GPU runs every block on its own microbatch: ZeRO-3-like, `stages` is one stage)."""
    stages: tuple[tuple[int, int], ...]
    """Per stage, its blocks [first, last) in forward order."""
    gpus: tuple[int, ...]
    """Per stage, the index of its GPU (data-parallel: every GPU)."""
    microbatches: int
    """M: the step's batch is M microbatches of `model.batch` samples."""
    mapping: str = "cross"
    """How `gpus` was chosen: cross (Mobius §3.3, from the root complexes) or sequential."""

    def to_json(self) -> dict:
        return {"kind": self.kind, "stages": [list(s) for s in self.stages], "gpus": list(self.gpus),
                "microbatches": self.microbatches, "mapping": self.mapping}

    def stage_of(self, order: list[str]) -> dict[str, int]:
        """Block name -> its stage."""
        return {order[i]: j for j, (lo, hi) in enumerate(self.stages) for i in range(lo, hi)}


@dataclass(frozen=True, kw_only=True)
class Decisions:
    policy: str
    blocks: dict[str, BlockDecision]
    """Per block, in forward order."""
    prefetch: int = 1
    """Streamed blocks loaded ahead of use (Fuyou §4.4 FIFO prefetch). STRONGHOLD's window of m
    layers is prefetch = m: m+1 parameter buffers on the GPU (STRONGHOLD Eq. 1c)."""
    overlap_optimizer: bool = False
    """True: a block's CPU update starts once its gradient arrives, during backward (LoHan
    active gradient offloading); False: all updates after backward (ZeRO-Infinity, Fuyou Fig. 2a)."""
    serialize_optimizer: bool = False
    """True: subgroup i+1's state read waits for subgroup i's write-back (no I/O pipelining)."""
    grad_buffers: int = 0
    """Gradient slots in DRAM for CPU-updated subgroups (0 = unbounded): the backward of a block
    waits until the gradient `grad_buffers` blocks earlier has been consumed by its update, so
    an optimizer slower than backward throttles it instead of filling DRAM. Only with
    overlap_optimizer (otherwise every gradient waits for the end of backward anyway)."""
    notes: tuple[str, ...] = ()
    """Human-readable reasons the policy gives for its choices; those that trace its search (each
    MIP round, each stage count, each swap count simulated) begin with SEARCH_NOTE."""
    pipeline: Pipeline | None = None
    """Several GPUs: the stages, their GPUs and the microbatches (planner.pipeline); None: one GPU."""
    swap_grads: bool = False
    """CPU-updated gradients go on from DRAM to SSD when the backward makes them, in fp32, and come
    back for the update: DeepSpeed's ZeRO-Infinity with the optimizer on NVMe (stage3.py
    `_offload_grad_partition_at_boundary` casts them to fp32, `swap_out_gradients` writes them;
    the optimizer swaps them in with the states). The zero-infinity baseline's."""
    blocking_copies: bool = False
    """The compute waits for the copies that go with it, as DeepSpeed 0.9.3 makes them: a block's
    input checkpoint goes to DRAM before the block runs and comes back when its backward starts
    (activation_checkpointing/checkpointing.py, `CPU_CHECKPOINT`: `.to(device)`, blocking), and each
    gradient's copy to DRAM holds up the next backward (swap_tensor/utils.py `insert_tensor`, a
    blocking `copy_` into the gradient swapper's pinned buffer; its write to SSD stays
    asynchronous). The zero-infinity baseline's (Fuyou Fig. 2a: "P^i (SSD to CPU), P^i (CPU to
    GPU), C_G^i (GPU), and A^i (GPU to CPU) are serialized")."""
    keep_params_for_update: bool = False
    """fp32: a CPU-updated block's parameters, read SSD -> DRAM -> GPU for its backward, keep the
    DRAM copy until the update instead of reading it from SSD again after the backward (one SSD
    read less per block and step, for that copy's DRAM from the backward's load to the update).
    `planner.passes.schedule` sets it where the plan still fits and is not slower."""
    ssd_reads_first: bool = False
    """The SSD reads a computation waits for (parameters, activations) go on `ssd.first`, which
    the executor's store runs ahead of queued writes and the simulator lets pause the write in
    progress; the update pipeline's reads stay on `ssd.read`, in order with the writes, each after
    the `ssd.first` read emitted before it. Off: every SSD read on `ssd.read`, in program order.
    `planner.passes.schedule` sets it where the plan still fits (a read that keeps pausing writes
    delays the DRAM those writes free)."""
    deferred_writes: tuple[str, ...] = ()
    """Blocks whose update's write-backs to SSD run at the start of the next step instead of
    ending this one: their updated P (and M) and Adam states stay in DRAM across the step
    boundary (carried, `carried_buffers`), the next step writes them home beside its first
    forwards and its first forward takes P from that DRAM copy instead of reading it from SSD.
    The step's state is then whole on SSD only once those writes are done: a `commit`
    instruction there commits the previous step, and every update and SSD write of this step
    waits for it. One GPU, CPU updates; `planner.passes.defer_writes` sets it for the blocks
    updated last where the plan still fits and is faster."""
    host_reserved: int = 0
    """DRAM bytes the system a policy models holds all step besides the plan's buffers, counted in
    the DRAM peak: the zero-infinity baseline's DeepSpeed pinned swap buffers and host gradient
    buffers (planner/policies/zero_infinity.py). The executor does not allocate it."""

    speculated: tuple[str, ...] = ()
    """With clipping (`Options.max_grad_norm`): the blocks whose CPU update runs as their gradient
    arrives, before the global norm is known, with factor 1 (the other updates wait for the last
    backward). Their state's home is SSD, so the last commit holds its version from before the
    step; each keeps its gradient in DRAM until the norm is known. Where the clip fires, the
    plan's redo program (`Plan.redo_instructions`) reads that version back and updates again with
    the clipped gradients, before anything is committed (exact: no algebraic inversion)."""
    grad_accum: int = 1
    """One GPU: the step runs the forward and backward of this many microbatches of `model.batch`
    rows one after the other (microbatch k's compute instructions say `micro` k), every later one
    adding its gradients into G (`accum`); the updates run in the last one's backward, as the
    policy decided them (`Options.grad_accum`)."""

    updates_wait: bool = False
    """Every update waits for every gradient: clipping by the global norm (`Options.max_grad_norm`)
    needs the norm of all of them, fp16 loss scaling whether any overflowed. The lowering then makes
    every optimizer step wait for the last backward (but the `speculated` ones, which a redo
    corrects) and double-buffers the subgroups' state reads. Set by `planner.passes.schedule`."""

    device_reserved: int = 0
    """Bytes each GPU holds all step besides the plan's buffers: the step's inputs (token ids,
    targets, the loss tangent) of every microbatch, which the executor puts on the device when the
    step starts. Set by `planner.passes.schedule`."""

    dp: int = 1
    """Data parallel (`Options.dp`): the ranks running this schedule, each on its own rows. Each
    block's last backward is followed by a `reduce` of its gradient over them, its
    `optimizer_step` updates the rank's shard (M: and OS: hold ceil(rows / dp) rows of each
    parameter) and a `gather` brings the other ranks' rows of P, on the rank's `gpuK.reduce` and
    `gpuK.gather` streams (each in program order, the same on every rank). Set by `planner.passes.schedule`."""

    def __post_init__(self):
        freeze(self)

    def of(self, block: str) -> BlockDecision:
        """The decision of a block, or of a unit (`UNIT`): its own where it has one, else its block's."""
        d = self.blocks.get(block)
        return d if d is not None else self.blocks[parent_of(block)]

    def fp32_grads(self, mixed: bool) -> bool:
        """Whether a mixed-precision plan's G buffers hold fp32 gradients: accumulated over
        microbatches or ranks (as eager's fp32 `.grad`: `grad_accum`, a pipeline's, `dp`; not the data-parallel baseline's per-GPU ones), or on
        their way to SSD (`swap_grads`). The planner sizes G by it and the executor casts to it."""
        pl = self.pipeline
        return mixed and (self.swap_grads or self.grad_accum > 1 or self.dp > 1
                          or (pl is not None and pl.microbatches > 1 and pl.kind != "data-parallel"))

    def microbatches(self) -> int:
        """Microbatches of `model.batch` rows one step trains on: a pipeline's, else `grad_accum`."""
        return self.pipeline.microbatches if self.pipeline is not None else self.grad_accum

    def reserved(self) -> dict[str, int]:
        """Tier -> bytes held all step outside the plan's buffers (the simulator's starting use)."""
        out = {"dram": self.host_reserved} if self.host_reserved else {}
        if self.device_reserved:
            for k in sorted(set(self.pipeline.gpus)) if self.pipeline else [0]:
                out[f"gpu{k}"] = self.device_reserved
        return out

    def to_json(self) -> dict:
        d = {"policy": self.policy, "prefetch": self.prefetch, "grad_buffers": self.grad_buffers,
             "overlap_optimizer": self.overlap_optimizer,
             "serialize_optimizer": self.serialize_optimizer, "notes": list(self.notes),
             "blocks": {b: {k: v for k, v in vars(d).items() if k not in ("reforward", "bwd_cut", "accum") or v}
                        for b, d in self.blocks.items()}}
        if self.pipeline is not None:
            d["pipeline"] = self.pipeline.to_json()
        if self.swap_grads:
            d["swap_grads"] = True
        if self.grad_accum > 1:
            d["grad_accum"] = self.grad_accum
        if self.speculated:
            d["speculated"] = list(self.speculated)
        if self.blocking_copies:
            d["blocking_copies"] = True
        if self.keep_params_for_update:
            d["keep_params_for_update"] = True
        if self.ssd_reads_first:
            d["ssd_reads_first"] = True
        if self.deferred_writes:
            d["deferred_writes"] = list(self.deferred_writes)
        if self.host_reserved:
            d["host_reserved"] = self.host_reserved
        if self.device_reserved:
            d["device_reserved"] = self.device_reserved
        if self.updates_wait:
            d["updates_wait"] = True
        if self.dp > 1:
            d["dp"] = self.dp
        return d


@dataclass(frozen=True)
class Instr:
    id: int
    kind: str
    """An `InstrKind` (its value, as the plan file writes it)."""
    stream: str
    """gpuK.compute, gpuK.h2d, gpuK.d2h, gpuK.send, gpuK.reduce, gpuK.gather, ssd.first, ssd.read, ssd.write, cpu.opt"""
    deps: tuple[int, ...]
    segment: str = ""
    """compute/recompute: "fwd:<b>", "bwd:<b>" or "refwd:<b>" (a partial swap's re-forward);
    optimizer_step: the subgroup (block)."""
    tensor: str = ""
    """load/store/free: the buffer."""
    src: str = ""
    dst: str = ""
    """load/store: tiers; free: `dst` is the tier released; optimizer_step: the device."""
    allocs: tuple[str, ...] = ()
    """Buffers this instruction creates on the compute device (compute/recompute)."""
    workspace: str = ""
    """Transient buffer held only while the instruction runs."""
    est_s: float = 0.0
    """Modeled duration (set when the plan is written; 0 straight out of the lowering)."""
    micro: int = 0
    """compute/recompute: the microbatch the segment runs on (pipelines; 0 otherwise)."""
    accum: tuple[str, ...] = ()
    """compute: gradient buffers the segment adds its results into (a later microbatch)."""
    contended_s: float = 0.0
    """compute/recompute: how much longer than `est_s` it runs in the overlapped replay, where copies
    and SSD transfers stream host memory beside it (`GPU.host_contention`: the CPU device tier; 0 on
    a GPU). Sync mode runs nothing beside it and takes `est_s` alone."""

    def to_json(self) -> dict:
        d = {"id": self.id, "kind": self.kind, "stream": self.stream, "deps": list(self.deps),
             "est_s": self.est_s}
        for k in ("segment", "tensor", "src", "dst", "workspace", "micro", "contended_s"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        for k in ("allocs", "accum"):
            if getattr(self, k):
                d[k] = list(getattr(self, k))
        return d


TENSOR_KINDS = {BufferKind.P: "parameter", BufferKind.C: "constant", BufferKind.G: "gradient",
                BufferKind.M: "optimizer_state", BufferKind.OS: "optimizer_state",
                **{k: "saved_activation" for k in (BufferKind.A, BufferKind.R, BufferKind.X, BufferKind.AE, BufferKind.RE)},
                **{k: "temporary" for k in (BufferKind.T, BufferKind.H, BufferKind.K, BufferKind.W)}}
"""The IR's tensor kind of each buffer kind (what a plan file's `kind` of a buffer says)."""


@dataclass(frozen=True)
class Buffer:
    name: str
    bytes: int
    block: str
    home: str = ""
    """Tier holding it at the start and end of every step ("" = created and freed within the step)."""
    members: tuple[str, ...] = ()
    """What it holds, in layout order, by the names of the block's profile (a replica holds its
    own layer's tensors of those names): model-state names for P/C, `<param>.master` for M,
    `<param>.exp_avg`/`.exp_avg_sq` for OS, joint-graph storage roots for G/A/X/T. Workspaces
    (W) list none: their bytes are the segment's peak of short-lived temporaries."""

    @property
    def buffer_kind(self) -> BufferKind:
        """What it holds, from its name (`buffer_kind`)."""
        return buffer_kind(self.name)

    @property
    def kind(self) -> str:
        """The IR's kind of the tensors it holds (`TENSOR_KINDS`)."""
        return TENSOR_KINDS[buffer_kind(self.name)]


def carried_buffers(decisions: Decisions, buffers: dict[str, Buffer]) -> list[str]:
    """The buffers `Decisions.deferred_writes` keeps in DRAM between steps (those with an SSD home
    of blocks updated on the CPU), in the order the next step writes them home: the master and
    Adam's states, then the parameters."""
    return [f"{k}:{b}" for b in decisions.deferred_writes for k in ("M", "OS", "P")
            if f"{k}:{b}" in buffers and buffers[f"{k}:{b}"].home == "ssd" and decisions.of(b).optimizer == "cpu"]


def split_micro(name: str) -> tuple[str, int | None]:
    """`A:b@2` -> ("A:b", 2); a name without a microbatch -> (name, None)."""
    base, at, m = name.rpartition("@")
    return (base, int(m)) if at and m.isdigit() else (name, None)


def split_segment(segment: str) -> tuple[str, str]:
    """A segment's phase and block: `bwd1:h.3` -> ("bwd1", "h.3")."""
    phase, _, block = segment.partition(":")
    return phase, block


def block_of(name: str) -> str:
    """The block a buffer name belongs to: `A:h.3@1` -> `h.3`; `P:b3/x1` -> `b3/x1` (a unit)."""
    return split_micro(name)[0].split(":")[-1]


UNIT = "/"
"""Separates a block from one of its placement units: `b3/x1`, the second group of block b3's
experts. A unit owns its parameters' state (P, G, M, OS: rows of the block's expert weights,
`rows_member`) and has a decision of its own; the block's segments compute with all of it."""


def unit_name(block: str, k: int) -> str:
    """Block `block`'s k-th group of experts as a placement unit: `b3/x1`."""
    return f"{block}{UNIT}x{k}"


def units_by_block(blocks) -> dict[str, list[str]]:
    """Block -> its placement units among `blocks` (names of blocks and units), in unit order."""
    out: dict[str, list[str]] = {}
    for u in sorted({b for b in blocks if UNIT in b}, key=lambda u: (parent_of(u), int(u.rsplit("x", 1)[1]))):
        out.setdefault(parent_of(u), []).append(u)
    return out


def parent_of(block: str) -> str:
    """The block a unit belongs to (a block is its own): `b3/x1` -> `b3`."""
    return block.split(UNIT, 1)[0]


def rows_member(name: str, rows: tuple[int, int]) -> str:
    """A buffer member holding rows [a, b) of the first dimension of `name`: `w[2:4]`."""
    return f"{name}[{rows[0]}:{rows[1]}]"


def member_rows(member: str) -> tuple[str, tuple[int, int] | None]:
    """`w[2:4]` -> ("w", (2, 4)); a whole member `w` -> ("w", None)."""
    if not member.endswith("]") or "[" not in member:
        return member, None
    name, _, rows = member[:-1].rpartition("[")
    a, _, b = rows.partition(":")
    return name, (int(a), int(b))


def gpus_of_blocks(decisions: Decisions, order: list[str]) -> dict[str, str]:
    """Block -> the GPU tier ("gpuK") that runs it: its stage's GPU in a pipeline, else gpu0
    (`order`: the blocks in forward order)."""
    pl = decisions.pipeline
    if pl is None or pl.kind == "data-parallel":
        return ByBlock({b: gpu_tier(0) for b in order})
    return ByBlock({b: gpu_tier(pl.gpus[j]) for b, j in pl.stage_of(order).items()})


class ByBlock(dict):
    """Block -> a value, which a block's units (`UNIT`) share."""

    def __missing__(self, key: str):
        if UNIT in key:
            return self[parent_of(key)]
        raise KeyError(key)


def home_tiers(buffers: dict[str, Buffer], decisions: Decisions, order: list[str]) -> dict[str, str]:
    """Buffer -> the tier it lives on between steps: a "gpu" home is its stage's GPU."""
    gpu_of = gpus_of_blocks(decisions, order)
    return {n: (gpu_of[parent_of(b.block)] if b.home == "gpu" else b.home) for n, b in buffers.items() if b.home}


def initial_residency(buffers: dict[str, Buffer], decisions: Decisions, order: list[str]) -> set[tuple[str, str]]:
    """The (buffer, tier) copies present when a step starts: every home, and the DRAM copies
    `Decisions.deferred_writes` carries from the step before."""
    return set(home_tiers(buffers, decisions, order).items()) | {
        (x, "dram") for x in carried_buffers(decisions, buffers)}


def final_residency(buffers: dict[str, Buffer], decisions: Decisions, order: list[str]) -> set[tuple[str, str]]:
    """The (buffer, tier) copies present when a step's instructions end: those it began with, and
    the gradients of the speculated updates, kept in DRAM for the redo program until the norm
    is known (`Decisions.speculated`)."""
    spec = set(decisions.speculated)
    return initial_residency(buffers, decisions, order) | {
        (n, "dram") for n, b in buffers.items() if b.buffer_kind is BufferKind.G and parent_of(b.block) in spec}


def block_gpus(plan) -> dict[str, str]:
    """Block -> the GPU tier ("gpuK") that runs it, for a plan file (`schema.plan.Plan`)."""
    return gpus_of_blocks(plan.decisions, [b.name for b in plan.model.blocks])


CPU_OPTIMIZER = "cpu.opt"
"""The stream of the CPU optimizer's updates."""


def resource_of(stream: str) -> str:
    """The resource a stream's work occupies (`Stream.resource`)."""
    return Stream.of(stream).resource


def runs_on(ins: Instr, gpu: str, block_gpu: dict[str, str], buffers) -> bool:
    """Whether the process driving GPU tier `gpu` replays `ins`: that GPU's streams, both ends of a
    send touching it, every commit, and the host work (DRAM, SSD, CPU optimizer) of its blocks
    (`block_gpu`: block -> its GPU tier)."""
    if ins.kind == InstrKind.SEND:
        return gpu in (ins.src, ins.dst)
    if ins.kind == InstrKind.COMMIT:
        return True
    dev = Stream.of(ins.stream).device
    if is_gpu(dev):
        return dev == gpu
    return block_gpu[parent_of(ins.segment if ins.kind == InstrKind.OPTIMIZER_STEP else buffers[ins.tensor].block)] == gpu
