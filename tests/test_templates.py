"""Block templates: deep models are traced as 3 layers (first, middle, last), planned from that
replicated trace, and run by the executor from the same template, each layer with its own
parameters (ir.template). Compared with eager PyTorch training of the full-depth model:
losses and parameters bit-identical (one torch thread, see test_real_models)."""
import pytest
import torch

from tensorstow import TensorstowError
from tensorstow.executor.executor import Executor
from tensorstow.ir.models import resolve_model
from tensorstow.ir.template import NotReplicable, instances
from tensorstow.ir.trace import trace, trace_spec
from tests.fixtures import real_models
from tests.test_real_models import (DROPOUT_SEED, assert_equal, assert_recomputes, data, hf_eager, hf_loss,
                                    offloaded_plans, run_eager)
from tests.test_real_models import one_thread  # noqa: F401  (autouse: one torch thread here too)

transformers = pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


def run(plan: dict, build, state_dir, mode="sync"):
    """The executor traces the model itself: from its template, as the plan says."""
    torch.manual_seed(0)
    ex = Executor(plan, build(), state_dir=state_dir, mode=mode)
    torch.manual_seed(DROPOUT_SEED)
    losses = [ex.step(x, y) for x, y in data()]
    params = ex.parameters()
    ex.close()
    return losses, params


def assert_replicated(plans: dict, layers: int) -> None:
    for pj in plans.values():
        assert (pj["model"]["traced_layers"], pj["model"]["layers"]) == (3, layers)
        assert {b["profile"] for b in pj["model"]["blocks"]} == {"pre", "b0", "b1", "b2", "post"}


def test_24_layer_user_model_trains_from_its_template_like_eager(tmp_path):
    """nanoGPT-style, 24 layers, dropout 0.1, tied head: offloaded plans that recompute (the
    dropout masks replayed per layer), in sync and overlap modes."""
    ref = "tests.fixtures.real_models:deep_nano_gpt"
    plans = offloaded_plans(ref)
    assert_replicated(plans, 24)
    assert_recomputes(plans)
    torch.manual_seed(0)
    want = run_eager(real_models.deep_nano_gpt(), lambda m, x, y: m(x, y)[1])
    for name, pj in plans.items():
        for mode in ("sync", "overlap"):
            assert_equal(run(pj, real_models.deep_nano_gpt, tmp_path / f"{name}-{mode}", mode), want)


def test_deep_hf_model_trains_from_its_template_like_eager(hf_root, tmp_path):
    cls, kw = ("LlamaConfig", dict(vocab_size=128, max_position_embeddings=64, hidden_size=32,
                                                       intermediate_size=64, num_hidden_layers=10,
                                                       num_attention_heads=4, num_key_value_heads=2))
    d = f"{hf_root}/deep-llama"
    getattr(transformers, cls)(**kw).save_pretrained(d)
    ref = f"hf:{d}"
    plans = offloaded_plans(ref, policies=("zero-infinity",))
    assert_replicated(plans, 10)
    want = hf_eager(ref)
    assert_equal(run(plans["zero-infinity"], resolve_model(ref).build, tmp_path), want, prefix="model.")


def test_deep_lora_model_trains_from_its_template_like_eager(tmp_path):
    pytest.importorskip("peft", reason="peft is not installed")
    ref = "tests.fixtures.real_models:deep_lora_llama"
    plans = offloaded_plans(ref, policies=("lohan",))
    assert_replicated(plans, 10)
    torch.manual_seed(0)
    want = run_eager(real_models.deep_lora_llama(), hf_loss)
    assert_equal(run(plans["lohan"], real_models.deep_lora_llama, tmp_path), want, prefix="model.")


def test_template_instances_name_each_layer_and_chain_its_boundaries():
    """Layer i reads what layer i-1's instance made, and its backward what layer i+1's made."""
    g = trace_spec(resolve_model("gpt-deep"), batch=1, seq=16).graph
    inst = instances(g, "h")
    assert inst.depth == 24 and g.traced_layers == 3
    assert inst.state_name("b7", "h.1.c_attn.weight") == "h.7.c_attn.weight"
    assert inst.state_name("b23", "h.2.c_attn.weight") == "h.23.c_attn.weight"
    # what b1 reads from b0's forward is, for b7, what b6 made; b23 (template b2) reads b22's
    b1_in = {n: v for n, v in inst.rename["b7"].items() if not n.startswith(tuple(_own(g, "b1")))}
    assert b1_in and all(v.endswith("@b6") or v.endswith("@b8") for v in b1_in.values())
    assert all(v.endswith("@b22") for v in inst.rename["b23"].values())
    assert not inst.rename.get("b0") and not inst.rename.get("pre")
    assert all(v.endswith("@b7") for k, v in inst.rename["b7"].items() if k in _own(g, "b1"))


def _own(g, block):
    return {t.name for t in g.tensors if t.block == block}


def test_layers_that_share_a_value_two_apart_are_traced_whole():
    """Every layer reads the first layer's output: no template can stand for them."""
    spec = resolve_model("tests.fixtures.real_models:skip_to_first")
    g = trace_spec(spec, batch=1, seq=16).graph
    assert g.traced_layers == 12
    with torch.device("meta"):
        model = spec.build()
    with pytest.raises(NotReplicable, match="reads what block b0 made"):
        from tensorstow.ir.trace import _template_view
        with _template_view(model):
            t = trace(model, batch=1, seq=16, replicate_to=12)
        instances(t.graph, t.layer_path)


def test_a_middle_layer_of_another_structure_is_traced_whole():
    g = trace_spec(resolve_model("tests.fixtures.real_models:odd_middle_layer"), batch=1, seq=16).graph
    assert g.traced_layers == 12


def test_executor_refuses_a_model_whose_layer_differs_from_the_template(tmp_path):
    ref = "tests.fixtures.real_models:deep_nano_gpt"
    pj = offloaded_plans(ref, policies=("zero-infinity",))["zero-infinity"]
    model = real_models.deep_nano_gpt()
    model.h[7].attn.heads = 2  # same parameters, another computation
    with pytest.raises(TensorstowError, match="layer 7 differs from layer 1"):
        Executor(pj, model, state_dir=tmp_path)
