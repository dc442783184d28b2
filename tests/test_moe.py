"""Mixture-of-experts models (transformers' Mixtral and Qwen3-MoE, tiny configs written with
`save_pretrained`: nothing downloaded) plan offloaded and train through the executor exactly as
eager Hugging Face training does.

transformers runs the experts through `aten::_grouped_mm` (its `grouped_mm` experts path): the
token-rows of every expert in one call, the group sizes data. The trace runs the same op
(`ir.trace.grouped_mm_any_dtype` infers its shape for the dtypes the CPU kernel takes), prices it
on its static total of token-rows (`ir.graph.grouped_mm_flops`), and the executor runs the very
kernel eager runs: losses and weights bit-identical (one torch thread, as tests/test_real_models.py
explains). Where the config turns the router's load-balancing loss on, it is part of the loss
(`ir.hf.CausalLM`), as the model's own forward adds it to a loss with labels.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")

from tensorstow.ir.graph import grouped_mm_flops  # noqa: E402
from tensorstow.ir.models import resolve_model  # noqa: E402
from tensorstow.ir.trace import trace  # noqa: E402
from tests import test_real_models as real  # noqa: E402
from tests.test_real_models import VOCAB, offloaded_plans, run_executor, one_thread  # noqa: E402,F401

FAMILIES = {
    "mixtral": ("MixtralConfig", dict(vocab_size=VOCAB, max_position_embeddings=64, hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(vocab_size=VOCAB, max_position_embeddings=64, hidden_size=32,
                                         intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                                         num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])),
}

_SMALL = dict(vocab_size=VOCAB, max_position_embeddings=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2)
OTHER_FAMILIES = {
    # shared experts beside the routed ones
    "qwen2_moe": ("Qwen2MoeConfig", dict(_SMALL, intermediate_size=64, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    "olmoe": ("OlmoeConfig", dict(_SMALL, intermediate_size=16, num_experts=8, num_experts_per_tok=2)),
    # multi-head latent attention, a shared expert, the first layer dense, grouped top-k routing
    "deepseek_v3": ("DeepseekV3Config", dict(_SMALL, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
                                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                             n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                                             qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4)),
    # attention sinks, sliding and full attention layers
    "gpt_oss": ("GptOssConfig", dict(_SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                                     sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "granitemoe": ("GraniteMoeConfig", dict(_SMALL, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
}


def moe_ref(family: str, root, **overrides) -> str:
    cls, kw = {**FAMILIES, **OTHER_FAMILIES}[family]
    d = root / (family + "".join(f"-{k}" for k in overrides))
    getattr(transformers, cls)(**{**kw, **overrides}).save_pretrained(d)
    return f"hf:{d}"


def moe_loss(model, x, y):
    """What the Hugging Face model computes as its training loss: the next tokens' cross-entropy,
    plus `router_aux_loss_coef` x its load-balancing loss where the config outputs router logits."""
    out = model(input_ids=x, output_router_logits=model.config.output_router_logits)
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())
    return ce + model.config.router_aux_loss_coef * out.aux_loss if model.config.output_router_logits else ce


def eager(ref: str, precision="fp32"):
    return real.hf_eager(ref, precision, loss_fn=moe_loss)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("aux", [False, True], ids=["ce", "router-aux-loss"])
def test_moe_trains_exactly_like_eager_hf(family, aux, tmp_path):
    ref = moe_ref(family, tmp_path, **({"output_router_logits": True, "router_aux_loss_coef": 0.02} if aux else {}))
    plans = offloaded_plans(ref)  # lohan and zero-infinity, below the all-resident peak
    want = eager(ref)
    for name, pj in plans.items():
        assert any(b["home"] == "ssd" for b in pj["buffers"].values())
        real.assert_equal(run_executor(pj, resolve_model(ref).build, tmp_path / name), want, prefix="model.")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_bf16_mixed_and_ilp_plans_train_like_eager_autocast(family, tmp_path):
    """bf16-mixed (the experts' grouped matmuls run in fp32, as transformers casts their input to
    the weight's dtype and autocast leaves the op alone) under an ILP plan: equal to eager autocast."""
    ref = moe_ref(family, tmp_path)
    pj = offloaded_plans(ref, policies=("ilp",), precision="bf16-mixed")["ilp"]
    got, want = run_executor(pj, resolve_model(ref).build, tmp_path / "s"), eager(ref, "bf16-mixed")
    assert [abs(a - b) / b for a, b in zip(got[0], want[0])] == [0.0, 0.0, 0.0]
    assert all(torch.equal(got[1]["model." + n], p) for n, p in want[1].items())


def test_the_experts_are_priced_on_their_static_token_rows(tmp_path):
    """Every token-row meets one expert whatever the routing: the experts' matmuls count
    batch x seq x top-k rows, forward and backward (2 M K N flops each, `grouped_mm_flops`)."""
    ref = moe_ref("mixtral", tmp_path)
    model = resolve_model(ref).build()
    graph = trace(model, batch=2, seq=16, precision="fp32", model_name=ref).graph
    cfg = FAMILIES["mixtral"][1]
    rows, h, i = 2 * 16 * cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["intermediate_size"]
    experts = [o for o in graph.ops if o.target == "aten._grouped_mm.default"]
    per_layer_fwd = 2 * rows * h * (2 * i) + 2 * rows * i * h  # gate and up together, then down
    assert sum(o.flops for o in experts if o.phase == "fwd") == cfg["num_hidden_layers"] * per_layer_fwd
    # the backward: each forward matmul's input gradient and weight gradient, as many flops each
    assert sum(o.flops for o in experts if o.phase == "bwd") == 2 * cfg["num_hidden_layers"] * per_layer_fwd
    assert grouped_mm_flops((64, 32), (4, 32, 128)) == 2 * 64 * 32 * 128
    assert grouped_mm_flops((32, 64), (64, 128)) == 2 * 32 * 64 * 128
    with pytest.raises(ValueError):
        grouped_mm_flops((4,), (4, 4))


def test_a_grouped_matmul_without_grouped_curves_runs_at_the_rate_of_one_experts_share(tmp_path):
    """Balanced routing gives each of E experts 1/E of the rows: where the GPU has no grouped
    curves (a preset), the op is priced at the measured matmul rate of flops / E (forward and both
    gradients), not at the rate of its total."""
    import dataclasses

    from tensorstow.planner.cost import expert_groups, ir_op_time
    from tensorstow.planner.presets import load_hardware
    ref = moe_ref("mixtral", tmp_path)
    graph = trace(resolve_model(ref).build(), batch=2, seq=16, precision="fp32", model_name=ref).graph
    tensors = {t.name: t for t in graph.tensors}
    experts = [o for o in graph.ops if o.target == "aten._grouped_mm.default"]
    e = FAMILIES["mixtral"][1]["num_local_experts"]  # 3 layers: 2 matmuls forward, each with 2 gradients
    assert len(experts) == 3 * 6 and {expert_groups(o, tensors) for o in experts} == {e}
    assert {expert_groups(o, tensors) for o in graph.ops if o.target == "aten.mm.default"} == {1}
    hw = load_hardware("lohan-rtx4090")
    # a measured curve whose rate grows 10x over 9 decades of size, as a GPU's does: log-log
    # interpolation gives rate(f) = 1e10 (f / 1e3)^(1/9)
    gpu = dataclasses.replace(hw.gpus[0], matmul_rates_fp32=((1e3, 1e10), (1e12, 1e11)))
    hw = dataclasses.replace(hw, gpus=(gpu, *hw.gpus[1:]))
    for o in experts:
        want = o.flops / (1e10 * (o.flops / e / 1e3) ** (1 / 9)) + gpu.op_s
        assert ir_op_time(o, tensors, hw) == pytest.approx(want, rel=1e-9)


def test_a_grouped_matmul_runs_at_its_layouts_rate_at_its_rows_per_expert(tmp_path):
    """Where the probe measured grouped curves (the CPU device tier), a grouped matmul runs at the
    rate of its layout at the rows balanced routing gives each expert (batch x seq x top-k / E):
    the forward and the input gradient (2-D x 3-D) at `grouped_mm_rates`, the weight gradient
    (2-D x 2-D, the rows contracted) at `grouped_mm_wgrad_rates`, which a CPU runs far slower at
    few rows (benchmarks/RESULTS.md "A mixture of experts from SSD")."""
    import dataclasses

    from tensorstow.planner.cost import grouped_layout, ir_op_time
    from tensorstow.planner.presets import load_hardware
    ref = moe_ref("mixtral", tmp_path)
    graph = trace(resolve_model(ref).build(), batch=2, seq=16, precision="fp32", model_name=ref).graph
    tensors = {t.name: t for t in graph.tensors}
    experts = [o for o in graph.ops if o.target == "aten._grouped_mm.default"]
    cfg = FAMILIES["mixtral"][1]
    rows = 2 * 16 * cfg["num_experts_per_tok"] / cfg["num_local_experts"]
    hw = load_hardware("lohan-rtx4090")
    # rates growing 4x and 16x from 1 to 256 rows: log-log interpolation gives r^(1/4) and r^(1/2)
    gpu = dataclasses.replace(hw.gpus[0], matmul_rates_fp32=((1e3, 1e13),), grouped_mm_rates_fp32=((1, 1e9), (256, 4e9)),
                              grouped_mm_wgrad_rates_fp32=((1, 1e8), (256, 1.6e9)))
    hw = dataclasses.replace(hw, gpus=(gpu, *hw.gpus[1:]))
    layouts = [grouped_layout(o, tensors) for o in experts]
    assert sorted(k for k, _ in layouts) == ["grouped_mm"] * 12 + ["grouped_mm_wgrad"] * 6  # 3 layers: 2 forward, 2 input and 2 weight gradients
    assert {r for _, r in layouts} == {rows}
    for o, (kind, _) in zip(experts, layouts):
        rate = 1e9 * rows ** 0.25 if kind == "grouped_mm" else 1e8 * rows ** 0.5
        assert ir_op_time(o, tensors, hw) == pytest.approx(o.flops / rate + gpu.op_s, rel=1e-9)


@pytest.mark.parametrize("aux", [False, True], ids=["ce", "router-aux-loss"])
def test_a_hugging_face_head_runs_fused_from_four_chunks_and_trains_like_eager(aux, tmp_path, monkeypatch):
    """From FUSE_FROM_CHUNKS chunks of tokens a step on, a plain bias-free head runs fused and
    chunked (`ir.head.fused_head_loss`; here 8-token chunks, 32 tokens a step): the loss equals the
    plain head's up to rounding, and the executor trains it bit for bit as eager runs the same
    wrapper; a head whose output the model transforms (Gemma 2's soft-capping) stays plain."""
    from tensorstow.ir.hf import CausalLM, _plain_head
    monkeypatch.setattr(CausalLM, "loss_chunk", 8)
    ref = moe_ref("qwen3_moe", tmp_path, **({"output_router_logits": True, "router_aux_loss_coef": 0.02} if aux else {}))
    model = resolve_model(ref).build()
    assert _plain_head(model.model)
    x, y = real.data()[0]
    with torch.no_grad():
        fused = model(x, y)
        plain = moe_loss(model.model, x, y)
    assert torch.allclose(fused, plain, rtol=1e-5)
    graph = trace(model, batch=2, seq=16, precision="fp32", model_name=ref).graph
    assert not any(o.target.startswith("aten._log_softmax") for o in graph.ops)  # no whole-vocab softmax
    pj = offloaded_plans(ref, policies=("lohan",))["lohan"]
    got = run_executor(pj, resolve_model(ref).build, tmp_path / "s")
    torch.manual_seed(0)
    want = real.run_eager(resolve_model(ref).build(), lambda m, x, y: m(x, y))
    real.assert_equal(got, want)
    gemma2 = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    assert not _plain_head(transformers.AutoModelForCausalLM.from_config(gemma2))


def test_a_plan_records_the_parameters_a_token_meets_and_show_says_so(tmp_path, capsys):
    """`model.active_params`: all parameters but the share of the experts a token's top-k leaves
    alone (Mixtral's tiny config: 4 experts, top-2, so half of the experts' weights); a dense
    model's plan leaves the key out (the golden plans are unchanged)."""
    from tensorstow.cli import main
    ref = moe_ref("mixtral", tmp_path)
    model = resolve_model(ref).build()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    out = tmp_path / "p.json"
    assert main(["plan", ref, "--batch", "2", "--seq", "16", "--gpu-mem", "400KB", "--policy", "lohan",
                 "-o", str(out)]) == 0
    m = json.loads(out.read_text())["model"]
    assert (m["params"], m["active_params"]) == (total, total - experts // 2)
    assert f"({(total - experts // 2) / 1e9:.3g}B active a token)" in capsys.readouterr().out
    dense = Path(__file__).resolve().parents[1] / "plans" / "gpt-tiny__lohan-rtx4090__lohan.json"
    assert "active_params" not in json.loads(dense.read_text())["model"]


def test_routing_the_trace_cannot_follow_is_one_line_naming_the_models_line(capsys):
    """A mixture of experts that branches on its routing (`if (top == i).any():`) cannot be one static
    schedule: one error line naming the model's file:line and the fix, exit 2, no traceback."""
    from tensorstow.cli import main
    import tests.fixtures.routed_branch as model_file
    assert main(["plan", "tests.fixtures.routed_branch:routed_branch", "--hw", "lohan-rtx4090", "--batch", "2",
                 "--seq", "8", "--gpu-mem", "1MB"]) == 2
    err = capsys.readouterr().err
    line = next(k for k, text in enumerate(open(model_file.__file__).read().splitlines(), 1) if "if (top == i).any()" in text)
    assert err.count("\n") == 1 and err.startswith("tensorstow: error: ") and "Traceback" not in err
    assert f"routed_branch.py:{line}: forward reads a tensor's value" in err and "torch.where" in err


def test_lora_on_a_mixture_of_experts_trains_its_attention_adapters_like_eager_peft(tmp_path):
    """PEFT LoRA on a Mixtral base (adapters on q_proj and v_proj): only the adapters train,
    bit for bit as eager PEFT training; the frozen experts and router stay as they were."""
    pytest.importorskip("peft", reason="peft is not installed")
    from tests.fixtures import real_models
    ref = "tests.fixtures.real_models:lora_mixtral"
    torch.manual_seed(0)
    initial = {n: p.detach().clone() for n, p in real_models.lora_mixtral().named_parameters()}
    trainable = {n for n, p in real_models.lora_mixtral().named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    torch.manual_seed(0)
    want = real.run_eager(real_models.lora_mixtral(), moe_loss)
    for name, pj in offloaded_plans(ref).items():
        got = run_executor(pj, real_models.lora_mixtral, tmp_path / name)
        real.assert_equal(got, want, prefix="model.")
        frozen = [n for n in set(initial) - trainable if "experts" in n or "gate" in n]
        assert frozen and all(torch.equal(got[1]["model." + n], initial[n]) for n in frozen)


def test_lora_on_the_experts_own_weights_trains_like_eager_peft_and_exports_its_adapter(tmp_path):
    """PEFT LoRA on the experts' weights themselves (`target_parameters`, each expert its own pair)
    beside q_proj: bit for bit as eager PEFT training, the frozen base unchanged (and the model
    object keeps its parameters through the trace, which PEFT's parametrization under the trace's
    swapped-in tensors took away); `--lora ...,parameters=...` plans it from an `hf:` checkpoint with
    weights (each of the experts' parameters a PEFT wrapper, nested: `experts.base_layer.base_layer.
    down_proj` is the checkpoint's `experts.down_proj`), the exported adapter loads with
    `PeftModel.from_pretrained`, every tensor matched, and `export --merge` equals PEFT's
    `merge_and_unload` of it."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    from safetensors.torch import load_file
    from tensorstow.cli import main
    from tensorstow.ir.trace import trace
    from tests.fixtures import real_models
    ref = "tests.fixtures.real_models:lora_mixtral_experts"
    model = real_models.lora_mixtral_experts()
    names = {n for n, _ in model.named_parameters()}
    trace(model, batch=2, seq=16, model_name=ref)
    assert {n for n, _ in model.named_parameters()} == names
    torch.manual_seed(0)
    initial = {n: p.detach().clone() for n, p in real_models.lora_mixtral_experts().named_parameters()}
    trainable = {n for n, p in real_models.lora_mixtral_experts().named_parameters() if p.requires_grad}
    assert any(".experts.lora_" in n for n in trainable) and all("lora_" in n for n in trainable)
    torch.manual_seed(0)
    want = real.run_eager(real_models.lora_mixtral_experts(), moe_loss)
    for name, pj in offloaded_plans(ref).items():
        got = run_executor(pj, real_models.lora_mixtral_experts, tmp_path / name)
        real.assert_equal(got, want, prefix="model.")
        assert all(torch.equal(got[1]["model." + n], initial[n]) for n in set(initial) - trainable)
    hf = tmp_path / "mixtral"
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**FAMILIES["mixtral"][1])).save_pretrained(hf)
    hf = f"hf:{hf}"
    plan, state, out = tmp_path / "p.json", tmp_path / "s", tmp_path / "out"
    assert main(["plan", hf, "--hw", "lohan-rtx4090", "--policy", "lohan", "--batch", "2", "--seq", "16", "--gpu-mem",
                 "600KB", "--lora", "r=4,alpha=8,targets=q_proj,parameters=mlp.experts.gate_up_proj,mlp.experts.down_proj",
                 "-o", str(plan)]) == 0
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--steps", "2", "--state-dir", str(state)]) == 0
    assert main(["export", str(state), "-o", str(out)]) == 0
    assert main(["export", str(state), "-o", str(tmp_path / "merged"), "--merge"]) == 0
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf[3:]), str(out))
    saved = load_file(str(out / "adapter_model.safetensors"))
    held = peft.get_peft_model_state_dict(loaded)
    assert saved.keys() == held.keys() and any(".experts.base_layer.lora_" in k for k in saved)
    assert all(torch.equal(saved[k], held[k]) for k in saved)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    want = loaded.merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    bad = [k for k in want if not torch.equal(merged[k], want[k])]
    assert not bad, f"merged weights differ from PEFT's merge_and_unload: {bad[:4]}"


@pytest.mark.parametrize("groups", ["1", "2"], ids=["layers", "expert-groups"])
def test_a_mixture_of_experts_killed_mid_step_resumes_exactly(groups, tmp_path):
    """SIGKILL inside the third of 4 steps of a Mixtral trained from SSD (its experts one unit a
    layer, or in two groups: `--expert-groups`); the same command resumes from the last commit, and
    the exported weights equal those of the run nobody interrupted."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tensorstow.cli import main
    from tests.test_state_selfcheck import KILL_AT
    ref = moe_ref("mixtral", tmp_path)
    plan = tmp_path / "p.json"
    assert main(["plan", ref, "--hw", "lohan-rtx4090", "--policy", "lohan", "--batch", "2", "--seq", "16",
                 "--gpu-mem", "400KB", "--expert-groups", groups, "-o", str(plan)]) == 0
    per_step = len(json.loads(plan.read_text())["instructions"])

    def run(state, kill_at=None):
        args = ["execute", str(plan), "--hw-mismatch", "ok", "--steps", "4", "--state-dir", str(state)]
        if kill_at is not None:
            r = subprocess.run([sys.executable, "-c", KILL_AT, str(kill_at), *args], capture_output=True, text=True,
                               timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})  # one thread, as here
            assert r.returncode == -9, r.stderr
        assert main(args) == 0
        assert main(["export", str(state), "-o", str(state) + "-out"]) == 0
        return load_file(str(state) + "-out/model.safetensors")

    whole, resumed = run(tmp_path / "whole"), run(tmp_path / "killed", kill_at=2 * per_step + per_step // 2)
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[n], resumed[n]) for n in whole)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_checkpoint_with_experts_stored_one_by_one_streams_as_from_pretrained_loads_it(family, tmp_path):
    """transformers saves a mixture of experts' experts one tensor each (Mixtral also under its
    older module names); the executor streams each parameter from the checkpoint through the
    family's own conversion, so training starts from exactly what `from_pretrained` loads."""
    from tensorstow.ir.hf import load_streaming
    cls, kw = FAMILIES[family]
    d = tmp_path / family
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw)).save_pretrained(d)
    from safetensors import safe_open
    with safe_open(str(next(d.glob("*.safetensors"))), framework="pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # one tensor per expert in the file
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d)
    _, checkpoint = load_streaming(f"hf:{d}")
    assert all(torch.equal(checkpoint["model." + n], p.detach()) for n, p in loaded.named_parameters())
    pj = offloaded_plans(f"hf:{d}", policies=("lohan",))["lohan"]
    from tensorstow.executor.executor import Executor
    ex = Executor(pj, f"hf:{d}", state_dir=tmp_path / "s")  # the weights streamed from the checkpoint
    torch.manual_seed(real.DROPOUT_SEED)
    got = [ex.step(x, y) for x, y in real.data()], ex.parameters()
    ex.close()
    loaded.config.use_cache = False
    want = real.run_eager(loaded.train(), moe_loss)
    real.assert_equal(got, want, prefix="model.")


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_other_moe_families_train_exactly_like_eager_hf(family, tmp_path):
    """Qwen2-MoE, OLMoE, DeepSeek-V3, gpt-oss and GraniteMoE, offloaded (zero-infinity: SSD state,
    every layer recomputed, CPU AdamW): bit-identical to eager HF."""
    ref = moe_ref(family, tmp_path)
    pj = offloaded_plans(ref, policies=("zero-infinity",))["zero-infinity"]
    real.assert_equal(run_executor(pj, resolve_model(ref).build, tmp_path / "s"), eager(ref), prefix="model.")


def test_a_lora_model_runs_its_head_fused_through_its_base_model(tmp_path, monkeypatch):
    """The fused head reaches the causal LM under a PEFT (LoRA) wrapper (it asked the wrapper for a
    hidden state the wrapper does not return, and failed from four chunks a step on): equal to the
    plain head up to rounding, and trained bit for bit as eager runs the same wrapper."""
    pytest.importorskip("peft", reason="peft is not installed")
    from tensorstow.ir.hf import CausalLM
    from tests.fixtures import real_models
    monkeypatch.setattr(CausalLM, "loss_chunk", 8)
    monkeypatch.setattr(real, "_traces", {})  # not the plain head's trace another test kept of this model
    torch.manual_seed(0)
    model = CausalLM(real_models.lora_mixtral())
    x, y = real.data()[0]
    with torch.no_grad():
        assert torch.allclose(model(x, y), moe_loss(model.model, x, y), rtol=1e-5)
    ref = "tests.fixtures.real_models:lora_mixtral"
    pj = offloaded_plans(ref, policies=("lohan",))["lohan"]
    got = run_executor(pj, real_models.lora_mixtral, tmp_path / "s")
    torch.manual_seed(0)
    want = real.run_eager(CausalLM(real_models.lora_mixtral()), lambda m, x, y: m(x, y))
    real.assert_equal(got, want)


def test_tracing_works_where_torch_has_a_python_meta_kernel_for_grouped_mm_already(monkeypatch):
    """torch 2.11 registers its own Python Meta kernel for `_grouped_mm`, and registering another
    through torch.library raises there: tracing then replaces the Python kernel alone (a tiny Qwen3-MoE
    traces and its experts' grouped matmul is in the graph)."""
    real = torch.library.Library.impl

    def impl(self, name, *args, **kw):
        if "_grouped_mm" in str(name):
            raise RuntimeError("This is not allowed since there's already a kernel registered from python "
                               "overriding _grouped_mm's behavior for Meta dispatch key and aten namespace.")
        return real(self, name, *args, **kw)
    monkeypatch.setattr(torch.library.Library, "impl", impl)
    import tempfile
    from pathlib import Path
    ref = moe_ref("qwen3_moe", Path(tempfile.mkdtemp()))
    traced = trace(resolve_model(ref).build(), batch=2, seq=16, precision="fp32", model_name=ref)
    assert any(n.target is torch.ops.aten._grouped_mm.default for n in traced.gm.graph.nodes)
