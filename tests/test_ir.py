"""IR invariants on real traces of small models."""
import json

import pytest
import torch

from tensorstow import TensorstowError
from tensorstow.ir.graph import Graph
from tensorstow.ir.models import GPT, PRESETS, gpt_param_count, resolve_model
from tensorstow.ir.trace import trace, trace_spec
from tests.conftest import traced_tiny


def roots(g, kind):
    return [t for t in g.tensors if t.kind == kind and t.storage == t.name]


def test_every_consumer_after_its_producer(tiny):
    _, tr = tiny
    g = tr.graph
    assert [op.index for op in g.ops] == list(range(len(g.ops)))
    for t in g.tensors:
        if t.producer is not None:
            assert all(c > t.producer for c in t.consumers), t.name
        for c in t.consumers:
            assert t.name in g.ops[c].inputs
    for op in g.ops:
        for name in op.inputs:
            assert op.index in g.tensor(name).consumers


def test_phases_in_execution_order(tiny):
    _, tr = tiny
    phases = [op.phase for op in tr.graph.ops]
    assert phases == sorted(phases, key=["fwd", "bwd", "opt"].index)


@pytest.mark.parametrize("precision,elt,master", [("fp32", 4, 0), ("fp16-mixed", 2, 4), ("bf16-mixed", 2, 4)])
def test_model_state_bytes_add_up(precision, elt, master):
    model, tr = traced_tiny(precision)
    g = tr.graph
    P = sum(p.numel() for p in model.parameters())
    assert g.param_count() == P
    by_kind = {}
    for t in g.tensors:
        if t.storage == t.name:
            by_kind[t.kind] = by_kind.get(t.kind, 0) + t.nbytes
    # P16 (LoHan Table II: 2P) for the weights autocast casts; the ones it reads in fp32 (layer
    # norms, embeddings) keep 4 bytes, and so do their gradients
    fp32 = 0 if elt == 4 else sum(q.numel() for n, q in model.named_parameters()
                                  if n.startswith(("wte", "wpe")) or ".ln_" in n or n.startswith("ln_f"))
    assert by_kind["parameter"] == elt * P + (4 - elt) * fp32
    assert by_kind["gradient"] == elt * P + (4 - elt) * fp32
    assert by_kind["optimizer_state"] == (master + 8) * P  # P32 4P + OS32 8P
    assert {t.dtype for t in roots(g, "saved_activation")} <= {g.compute_dtype, "float32", "int64", "bool", "uint8"}


def test_saved_activation_bytes_match_autograd_saved_tensors(tiny):
    model, tr = tiny
    ir_bytes = sum(t.nbytes for t in roots(tr.graph, "saved_activation"))
    idx = torch.randint(0, model.vocab_size, (2, 32))
    tgt = torch.randint(0, model.vocab_size, (2, 32))
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()}
    excluded |= {idx.untyped_storage().data_ptr(), tgt.untyped_storage().data_ptr()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in excluded:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, tgt)
    assert ir_bytes == sum(saved.values()) > 0
    assert len(roots(tr.graph, "saved_activation")) == len(saved)


def test_blocks_and_similarity(tiny):
    _, tr = tiny
    g = tr.graph
    assert [b.name for b in g.blocks] == ["pre", "b0", "b1", "b2", "b3", "post"]
    # each block's forward and backward ops are contiguous runs; backward visits blocks in reverse
    fwd = [op.block for op in g.ops if op.phase == "fwd"]
    bwd = [op.block for op in g.ops if op.phase == "bwd"]
    dedup = lambda xs: [x for i, x in enumerate(xs) if i == 0 or xs[i - 1] != x]
    assert dedup(fwd) == ["pre", "b0", "b1", "b2", "b3", "post"]
    assert dedup(bwd) == ["post", "b3", "b2", "b1", "b0", "pre"]
    sigs = {b.name: b.signature for b in g.blocks}
    assert sigs["b1"] == sigs["b2"] == sigs["b3"]
    assert len({sigs["pre"], sigs["b1"], sigs["post"]}) == 3
    # a layer's matmul FLOPs: 24·B·T·d² forward (qkv, proj, fc, proj) plus attention
    B, T, d = 2, 32, 64
    mm = sum(op.flops for op in g.ops if op.block == "b1" and op.phase == "fwd" and "addmm" in op.target)
    assert mm == 2 * B * T * (3 * d * d + d * d + 8 * d * d)


def test_json_round_trip_and_determinism(tiny):
    _, tr = tiny
    g = tr.graph
    text = json.dumps(g.to_json(), sort_keys=True)
    g2 = Graph.from_json(json.loads(text))
    assert g2 == g
    assert json.dumps(g2.to_json(), sort_keys=True) == text
    again = trace(GPT(PRESETS["gpt-tiny"]), batch=2, seq=32, model_name="gpt-tiny").graph
    assert again.fingerprint() == g.fingerprint()


def test_replicated_preset_matches_analytic_param_count():
    spec = resolve_model("gpt3-175b")
    g = trace_spec(spec, batch=1, precision="fp16-mixed").graph
    assert g.traced_layers == 3
    assert len(g.layer_blocks()) == 96
    assert g.param_count() == gpt_param_count(PRESETS["gpt3-175b"]) == 175_209_234_432
    assert {b.profile for b in g.layer_blocks()[1:-1]} == {"b1"}


def test_user_factory_models():
    g = trace_spec(resolve_model("tests.fixtures.user_models:mlp_stack"), batch=2).graph
    assert [b.name for b in g.blocks] == ["pre", "b0", "b1", "b2", "b3", "post"]
    assert g.block("b1").signature == g.block("b2").signature  # identical middle layers share a profile
    flat = trace_spec(resolve_model("tests.fixtures.user_models:flat"), batch=2).graph
    assert [b.name for b in flat.blocks] == ["b0"]
    with pytest.raises(TensorstowError, match="not an nn.Module"):
        trace_spec(resolve_model("tests.fixtures.user_models:not_a_model"), batch=1)
    with pytest.raises(TensorstowError, match="unknown model"):
        resolve_model("gpt-nonexistent")
    with pytest.raises(TensorstowError, match="cannot import"):
        resolve_model("no_such_pkg.mod:fn")


def test_attention_flops_count_grouped_query_heads():
    """torch 2.11 rejects grouped-query shapes in its sdpa flop counter; tensorstow counts them
    itself, so a LLaMA-family plan neither fails (planner) nor counts its attention as free (trace)."""
    from tensorstow.ir.graph import attention_flops
    B, H, KV, T, S, D, Dv = 2, 8, 2, 16, 24, 32, 16
    q, k, v = (B, H, T, D), (B, KV, S, D), (B, KV, S, Dv)
    assert attention_flops(q, k, v) == 2 * B * H * T * S * (D + Dv)  # q k^T, then p v
    assert attention_flops(q, k, v, backward=True) == 2 * B * H * T * S * (3 * D + 2 * Dv)
    with pytest.raises(ValueError, match="incompatible"):
        attention_flops((B, 5, T, D), k, v)  # 5 query heads cannot share 2 key/value heads evenly
    g = trace_spec(resolve_model("tests.fixtures.user_models:grouped_query_attention"), batch=2, seq=16).graph
    fwd = [op for op in g.ops if "scaled_dot_product" in op.target and op.phase == "fwd"]
    bwd = [op for op in g.ops if "scaled_dot_product" in op.target and op.phase == "bwd"]
    assert len(fwd) == len(bwd) == 3
    heads, hd = 4, 8  # the fixture: 4 query heads of 8 over 2 key/value heads
    assert {op.flops for op in fwd} == {2 * 2 * heads * 16 * 16 * (hd + hd)}
    assert {op.flops for op in bwd} == {2 * 2 * heads * 16 * 16 * (3 * hd + 2 * hd)}


def test_a_torch_too_old_to_trace_gets_one_clear_error(monkeypatch):
    """torch 2.8 and older lack the switch that traces the backward outside autocast: every trace
    failed with an AttributeError from deep inside torch; it now names the torch to install."""
    from torch._functorch import config as functorch_config
    monkeypatch.delattr(functorch_config, "backward_pass_autocast")
    with pytest.raises(TensorstowError, match=r"install torch>=2\.10,<2\.15"):
        traced_tiny()


def test_a_model_built_from_a_reference_is_traced_once_a_process_until_its_source_changes(tmp_path, monkeypatch):
    """`ir.kept`: a preset's or an `hf:` directory's trace is kept for the process and given again
    for the same inputs; an edited config.json, a weight file written again, another shape or
    precision trace anew, and a factory (whose code may read anything) is traced every time."""
    import transformers

    import tensorstow.ir.trace as tr
    from tensorstow.ir.kept import forget
    forget()
    calls = []
    real = tr.trace
    monkeypatch.setattr(tr, "trace", lambda *a, **k: calls.append(k["model_name"]) or real(*a, **k))
    d = tmp_path / "llama"
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    ref = f"hf:{d}"
    first = trace_spec(resolve_model(ref), batch=2, seq=16)
    assert trace_spec(resolve_model(ref), batch=2, seq=16) is first and calls == [ref]
    assert trace_spec(resolve_model(ref), batch=2, seq=16, precision="bf16-mixed") is not first
    assert trace_spec(resolve_model(ref), batch=1, seq=16) is not first and len(calls) == 3

    cfg.intermediate_size = 96  # the same directory, another model: config.json alone edited
    cfg.save_pretrained(d)
    wider = trace_spec(resolve_model(ref), batch=2, seq=16)
    assert wider.graph.fingerprint() != first.graph.fingerprint() and len(calls) == 4
    forget()
    assert trace_spec(resolve_model(ref), batch=2, seq=16).graph.fingerprint() == wider.graph.fingerprint()
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)  # weights to match, for the executor

    kept = trace_spec(resolve_model(ref), batch=2, seq=16)
    weights = next(d.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())  # written again: its modification time moves on
    import os
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    assert trace_spec(resolve_model(ref), batch=2, seq=16) is not kept

    import tensorstow
    planned = tensorstow.plan(ref, batch=2, seq=16, precision="fp32", hw="lohan-rtx4090").to_plan()
    n = len(calls)
    runs = [tensorstow.Executor(planned, ref) for _ in range(2)]  # the executor traces the model it builds
    assert len(calls) == n + 1
    for ex in runs:
        ex.close()
    from tensorstow.cli import main
    path = tmp_path / "plan.json"
    path.write_text(planned.dumps())
    for _ in range(2):  # `tensorstow execute` builds the model as the executor above did: the same trace
        assert main(["execute", str(path), "--steps", "1", "--hw-mismatch", "ok"]) == 0
    assert len(calls) == n + 1

    assert trace_spec(resolve_model("gpt-tiny"), batch=2, seq=32) is trace_spec(resolve_model("gpt-tiny"), batch=2, seq=32)
    n = len(calls)
    factory = resolve_model("tests.fixtures.user_models:flat")
    assert trace_spec(factory, batch=2) is not trace_spec(factory, batch=2) and len(calls) == n + 2
    forget()
