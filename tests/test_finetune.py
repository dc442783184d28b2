"""Fine-tuning data: examples with labels (JSONL, a `datasets` directory), tokenized with a real
tokenizer trained here, padded or packed, epochs in a reproducible shuffled order; and a pretrained
tiny LLaMA fine-tuned from prompt/completion pairs through an offloaded plan by `tensorstow
execute`, killed and resumed, exported, equal to an eager Hugging Face loop with the same
semantics."""
import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tensorstow import TensorstowError  # noqa: E402
from tensorstow.cli import main  # noqa: E402
from tensorstow.executor.examples import Examples  # noqa: E402
from tensorstow.ir.autocast import gpu_autocast  # noqa: E402
from tests.oracle import param_groups  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the cat sat on a mat while a dog ran to the park and the bird sang over the quiet green hill "
         "under a warm sun").split()


def make_tokenizer(path: Path):
    """A byte-level BPE of 200 tokens trained on a few sentences, with <s>, </s> and <pad>, saved
    as a transformers tokenizer that adds <s> in front (as LLaMA's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers, decoders
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def pairs(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        w = [WORDS[int(i)] for i in torch.randint(len(WORDS), (int(torch.randint(2, 9, (1,), generator=g)),),
                                                 generator=g)]
        k = max(1, len(w) // 2)
        out.append({"prompt": " ".join(w[:k]) + ":", "completion": " " + " ".join(w[k:])})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_prompt_completion_is_tokenized_with_the_prompt_left_out_of_the_labels(tok, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "the cat sat:", "completion": " on a mat"}])
    ex = Examples.load(str(data), seq=15, vocab=len(tok), tokenizer=tok)
    prompt = tok("the cat sat:")["input_ids"]
    completion = tok(" on a mat", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(prompt) + len(completion)
    assert prompt[0] == tok.bos_token_id and n <= 16
    assert ex.ids[0, :n].tolist() == prompt + completion
    assert ex.labels[0, :n].tolist() == [-100] * len(prompt) + completion
    assert ex.ids[0, n:].tolist() == [tok.pad_token_id] * (16 - n) and set(ex.labels[0, n:].tolist()) == {-100}
    _, _, x, y = next(ex.batches(1, 1, seed=0))
    assert x[0].tolist() == ex.ids[0, :-1].tolist() and y[0].tolist() == ex.labels[0, 1:].tolist()


def test_text_and_pretokenized_examples_truncate_and_pack(tok, tmp_path):
    text = "the cat sat on a mat while a dog ran to the park"
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": text}, {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}])
    ex = Examples.load(str(data), seq=4, vocab=len(tok), tokenizer=tok)
    assert ex.ids[0].tolist() == ids[:5] and ex.labels[0].tolist() == ids[:5]  # truncated to seq + 1
    assert ex.ids[1].tolist()[:3] == [5, 6, 7] and ex.labels[1].tolist() == [-100, 6, 7, -100, -100]
    packed = Examples.load(str(data), seq=4, vocab=len(tok), tokenizer=tok, packing=True)
    # windows of seq + 1: the text cut to 5 tokens fills one, the 3 ids open another (padded); each
    # example's first label ignored, positions from 0 (tests/test_packing.py: TRL's packing order)
    assert packed.ids.tolist() == [ids[:5], [5, 6, 7, tok.pad_token_id, tok.pad_token_id]]
    assert packed.labels.tolist() == [[-100] + ids[1:5], [-100, 6, 7, -100, -100]]
    assert packed.positions.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]


def test_a_datasets_directory_reads_like_its_jsonl(tok, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = pairs(6)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    a = Examples.load(str(tmp_path / "ds"), seq=12, vocab=len(tok), tokenizer=tok)
    b = Examples.load(str(write_jsonl(tmp_path / "d.jsonl", rows)), seq=12, vocab=len(tok), tokenizer=tok)
    assert (a.ids == b.ids).all() and (a.labels == b.labels).all()


def test_epochs_visit_every_example_once_in_a_seeded_order_and_resume_in_place(tok, tmp_path):
    ex = Examples.load(str(write_jsonl(tmp_path / "d.jsonl", pairs(11))), seq=8, vocab=len(tok), tokenizer=tok)
    rows, steps = 2, 3 * (11 // 2)  # three epochs of 5 steps (the 11th example is dropped each epoch)
    run = list(ex.batches(rows, steps, seed=7))
    for e in range(3):
        order = torch.randperm(11, generator=torch.Generator().manual_seed(7 + e))
        seen = [x for (ep, _, x, _) in run if ep == e]
        assert torch.equal(torch.cat(seen), torch.from_numpy(ex.ids[order[:10].numpy(), :-1]))
    resumed = list(ex.batches(rows, steps, seed=7, start=8))
    assert all(a[:2] == b[:2] and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]) for a, b in zip(run[8:], resumed))
    assert [k for (_, k, _, _) in run[:5]] == [0, 2, 4, 6, 8]
    in_order = list(ex.batches(rows, 5, seed=7, shuffle=False))
    assert torch.equal(torch.cat([x for (_, _, x, _) in in_order]), torch.from_numpy(ex.ids[:10, :-1]))


def test_bad_examples_name_the_line(tok, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "oops"\n')
    with pytest.raises(TensorstowError, match=r"bad.jsonl:2: not a JSON object"):
        Examples.load(str(bad), seq=8, vocab=len(tok), tokenizer=tok)
    with pytest.raises(TensorstowError, match="give input_ids"):
        Examples.load(str(write_jsonl(tmp_path / "k.jsonl", [{"question": "a"}])), seq=8, vocab=len(tok), tokenizer=tok)
    with pytest.raises(TensorstowError, match="pass --tokenizer"):
        Examples.load(str(write_jsonl(tmp_path / "t.jsonl", [{"text": "a"}])), seq=8, vocab=len(tok))
    with pytest.raises(TensorstowError, match="outside the model's vocabulary"):
        Examples.load(str(write_jsonl(tmp_path / "v.jsonl", [{"input_ids": [1, 999]}])), seq=8, vocab=len(tok))


# ---- a whole fine-tune, against eager Hugging Face ---------------------------------------------

SEQ, BATCH, EPOCHS, LR, WD, WARMUP = 24, 2, 2, 3e-3, 0.1, 2


def encode(tok, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's completion-only encoding, right-padded to SEQ + 1: (ids, labels)."""
    enc = []
    for r in rows:
        p = tok(r["prompt"])["input_ids"]
        c = tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids, labels = (p + c)[:SEQ + 1], ([-100] * len(p) + c)[:SEQ + 1]
        enc.append((ids + [tok.pad_token_id] * (SEQ + 1 - len(ids)), labels + [-100] * (SEQ + 1 - len(labels))))
    return torch.tensor([e[0] for e in enc]), torch.tensor([e[1] for e in enc])


def eager_finetune(ckpt: Path, tok, rows: list[dict], steps_per_epoch: int, precision: str = "fp32", accum: int = 1,
                   max_grad_norm: float | None = None, held_out: list[dict] = (), eval_at=(), lora: dict | None = None,
                   encoded: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The semantics `tensorstow execute` documents, written out for eager Hugging Face: the same
    tokens and labels, each epoch in randperm(seed + epoch) order, AdamW with decay on the 2-D
    parameters, warmup + cosine as transformers schedules it, HF's loss (the mean over labels
    that are not -100); with `accum` K, each step's BATCH x K rows as K microbatches, each one's
    loss weighted by its share of the step's labels (the Trainer's num_items_in_batch), clipped to
    `max_grad_norm`; after the steps `eval_at` the eval-mode loss of `held_out`, its batches of
    BATCH x K rows weighted alike; `lora`: LoraConfig's arguments, the model PEFT's
    `get_peft_model` of the checkpoint; `encoded`: the rows' (ids, labels) as another reference
    tokenized them (TRL), instead of `encode`. Returns (losses, eval losses, the model)."""
    ids, labels = encode(tok, rows) if encoded is None else encoded
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    model.config.use_cache = False
    if lora is not None:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **lora))
    model.train()
    opt = torch.optim.AdamW(param_groups(model, WD), lr=LR)
    sched = transformers.get_cosine_schedule_with_warmup(opt, WARMUP, EPOCHS * steps_per_epoch)

    def amp():
        return gpu_autocast(torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
    rows_a_step = BATCH * accum

    def weighted(x, y):
        """The step's loss terms: each microbatch's mean loss x its share of the labels."""
        counts = [int((y_k != -100).sum()) for y_k in y.chunk(accum)]
        for x_k, y_k, n in zip(x.chunk(accum), y.chunk(accum), counts):
            with amp():
                loss = F.cross_entropy(model(input_ids=x_k).logits.flatten(0, 1).float(), y_k.flatten())
            yield (loss if accum == 1 else loss * (n / sum(counts))), n

    def evaluate():
        ev_ids, ev_labels = encode(tok, held_out)
        model.eval()
        with torch.no_grad():
            per = [sum(v.item() for v, n in weighted(ev_ids[k:k + rows_a_step, :-1], ev_labels[k:k + rows_a_step, 1:])
                       if n) for k in range(0, len(held_out) - rows_a_step + 1, rows_a_step)]
        model.train()
        return sum(per) / len(per)

    losses, evals = [], []
    for e in range(EPOCHS):
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(e))
        for k in range(steps_per_epoch):
            at = order[k * rows_a_step:(k + 1) * rows_a_step]
            opt.zero_grad()
            total = 0.0
            for value, n in weighted(ids[at, :-1], labels[at, 1:]):
                value.backward()
                if n:
                    total += value.item()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            sched.step()
            losses.append(total)
            if len(losses) in eval_at:
                evals.append(evaluate())
    return losses, evals, model


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def pretrained(ckpt: Path):
    """A tiny LLaMA checkpoint (safetensors) and its tokenizer in one directory."""
    torch.manual_seed(3)
    tok = make_tokenizer(ckpt)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(ckpt)
    return tok


ACCUM, CLIP, EVAL_EVERY = 4, 1.0, 3
"""The Trainer's recipe on top: 4 microbatches a step, gradients clipped to norm 1, an evaluation
every 3 steps."""


def recipe(tmp_path: Path):
    """The checkpoint, its tokenizer, 40 training pairs (5 steps of 2 x 4 rows an epoch) and 8 held
    out (one evaluation batch of 2 x 4 rows), as JSONL."""
    ckpt = tmp_path / "ckpt"
    tok = pretrained(ckpt)
    rows, held_out = pairs(40), pairs(8, seed=1)
    return (ckpt, tok, rows, held_out, write_jsonl(tmp_path / "train.jsonl", rows),
            write_jsonl(tmp_path / "eval.jsonl", held_out))


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_python_api_is_the_same_fine_tune(precision, tmp_path):
    """The recipe through the API: `tensorstow.plan` (accumulation, clipping), `Executor(plan,
    "hf:DIR")` streaming the checkpoint, `Examples` for the data, an `LRSchedule`, `ex.evaluate`
    every 3 steps: fp32 bit-identical to the eager loop (losses, eval losses, weights), bf16-mixed
    (PyTorch AMP) with every loss within 1% of eager autocast's."""
    import tensorstow
    from tensorstow.executor.lr import LRSchedule
    ckpt, tok, rows, held_out, train, evals = recipe(tmp_path)
    per = len(rows) // (BATCH * ACCUM)
    plan = tensorstow.plan(f"hf:{ckpt}", hw="lohan-rtx4090", policy="zero-infinity", precision=precision, batch=BATCH,
                           seq=SEQ, gpu_mem="1MB", lr=LR, weight_decay=WD, exact_optimizer=True, grad_accum=ACCUM,
                           max_grad_norm=CLIP)
    data = Examples.load(str(train), SEQ, len(tok), tokenizer=tok)
    ev = [(x, y) for _, _, x, y in Examples.load(str(evals), SEQ, len(tok), tokenizer=tok).batches(
        BATCH * ACCUM, 1, seed=0, shuffle=False)]
    torch.manual_seed(0)
    ex = tensorstow.Executor(plan, f"hf:{ckpt}", state_dir=tmp_path / "s",
                             lr_schedule=LRSchedule("cosine", LR, WARMUP, EPOCHS * per))
    losses, got_evals = [], []
    for _, _, x, y in data.batches(BATCH * ACCUM, EPOCHS * per, seed=0):
        losses.append(ex.step(x, y))
        if len(losses) % EVAL_EVERY == 0:
            got_evals.append(ex.evaluate(ev))
    got = ex.parameters()
    ex.close()
    want_losses, want_evals, model = eager_finetune(ckpt, tok, rows, per, precision, ACCUM, CLIP, held_out, (3, 6, 9))
    want = weights(model)
    assert len(got_evals) == 3
    if precision == "fp32":
        assert losses == want_losses and got_evals == want_evals
        assert all(torch.equal(got["model." + n], p) for n, p in want.items())
    else:
        assert losses == pytest.approx(want_losses, rel=0.01) and got_evals == pytest.approx(want_evals, rel=0.01)


API_RUN = """
import os, signal, sys
import torch
import tensorstow
from tensorstow.executor.examples import Examples
from tensorstow.executor.lr import LRSchedule
from transformers import AutoTokenizer
plan, ckpt, train, state, seq, lr, warmup, rows, total, kill_after = sys.argv[1:]
tok = AutoTokenizer.from_pretrained(ckpt)
data = Examples.load(train, int(seq), len(tok), tokenizer=tok)
torch.manual_seed(0)
ex = tensorstow.Executor(tensorstow.Plan.load(plan), "hf:" + ckpt, state_dir=state,
                         lr_schedule=LRSchedule("cosine", float(lr), int(warmup), int(total)))
for k, (_, _, x, y) in enumerate(data.batches(int(rows), int(total), seed=0), 1):
    ex.step(x, y)
    if k == int(kill_after):
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_an_api_run_killed_mid_epoch_resumes_the_same_fine_tune(tmp_path):
    """The recipe's API loop in a process SIGKILL-ed after step 7 (epoch 1 under way); the same
    loop with `resume=True` continues from the committed step, its data from that very example:
    the remaining losses, the evaluation after step 9 and the final weights equal the eager loop's
    bit for bit (fp32). Through the same plan as the CLI test: state on SSD, accumulation, clipping."""
    import tensorstow
    from tensorstow.executor.lr import LRSchedule
    ckpt, tok, rows, held_out, train, evals = recipe(tmp_path)
    per, step_rows = len(rows) // (BATCH * ACCUM), BATCH * ACCUM
    plan = tmp_path / "plan.json"
    plan.write_text(tensorstow.plan(f"hf:{ckpt}", hw="lohan-rtx4090", policy="zero-infinity", precision="fp32",
                                    batch=BATCH, seq=SEQ, gpu_mem="1MB", lr=LR, weight_decay=WD, exact_optimizer=True,
                                    grad_accum=ACCUM, max_grad_norm=CLIP).dumps())
    state = tmp_path / "s"
    r = subprocess.run([sys.executable, "-c", API_RUN, str(plan), str(ckpt), str(train), str(state), str(SEQ), str(LR),
                        str(WARMUP), str(step_rows), str(EPOCHS * per), "7"], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == -9, r.stderr
    data = Examples.load(str(train), SEQ, len(tok), tokenizer=tok)
    ev = [(x, y) for _, _, x, y in Examples.load(str(evals), SEQ, len(tok), tokenizer=tok).batches(
        step_rows, 1, seed=0, shuffle=False)]
    ex = tensorstow.Executor(tensorstow.Plan.load(plan), f"hf:{ckpt}", state_dir=state, resume=True,
                             lr_schedule=LRSchedule("cosine", LR, WARMUP, EPOCHS * per))
    start = ex.steps_done
    assert start in (6, 7)  # step 7's commit completes in the background, the kill may come first
    losses, got_evals = [], []
    for k, (_, _, x, y) in enumerate(data.batches(step_rows, EPOCHS * per, seed=0, start=start), start + 1):
        losses.append(ex.step(x, y))
        if k % EVAL_EVERY == 0:
            got_evals.append(ex.evaluate(ev))
    got = ex.parameters()
    ex.close()
    want_losses, want_evals, model = eager_finetune(ckpt, tok, rows, per, "fp32", ACCUM, CLIP, held_out, (9,))
    assert losses == want_losses[start:] and got_evals == want_evals
    assert all(torch.equal(got["model." + n], p) for n, p in weights(model).items())


def test_pretrained_llama_finetunes_from_prompt_completion_like_eager(tmp_path):
    """The issue's recipe by the command line. A LLaMA checkpoint (safetensors) and its tokenizer in
    one directory, prompt/completion JSONL: planned with its state on SSD, `--grad-accum 4`,
    `--max-grad-norm 1`, warmup + cosine, weight decay on 2-D parameters; `execute --epochs 2`
    (shuffled, right-padded) evaluating held-out pairs every 3 steps, SIGKILL-ed mid-epoch and run
    again, exported, reloaded with `from_pretrained`: the losses, eval losses and exported weights
    equal the eager loop's bit for bit (fp32, --exact-optimizer)."""
    ckpt, tok, rows, held_out, data, evals = recipe(tmp_path)
    plan = tmp_path / "plan.json"
    assert main(["plan", f"hf:{ckpt}", "--hw", "lohan-rtx4090", "--policy", "zero-infinity", "--precision", "fp32",
                 "--batch", str(BATCH), "--seq", str(SEQ), "--gpu-mem", "1MB", "--lr", str(LR), "--weight-decay", str(WD),
                 "--exact-optimizer", "--lr-scheduler", "cosine", "--warmup-steps", str(WARMUP),
                 "--grad-accum", str(ACCUM), "--max-grad-norm", str(CLIP), "-o", str(plan)]) == 0
    assert any(b["home"] == "ssd" for b in json.loads(plan.read_text())["buffers"].values())
    log, state = tmp_path / "log.jsonl", tmp_path / "state"
    cmd = [sys.executable, "-m", "tensorstow.cli", "execute", str(plan), "--hw-mismatch", "ok", "--data", str(data), "--epochs", str(EPOCHS),
           "--eval-data", str(evals), "--eval-every", str(EVAL_EVERY), "--state-dir", str(state), "--log-json", str(log)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    for line in p.stdout:
        if line.startswith("step 7/"):  # epoch 1 has begun (5 steps an epoch)
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "resuming from step" in r.stdout and "epoch 1" in r.stdout
    assert main(["export", str(state), "-o", str(tmp_path / "out")]) == 0
    want_losses, want_evals, model = eager_finetune(ckpt, tok, rows, len(rows) // (BATCH * ACCUM), "fp32", ACCUM,
                                                    CLIP, held_out, (3, 6, 9, 10))
    want = weights(model)
    logged, evaluated = {}, {}
    for line in log.read_text().splitlines():  # a step the kill cut short is logged again after the resume
        row = json.loads(line)
        (evaluated if "eval_loss" in row else logged)[row["step"]] = row
    assert sorted(logged) == list(range(1, len(want_losses) + 1))
    assert [logged[k]["loss"] for k in sorted(logged)] == want_losses
    assert [logged[k]["epoch"] for k in sorted(logged)] == [0] * 5 + [1] * 5
    assert sorted(evaluated) == [3, 6, 9, 10]  # and after the last step
    assert [evaluated[k]["eval_loss"] for k in sorted(evaluated)] == want_evals
    got = dict(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").named_parameters())
    assert got.keys() == want.keys()
    bad = [n for n in want if not torch.equal(got[n].detach(), want[n])]
    assert not bad, f"exported weights differ from eager: {bad[:4]}"


@pytest.mark.parametrize("targets", ["q_proj,v_proj", "q_proj,embed_tokens"], ids=["linear", "embedding"])
def test_lora_from_the_command_line_exports_an_adapter_and_merged_weights(targets, tmp_path, capsys):
    """`plan hf:DIR --lora r=4,alpha=8,targets=q_proj,v_proj` with the recipe (accumulation,
    clipping, warmup + cosine), `execute`, `export`: the adapter loads with
    `PeftModel.from_pretrained` onto the base and equals eager PEFT's trained adapters (the frozen
    base streamed from the checkpoint, the adapters initialised as get_peft_model of the loaded
    checkpoint does); `export --merge` loads with `from_pretrained` and equals merge_and_unload.
    An embedding's adapters too (PEFT moves them to the base's device tensor by tensor, not
    module by module; they are saved as `lora_embedding_A`, not `lora_A`), and its file holds
    what PEFT's `save_pretrained` writes."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    ckpt, tok, rows, _, data, _ = recipe(tmp_path)
    plan = tmp_path / "plan.json"
    lora = {"r": 4, "lora_alpha": 8.0, "target_modules": targets.split(",")}
    assert main(["plan", f"hf:{ckpt}", "--hw", "lohan-rtx4090", "--policy", "lohan", "--precision", "fp32",
                 "--batch", str(BATCH), "--seq", str(SEQ), "--gpu-mem", "1MB", "--lr", str(LR), "--weight-decay", str(WD),
                 "--exact-optimizer", "--lr-scheduler", "cosine", "--warmup-steps", str(WARMUP),
                 "--grad-accum", str(ACCUM), "--max-grad-norm", str(CLIP),
                 "--lora", f"r=4,alpha=8,targets={targets}", "-o", str(plan)]) == 0
    state, log = tmp_path / "state", tmp_path / "log.jsonl"
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--data", str(data), "--epochs", str(EPOCHS), "--state-dir", str(state),
                 "--log-json", str(log)]) == 0
    assert main(["export", str(state), "-o", str(tmp_path / "adapter")]) == 0
    assert main(["export", str(state), "--merge", "-o", str(tmp_path / "merged")]) == 0
    want_losses, _, model = eager_finetune(ckpt, tok, rows, len(rows) // (BATCH * ACCUM), "fp32", ACCUM, CLIP,
                                           lora=lora)
    assert [json.loads(line)["loss"] for line in log.read_text().splitlines()] == want_losses
    want = weights(model)
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(ckpt), tmp_path / "adapter")
    got = weights(loaded)
    assert got.keys() == want.keys()
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, f"adapter differs from eager PEFT's: {bad[:4]}"
    model.save_pretrained(tmp_path / "eager-adapter")
    saved, eager_saved = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("adapter", "eager-adapter"))
    assert saved.keys() == eager_saved.keys()
    assert all(torch.equal(saved[k], eager_saved[k]) for k in saved)
    merged = weights(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged"))
    eager_merged = weights(model.merge_and_unload())
    assert merged.keys() == eager_merged.keys()
    bad = [n for n in eager_merged if not torch.equal(merged[n], eager_merged[n])]
    assert not bad, f"merged weights differ from merge_and_unload: {bad[:4]}"
    if targets != "q_proj,v_proj":
        return
    assert main(["export", str(state), "--tokenizer", str(tmp_path / "no-such-dir"), "-o", str(tmp_path / "t")]) == 2
    assert "no such directory" in capsys.readouterr().err and not (tmp_path / "t").exists()
    # an edited or damaged adapter or model config in the state dir is not exported (it would merge
    # at another scale, or load adapters onto other modules); the same execute writes it anew
    config = state / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 8.0', '"lora_alpha": 800.0'))
    (state / "config.json").write_text("{damaged")
    capsys.readouterr()
    assert main(["export", str(state), "--merge", "-o", str(tmp_path / "edited")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "adapter_config.json" in err and "edited or damaged" in err
    assert not (tmp_path / "edited").exists()
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--data", str(data), "--epochs", str(EPOCHS),
                 "--state-dir", str(state)]) == 0
    assert main(["export", str(state), "--merge", "-o", str(tmp_path / "again")]) == 0
    again = weights(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again"))
    assert all(torch.equal(again[n], merged[n]) for n in merged)


def test_held_out_examples_short_of_a_batch_are_said_to_be_left_out(tmp_path, capsys):
    """Evaluation runs whole batches: with 8 + 3 held-out pairs and 2 x 4 rows a step, the last 3
    are not evaluated, and the run says so rather than leaving them out silently."""
    ckpt, tok, rows, held_out, data, _ = recipe(tmp_path)
    evals = write_jsonl(tmp_path / "eval11.jsonl", held_out + pairs(3, seed=2))
    plan = tmp_path / "plan.json"
    assert main(["plan", f"hf:{ckpt}", "--hw", "lohan-rtx4090", "--precision", "fp32", "--batch", str(BATCH),
                 "--seq", str(SEQ), "--grad-accum", str(ACCUM), "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--data", str(data), "--steps", "1",
                 "--eval-data", str(evals), "--eval-every", "1"]) == 0
    out = capsys.readouterr().out
    assert f"eval data {evals}: the last 3 of its 11 examples are not evaluated" in out
    assert "eval after step 1/1" in out
    # more batches than the data holds would evaluate examples twice: refused
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--data", str(data), "--steps", "1",
                 "--eval-data", str(evals), "--eval-every", "1", "--eval-batches", "2"]) == 2
    assert f"{evals} holds 1 evaluation batches of 8 rows, and 2 were asked for" in capsys.readouterr().err
    # a tokenizer path that is no directory: one line at once (transformers would try the Hub under that name)
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--data", str(data), "--steps", "1",
                 "--tokenizer", str(tmp_path / "no-such-dir")]) == 2
    assert "--tokenizer" in capsys.readouterr().err
