"""The fused, chunked LM head + cross-entropy (`ir.models.fused_head_loss`, GPTConfig.loss_chunk):
it equals the plain head up to rounding, trains through the executor exactly as eager does, and
is what lets the papers' GPT-3 13B at batch 48 and 64 fit an RTX 4090 in the planner."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tensorstow.api import plan
from tensorstow.executor.data import batches
from tensorstow.executor.executor import Executor
from tensorstow.ir.models import GPT, PRESETS, fused_head_loss
from tests.oracle import train_eager

TINY = dataclasses.replace(PRESETS["gpt-tiny"], loss_chunk=16)
B, T, STEPS, LR = 2, 32, 3, 1e-3


def test_fused_head_loss_equals_cross_entropy_and_its_gradients():
    torch.manual_seed(0)
    h = torch.randn(300, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 32, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (300,))
    t[[5, 77]] = -100  # ignored, as F.cross_entropy's default ignore_index
    want = F.cross_entropy(h @ w.t(), t)
    got = fused_head_loss(h, w, t, 64)  # 5 chunks, the last one short
    assert torch.allclose(got, want, rtol=1e-12)
    for a, b in zip(torch.autograd.grad(2.5 * got, (h, w)), torch.autograd.grad(2.5 * want, (h, w))):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_fused_head_trains_through_the_executor_exactly_like_eager(precision):
    """Several chunks per step (B x T = 64 tokens, 16 per chunk: the fused head), planned with the head's state
    streamed from DRAM; bit-identical with eager training of the same model."""
    torch.manual_seed(0)
    res = plan(GPT(TINY), hw="lohan-rtx4090", policy="zero-infinity", batch=B, seq=T, precision=precision,
               gpu_mem="2MB", ssds=0, lr=LR, exact_optimizer=True)
    assert res.fits
    torch.manual_seed(0)
    ex = Executor(res.to_plan(), GPT(TINY))
    data = list(batches("synthetic", B, T, TINY.vocab_size, STEPS, seed=0))
    losses = [ex.step(x, y) for x, y in data]
    torch.manual_seed(0)
    want_losses, want = train_eager(GPT(TINY), data, lr=LR, precision=precision)
    assert losses == want_losses
    got = ex.parameters()
    assert [n for n in want if not torch.equal(got[n], want[n])] == []


def test_the_papers_13b_at_batch_64_plans_on_the_rtx_4090():
    """LoHan and Fuyou train GPT-3 13B at batch 64 (seq 1024) on a 24 GB RTX 4090; with the plain
    head its fp32 logits alone are 13 GB and no plan fits (LoHan Fig. 10b, Fuyou Fig. 5c)."""
    res = plan("gpt3-13b", hw="lohan-rtx4090", policy="lohan", batch=64)
    assert res.fits, res.over_capacity()



def test_small_batches_keep_the_plain_head():
    """Below FUSE_FROM_CHUNKS chunks of tokens the plain head is traced (its logits are small):
    the fused one's ops appear only from there on."""
    from tensorstow.ir.models import FUSE_FROM_CHUNKS
    from tensorstow.ir.trace import trace

    def ops(batch):
        return {str(n.target) for n in trace(GPT(TINY), batch=batch, seq=T, precision="fp32",
                                             model_name="tiny").gm.graph.nodes}
    assert TINY.loss_chunk * FUSE_FROM_CHUNKS == B * T
    assert "aten.logsumexp.default" in ops(B) and "aten._log_softmax.default" not in ops(B)
    assert "aten._log_softmax.default" in ops(1) and "aten.logsumexp.default" not in ops(1)
