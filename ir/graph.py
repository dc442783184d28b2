"""The tensor-lifetime IR: ops in execution order, tensors with kind and lifetime, blocks.

Plain frozen dataclasses that round-trip losslessly through JSON. Op indices are the
execution order of one training step: forward, backward, then one optimizer op per block.

Blocks are the model's repeated layers (`b0`..`b{L-1}`) plus `pre` (everything before the
first layer: embeddings) and `post` (after the last layer: final norm, head, loss). Each
block carries a similarity signature: identical transformer layers share one traced
profile (Mobius §3.2 layer similarity), so a 96-layer model can be traced as 3 layers
(first, middle, last) and the middle one replicated; `Block.profile` names the traced
block whose ops describe it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import operator
from dataclasses import asdict, dataclass, fields

SCHEMA_VERSION_IR = 1

KINDS = ("parameter", "constant", "gradient", "optimizer_state", "saved_activation", "temporary", "input")
"""`constant`: model state that is read but never trained (frozen parameters, buffers)."""

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1,
               "uint8": 1, "int8": 1, "float64": 8}


def draws_random(target: str) -> bool:
    """Whether an op (by its aten name) draws from the random generator."""
    return any(k in target for k in ("rand", "bernoulli", "normal", "dropout", "multinomial", "uniform",
                                     "exponential", "poisson", "shuffle"))


def attention_flops(q_shape, k_shape, v_shape, backward: bool = False) -> int:
    """Matmul flops of scaled-dot-product attention, `(batch, heads, seq, dim)` shapes, key and value
    with as many heads as the query or a divisor of them (grouped-query attention: the kernel
    broadcasts each key/value head to its query heads). Forward: scores = q k^T and out = p v;
    backward: the scores again, then grad p, grad v, grad q and grad k, 2 flops a multiply-add each
    (torch.utils.flop_counter's sdpa counts, which torch 2.11's rejects for grouped-query shapes)."""
    b, h, s_q, d_q = q_shape
    s_k, d_v = k_shape[2], v_shape[3]
    if k_shape[1] != v_shape[1] or h % k_shape[1] or k_shape[3] != d_q or v_shape[2] != s_k:
        raise ValueError(f"attention_flops: incompatible shapes q={tuple(q_shape)} k={tuple(k_shape)} "
                         f"v={tuple(v_shape)}")
    per_dim = 2 * b * h * s_q * s_k
    return per_dim * (3 * d_q + 2 * d_v) if backward else per_dim * (d_q + d_v)


def grouped_mm_flops(a_shape, b_shape) -> int:
    """Flops of `aten::_grouped_mm(a, b, offs)` (a mixture of experts' experts): every token-row
    meets one expert's weight, so the total is static whatever the routing (`offs`, data, only
    splits it). 2-D `a` (token-rows M, K) x 3-D `b` (experts, K, N): 2 M K N, each row through its
    expert (the forward, and the input's gradient); 2-D x 2-D, `offs` splitting the contraction
    (a weight's gradient, out (experts, K, N) from (K, M) x (M, N)): 2 K M N; 3-D x 3-D: every
    group whole; 3-D x 2-D, `offs` splitting `b`'s columns: 2 M K N."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    if len(a_shape) == 3 and len(b_shape) == 2:
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    raise ValueError(f"grouped_mm_flops: shapes a={tuple(a_shape)} b={tuple(b_shape)}")


def lsum(xs, start=0):
    """`sum` as Python 3.11 adds floats: left to right, rounding each addition. Python 3.12's `sum`
    compensates the rounding (Neumaier), so plan numbers built with it differ in their last bits
    between interpreters, and a MIP stopped within a gap of its optimum can then return another
    plan: the planner adds its float times with this (integer sums are exact either way), and a
    golden plan is the same under either."""
    return functools.reduce(operator.add, xs, start)


def stable_hash(obj) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace): the fingerprint of plain data."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class Tensor:
    name: str
    """Unique name (the fx node name; `<param>.grad`/`.master`/`.exp_avg`/`.exp_avg_sq` for model states)."""
    kind: str
    """One of KINDS."""
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    """Bytes of this tensor's own elements (a view reports its elements; see `storage`)."""
    block: str
    """Block that produces it (parameters/states: the block that owns the parameter)."""
    producer: int | None
    """Index of the producing op; None for graph inputs, parameters and optimizer states."""
    consumers: tuple[int, ...]
    """Indices of the ops that read it, ascending."""
    storage: str
    """Name of the tensor whose memory this one uses (itself unless it is a view)."""
    param: str = ""
    """For parameters, gradients and optimizer states: the parameter's qualified name."""

    @property
    def lifetime(self) -> tuple[int, int]:
        """(first op index it exists at, last op index that reads it); -1 = before the step."""
        start = -1 if self.producer is None else self.producer
        return start, (self.consumers[-1] if self.consumers else start)


@dataclass(frozen=True)
class Op:
    index: int
    name: str
    """fx node name in the traced joint graph ("adam:<block>" for optimizer ops)."""
    target: str
    """aten overload, e.g. "aten.addmm.default"."""
    phase: str
    """"fwd", "bwd" or "opt"."""
    block: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    flops: int
    """From torch.utils.flop_counter (0 for ops it does not count: elementwise, views)."""
    bytes_in: int
    """Bytes read (views read nothing)."""
    bytes_out: int
    """Bytes written (views write nothing)."""


@dataclass(frozen=True)
class Block:
    name: str
    """"pre", "b0".."b{L-1}", "post"."""
    kind: str
    """"pre", "layer" or "post"."""
    params: tuple[str, ...]
    """Qualified names of the trainable parameters it owns (empty for replicas: see `profile`).
    Frozen parameters and buffers it owns are its `constant` tensors."""
    param_count: int
    """Trainable parameters."""
    signature: str
    """Similarity signature: equal signatures mean identical ops, shapes and parameters."""
    profile: str
    """Name of the traced block whose ops describe this one (itself when traced)."""


@dataclass(frozen=True)
class Graph:
    model: str
    batch: int
    seq: int
    precision: str
    """"fp32", "bf16-mixed" or "fp16-mixed"."""
    compute_dtype: str
    ops: tuple[Op, ...]
    tensors: tuple[Tensor, ...]
    """Sorted by name."""
    blocks: tuple[Block, ...]
    """All blocks of the real model in forward order (replicas included)."""
    traced_layers: int
    """How many layers the joint graph holds (< number of layer blocks when replicated)."""
    schema_version: int = SCHEMA_VERSION_IR

    # ---- queries -------------------------------------------------------------------------
    def tensor(self, name: str) -> Tensor:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, Tensor]:
        cache = self.__dict__.get("_tensor_index")
        if cache is None:
            cache = {t.name: t for t in self.tensors}
            object.__setattr__(self, "_tensor_index", cache)
        return cache

    def block(self, name: str) -> Block:
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(name)

    def layer_blocks(self) -> list[Block]:
        return [b for b in self.blocks if b.kind == "layer"]

    def param_count(self) -> int:
        return sum(b.param_count for b in self.blocks)

    def active_param_count(self) -> int:
        """Trainable parameters one token meets, as mixture-of-experts papers count them: all but
        the share of each experts' weight its token doesn't reach. A weight of E experts that a
        grouped matmul runs R token-rows through, for T tokens a step, is read by top-k = R / T of
        its E experts per token. Equal to `param_count` for a dense model."""
        tensors = {t.name: t for t in self.tensors}
        tokens = self.batch * self.seq
        idle: dict[str, float] = {}  # per traced block: parameters a token leaves alone
        seen: set[str] = set()
        for o in self.ops:
            if o.phase != "fwd" or o.target != "aten._grouped_mm.default":
                continue
            rows, w = tensors[o.inputs[0]], tensors[tensors[o.inputs[1]].storage]
            if w.kind != "parameter" or w.name in seen or len(w.shape) != 3 or len(rows.shape) != 2:
                continue
            seen.add(w.name)
            experts, top_k = w.shape[0], rows.shape[0] / tokens
            idle[o.block] = idle.get(o.block, 0.0) + numel(w.shape) * (1 - top_k / experts)
        return self.param_count() - round(sum(idle.get(b.profile, 0.0) for b in self.blocks))

    def fingerprint(self) -> str:
        """Identity of the traced computation (what the executor must re-trace identically)."""
        d = self.to_json()
        return stable_hash(d)

    # ---- JSON -----------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("_tensor_index", None)
        return d

    @staticmethod
    def from_json(d: dict) -> "Graph":
        if d.get("schema_version") != SCHEMA_VERSION_IR:
            raise ValueError(f"IR schema_version {d.get('schema_version')!r} is not "
                             f"{SCHEMA_VERSION_IR}; re-trace the model")
        return Graph(
            model=d["model"], batch=d["batch"], seq=d["seq"], precision=d["precision"],
            compute_dtype=d["compute_dtype"],
            ops=tuple(_tuplify(Op, o) for o in d["ops"]),
            tensors=tuple(_tuplify(Tensor, t) for t in d["tensors"]),
            blocks=tuple(_tuplify(Block, b) for b in d["blocks"]),
            traced_layers=d["traced_layers"], schema_version=d["schema_version"])


def _tuplify(cls, d: dict):
    """Rebuild a dataclass from JSON, turning lists back into tuples."""
    kw = {}
    for f in fields(cls):
        v = d[f.name]
        if isinstance(v, list):
            v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        kw[f.name] = v
    return cls(**kw)


FLASH_DTYPES = ("float16", "bfloat16")


FLASH_MAX_HEAD = 256


FLASH_MIN_CAPABILITY = 8.0
"""PyTorch runs its flash-attention kernels on CUDA compute capability 8.0 (Ampere) and newer."""


def flash_eligible(dtypes, q_shape, k_shape, v_shape, masked: bool) -> bool:
    """Whether CUDA's flash-attention kernels run this attention (PyTorch's own rules for them,
    `sdp_utils`): 16-bit inputs of one dtype, no mask, as many key/value heads as query heads, one
    head size that is a multiple of 8 and at most 256, and as many keys as queries (flash aligns a
    causal mask bottom-right where the CPU kernel aligns it top-left). Used by the executor and,
    from the trace's shapes, by the planner, so both agree on whether the backward recomputes."""
    if masked or len(set(dtypes)) != 1 or str(next(iter(dtypes))).removeprefix("torch.") not in FLASH_DTYPES:
        return False
    if not (len(q_shape) == len(k_shape) == len(v_shape) == 4):
        return False
    d = q_shape[-1]
    return (q_shape[1] == k_shape[1] == v_shape[1] and k_shape[-1] == v_shape[-1] == d and d % 8 == 0
            and d <= FLASH_MAX_HEAD and q_shape[-2] == k_shape[-2])


def numel(shape) -> int:
    """Elements of a tensor of this shape (1 for a scalar's `()`)."""
    n = 1
    for s in shape:
        n *= int(s)
    return n
