"""The LM head and its cross-entropy fused and chunked (`fused_head_loss`): the logits of a step
never exist whole. GPT presets (`ir.models`) and Hugging Face causal LMs (`ir.hf`) use it from
FUSE_FROM_CHUNKS chunks of tokens a step on."""
from __future__ import annotations

import torch

FUSE_FROM_CHUNKS = 4
"""The fused head runs from this many chunks of tokens on: below, the plain head's logits are
small, and the fused head's gradients kept for backward (vocab x d in fp32) would outweigh them."""

IGNORE_INDEX = -100
"""Targets equal to this are left out of the loss (F.cross_entropy's default)."""


class _FusedHeadLoss(torch.autograd.Function):
    """`F.cross_entropy(h @ weight.T, targets)` (the mean over targets != IGNORE_INDEX) without
    the whole logits ever existing: the tokens go through in chunks, and each chunk's logits give
    its share of the loss and, at once, of the gradients with respect to h and weight, which are
    all the backward keeps. The technique of Liger-Kernel's fused linear cross-entropy.

    Why: the plain head of GPT-3 13B at batch 48 x seq 1024 holds 9.9 GB of fp32 logits and as much
    of log-softmax output and temporaries, more than a 24 GB GPU has next to the rest (LoHan and
    Fuyou train it at batch 64 on an RTX 4090); chunked, the head needs ~3 x chunk x vocab x 4 B of
    temporaries and keeps tokens x d + vocab x d of gradients. The arithmetic is the unfused
    head's (16-bit matmuls under autocast, softmax and loss in fp32), in another order: eager and
    the executor run this same function, so they agree bit for bit; against the unfused head the
    result differs by rounding."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int):
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32  # softmax and loss dtype
        valid = targets != IGNORE_INDEX
        scale = valid.to(acc) / valid.sum()  # d loss / d token-loss: 1/count, 0 where ignored
        safe = torch.where(valid, targets, 0).unsqueeze(1)
        losses, grad_h, grad_w = [], [], None
        for a in range(0, h.shape[0], chunk):
            hc, tc, sc = h[a:a + chunk], safe[a:a + chunk], scale[a:a + chunk].unsqueeze(1)
            logits = hc @ weight.t()  # 16-bit under autocast, like the unfused head's
            lf = logits.to(acc)
            lse = torch.logsumexp(lf, dim=-1, keepdim=True)
            losses.append(((lse - lf.gather(1, tc)) * sc).sum())
            probs = torch.exp(lf - lse)  # softmax; minus the one-hot of the target, per token's weight
            g = (probs.scatter_add(1, tc, torch.full(tc.shape, -1.0, dtype=acc, device=lf.device)) * sc).to(logits.dtype)
            grad_h.append(g @ weight)
            gw = (g.t() @ hc).to(acc)
            grad_w = gw if grad_w is None else grad_w + gw
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.save_for_backward(torch.cat(grad_h), grad_w)
        return torch.stack(losses).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (grad_h * grad_loss).to(h_dtype), (grad_w * grad_loss).to(w_dtype), None, None


def fused_head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean cross-entropy of the logits `h @ weight.T` over `targets`, `chunk` tokens at a time
    (`_FusedHeadLoss`). h: (tokens, d); weight: (vocab, d); targets: (tokens,)."""
    return _FusedHeadLoss.apply(h, weight, targets, chunk)


LOSS_CHUNK = 2048
"""Tokens per chunk of the fused head + loss of the LoHan / Fuyou GPT-3 presets (two sequences of
1024): 0.4 GB of fp32 logits per chunk. Those papers train at batch 32-64 on one 24-80 GB GPU,
where the plain head does not fit (`_FusedHeadLoss`)."""


