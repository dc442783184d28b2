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

import contextlib
import logging
import operator
import os
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
import torch.utils.flop_counter as flop_counter
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from tensorstow.errors import TensorstowError
from tensorstow.ir.graph import Block, Graph, Op, Tensor, attention_flops, draws_random, numel, stable_hash

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
    """Qualified names of the model state in placeholder order: parameters (trainable and
    frozen), then buffers. All of them are inputs of the joint graph."""
    trainable: frozenset[str] = frozenset()
    """The parameters that require grad (the others, and buffers, are read-only constants)."""
    layer_path: str = ""
    """Qualified name of the list of repeated layers ("" if none)."""


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
    from tensorstow.ir.hf import wrap
    model = wrap(model)  # a Hugging Face causal LM given as a module gets the loss contract
    if precision not in PRECISIONS:
        raise TensorstowError(f"unknown precision '{precision}': use one of {sorted(PRECISIONS)}")
    if batch < 1 or seq < 1:
        raise TensorstowError(f"batch and seq must be >= 1 (got batch={batch}, seq={seq})")
    vocab, block_size = model_dims(model)
    if vocab is None or block_size is None:
        raise TensorstowError(f"model '{model_name}' ({type(model).__name__}, {forward_site(model)}) lacks "
                              f"`vocab_size`/`block_size` (on the model or its `config`, as nanoGPT keeps "
                              f"them): set them in __init__, or use hf:DIR for a Hugging Face model")
    if block_size and seq > block_size:  # 0: no sequence limit (ALiBi)
        raise TensorstowError(f"--seq {seq} exceeds the model's block_size {block_size}")
    dtype = PRECISIONS[precision]
    fm = fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
    layers_name, layers = find_layers(model)

    def fake(t):
        if _is_fake(t):
            return t
        if t.device.type == "meta":  # built without memory: a CPU fake of the same shape and layout
            with fm:
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        return fm.from_tensor(t)

    mixed = precision != "fp32"
    with fm:
        # Parameters are traced as their fp32 masters, under autocast when mixed (each op in the
        # dtype CUDA autocast gives it); buffers (rotary tables, masks) keep their dtype.
        # Frozen parameters keep the model's dtype under mixed precision, as in eager AMP.
        params = {n: fake(p).detach().to(torch.float32 if p.is_floating_point() and (p.requires_grad or not mixed)
                                          else p.dtype)
                  .requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
        buffers = {n: fake(b).detach() for n, b in model.named_buffers()}
        idx = torch.zeros(batch, seq, dtype=torch.long)
        tgt = torch.zeros(batch, seq, dtype=torch.long)
    if not any(p.requires_grad for p in params.values()):
        raise TensorstowError(f"model '{model_name}': no parameter requires grad, so there is nothing to "
                              f"train; unfreeze some (p.requires_grad_(True))")

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

    def step(p, b, i, t):
        return loss_of(functional_call(model, {**p, **b}, (i, t)), f"{model_name}' ({forward_site(model)})")

    # The backward is traced outside autocast, as eager AMP runs `loss.backward()` after the
    # autocast region (torch's default would trace it under the forward's autocast state).
    from torch._functorch import config as functorch_config

    from tensorstow.ir.autocast import gpu_autocast
    if not hasattr(functorch_config, "backward_pass_autocast"):
        raise TensorstowError(f"torch {torch.__version__} cannot trace a training step as tensorstow does (it "
                              f"has no torch._functorch.config.backward_pass_autocast): install torch>=2.10,<2.15")
    try:
        with fm, quiet_tracing(), ShapeConstants(), gpu_autocast(dtype) if mixed else contextlib.nullcontext(), \
                functorch_config.patch(backward_pass_autocast="off"):
            aot_function(step, fw_compiler=_never, partition_fn=partition)(params, buffers, idx, tgt)
    except _Captured:
        pass
    except TensorstowError:
        raise
    except Exception as e:  # a user model the tracer cannot handle: say where and why
        raise TensorstowError(tracing_failure(model_name, e)) from e
    finally:
        for h in hooks:
            h.remove()
    if "gm" not in captured:
        raise TensorstowError(f"model '{model_name}': no joint graph was produced "
                              f"(does forward return a loss that requires grad?)")
    gm: fx.GraphModule = captured["gm"]
    if mixed:
        _compute_copies(gm, [p.requires_grad for p in params.values()], dtype, fm)
    n_layers = len(layers) if layers is not None else 0
    state_names = [*params, *buffers]
    trainable = frozenset(n for n, p in params.items() if p.requires_grad)
    graph = _build_ir(gm, captured["bounds"], n_layers, state_names, trainable, model_name, batch, seq,
                      precision, replicate_to)
    return Traced(graph=graph, gm=gm, param_names=state_names, trainable=trainable, layer_path=layers_name)


def _compute_copies(gm: fx.GraphModule, trainable: list[bool], dtype: torch.dtype, fm: FakeTensorMode) -> None:
    """A trainable parameter autocast only ever reads cast to `dtype` becomes a `dtype` input:
    the compute copy P16 (LoHan Table II) the optimizer writes from the fp32 master, instead of
    a cast in every step's graph. Its gradient, autocast's upcast of a `dtype` gradient, is
    returned before the upcast (G16; the optimizer upcasts it). Same values: the cast is the
    rounding P16 = M.to(dtype). Parameters read in fp32 (norm weights, embeddings) stay fp32;
    frozen parameters and buffers (no master to round from) keep their dtype and their casts."""
    state = [n for n in gm.graph.nodes if n.op == "placeholder"][:len(trainable)]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    results = list(out.args[0])
    for i, ph in enumerate(state):
        if not trainable[i]:
            continue
        users = list(ph.users)
        if not users or not all(_is_cast(u, dtype) for u in users):
            continue
        v = ph.meta["val"]
        with fm:
            ph.meta["val"] = torch.empty_strided(v.shape, v.stride(), dtype=dtype)
        for u in users:
            u.replace_all_uses_with(ph)
            gm.graph.erase_node(u)
        g = results[1 + i] if 1 + i < len(results) else None
        if isinstance(g, fx.Node) and _is_cast(g, torch.float32) and len(g.users) == 1 \
                and _val(g.args[0]).dtype == dtype:
            results[1 + i] = g.args[0]
            out.args = (tuple(results), *out.args[1:])
            gm.graph.erase_node(g)
    gm.graph.lint()
    gm.recompile()


def _is_cast(n: fx.Node, dtype: torch.dtype) -> bool:
    return (n.op == "call_function" and n.target is torch.ops.aten._to_copy.default and len(n.args) == 1
            and set(n.kwargs) <= {"dtype", "layout", "device"} and n.kwargs.get("dtype") == dtype)


def model_dims(model: nn.Module) -> tuple[int | None, int | None]:
    """(vocab_size, block_size) of a model: its own attributes, else its `config`'s (nanoGPT)."""
    cfg = getattr(model, "config", None)
    return tuple(getattr(model, k, None) if getattr(model, k, None) is not None else getattr(cfg, k, None)
                 for k in ("vocab_size", "block_size"))


def forward_site(model: nn.Module) -> str:
    """`file:line` of the model's forward, for messages about what it returns."""
    import inspect
    fn = type(model).forward
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return type(model).__qualname__ + ".forward"


def loss_of(out, model_name: str) -> torch.Tensor:
    """The scalar loss of a forward's result: the result itself, or the one 0-dim floating
    tensor of a tuple / dict / ModelOutput (nanoGPT returns `(logits, loss)`)."""
    if isinstance(out, torch.Tensor):
        if out.dim() == 0:
            return out
        raise TensorstowError(
            f"model '{model_name}: forward returned a tensor of shape {tuple(out.shape)}, not a scalar "
            f"loss; return the loss (forward(idx, targets) -> loss), or use hf:DIR, which applies the "
            f"loss contract to a Hugging Face model's logits")
    leaves = pytree.tree_leaves(dict(out) if isinstance(out, dict) else out)
    scalars = [t for t in leaves if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()]
    if len(scalars) == 1:
        return scalars[0]
    raise TensorstowError(
        f"model '{model_name}: forward returned {type(out).__name__} with {len(scalars)} scalar tensors; "
        f"tensorstow needs one scalar loss: return it alone (forward(idx, targets) -> loss)")


class ShapeConstants(TorchFunctionMode):
    """Evaluates, for real, the values that depend only on shapes, so that tracing takes the
    branches eager execution takes.

    Models branch on such values (Hugging Face's mask code checks whether `position_ids =
    arange(T)` describe packed sequences); on fake tensors `bool(t)` has no answer. A tensor
    made by a factory with no tensor inputs (arange, ones, full, tril of those) or by an op
    whose tensor inputs are all such tensors gets a real shadow value; reading it (`bool`,
    `item`, `tolist`) reads the shadow. Values that depend on the data, the parameters or a
    random draw have no shadow, and reading them stays a tracing error (data-dependent
    control flow)."""

    LIMIT = 1 << 22
    """Largest shadow computed, in elements (masks of long sequences are left fake)."""
    _READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        from torch.utils.weak import WeakTensorKeyDictionary
        self.real = WeakTensorKeyDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.utils._python_dispatch import _disable_current_modes
        kwargs = kwargs or {}
        if func in self._READS and isinstance(args[0], torch.Tensor) and args[0] in self.real:
            with _disable_current_modes():
                return func(self.real[args[0]], *args[1:])
        out = func(*args, **kwargs)
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        name = getattr(func, "__name__", "")
        if not all(t in self.real for t in tensors) or draws_random(name):
            if tensors and (name.endswith("_") or "out" in kwargs):
                self.real.pop(tensors[0], None)  # mutated by unknown values: no longer known
            return out
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if not outs or any(o.numel() > self.LIMIT for o in outs):
            return out
        with _disable_current_modes():
            try:
                real_args = pytree.tree_map_only(torch.Tensor, lambda t: self.real[t], (args, kwargs))
                real_out = func(*real_args[0], **real_args[1])
            except Exception:  # no real value after all: the fake result stands alone
                return out
        reals = [r for r in pytree.tree_leaves(real_out) if isinstance(r, torch.Tensor)]
        if len(reals) == len(outs):
            for o, r in zip(outs, reals):
                self.real[o] = r
        return out


@contextmanager
def quiet_tracing():
    """Silence the loggers that print pages of fake-tensor internals when a trace fails (the
    failure itself becomes one line; `--debug` shows the traceback)."""
    loggers = [logging.getLogger(n) for n in ("torch._subclasses.fake_tensor", "torch.fx.experimental",
                                             "torch._functorch", "torch._dynamo", "transformers")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                      for m in (torch, __import__("functorch")))
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN = tuple(os.path.join(_ROOT, d) + os.sep for d in ("ir", "planner", "executor")) + tuple(
    os.path.join(_ROOT, f) for f in ("api.py", "__init__.py"))


def user_frame(exc: BaseException) -> str:
    """`file:line` of the innermost frame of the user's code (not torch, not tensorstow, not
    the standard library) in the exception's traceback; "" if there is none."""
    found = ""
    stdlib = os.path.dirname(contextlib.__file__) + os.sep
    for fs in traceback.extract_tb(exc.__traceback__):
        f = os.path.abspath(fs.filename)
        if f.startswith(_LIBRARY_DIRS) or f.startswith(_OWN) or (f.startswith(stdlib) and "site-packages" not in f):
            continue
        found = f"{fs.filename}:{fs.lineno}"
    return found


def tracing_failure(model_name: str, e: BaseException) -> str:
    """One line: what failed, where in the user's code, and what to do."""
    where = user_frame(e)
    at = f" at {where}" if where else ""
    first = str(e).splitlines()[0] if str(e) else ""
    name = type(e).__name__
    if "DataDependent" in name or "data-dependent" in first.lower() or "_local_scalar_dense" in first:
        return (f"model '{model_name}': data-dependent control flow{at}: forward reads a tensor's value "
                f"(`if t:`, `.item()`, `.tolist()`) that depends on the data or the parameters ({name}); "
                f"tensorstow plans one static schedule, so branches may depend on shapes only: compute "
                f"both sides with torch.where, or move the check out of forward")
    return (f"model '{model_name}': tracing failed{at} ({name}: {first}); forward(idx, targets) must run "
            f"under torch.fx/aot tracing on fake tensors (run with --debug for the traceback)")


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
        lo = _seq(args[0]) if args else None
        if lo is None:  # an input that needs no gradient (frozen embeddings): the counter itself,
            lo = torch.autograd._get_sequence_nr() - 1  # which the tracer stamps on forward ops
        bounds[i] = [lo, None]
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
    t = node.target
    packet = getattr(t, "overloadpacket", None)
    args, kwargs = pytree.tree_map_only(fx.Node, _val, (node.args, node.kwargs))
    out = _val(node)
    try:
        if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            return attention_flops(*(a.shape for a in args[:3]))
        if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
            return attention_flops(*(a.shape for a in args[1:4]), backward=True)
        fn = flop_counter.flop_registry.get(packet)
        return int(fn(*args, **kwargs, out_val=out)) if fn else 0
    except Exception:  # a counter that cannot read these args: count nothing rather than guess
        return 0


def _build_ir(gm, bounds, n_layers, param_names, trainable, model_name, batch, seq, precision,
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
        src = view_source(n)
        root[n.name] = n.name if src is None else root.get(src.name, src.name)

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
        view = aliases_input(n)
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
            p = param_of_ph.get(n.name)
            kind[n.name] = "input" if p is None else "parameter" if p in trainable else "constant"
            param_tag[n.name] = p or ""
    for name, p in grad_of.items():
        for nm in {name, root[name]}:
            if kind.get(nm) not in ("parameter", "constant", "input"):
                kind[nm], param_tag[nm] = "gradient", p
    for name in fwd_saved:
        for nm in (name, root[name]):
            kind.setdefault(nm, "saved_activation")
    for name, r in root.items():
        if r != name and kind.get(r) in ("parameter", "constant", "input") and name not in kind:
            kind[name], param_tag[name] = kind[r], param_tag[r]

    owner = _owners(ops, param_of_ph, grad_of, root, op_index, n_layers)
    tensors: dict[str, Tensor] = {}
    for n in nodes:
        v = _val(n) if n.op != "get_attr" else getattr(gm, n.target)
        if n.op not in ("placeholder", "call_function", "get_attr") or not isinstance(v, torch.Tensor):
            continue
        if n.op == "get_attr":  # a literal of forward (`torch.tensor([...])`): part of the graph
            kind[n.name] = "input"
            blk, prod = next((op.block for op in ops if n.name in op.inputs), "pre"), None
        elif n.op == "placeholder":
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
        ps = sorted(p for p, ob in owner.items() if ob == b and p in trainable)
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
                                        nbytes=4 * numel(ph.shape), block=b, producer=None,
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


FULL_TRACE_LAYERS = 8
"""Presets up to this depth are traced layer by layer; deeper ones trace 3 and replicate."""


def _build_without_memory(spec, fm: FakeTensorMode) -> nn.Module:
    """The model for tracing, built on fake tensors; a factory whose code cannot run on them
    (PEFT moves adapters with swap_tensors) is built on the meta device, and one that fails
    there too is built for real (its parameters then take host memory while planning)."""
    try:
        with fm:
            return spec.build(weights=False)
    except TensorstowError:
        raise
    except Exception:
        pass
    try:
        with torch.device("meta"):
            return spec.build(weights=False)
    except TensorstowError:
        raise
    except Exception:
        return spec.build(weights=False)


@contextmanager
def _template_view(model: nn.Module):
    """`model` with its list of layers cut to (first, middle, last) while a trace runs."""
    name, layers = find_layers(model)
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, nn.ModuleList([layers[0], layers[1], layers[len(layers) - 1]]))
    try:
        yield
    finally:
        setattr(parent, attr, layers)


def odd_layer(layers) -> int | None:
    """Index of the first of layers 2..L-2 whose structure differs from layer 1's (None: the
    middle layers are one similarity class, `ir.template.layer_structure`)."""
    from tensorstow.ir.template import layer_structure
    ref = layer_structure(layers[1])
    return next((i for i in range(2, len(layers) - 1) if layer_structure(layers[i]) != ref), None)


def trace_model(model: nn.Module, *, batch: int, seq: int, precision: str = "fp32", model_name: str = "model",
                template: bool | None = None, fake_mode: FakeTensorMode | None = None) -> Traced:
    """Trace `model`, a deep one as a block template: its first, middle and last layers are
    traced and the IR describes all L of them (`ir.template`). `template=None` decides: models
    deeper than FULL_TRACE_LAYERS whose middle layers share one structure and whose traced
    layers hand values on only to their neighbours; True insists (the executor, running a
    replicated plan), False traces every layer."""
    from tensorstow.ir.hf import wrap
    from tensorstow.ir.template import NotReplicable, instances
    model = wrap(model)
    _, layers = find_layers(model)
    depth = len(layers) if layers is not None else 0
    kw = dict(batch=batch, seq=seq, precision=precision, model_name=model_name, fake_mode=fake_mode)
    if template is None:
        template = depth > FULL_TRACE_LAYERS and odd_layer(layers) is None
        auto = True
    else:
        auto = False
    if not template:
        return trace(model, **kw)
    odd = odd_layer(layers) if depth > 3 else 0
    if odd is not None:
        raise TensorstowError(f"model '{model_name}': layer {odd} differs from layer 1 (module classes, "
                              f"attributes or parameter shapes), so one traced layer cannot stand for both; "
                              f"re-plan the model")
    with _template_view(model):
        traced = trace(model, replicate_to=depth, **kw)
    try:
        instances(traced.graph, traced.layer_path)
    except NotReplicable as e:
        if auto:
            return trace(model, **kw)
        raise TensorstowError(f"model '{model_name}': its traced layers cannot stand for the others ({e}); "
                              f"re-plan the model") from None
    return traced


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
        model = _build_without_memory(spec, fm)
        replicate = None
        if seq is None:
            seq = model_dims(model)[1]
            if seq == 0:
                raise TensorstowError(f"model '{spec.name}' has no sequence limit: pass --seq")
    if replicate is None and cfg is None:
        return trace_model(model, batch=batch, seq=seq, precision=precision, model_name=spec.name, fake_mode=fm)
    return trace(model, batch=batch, seq=seq, precision=precision, model_name=spec.name,
                 replicate_to=replicate, fake_mode=fm)
