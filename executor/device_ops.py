"""Ops a CPU trace holds that only the CPU implements, and what runs them on another device.

Every plan's joint graph is traced on CPU fake tensors (the planner's machine may have no GPU,
and one trace everywhere keeps the fingerprint independent of the backend). PyTorch decomposes
`F.scaled_dot_product_attention` there into `aten._scaled_dot_product_flash_attention_for_cpu`
and its backward: kernels only the CPU registers. On CUDA the executor runs them through
`PORTABLE`, functions with the CPU ops' signatures and results:

- 16-bit attention without a mask (what a mixed-precision causal LM runs; `flash_eligible`):
  CUDA's flash-attention kernels, forward and backward, as eager's `F.scaled_dot_product_attention`
  and its autograd run them. The forward's log-sum-exp (the same (B, H, T) fp32 tensor the CPU
  kernel saves) is what the backward reads; dropout's RNG state is not kept (no dropout here).
- anything else (fp32, a mask, a head size or GPU flash does not take):
  - forward: `F.scaled_dot_product_attention` (memory-efficient, cuDNN or math, whichever
    PyTorch picks), its output given the strides the trace recorded; the log-sum-exp output,
    which only the backward below would read, is left uninitialised.
  - backward: the attention recomputed under autograd and differentiated: one extra attention
    forward per backward, in exchange for not depending on a kernel's private saved state
    (a padded log-sum-exp). It leaves the step's inference mode for that, on copies of the
    query, key, value and mask. The planner prices that forward (`planner.cost`), by the same rule.

Saved-activation sizes follow the trace (the CPU op's output and log-sum-exp, the same shapes
CUDA's flash kernel saves). Attention dropout is refused off the CPU: its mask could not be
reproduced. `tests/test_device_ops.py` checks the functions against the CPU ops (the flash calls'
signatures and results on meta tensors; their numbers on a GPU) and checks that the traces of the
tested model families hold no other CPU-only op.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tensorstow.errors import TensorstowError
from tensorstow.ir.graph import flash_eligible

aten = torch.ops.aten


def _restride(t: torch.Tensor, like) -> torch.Tensor:
    """`t` with the strides the trace recorded for this output (downstream views rely on them)."""
    if like is None or t.stride() == tuple(like.stride()):
        return t
    out = torch.empty_strided(tuple(like.shape), tuple(like.stride()), dtype=t.dtype, device=t.device)
    return out.copy_(t)


def _flash(query, key, value, attn_mask) -> bool:
    """`flash_eligible` for these tensors on this device (and PyTorch lets flash run there)."""
    return (query.device.type == "cuda"
            and flash_eligible({query.dtype, key.dtype, value.dtype}, query.shape, key.shape, value.shape,
                               attn_mask is not None)
            and all(t.stride(-1) == 1 for t in (query, key, value))
            and torch.backends.cuda.flash_sdp_enabled() and _flash_runs(query.device, query.dtype))


@functools.lru_cache(maxsize=None)
def _flash_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this GPU runs the flash kernels (compute capability, the build): one tiny forward
    and backward, once per device and dtype; the recompute path serves it where they refuse."""
    try:
        q = torch.zeros(1, 1, 8, 8, dtype=dtype, device=device)
        out, lse = flash_forward(q, q, q, True, None)
        flash_backward(out, q, q, q, out, lse, True, None)
        return True
    except RuntimeError:
        return False


def flash_forward(query, key, value, is_causal, scale):
    """(output, logsumexp) of `aten._scaled_dot_product_flash_attention`, no dropout."""
    r = aten._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal, False, scale=scale)
    return r[0], r[1]


def flash_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale):
    """The gradients of query, key and value from `flash_forward`'s results. Without dropout the
    kernel reads no RNG state: the seed and offset are placeholders of the forward's dtypes."""
    grad_out, out = (t if t.stride(-1) == 1 else t.contiguous() for t in (grad_out, out))  # the kernel's layout
    rng, unused = _rng_placeholders(query.device)
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out, query, key, value, out, logsumexp, None, None, query.shape[-2], key.shape[-2], 0.0, is_causal,
        rng, unused, scale=scale)


@functools.lru_cache(maxsize=None)
def _rng_placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed and offset `flash_backward` passes (read only with dropout), made once per device."""
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)


def sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None, _like=None):
    """`_scaled_dot_product_flash_attention_for_cpu` on any device: (output, logsumexp)."""
    _no_dropout(dropout_p)
    like_out, like_lse = _like if _like is not None else (None, None)
    if _flash(query, key, value, attn_mask):
        out, lse = flash_forward(query, key, value, is_causal, scale)
        return _restride(out, like_out), lse
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=0.0,
                                         is_causal=is_causal, scale=scale)
    B, H, T = query.shape[0], query.shape[1], query.shape[2]
    lse_shape = tuple(like_lse.shape) if like_lse is not None else (B, H, T)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=query.device)
    return _restride(out, like_out), lse


def sdpa_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                  scale=None, _like=None):
    """`_scaled_dot_product_flash_attention_for_cpu_backward` on any device: the gradients of
    query, key and value; with the flash kernel `sdpa_forward` ran, else by recomputing the
    attention under autograd."""
    _no_dropout(dropout_p)
    likes = _like if _like is not None else (None, None, None)
    if _flash(query, key, value, attn_mask):
        grads = flash_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale)
        return tuple(_restride(g, like) for g, like in zip(grads, likes))
    # the executor's step runs in inference mode, where autograd records nothing: leave it here,
    # and differentiate normal copies of its inference tensors (autograd refuses to save those)
    with torch.inference_mode(False), torch.enable_grad():
        q, k, v = (_autograd_leaf(t).requires_grad_(True) for t in (query, key, value))
        mask = None if attn_mask is None else _autograd_leaf(attn_mask)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=is_causal,
                                           scale=scale)
        grads = torch.autograd.grad(o, (q, k, v), grad_out)
    return tuple(_restride(g, like) for g, like in zip(grads, likes))


def _autograd_leaf(t: torch.Tensor) -> torch.Tensor:
    """`t` detached from any graph; a copy where it is an inference tensor."""
    return t.clone() if t.is_inference() else t.detach()


def _no_dropout(p: float) -> None:
    if p:
        raise TensorstowError(f"attention dropout ({p}) runs only on the CPU in this version: a plan traced on "
                              f"the CPU recomputes attention on other devices, which cannot replay the "
                              f"CPU kernel's mask; set the model's attention dropout to 0")


PORTABLE = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: sdpa_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: sdpa_backward,
}
"""CPU-only op of a trace -> a function with its signature that runs on any device. A function
takes `_like`: the trace's fake values of the op's outputs (shapes and strides to match)."""


def cpu_only(op) -> bool:
    """Whether an aten op is one only the CPU backend implements (by PyTorch's naming of such
    kernels: `..._for_cpu`, `..._cpu_fallback`, mkldnn)."""
    name = getattr(op, "_name", "") or str(op)
    return "_for_cpu" in name or "cpu_fallback" in name or "mkldnn" in name


def check_portable(gm, device: torch.device) -> None:
    """Refuse, before the first step, a graph that holds an op `device` cannot run."""
    if device.type == "cpu":
        return
    for n in gm.graph.nodes:
        if n.op != "call_function" or not cpu_only(n.target):
            continue
        if n.target not in PORTABLE:
            raise TensorstowError(f"the traced graph holds {n.target}, which only the CPU implements and "
                                  f"tensorstow cannot run on {device.type}; please report the model")
        dropout = n.args[3] if len(n.args) > 3 else n.kwargs.get("dropout_p", 0.0)
        if n.target is aten._scaled_dot_product_flash_attention_for_cpu.default and dropout:
            _no_dropout(dropout)


def targets_for(device: torch.device) -> dict:
    """The replacement of each CPU-only op when running on `device` (none on the CPU)."""
    return {} if device.type == "cpu" else dict(PORTABLE)
