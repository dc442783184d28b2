"""Trace an nn.Module into the tensor-lifetime IR with torch.fx, on fake tensors.

The joint forward+backward graph comes from `aot_function` with a capturing partition
function (no compilation happens: tracing stops once the joint graph is captured). The
model and inputs live in a CPU `FakeTensorMode` (no real memory; meta-device tracing drops
cross_entropy's backward, see DESIGN.md pitfalls).

Block attribution: forward hooks on each layer record the autograd sequence numbers of its
input and output, so a forward op whose `seq_nr` lies in (pre_i, post_i] belongs to layer i.
A backward op carries the `seq_nr` of the forward op it differentiates, and inherits that
op's block; ops without one inherit the block of the op before them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
import torch.utils.flop_counter as flop_counter
from torch._subclasses.fake_tensor import FakeTensorMode

from tensorstow import TensorstowError
from tensorstow.ir.graph import Block, Graph, Op, Tensor, stable_hash

PRECISIONS = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
_DTYPE_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.int64: "int64", torch.int32: "int32", torch.bool: "bool", torch.uint8: "uint8",
               torch.float64: "float64", torch.int8: "int8"}
_ALIAS_TARGETS = {torch.ops.aten._unsafe_view.default}


@dataclass
class Traced:
    """A traced model: the IR plus what the executor needs to run the joint graph."""

    graph: Graph
    gm: fx.GraphModule
    """The joint forward+backward graph (placeholders: params..., idx, targets, tangent)."""
    param_names: list[str]
    """Qualified parameter names in placeholder order."""


class _Captured(Exception):
    pass


def find_layers(model: nn.Module) -> tuple[str, nn.ModuleList | None]:
    """The first non-empty nn.ModuleList is the list of repeated layers."""
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            return name, m
    return "", None


def trace(model: nn.Module, *, batch: int, seq: int, precision: str = "fp32",
          model_name: str = "model", replicate_to: int | None = None,
          fake_mode: FakeTensorMode | None = None) -> Traced:
    """Trace one training step of `model` on fake `(batch, seq)` token inputs.

    `model` may hold real or fake parameters; nothing is allocated or modified. With
    `replicate_to=L` the model must have been built with 3 layers (first, middle, last);
    the IR then describes L layers, layers 1..L-2 sharing the middle layer's profile.
    """
    if precision not in PRECISIONS:
        raise TensorstowError(f"unknown precision '{precision}': use one of {sorted(PRECISIONS)}")
    if batch < 1 or seq < 1:
        raise TensorstowError(f"batch and seq must be >= 1 (got batch={batch}, seq={seq})")
    vocab = getattr(model, "vocab_size", None)
    block_size = getattr(model, "block_size", None)
    if vocab is None or block_size is None:
        raise TensorstowError(f"model '{model_name}' lacks `vocab_size`/`block_size` attributes "
                              f"(nanoGPT convention: forward(idx, targets) -> loss)")
    if seq > block_size:
        raise TensorstowError(f"--seq {seq} exceeds the model's block_size {block_size}")
    dtype = PRECISIONS[precision]
    fm = fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
    layers_name, layers = find_layers(model)

    with fm:
        params = {n: (fm.from_tensor(p) if not _is_fake(p) else p).detach().to(dtype).requires_grad_(True)
                  for n, p in model.named_parameters()}
        idx = torch.zeros(batch, seq, dtype=torch.long)
        tgt = torch.zeros(batch, seq, dtype=torch.long)

    bounds: dict[int, list] = {}
    hooks = []
    if layers is not None:
        for i, layer in enumerate(layers):
            hooks.append(layer.register_forward_pre_hook(_pre_hook(bounds, i)))
            hooks.append(layer.register_forward_hook(_post_hook(bounds, i)))
    captured = {}

    def partition(joint, joint_inputs, **kw):
        captured["gm"] = joint
        captured["bounds"] = {k: list(v) for k, v in bounds.items()}
        raise _Captured

    from functorch.compile import aot_function
    from torch.func import functional_call

    def step(p, i, t):
        return functional_call(model, p, (i, t))

    try:
        with fm:
            aot_function(step, fw_compiler=_never, partition_fn=partition)(params, idx, tgt)
    except _Captured:
        pass
    except TensorstowError:
        raise
    except Exception as e:  # a user model the tracer cannot handle: say which and why
        raise TensorstowError(f"model '{model_name}': tracing failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); the model must run "
                              f"forward(idx, targets) -> scalar loss under torch.fx/aot tracing") from None
    finally:
        for h in hooks:
            h.remove()
    if "gm" not in captured:
        raise TensorstowError(f"model '{model_name}': no joint graph was produced "
                              f"(does forward return a loss that requires grad?)")
    gm: fx.GraphModule = captured["gm"]
    n_layers = len(layers) if layers is not None else 0
    param_names = list(params)
    graph = _build_ir(gm, captured["bounds"], n_layers, param_names, model_name, batch, seq,
                      precision, replicate_to)
    return Traced(graph=graph, gm=gm, param_names=param_names)


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


def _never(gm, args):
    raise AssertionError("unreachable: tracing stops at partition")


def _seq(t):
    t = t[0] if isinstance(t, (tuple, list)) else t
    fn = getattr(t, "grad_fn", None)
    return fn._sequence_nr() if fn is not None else None


def _pre_hook(bounds, i):
    def hook(mod, args):
        if i == 0:
            bounds.clear()
        bounds[i] = [_seq(args[0]) if args else None, None]
    return hook


def _post_hook(bounds, i):
    def hook(mod, args, out):
        bounds.setdefault(i, [None, None])[1] = _seq(out)
    return hook


# ---- IR construction ------------------------------------------------------------------------

def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _nbytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    return 0


def _aliases_input(node: fx.Node) -> bool:
    t = node.target
    if t in _ALIAS_TARGETS:
        return True
    schema = getattr(t, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


def _flops(node: fx.Node) -> int:
    t = node.target
    packet = getattr(t, "overloadpacket", None)
    args, kwargs = pytree.tree_map_only(fx.Node, _val, (node.args, node.kwargs))
    out = _val(node)
    try:
        if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            q, k, v = (a.shape for a in args[:3])
            return int(flop_counter.sdpa_flop_count(q, k, v))
        if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
            g, q, k, v = (a.shape for a in args[:4])
            return int(flop_counter.sdpa_backward_flop_count(g, q, k, v))
        fn = flop_counter.flop_registry.get(packet)
        return int(fn(*args, **kwargs, out_val=out)) if fn else 0
    except Exception:  # a counter that cannot read these args: count nothing rather than guess
        return 0


def _build_ir(gm, bounds, n_layers, param_names, model_name, batch, seq, precision,
              replicate_to) -> Graph:
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    primals = [n for n in placeholders if n.name.startswith("primals")]
    out_node = next(n for n in nodes if n.op == "output")
    grads = out_node.args[0][1:]
    param_of_ph = {primals[i].name: param_names[i] for i in range(len(param_names))}
    grad_of = {}  # node name -> param name
    for i, g in enumerate(grads[:len(param_names)]):
        if isinstance(g, fx.Node):
            grad_of[g.name] = param_names[i]

    # Blocks of the forward ops by autograd sequence number.
    ranges = [(i, bounds[i][0], bounds[i][1]) for i in sorted(bounds)]
    def fwd_block_of(s):
        if s is None or not ranges:
            return None
        if ranges[0][1] is not None and s <= ranges[0][1]:
            return "pre"
        for i, lo, hi in ranges:
            if lo is not None and hi is not None and lo < s <= hi:
                return f"b{i}"
        return "post" if ranges[-1][2] is not None and s > ranges[-1][2] else None

    calls = [n for n in nodes if n.op == "call_function"]
    is_fwd = {n.name: n.meta.get("partitioner_tag") != "is_backward" for n in calls}
    block_of: dict[str, str] = {}
    seq_block: dict[int, str] = {}
    prev = "pre" if n_layers else "b0"
    for n in calls:
        if not is_fwd[n.name]:
            continue
        b = fwd_block_of(n.meta.get("seq_nr")) if n_layers else "b0"
        b = b or prev
        block_of[n.name] = prev = b
        if n.meta.get("seq_nr") is not None:
            seq_block.setdefault(n.meta["seq_nr"], b)
    # Backward visits blocks in reverse; an op whose seq_nr points at a later block is a
    # gradient accumulation (autograd tags those with the loss's seq_nr): it stays put.
    rank = {b: i for i, b in enumerate(["pre"] + [f"b{i}" for i in range(n_layers)] + ["post"])}
    prev = "post" if n_layers else "b0"
    for n in calls:
        if is_fwd[n.name]:
            continue
        b = seq_block.get(n.meta.get("seq_nr")) or prev
        if n_layers and rank[b] > rank[prev]:
            b = prev
        block_of[n.name] = prev = b

    # Storage roots (views share their base's memory).
    root: dict[str, str] = {}
    for n in nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            base = n.args[0]
            root[n.name] = root.get(base.name, base.name) if _aliases_input(base) else n.name
        elif n.op == "call_function" and _aliases_input(n) and n.args and isinstance(n.args[0], fx.Node):
            root[n.name] = root.get(n.args[0].name, n.args[0].name)
        else:
            root[n.name] = n.name

    # Ops: forward, then backward, each in graph order; getitem folds into its producer.
    op_nodes = [n for n in calls if n.target is not operator.getitem]
    op_nodes.sort(key=lambda n: 0 if is_fwd[n.name] else 1)
    _check_contiguous(op_nodes, block_of, is_fwd, n_layers)
    op_index = {n.name: i for i, n in enumerate(op_nodes)}

    def producer_op(n: fx.Node) -> str | None:
        if n.op == "call_function" and n.target is operator.getitem:
            return n.args[0].name
        return n.name if n.op == "call_function" else None

    def tensor_inputs(n: fx.Node) -> list[fx.Node]:
        seen, out = set(), []
        for a in pytree.tree_leaves((n.args, n.kwargs)):
            if isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor) and a.name not in seen:
                seen.add(a.name)
                out.append(a)
        return out

    consumers: dict[str, list[int]] = {}
    ops: list[Op] = []
    for i, n in enumerate(op_nodes):
        ins = tensor_inputs(n)
        outs = [u for u in n.users if u.target is operator.getitem] if isinstance(_val(n), (tuple, list)) else [n]
        outs = [o for o in outs if isinstance(_val(o), torch.Tensor)]
        view = _aliases_input(n)
        for a in ins:
            consumers.setdefault(a.name, []).append(i)
        ops.append(Op(index=i, name=n.name, target=str(n.target), phase="fwd" if is_fwd[n.name] else "bwd",
                      block=block_of[n.name], inputs=tuple(a.name for a in ins),
                      outputs=tuple(o.name for o in sorted(outs, key=lambda o: o.name)),
                      flops=_flops(n), bytes_in=0 if view else sum(_nbytes(_val(a)) for a in ins),
                      bytes_out=0 if view else sum(_nbytes(_val(o)) for o in outs)))

    # Tensor kinds; gradient / saved-activation status propagates to the storage root.
    fwd_saved = set()
    for n in calls:
        if not is_fwd[n.name]:
            for a in tensor_inputs(n):
                if a.op == "call_function" and is_fwd.get(producer_op(a) or "", False):
                    fwd_saved.add(a.name)
    kind: dict[str, str] = {}
    param_tag: dict[str, str] = {}
    for n in nodes:
        if n.op == "placeholder":
            kind[n.name] = "parameter" if n.name in param_of_ph else "input"
            param_tag[n.name] = param_of_ph.get(n.name, "")
    for name, p in grad_of.items():
        for nm in {name, root[name]}:
            if kind.get(nm) not in ("parameter", "input"):
                kind[nm], param_tag[nm] = "gradient", p
    for name in fwd_saved:
        for nm in (name, root[name]):
            kind.setdefault(nm, "saved_activation")
    for name, r in root.items():
        if r != name and kind.get(r) in ("parameter", "input") and name not in kind:
            kind[name], param_tag[name] = kind[r], param_tag[r]

    owner = {}  # param name -> block (block of first op that reads it)
    for op in ops:
        for a in op.inputs:
            p = param_of_ph.get(a)
            if p and p not in owner:
                owner[p] = op.block
    tensors: dict[str, Tensor] = {}
    for n in nodes:
        v = _val(n)
        if n.op not in ("placeholder", "call_function") or not isinstance(v, torch.Tensor):
            continue
        if n.op == "placeholder":
            blk = owner.get(param_of_ph.get(n.name, ""), "pre")
            prod = None
        else:
            prod = op_index[producer_op(n)]
            blk = ops[prod].block
        tensors[n.name] = Tensor(
            name=n.name, kind=kind.get(n.name, "temporary"), dtype=_DTYPE_NAME.get(v.dtype, str(v.dtype)),
            shape=tuple(int(s) for s in v.shape), nbytes=_nbytes(v), block=blk, producer=prod,
            consumers=tuple(sorted(set(consumers.get(n.name, [])))), storage=root[n.name],
            param=param_tag.get(n.name, ""))

    # Optimizer: one op per block over its parameters, and explicit fp32 states
    # (LoHan Table II: P16 2P, G16 2P, P32 4P, OS32 8P; fp32 training has no separate master).
    mixed = precision != "fp32"
    ph_of_param = {v: k for k, v in param_of_ph.items()}
    grad_node_of = {p: g for g, p in grad_of.items()}
    block_names = ["pre"] + [f"b{i}" for i in range(n_layers)] + ["post"] if n_layers else ["b0"]
    for b in block_names:
        ps = sorted(p for p, ob in owner.items() if ob == b)
        if not ps:
            continue
        idx = len(ops)
        ins, outs = [], []
        for p in ps:
            ph = tensors[ph_of_param[p]]
            g = grad_node_of.get(p)
            if g:
                ins.append(g)
                tensors[g] = _with_consumer(tensors[g], idx)
            states = ([".master"] if mixed else []) + [".exp_avg", ".exp_avg_sq"]
            for s in states:
                tensors[p + s] = Tensor(name=p + s, kind="optimizer_state", dtype="float32", shape=ph.shape,
                                        nbytes=4 * _numel(ph.shape), block=b, producer=None,
                                        consumers=(idx,), storage=p + s, param=p)
                ins.append(p + s)
            ins.append(ph.name)
            tensors[ph.name] = _with_consumer(ph, idx)
        ops.append(Op(index=idx, name=f"adam:{b}", target="tensorstow.adam", phase="opt", block=b,
                      inputs=tuple(ins), outputs=(), flops=0,
                      bytes_in=sum(tensors[t].nbytes for t in ins), bytes_out=0))

    blocks = _blocks(ops, tensors, owner, block_names, n_layers, replicate_to)
    return Graph(model=model_name, batch=batch, seq=seq, precision=precision,
                 compute_dtype=_DTYPE_NAME[PRECISIONS[precision]], ops=tuple(ops),
                 tensors=tuple(tensors[k] for k in sorted(tensors)), blocks=tuple(blocks),
                 traced_layers=n_layers)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _with_consumer(t: Tensor, idx: int) -> Tensor:
    from dataclasses import replace
    return replace(t, consumers=tuple(sorted(set(t.consumers) | {idx})))


def _check_contiguous(op_nodes, block_of, is_fwd, n_layers):
    """Each block's forward ops, and its backward ops, must form one contiguous run."""
    seen, last = set(), None
    for n in op_nodes:
        key = (is_fwd[n.name], block_of[n.name])
        if key != last:
            if key in seen:
                raise TensorstowError(
                    f"the {'forward' if key[0] else 'backward'} ops of block {key[1]} are interleaved "
                    f"with another block's (at node {n.name}); tensorstow needs layers that run one "
                    f"after another")
            seen.add(key)
            last = key


def _signature(block: str, ops: list[Op], tensors: dict[str, Tensor], params: list[str]) -> str:
    def desc(name):
        t = tensors.get(name)
        return (t.kind, t.dtype, t.shape) if t else name
    sig = [(op.phase, op.target, tuple(desc(a) for a in op.inputs), tuple(desc(o) for o in op.outputs))
           for op in ops if op.block == block and op.phase != "opt"]
    return stable_hash([sig, sorted(tensors[p].shape for p in params if p in tensors)])


def _blocks(ops, tensors, owner, block_names, n_layers, replicate_to) -> list[Block]:
    ph_by_param = {t.param: t for t in tensors.values() if t.kind == "parameter" and t.storage == t.name}
    info = {}
    for b in block_names:
        ps = sorted(p for p, ob in owner.items() if ob == b)
        count = sum(_numel(ph_by_param[p].shape) for p in ps)
        sig = _signature(b, ops, tensors, [ph_by_param[p].name for p in ps])
        kind = "layer" if b.startswith("b") else b
        info[b] = Block(name=b, kind=kind, params=tuple(ps), param_count=count, signature=sig, profile=b)
    if replicate_to is None or replicate_to == n_layers:
        return [info[b] for b in block_names]
    if n_layers != 3:
        raise TensorstowError(f"replication needs a 3-layer trace (first, middle, last), got {n_layers}")
    if replicate_to < 3:
        raise TensorstowError("replicate_to must be >= 3")
    mid = info["b1"]
    out = [info["pre"], info["b0"]]
    for i in range(1, replicate_to - 1):
        out.append(Block(name=f"b{i}", kind="layer", params=mid.params if i == 1 else (),
                         param_count=mid.param_count, signature=mid.signature, profile="b1"))
    last = info["b2"]
    out.append(Block(name=f"b{replicate_to - 1}", kind="layer", params=last.params,
                     param_count=last.param_count, signature=last.signature, profile="b2"))
    out.append(info["post"])
    return out


FULL_TRACE_LAYERS = 8
"""Presets up to this depth are traced layer by layer; deeper ones trace 3 and replicate."""


def trace_spec(spec, *, batch: int, seq: int | None = None, precision: str = "fp32") -> Traced:
    """Trace a ModelSpec. Presets deeper than FULL_TRACE_LAYERS are built with 3 layers (first,
    middle, last) on fake tensors and replicated by similarity: the middle layer's profile
    stands for layers 1..L-2 (their signatures are equal by construction)."""
    fm = FakeTensorMode(allow_non_fake_inputs=True)
    cfg = spec.config
    seq = seq or (cfg.block_size if cfg else None)
    if cfg is not None:
        depth = cfg.n_layer if cfg.n_layer <= FULL_TRACE_LAYERS else 3
        with fm:
            model = spec.build(n_layer=depth)
        replicate = None if depth == cfg.n_layer else cfg.n_layer
    else:
        with fm:
            model = spec.build()
        replicate = None
        if seq is None:
            seq = getattr(model, "block_size", None)
    return trace(model, batch=batch, seq=seq, precision=precision, model_name=spec.name,
                 replicate_to=replicate, fake_mode=fm)
