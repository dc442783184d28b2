"""A frozen base stored quantized (QLoRA): the linear layers of a LoRA model's base held as
bitsandbytes holds them, dequantized by bitsandbytes' own kernel inside the step.

`quantize_linears(model, "nf4")` replaces every `nn.Linear` of the base but the LM head (as
`BitsAndBytesConfig(load_in_4bit=True)` does by default; LoRA's own adapters are left as they are)
with a `QuantLinear4bit`: its weight is two frozen parameters, the packed 4-bit codes (`weight`, uint8,
(out, in / 2): two codes a byte, row by row) and the per-block scales (`weight_absmax`, fp32, one a
`BLOCKSIZE` weights), exactly
`bitsandbytes.functional.quantize_4bit(W, blocksize=64, quant_type=...)` of the full-precision
weight (what `from_pretrained` with that config stores). Its forward is
`F.linear(x, dequantize_4bit(codes, absmax, ...), bias)` through `torch.ops.bitsandbytes`, the
computation bitsandbytes' `Linear4bit` runs in training: the trace records the dequantization as
an op of the step, the planner moves and stores the quantized bytes (the frozen parameters are the
block's constants, `C:<b>`), and the executor dequantizes on the device inside the segment that
reads the weight.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tensorstow.errors import TensorstowError

QUANT_TYPES = ("nf4", "fp4")
"""The 4-bit formats (`Options.quantize`)."""
BLOCKSIZE = 64
"""Weights per scale: bitsandbytes' and transformers' default for 4-bit."""
SKIP = ("lm_head",)
"""Linear layers left in full precision (BitsAndBytesConfig's default `llm_int8_skip_modules`)."""


def _bitsandbytes():
    """`bitsandbytes.functional` (importing it registers `torch.ops.bitsandbytes`)."""
    try:
        import bitsandbytes.functional as bnb_f
        return bnb_f
    except ImportError:
        raise TensorstowError("--quantize needs bitsandbytes (pip install 'tensorstow[hf]')") from None


class QuantLinear4bit(nn.Module):
    """A linear layer whose weight is stored 4-bit (`quantize_4bit`'s codes and scales) and
    dequantized to fp32 on each use, as bitsandbytes' `Linear4bit` computes in training."""

    def __init__(self, linear: nn.Linear, quant_type: str):
        super().__init__()
        bnb_f = _bitsandbytes()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.quant_type = quant_type
        w = linear.weight
        n = w.numel()
        if n % BLOCKSIZE or self.in_features % 2:
            raise TensorstowError(f"--quantize {quant_type}: a {tuple(w.shape)} weight does not split into blocks of "
                                  f"{BLOCKSIZE}; leave its layer out (--quantize-skip)")
        if w.device.type == "meta" or _is_fake(w):  # shapes only: streamed or traced
            codes = torch.empty(self.out_features, self.in_features // 2, dtype=torch.uint8, device=w.device)
            absmax = torch.empty(n // BLOCKSIZE, dtype=torch.float32, device=w.device)
        else:
            codes, state = bnb_f.quantize_4bit(w.detach().float(), blocksize=BLOCKSIZE, quant_type=quant_type)
            codes, absmax = codes.view(self.out_features, -1), state.absmax
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_absmax = nn.Parameter(absmax, requires_grad=False)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.ops.bitsandbytes.dequantize_4bit(self.weight, self.weight_absmax, BLOCKSIZE, self.quant_type,
                                                   [self.out_features, self.in_features], torch.float32)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.quant_type}"


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


def quantize_linears(model: nn.Module, quant_type: str) -> dict[str, str]:
    """Replace the base's linear layers of `model` (a PEFT LoRA model, or a plain one) by
    `QuantLinear4bit`s, in place; returns {qualified name of each quantized layer's parameter:
    the full-precision weight's name it is made from} (`<layer>.weight` and
    `<layer>.weight_absmax` -> `<layer>.weight`)."""
    if quant_type not in QUANT_TYPES:
        raise TensorstowError(f"--quantize {quant_type}: give one of {', '.join(QUANT_TYPES)}")
    made: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        for child, sub in list(module.named_children()):
            full = f"{name}.{child}" if name else child
            if type(sub) is not nn.Linear or child in SKIP or ".lora_" in f".{full}" or child.startswith("lora_"):
                continue
            setattr(module, child, QuantLinear4bit(sub, quant_type))
            made[f"{full}.weight"] = f"{full}.weight"
            made[f"{full}.weight_absmax"] = f"{full}.weight"
    if not made:
        raise TensorstowError(f"--quantize {quant_type}: the model has no linear layer to quantize")
    return made


def frozen_param_count(model: nn.Module) -> int:
    """The model's frozen parameters as weights count them: a quantized layer's weight (and bias) by
    its shape, not by its codes and scales."""
    n = 0
    for m in model.modules():
        if isinstance(m, QuantLinear4bit):
            n += m.in_features * m.out_features + (m.bias.numel() if m.bias is not None else 0)
            continue
        n += sum(p.numel() for p in m.parameters(recurse=False) if not p.requires_grad)
    return n


def quantized_part(weight: torch.Tensor, part: str, quant_type: str) -> torch.Tensor:
    """`part` ("weight": the codes, "weight_absmax": the scales) of `weight` quantized as
    `QuantLinear4bit` stores it: a checkpoint's full-precision weight quantized as it is read."""
    codes, state = _bitsandbytes().quantize_4bit(weight.float(), blocksize=BLOCKSIZE, quant_type=quant_type)
    return codes.view(weight.shape[0], -1) if part == "weight" else state.absmax


def dequantized(codes: torch.Tensor, absmax: torch.Tensor, quant_type: str) -> torch.Tensor:
    """The fp32 weight of `QuantLinear4bit` codes (out, in / 2) and scales, as its forward makes it."""
    _bitsandbytes()
    return torch.ops.bitsandbytes.dequantize_4bit(codes, absmax, BLOCKSIZE, quant_type,
                                                  [codes.shape[0], 2 * codes.shape[1]], torch.float32)
