"""A frozen base stored quantized (QLoRA): the linear layers of a LoRA model's base held as
bitsandbytes holds them, dequantized by bitsandbytes' own kernels inside the step.

`quantize_linears(model, Quantization.parse("nf4"))` replaces every `nn.Linear` of the base but the
LM head and the layers `--quantize-skip` names (as `BitsAndBytesConfig(load_in_4bit=True,
llm_int8_skip_modules=...)` does; LoRA's own adapters are left as they are) with a
`QuantLinear`. Its weight is frozen parameters holding exactly what
`bitsandbytes.functional.quantize_4bit(W, blocksize=64, quant_type=..., compress_statistics=...)`
makes of the full-precision weight (what `from_pretrained` with that config stores): the packed
4-bit codes (`weight`, uint8, (out, in / 2): two codes a byte, row by row) and the per-block scales
(`weight_absmax`, fp32, one a `BLOCKSIZE` weights); with double quantization the scales themselves
8-bit (`weight_absmax` uint8, with `weight_nested_absmax` one fp32 a `NESTED_BLOCKSIZE` scales, the
8-bit code table `weight_nested_code` and the scales' mean `weight_offset`). Its forward dequantizes
them through `torch.ops.bitsandbytes` as bitsandbytes' `dequantize_4bit` does and runs `F.linear`:
the computation `Linear4bit` runs in training. The trace records the dequantization as ops of the
step, the planner moves and stores the quantized bytes (the frozen parameters are the block's
constants, `C:<b>`), and the executor dequantizes on the device inside the segment that reads the
weight.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tensorstow.errors import TensorstowError

QUANT_TYPES = ("nf4", "fp4", "int8")
"""The formats (`Options.quantize`): 4-bit NF4 and FP4 (`load_in_4bit`), 8-bit LLM.int8 weights
(`load_in_8bit`: int8 rows, each with its absmax scale)."""
BLOCKSIZE = 64
"""Weights per scale: bitsandbytes' and transformers' default for 4-bit."""
NESTED_BLOCKSIZE = 256
"""Scales per second-level scale under double quantization (bitsandbytes' `compress_statistics`)."""
SKIP = ("lm_head",)
"""Linear layers left in full precision (BitsAndBytesConfig's default `llm_int8_skip_modules`)."""
PARTS = ("weight", "weight_absmax", "weight_nested_absmax", "weight_nested_code", "weight_offset", "weight_scb")
"""A quantized layer's frozen parameters, by name: 4-bit the codes and scales (the nested ones with
double quantization), int8 the codes and their rows' scales (`weight_scb`, bitsandbytes' SCB)."""


@dataclass(frozen=True)
class Quantization:
    """`Options.quantize` read ("nf4", "fp4", "int8"; "nf4,double"), with `Options.quantize_skip`:
    more linear layers to keep in full precision (fnmatch patterns on module names, e.g. `*.down_proj`)."""
    quant_type: str
    double: bool = False
    skip: tuple[str, ...] = ()

    @staticmethod
    def parse(spec: str, skip: str | None = None) -> "Quantization":
        quant_type, *rest = [p.strip() for p in spec.split(",")]
        if quant_type not in QUANT_TYPES:
            raise TensorstowError(f"--quantize {spec}: give one of {', '.join(QUANT_TYPES)} (4-bit ones optionally "
                                  f"with ',double')")
        if rest not in ([], ["double"]) or rest and quant_type == "int8":
            raise TensorstowError(f"--quantize {spec}: the only part after the format is ',double', for nf4 and fp4")
        patterns = tuple(p.strip() for p in (skip or "").split(",") if p.strip())
        return Quantization(quant_type, bool(rest), patterns)

    def skips(self, name: str) -> bool:
        """Whether the linear layer `name` (its qualified module name) stays in full precision."""
        leaf = name.rpartition(".")[2]
        return leaf in SKIP or any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(leaf, p) for p in self.skip)


def bitsandbytes_functional():
    """`bitsandbytes.functional` (importing it registers `torch.ops.bitsandbytes`)."""
    try:
        import bitsandbytes.functional as bnb_f
        return bnb_f
    except ImportError:
        raise TensorstowError("--quantize needs bitsandbytes (pip install 'tensorstow[qlora]')") from None


def quantized_parts(weight: torch.Tensor, q: Quantization) -> dict[str, torch.Tensor]:
    """The frozen parameters `QuantLinear` holds for `weight` (`PARTS`), as bitsandbytes makes them:
    4-bit by `quantize_4bit`, int8 by `int8_vectorwise_quant` of the fp16 weight (what transformers'
    `load_in_8bit` stores)."""
    if q.quant_type == "int8":
        bitsandbytes_functional()
        codes, scb, _ = torch.ops.bitsandbytes.int8_vectorwise_quant(weight.detach().to(torch.float16), 0.0)
        return {"weight": codes, "weight_scb": scb}
    codes, state = bitsandbytes_functional().quantize_4bit(weight.detach().float(), blocksize=BLOCKSIZE,
                                                 quant_type=q.quant_type, compress_statistics=q.double)
    parts = {"weight": codes.view(weight.shape[0], -1), "weight_absmax": state.absmax}
    if q.double:
        parts.update(weight_nested_absmax=state.state2.absmax, weight_nested_code=state.state2.code,
                     weight_offset=state.offset.reshape(()).float())
    return parts


def parts_stored(key: str, files, read, q: Quantization) -> dict[str, torch.Tensor] | None:
    """The parts of `key`'s weight where the checkpoint holds it already quantized (saved by
    transformers from a bitsandbytes 4-bit model: `key` the codes, `key.absmax`, `key.quant_map`,
    `key.quant_state.bitsandbytes__<type>`, and with double quantization `key.nested_absmax`,
    `key.nested_quant_map`), read with bitsandbytes' own `QuantState.from_dict`; None where it holds
    the weight in full precision. A checkpoint quantized otherwise than `q` is refused."""
    module = key.removesuffix(".weight")
    if q.quant_type == "int8" and f"{module}.SCB" in files:
        return {"weight": read(key), "weight_scb": read(f"{module}.SCB")}
    if f"{key}.quant_map" not in files:
        if f"{module}.SCB" in files:
            raise TensorstowError(f"the checkpoint stores {key} as int8, not as the plan's --quantize {q.quant_type}: "
                                  f"plan it with --quantize int8")
        return None
    stored = {k[len(key) + 1:]: read(k) for k in files if k.startswith(f"{key}.")}
    state = bitsandbytes_functional().QuantState.from_dict(stored, torch.device("cpu"))
    if q.quant_type == "int8" or state.quant_type != q.quant_type or bool(state.nested) != q.double or state.blocksize != BLOCKSIZE:
        saved = state.quant_type + (",double" if state.nested else "")
        raise TensorstowError(f"the checkpoint stores {key} as {saved} in blocks of {state.blocksize}, not as the plan's "
                              f"--quantize {q.quant_type}{',double' if q.double else ''} (blocks of {BLOCKSIZE}): plan it "
                              f"with --quantize {saved}")
    codes = read(key)
    parts = {"weight": codes.view(state.shape[0], -1), "weight_absmax": state.absmax}
    if state.nested:
        parts.update(weight_nested_absmax=state.state2.absmax, weight_nested_code=state.state2.code,
                     weight_offset=state.offset.reshape(()).float())
    return parts


def _shapes(out_features: int, in_features: int, q: Quantization) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if q.quant_type == "int8":
        return {"weight": ((out_features, in_features), torch.int8), "weight_scb": ((out_features,), torch.float32)}
    blocks = out_features * in_features // BLOCKSIZE
    shapes = {"weight": ((out_features, in_features // 2), torch.uint8),
              "weight_absmax": ((blocks,), torch.uint8 if q.double else torch.float32)}
    if q.double:
        shapes.update(weight_nested_absmax=((-(-blocks // NESTED_BLOCKSIZE),), torch.float32),
                      weight_nested_code=((256,), torch.float32), weight_offset=((), torch.float32))
    return shapes


def dequantized(parts: dict[str, torch.Tensor], quant_type: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight of a quantized layer's parts (`PARTS` present), as bitsandbytes makes it in training:
    4-bit by `dequantize_4bit` (the scales first where they are 8-bit), in fp32; int8 as its CPU
    training path (`MatMul8bitFp`) does, the codes in `dtype` (the input's) times their row's scale / 127."""
    if "weight_scb" in parts:
        return parts["weight"].to(dtype).mul_(parts["weight_scb"].unsqueeze(1).mul(1.0 / 127.0))
    bitsandbytes_functional()  # its ops registered (an export merging a base runs without the step's imports)
    codes, absmax = parts["weight"], parts["weight_absmax"]
    if "weight_nested_absmax" in parts:
        absmax = torch.ops.bitsandbytes.dequantize_blockwise(absmax, parts["weight_nested_absmax"],
                                                            parts["weight_nested_code"], NESTED_BLOCKSIZE,
                                                            torch.float32)
        absmax = absmax + parts["weight_offset"]
    return torch.ops.bitsandbytes.dequantize_4bit(codes, absmax, BLOCKSIZE, quant_type,
                                                  [codes.shape[0], 2 * codes.shape[1]], torch.float32)


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored quantized (4-bit: `quantize_4bit`'s codes and scales;
    int8: rows and their scales) and dequantized on each use, as bitsandbytes' `Linear4bit` and
    `Linear8bitLt` compute in training."""

    def __init__(self, linear: nn.Linear, q: Quantization):
        super().__init__()
        bitsandbytes_functional()
        self.in_features, self.out_features, self.quant_type = linear.in_features, linear.out_features, q.quant_type
        w = linear.weight
        if q.quant_type != "int8" and (w.numel() % BLOCKSIZE or self.in_features % 2):
            raise TensorstowError(f"--quantize: a {tuple(w.shape)} weight does not split into blocks of {BLOCKSIZE}; "
                                  f"leave its layer out (--quantize-skip NAME)")
        if w.device.type == "meta" or _is_fake(w):  # shapes only: streamed or traced
            parts = {k: torch.empty(s, dtype=dt, device=w.device)
                     for k, (s, dt) in _shapes(self.out_features, self.in_features, q).items()}
        else:
            parts = quantized_parts(w, q)
        for k in PARTS:
            if k in parts:
                setattr(self, k, nn.Parameter(parts[k], requires_grad=False))
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = {k: getattr(self, k) for k in PARTS if hasattr(self, k)}
        return F.linear(x, dequantized(parts, self.quant_type, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.quant_type}"


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


def quantize_linears(model: nn.Module, q: Quantization) -> dict[str, str]:
    """Replace the base's linear layers of `model` (a PEFT LoRA model, or a plain one) by
    `QuantLinear`s, in place; returns {qualified name of each quantized layer's parameter:
    the full-precision weight's name it is made from} (`<layer>.weight_absmax` -> `<layer>.weight`)."""
    made: dict[str, str] = {}
    head = _output_embeddings(model)
    for name, module in list(model.named_modules()):
        for child, sub in list(module.named_children()):
            full = f"{name}.{child}" if name else child
            if type(sub) is not nn.Linear or ".lora_" in f".{full}" or child.startswith("lora_") or sub is head:
                continue
            layer = full.removesuffix(".base_layer")
            if q.skips(layer):
                continue
            setattr(module, child, QuantLinear(sub, q))
            made.update({f"{full}.{p}": f"{full}.weight" for p in PARTS if hasattr(getattr(module, child), p)})
    if not made:
        raise TensorstowError("--quantize: the model has no linear layer to quantize")
    return made


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's LM head whatever the family names it (`lm_head`, GPT-NeoX's `embed_out`): the
    output embeddings transformers keeps in full precision under quantization."""
    for m in model.modules():
        get = getattr(m, "get_output_embeddings", None)
        if callable(get):
            try:
                head = get()
            except (AttributeError, NotImplementedError):
                continue
            if isinstance(head, nn.Module):
                return head
    return None


def frozen_param_count(model: nn.Module) -> int:
    """The model's frozen parameters as weights count them: a quantized layer's weight (and bias) by
    its shape, not by its codes and scales."""
    n = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            n += m.in_features * m.out_features + (m.bias.numel() if m.bias is not None else 0)
            continue
        n += sum(p.numel() for p in m.parameters(recurse=False) if not p.requires_grad)
    return n
