"""Models nobody here wrote train through offloaded plans exactly like eager training.

Hugging Face causal LMs (`hf:DIR`, tiny configs written with `save_pretrained`), a
nanoGPT-style GPT (tied head, SDPA flash, dropout; `forward -> (logits, loss)`), a model
that keeps its causal mask as a buffer, a frozen-embedding model and a LoRA-adapted LLaMA
(PEFT) are each planned with a device budget below their all-resident peak, so the plans
offload, then trained 3 steps (fp32, AdamW) through the executor and compared with eager
training of the same model (the loss contract of `tensorstow.ir.hf` for HF models): losses
and parameters bit-identical (`torch.equal`).

The tests run torch on one thread. With two, a CPU reduction may split its work differently
between two allocations of the same data, so eager against eager-on-other-buffers can differ
in the last bit (seen for GPT-2's LayerNorm and embedding gradients in about 1 run in 6,
never with one thread); the executor runs the very aten ops eager runs, in the same order.
"""
import dataclasses
import functools
import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")

import tensorstow  # noqa: E402
from tensorstow.executor.data import batches  # noqa: E402
from tensorstow.executor.executor import Executor  # noqa: E402
from tensorstow.ir.models import resolve_model  # noqa: E402
from tensorstow.ir.trace import trace  # noqa: E402
from tensorstow.cli import main  # noqa: E402
from tensorstow.planner.presets import load_hardware
from tensorstow.schema.options import Options
from tensorstow.planner.plan import plan_problem
from tensorstow.planner.passes import schedule
from tensorstow.planner.problem import build_problem
from tensorstow.schema.schedule import BlockDecision, Decisions
from tests.fixtures import real_models  # noqa: E402
from tests.oracle import param_groups, train_eager  # noqa: E402

B, T, STEPS, LR, VOCAB = 2, 16, 3, 1e-3, 128
DROPOUT_SEED = 1234
"""Seeded right before the first step, in the executor's run and in eager's: the dropout stream."""

SMALL = dict(vocab_size=VOCAB, max_position_embeddings=64)
FAMILIES = {
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64)),
    "llama": ("LlamaConfig", dict(SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2)),
    "llama-tied": ("LlamaConfig", dict(SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # a sliding window shorter than the sequence: a real mask made before the layers, read by each
    "mistral": ("MistralConfig", dict(SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "phi": ("PhiConfig", dict(SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4)),
    # OPT's defaults otherwise: tied head, dropout 0.1, learned positions with an offset
    "opt": ("OPTConfig", dict(SMALL, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=3,
                              num_attention_heads=4)),
}

# Families beyond the list above, to show the general case works: one offloaded plan each
# (zero-infinity: SSD state, every layer recomputed, CPU AdamW).
OTHER_FAMILIES = {
    "qwen3": ("Qwen3Config", dict(SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)),
    "gemma": ("GemmaConfig", dict(SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)),
    "gemma2": ("Gemma2Config", dict(SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8)),
    "gpt_neox": ("GPTNeoXConfig", dict(SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                       num_attention_heads=4)),
    "olmo": ("OlmoConfig", dict(SMALL, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=4)),
    "gptj": ("GPTJConfig", dict(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64, rotary_dim=4)),
    # literal tensors inside forward (torch.tensor([...])) become constants of the graph
    "falcon": ("FalconConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4)),
    # ALiBi: no sequence limit in the config
    "bloom": ("BloomConfig", dict(vocab_size=VOCAB, hidden_size=32, n_layer=3, n_head=4)),
}
FAMILIES.update(OTHER_FAMILIES)
MAIN_FAMILIES = sorted(set(FAMILIES) - set(OTHER_FAMILIES))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@functools.lru_cache(maxsize=None)
def hf_ref(family: str, root: str) -> str:
    cls, kw = FAMILIES[family]
    d = f"{root}/{family}"
    getattr(transformers, cls)(**kw).save_pretrained(d)
    return f"hf:{d}"


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


def data():
    return list(batches("synthetic", B, T, VOCAB, STEPS, seed=0))


def offloaded_plans(ref: str, policies=("lohan", "zero-infinity"), precision="fp32", **options) -> dict[str, dict]:
    """The named policies' plans for a device budget below the model's all-resident peak: the
    largest of a few fractions of that peak for which every policy's plan fits (`options`: more
    plan options)."""
    hw = load_hardware("lohan-rtx4090")
    o = Options(model=ref, hardware="lohan-rtx4090", policy="all-gpu", batch=B, seq=T, precision=precision, lr=LR,
                exact_optimizer=True, **options)  # bit-identical with eager's default AdamW
    problem = build_problem(o, hw)
    resident = plan_problem(problem, "all-gpu").peak("gpu")
    for frac in (0.5, 0.65, 0.8, 0.95):
        gpu = int(resident * frac)
        p = dataclasses.replace(problem, hw=hw.with_overrides(gpu_mem=gpu),
                                options=dataclasses.replace(o, gpu_mem=gpu))
        plans = {name: plan_problem(p, name) for name in policies}
        if all(pl.fits for pl in plans.values()):
            out = {name: json.loads(pl.dumps()) for name, pl in plans.items()}
            for pj in out.values():
                assert pj["predicted"]["peak_bytes"]["gpu"] < resident
                assert any(b["home"] not in ("gpu", "") for b in pj["buffers"].values()), "the plan must offload"
            return out
    raise AssertionError(f"{ref}: no offloaded plan fits below the all-resident peak {resident}")


def run_executor(plan: dict, build, state_dir, mode="sync", **kw) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = build()
    ex = Executor(plan, model, state_dir=state_dir, mode=mode,
                  traced=traced(plan["options"]["model"], model, plan["options"]["precision"]), **kw)
    torch.manual_seed(DROPOUT_SEED)
    losses = [ex.step(x, y) for x, y in data()]
    params = ex.parameters()
    ex.close()
    return losses, params


_traces = {}


def traced(ref, model, precision="fp32"):
    """One trace of each model, shared by its plans (the executor still checks it against each
    plan's fingerprint and the model's parameters)."""
    if (ref, precision) not in _traces:
        _traces[ref, precision] = trace(model, batch=B, seq=T, precision=precision, model_name=ref)
    return _traces[ref, precision]


def run_eager(model, loss_fn, precision="fp32", make_optimizer=None) -> tuple[list[float], dict]:
    torch.manual_seed(DROPOUT_SEED)
    return train_eager(model, data(), lr=LR, loss=loss_fn, precision=precision, make_optimizer=make_optimizer)


def hf_loss(model, x, y):
    """The loss contract, on the Hugging Face model itself."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def hf_eager(ref: str, precision="fp32", loss_fn=None):
    """Eager training of the `hf:` config's model (`loss_fn`: default the loss contract's `hf_loss`)."""
    config = transformers.AutoConfig.from_pretrained(ref[3:])
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    return run_eager(model, loss_fn or hf_loss, precision)


def assert_equal(got, want, prefix=""):
    (lg, pg), (lw, pw) = got, want
    assert lg == lw, f"losses {lg} != eager {lw}"
    pw = {prefix + n: p for n, p in pw.items()}
    assert pg.keys() == pw.keys()
    bad = [n for n in pw if not torch.equal(pg[n], pw[n])]
    assert not bad, f"parameters differ from eager: {bad[:5]}"


def assert_recomputes(plans: dict[str, dict]) -> None:
    assert any(i["kind"] == "recompute" for pj in plans.values() for i in pj["instructions"])


@pytest.mark.parametrize("family", MAIN_FAMILIES)
def test_hf_family_trains_exactly_like_eager(family, hf_root, tmp_path):
    ref = hf_ref(family, hf_root)
    plans = offloaded_plans(ref)
    assert_recomputes(plans)  # zero-infinity recomputes every layer from its checkpoint
    want = hf_eager(ref)
    for name, pj in plans.items():
        got = run_executor(pj, resolve_model(ref).build, tmp_path / name)
        assert_equal(got, want, prefix="model.")


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_other_hf_families_train_exactly_like_eager(family, hf_root, tmp_path):
    ref = hf_ref(family, hf_root)
    pj = offloaded_plans(ref, policies=("zero-infinity",))["zero-infinity"]
    assert_equal(run_executor(pj, resolve_model(ref).build, tmp_path), hf_eager(ref), prefix="model.")


def test_tied_head_is_loaded_for_every_block_that_reads_it(hf_root):
    """The LM head in `post` reads the embedding owned by `pre`: every compute of post waits for
    a load of P:pre, and post's backward carries its partial gradient (T:post) to pre's."""
    pj = offloaded_plans(hf_ref("llama-tied", hf_root), policies=("zero-infinity",))["zero-infinity"]
    assert pj["model"]["profiles"]["post"]["reads"] == ["pre"]
    instrs = pj["instructions"]
    loads = {i["id"] for i in instrs if i["kind"] == "load" and i["tensor"] == "P:pre" and i["dst"] == "gpu0"}
    for c in (i for i in instrs if i["kind"] == "compute" and i["segment"].endswith(":post")):
        assert set(c["deps"]) & loads, f"{c['segment']} does not wait for P:pre"
    assert "T:post" in pj["buffers"] and any("T:post" in i.get("allocs", ()) for i in instrs)


@pytest.mark.parametrize("factory", ["nano_gpt", "nano_gpt_dropout", "nano_gpt_mask_buffer"])
def test_nanogpt_style_trains_exactly_like_eager(factory, tmp_path):
    ref = f"tests.fixtures.real_models:{factory}"
    plans = offloaded_plans(ref)
    assert_recomputes(plans)
    build = getattr(real_models, factory)
    torch.manual_seed(0)
    want = run_eager(build(), lambda m, x, y: m(x, y)[1])
    for name, pj in plans.items():
        assert_equal(run_executor(pj, build, tmp_path / name), want)



def test_nanogpt_ignore_index_leaves_padding_out_of_the_loss(tmp_path):
    """nanoGPT's `F.cross_entropy(..., ignore_index=-1)`: the executor accepts -1 targets (the
    model's own ignore index, read from its traced loss) and trains through an offloaded plan
    exactly as eager does; -100, which this loss does not ignore, is refused in one line."""
    ref = "tests.fixtures.real_models:nano_gpt"
    pj = offloaded_plans(ref, policies=("lohan",))["lohan"]
    padded = torch.arange(T) >= T - 5  # the last 5 targets of every row are padding
    steps = [(x, torch.where(padded, -1, y)) for x, y in data()]
    torch.manual_seed(0)
    model = real_models.nano_gpt()
    ex = Executor(pj, model, state_dir=tmp_path / "s", traced=traced(ref, model))
    assert ex.program.ignore_index == {-1}
    torch.manual_seed(DROPOUT_SEED)
    got = ([ex.step(x, y) for x, y in steps], ex.parameters())
    with pytest.raises(tensorstow.TensorstowError, match=r"labels its loss ignores: -1\)"):
        ex.step(steps[0][0], torch.full_like(steps[0][1], -100))
    ex.close()
    torch.manual_seed(0)
    model = real_models.nano_gpt()
    torch.manual_seed(DROPOUT_SEED)
    want = train_eager(model, steps, lr=LR, loss=lambda m, x, y: m(x, y)[1])
    assert_equal(got, want)


@pytest.mark.parametrize("decay_all", [False, True])
def test_nanogpt_configure_optimizers_groups_train_like_eager(decay_all, tmp_path):
    """Weight decay 0.1 through an offloaded plan: by default only on the parameters of two or more
    dimensions, as nanoGPT's own `configure_optimizers` groups them (biases and layer norms not
    decayed); `decay_all` on every parameter, as one torch.optim group."""
    ref = "tests.fixtures.real_models:nano_gpt"
    hw = load_hardware("lohan-rtx4090")
    o = Options(model=ref, hardware="lohan-rtx4090", policy="lohan", batch=B, seq=T, precision="fp32", lr=LR,
                weight_decay=0.1, decay_all=decay_all, exact_optimizer=True, gpu_mem=2_000_000)
    pj = json.loads(plan_problem(build_problem(o, hw.with_overrides(gpu_mem=o.gpu_mem)), "lohan").dumps())
    assert any(b["home"] not in ("gpu", "") for b in pj["buffers"].values())
    got = run_executor(pj, real_models.nano_gpt, tmp_path / "s")
    torch.manual_seed(0)
    model = real_models.nano_gpt()
    if decay_all:
        make = lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1)  # noqa: E731
    else:
        make = lambda m: real_models.configure_optimizers(m, 0.1, LR, (0.9, 0.999))  # noqa: E731
    want = run_eager(model, lambda m, x, y: m(x, y)[1], make_optimizer=make)
    assert_equal(got, want)
    torch.manual_seed(0)  # the other grouping trains differently: the groups matter
    other = run_eager(real_models.nano_gpt(), lambda m, x, y: m(x, y)[1],
                      make_optimizer=lambda m: torch.optim.AdamW(param_groups(m, 0.1, not decay_all), lr=LR))
    assert any(not torch.equal(got[1][n], other[1][n]) for n in got[1])


def test_param_groups_train_like_torch_param_groups_under_a_schedule(tmp_path):
    """`param_groups`: the first matching pattern gives a parameter its lr scale and weight decay
    (the rest follow the decay rule), as torch.optim param groups; under a cosine schedule each
    group's rate is its base rate times the schedule's factor, as LambdaLR steps it: bit-identical
    to eager through an offloaded plan. A pattern that matches nothing is one error."""
    import fnmatch

    from tensorstow.executor.lr import LRSchedule
    ref = "tests.fixtures.real_models:nano_gpt"
    groups = ("*.bias:weight_decay=0.05", "h.0.*:lr_scale=0.3", "wte.*:lr_scale=3,weight_decay=0")
    hw = load_hardware("lohan-rtx4090")
    o = Options(model=ref, hardware="lohan-rtx4090", policy="lohan", batch=B, seq=T, precision="fp32", lr=LR,
                weight_decay=0.1, param_groups=groups, exact_optimizer=True, gpu_mem=2_000_000)
    pj = json.loads(plan_problem(build_problem(o, hw.with_overrides(gpu_mem=o.gpu_mem)), "lohan").dumps())
    assert pj["options"]["param_groups"] == list(groups)
    torch.manual_seed(0)
    model = real_models.nano_gpt()
    ex = Executor(pj, model, state_dir=tmp_path / "s", traced=traced(ref, model),
                  lr_schedule=LRSchedule("cosine", LR, 0, STEPS))
    torch.manual_seed(DROPOUT_SEED)
    got = ([ex.step(x, y) for x, y in data()], ex.parameters())
    ex.close()

    def make(m):  # the same groups by hand, as a nanoGPT user writes them for torch.optim
        rules = [(pat.split(":")[0], dict(kv.split("=") for kv in pat.split(":")[1].split(","))) for pat in groups]
        by_group: dict = {}
        for n, p in m.named_parameters():
            rule = next((r for pat, r in rules if fnmatch.fnmatchcase(n, pat)), {})
            lr = LR * float(rule.get("lr_scale", 1.0))
            wd = float(rule["weight_decay"]) if "weight_decay" in rule else 0.1 if p.dim() >= 2 else 0.0
            by_group.setdefault((lr, wd), []).append(p)
        return torch.optim.AdamW([{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in by_group.items()],
                                 lr=LR)

    torch.manual_seed(0)
    model = real_models.nano_gpt()
    torch.manual_seed(DROPOUT_SEED)
    want = train_eager(model, data(), lr=LR, loss=lambda m, x, y: m(x, y)[1], make_optimizer=make,
                       scheduler=lambda opt: transformers.get_cosine_schedule_with_warmup(opt, 0, STEPS))
    assert_equal(got, want)
    bad = json.loads(json.dumps(pj))
    bad["options"]["param_groups"] = ["*.nothing:lr_scale=2"]
    with pytest.raises(tensorstow.TensorstowError, match="matches no trainable parameter"):
        Executor(bad, real_models.nano_gpt(), state_dir=tmp_path / "t")


def _frozen_state_is_read_only(pj: dict, frozen_blocks: set[str]) -> None:
    """Frozen state lives in C:<b> buffers that are only ever loaded, never stored back, and
    blocks with nothing to train have no gradient, optimizer state or update."""
    bufs = pj["buffers"]
    for b in frozen_blocks:
        assert f"C:{b}" in bufs
        assert not {f"P:{b}", f"G:{b}", f"OS:{b}", f"M:{b}"} & set(bufs), f"block {b} has training state"
    for i in pj["instructions"]:
        if i.get("tensor", "").startswith("C:"):
            assert i["kind"] in ("load", "free"), f"constant {i['tensor']} is written: {i}"
        if i["kind"] == "optimizer_step":
            assert i["segment"] not in frozen_blocks


def test_frozen_embedding_is_never_trained_or_written(tmp_path):
    ref = "tests.fixtures.real_models:frozen_embedding"
    plans = offloaded_plans(ref)
    torch.manual_seed(0)
    initial = {n: p.detach().clone() for n, p in real_models.frozen_embedding().named_parameters()}
    torch.manual_seed(0)
    want = run_eager(real_models.frozen_embedding(), lambda m, x, y: m(x, y)[1])
    for name, pj in plans.items():
        _frozen_state_is_read_only(pj, {"pre"})
        got = run_executor(pj, real_models.frozen_embedding, tmp_path / name)
        assert_equal(got, want)
        for n in ("wte.weight", "wpe.weight"):
            assert torch.equal(got[1][n], initial[n])


def test_lora_llama_trains_only_its_adapters(tmp_path):
    pytest.importorskip("peft", reason="peft is not installed")
    ref = "tests.fixtures.real_models:lora_llama"
    plans = offloaded_plans(ref)
    torch.manual_seed(0)
    base = real_models.lora_llama()
    initial = {n: p.detach().clone() for n, p in base.named_parameters()}
    trainable = {n for n, p in base.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    torch.manual_seed(0)
    want = run_eager(real_models.lora_llama(), hf_loss)
    for name, pj in plans.items():
        _frozen_state_is_read_only(pj, {"pre", "post"})  # embedding, final norm and head: all frozen
        n_trainable = sum(initial[n].numel() for n in trainable)
        assert sum(b["bytes"] for k, b in pj["buffers"].items() if k.startswith("OS:")) == 8 * n_trainable
        got = run_executor(pj, real_models.lora_llama, tmp_path / name)
        assert_equal(got, want, prefix="model.")
        for n in set(initial) - trainable:
            assert torch.equal(got[1]["model." + n], initial[n]), f"frozen {n} changed"



def test_lora_exports_as_a_peft_adapter_and_merged(tmp_path):
    """A PEFT LoRA model trained by `tensorstow execute` (SSD state) exports as its adapter, which
    `PeftModel.from_pretrained` loads onto the base with the adapters eager training gives, and
    with `--merge` as merged weights `from_pretrained` loads, equal to PEFT's merge_and_unload of
    the eager model."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    ref = "tests.fixtures.real_models:lora_llama"
    pj = offloaded_plans(ref, policies=("zero-infinity",))["zero-infinity"]
    (tmp_path / "plan.json").write_text(json.dumps(pj))
    assert main(["execute", str(tmp_path / "plan.json"), "--hw-mismatch", "ok", "--steps", str(STEPS), "--state-dir",
                 str(tmp_path / "s")]) == 0
    assert main(["export", str(tmp_path / "s"), "-o", str(tmp_path / "adapter")]) == 0
    assert main(["export", str(tmp_path / "s"), "-o", str(tmp_path / "merged"), "--merge"]) == 0
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    torch.manual_seed(0)
    eager = real_models.lora_llama()
    _, want = run_eager(eager, hf_loss)
    torch.manual_seed(0)  # the base the factory adapts, with its initial weights
    loaded = peft.PeftModel.from_pretrained(real_models.llama_base(), tmp_path / "adapter")
    got = dict(loaded.named_parameters())
    assert got.keys() == want.keys()
    bad = [n for n in want if not torch.equal(got[n].detach(), want[n])]
    assert not bad, f"the loaded adapter differs from eager: {bad[:4]}"
    merged = dict(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").named_parameters())
    reference = dict(eager.merge_and_unload().named_parameters())
    assert merged.keys() == reference.keys()
    bad = [n for n in reference if not torch.equal(merged[n].detach(), reference[n].detach())]
    assert not bad, f"merged weights differ from PEFT's merge_and_unload: {bad[:4]}"
    torch.manual_seed(0)
    initial = dict(real_models.llama_base().named_parameters())
    assert all(not torch.equal(merged[n], initial[n]) for n in merged if "q_proj" in n)  # the adapters moved them
    assert all(torch.equal(merged[n], initial[n]) for n in merged if "mlp" in n)  # frozen, not adapted
    # a state dir that does not say it holds a PEFT model: refused, never written under names
    # from_pretrained would skip (loading random weights)
    (tmp_path / "s" / "adapter_config.json").unlink()
    layout = json.loads((tmp_path / "s" / "layout.json").read_text())
    del layout["peft_adapter"]
    (tmp_path / "s" / "layout.json").write_text(json.dumps(layout))
    assert main(["export", str(tmp_path / "s"), "-o", str(tmp_path / "plain")]) == 2
    assert not (tmp_path / "plain").exists() and not (tmp_path / "plain.tmp-export").exists()

def test_python_api_with_an_hf_module(hf_root, tmp_path):
    """tensorstow.plan(module) and tensorstow.Executor(plan, module): an HF model given as a
    Python object gets the loss contract."""
    ref = hf_ref("llama", hf_root)
    config = transformers.AutoConfig.from_pretrained(ref[3:])
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    plan = tensorstow.plan(model, hw="lohan-rtx4090", policy="zero-infinity", batch=B, seq=T,
                           precision="fp32", gpu_mem=300_000, lr=LR, exact_optimizer=True)
    assert plan.fits
    ex = tensorstow.Executor(plan, model, state_dir=tmp_path)
    torch.manual_seed(DROPOUT_SEED)
    losses = [ex.step(x, y) for x, y in data()]
    params = ex.parameters()
    ex.close()
    want = hf_eager(ref)
    assert_equal((losses, params), want, prefix="model.")


@pytest.mark.parametrize("factory, says", [
    ("returns_logits", "not a scalar loss"),
    ("no_attributes", "lacks `vocab_size`/`block_size`"),
    ("data_dependent", "data-dependent control flow"),
])
def test_bad_models_fail_at_plan_time_with_one_line(factory, says, capsys):
    rc = main(["plan", f"tests.fixtures.real_models:{factory}", "--hw", "lohan-rtx4090", "--batch", "2",
               "--seq", "16", "--precision", "fp32"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert says in lines[0] and "real_models.py:" in lines[0], lines[0]


def test_data_dependent_branch_names_the_users_line(capsys):
    import inspect
    src, first = inspect.getsourcelines(real_models.DataDependent.forward)
    line = first + next(k for k, s in enumerate(src) if "if loss > 1.0" in s)
    main(["plan", "tests.fixtures.real_models:data_dependent", "--hw", "lohan-rtx4090", "--batch", "2",
          "--seq", "16", "--precision", "fp32"])
    assert f"real_models.py:{line}" in capsys.readouterr().err


def test_debug_shows_the_traceback(capsys):
    rc = main(["plan", "tests.fixtures.real_models:data_dependent", "--hw", "lohan-rtx4090", "--batch", "2",
               "--seq", "16", "--precision", "fp32", "--debug"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("tensorstow: error:")


def test_hf_dir_without_config_is_one_line(tmp_path, capsys):
    rc = main(["plan", f"hf:{tmp_path}", "--hw", "lohan-rtx4090"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "config.json" in err


def test_weights_saved_with_another_config_are_one_line_before_any_step(tmp_path, capsys):
    """A config.json edited after save_pretrained (a wider MLP) beside the old weights: execute
    refuses the first tensor whose shape differs, naming it (it trained into a traceback from the
    first segment: "shape '[2, 16, 96]' is invalid for input of size 2048")."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    d = tmp_path / "llama"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    cfg.intermediate_size = 96
    cfg.save_pretrained(d)
    plan = tmp_path / "plan.json"
    assert main(["plan", f"hf:{d}", "--batch", "2", "--seq", "16", "--hw", "lohan-rtx4090", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["execute", str(plan), "--steps", "1", "--hw-mismatch", "ok", "--state-dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tensorstow: error: model 'hf:{d}': the checkpoint's model.layers.0.mlp.down_proj.weight is (32, 64) "
                   f"where the model its config.json describes has (32, 96): the weights were saved with another "
                   f"configuration; save the model and its config.json together (save_pretrained)"]


@pytest.mark.parametrize("policy", ["all-gpu", "stronghold", "dos", "ilp"])
def test_every_policy_trains_a_tied_model_with_dropout_exactly(policy, tmp_path):
    """The tied head and the dropout stream hold under every policy's plan (all-gpu at a budget
    that holds the whole model; the others offloaded)."""
    ref = "tests.fixtures.real_models:nano_gpt_dropout"
    if policy == "all-gpu":
        o = Options(model=ref, hardware="lohan-rtx4090", policy=policy, batch=B, seq=T, precision="fp32", lr=LR,
                exact_optimizer=True)  # bit-identical with eager's default AdamW
        pj = json.loads(plan_problem(build_problem(o, load_hardware("lohan-rtx4090")), policy).dumps())
    else:
        pj = offloaded_plans(ref, policies=(policy,))[policy]
    torch.manual_seed(0)
    want = run_eager(real_models.nano_gpt_dropout(), lambda m, x, y: m(x, y)[1])
    assert_equal(run_executor(pj, real_models.nano_gpt_dropout, tmp_path), want)


def test_hf_dir_with_safetensors_weights_starts_from_them(tmp_path):
    """hf:DIR holding weights: training starts from the checkpoint, not from a fresh init, and
    equals eager training of `from_pretrained(DIR)`."""
    cls, kw = FAMILIES["llama"]
    torch.manual_seed(7)
    saved = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw))
    saved.save_pretrained(tmp_path / "ckpt")
    assert list((tmp_path / "ckpt").glob("*.safetensors"))
    ref = f"hf:{tmp_path / 'ckpt'}"
    pj = offloaded_plans(ref, policies=("zero-infinity",))["zero-infinity"]
    torch.manual_seed(0)  # a fresh init would differ from the checkpoint
    ex = Executor(pj, resolve_model(ref).build(), state_dir=tmp_path / "state")
    start = ex.parameters()
    assert all(torch.equal(start["model." + n], p) for n, p in saved.named_parameters())
    ex.close()
    eager_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    eager_model.config.use_cache = False
    eager_model.train()
    want = run_eager(eager_model, hf_loss)
    got = run_executor(pj, resolve_model(ref).build, tmp_path / "state2")
    assert_equal(got, want, prefix="model.")
    # the API given the model as the plan names it: the checkpoint streamed in, as `execute` does
    ex = Executor(pj, ref, state_dir=tmp_path / "state3")
    torch.manual_seed(DROPOUT_SEED)
    assert_equal(([ex.step(x, y) for x, y in data()], ex.parameters()), want, prefix="model.")
    ex.close()


@pytest.mark.parametrize("ref", ["llama-tied", "tests.fixtures.real_models:nano_gpt_dropout"])
def test_overlap_mode_equals_eager(ref, hf_root, tmp_path):
    """One worker per stream (each instruction waits only for its plan dependencies): the tied
    head's loads, the carried partial gradient and the replayed dropout stream hold there too."""
    ref = hf_ref(ref, hf_root) if ref in FAMILIES else ref
    plans = offloaded_plans(ref)
    if ref.startswith("hf:"):
        want, build = hf_eager(ref), resolve_model(ref).build
        prefix = "model."
    else:
        torch.manual_seed(0)
        want, build, prefix = run_eager(real_models.nano_gpt_dropout(), lambda m, x, y: m(x, y)[1]), \
            real_models.nano_gpt_dropout, ""
    for name, pj in plans.items():
        assert_equal(run_executor(pj, build, tmp_path / name, mode="overlap"), want, prefix=prefix)


def test_export_loads_with_from_pretrained_and_equals_eager(tmp_path):
    """hf:DIR from a safetensors checkpoint -> `tensorstow execute` (SSD state) -> `tensorstow
    export` -> `AutoModelForCausalLM.from_pretrained` holds what 3 eager steps give."""
    cls, kw = FAMILIES["llama-tied"]
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw)).save_pretrained(tmp_path / "ckpt")
    ref = f"hf:{tmp_path / 'ckpt'}"
    pj = offloaded_plans(ref, policies=("zero-infinity",))["zero-infinity"]
    (tmp_path / "plan.json").write_text(json.dumps(pj))
    assert main(["execute", str(tmp_path / "plan.json"), "--hw-mismatch", "ok", "--steps", str(STEPS), "--state-dir",
                 str(tmp_path / "state")]) == 0
    assert main(["export", str(tmp_path / "state"), "-o", str(tmp_path / "out")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.manual_seed(0)  # as `tensorstow execute --seed 0` before building the model
    eager_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    eager_model.config.use_cache = False
    eager_model.train()
    _, want = run_eager(eager_model, hf_loss)
    got = dict(loaded.named_parameters())
    assert got.keys() == want.keys()
    bad = [n for n in want if not torch.equal(got[n].detach(), want[n])]
    assert not bad, f"exported weights differ from eager: {bad[:4]}"


def test_hf_checkpoint_streams_into_the_tiers_and_trains_like_eager(tmp_path):
    """`tensorstow execute hf:DIR` with safetensors weights builds the model with its parameters
    on the meta device and reads each block's tensors from the checkpoint as it places the block;
    GPT-2 (dropout 0.1) then trains like `torch.manual_seed(0); from_pretrained(DIR)` eagerly, so
    the random stream is where eager leaves it too."""
    from tensorstow.ir.models import build_for_execution
    cls, kw = FAMILIES["gpt2"]
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw)).save_pretrained(tmp_path / "ckpt")
    ref = f"hf:{tmp_path / 'ckpt'}"
    model, source = build_for_execution(resolve_model(ref), seed=0)
    assert {p.device.type for p in model.parameters()} == {"meta"} and source is not None
    pj = offloaded_plans(ref, policies=("zero-infinity",))["zero-infinity"]
    (tmp_path / "plan.json").write_text(json.dumps(pj))
    assert main(["execute", str(tmp_path / "plan.json"), "--hw-mismatch", "ok", "--steps", str(STEPS), "--state-dir",
                 str(tmp_path / "state")]) == 0
    assert main(["export", str(tmp_path / "state"), "-o", str(tmp_path / "out")]) == 0
    from safetensors.torch import load_file
    got = load_file(tmp_path / "out" / "model.safetensors")
    torch.manual_seed(0)
    eager_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    eager_model.config.use_cache = False
    eager_model.train()
    _, want = train_eager(eager_model, data(), lr=LR, loss=hf_loss)
    assert set(got) <= set(want)
    bad = [n for n in got if not torch.equal(got[n], want[n])]
    assert not bad, f"differs from eager: {bad[:4]}"


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("model", ["llama-like", "hf-llama", "nano-gpt"])
def test_mixed_precision_trains_exactly_like_eager_autocast(model, precision, hf_root, tmp_path):
    """Eager AMP is the reference (tests/oracle.py: fp32 parameters, the forward under autocast
    with CUDA's op lists, torch's AdamW on the fp32 parameters, a GradScaler for fp16). The
    models: one written here that computes its rotary angles in fp32 with autocast off and its
    RMSNorm in fp32 (a whole-model 16-bit cast cannot even trace it); Hugging Face's LLaMA; a
    nanoGPT with a tied head (the embedding, read in fp32, is also cast for the head). Offloaded
    plans (lohan and zero-infinity: SSD state, recompute, CPU AdamW), bit-identical: the executor
    runs the casts autocast made, and a compute copy P16 = M.to(bf16) is the cast's value."""
    ref = {"llama-like": "tests.fixtures.real_models:llama_like", "nano-gpt": "tests.fixtures.real_models:nano_gpt",
           "hf-llama": None}[model] or hf_ref("llama", hf_root)
    plans = offloaded_plans(ref, precision=precision)
    if model == "hf-llama":
        want = hf_eager(ref, precision)
    else:
        torch.manual_seed(0)
        loss = (lambda m, x, y: m(x, y)[1]) if model == "nano-gpt" else (lambda m, x, y: m(x, y))
        want = run_eager(resolve_model(ref).build(), loss, precision)
    for name, pj in plans.items():
        got = run_executor(pj, resolve_model(ref).build, tmp_path / name)
        assert_equal(got, want, prefix="model." if model == "hf-llama" else "")


def test_frozen_weights_keep_their_fp32_values_under_mixed_precision(tmp_path):
    """A LoRA base is frozen and read through autocast's casts: it has no fp32 master, so it is
    stored as the model holds it (fp32) and cast in the graph, as eager AMP does; the trained
    model's frozen weights are the original values, bit for bit, and training equals eager AMP."""
    pytest.importorskip("peft", reason="peft is not installed")
    ref = "tests.fixtures.real_models:lora_llama"
    pj = offloaded_plans(ref, policies=("lohan",), precision="bf16-mixed")["lohan"]
    const = {n: b for n, b in pj["buffers"].items() if n.startswith("C:")}
    assert const
    torch.manual_seed(0)
    frozen = {n: p.detach().clone() for n, p in real_models.lora_llama().named_parameters() if not p.requires_grad}
    torch.manual_seed(0)
    want = run_eager(real_models.lora_llama(), hf_loss, "bf16-mixed")
    got = run_executor(pj, real_models.lora_llama, tmp_path)
    assert_equal(got, want, prefix="model.")
    assert all(torch.equal(got[1]["model." + n], frozen[n]) for n in frozen)


def _partial_swap_plan(ref: str, cut: bool = False) -> dict:
    """Every layer swapped partially (Fuyou Table 2: its FLOP-bearing ops' outputs to DRAM or SSD,
    the rest re-forwarded before its backward); the policies pick whole swaps for these tiny models.
    `cut`: every layer's backward in two parts as well (BlockDecision.bwd_cut), and every third
    layer recomputed instead of swapped."""
    o = Options(model=ref, hardware="lohan-rtx4090", policy="custom", batch=B, seq=T, precision="fp32", lr=LR,
                exact_optimizer=True)
    p = build_problem(o, load_hardware("lohan-rtx4090"))
    layers = [b for b in p.order if p.graph.block(b).kind == "layer"]
    recompute = set(layers[::3]) if cut else set()
    dec = Decisions(policy="custom", overlap_optimizer=True, blocks={b: BlockDecision(
        params="dram", states="ssd", optimizer="cpu",
        activations=("recompute" if b in recompute else "swap_dram" if i % 2 else "swap_ssd") if b in layers else "keep",
        checkpoint="dram" if b in layers else "gpu", reforward=b not in recompute,
        bwd_cut=p.profiles[p.profile_of[b]].bwd_cut if cut and b in layers else 0) for i, b in enumerate(p.order)})
    pj = json.loads(schedule(p, dec).dumps())
    assert {n for n in pj["buffers"] if n.startswith("R:")} == {f"R:{b}" for b in layers if b not in recompute}
    if cut:
        assert all(p.profiles[p.profile_of[b]].bwd_cut for b in layers)
        assert [i["segment"] for i in pj["instructions"] if i.get("segment", "").startswith("bwd1:")] == [f"bwd1:{b}" for b in layers[::-1]]
        assert any(n.startswith(("AE:", "RE:")) for n in pj["buffers"])
    return pj


def test_cut_backwards_train_exactly_like_eager(hf_root, tmp_path):
    """Each layer's backward in two parts (LoHan's layer-by-layer swapping): the first releases
    what only it reads and hands the rest over in K:<b>; on models nobody here wrote the training
    is bit-identical to eager (overlap mode: tests/test_executor.py's `cut-backward` plan)."""
    ref = hf_ref("llama", hf_root)
    assert_equal(run_executor(_partial_swap_plan(ref, cut=True), resolve_model(ref).build, tmp_path / "llama"),
                 hf_eager(ref), prefix="model.")
    ref = "tests.fixtures.real_models:nano_gpt"
    torch.manual_seed(0)
    want = run_eager(real_models.nano_gpt(), lambda m, x, y: m(x, y)[1])
    assert_equal(run_executor(_partial_swap_plan(ref, cut=True), real_models.nano_gpt, tmp_path / "nano"), want)


def test_partial_swaps_train_exactly_like_eager(hf_root, tmp_path):
    ref = hf_ref("llama", hf_root)
    assert_equal(run_executor(_partial_swap_plan(ref), resolve_model(ref).build, tmp_path / "llama"),
                 hf_eager(ref), prefix="model.")
    ref = "tests.fixtures.real_models:nano_gpt"
    torch.manual_seed(0)
    want = run_eager(real_models.nano_gpt(), lambda m, x, y: m(x, y)[1])
    assert_equal(run_executor(_partial_swap_plan(ref), real_models.nano_gpt, tmp_path / "nano"), want)
