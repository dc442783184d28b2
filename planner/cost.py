"""Cost model: block profiles from the IR, and the duration of every instruction.

Op time is a roofline: max(FLOPs / THP_G, bytes / memory bandwidth), summed over a
segment's ops; a probed GPU's matmuls and attention run at the rates measured at their sizes,
and every kernel takes at least its launch floor. Transfers take bytes / link bandwidth; the host link is duplex (H2D and D2H
are separate resources), SSD traffic is simplex across N drives (Fuyou Eq. 3-4, LoHan
Eq. 2: reads and writes share the SSDs' bandwidth). The CPU optimizer updates
`cpu.adam_rate` parameters per second; the GPU optimizer is memory-bound.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tensorstow.ir.graph import FLASH_MIN_CAPABILITY, Graph, attention_flops, draws_random, flash_eligible, lsum, numel
from tensorstow.schema.hardware import CPU_GPU_NAME, Hardware
from tensorstow.schema.schedule import UNIT, InstrKind, gpu_index, is_gpu, parent_of, rows_member

# Bytes moved per parameter by one Adam step on the GPU: read param, grad, master, m, v and
# write master, m, v, param (mixed precision: 2+2+4+4+4 read, 4+4+4+2 written).
GPU_ADAM_BYTES_PER_PARAM = 30


@dataclass(frozen=True)
class UnitProfile:
    """A group of a block's experts as a placement unit (`schema.schedule.UNIT`): rows [a, b) of each
    of the block's expert weights (a mixture of experts' (experts, ...) parameters), their gradients'
    rows, and what an update of them takes."""

    name: str
    """The unit's suffix in its block's name (`x0`: `b3/x0`)."""
    rows: tuple[int, int]
    """The experts it holds: [a, b)."""
    params: tuple[str, ...]
    """P:<unit> members: `rows_member` of each expert weight."""
    grads: tuple[str, ...]
    """G:<unit> members: the same rows of each expert weight's gradient storage root."""
    param_count: int
    param_bytes: int
    grad_bytes: int
    grad_fp32_bytes: int
    opt_workspace: int
    """Scratch of a GPU Adam step of the unit (two fp32 tensors the size of its largest slice)."""


@dataclass(frozen=True)
class BlockProfile:
    """Everything the planner needs about one traced block (shared by similar blocks)."""

    name: str
    fwd_ops: tuple[int, int]
    """[first, last] op index of the block's forward in the IR (-1, -1 if none)."""
    bwd_ops: tuple[int, int]
    fwd_flops: int
    bwd_flops: int
    fwd_time_s: float
    """Roofline time of the forward on the GPU."""
    bwd_time_s: float
    param_count: int
    """Trainable parameters."""
    param_bytes: int
    """Bytes of their compute copies P (mixed precision: 16-bit where autocast only reads them
    cast, fp32 where it reads them in fp32: norm weights, embeddings)."""
    grad_bytes: int
    """Bytes of their gradients' storages G (the dtype of the compute copy)."""
    grad_fp32_bytes: int
    """Bytes of the gradients' storages in fp32: what eager's fp32 `.grad` accumulates in (a
    mixed-precision pipeline's G over several microbatches)."""
    const_bytes: int
    """Frozen parameters and buffers the block owns (read-only: C:<b>)."""
    reads: tuple[str, ...]
    """Other blocks whose parameters or constants this block's ops read (a tied embedding read
    by the LM head in `post`): their P:/C: buffers must be on the device when it runs."""
    saved_bytes: int
    """Activations produced in the block and read by its backward (A_i)."""
    input_bytes: int
    """Values produced by other blocks' forward and read by this block (forward or backward):
    its checkpoint X_i, from which a recompute can rerun the forward (hidden state, masks,
    rotary tables)."""
    output_bytes: int
    """Bytes the block's forward hands to the next block."""
    fwd_workspace: int
    """Peak bytes of temporaries while the forward runs."""
    bwd_workspace: int
    """Peak temporaries of the backward (the gradient it receives is the next block's H, the
    one it hands on its own H)."""
    opt_workspace: int
    """Scratch of a GPU Adam step: two fp32 tensors the size of the block's largest parameter."""
    carried_bytes: int
    """Values the block's backward makes for a backward other than the next one (a tied
    weight's partial gradient, summed where the weight is owned): T:<b>."""
    carried_until: str
    """Profile of the block whose backward reads T:<b> last ("" if nothing is carried): T:<b>
    is released after the first backward of such a block that follows b's."""
    handed_bytes: int
    """Values the block's backward hands to the next backward (the block before it in forward
    order): the activation gradient, H:<b>, held from b's backward to the end of that one."""
    saved: tuple[tuple[str, int, int], ...]
    """(tensor, bytes, FLOPs of the op that produced it) for each saved storage."""
    inputs: tuple[str, ...] = ()
    """Storage roots of X:<b>."""
    carried: tuple[str, ...] = ()
    """Storage roots of T:<b>."""
    handed: tuple[str, ...] = ()
    """Storage roots of H:<b>."""
    params: tuple[str, ...] = ()
    """Model-state names of the trainable parameters it owns (P:<b>, and M:/OS: by parameter)."""
    consts: tuple[str, ...] = ()
    """Model-state names of the frozen parameters and buffers it owns (C:<b>)."""
    grads: tuple[str, ...] = ()
    """Storage roots of its parameters' gradients (G:<b>), in parameter order."""
    swapped: tuple[str, ...] = ()
    """What a partial swap moves (`BlockDecision.reforward`, Fuyou Table 2): the outputs of the
    block's FLOP-bearing ops (linear layers, attention) that its backward or its re-forward read.
    All of `saved` when the block has no cheaper split (then `rest` is empty)."""
    swap_bytes: int = 0
    rest: tuple[str, ...] = ()
    """The saved storages a partial swap leaves behind and the re-forward makes again (norms,
    activation functions, residual sums: FLOP-free ops) from X and `swapped`: R:<b>."""
    rest_bytes: int = 0
    refwd_time_s: float = 0.0
    """Roofline time of the re-forward (memory-bound: its ops count no FLOPs)."""
    refwd_workspace: int = 0
    bwd_cut: int = 0
    """Where the backward may be cut in two (`BlockDecision.bwd_cut`): the number of its ops, in
    order, the first part runs; 0 when no cut frees more than it hands over. LoHan swaps layer by
    layer (§IV-D), so the next swapped block's activations arrive in memory the backward frees as it
    runs: a cut lets the first part release what only it reads (`early`) before that load."""
    early: tuple[str, ...] = ()
    """Saved storages no op after the cut reads: released when the first part ends (AE:/RE:<b>)."""
    handoff: tuple[str, ...] = ()
    """Storage roots the first part makes that the second part or the block's G/T/H hold: K:<b>."""
    handoff_bytes: int = 0
    bwd1_time_s: float = 0.0
    bwd2_time_s: float = 0.0
    """Roofline times of the two parts (their sum is `bwd_time_s`)."""
    bwd1_workspace: int = 0
    bwd2_workspace: int = 0
    sizes: tuple[tuple[str, int], ...] = ()
    """Bytes of each storage in `saved`, `swapped` and `rest` (how a cut splits their buffers)."""
    units: tuple[UnitProfile, ...] = ()
    """`Options.expert_groups`: the block's experts in groups, each a placement unit of its own; the
    block's own buffers hold the rest of its state (`own`)."""
    experts: tuple[str, ...] = ()
    """The expert weights (in `params`) and their gradients' roots (in `grads`) the units hold."""
    shapes: tuple[tuple[int, int], ...] = ()
    """Per parameter of `params`: (rows, elements a row), its first dimension and the rest (a
    data-parallel rank's shard of its optimizer state is whole rows: `shard_count`)."""

    def own(self) -> dict:
        """The block's own state, without what its units hold: params, grads, param_count,
        param_bytes, grad_bytes, grad_fp32_bytes."""
        if not self.units:
            return dict(params=self.params, grads=self.grads, param_count=self.param_count, shapes=self.shapes,
                        param_bytes=self.param_bytes, grad_bytes=self.grad_bytes, grad_fp32_bytes=self.grad_fp32_bytes)
        held = set(self.experts)
        return dict(params=tuple(p for p in self.params if p not in held),
                    shapes=tuple(x for p, x in zip(self.params, self.shapes) if p not in held),
                    grads=tuple(g for g in self.grads if g not in held),
                    **{k: getattr(self, k) - sum(getattr(u, k) for u in self.units)
                       for k in ("param_count", "param_bytes", "grad_bytes", "grad_fp32_bytes")})


def shard_count(shapes, ranks: int) -> int:
    """The elements of one data-parallel rank's shard of parameters of `shapes` ((rows, elements a
    row) each, `BlockProfile.shapes`): of each, ceil(rows / ranks) rows, so every rank's shard has
    the same size (the last ranks' ends padded) and the ranks gather them in one collective."""
    return sum(-(-rows // ranks) * row for rows, row in shapes)


def commit_time(hw, instrs) -> float:
    """Seconds of the store's commit that ends a step writing SSD-resident buffers: `commit_s`, the
    manifest and the directory (`SSDStore.commit`). The written files' syncs are not in it: the
    store runs each as its write completes, and `transfer_time` prices it with the write. It runs
    after the step's last instruction (`simulate`: beside the next step, in one process). 0 where
    the plan writes nothing to SSD. [OURS]"""
    return hw.ssd.commit_s if any(i.kind == InstrKind.STORE and i.dst == "ssd" for i in instrs) else 0.0


def op_time(flops: int, nbytes: int, hw: Hardware, gpu: int = 0, fp32: bool = False, kind: str = "",
            groups: int = 1, rows: float = 0.0, matmul_rows: float = 0.0) -> float:
    """Roofline time of one op, plus the host's dispatch cost per op (`GPU.op_s`); `fp32`: its math
    runs in fp32. `kind` ("matmul", "attention", "attention_bwd" from `op_kind`,
    "matmul_unaligned" from `matmul_kind`, "grouped_mm", "grouped_mm_wgrad" from `grouped_layout`):
    its FLOPs run at the rate the GPU's probe measured at that size and precision (`measured_rate`)
    where it has one,
    else at `flops_fp32` (fp32, where the GPU has one) or `flops`; a grouped matmul of `groups`
    groups of `rows` rows each, at its layout's rate at those rows (`GPU.grouped_mm_rates`), else at
    the matmul rate of one group's share (`flops / groups`); an fp32 matmul whose output has
    `matmul_rows` rows or columns (the fewer: `matmul_rows`) at the share of its rate
    `GPU.matmul_row_factors` gives there (the CPU device tier). An op that touches memory takes at
    least `GPU.kernel_s`. An op without FLOPs moves its bytes at `GPU.elementwise_bw` where the
    probe measured one, else at `mem_bw`."""
    g = hw.gpus[gpu]
    rate = grouped_rate(g, kind, rows, fp32) if kind.startswith("grouped") else 0.0
    if kind and not rate:
        rate = measured_rate(g, "matmul" if kind.startswith("grouped") else kind, flops / groups, fp32)
    if not rate:
        rate = g.flops_fp32 if fp32 and g.flops_fp32 else g.flops
    if fp32 and matmul_rows and g.matmul_row_factors and kind.startswith("matmul"):
        rate *= _interpolate(g.matmul_row_factors, matmul_rows)
    bw = g.elementwise_bw if not flops and g.elementwise_bw else g.mem_bw
    t = max(flops / rate, nbytes / bw)
    if flops or nbytes:
        t = max(t, g.kernel_s)
    return t + g.op_s


_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_grouped_mm"})
_ATTENTION_BWD_PER_FWD = 2.5
"""An attention backward's FLOPs over its forward's (`attention_flops`, head dims equal): where a
backward op looks up `GPU.attention_rates`, which are keyed by the forward's FLOPs."""


def op_kind(target: str) -> str:
    """What rate an op's FLOPs run at (`op_time`), by its aten name: "matmul", "attention" (a
    fused scaled-dot-product forward), "attention_bwd", or "" (the peak)."""
    if "_attention" in target or "scaled_dot_product" in target:
        return "attention_bwd" if "backward" in target else "attention"
    return "matmul" if target.removeprefix("aten.").split(".")[0] in _MATMULS else ""


TENSOR_CORE_ALIGN = 8
"""Elements a 16-bit matmul's dimensions are multiples of for the GPU's aligned tensor-core
kernels (16 bytes); with any other, cuBLAS falls back to slower ones (`matmul_unaligned`)."""


def matmul_kind(o, tensors) -> str:
    """`op_kind` of an IR op, telling a matmul with a dimension that is not a multiple of
    TENSOR_CORE_ALIGN ("matmul_unaligned": a vocabulary of 50257, whose LM head ran at 94-145
    TFLOPS against 693-767 at 50304 on an H200, benchmarks/RESULTS.md "On a GPU") from the rest."""
    kind = op_kind(o.target)
    if kind == "matmul" and any(d % TENSOR_CORE_ALIGN for name in o.inputs if name in tensors
                                for d in tensors[name].shape[-2:] if len(tensors[name].shape) >= 2):
        return "matmul_unaligned"
    return kind


def grouped_layout(o, tensors) -> tuple[str, float]:
    """(kind, rows per group) of a grouped matmul: "grouped_mm" for a 2-D input times a 3-D weight
    (the forward, the input gradient), whose rows are the input's; "grouped_mm_wgrad" for 2-D x 2-D
    into one matrix per group (the weight gradient), whose contracted dimension is the rows; "matmul"
    (rows 0) for any other. Balanced routing, the cost model's expectation, gives each of the
    `expert_groups` groups an equal share of the rows."""
    if len(o.inputs) < 2 or not all(n in tensors for n in o.inputs[:2]):
        return "matmul", 0.0
    a, b = (tensors[n].shape for n in o.inputs[:2])
    groups = expert_groups(o, tensors)
    if len(a) == 2 and len(b) == 3:
        return "grouped_mm", a[0] / groups
    if len(a) == 2 and len(b) == 2:
        return "grouped_mm_wgrad", a[1] / groups
    return "matmul", 0.0


def grouped_rate(g, kind: str, rows: float, fp32: bool = False) -> float:
    """FLOP/s of a grouped matmul of `kind` ("grouped_mm", "grouped_mm_wgrad") at `rows` a group from
    the GPU's probed curve at its precision (`GPU.grouped_mm_rates`), interpolated log-log and held
    at its ends; 0 where it has none."""
    return _interpolate(getattr(g, kind + "_rates" + ("_fp32" if fp32 else ""), ()), rows)


def _interpolate(curve, x: float) -> float:
    """A (size, rate) curve's rate at `x`: log-log between its points, held at its ends; 0 where
    the curve is empty or `x` is not positive."""
    if not curve or x <= 0:
        return 0.0
    if x <= curve[0][0]:
        return curve[0][1]
    for (f0, r0), (f1, r1) in zip(curve, curve[1:]):
        if x <= f1:
            w = math.log(x / f0) / math.log(f1 / f0)
            return math.exp(math.log(r0) + w * math.log(r1 / r0))
    return curve[-1][1]


def measured_rate(g, kind: str, flops: float, fp32: bool = False) -> float:
    """FLOP/s of an op of `kind` and `flops` from the GPU's probed curves at its precision
    (`fp32`: `GPU.matmul_rates_fp32`, `attention_rates_fp32`), interpolated log-log between
    their points and held at their ends; 0 where the GPU has none. An unaligned matmul takes
    `GPU.matmul_rates_unaligned` where the probe measured it, else the aligned curve."""
    matmul, attention = (g.matmul_rates_fp32, g.attention_rates_fp32) if fp32 else (g.matmul_rates, g.attention_rates)
    curve = matmul
    if kind == "matmul_unaligned" and g.matmul_rates_unaligned and not fp32:
        curve = g.matmul_rates_unaligned
    if kind.startswith("attention") and attention:
        curve = attention
        if kind == "attention_bwd":
            flops /= _ATTENTION_BWD_PER_FWD
    return _interpolate(curve, flops)


def ops_time(ops, tensors, hw: Hardware) -> float:
    """Roofline time of a sequence of IR ops on GPU 0 (each at its precision and kind)."""
    return lsum(ir_op_time(o, tensors, hw) for o in ops)


DEQUANT_4BIT = "bitsandbytes.dequantize_4bit"
"""The op that makes a 4-bit weight of its codes and scales (`ir.quant.dequantized`), priced at
`GPU.dequant_rate` where the probe measured it."""


def ir_op_time(o, tensors, hw: Hardware) -> float:
    """`op_time` of an IR op: its precision and kind read from its inputs; a grouped matmul's rate is
    its layout's at its rows per group (`grouped_layout`)."""
    g = hw.gpus[0]
    if g.dequant_rate and DEQUANT_4BIT in o.target:  # a QLoRA base's weight, at its probed rate
        return max(math.prod(tensors[o.outputs[0]].shape) / g.dequant_rate, g.kernel_s) + g.op_s
    kind, rows = grouped_layout(o, tensors) if "_grouped_mm" in o.target else (matmul_kind(o, tensors), 0.0)
    return op_time(o.flops, o.bytes_in + o.bytes_out, hw, fp32=_in_fp32(o, tensors), kind=kind,
                   groups=expert_groups(o, tensors), rows=rows,
                   matmul_rows=matmul_rows(o, tensors) if kind.startswith("matmul") else 0.0)


def matmul_rows(o, tensors) -> float:
    """The fewer of a matmul's output rows and columns, which `GPU.matmul_row_factors` prices: a
    linear layer's forward or input gradient on few tokens has that many rows (a batched matmul's
    per matrix); its weight gradient, weight-shaped, has the weight's. 0 where the output is not a
    matrix."""
    out = tensors[o.outputs[0]].shape if o.outputs and o.outputs[0] in tensors else ()
    if len(out) < 2:
        return 0.0
    rows = out[-2] if "bmm" in o.target else math.prod(out[:-1])
    return float(min(rows, out[-1]))


def expert_groups(o, tensors) -> int:
    """The groups a grouped matmul splits its rows into (a mixture of experts' experts: the length of
    its `offs` input, the one 1-D integer input), 1 for any other op. Balanced routing, the cost
    model's expectation, gives every group 1/groups of the rows (`grouped_layout`)."""
    if "_grouped_mm" not in o.target:
        return 1
    offs = [tensors[n] for n in o.inputs if n in tensors and len(tensors[n].shape) == 1
            and tensors[n].dtype.startswith("int")]
    return max(1, offs[0].shape[0]) if offs else 1


def _in_fp32(o, tensors) -> bool:
    """Whether an op computes in fp32: its first floating-point input is fp32 (autocast has cast
    the inputs of the ops it runs in 16 bits)."""
    for name in o.inputs:
        dt = tensors[name].dtype
        if dt.startswith(("float", "bfloat")):
            return dt == "float32"
    return False


def profiles(graph: Graph, hw: Hardware, expert_groups: int = 1) -> dict[str, BlockProfile]:
    """One profile per traced block; with `expert_groups` > 1 a mixture of experts' layer holds its
    experts in that many units (`expert_units`)."""
    tensors = {t.name: t for t in graph.tensors}
    ops = graph.ops
    order = [blk.profile for blk in graph.blocks]  # forward order, as the ops name their blocks
    readers: dict[str, set[int]] = {}  # storage root -> ops that read it or a view of it
    for t in tensors.values():
        readers.setdefault(t.storage, set()).update(t.consumers)
    traced = list(dict.fromkeys(order))  # each traced block once, in forward order
    phase_ops = {(b, ph): [o for o in ops if o.block == b and o.phase == ph] for b in traced for ph in ("fwd", "bwd")}
    saved_of, inputs_of = {}, {}
    for b in traced:
        fwd_idx = {o.index for o in phase_ops[b, "fwd"]}
        bwd_idx = {o.index for o in phase_ops[b, "bwd"]}
        saved, inputs = {}, {}
        for t in tensors.values():
            if t.storage != t.name or t.producer is None or ops[t.producer].phase != "fwd":
                continue
            reads = readers[t.name]
            if t.producer in fwd_idx:
                if t.kind == "saved_activation" and reads & bwd_idx:
                    saved[t.name] = (t.nbytes, ops[t.producer].flops)
            elif reads & (fwd_idx | bwd_idx) and t.kind not in ("gradient",):
                inputs[t.name] = (t.nbytes, ops[t.producer].flops)
        saved_of[b], inputs_of[b] = saved, inputs
    # A value made before b and in X of the block after b passes through b's forward: the
    # forward of b makes that X, so b's own X holds it too (a mask only every other layer reads).
    pos = {b: k for k, b in enumerate(traced)}
    for k in range(len(traced) - 2, -1, -1):
        for name, v in inputs_of[traced[k + 1]].items():
            if pos.get(ops[tensors[name].producer].block, k) < k:
                inputs_of[traced[k]].setdefault(name, v)
    out: dict[str, BlockProfile] = {}
    for b in traced:
        fwd, bwd = phase_ops[b, "fwd"], phase_ops[b, "bwd"]
        fwd_idx = {o.index for o in fwd}
        saved, inputs = saved_of[b], inputs_of[b]
        nxt = set()
        for o in fwd:
            for name in o.outputs:
                t = tensors[name]
                if any(c not in fwd_idx and ops[c].phase == "fwd" for c in t.consumers):
                    nxt.add(t.storage)
        carried, until, handed = _carried(b, bwd, tensors, ops, readers, order)
        swapped, rest, refwd = reforward_split(fwd, set(saved), tensors, ops)
        largest = max((numel(t.shape) for t in tensors.values()
                       if t.kind == "parameter" and t.storage == t.name and t.block == b), default=0)
        planned = set(handed)
        cut = _backward_cut(bwd, saved, readers, tensors, ops, hw, planned, set(carried))
        out[b] = BlockProfile(
            name=b,
            fwd_ops=(fwd[0].index, fwd[-1].index) if fwd else (-1, -1),
            bwd_ops=(bwd[0].index, bwd[-1].index) if bwd else (-1, -1),
            fwd_flops=sum(o.flops for o in fwd), bwd_flops=sum(o.flops for o in bwd),
            fwd_time_s=ops_time(fwd, tensors, hw),
            bwd_time_s=ops_time(bwd, tensors, hw)
            + lsum(_attention_recompute_time(o, tensors, hw) for o in bwd),
            param_count=next(blk.param_count for blk in graph.blocks if blk.name == b),
            const_bytes=sum(t.nbytes for t in tensors.values() if t.kind == "constant" and t.block == b
                            and t.storage == t.name and t.producer is None),
            reads=_foreign_reads(b, fwd + bwd, tensors),
            saved_bytes=sum(v[0] for v in saved.values()),
            input_bytes=sum(v[0] for v in inputs.values()),
            output_bytes=sum(tensors[n].nbytes for n in sorted(nxt)),
            fwd_workspace=_workspace(fwd, tensors, ops),
            bwd_workspace=_workspace(bwd, tensors, ops, planned=set(handed)),
            opt_workspace=2 * 4 * largest,
            carried_bytes=sum(tensors[n].nbytes for n in carried), carried_until=until,
            handed_bytes=sum(tensors[n].nbytes for n in handed),
            saved=tuple(sorted((k, v[0], v[1]) for k, v in saved.items())),
            inputs=tuple(sorted(inputs)), carried=carried, handed=handed, **_state(b, tensors),
            swapped=swapped, swap_bytes=sum(tensors[n].nbytes for n in swapped),
            rest=rest, rest_bytes=sum(tensors[n].nbytes for n in rest),
            refwd_time_s=ops_time(refwd, tensors, hw),
            refwd_workspace=_workspace(refwd, tensors, ops),
            sizes=tuple(sorted((n, tensors[n].nbytes) for n in {*saved, *swapped, *rest})), **cut)
        if expert_groups > 1:
            out[b] = expert_units(out[b], fwd, tensors, expert_groups)
    return out


def expert_units(p: BlockProfile, fwd, tensors, groups: int) -> BlockProfile:
    """Block profile `p` with its experts in `groups` units (`UnitProfile`), where its forward runs
    a grouped matmul over a trainable (experts, ...) weight of its own and every such weight's
    gradient roots have the experts first too; `p` as it is otherwise. Group k holds experts
    [E k / groups, E (k + 1) / groups)."""
    weights: dict[str, int] = {}  # the block's expert weights (model-state names) -> experts
    for o in fwd:
        if "_grouped_mm" not in o.target or len(o.inputs) < 2:
            continue
        w = tensors[tensors[o.inputs[1]].storage]
        if w.kind == "parameter" and w.param in p.params and len(w.shape) == 3:
            weights[w.param] = w.shape[0]
    by_param: dict[str, set[str]] = {}
    for t in tensors.values():
        if t.kind == "gradient" and t.param in weights:
            by_param.setdefault(t.param, set()).add(t.storage)
    roots = {w: sorted(by_param.get(w, ())) for w in weights}
    if not weights or len(set(weights.values())) != 1 or not all(roots.values()):
        return p
    experts = next(iter(weights.values()))
    if any(tensors[r].shape[0] != experts for rs in roots.values() for r in rs) or groups > experts:
        return p
    params = {t.param: t for t in tensors.values() if t.kind == "parameter" and t.storage == t.name and t.param in weights}
    units = []
    for k in range(groups):
        a, b = experts * k // groups, experts * (k + 1) // groups
        share = lambda n: n * (b - a) // experts  # noqa: E731 (rows a..b of a tensor of `experts` rows)
        ws = [w for w in p.params if w in weights]
        gs = [r for w in ws for r in roots[w]]
        units.append(UnitProfile(
            name=f"x{k}", rows=(a, b), params=tuple(rows_member(w, (a, b)) for w in ws),
            grads=tuple(rows_member(r, (a, b)) for r in gs),
            param_count=sum(share(numel(params[w].shape)) for w in ws),
            param_bytes=sum(share(params[w].nbytes) for w in ws),
            grad_bytes=sum(share(tensors[r].nbytes) for r in gs),
            grad_fp32_bytes=sum(share(tensors[r].nbytes * 4 // _ITEMSIZE[tensors[r].dtype]) for r in gs),
            opt_workspace=2 * 4 * max(share(numel(params[w].shape)) for w in ws)))
    held = tuple(w for w in p.params if w in weights) + tuple(r for w in p.params if w in weights for r in roots[w])
    return dataclasses.replace(p, units=tuple(units), experts=held)


def _op_times(seg, tensors, hw: Hardware) -> float:
    return lsum(ir_op_time(o, tensors, hw) + _attention_recompute_time(o, tensors, hw) for o in seg)


def _backward_cut(bwd, saved: dict, readers, tensors, ops, hw: Hardware, handed: set, carried: set) -> dict:
    """The BlockProfile fields of the best place to cut b's backward in two (none: {}).

    A cut after the c-th op releases the saved storages only the first c ops read (`early`) and
    holds what those ops make for later (`handoff`: values the rest reads, and the gradients and
    activation gradient that G/T/H take when the backward ends). The best cut gives the next block's
    prefetch the most room for the longest: (early - handoff) bytes x the second part's time."""
    if len(bwd) < 2 or not saved:
        return {}
    pos = {o.index: k for k, o in enumerate(bwd)}
    last = {}
    for name in saved:
        reads = [pos[r] for r in readers[name] if r in pos]
        if reads:
            last[name] = max(reads)
    made_at = {}
    for k, o in enumerate(bwd):
        for name in o.outputs:
            if tensors[name].storage == name:
                made_at[name] = k
    kept = handed | carried
    times = [_op_times([o], tensors, hw) for o in bwd]

    def cut_at(c: int) -> tuple[list[str], list[str]]:
        """(early, handoff) of a cut after the c-th op."""
        early = [n for n, k in last.items() if k < c]
        handoff = [n for n, k in made_at.items() if k < c and (
            n in kept or tensors[n].kind == "gradient" or any(pos.get(r, -1) >= c for r in readers[n]))]
        return early, handoff
    best, best_score = 0, 0.0
    for c in range(1, len(bwd)):
        early, handoff = cut_at(c)
        score = (sum(saved[n][0] for n in early) - sum(tensors[n].nbytes for n in handoff)) * lsum(times[c:])
        if score > best_score:
            best, best_score = c, score
    if not best:
        return {}
    early, handoff = (tuple(sorted(x)) for x in cut_at(best))
    return dict(bwd_cut=best, early=early, handoff=handoff,
                handoff_bytes=sum(tensors[n].nbytes for n in handoff),
                bwd1_time_s=lsum(times[:best]), bwd2_time_s=lsum(times[best:]),
                bwd1_workspace=_workspace(bwd[:best], tensors, ops, planned=set(handoff)),
                bwd2_workspace=_workspace(bwd[best:], tensors, ops, planned=handed))


def reforward_split(fwd, saved: set[str], tensors, ops) -> tuple[tuple[str, ...], tuple[str, ...], list]:
    """(swapped, rest, re-forward ops) of a block whose saved storages are `saved`.

    Fuyou Table 2 / LoHan Eq. 6 rank activations by the FLOPs it takes to make them again per byte
    swapped: a linear layer's output costs 2*h FLOPs per element to recompute, a norm's, an
    activation function's or a residual sum's none. So a swap moves only the outputs of FLOP-bearing
    ops (qkv 3h, attention h, its projection h, h-to-4h 4h: Fuyou's 9 t_s of a GPT block, against
    16 h-sized saved values) and the backward first re-runs the FLOP-free ops that make the rest
    from them and the block input X. Walked back from every saved storage: a value made by a
    FLOP-bearing op of the block is swapped, one made by any other op of the block is made again
    (with its inputs, recursively), one from outside (X, parameters) is on the device anyway.
    No split (everything saved is swapped) when the block draws random numbers (a re-forward would
    have to replay the generator) or when the split would not move fewer bytes."""
    whole = (tuple(sorted(saved)), (), [])
    if not saved or any(draws_random(o.target) for o in fwd):
        return whole
    fwd_idx = {o.index for o in fwd}
    swapped, redo, seen = set(), set(), set()
    todo = sorted(saved)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        t = tensors[name]
        if t.producer is None or t.producer not in fwd_idx:
            continue  # the block input X, parameters, constants
        op = ops[t.producer]
        if op.flops > 0 and t.storage == name:
            swapped.add(name)
            continue
        redo.add(op.index)
        todo.extend(op.inputs)
    rest = saved - swapped
    if not rest or not swapped or sum(tensors[n].nbytes for n in swapped) >= sum(tensors[n].nbytes for n in saved):
        return whole
    return tuple(sorted(swapped)), tuple(sorted(rest)), [ops[i] for i in sorted(redo)]


_CPU_FLASH_BWD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


def _attention_recompute_time(o, tensors, hw: Hardware) -> float:
    """On a GPU the CPU trace's attention backward runs as CUDA's flash backward where it is
    `flash_eligible` (16-bit, no mask) and the GPU runs flash (nothing extra), else as a recompute
    of the attention forward plus its backward (executor.device_ops): that forward's roofline
    time, on top of the op's."""
    if o.target != _CPU_FLASH_BWD or len(o.inputs) < 4 or hw.gpus[0].name == CPU_GPU_NAME:
        return 0.0  # (a probed CPU-only machine runs the CPU kernel itself)
    q, k, v = (tensors[n] for n in o.inputs[1:4])
    # the op's tensors: grad_out, query, key, value, out, logsumexp, and a mask where it has one
    cc = hw.gpus[0].compute_capability
    if (len(o.inputs) == 6 and (not cc or cc >= FLASH_MIN_CAPABILITY)
            and flash_eligible({q.dtype, k.dtype, v.dtype}, q.shape, k.shape, v.shape, masked=False)):
        return 0.0
    flops = attention_flops(q.shape, k.shape, v.shape)
    return op_time(flops, q.nbytes + k.nbytes + v.nbytes + tensors[o.inputs[0]].nbytes, hw, fp32=q.dtype == "float32",
                   kind="attention")


def _state(b: str, tensors: dict) -> dict:
    """The model state block b owns, and its gradients' storage roots."""
    own = sorted((t.param, t.kind) for t in tensors.values() if t.block == b and t.producer is None
                 and t.kind in ("parameter", "constant") and t.storage == t.name and t.param)
    params = tuple(p for p, k in own if k == "parameter")
    grads: dict[str, None] = {}
    by_param: dict[str, list[str]] = {}
    for t in tensors.values():
        if t.kind == "gradient" and t.param:
            by_param.setdefault(t.param, []).append(t.storage)
    for p in params:
        for r in sorted(set(by_param.get(p, ()))):
            grads.setdefault(r)
    mine = {t.param: t for t in tensors.values() if t.block == b and t.producer is None
            and t.kind == "parameter" and t.storage == t.name and t.param}
    roots = {p: t.nbytes for p, t in mine.items()}
    shapes = tuple((mine[p].shape[0] if mine[p].shape else 1, numel(mine[p].shape[1:])) for p in params)
    return dict(params=params, consts=tuple(p for p, k in own if k == "constant"), grads=tuple(grads), shapes=shapes,
                param_bytes=sum(roots[p] for p in params), grad_bytes=sum(tensors[r].nbytes for r in grads),
                grad_fp32_bytes=sum(tensors[r].nbytes * 4 // _ITEMSIZE[tensors[r].dtype] for r in grads))


_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def _foreign_reads(b: str, seg_ops, tensors) -> tuple[str, ...]:
    """Blocks other than b that own a parameter or constant b's ops read."""
    out = set()
    for o in seg_ops:
        for a in o.inputs:
            t = tensors[a]
            if t.kind in ("parameter", "constant"):
                root = tensors[t.storage]
                if root.producer is None and root.block != b:
                    out.add(root.block)
    return tuple(sorted(out))


def _carried(b, bwd, tensors, ops, readers, order) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """(carried, until, handed): roots made by b's backward and read by a backward other than
    the next one (the block before b), with the profile of the block that reads them last; and
    the roots only the next backward reads (the activation gradient it receives).
    `order`: the profile of every block in forward order (replicas repeat their profile)."""
    bwd_idx = {o.index for o in bwd}
    k = order.index(b)
    prev = order[k - 1] if k > 0 else None
    names, until, handed = [], "", []
    for o in bwd:
        for name in o.outputs:
            t = tensors[name]
            if t.storage != name or t.kind == "gradient":
                continue
            blocks = {ops[c].block for c in readers[name] if c not in bwd_idx and ops[c].phase == "bwd"}
            if blocks and blocks != {prev}:
                names.append(name)
                last = min(blocks, key=order.index)
                until = min((until, last), key=order.index) if until else last
            elif blocks:
                handed.append(name)
    return tuple(sorted(names)), until, tuple(sorted(handed))


def _workspace(seg, tensors, ops, planned=frozenset()) -> int:
    """Peak live bytes of temporaries (not saved, not parameters/gradients) inside a segment;
    `planned` roots are not counted (a buffer of their own holds them: H)."""
    if not seg:
        return 0
    idx = {o.index for o in seg}
    live: dict[str, int] = {}
    last_use: dict[str, int] = {}
    peak = 0
    for o in seg:
        for name in o.outputs:
            t = tensors[name]
            if t.kind == "temporary" and t.storage == t.name and name not in planned:
                live[name] = t.nbytes
                inside = [c for c in t.consumers if c in idx]
                last_use[name] = max(inside) if inside else o.index
        peak = max(peak, sum(live.values()))
        for name in [n for n, last in last_use.items() if last <= o.index and n in live]:
            del live[name]
    return peak


def transfer_time(nbytes: int, src: str, dst: str, hw: Hardware, tensors: int = 1, durable: bool = True) -> float:
    """Seconds to move `nbytes` between tiers ("gpuK", "dram", "ssd"), a buffer of `tensors` members:
    its bytes over the link, plus the fixed costs the spec states (probed; 0 in the presets): each
    tensor of a DRAM <-> device copy `GPU.copy_tensor_s`, each SSD request `SSD.request_s`; an SSD
    write of a buffer homed there (`durable`) also its sync (`SSD.sync_s` + its bytes' flush,
    `SSD.write_s_per_byte`); a step's own activations, checkpoints and gradients are not synced
    (`SSDStore.set_transient`)."""
    if nbytes == 0:
        return 0.0
    if is_gpu(src) and is_gpu(dst):
        bw = hw.gpu_p2p_bw or min(_host_link(gpu_index(src), hw, "d2h"), _host_link(gpu_index(dst), hw, "h2d"))
        return nbytes / bw
    if src == "dram" and is_gpu(dst):
        return nbytes / _host_link(gpu_index(dst), hw, "h2d") + tensors * hw.gpus[gpu_index(dst)].copy_tensor_s
    if is_gpu(src) and dst == "dram":
        return nbytes / _host_link(gpu_index(src), hw, "d2h") + tensors * hw.gpus[gpu_index(src)].copy_tensor_s
    if src == "ssd" and dst == "dram":
        return nbytes / _nonzero(hw.ssd.read_total(), "SSD read bandwidth") + hw.ssd.request_s
    if src == "dram" and dst == "ssd":  # the write, then its early sync (SSD.write_s_per_byte)
        bw = _nonzero(hw.ssd.write_total(), "SSD write bandwidth")
        if not durable:
            return nbytes / bw + hw.ssd.request_s
        return nbytes * hw.ssd.write_s_per_byte() + hw.ssd.request_s + hw.ssd.sync_s
    raise ValueError(f"no direct link {src} -> {dst} (consumer GPUs have no GPUDirect storage)")


def _host_link(gpu: int, hw: Hardware, way: str) -> float:
    """A GPU's pinned host link one way ("h2d"/"d2h"), bounded by its root complex's uplink
    (Mobius: the GPUs under one complex share it)."""
    g, rc = hw.gpus[gpu], hw.root_complex_bw or float("inf")
    return min(g.d2h_bw if way == "d2h" else g.h2d_bw, rc)


def _blocking_copy_bw(gpu: int, hw: Hardware, way: str, mixed: bool) -> float:
    """Bytes/s of DeepSpeed's blocking copy between a GPU's 16-bit (mixed) or fp32 tensor and an fp32
    host tensor: converting through the CPU in mixed precision (`GPU.d2h_convert_bw` /
    `h2d_convert_bw`, where the spec states it), the pinned link otherwise. A converting copy
    still crosses the link, so it is never faster than the link (and its root complex)."""
    g = hw.gpus[gpu]
    link = _host_link(gpu, hw, way)
    convert = (g.d2h_convert_bw if way == "d2h" else g.h2d_convert_bw) if mixed else 0.0
    return min(convert, link) if convert else link


def zero3_grad_flush_time(nbytes: int, gpu: int, gpus: int, mixed: bool, hw: Hardware, tensors: int = 1) -> float:
    """Seconds DeepSpeed ZeRO-3 with its optimizer offloaded (to DRAM or NVMe) spends, per GPU,
    getting one block's gradient (`nbytes` of 16-bit or fp32 gradient on each of `gpus` GPUs, in
    `tensors` tensors) to the host, with the backward waiting for it. A ring reduce-scatter leaves
    each GPU its 1/N partition, sending (N-1)/N of the gradient over P2P (over the host links
    without it); the partition then goes to the host by a blocking `copy_` into the fp32 gradient
    (stage3.py `partition_grads`; for a sub-group swapped to NVMe, a host buffer and `.float()`
    before `swap_out_gradients`), which in mixed precision is a converting copy
    (`GPU.d2h_convert_bw`, DOS §4.1 and Fig. 6 top: 2.5 GB/s, stalling the GPU); plus each
    tensor's `GPU.copy_tensor_s`."""
    if nbytes == 0:
        return 0.0
    scatter = (gpus - 1) / gpus * nbytes / (hw.gpu_p2p_bw or _host_link(gpu, hw, "d2h"))
    return (scatter + nbytes / gpus / _blocking_copy_bw(gpu, hw, "d2h", mixed)
            + tensors * hw.gpus[gpu].copy_tensor_s)


def zero3_param_writeback_time(param_bytes: int, gpus: int, mixed: bool, hw: Hardware) -> float:
    """Seconds the CPU optimizer's loop waits, after updating one sub-group (a block), for each
    GPU's blocking copy of its updated 1/N partition back into the GPU's parameters (stage3.py
    `step` -> `_reassign_or_swap_out_partitioned_parameters`; DOS Fig. 5 top: the CPU idles while
    it runs). The GPUs copy in parallel; mixed precision converts (`GPU.h2d_convert_bw`, DOS
    Table 1: 8 GB/s)."""
    return max((param_bytes / gpus / _blocking_copy_bw(k, hw, "h2d", mixed) for k in range(min(gpus, len(hw.gpus)))),
               default=0.0)


def _nonzero(bw: float, what: str) -> float:
    if bw <= 0:
        raise ValueError(f"{what} is 0 (no SSDs in the hardware spec) but the plan uses the SSD tier")
    return bw


def optimizer_time(params: int, device: str, hw: Hardware, tensors: int = 0) -> float:
    """Seconds of one block's update of `params` parameters in `tensors` tensors: on the CPU at
    `CPU.adam_rate` plus `CPU.adam_tensor_s` per tensor (the executor's per-tensor work [OURS]);
    on a GPU memory-bound."""
    if device == "cpu":
        return params / hw.cpu.adam_rate + tensors * hw.cpu.adam_tensor_s
    return params * GPU_ADAM_BYTES_PER_PARAM / hw.gpus[gpu_index(device)].mem_bw


def update_time(prof: BlockProfile, device: str, problem) -> float:
    """`optimizer_time` of a block profile: its trainable parameters and their tensors (those of
    the traced block the profile describes), its units' included (what a policy decides on)."""
    return optimizer_time(prof.param_count, device, problem.hw, len(problem.graph.block(prof.name).params))


def segment_update_time(problem, segment: str, device: str) -> float:
    """`optimizer_time` of one `optimizer_step`: of a block's own parameters, or of a unit's
    (`schema.schedule.UNIT`)."""
    prof = problem.profiles[problem.profile_of[parent_of(segment)]]
    if segment != parent_of(segment):
        u = unit_profile(prof, segment)
        return optimizer_time(u.param_count, device, problem.hw, len(u.params))
    tensors = len(problem.graph.block(prof.name).params) - (len(prof.units[0].params) if prof.units else 0)
    ranks = problem.options.dp
    if ranks > 1:  # the rank's shard (the other ranks' rows come by a `gather`)
        return optimizer_time(shard_count(prof.shapes, ranks), device, problem.hw, tensors)
    return optimizer_time(prof.own()["param_count"], device, problem.hw, tensors)


GLOO_COPIES = 32
"""Without a measured `CPU.gloo_bw`: DRAM bandwidth over this, gloo's all-reduce bus bandwidth in
host memory (on a 2-core VM 1.1-1.4 GB/s beside 37 GB/s of DRAM bandwidth: benchmarks/RESULTS.md
"Data parallel")."""


def collective_bw(problem, tier: str, gather: bool = False) -> float:
    """Bus bandwidth of a ring collective over the data-parallel ranks of buffers on `tier`,
    bytes/s: the slowest link of the ring. GPU memory moves GPU to GPU (NCCL: P2P where the spec
    has it, else through host memory at the slower of the GPU's two copy engines); host memory,
    and a CPU device tier's, through gloo (`CPU.gloo_bw`, for an all-gather (`gather`)
    `CPU.gloo_gather_bw`, measured by the probe); across machines at most `Options.net_bw`."""
    hw, o = problem.machine or problem.hw, problem.options
    if _through_gloo(problem, tier):  # unmeasured: gloo's ring copies each chunk through loopback TCP, several times over
        inside = (gather and hw.cpu.gloo_gather_bw) or hw.cpu.gloo_bw or hw.dram.bandwidth / GLOO_COPIES
    else:
        inside = hw.gpu_p2p_bw or min(hw.gpu.h2d_bw, hw.gpu.d2h_bw)
    return min(inside, o.net_bw) if o.nodes > 1 else inside


def _through_gloo(problem, tier: str) -> bool:
    """Whether the ranks' collectives of buffers on `tier` run through gloo (host memory, or a CPU
    device tier) rather than GPU to GPU."""
    return not (is_gpu(tier) and (problem.machine or problem.hw).gpu.name != CPU_GPU_NAME)


def collective_step_s(problem, tier: str) -> float:
    """Seconds each step of a ring collective on `tier` costs besides its bytes (alpha of the
    alpha-beta model; Thakur, Rabenseifner & Gropp, "Optimization of collective communication
    operations in MPICH", IJHPCA 2005): `CPU.gloo_step_s` through gloo, 0 GPU to GPU (unmeasured)."""
    return (problem.machine or problem.hw).cpu.gloo_step_s if _through_gloo(problem, tier) else 0.0


def all_reduce_time(nbytes: int, tier: str, problem, tensors: int = 1) -> float:
    """A ring all-reduce of `nbytes` in `tensors` collectives (the executor's one per tensor) on
    `tier` over the `Options.dp` ranks: each rank sends and receives 2 (N - 1) / N of the bytes
    (reduce-scatter, then all-gather; Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms
    for clusters of workstations", JPDC 2009; NCCL's bus bandwidth), each collective 2 (N - 1)
    steps of `collective_step_s`."""
    n = problem.options.dp
    step = collective_step_s(problem, tier)
    if problem.options.exact_optimizer and n > 2:  # summed in rank order: every rank gathers every rank's
        return tensors * (n - 1) * step + (n - 1) * nbytes / collective_bw(problem, tier, gather=True)
    return tensors * 2 * (n - 1) * step + 2 * (n - 1) / n * nbytes / collective_bw(problem, tier)


def all_gather_time(nbytes: int, tier: str, problem, tensors: int = 1) -> float:
    """A ring all-gather on `tier`, in `tensors` collectives, of tensors of `nbytes` in all whose N
    shards the ranks hold: (N - 1) / N of it through each rank's link, each collective N - 1 steps
    of `collective_step_s`."""
    n = problem.options.dp
    return tensors * (n - 1) * collective_step_s(problem, tier) + (n - 1) / n * nbytes / collective_bw(
        problem, tier, gather=True)


def unit_profile(prof: BlockProfile, unit: str) -> UnitProfile:
    """The `UnitProfile` of unit `unit` (`b3/x1`) of the block `prof` describes."""
    suffix = unit.split(UNIT, 1)[1]
    return next(u for u in prof.units if u.name == suffix)
