"""Conversational data as people have it, tokenized as TRL's SFTTrainer tokenizes it (the reference,
run here on the same rows): `messages` through the checkpoint's own chat template with the loss on
the assistant's tokens only, a conversational prompt and completion with the loss on the completion,
`--loss-on all`; a template that marks no assistant tokens refused in one line before any step; an
example whose assistant tokens are cut off counted and left out; and a pretrained tiny LLaMA
fine-tuned on `messages` through an offloaded plan, equal to the eager loop on TRL's tokens."""
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="TRL (the test extra) is the reference for chat tokenization")
datasets = pytest.importorskip("datasets")

from tensorstow import TensorstowError  # noqa: E402
from tensorstow.cli import main  # noqa: E402
from tensorstow.executor.examples import Chat, Examples, read_records, tokenize  # noqa: E402
from tests.test_finetune import (BATCH, LR, SEQ, WARMUP, WD, WORDS, eager_finetune, pretrained,  # noqa: E402
                                 weights, write_jsonl)

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
            "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""A ChatML-like template that marks the assistant's turns with {% generation %}, as TRL asks of one."""
PLAIN = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
"""The same template without the marks (as most checkpoints' templates are)."""


def words(g: torch.Generator, lo: int = 1, hi: int = 6) -> str:
    n = int(torch.randint(lo, hi, (1,), generator=g))
    return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n,), generator=g))


def conversations(n: int, seed: int = 0) -> list[dict]:
    """`messages` examples: an optional system turn, then one or two user/assistant exchanges."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        msgs = [{"role": "system", "content": words(g)}] if k % 3 == 0 else []
        for _ in range(1 + k % 2):
            msgs += [{"role": "user", "content": words(g)}, {"role": "assistant", "content": words(g)}]
        out.append({"messages": msgs})
    return out


def prompt_completions(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt": [{"role": "user", "content": words(g)}], "completion": [{"role": "assistant", "content": words(g)}]}
            for _ in range(n)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny LLaMA checkpoint whose tokenizer carries TEMPLATE as its chat template."""
    d = tmp_path_factory.mktemp("chat") / "ckpt"
    tok = pretrained(d)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    return d


def trl_tokens(ckpt: Path, rows: list[dict], out: Path, **config) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each row as TRL's SFTTrainer prepares its train dataset."""
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    args = trl.SFTConfig(output_dir=str(out), max_length=None, report_to="none", use_cpu=True, **config)
    ds = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                        processing_class=tok).train_dataset
    return [(r["input_ids"], r["labels"] if "labels" in r else r["input_ids"]) for r in ds]


def ours(ckpt: Path, rows: list[dict], chat: Chat = Chat()) -> list[tuple[list[int], list[int]]]:
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    return tokenize([(f"row {k}", r) for k, r in enumerate(rows)], tok, -100, len(tok), chat)


def test_conversations_tokenize_as_trl_does(ckpt, tmp_path):
    chats, pcs = conversations(6), prompt_completions(4)
    want = trl_tokens(ckpt, chats, tmp_path / "a", assistant_only_loss=True)
    got = ours(ckpt, chats)
    assert got == want
    assert all(any(t == -100 for t in lab) and any(t != -100 for t in lab) for _, lab in got)  # masks, not all or none
    assert ours(ckpt, pcs) == trl_tokens(ckpt, pcs, tmp_path / "b")  # the completion only (completion_only_loss)
    # --loss-on all: every token, as TRL without assistant_only_loss / completion_only_loss
    assert ours(ckpt, chats, Chat(loss_on="all")) == trl_tokens(ckpt, chats, tmp_path / "c")
    assert ours(ckpt, pcs, Chat(loss_on="all")) == trl_tokens(ckpt, pcs, tmp_path / "d", completion_only_loss=False)


def test_a_template_file_and_a_tools_column_reach_the_template(ckpt, tmp_path):
    """--chat-template FILE replaces the tokenizer's template; a `tools` column (a list, or that list
    as JSON text) is handed to it as TRL hands it."""
    f = tmp_path / "tools.jinja"
    f.write_text("{% if tools %}<|tools|>{{ tools | map(attribute='name') | join(',') }}{{ eos_token }}{% endif %}"
                 + TEMPLATE)
    tools = [{"name": "park"}, {"name": "hill"}]
    as_text = [dict(r, tools=json.dumps(tools)) for r in conversations(3)]  # one column type for datasets
    rows = [dict(r, tools=tools) for r in conversations(2)] + as_text[2:]
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    got = ours(ckpt, rows, Chat.of(str(f)))
    tok.chat_template = f.read_text()
    tok.save_pretrained(tmp_path / "tok")
    transformers.AutoModelForCausalLM.from_pretrained(ckpt).save_pretrained(tmp_path / "tok")
    assert got == trl_tokens(tmp_path / "tok", as_text, tmp_path / "t", assistant_only_loss=True)
    assert tok.decode(got[0][0]).startswith("toolsparkhill</s>")  # characters outside the tiny vocabulary drop out


def test_a_template_that_marks_no_assistant_tokens_is_refused_before_any_step(ckpt, tmp_path, capsys):
    """transformers would return an all-zero assistant mask (nothing to learn): one line that says what to
    do; --loss-on all trains on every token instead."""
    plain = tmp_path / "plain.jinja"
    plain.write_text(PLAIN)
    rows = conversations(4)
    with pytest.raises(TensorstowError, match=r"chat template .*plain.jinja marks no assistant tokens .*generation.*"
                                              r"--chat-template FILE.*--loss-on all"):
        ours(ckpt, rows, Chat.of(str(plain)))
    assert ours(ckpt, rows, Chat.of(str(plain), "all")) == [(i, i) for i, _ in ours(ckpt, rows, Chat(loss_on="all"))]
    plan, data = tmp_path / "plan.json", write_jsonl(tmp_path / "chat.jsonl", rows)
    assert main(["plan", f"hf:{ckpt}", "--hw", "lohan-rtx4090", "--precision", "fp32", "--batch", "2", "--seq", str(SEQ),
                 "-o", str(plan)]) == 0
    capsys.readouterr()
    code = main(["execute", str(plan), "--hw-mismatch", "ok", "--data", str(data), "--steps", "1",
                 "--chat-template", str(plain)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("tensorstow: error: chat template ")
    assert "step 1/" not in capsys.readouterr().out


def test_examples_whose_assistant_tokens_are_cut_off_are_counted_and_left_out(ckpt, tmp_path):
    def chat(user, assistant):
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}
    rows = [chat("the cat", "sat on"), chat("a mat", "the dog"), chat(" ".join(WORDS * 3), "the cat"),
            chat("the park", "a bird"), chat("sang", "over the hill")]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    ex = Examples.load(str(data), SEQ, len(tok), tokenizer=tok)
    assert ex.left_out == (f"{data}:3",) and len(ex) == 4
    assert ex.notes == (f"1 example left out, with no label within seq + 1 = 25 tokens (labels cut off, or none) "
                        f"(first: {data}:3)",)
    pairs = ours(ckpt, [r for k, r in enumerate(rows) if k != 2])
    assert [row.tolist()[:len(i)] for row, (i, _) in zip(ex.ids, pairs)] == [i[:SEQ + 1] for i, _ in pairs]
    with pytest.raises(TensorstowError, match=r"no example has a label within seq \+ 1 = 25 tokens"):
        Examples.load(str(write_jsonl(tmp_path / "one.jsonl", [rows[2]])), SEQ, len(tok), tokenizer=tok)


@pytest.mark.parametrize("row, says", [
    ({"conversations": [{"from": "human", "value": "hi"}]},
     r":1: the example has keys \['conversations'\]: give input_ids \(and labels\), messages, prompt and completion, "
     r"or text"),
    ({"messages": "hello"}, r":1: messages must be a non-empty list of messages .*got a string"),
    ({"messages": [{"content": "hi"}]}, r":1: messages\[0\] must be a message object with a string \"role\""),
    ({"messages": [{"role": "user", "content": "a"}], "tools": "{not json"}, r":1: tools is a string that is not JSON"),
    ({"prompt": [{"role": "user", "content": "a"}], "completion": "b"}, r":1: completion must be a non-empty list"),
    ({"messages": [{"role": "user", "contnet": "hi"}, {"role": "assistant", "content": "a"}]},  # else an empty turn
     r":1: messages\[0\] has no \"content\" \(its keys: contnet, role\): give every message its \"content\" \(an "
     r"assistant's tool call may give \"tool_calls\" instead\)$"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": []}]},
     r":1: messages\[1\] has no \"content\" \(its keys: role, tool_calls\)"),
    ({"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "assistant", "content": None}]},
     r":1: completion\[0\] has \"content\": null: give every message its \"content\""),
    ({"messages": [{"role": "user", "content": "a"}], "text": "a"},
     r":1: the example has both messages and text, two forms of example: keep one of them$"),
])
def test_bad_conversations_are_one_line_naming_the_line(ckpt, tmp_path, row, says):
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    data = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(TensorstowError, match=says) as e:
        tokenize(read_records(str(data)), tok, -100, len(tok))
    assert "\n" not in str(e.value)


def test_an_assistant_tool_call_needs_no_content(ckpt, tmp_path):
    """`{"role": "assistant", "tool_calls": [...]}` without content (or with it null), as transformers
    and TRL take a tool call: tokenized as TRL tokenizes it, the call among the labels."""
    calls = TEMPLATE.replace("{{ m['content'] }}{{ eos_token }}{% endgeneration %}",
                             "{% for c in m['tool_calls'] or [] %}<call>{{ c['function']['name'] }}{% endfor %}"
                             "{{ m['content'] or '' }}{{ eos_token }}{% endgeneration %}")
    call = {"type": "function", "function": {"name": "park", "arguments": {"where": "hill"}}}
    turns = [{"role": "user", "content": "the cat"}, {"role": "assistant", "tool_calls": [call]},
             {"role": "tool", "content": "a dog"}, {"role": "assistant", "content": "the bird"}]
    rows = [{"messages": turns}, {"messages": [dict(m, content=m.get("content")) for m in turns]}]
    f = tmp_path / "calls.jinja"
    f.write_text(calls)
    got = ours(ckpt, rows, Chat.of(str(f)))
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    tok.chat_template = calls
    tok.save_pretrained(tmp_path / "tok")
    transformers.AutoModelForCausalLM.from_pretrained(ckpt).save_pretrained(tmp_path / "tok")
    assert got == trl_tokens(tmp_path / "tok", rows, tmp_path / "t", assistant_only_loss=True)
    assert got[0] == got[1] and "callpark</s>" in tok.decode([t for t in got[0][1] if t != -100])


@pytest.mark.parametrize("rule, row, why", [
    ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}{% endif %}",
     conversations(2)[1], "a system turn first"),
    ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
     "{{ raise_exception('no role ' + m['role']) }}{% endif %}{% endfor %}",
     {"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}, "no role robot"),
])
def test_a_template_that_rejects_a_conversation_names_the_example(ckpt, tmp_path, rule, row, why):
    """The template's own refusal (a role it does not know, a missing system turn): one line naming
    the example's FILE:LINE and the template's reason."""
    f = tmp_path / "strict.jinja"
    f.write_text(rule + TEMPLATE)
    data = write_jsonl(tmp_path / "d.jsonl", [conversations(1)[0], row])
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    with pytest.raises(TensorstowError, match=rf"{data}:2: chat template .*strict.jinja fails on this conversation "
                                              rf"\({why}\)"):
        tokenize(read_records(str(data)), tok, -100, len(tok), Chat.of(str(f)))


CHAT_ACCUM = 2


def chat_recipe(ckpt: Path, tmp_path: Path):
    """12 multi-turn conversations (3 steps of 2 x 2 rows an epoch) as JSONL, TRL's tokens for them
    right-padded to CHAT_SEQ + 1, and a plan: state on SSD, `--grad-accum 2`, `--max-grad-norm 1`,
    warmup + cosine, AdamW with weight decay, fp32 with the exact optimizer."""
    rows = conversations(12)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    want_pairs = trl_tokens(ckpt, rows, tmp_path / "trl", assistant_only_loss=True)
    assert max(len(i) for i, _ in want_pairs) <= CHAT_SEQ + 1  # whole: a cut one is left out (tested above)
    pad = lambda xs, v: xs + [v] * (CHAT_SEQ + 1 - len(xs))  # noqa: E731
    encoded = (torch.tensor([pad(i, tok.pad_token_id) for i, _ in want_pairs]),
               torch.tensor([pad(lab, -100) for _, lab in want_pairs]))
    plan = tmp_path / "plan.json"
    assert main(["plan", f"hf:{ckpt}", "--hw", "lohan-rtx4090", "--policy", "zero-infinity", "--precision", "fp32",
                 "--batch", str(BATCH), "--seq", str(CHAT_SEQ), "--gpu-mem", "1MB", "--lr", str(LR), "--weight-decay",
                 str(WD), "--exact-optimizer", "--lr-scheduler", "cosine", "--warmup-steps", str(WARMUP),
                 "--grad-accum", str(CHAT_ACCUM), "--max-grad-norm", "1", "-o", str(plan)]) == 0
    assert any(b["home"] == "ssd" for b in json.loads(plan.read_text())["buffers"].values())
    return rows, tok, encoded, plan, write_jsonl(tmp_path / "chat.jsonl", rows)


CHAT_SEQ = 56
"""Every conversation of `chat_recipe` whole (the suite's SEQ would cut some assistants off)."""


def eager_chat(ckpt, tok, rows, encoded):
    return eager_finetune(ckpt, tok, rows, len(rows) // (BATCH * CHAT_ACCUM), "fp32", CHAT_ACCUM, 1.0, encoded=encoded)


def test_a_chat_fine_tune_trains_like_eager_on_trls_tokens(ckpt, tmp_path):
    """`messages` JSONL through `tensorstow execute`, the checkpoint's own template, assistant-only
    loss, 2 shuffled epochs of the recipe above: losses and exported weights bit-identical to the
    eager loop fed TRL's (input_ids, labels)."""
    rows, tok, encoded, plan, data = chat_recipe(ckpt, tmp_path)
    log = tmp_path / "log.jsonl"
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--data", str(data), "--epochs", "2",
                 "--state-dir", str(tmp_path / "state"), "--log-json", str(log)]) == 0
    got_losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    want_losses, _, model = eager_chat(ckpt, tok, rows, encoded)
    assert len(got_losses) == 6 and got_losses == want_losses
    assert main(["export", str(tmp_path / "state"), "-o", str(tmp_path / "out")]) == 0
    got = dict(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").named_parameters())
    want = weights(model)
    assert [n for n in want if not torch.equal(got[n].detach(), want[n])] == []
    # a whole checkpoint: the tokenizer and its chat template beside the weights
    saved = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert saved.chat_template == TEMPLATE and saved("the cat")["input_ids"] == tok("the cat")["input_ids"]
    other = tmp_path / "other.jinja"
    other.write_text(PLAIN)
    assert main(["export", str(tmp_path / "state"), "-o", str(tmp_path / "out2"), "--chat-template", str(other)]) == 0
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out2").chat_template == PLAIN


def test_the_python_api_is_the_same_chat_fine_tune(ckpt, tmp_path):
    """The recipe through the API: `Examples.load(..., chat=Chat())`, an `LRSchedule`, `Executor.step`."""
    import tensorstow
    from tensorstow.executor.lr import LRSchedule
    rows, tok, encoded, plan, data = chat_recipe(ckpt, tmp_path)
    examples = Examples.load(str(data), CHAT_SEQ, len(tok), tokenizer=tok, chat=Chat())
    per, rows_a_step = examples.steps_per_epoch(BATCH * CHAT_ACCUM), BATCH * CHAT_ACCUM
    torch.manual_seed(0)
    ex = tensorstow.Executor(tensorstow.Plan.load(plan), f"hf:{ckpt}", state_dir=tmp_path / "s",
                             lr_schedule=LRSchedule("cosine", LR, WARMUP, 2 * per))
    losses = [ex.step(x, y) for _, _, x, y in examples.batches(rows_a_step, 2 * per, seed=0)]
    got = ex.parameters()
    ex.close()
    want_losses, _, model = eager_chat(ckpt, tok, rows, encoded)
    assert losses == want_losses
    assert all(torch.equal(got["model." + n], p) for n, p in weights(model).items())


def test_a_run_counts_long_conversations_and_empty_assistant_turns_and_trains_on(ckpt, tmp_path, capsys):
    """Training can go on: a conversation longer than seq + 1 is cut to it, an empty assistant turn
    learns its end-of-turn tokens; each is one counted line before the first step."""
    rows = conversations(4)
    rows[1] = {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": ""}]}
    rows[3] = {"messages": [{"role": "user", "content": "a dog"}, {"role": "assistant", "content": " ".join(WORDS)}]}
    data, plan = write_jsonl(tmp_path / "chat.jsonl", rows), tmp_path / "plan.json"
    assert main(["plan", f"hf:{ckpt}", "--hw", "lohan-rtx4090", "--precision", "fp32", "--batch", "2", "--seq", str(SEQ),
                 "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--data", str(data), "--steps", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    said = [line for line in out if line.startswith(f"data {data}: ")]
    assert any("longer than seq + 1 = 25 tokens: cut to it (first: " in line for line in said)
    assert f"data {data}: 1 example with an empty assistant turn: its end-of-turn tokens are its labels " \
           f"(first: {data}:2)" in said
    assert out.index(said[-1]) < next(k for k, line in enumerate(out) if line.startswith("step 1/1"))
