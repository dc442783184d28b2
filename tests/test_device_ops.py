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
from tensorstow.executor.runtime import Executor
from tensorstow.ir.models import GPT, PRESETS, resolve_model
from tensorstow.ir.trace import trace
from tensorstow.planner.hardware import load_hardware
from tensorstow.planner.plan import Options, make_plan
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


def test_the_planner_counts_the_attention_recompute_of_a_gpu_backward():
    """device_ops' backward recomputes the attention forward on a GPU: the block's backward time
    includes that forward's roofline time; a probed CPU-only machine runs the CPU kernel and
    pays nothing extra."""
    import dataclasses

    from tensorstow.planner import cost
    from tensorstow.planner.plan import build_problem
    from tensorstow.planner.hardware import CPU_GPU_NAME
    hw = load_hardware("lohan-rtx4090")
    p = build_problem(Options(model="gpt-tiny", hardware="lohan-rtx4090", batch=2, seq=32), hw)
    bwd = [o for o in p.graph.ops if o.block == "b0" and o.phase == "bwd"]
    attn = next(o for o in p.graph.ops if o.block == "b0" and o.target == str(aten._scaled_dot_product_flash_attention_for_cpu.default))
    plain = sum(cost.op_time(o.flops, o.bytes_in + o.bytes_out, hw) for o in bwd)
    extra = p.profiles["b0"].bwd_time_s - plain
    assert extra >= attn.flops / hw.gpu.flops * (1 - 1e-9) and extra > 0
    cpu = dataclasses.replace(hw, gpus=(dataclasses.replace(hw.gpu, name=CPU_GPU_NAME),))
    assert cost.profiles(p.graph, cpu)["b0"].bwd_time_s == pytest.approx(
        sum(cost.op_time(o.flops, o.bytes_in + o.bytes_out, cpu) for o in bwd), rel=1e-12)
