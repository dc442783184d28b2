"""QLoRA: LoRA adapters on a base stored 4-bit (`--quantize nf4|fp4`), quantized from the
full-precision checkpoint as it is read, kept and moved quantized, dequantized by bitsandbytes'
kernel inside the step. The reference is eager PEFT on transformers' bitsandbytes base
(`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=..., bnb_4bit_compute_dtype=fp32)`)
on the CPU: the same codes and scales, the same dequantization, the same losses and adapters."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes", reason="bitsandbytes (the qlora extra) quantizes the base")

import tensorstow  # noqa: E402
from tensorstow import TensorstowError  # noqa: E402
from tensorstow.cli import main  # noqa: E402
from tests.test_finetune import pretrained  # noqa: E402

SEQ, BATCH, STEPS, LR = 16, 2, 3, 1e-2
LORA = "r=4,alpha=8,targets=q_proj,v_proj"


def batches(vocab: int):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(3, vocab, (BATCH, SEQ), generator=g), torch.randint(3, vocab, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def quantize_args(quant: str) -> list[str]:
    """The plan flags of a test id: "fp4,skip=down_proj" is `--quantize fp4 --quantize-skip down_proj`."""
    kind = ",".join(p for p in quant.split(",") if not p.startswith("skip="))
    skip = [p[len("skip="):] for p in quant.split(",") if p.startswith("skip=")]
    return ["--quantize", kind, *(["--quantize-skip", ",".join(skip)] if skip else [])]


def eager_qlora(ckpt, quant: str, data, precision: str = "fp32"):
    """Eager PEFT on transformers' bitsandbytes 4-bit base: losses and the trained adapters; bf16-mixed
    under autocast with CUDA's op lists (`ir.autocast.gpu_autocast`), as tensorstow traces it."""
    kind, *parts = quant.split(",")
    skip = ["lm_head"] + [p[len("skip="):] for p in parts if p.startswith("skip=")]  # --quantize-skip, in the test's ids
    if kind == "int8":
        cfg = transformers.BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    else:
        cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind,
                                              bnb_4bit_compute_dtype=torch.float32,
                                              bnb_4bit_use_double_quant="double" in parts, llm_int8_skip_modules=skip)
    return eager_peft(ckpt, data, precision, quantization_config=cfg)


def eager_peft(ckpt, data, precision: str = "fp32", **load):
    """The eager LoRA loop on `from_pretrained(ckpt, **load)`: its losses and trained adapters."""
    import contextlib

    from tensorstow.ir.autocast import gpu_autocast
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, device_map="cpu", **load)
    model.config.use_cache = False
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       task_type="CAUSAL_LM"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0, foreach=False)
    losses = []
    for x, y in data:
        opt.zero_grad()
        with gpu_autocast(torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext():
            loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("quant, precision", [("nf4", "fp32"), ("fp4", "fp32"), ("nf4", "bf16-mixed"),
                                              ("nf4,double", "fp32"), ("fp4,skip=down_proj", "fp32"), ("int8", "fp32"),
                                              ("int8", "bf16-mixed")])
def test_qlora_trains_like_eager_peft_on_a_bitsandbytes_base(quant, precision, tmp_path):
    ckpt = tmp_path / "ckpt"
    tok = pretrained(ckpt)
    plan = tmp_path / "plan.json"
    assert main(["plan", f"hf:{ckpt}", "--hw", "lohan-rtx4090", "--policy", "zero-infinity", "--precision", precision,
                 "--batch", str(BATCH), "--seq", str(SEQ), "--gpu-mem", "1MB", "--lr", str(LR), "--weight-decay", "0",
                 "--exact-optimizer", "--lora", LORA, *quantize_args(quant), "-o", str(plan)]) == 0
    pj = json.loads(plan.read_text())
    assert any(b["home"] == "ssd" for b in pj["buffers"].values())
    # the base is stored quantized: each linear weight of the layers as 4-bit codes and its scales (fp32,
    # or 8-bit with their own scales, code table and mean under double quantization), the rest as it was
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    state = {**dict(base.named_parameters()), **dict(base.named_buffers())}
    linear = {n for n in state if ".layers." in n and n.endswith("proj.weight")
              and not ("skip=down_proj" in quant and "down_proj" in n)}

    def stored(n: int, rows: int) -> int:
        if quant == "int8":  # int8 codes, an fp32 scale a row
            return n + rows * 4
        blocks = n // 64
        scales = blocks + -(-blocks // 256) * 4 + 256 * 4 + 4 if "double" in quant else blocks * 4
        return n // 2 + scales
    want_bytes = sum(stored(state[n].numel(), state[n].shape[0]) if n in linear else state[n].nbytes for n in state)
    assert sum(b["bytes"] for k, b in pj["buffers"].items() if k.startswith("C:")) == want_bytes
    # the plan counts the frozen base by its weights' shapes, beside the adapters it trains
    assert pj["model"]["frozen_params"] == sum(p.numel() for p in base.parameters())
    members = [m for k, b in pj["buffers"].items() if k.startswith("C:") for m in b["members"]]
    assert sum(m.endswith(".weight_scb" if quant == "int8" else ".weight_absmax") for m in members) == len(linear)
    data = batches(len(tok))
    ex = tensorstow.Executor(tensorstow.Plan.load(plan), f"hf:{ckpt}", state_dir=tmp_path / "s")
    losses = [ex.step(x, y) for x, y in data]
    got = ex.parameters()
    ex.close()
    want_losses, want = eager_qlora(ckpt, quant, data, precision)
    assert set(want) == {n[len("model."):] for n in got if "lora_" in n}
    if precision == "bf16-mixed":  # 16-bit matmuls: within 1% of eager autocast
        assert losses == pytest.approx(want_losses, rel=0.01)
        return
    assert losses == pytest.approx(want_losses, rel=1e-5)
    for n, p in want.items():
        torch.testing.assert_close(got["model." + n], p, rtol=1e-4, atol=1e-6)
    if quant != "nf4":
        return
    # the same base homed in DRAM (no SSD on the machine): the same training
    dram = tmp_path / "dram.json"
    assert main(["plan", f"hf:{ckpt}", "--hw", "lohan-rtx4090", "--policy", "zero-infinity", "--precision", precision,
                 "--batch", str(BATCH), "--seq", str(SEQ), "--gpu-mem", "1MB", "--ssds", "0", "--lr", str(LR),
                 "--weight-decay", "0", "--exact-optimizer", "--lora", LORA, "--quantize", quant, "-o", str(dram)]) == 0
    homes = {b["home"] for k, b in json.loads(dram.read_text())["buffers"].items() if k.startswith("C:")}
    assert homes == {"dram"}
    ex = tensorstow.Executor(tensorstow.Plan.load(dram), f"hf:{ckpt}")
    assert [ex.step(x, y) for x, y in data] == pytest.approx(want_losses, rel=1e-5)
    ex.close()


def test_quantize_needs_lora_a_known_format_and_bitsandbytes(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    pretrained(ckpt)
    capsys.readouterr()
    for args, says in ((["--quantize", "nf4"], "--quantize nf4: a quantized base is frozen"),
                       (["--lora", LORA, "--quantize", "int3"], "--quantize int3: give one of nf4, fp4, int8"),
                       (["--lora", LORA, "--quantize", "int8,double"], "the only part after the format is ',double'"),
                       (["--lora", LORA, "--quantize-skip", "o_proj"], "--quantize-skip o_proj: it names layers")):
        assert main(["plan", f"hf:{ckpt}", "--hw", "lohan-rtx4090", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err
    with pytest.raises(TensorstowError, match="a quantized base is frozen"):
        tensorstow.plan(f"hf:{ckpt}", hw="lohan-rtx4090", quantize="nf4")
    with pytest.raises(TensorstowError, match="quantize: a model object is traced as it is"):
        tensorstow.plan(transformers.AutoModelForCausalLM.from_pretrained(ckpt), hw="lohan-rtx4090", quantize="nf4")
    for module in ("bitsandbytes", "bitsandbytes.functional"):  # as on a machine without the qlora extra
        monkeypatch.setitem(sys.modules, module, None)
    capsys.readouterr()
    assert main(["plan", f"hf:{ckpt}", "--hw", "lohan-rtx4090", "--lora", LORA, "--quantize", "nf4"]) == 2
    assert capsys.readouterr().err == "tensorstow: error: --quantize needs bitsandbytes (pip install 'tensorstow[qlora]')\n"


def test_the_lm_head_stays_full_precision_whatever_its_name():
    """The output embeddings (`get_output_embeddings()`, whatever the family names them) are left in
    full precision, as transformers leaves them; every other linear layer is quantized."""
    from tensorstow.ir.quant import QuantLinear, Quantization, quantize_linears

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.mix, self.decoder = (torch.nn.Linear(64, 64), torch.nn.Linear(64, 128),
                                                 torch.nn.Linear(128, 96))

        def get_output_embeddings(self):
            return self.decoder
    model = Decoder()
    quantize_linears(model, Quantization.parse("nf4"))
    assert type(model.decoder) is torch.nn.Linear
    assert isinstance(model.proj, QuantLinear) and isinstance(model.mix, QuantLinear)


def test_a_qlora_state_dir_exports_its_adapter_and_merged_full_precision_weights(tmp_path):
    """The adapter loads with `PeftModel.from_pretrained` onto transformers' 4-bit base; `--merge`
    writes full-precision weights: each base weight dequantized, its LoRA pair merged (what
    `merge_and_unload` of the dequantized base gives)."""
    import bitsandbytes.functional as bnb_f
    ckpt = tmp_path / "ckpt"
    pretrained(ckpt)
    plan = tmp_path / "plan.json"
    assert main(["plan", f"hf:{ckpt}", "--hw", "lohan-rtx4090", "--policy", "zero-infinity", "--precision", "fp32",
                 "--batch", str(BATCH), "--seq", str(SEQ), "--gpu-mem", "1MB", "--lr", str(LR), "--weight-decay", "0",
                 "--exact-optimizer", "--lora", LORA, "--quantize", "nf4", "-o", str(plan)]) == 0
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--steps", "2", "--state-dir", str(tmp_path / "s")]) == 0
    assert main(["export", str(tmp_path / "s"), "-o", str(tmp_path / "adapter")]) == 0
    # in a process of its own, as a user runs it: nothing of the step's imports is there
    r = subprocess.run([sys.executable, "-m", "tensorstow.cli", "export", str(tmp_path / "s"), "-o",
                        str(tmp_path / "merged"), "--merge"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    cfg = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=cfg, device_map="cpu")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert len(lora) == 2 * 2 * 3 and all(not torch.equal(p, torch.zeros_like(p)) for n, p in lora.items() if "lora_B" in n)
    merged = dict(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").named_parameters())
    full = dict(transformers.AutoModelForCausalLM.from_pretrained(ckpt).named_parameters())
    assert merged.keys() == full.keys()
    for n, w in full.items():
        module = n[:-len(".weight")]
        if ".layers." in n and n.endswith("proj.weight"):
            codes, state = bnb_f.quantize_4bit(w.detach(), blocksize=64, quant_type="nf4")
            want = bnb_f.dequantize_4bit(codes, state)
            key = f"base_model.model.{module}"
            if f"{key}.lora_A.default.weight" in lora:
                want = want + lora[f"{key}.lora_B.default.weight"] @ lora[f"{key}.lora_A.default.weight"] * 2.0
        else:
            want = w
        torch.testing.assert_close(merged[n], want.detach(), rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("quant", ["nf4", "nf4,double", "int8"])
def test_a_checkpoint_saved_quantized_loads_as_saved(quant, tmp_path):
    """A checkpoint transformers saved from a bitsandbytes 4-bit model (codes, scales and quant state
    per weight) streams as it is stored: the same codes and scales, training like eager PEFT on
    that checkpoint loaded by `from_pretrained`; a plan quantized otherwise is refused in one line."""
    ckpt, saved = tmp_path / "ckpt", tmp_path / "saved"
    pretrained(ckpt)
    cfg = (transformers.BitsAndBytesConfig(load_in_8bit=True) if quant == "int8" else
           transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                                           bnb_4bit_use_double_quant="double" in quant))
    transformers.AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=cfg, device_map="cpu").save_pretrained(saved)
    plan = tmp_path / "plan.json"
    assert main(["plan", f"hf:{saved}", "--hw", "lohan-rtx4090", "--policy", "zero-infinity", "--precision", "fp32",
                 "--batch", str(BATCH), "--seq", str(SEQ), "--gpu-mem", "1MB", "--lr", str(LR), "--weight-decay", "0",
                 "--exact-optimizer", "--lora", LORA, "--quantize", quant, "-o", str(plan)]) == 0
    vocab = transformers.AutoConfig.from_pretrained(saved).vocab_size
    data = batches(vocab)
    ex = tensorstow.Executor(tensorstow.Plan.load(plan), f"hf:{saved}", state_dir=tmp_path / "s")
    losses = [ex.step(x, y) for x, y in data]
    got = ex.parameters()
    ex.close()
    want, adapters = eager_peft(saved, data)  # transformers reads the quantization from the checkpoint's config
    assert losses == pytest.approx(want, rel=1e-5)
    for n, p in adapters.items():
        torch.testing.assert_close(got["model." + n], p, rtol=1e-4, atol=1e-6)
    # merged: the stored base dequantized plus the deltas, a full-precision checkpoint
    assert main(["export", str(tmp_path / "s"), "-o", str(tmp_path / "merged"), "--merge"]) == 0
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    other = tmp_path / "other.json"
    assert main(["plan", f"hf:{saved}", "--hw", "lohan-rtx4090", "--policy", "zero-infinity", "--precision", "fp32",
                 "--batch", str(BATCH), "--seq", str(SEQ), "--gpu-mem", "1MB", "--lora", LORA, "--quantize", "fp4",
                 "-o", str(other)]) == 0
    kind = quant.split(",")[0]
    with pytest.raises(TensorstowError, match=rf"stores model\.layers\.\d+\..* as {kind}.*plan it with --quantize {kind}"):
        tensorstow.Executor(tensorstow.Plan.load(other), f"hf:{saved}", state_dir=tmp_path / "s2")
    plain = tmp_path / "plain.json"  # no --quantize: the stored codes are no full-precision weight
    assert main(["plan", f"hf:{saved}", "--hw", "lohan-rtx4090", "--policy", "zero-infinity", "--precision", "fp32",
                 "--batch", str(BATCH), "--seq", str(SEQ), "--gpu-mem", "1MB", "--lora", LORA, "-o", str(plain)]) == 0
    with pytest.raises(TensorstowError, match=r"stores model\.layers\.\d+\..* quantized, where the plan keeps"):
        tensorstow.Executor(tensorstow.Plan.load(plain), f"hf:{saved}", state_dir=tmp_path / "s3")


def test_fit_finds_the_largest_model_this_machine_can_qlora(monkeypatch, capsys):
    """`fit --lora ... --quantize nf4` walks LLaMA-shaped models (here a ladder of small ones): on a
    machine with little DRAM and no SSD, a 4-bit base fits a larger model than a full-precision one."""
    from tensorstow.planner import report
    monkeypatch.setattr(report, "LLAMA_LADDER", {
        "llama-s": (128, 2, 256, 4, 4), "llama-m": (256, 4, 512, 4, 4), "llama-l": (512, 4, 1024, 8, 8),
        "llama-xl": (768, 6, 2048, 12, 12)})
    found = {}
    for quantize in ([], ["--quantize", "nf4"]):
        assert main(["fit", "--hw", "lohan-rtx4090", "--gpu-mem", "400MB", "--dram", "150MB", "--ssds", "0",
                     "--seq", "64", "--policy", "lohan", "--lora", "r=4,targets=q_proj,v_proj", *quantize]) == 0
        row = capsys.readouterr().out.splitlines()[-1].split()
        found[bool(quantize)] = row[1]
    ladder = list(report.LLAMA_LADDER)
    assert found[False] in ladder and found[True] in ladder
    assert ladder.index(found[True]) > ladder.index(found[False])


def test_a_4bit_base_dequantizes_at_the_probed_rate(tmp_path):
    """`GPU.dequant_rate` (`tensorstow probe` times bitsandbytes' `dequantize_4bit`): each weight of
    the base the step dequantizes takes its weights over that rate (on a CPU core 0.33 G weights/s,
    7x below what `elementwise_bw` gives its bytes), the block's forward with it; a spec without
    the rate prices the op by its bytes, as before. The rate travels in the spec, is left out at
    0, and processes that share the device split it."""
    import dataclasses
    import math

    from tensorstow.planner import cost
    from tensorstow.planner.presets import load_hardware
    from tensorstow.planner.problem import build_problem
    from tensorstow.schema.hardware import Hardware
    from tensorstow.schema.options import Options
    ckpt = tmp_path / "ckpt"
    pretrained(ckpt)
    o = Options(model=f"hf:{ckpt}", hardware="lohan-rtx4090", batch=BATCH, seq=SEQ, precision="fp32", lora=LORA,
                quantize="nf4")
    hw = load_hardware("lohan-rtx4090")
    rated = dataclasses.replace(hw, gpus=(dataclasses.replace(hw.gpus[0], dequant_rate=3e5),))
    assert "dequant_rate" not in hw.to_json()["gpus"][0] and Hardware.from_json(rated.to_json()) == rated
    assert rated.gpus[0].shared_by(2).dequant_rate == 1.5e5
    plain, probed = build_problem(o, hw), build_problem(o, rated)
    tensors = {t.name: t for t in plain.graph.tensors}
    dequants = [op for op in plain.graph.ops if op.target.startswith(cost.DEQUANT_4BIT)]
    assert len(dequants) == 3 * 7  # every projection of every layer, once in the forward
    g = rated.gpus[0]
    extra = 0.0
    for op in dequants:
        weights = math.prod(tensors[op.outputs[0]].shape)
        assert cost.ir_op_time(op, tensors, rated) == pytest.approx(weights / 3e5 + g.op_s)
        assert cost.ir_op_time(op, tensors, hw) == cost.op_time(0, op.bytes_in + op.bytes_out, hw)
        if op.block == "b1":
            extra += cost.ir_op_time(op, tensors, rated) - cost.ir_op_time(op, tensors, hw)
    b1 = (plain.profiles[plain.profile_of["b1"]], probed.profiles[probed.profile_of["b1"]])
    assert b1[1].fwd_time_s - b1[0].fwd_time_s == pytest.approx(extra) and extra > 0


def test_the_probe_times_the_dequantizations_it_prices():
    """The CPU tier's `dequant_rate` is timed in place: the op timer with `dequant` counts the 4-bit
    dequantizations dispatched under it, and the weights they make, and nothing else."""
    from tensorstow import calibrate
    from tensorstow.ir import quant
    parts = quant.quantized_parts(torch.randn(64, 128), quant.Quantization("nf4"))
    x = torch.randn(4, 128)
    with calibrate._op_timer(dequant=True) as t:
        (x @ quant.dequantized(parts, "nf4").t()).relu().sum()
    assert t.weights == 64 * 128 and t.seconds > 0
    assert t.bytes == parts["weight"].nbytes + parts["weight_absmax"].nbytes + 64 * 128 * 4
