"""A plan traced on the CPU runs on CUDA: the CPU-only ops of a trace have portable versions.

No GPU is needed to check them: the portable functions are device-agnostic, so on the CPU they
must give exactly what the CPU kernels give (they call the same kernels through
`F.scaled_dot_product_attention`), an executor forced to use them must still train exactly
like eager, and every CPU-only op in the traces of the model families tensorstow supports must
have one (the table a CUDA run needs)."""
import json

import pytest
import torch

from tensorstow import TensorstowError
from tensorstow.executor.data import batches
from tensorstow.executor.device_ops import PORTABLE, check_portable, cpu_only, sdpa_backward, sdpa_forward
from tensorstow.executor.executor import Executor
from tensorstow.ir.models import GPT, PRESETS, resolve_model
from tensorstow.ir.trace import trace
from tensorstow.planner.presets import load_hardware
from tensorstow.schema.options import Options
from tensorstow.planner.plan import make_plan
from tests.oracle import train_eager

aten = torch.ops.aten


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["causal", "mask", "scale"])
def test_portable_attention_equals_the_cpu_kernels(dtype, case):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=dtype) for _ in range(3))
    kw = {"causal": dict(is_causal=True), "mask": dict(attn_mask=torch.randn(16, 16).tril().to(dtype)),
          "scale": dict(is_causal=True, scale=0.3)}[case]
    causal = kw.pop("is_causal", False)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, **kw)
    got_out, got_lse = sdpa_forward(q, k, v, 0.0, causal, **kw, _like=(out, lse))
    assert torch.equal(got_out, out) and got_out.stride() == out.stride()
    assert got_lse.shape == lse.shape and got_lse.dtype == lse.dtype
    g = torch.randn_like(out)
    want = aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, causal, **kw)
    got = sdpa_backward(g, q, k, v, out, got_lse, 0.0, causal, **kw, _like=want)
    for a, b in zip(got, want):
        assert torch.equal(a, b) and a.stride() == b.stride()


def _traced_ops(model, precision):
    tr = trace(model, batch=2, seq=16, precision=precision, model_name="m")
    return {n.target for n in tr.gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("ref", ["gpt-tiny", "tests.fixtures.real_models:llama_like",
                                 "tests.fixtures.real_models:nano_gpt_mask_buffer", "hf-llama", "hf-gpt2"])
def test_every_cpu_only_op_of_a_trace_has_a_portable_version(ref, tmp_path):
    """The CUDA op-mapping table, checked against the ops the traces really contain."""
    if ref.startswith("hf-"):
        transformers = pytest.importorskip("transformers")
        cfg = {"hf-llama": lambda: transformers.LlamaConfig(
                   vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64),
               "hf-gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4,
                                                          n_positions=64, attn_pdrop=0.0)}[ref]()
        cfg.save_pretrained(tmp_path)
        ref = f"hf:{tmp_path}"
    ops = set()
    for precision in ("fp32", "bf16-mixed"):
        torch.manual_seed(0)
        ops |= _traced_ops(resolve_model(ref).build(), precision)
    cpu = {op for op in ops if cpu_only(op)}
    assert cpu <= set(PORTABLE), f"no portable version of {cpu - set(PORTABLE)}"
    if "mask_buffer" not in ref:
        assert aten._scaled_dot_product_flash_attention_for_cpu.default in cpu  # the table is exercised


def test_an_executor_running_the_portable_ops_trains_exactly_like_eager(tmp_path):
    """What a CUDA executor runs for attention, forced on the CPU: same losses and parameters
    as eager autocast, bit for bit (offloaded plan, recomputed layers)."""
    B, T, lr = 2, 32, 1e-3
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="zero-infinity", batch=B, seq=T,
                precision="bf16-mixed", lr=lr, exact_optimizer=True)
    plan = json.loads(make_plan(o, load_hardware(o.hardware)).dumps())
    data = list(batches("synthetic", B, T, PRESETS["gpt-tiny"].vocab_size, 3, seed=0))
    torch.manual_seed(0)
    want = train_eager(GPT(PRESETS["gpt-tiny"]), data, lr=lr, precision="bf16-mixed")
    torch.manual_seed(0)
    ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), state_dir=tmp_path)
    ex.joint.targets = dict(PORTABLE)
    losses = [ex.step(x, y) for x, y in data]
    assert losses == want[0]
    got = ex.parameters()
    assert all(torch.equal(got[n], want[1][n]) for n in want[1])


def test_attention_dropout_traces_to_portable_ops_and_the_guard_refuses_the_cpu_kernels_dropout():
    """With dropout, CPU attention decomposes into portable ops (math + native_dropout, whose
    generator state the executor replays), so a CUDA run accepts the graph; a CPU flash kernel
    with dropout (no PyTorch version here emits one) would be refused before any step."""
    torch.manual_seed(0)
    tr = trace(resolve_model("tests.fixtures.real_models:nano_gpt_dropout").build(), batch=2, seq=16,
               precision="bf16-mixed", model_name="m")
    targets = {n.target for n in tr.gm.graph.nodes if n.op == "call_function"}
    assert aten.native_dropout.default in targets and not any(cpu_only(t) for t in targets)
    check_portable(tr.gm, torch.device("cuda"))
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TensorstowError, match="attention dropout"):
        sdpa_forward(q, q, q, 0.1, True)


@pytest.mark.parametrize("precision, recompute", [("fp32", True), ("bf16-mixed", False)])
def test_the_planner_counts_the_attention_recompute_of_a_gpu_backward(precision, recompute):
    """device_ops' backward recomputes the attention forward on a GPU unless flash's backward runs
    it (16-bit, no mask): the block's backward time includes that forward's roofline time where it
    recomputes and nothing where it does not; a probed CPU-only machine runs the CPU kernel and
    pays nothing extra."""
    import dataclasses

    from tensorstow.planner import cost
    from tensorstow.planner.problem import build_problem
    from tensorstow.schema.hardware import CPU_GPU_NAME
    hw = load_hardware("lohan-rtx4090")
    p = build_problem(Options(model="gpt-tiny", hardware="lohan-rtx4090", batch=2, seq=32, precision=precision), hw)
    b = next(o.block for o in p.graph.ops if o.target == str(aten._scaled_dot_product_flash_attention_for_cpu.default))
    bwd = [o for o in p.graph.ops if o.block == b and o.phase == "bwd"]
    attn = next(o for o in p.graph.ops if o.block == b and o.target == str(aten._scaled_dot_product_flash_attention_for_cpu.default))
    tensors = {t.name: t for t in p.graph.tensors}

    def plain(machine):
        return sum(cost.op_time(o.flops, o.bytes_in + o.bytes_out, machine, fp32=cost._in_fp32(o, tensors))
                   for o in bwd)

    extra = p.profiles[b].bwd_time_s - plain(hw)
    if recompute:
        assert extra >= attn.flops / hw.gpu.flops * (1 - 1e-9) and extra > 0
    else:
        assert extra == pytest.approx(0, abs=1e-15)
        # the same attention with a mask (the op's seventh tensor) is not flash's: it recomputes
        op = next(o for o in bwd if o.target == cost._CPU_FLASH_BWD)
        masked = dataclasses.replace(op, inputs=(*op.inputs, op.inputs[5]))
        assert cost._attention_recompute_time(masked, tensors, hw) > 0
    cpu = dataclasses.replace(hw, gpus=(dataclasses.replace(hw.gpu, name=CPU_GPU_NAME),))
    assert cost.profiles(p.graph, cpu)[b].bwd_time_s == pytest.approx(plain(cpu), rel=1e-12)


def _as_trace(shape, dtype, device):
    """Query/key/value laid out as attention sees them: (B, H, T, D) views of (B, T, H, D)."""
    B, H, T, D = shape
    return torch.empty(B, T, H, D, dtype=dtype, device=device).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_the_flash_calls_give_what_the_cpu_kernels_give_in_shape_and_layout(dtype, causal):
    """The CUDA flash path's calls (argument order, the placeholders for dropout's RNG state),
    run on meta tensors: the output, log-sum-exp and gradients have the CPU kernels' shapes,
    dtypes and strides, so the trace's buffers and views fit them."""
    from tensorstow.executor.device_ops import flash_backward, flash_forward
    shape = (2, 4, 16, 8)
    q, k, v = (_as_trace(shape, dtype, "cpu").normal_() for _ in range(3))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(torch.randn_like(out), q, k, v, out, lse, 0.0, causal)
    mq, mk, mv = (_as_trace(shape, dtype, "meta") for _ in range(3))
    m_out, m_lse = flash_forward(mq, mk, mv, causal, None)
    assert (m_out.shape, m_out.stride(), m_out.dtype) == (out.shape, out.stride(), out.dtype)
    assert (m_lse.shape, m_lse.dtype) == (lse.shape, lse.dtype)
    m_grads = flash_backward(torch.empty_like(m_out), mq, mk, mv, m_out, m_lse, causal, 0.3)
    assert [(g.shape, g.stride(), g.dtype) for g in m_grads] == [(g.shape, g.stride(), g.dtype) for g in grads]


def test_flash_runs_exactly_the_attention_pytorch_hands_to_its_flash_kernels():
    from tensorstow.ir.graph import flash_eligible
    q = (2, 4, 16, 64)
    assert flash_eligible({torch.bfloat16}, q, q, q, masked=False)
    assert flash_eligible({"float16"}, q, q, q, masked=False)  # the IR's dtype names
    assert not flash_eligible({torch.float32}, q, q, q, masked=False)
    assert not flash_eligible({torch.bfloat16}, q, q, q, masked=True)
    assert not flash_eligible({torch.bfloat16, torch.float16}, q, q, q, masked=False)
    assert not flash_eligible({torch.bfloat16}, q, (2, 2, 16, 64), (2, 2, 16, 64), masked=False)  # grouped KV heads
    assert not flash_eligible({torch.bfloat16}, (2, 4, 16, 12), (2, 4, 16, 12), (2, 4, 16, 12), masked=False)
    assert not flash_eligible({torch.bfloat16}, (2, 4, 16, 512), (2, 4, 16, 512), (2, 4, 16, 512), masked=False)
    assert not flash_eligible({torch.bfloat16}, q, (2, 4, 32, 64), (2, 4, 32, 64), masked=False)  # T != S
    cpu = torch.zeros(2, 4, 16, 64, dtype=torch.bfloat16)
    from tensorstow.executor import device_ops
    assert not device_ops._flash(cpu, cpu, cpu, None)  # the CPU runs its own kernel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the flash kernels are CUDA's)")
@pytest.mark.parametrize("causal", [True, False])
def test_portable_attention_on_cuda_equals_eager_autograd(causal):
    """On a GPU, bf16: the portable forward and backward (flash's kernels where eligible, the
    recompute otherwise) give what eager `F.scaled_dot_product_attention` and autograd give."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    for shape in ((2, 4, 64, 64), (2, 4, 64, 12)):  # eligible; a head size flash does not take
        q, k, v = (_as_trace(shape, torch.bfloat16, "cuda").normal_() for _ in range(3))
        g = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        ql, kl, vl = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        want_out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)
        want = torch.autograd.grad(want_out, (ql, kl, vl), g)
        with torch.inference_mode():
            out, lse = sdpa_forward(q, k, v, 0.0, causal)
            got = sdpa_backward(g, q, k, v, out, lse, 0.0, causal)
        torch.testing.assert_close(out, want_out.detach(), rtol=1e-2, atol=1e-2)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
