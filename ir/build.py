"""The tensor-lifetime IR of a captured joint forward+backward graph (`build_ir`).

`ir.trace` captures the graph; here its nodes become the IR: every op attributed to a block (the
forward by autograd sequence number, the backward by the forward op it differentiates), the storage
roots views share, each tensor's kind (parameter, constant, input, gradient, saved activation,
temporary), the block that owns each piece of model state, one optimizer op per block with its
explicit fp32 states, and the blocks themselves (replicated from a 3-layer trace where asked).

Block attribution: forward hooks on each layer record the autograd sequence numbers of its
input and output (`bounds`), so a forward op whose `seq_nr` lies in (pre_i, post_i] belongs to
layer i. A backward op carries the `seq_nr` of the forward op it differentiates, and inherits that
op's block; ops without one inherit the block of the op before them.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch.utils.flop_counter as flop_counter

from tensorstow.errors import TensorstowError
from tensorstow.ir.graph import Block, Graph, Op, Tensor, attention_flops, grouped_mm_flops, numel, stable_hash

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.int64: "int64", torch.int32: "int32", torch.bool: "bool", torch.uint8: "uint8",
               torch.float64: "float64", torch.int8: "int8"}
"""The IR's names of torch dtypes."""
_ALIAS_TARGETS = {torch.ops.aten._unsafe_view.default}


def node_value(n):
    """The value an fx node holds in its `meta` (a fake tensor, a tuple of them), or None."""
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _nbytes(v) -> int:
    """Bytes of a tensor value (0 for anything else)."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    return 0


def view_source(node: fx.Node) -> fx.Node | None:
    """The node whose storage `node`'s value shares, or None: its first argument where it is a
    view of it (`aliases_input`), or the tuple of a view op (`split`) it is a getitem of. The
    IR's storage roots follow these links, and so do the compiled segments' uncounted views."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    return src if (aliases_input(src) if node.target is operator.getitem else aliases_input(node)) else None


def aliases_input(node: fx.Node) -> bool:
    """Whether the node's value shares its first argument's storage (its schema says its first
    return aliases an input, not written): views, `detach`, `split`, `_unsafe_view`."""
    t = node.target
    if t in _ALIAS_TARGETS:
        return True
    schema = getattr(t, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


def _flops(node: fx.Node) -> int:
    """FLOPs of one node by torch's flop counter (the CPU flash attention ops by `attention_flops`)."""
    t = node.target
    packet = getattr(t, "overloadpacket", None)
    args, kwargs = pytree.tree_map_only(fx.Node, node_value, (node.args, node.kwargs))
    out = node_value(node)
    try:
        if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            return attention_flops(*(a.shape for a in args[:3]))
        if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
            return attention_flops(*(a.shape for a in args[1:4]), backward=True)
        if packet is torch.ops.aten._grouped_mm:
            return grouped_mm_flops(args[0].shape, args[1].shape)
        fn = flop_counter.flop_registry.get(packet)
        return int(fn(*args, **kwargs, out_val=out)) if fn else 0
    except Exception:  # a counter that cannot read these args: count nothing rather than guess
        return 0


def build_ir(gm: fx.GraphModule, *, bounds: dict[int, list], n_layers: int, param_names: list[str],
             trainable: frozenset[str], model_name: str, batch: int, seq: int, precision: str,
             dtype: torch.dtype, replicate_to: int | None) -> Graph:
    """The IR of the joint graph `gm` (placeholders: the model state in `param_names` order, then
    the step's inputs; outputs: the loss, then the state's gradients).

    bounds: layer -> [autograd seq_nr before it, after it] (the trace's hooks); n_layers: the traced
    layers (0: the model is one block, `b0`); trainable: the parameters that require grad;
    precision and dtype: the training precision and its compute dtype; replicate_to: the number of
    layers a 3-layer trace stands for (None: as traced)."""
    ir = _IRBuilder(gm, bounds=bounds, n_layers=n_layers, param_names=param_names, trainable=trainable)
    ir.attribute_blocks()
    ir.find_storage_roots()
    ir.make_ops()
    ir.classify_tensors()
    ir.make_tensors()
    ir.add_optimizer(mixed=precision != "fp32")
    blocks = _blocks(ir.ops, ir.tensors, ir.owner, ir.block_names, n_layers, replicate_to)
    return Graph(model=model_name, batch=batch, seq=seq, precision=precision,
                 compute_dtype=DTYPE_NAMES[dtype], ops=tuple(ir.ops),
                 tensors=tuple(ir.tensors[k] for k in sorted(ir.tensors)), blocks=tuple(blocks),
                 traced_layers=n_layers)


class _IRBuilder:
    """The IR's parts, built phase by phase from the joint graph (`build_ir` runs the phases in
    order; each reads what the ones before it made)."""

    def __init__(self, gm: fx.GraphModule, *, bounds: dict[int, list], n_layers: int, param_names: list[str],
                 trainable: frozenset[str]):
        self.gm, self.bounds, self.n_layers, self.trainable = gm, bounds, n_layers, trainable
        self.nodes = list(gm.graph.nodes)
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        primals = [n for n in placeholders if n.name.startswith("primals")]
        out_node = next(n for n in self.nodes if n.op == "output")
        grads = out_node.args[0][1:]
        self.param_of_ph = {primals[i].name: param_names[i] for i in range(len(param_names))}
        """Placeholder node -> the model state name it stands for."""
        self.grad_of: dict[str, str] = {}
        """Gradient node -> the parameter it is the gradient of."""
        for i, g in enumerate(grads[:len(param_names)]):
            if isinstance(g, fx.Node):
                self.grad_of[g.name] = param_names[i]
        self.calls = [n for n in self.nodes if n.op == "call_function"]
        self.is_fwd = {n.name: n.meta.get("partitioner_tag") != "is_backward" for n in self.calls}
        """Call node -> whether it belongs to the forward."""
        self.block_names = ["pre"] + [f"b{i}" for i in range(n_layers)] + ["post"] if n_layers else ["b0"]
        """The blocks in forward order."""
        self.block_of: dict[str, str] = {}
        """Call node -> its block (`attribute_blocks`)."""
        self.root: dict[str, str] = {}
        """Node -> the storage root its value shares (itself unless a view; `find_storage_roots`)."""
        self.op_nodes: list[fx.Node] = []
        """The nodes that become ops: forward, then backward, each in graph order (`make_ops`)."""
        self.op_index: dict[str, int] = {}
        """Op node -> its op's index."""
        self.ops: list[Op] = []
        """The IR's ops (`make_ops`; `add_optimizer` appends the updates)."""
        self.consumers: dict[str, list[int]] = {}
        """Node -> the ops that read it."""
        self.kind: dict[str, str] = {}
        """Node -> its tensor kind, where it is not a temporary (`classify_tensors`)."""
        self.param_tag: dict[str, str] = {}
        """Node -> the model state it holds or is the gradient of."""
        self.owner: dict[str, str] = {}
        """Model state name -> the block that owns it (`_owners`)."""
        self.tensors: dict[str, Tensor] = {}
        """Name -> the IR's tensor (`make_tensors`; `add_optimizer` adds the states)."""

    def attribute_blocks(self) -> None:
        """Each call node's block: forward ops by autograd sequence number (between the layer hooks'
        bounds), backward ops by the forward op they differentiate; an op without a number
        inherits the block of the op before it."""
        ranges = [(i, self.bounds[i][0], self.bounds[i][1]) for i in sorted(self.bounds)]
        n_layers, is_fwd, block_of = self.n_layers, self.is_fwd, self.block_of
        seq_block: dict[int, str] = {}
        prev = "pre" if n_layers else "b0"
        for n in self.calls:
            if not is_fwd[n.name]:
                continue
            b = _forward_block(ranges, n.meta.get("seq_nr")) if n_layers else "b0"
            b = b or prev
            block_of[n.name] = prev = b
            if n.meta.get("seq_nr") is not None:
                seq_block.setdefault(n.meta["seq_nr"], b)
        # Backward visits blocks in reverse; an op whose seq_nr points at a later block is a
        # gradient accumulation (autograd tags those with the loss's seq_nr): it stays put.
        rank = {b: i for i, b in enumerate(["pre"] + [f"b{i}" for i in range(n_layers)] + ["post"])}
        prev = "post" if n_layers else "b0"
        for n in self.calls:
            if is_fwd[n.name]:
                continue
            b = seq_block.get(n.meta.get("seq_nr")) or prev
            if n_layers and rank[b] > rank[prev]:
                b = prev
            block_of[n.name] = prev = b

    def find_storage_roots(self) -> None:
        """Each node's storage root: views share their base's memory."""
        for n in self.nodes:
            src = view_source(n)
            self.root[n.name] = n.name if src is None else self.root.get(src.name, src.name)

    def make_ops(self) -> None:
        """The ops: forward, then backward, each in graph order; a getitem folds into its producer.
        A view moves no bytes."""
        is_fwd = self.is_fwd
        op_nodes = self.op_nodes = [n for n in self.calls if n.target is not operator.getitem]
        op_nodes.sort(key=lambda n: 0 if is_fwd[n.name] else 1)
        _check_contiguous(op_nodes, self.block_of, is_fwd, self.n_layers)
        self.op_index = {n.name: i for i, n in enumerate(op_nodes)}
        for i, n in enumerate(op_nodes):
            ins = _tensor_inputs(n)
            outs = ([u for u in n.users if u.target is operator.getitem] if isinstance(node_value(n), (tuple, list))
                    else [n])
            outs = [o for o in outs if isinstance(node_value(o), torch.Tensor)]
            view = aliases_input(n)
            for a in ins:
                self.consumers.setdefault(a.name, []).append(i)
            self.ops.append(Op(index=i, name=n.name, target=str(n.target), phase="fwd" if is_fwd[n.name] else "bwd",
                               block=self.block_of[n.name], inputs=tuple(a.name for a in ins),
                               outputs=tuple(o.name for o in sorted(outs, key=lambda o: o.name)),
                               flops=_flops(n), bytes_in=0 if view else sum(_nbytes(node_value(a)) for a in ins),
                               bytes_out=0 if view else sum(_nbytes(node_value(o)) for o in outs)))

    def classify_tensors(self) -> None:
        """Tensor kinds: placeholders are parameters, constants or inputs; gradient and
        saved-activation status propagates to the storage root, and a view of a parameter,
        constant or input is one."""
        is_fwd, kind, param_tag, root = self.is_fwd, self.kind, self.param_tag, self.root
        fwd_saved = set()
        for n in self.calls:
            if not is_fwd[n.name]:
                for a in _tensor_inputs(n):
                    if a.op == "call_function" and is_fwd.get(_producer_op(a) or "", False):
                        fwd_saved.add(a.name)
        for n in self.nodes:
            if n.op == "placeholder":
                p = self.param_of_ph.get(n.name)
                kind[n.name] = "input" if p is None else "parameter" if p in self.trainable else "constant"
                param_tag[n.name] = p or ""
        for name, p in self.grad_of.items():
            for nm in {name, root[name]}:
                if kind.get(nm) not in ("parameter", "constant", "input"):
                    kind[nm], param_tag[nm] = "gradient", p
        for name in fwd_saved:
            for nm in (name, root[name]):
                kind.setdefault(nm, "saved_activation")
        for name, r in root.items():
            if r != name and kind.get(r) in ("parameter", "constant", "input") and name not in kind:
                kind[name], param_tag[name] = kind[r], param_tag[r]

    def make_tensors(self) -> None:
        """The IR's tensors, each with its block: a state's owner (`_owners`), else its producer's;
        a literal of forward (`torch.tensor([...])`, a get_attr) is an input of its first reader."""
        ops, kind = self.ops, self.kind
        self.owner = _owners(ops, self.param_of_ph, self.grad_of, self.root, self.op_index, self.n_layers)
        for n in self.nodes:
            v = node_value(n) if n.op != "get_attr" else getattr(self.gm, n.target)
            if n.op not in ("placeholder", "call_function", "get_attr") or not isinstance(v, torch.Tensor):
                continue
            if n.op == "get_attr":  # a literal of forward (`torch.tensor([...])`): part of the graph
                kind[n.name] = "input"
                blk, prod = next((op.block for op in ops if n.name in op.inputs), "pre"), None
            elif n.op == "placeholder":
                blk = self.owner.get(self.param_of_ph.get(n.name, ""), "pre")
                prod = None
            else:
                prod = self.op_index[_producer_op(n)]
                blk = ops[prod].block
            self.tensors[n.name] = Tensor(
                name=n.name, kind=kind.get(n.name, "temporary"), dtype=DTYPE_NAMES.get(v.dtype, str(v.dtype)),
                shape=tuple(int(s) for s in v.shape), nbytes=_nbytes(v), block=blk, producer=prod,
                consumers=tuple(sorted(set(self.consumers.get(n.name, [])))), storage=self.root[n.name],
                param=self.param_tag.get(n.name, ""))

    def add_optimizer(self, mixed: bool) -> None:
        """One optimizer op per block over its trainable parameters, and explicit fp32 states
        (LoHan Table II: P16 2P, G16 2P, P32 4P, OS32 8P; fp32 training has no separate master)."""
        ops, tensors = self.ops, self.tensors
        ph_of_param = {v: k for k, v in self.param_of_ph.items()}
        grad_node_of = {p: g for g, p in self.grad_of.items()}
        for b in self.block_names:
            ps = sorted(p for p, ob in self.owner.items() if ob == b and p in self.trainable)
            if not ps:
                continue
            idx = len(ops)
            ins = []
            for p in ps:
                ph = tensors[ph_of_param[p]]
                g = grad_node_of.get(p)
                if g:
                    ins.append(g)
                    tensors[g] = _with_consumer(tensors[g], idx)
                states = ([".master"] if mixed else []) + [".exp_avg", ".exp_avg_sq"]
                for s in states:
                    tensors[p + s] = Tensor(name=p + s, kind="optimizer_state", dtype="float32", shape=ph.shape,
                                            nbytes=4 * numel(ph.shape), block=b, producer=None,
                                            consumers=(idx,), storage=p + s, param=p)
                    ins.append(p + s)
                ins.append(ph.name)
                tensors[ph.name] = _with_consumer(ph, idx)
            ops.append(Op(index=idx, name=f"adam:{b}", target="tensorstow.adam", phase="opt", block=b,
                          inputs=tuple(ins), outputs=(), flops=0,
                          bytes_in=sum(tensors[t].nbytes for t in ins), bytes_out=0))


def _forward_block(ranges: list[tuple[int, int | None, int | None]], s: int | None) -> str | None:
    """The block of a forward op with autograd sequence number `s`, from the layers' (index, seq
    before, seq after): `pre` before the first layer, `b<i>` inside layer i, `post` after the last;
    None where that cannot tell."""
    if s is None or not ranges:
        return None
    if ranges[0][1] is not None and s <= ranges[0][1]:
        return "pre"
    for i, lo, hi in ranges:
        if lo is not None and hi is not None and lo < s <= hi:
            return f"b{i}"
    return "post" if ranges[-1][2] is not None and s > ranges[-1][2] else None


def _producer_op(n: fx.Node) -> str | None:
    """The op node that makes n's value: n itself, or the multi-output op a getitem reads."""
    if n.op == "call_function" and n.target is operator.getitem:
        return n.args[0].name
    return n.name if n.op == "call_function" else None


def _tensor_inputs(n: fx.Node) -> list[fx.Node]:
    """The nodes whose tensor values n reads, each once, in argument order."""
    seen, out = set(), []
    for a in pytree.tree_leaves((n.args, n.kwargs)):
        if isinstance(a, fx.Node) and isinstance(node_value(a), torch.Tensor) and a.name not in seen:
            seen.add(a.name)
            out.append(a)
    return out


def _owners(ops, param_of_ph, grad_of, root, op_index, n_layers) -> dict[str, str]:
    """Model state name -> the block that owns it (whose P:/C: buffer holds it).

    A trainable parameter belongs to the block whose backward produces its final gradient
    (for a weight tied across blocks, where the contributions are summed); anything else to
    the first block that reads it. Every other reader must run its backward before the
    owner's, so the single update comes after every use (tied embedding = LM head: the head
    in `post` reads the embedding owned by `pre`)."""
    owner: dict[str, str] = {}
    readers: dict[str, list[str]] = {}
    for op in ops:
        for a in op.inputs:
            p = param_of_ph.get(a)
            if p:
                owner.setdefault(p, op.block)
                readers.setdefault(p, []).append(op.block)
    for g, p in grad_of.items():
        owner[p] = ops[op_index[root[g]]].block if root[g] in op_index else owner.get(p, "pre")
    order = {b: i for i, b in enumerate(["pre"] + [f"b{i}" for i in range(n_layers)] + ["post"])}
    for p, blocks in readers.items():
        early = [b for b in blocks if order.get(b, 0) < order.get(owner[p], 0)]
        if p in grad_of.values() and early:
            raise TensorstowError(
                f"parameter {p} is read by block {early[0]} but its gradient is completed in block "
                f"{owner[p]}, which runs backward first; tensorstow updates it once after its last use, "
                f"so a shared parameter must be owned by the earliest block that reads it")
    return owner


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
    # outputs as a sorted multiset: `op.outputs` is in node-name order, which changes with the
    # node counter (getitem_99 < getitem_100 as strings), not with the computation
    sig = [(op.phase, op.target, tuple(desc(a) for a in op.inputs), tuple(sorted(desc(o) for o in op.outputs)))
           for op in ops if op.block == block and op.phase != "opt"]
    return stable_hash([sig, sorted(tensors[p].shape for p in params if p in tensors)])


def _blocks(ops, tensors, owner, block_names, n_layers, replicate_to) -> list[Block]:
    ph_by_name = {t.param: t for t in tensors.values()
                  if t.kind in ("parameter", "constant") and t.storage == t.name and t.producer is None}
    info = {}
    for b in block_names:
        state = sorted(p for p, ob in owner.items() if ob == b)
        ps = [p for p in state if ph_by_name[p].kind == "parameter"]
        count = sum(numel(ph_by_name[p].shape) for p in ps)
        sig = _signature(b, ops, tensors, [ph_by_name[p].name for p in state])
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
