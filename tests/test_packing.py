"""`--packing` without cross-contamination: examples packed best-fit decreasing into windows as TRL's
`pack_dataset(strategy="bfd")` packs them (TRL is the reference), each example from position 0,
attending only to itself and never the target of the one before. Through an offloaded packed plan,
each token's loss equals its example's own eager, unpacked loss (a Hugging Face LLaMA, rotary
positions, and GPT-2, learned absolute positions); an epoch trains like an eager loop on the same
windows."""
import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="TRL (the test extra) is the reference for packing")
datasets = pytest.importorskip("datasets")

from tensorstow import TensorstowError  # noqa: E402
from tensorstow.cli import main  # noqa: E402
from tensorstow.executor.examples import Examples, best_fit_decreasing  # noqa: E402
from tests.test_finetune import write_jsonl  # noqa: E402

SEQ, BATCH, VOCAB = 24, 2, 96


def test_windows_pack_as_trls_best_fit_decreasing():
    g = torch.Generator().manual_seed(0)
    for capacity, n in ((25, 40), (9, 30), (64, 200)):
        lengths = [int(v) for v in torch.randint(1, capacity + 1, (n,), generator=g)]
        ds = datasets.Dataset.from_dict({"input_ids": [[k] * m for k, m in enumerate(lengths)]})
        packed = trl.data_utils.pack_dataset(ds, seq_length=capacity, strategy="bfd")
        want = [[row[0]] + [b for a, b in zip(row, row[1:]) if a != b] for row in packed["input_ids"]]
        assert best_fit_decreasing(lengths, capacity) == want
        assert [sum(lengths[k] for k in w) for w in want] == [sum(s) for s in packed["seq_lengths"]]


def documents(n: int, seed: int = 0, lo: int = 3, hi: int = 14) -> list[dict]:
    """Pre-tokenized examples, the first token's label ignored as a tokenizer's <s> would be."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = [int(t) for t in torch.randint(3, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)]
        out.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return out


def test_a_packed_window_holds_each_example_from_position_0_and_ignores_its_first_label(tmp_path):
    docs = documents(9)
    ex = Examples.load(str(write_jsonl(tmp_path / "d.jsonl", docs)), SEQ, VOCAB, packing=True)
    windows = best_fit_decreasing([len(d["input_ids"]) for d in docs], SEQ + 1)
    assert ex.ids.shape == ex.positions.shape == (len(windows), SEQ + 1)
    for w, members in enumerate(windows):
        at = 0
        for k in members:
            n = len(docs[k]["input_ids"])
            assert ex.ids[w, at:at + n].tolist() == docs[k]["input_ids"]
            assert ex.positions[w, at:at + n].tolist() == list(range(n))
            assert ex.labels[w, at:at + n].tolist() == [-100] + docs[k]["input_ids"][1:]
            at += n
        assert (ex.labels[w, at:] == -100).all() and ex.positions[w, at:].tolist() == list(range(SEQ + 1 - at))
    *_, x, y, pos = next(ex.batches(BATCH, 1, seed=0, positions=True))
    assert x.shape == y.shape == pos.shape == (BATCH, SEQ)
    with pytest.raises(TensorstowError, match="positions asked of examples not packed"):
        next(Examples.load(str(tmp_path / "d.jsonl"), SEQ, VOCAB).batches(BATCH, 1, seed=0, positions=True))


def checkpoint(family: str, d):
    torch.manual_seed(1)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    else:
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def packed_plan(ckpt, tmp_path, **kw) -> str:
    plan = tmp_path / "plan.json"
    assert main(["plan", f"hf:{ckpt}", "--hw", "lohan-rtx4090", "--policy", "zero-infinity", "--precision", "fp32",
                 "--batch", str(BATCH), "--seq", str(SEQ), "--gpu-mem", "1MB", "--exact-optimizer", "--packing",
                 *[a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))], "-o", str(plan)]) == 0
    assert any(b["home"] == "ssd" for b in json.loads(plan.read_text())["buffers"].values())
    return str(plan)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_each_tokens_loss_in_a_packed_window_is_its_examples_own(family, tmp_path):
    """Through the executor's packed program, the loss of every target of a window (one target
    left in at a time) equals that token's loss in its own example run alone from position 0."""
    import tensorstow
    ckpt = checkpoint(family, tmp_path / family)
    docs = documents(6, seed=2)
    ex_data = Examples.load(str(write_jsonl(tmp_path / "d.jsonl", docs)), SEQ, VOCAB, packing=True)
    *_, x, y, pos = next(ex_data.batches(BATCH, 1, seed=0, shuffle=False, positions=True))
    assert any((p[1:] == 0).any() for p in pos)  # windows hold more than one example
    ex = tensorstow.Executor(tensorstow.Plan.load(packed_plan(ckpt, tmp_path)), f"hf:{ckpt}", state_dir=tmp_path / "s")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    windows = best_fit_decreasing([len(d["input_ids"]) for d in docs], SEQ + 1)
    checked = 0
    for r in range(BATCH):
        at = 0
        for k in windows[r]:
            ids = docs[k]["input_ids"]
            with torch.no_grad():
                alone = F.cross_entropy(model(input_ids=torch.tensor([ids])).logits[0, :-1], torch.tensor(ids[1:]),
                                        reduction="none")
            for t in range(len(ids) - 1):  # token at + t predicts at + t + 1, its example's t + 1
                if at + t >= SEQ:
                    break
                one = torch.full_like(y, -100)
                one[r, at + t] = y[r, at + t]
                assert int(y[r, at + t]) == ids[t + 1]
                got = ex.evaluate([(x, one, pos)])
                assert got == pytest.approx(float(alone[t]), rel=1e-5, abs=1e-6)
                checked += 1
            at += len(ids)
    ex.close()
    assert checked >= 20


def test_a_packed_epoch_trains_like_eager_on_the_same_windows(tmp_path):
    """`execute --epochs 1` of a packed plan (shuffled windows, state on SSD): losses and weights as an
    eager loop that feeds the same windows with their position ids (transformers masks each example
    to itself)."""
    ckpt = checkpoint("llama", tmp_path / "llama")
    docs = documents(24, seed=3)
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    plan = packed_plan(ckpt, tmp_path, lr=1e-3)
    log = tmp_path / "log.jsonl"
    assert main(["execute", plan, "--hw-mismatch", "ok", "--data", str(data), "--epochs", "1",
                 "--state-dir", str(tmp_path / "state"), "--log-json", str(log)]) == 0
    got = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    windows = Examples.load(str(data), SEQ, VOCAB, packing=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    want = []
    for *_, x, y, pos in windows.batches(BATCH, windows.steps_per_epoch(BATCH), seed=0, positions=True):
        opt.zero_grad()
        out = model(input_ids=x, position_ids=pos, use_cache=False)  # with a cache transformers would not mask
        loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert len(got) == len(want) >= 4
    assert got == pytest.approx(want, rel=1e-5)
    assert main(["export", str(tmp_path / "state"), "-o", str(tmp_path / "out")]) == 0
    out = dict(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(out[n], p.detach(), rtol=1e-5, atol=1e-6)


def test_packing_needs_a_model_that_takes_positions(capsys):
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--packing"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--packing keeps a window's documents apart" in err


def test_a_packed_run_resumed_midway_ends_as_one_uninterrupted(tmp_path):
    ckpt = checkpoint("llama", tmp_path / "llama")
    data = write_jsonl(tmp_path / "d.jsonl", documents(24, seed=4))
    plan = packed_plan(ckpt, tmp_path)
    logs = {}
    for name, runs in (("whole", ["4"]), ("resumed", ["2", "4"])):
        for steps in runs:
            assert main(["execute", plan, "--hw-mismatch", "ok", "--data", str(data), "--steps", steps,
                         "--state-dir", str(tmp_path / name), "--log-json", str(tmp_path / f"{name}.jsonl")]) == 0
        logs[name] = [json.loads(line)["loss"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert len(logs["whole"]) == 4 and logs["resumed"] == logs["whole"]
