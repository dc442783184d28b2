"""Trace an nn.Module into the tensor-lifetime IR with torch.fx, on fake tensors.

The joint forward+backward graph comes from `aot_function` with a capturing partition
function (no compilation happens: tracing stops once the joint graph is captured). The
model and inputs live in a CPU `FakeTensorMode` (no real memory; meta-device tracing drops
cross_entropy's backward, see DESIGN.md pitfalls).

Forward hooks on each layer record the autograd sequence numbers of its input and output while
the step is traced; `ir.build` turns the captured graph into the IR, attributing each op to a
block by them.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
import logging
import os
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from tensorstow.errors import TensorstowError
from tensorstow.ir.build import build_ir, node_value
from tensorstow.ir.graph import Graph, draws_random

PRECISIONS = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


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
    packing: bool = False
    """The step takes each token's position as a third input (packed windows: `trace`'s `packing`)."""
    frozen_params: int = 0
    """Parameters that do not train (a LoRA model's base; a quantized weight counted by its shape)."""


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
          fake_mode: FakeTensorMode | None = None, packing: bool = False) -> Traced:
    """Trace one training step of `model` on fake `(batch, seq)` token inputs.

    `model` may hold real or fake parameters; nothing is allocated or modified. With
    `replicate_to=L` the model must have been built with 3 layers (first, middle, last);
    the IR then describes L layers, layers 1..L-2 sharing the middle layer's profile.
    `packing`: the step also takes each token's position (`(batch, seq)` int64), for windows that
    pack several documents, each from position 0 and attending only to itself (a Hugging Face
    model builds that mask from the positions).
    """
    from tensorstow.ir.hf import CausalLM, wrap
    model = wrap(model)  # a Hugging Face causal LM given as a module gets the loss contract
    _check_step(model, model_name, batch, seq, precision)
    if packing and not isinstance(model, CausalLM):
        raise TensorstowError(f"model '{model_name}': --packing keeps a window's documents apart with per-document "
                              f"position ids, which only Hugging Face models (hf:DIR) take; plan without --packing "
                              f"(one example a row)")
    dtype = PRECISIONS[precision]
    fm = fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
    layers_name, layers = find_layers(model)
    mixed = precision != "fp32"
    params, buffers, idx, tgt = _fake_inputs(model, fm, batch, seq, mixed)
    with fm:
        extra = (torch.zeros(batch, seq, dtype=torch.long),) if packing else ()
    if not any(p.requires_grad for p in params.values()):
        raise TensorstowError(f"model '{model_name}': no parameter requires grad, so there is nothing to "
                              f"train; unfreeze some (p.requires_grad_(True))")
    gm, bounds = _capture_joint(model, model_name, layers, fm, dtype if mixed else None,
                                (params, buffers, idx, tgt, *extra))
    if mixed:
        _compute_copies(gm, [p.requires_grad for p in params.values()], dtype, fm)
    n_layers = len(layers) if layers is not None else 0
    state_names = [*params, *buffers]
    trainable = frozenset(n for n, p in params.items() if p.requires_grad)
    graph = build_ir(gm, bounds=bounds, n_layers=n_layers, param_names=state_names, trainable=trainable,
                     model_name=model_name, batch=batch, seq=seq, precision=precision, dtype=dtype,
                     replicate_to=replicate_to)
    from tensorstow.ir.quant import frozen_param_count
    frozen = frozen_param_count(model)
    if replicate_to is not None and layers is not None:  # a 3-layer template stands for replicate_to layers
        per_layer = frozen_param_count(layers[1])
        frozen += per_layer * (replicate_to - len(layers))
    return Traced(graph=graph, gm=gm, param_names=state_names, trainable=trainable, layer_path=layers_name,
                  packing=packing, frozen_params=frozen)


def _check_step(model: nn.Module, model_name: str, batch: int, seq: int, precision: str) -> None:
    """Raise TensorstowError where no step can be traced: an unknown precision, an empty batch, a
    model without `vocab_size`/`block_size`, a sequence longer than its `block_size`."""
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


def _fake_inputs(model: nn.Module, fm: FakeTensorMode, batch: int, seq: int, mixed: bool):
    """(parameters, buffers, idx, targets) of the step in `fm`: the model's state as fake tensors
    (a meta-device one as a CPU fake of the same shape and layout) and zero token inputs.
    Parameters are traced as their fp32 masters, under autocast when mixed (each op in the dtype
    CUDA autocast gives it); buffers (rotary tables, masks) keep their dtype. Frozen parameters
    keep the model's dtype under mixed precision, as in eager AMP."""
    def fake(t):
        if _is_fake(t):
            return t
        if t.device.type == "meta":  # built without memory: a CPU fake of the same shape and layout
            with fm:
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        return fm.from_tensor(t)

    with fm:
        params = {n: fake(p).detach().to(torch.float32 if p.is_floating_point() and (p.requires_grad or not mixed)
                                          else p.dtype)
                  .requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
        buffers = {n: fake(b).detach() for n, b in model.named_buffers()}
        idx = torch.zeros(batch, seq, dtype=torch.long)
        tgt = torch.zeros(batch, seq, dtype=torch.long)
    return params, buffers, idx, tgt


def _capture_joint(model: nn.Module, model_name: str, layers: nn.ModuleList | None, fm: FakeTensorMode,
                   autocast: torch.dtype | None, inputs: tuple) -> tuple[fx.GraphModule, dict[int, list]]:
    """The joint forward+backward graph of one step on `inputs` (params, buffers, idx, targets),
    captured by `aot_function`'s partition function (tracing stops there, nothing compiles), and
    each layer's autograd sequence-number bounds, recorded by hooks while it ran. `autocast`: the
    mixed-precision compute dtype (None: fp32)."""
    # The backward is traced outside autocast, as eager AMP runs `loss.backward()` after the
    # autocast region (torch's default would trace it under the forward's autocast state).
    from torch._functorch import config as functorch_config
    if not hasattr(functorch_config, "backward_pass_autocast"):
        raise TensorstowError(f"torch {torch.__version__} cannot trace a training step as tensorstow does (it "
                              f"has no torch._functorch.config.backward_pass_autocast): install torch>=2.10,<2.15")
    from functorch.compile import aot_function
    from torch.func import functional_call

    from tensorstow.ir.autocast import gpu_autocast

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

    def step(p, b, i, t, *positions):
        return loss_of(functional_call(model, {**p, **b}, (i, t, *positions)), f"{model_name}' ({forward_site(model)})")

    try:
        with model_left_as_it_was(model), fm, quiet_tracing(), ShapeConstants(), grouped_mm_any_dtype(), \
                transformers_sees_a_trace() if len(inputs) > 4 else contextlib.nullcontext(), \
                gpu_autocast(autocast) if autocast is not None else contextlib.nullcontext(), \
                functorch_config.patch(backward_pass_autocast="off"):
            aot_function(step, fw_compiler=_never, partition_fn=partition)(*inputs)
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
    return captured["gm"], captured["bounds"]


@contextmanager
def model_left_as_it_was(model: nn.Module):
    """Every module of `model` keeps its class, parameters, buffers and submodules whatever its
    forward does to them while traced: PEFT's LoRA on a parameter itself (`target_parameters`)
    registers a parametrization of the parameter for each forward and removes it after, which under
    `functional_call`'s swapped-in tensors left the module without its parameter."""
    saved = [(m, m.__class__, dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in model.modules()]
    try:
        yield
    finally:
        for m, cls, params, buffers, modules in saved:
            m.__class__ = cls
            for d, old in ((m._parameters, params), (m._buffers, buffers), (m._modules, modules)):
                if d.keys() != old.keys() or any(d[k] is not v for k, v in old.items()):
                    d.clear()
                    d.update(old)


@contextmanager
def transformers_sees_a_trace():
    """While tracing, transformers' `masking_utils.is_tracing` answers True, as it does under the
    tracers it knows (dynamo, torch.fx, fake tensors): aot tracing's functional tensors are none of
    them, and where it thinks it runs eagerly transformers reads data to skip work, e.g. whether a
    packed window holds more than one document (`find_packed_sequence_indices`); traced, it builds
    the mask from the positions whatever they are, the static graph every window runs. Only a packed
    step (positions given) traces so: without, eager's causal path (no mask) is the one traced."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "is_tracing"):
        yield
        return
    before = masking.is_tracing
    masking.is_tracing = lambda tensor=None: True
    try:
        yield
    finally:
        masking.is_tracing = before


@contextmanager
def grouped_mm_any_dtype():
    """While tracing, `aten::_grouped_mm` (a mixture of experts' experts, as transformers runs them:
    `integrations/moe.py`) has its output shape inferred for every dtype: torch's meta function
    checks its CUDA kernel's rule (bf16 only), where its CPU kernel, which eager runs, also takes
    fp32 and fp16. The shape is static whatever the routing: the token-rows of every expert
    together, the group sizes `offs` being data."""
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    def meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        torch._check(mat_a.dtype == mat_b.dtype, lambda: f"grouped_mm of {mat_a.dtype} and {mat_b.dtype}")
        torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3) and mat_a.size(-1) == mat_b.size(-2),
                     lambda: f"grouped_mm of shapes {tuple(mat_a.shape)} and {tuple(mat_b.shape)}")
        return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype or mat_a.dtype)
    op, key = torch.ops.aten._grouped_mm.default, torch._C.DispatchKey.Meta
    before = op.py_kernels.get(key)  # what aot tracing's Python dispatcher runs (`activate_meta`)
    lib = torch.library.Library("aten", "IMPL")
    try:
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
                lib.impl("_grouped_mm", meta, "Meta")
        except RuntimeError:  # torch 2.11: a Python Meta kernel is registered already; the one below replaces it
            pass
        op.py_kernels[key] = meta
        op._dispatch_cache.clear()
        yield
    finally:
        if before is None:
            op.py_kernels.pop(key, None)
        else:
            op.py_kernels[key] = before
        op._dispatch_cache.clear()
        lib._destroy()


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
                and node_value(g.args[0]).dtype == dtype:
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


FULL_TRACE_LAYERS = 8
"""Presets up to this depth are traced layer by layer; deeper ones trace 3 and replicate."""


def _build_without_memory(spec, fm: FakeTensorMode) -> nn.Module:
    """The model for tracing, built on fake tensors; a factory whose code cannot run on them
    (PEFT moves adapters with swap_tensors) is built on the meta device, and one that fails
    there too is built for real (its parameters then take host memory while planning)."""
    from tensorstow.ir.models import FactoryError
    for where in (fm, torch.device("meta")):
        try:
            with where:
                return spec.build(weights=False)
        except FactoryError:  # the factory's own code failed there (a TensorstowError it raised is the user's)
            continue
        except TensorstowError:
            raise
        except Exception:  # noqa: BLE001 - library code that cannot run on fake or meta tensors
            continue
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
                template: bool | None = None, fake_mode: FakeTensorMode | None = None, packing: bool = False) -> Traced:
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
    kw = dict(batch=batch, seq=seq, precision=precision, model_name=model_name, fake_mode=fake_mode, packing=packing)
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


def trace_spec(spec, *, batch: int, seq: int | None = None, precision: str = "fp32", packing: bool = False) -> Traced:
    """Trace a ModelSpec (once per process for a preset or an `hf:` model: `ir.kept`). Presets
    deeper than FULL_TRACE_LAYERS are built with 3 layers (first, middle, last) on fake tensors
    and replicated by similarity: the middle layer's profile stands for layers 1..L-2 (their
    signatures are equal by construction)."""
    from tensorstow.ir.kept import traced_once
    return traced_once(spec, ("plan", batch, seq, precision, packing),
                       lambda: _trace_spec(spec, batch=batch, seq=seq, precision=precision, packing=packing))


def _trace_spec(spec, *, batch: int, seq: int | None, precision: str, packing: bool) -> Traced:
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
        return trace_model(model, batch=batch, seq=seq, precision=precision, model_name=spec.name, fake_mode=fm,
                           packing=packing)
    return trace(model, batch=batch, seq=seq, precision=precision, model_name=spec.name,
                 replicate_to=replicate, fake_mode=fm, packing=packing)
