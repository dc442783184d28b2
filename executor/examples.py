"""Fine-tuning data: examples with labels, read from JSONL or a Hugging Face `datasets` directory,
tokenized, cut to the plan's sequence, and the order the steps take them in.

Each line of a JSONL file (or each row of a directory `datasets.Dataset.save_to_disk` wrote) is
one example, in one of these forms:

    {"input_ids": [...], "labels": [...]}   pre-tokenized; labels default to input_ids; a label
                                            equal to the model's ignore index is left out; an
                                            `attention_mask` of ones may come along; other keys
                                            are left aside, but not a misspelt one
    {"prompt": str, "completion": str}      ids = tok(prompt) + tok(completion, no special
                                            tokens) + [eos]; labels ignore the prompt's ids
                                            (TRL's completion-only loss)
    {"text": str}                           ids = tok(text) + [eos]; every token is a label
    {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]}
                                            a conversation (an assistant's tool call may give
                                            `tool_calls` instead of `content`): ids and the
                                            assistant mask from `tok.apply_chat_template(messages,
                                            tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)`; labels are the
                                            assistant's tokens (TRL's assistant_only_loss)
    {"prompt": [messages], "completion": [messages]}
                                            a conversational prompt and completion: the prompt
                                            rendered with the generation prompt, then prompt +
                                            completion; labels are the completion's tokens, from
                                            where the two renderings part (TRL's SFTTrainer)

The chat template is the tokenizer's own or the run's `chat_template` file; `loss_on="all"` makes
every token of a text or conversational example a label. An assistant-only loss needs a template
that marks the assistant's tokens (`{% generation %}`): one that does not is refused before any
step (transformers would return an all-zero mask: nothing to learn). A text or conversational
example left with no label in its row (its assistant tokens or completion cut off at seq + 1, or
none) is counted and left out (`Examples.left_out`), never trained on silently; data in which no
example of any form has a label within seq + 1 is refused.

A bad example (not UTF-8, not JSON, two forms at once, a field of the wrong type, a message
without content, a key the pre-tokenized form does not take, no input_ids, an id or label outside
the vocabulary) is refused with where it is: `FILE:LINE` (1-based) or `DIR row N` (0-based), and its
field. `tok` is the model's tokenizer (`AutoTokenizer` of the `hf:` directory, or `--tokenizer DIR`).
Each example is truncated or right-padded to seq + 1 tokens (the tokenizer's pad id, else its
eos; padded labels ignored). A row's input is its first seq tokens, its targets the labels of the
last seq: labels are aligned with input_ids, as Hugging Face models shift them.

With `packing` (a plan made with `--packing`) a row is a window of seq + 1 tokens holding several
examples, each truncated to seq + 1, packed best-fit decreasing as TRL's `pack_dataset(...,
strategy="bfd")` packs them (longest first, each into the window with the least room that holds
it, windows in the order they were opened; the rest of a window padded), with each token's
position in its example (`positions`: 0 at every example's start, and for the padding), from which
a Hugging Face model masks attention to within an example; every example's first label is
ignored, so no example's first token is a target of the one before.

Order: epoch e visits the examples in `torch.randperm(n, generator=torch.Generator().manual_seed(
seed + e))` (in file order without shuffling); its optimizer step k takes positions
[k * R, (k + 1) * R) of that order, R the rows of one step (batch x microbatches), in order; a
last partial step is dropped (`drop_last`). Step s of the run is step s mod S of epoch s // S (S
steps an epoch), so a resumed run continues at the very example an uninterrupted one would see.
"""
from __future__ import annotations

import bisect
import difflib
import json
import math
import re
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from tensorstow.errors import TensorstowError

FORMATS = ("input_ids", "messages", "prompt", "text")
TRAIN, HELD_OUT = ("train",), ("validation", "test")
"""The split of a `DatasetDict` that training data reads, and those evaluation data reads (the first
it has): never the training split, which would evaluate on what was trained on."""
PRETOKENIZED = {"input_ids", "labels", "attention_mask"}
"""The keys a pre-tokenized example is read by (its attention_mask all ones: TRL ignores the
column); others are left aside, but one close to these (a misspelt `label`) is refused."""
LABEL_MASKS = {"completion_mask", "assistant_masks"}
"""TRL's columns that say which of a pre-tokenized example's tokens are labels: refused, not left
aside (every token would be a label); `labels` says it here."""
LOSS_ON = ("assistant", "all")
"""Which tokens of a text or conversational example are labels (`Run.loss_on`)."""
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""The Jinja block a chat template marks the assistant's tokens with (transformers'
`return_assistant_tokens_mask` reads it)."""


def is_examples(source: str) -> bool:
    """Whether `--data` names examples (JSONL or a `datasets` directory) rather than tokens."""
    p = Path(source)
    return p.suffix in (".jsonl", ".json") or p.is_dir()


def read_records(source: str, splits: tuple[str, ...] = TRAIN) -> list[tuple[str, dict]]:
    """The examples of a JSONL file or a `save_to_disk` directory, as dicts, each with where it is
    from: `FILE:LINE` (1-based) or `DIR row N` (0-based), the prefix of its error messages."""
    p = Path(source)
    if p.is_dir():
        return _read_datasets_dir(source, splits)
    if not p.is_file():
        raise TensorstowError(f"data file {source} does not exist")
    out = []
    with open(p, "rb") as f:  # binary: a line that is not UTF-8 is named by its line, not a traceback
        for line_no, raw in enumerate(f, 1):
            where = f"{source}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TensorstowError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                      f"save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer of over 4300 digits, deep nesting
                raise TensorstowError(f"{where}: not a JSON object ({getattr(e, 'msg', e)})") from None
            if not isinstance(rec, dict):
                raise TensorstowError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            out.append((where, rec))
    if not out:
        raise TensorstowError(f"data file {source} holds no examples")
    return out


def _read_datasets_dir(source: str, splits: tuple[str, ...]) -> list[tuple[str, dict]]:
    """The rows of a directory `datasets.Dataset.save_to_disk` wrote (of a `DatasetDict`, the
    first of `splits` it has: `TRAIN` for training data, `HELD_OUT` for evaluation data), as
    `read_records` gives them."""
    try:
        import datasets
        import pyarrow
    except ImportError:
        raise TensorstowError(f"data {source} is a directory: reading a `datasets` directory needs the "
                              f"datasets package (pip install 'tensorstow[hf]')") from None
    p = Path(source)
    marks = (datasets.config.DATASET_STATE_JSON_FILENAME, datasets.config.DATASETDICT_JSON_FILENAME)
    if not any((p / m).is_file() for m in marks):
        raise TensorstowError(f"data {source}: not a directory `datasets` save_to_disk wrote (it holds no "
                              f"{' or '.join(marks)})")
    no_rows = f"data {source}: the datasets directory holds no rows: give one with examples"
    try:
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            split = next((name for name in splits if name in ds), None)
            if split is None:
                raise TensorstowError(f"data {source} holds splits {sorted(ds)}, none of {', '.join(splits)}: pass "
                                      f"the directory of one split")
            ds = ds[split]
        if not ds.num_rows:
            raise TensorstowError(no_rows)
        rows = list(ds)  # every row read here: a damaged arrow file fails now, not mid-run
    except TensorstowError:
        raise
    except IndexError:  # datasets finds no table to load: the directory of an empty dataset
        raise TensorstowError(no_rows) from None
    except (OSError, ValueError, KeyError, pyarrow.ArrowException) as e:  # a truncated file, damaged metadata
        first = str(e).splitlines()[0] if str(e) else type(e).__name__  # an OSError's message names its file
        raise TensorstowError(f"data {source}: cannot read the datasets directory ({first}); it is damaged or "
                              f"was not written by save_to_disk: write it again") from None
    # a row lacks a column other rows have as a None in it: drop those, as the row's JSONL line would
    return [(f"{source} row {k}", {c: v for c, v in r.items() if v is not None}) for k, r in enumerate(rows)]


@dataclass(frozen=True)
class Chat:
    """How text and conversational examples become labels: the chat template and the loss."""
    template: str | None = None
    """The Jinja source of the chat template (None: the tokenizer's own)."""
    source: str = "the tokenizer's chat template"
    """Where the template is from, as error messages name it."""
    loss_on: str = "assistant"
    """`LOSS_ON`: the assistant's tokens (the completion of a prompt and completion), or all."""

    @staticmethod
    def of(template_file: str | None, loss_on: str = "assistant") -> "Chat":
        """The run's chat settings: `template_file` read (a Jinja file), else the tokenizer's template."""
        if loss_on not in LOSS_ON:
            raise TensorstowError(f"--loss-on {loss_on}: give one of {', '.join(LOSS_ON)}")
        if template_file is None:
            return Chat(loss_on=loss_on)
        try:
            text = Path(template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TensorstowError(f"--chat-template {template_file}: cannot read it ({getattr(e, 'strerror', None) or e}); "
                                  f"give a Jinja chat template file") from None
        return Chat(template=text, source=f"chat template {template_file}", loss_on=loss_on)


def tokenize(records: list[tuple[str, dict]], tokenizer, ignore: int, vocab: int | None, chat: Chat = Chat(),
             empty_turns: list[str] | None = None) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each (where, record) (the module docstring's forms): every id in the model's
    vocabulary [0, vocab) (no upper bound with `vocab` None), every label too or `ignore`.
    `empty_turns` collects where a conversation has an assistant turn with no content (trained on:
    its template's end-of-turn tokens are its labels)."""
    out = []
    for where, r in records:
        forms = [f for f in FORMATS if f in r]
        if len(forms) > 1 and forms[0] != "input_ids":  # tokenized data keeps its source (`ds.map`): TRL takes the ids
            raise TensorstowError(f"{where}: the example has both {forms[0]} and {forms[1]}, two forms of example: "
                                  f"keep one of them")
        form = forms[0] if forms else None
        if form == "input_ids":
            extra = sorted(set(r) - PRETOKENIZED)  # other columns (its text, an id, token_type_ids) left aside, as TRL
            masks = [k for k in extra if k in LABEL_MASKS]
            if masks:  # left aside, every token would be a label
                raise TensorstowError(f"{where}: the pre-tokenized example's {masks[0]} says which tokens are labels, "
                                      f"which tensorstow reads from labels: give labels (the input_id where the mask "
                                      f"is 1, -100 elsewhere) instead")
            near = [(k, m[0]) for k in extra for m in [difflib.get_close_matches(k, sorted(PRETOKENIZED), 1, 0.8)] if m]
            if near:  # a misspelt `labels` would leave every token a label
                raise TensorstowError(f"{where}: the pre-tokenized example has key {near[0][0]}, not {near[0][1]}: "
                                      f"rename the misspelt key")
            ids = _token_ids(r["input_ids"], "input_ids", where)
            if not ids:
                raise TensorstowError(f"{where}: input_ids is empty: give the example's token ids, or drop it")
            mask = r.get("attention_mask")
            if mask is not None and not (isinstance(mask, (list, tuple, np.ndarray)) and list(mask) == [1] * len(ids)):
                raise TensorstowError(f"{where}: attention_mask must be a 1 for each of the {len(ids)} input_ids "
                                      f"(every token of an example is attended to): cut the padding off input_ids, "
                                      f"or drop the mask")
            labels = _token_ids(r["labels"], "labels", where) if "labels" in r else ids
            if len(labels) != len(ids):
                raise TensorstowError(f"{where}: {len(ids)} input_ids but {len(labels)} labels; give one label "
                                      f"per input id")
            _check_vocab(ids, "input_ids", vocab, where)
            if "labels" in r:
                _check_vocab(labels, "labels", vocab, where, ignore=ignore)
            out.append((ids, labels))
            continue
        if form is None or (form == "prompt" and "completion" not in r):
            raise TensorstowError(f"{where}: the example has keys {sorted(r)}: give input_ids (and labels), messages, "
                                  f"prompt and completion, or text")
        if tokenizer is None:
            raise TensorstowError(f"{where}: the example is text: pass --tokenizer DIR (or plan an hf: model, "
                                  f"whose directory holds its tokenizer)")
        if form == "messages" or form == "prompt" and isinstance(r["prompt"], list):
            ids, labels = _conversation(tokenizer, r, form, where, chat, ignore)
            turns = r.get("messages") or r.get("completion") or []
            if empty_turns is not None and any(m.get("role") == "assistant" and not str(m.get("content") or "").strip()
                                               and not m.get("tool_calls") for m in turns if isinstance(m, dict)):
                empty_turns.append(where)
        elif form == "prompt":
            eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
            prompt = tokenizer(_text(r, "prompt", where))["input_ids"]
            completion = tokenizer(_text(r, "completion", where), add_special_tokens=False)["input_ids"] + eos
            ids = prompt + completion
            labels = list(ids) if chat.loss_on == "all" else [ignore] * len(prompt) + completion
        else:
            eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
            ids = tokenizer(_text(r, "text", where))["input_ids"] + eos
            labels = list(ids)
        _check_vocab(ids, f"{form} (tokenized)", vocab, where)  # labels are some of the ids
        out.append((ids, labels))
    return out


def _conversation(tokenizer, r: dict, form: str, where: str, chat: Chat, ignore: int) -> tuple[list[int], list[int]]:
    """(ids, labels) of a conversational example, as TRL's SFTTrainer tokenizes it: `messages` with the
    template's assistant mask, a prompt and completion of messages with the completion's tokens."""
    template = chat.template if chat.template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise TensorstowError(f"{where}: the example is a conversation but the tokenizer has no chat template; pass "
                              f"--chat-template FILE (a Jinja template)")
    kwargs = dict(chat_template=template, tools=_tools(r, where), **_template_kwargs(r, where))
    assistant = chat.loss_on == "assistant"
    if form == "messages":
        if assistant and not _GENERATION.search(template):
            raise TensorstowError(f"{chat.source} marks no assistant tokens (it has no {{% generation %}} block), so an "
                                  f"assistant-only loss would learn nothing: pass --chat-template FILE with one, or "
                                  f"--loss-on all to train on every token")
        done = _render(tokenizer, _messages(r, "messages", where), where, chat, return_assistant_tokens_mask=assistant,
                       **kwargs)
        ids = list(done["input_ids"])
        mask = list(done["assistant_masks"]) if assistant else [1] * len(ids)
        return ids, [t if m else ignore for t, m in zip(ids, mask)]
    prompt, completion = _messages(r, "prompt", where), _messages(r, "completion", where)
    prompt_ids = list(_render(tokenizer, prompt, where, chat, add_generation_prompt=True, **kwargs)["input_ids"])
    ids = list(_render(tokenizer, prompt + completion, where, chat, **kwargs)["input_ids"])
    if not assistant:
        return ids, list(ids)
    start = next((k for k, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), min(len(prompt_ids), len(ids)))
    return ids, [ignore] * start + ids[start:]  # the completion: from where the renderings part (TRL)


def _render(tokenizer, messages: list, where: str, chat: Chat, **kwargs) -> dict:
    """`tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)`; a template
    that fails on the conversation is one line naming the example."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    except Exception as e:  # jinja2's TemplateError, or what the template's own raise_exception says
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TensorstowError(f"{where}: {chat.source} fails on this conversation ({first}); fix the example or "
                              f"the template") from None


def _messages(r: dict, field: str, where: str) -> list[dict]:
    """`r[field]` as a conversation: a list of objects, each with a string `role`."""
    value = r[field]
    if not isinstance(value, list) or not value:
        raise TensorstowError(f"{where}: {field} must be a non-empty list of messages "
                              f"({{\"role\": ..., \"content\": ...}}), got {_kind(value)}")
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TensorstowError(f"{where}: {field}[{k}] must be a message object with a string \"role\", got "
                                  f"{_shown(m)}")
        if m.get("content") is None and not m.get("tool_calls"):  # the template would render it as an empty turn
            has = "\"content\": null" if "content" in m else f"no \"content\" (its keys: {', '.join(sorted(m))})"
            raise TensorstowError(f"{where}: {field}[{k}] has {has}: give every message its \"content\" (an "
                                  f"assistant's tool call may give \"tool_calls\" instead)")
    return value


def _tools(r: dict, where: str):
    """The example's `tools` column (a list of tool schemas, or that list as a JSON string, as TRL takes
    it), None without one."""
    tools = r.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise TensorstowError(f"{where}: tools is a string that is not JSON ({e})") from None
    if tools is not None and not isinstance(tools, list):
        raise TensorstowError(f"{where}: tools must be a list of tool schemas, got {_kind(tools)}")
    return tools


def _template_kwargs(r: dict, where: str) -> dict:
    """The example's `chat_template_kwargs` (extra variables of the template, TRL's column), {} without."""
    kw = r.get("chat_template_kwargs", {})
    if not isinstance(kw, dict):
        raise TensorstowError(f"{where}: chat_template_kwargs must be an object, got {_kind(kw)}")
    return kw


INT64 = np.iinfo(np.int64)
KINDS = ((type(None), "null"), ((bool, np.bool_), "a bool"), ((int, np.integer), "an integer"),
         ((float, np.floating), "a float"), (str, "a string"), ((list, tuple, np.ndarray), "a list"),
         (dict, "an object"))
"""What a JSON reader calls a value of each type (bool before int: a bool is a Python int)."""


def _kind(v) -> str:
    """The JSON name of `v`'s type, with its article ("a string", "null")."""
    return next((name for types, name in KINDS if isinstance(v, types)), f"a {type(v).__name__}")


def _shown(v) -> str:
    """`v` as JSON writes it (its repr where JSON cannot), cut to 40 characters."""
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _token_ids(value, field: str, where: str) -> list[int]:
    """`value` as a list of token ids: a list (or 1-D array) of integers, Python's or numpy's, that
    fit int64. A string, null, a nested list, a float (even 3.0) or a bool is refused, where int()
    would truncate it or take it silently."""
    what = f"{where}: {field} must be a list of integer token ids"
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise TensorstowError(f"{what}, got {_kind(value)}")
    ids = []
    for k, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TensorstowError(f"{what}, element {k} is " + ("null" if t is None else f"{_shown(t)} ({_kind(t)})"))
        if not INT64.min <= int(t) <= INT64.max:
            raise TensorstowError(f"{what}, element {k} is {_shown(int(t))}, outside int64")
        ids.append(int(t))
    return ids


def _text(r: dict, field: str, where: str) -> str:
    """`r[field]`, which must be a string: a number or null is no text to tokenize."""
    if not isinstance(r[field], str):
        raise TensorstowError(f"{where}: {field} must be a string, got {_kind(r[field])}")
    return r[field]


def _check_vocab(values: list[int], field: str, vocab: int | None, where: str, *, ignore: int | None = None
                 ) -> None:
    """Every id of `values` in the model's vocabulary [0, vocab), or with `ignore` (labels) equal to it."""
    top = math.inf if vocab is None else vocab
    bad = next((t for t in values if not 0 <= t < top and t != ignore), None)
    if bad is None:
        return
    if ignore is None:
        raise TensorstowError(f"{where}: {field} holds token id {bad}, outside the model's vocabulary [0, {top}); "
                              f"tokenize it with the model's tokenizer")
    raise TensorstowError(f"{where}: {field} holds {bad}, neither the ignore index {ignore} nor in the model's "
                          f"vocabulary [0, {top}); give the target token's id, or {ignore} to leave it out of the loss")


@dataclass
class Examples:
    """The examples as rows of seq + 1 token ids and labels, and the order steps take them in."""
    ids: np.ndarray
    """(n, seq + 1) int64."""
    labels: np.ndarray
    ignore: int
    """The label value left out of the loss (padding, prompts)."""
    positions: np.ndarray | None = None
    """With packing: (n, seq + 1) int64, each token's position in its example."""
    left_out: tuple[str, ...] = field(default=())
    """Where each text or conversational example left out is (no label left in its row)."""
    notes: tuple[str, ...] = field(default=())
    """What a run says of the data before its first step: examples left out, cut to seq + 1 tokens,
    or with an empty assistant turn, each counted with the first one's place."""

    @staticmethod
    def load(source: str, seq: int, vocab: int | None, *, tokenizer=None, ignore: int = -100,
             packing: bool = False, chat: Chat = Chat(), splits: tuple[str, ...] = TRAIN) -> "Examples":
        records = read_records(source, splits)
        empty_turns: list[str] = []
        pairs = tokenize(records, tokenizer, ignore, vocab, chat, empty_turns)
        width = seq + 1
        long = [where for (where, r), (i, _) in zip(records, pairs) if "input_ids" not in r and len(i) > width]
        # a row's targets are the labels of its last seq tokens: data without any is refused, and an example
        # from text without any left out (a pre-tokenized one is kept as it is given)
        unlabelled = [k for k, (_, lab) in enumerate(pairs) if all(t == ignore for t in lab[1:width])]
        if len(unlabelled) == len(pairs):
            first, r = records[0]
            fix = (f"give labels other than the ignore index {ignore}" if "input_ids" in r else
                   "with --loss-on assistant the chat template must mark the assistant's tokens")
            raise TensorstowError(f"data {source}: no example has a label within seq + 1 = {width} tokens (first: "
                                  f"{first}); {fix}, and a longer --seq keeps more of each example")
        empty = [k for k in unlabelled if "input_ids" not in records[k][1]]
        if empty:
            gone = set(empty)
            pairs = [p for k, p in enumerate(pairs) if k not in gone]
        left_out = tuple(records[k][0] for k in empty)
        notes = tuple(_counted(wheres, what) for wheres, what in (
            (left_out, f"left out, with no label within seq + 1 = {width} tokens (labels cut off, or none)"),
            ([w for w in long if w not in left_out], f"longer than seq + 1 = {width} tokens: cut to it"),
            (empty_turns, "with an empty assistant turn: its end-of-turn tokens are its labels")) if wheres)
        pad = _pad_id(tokenizer)
        if packing:
            windows = best_fit_decreasing([min(len(i), width) for i, _ in pairs], width)
            rows = np.full((len(windows), width), pad, dtype=np.int64)
            lab = np.full((len(windows), width), ignore, dtype=np.int64)
            pos = np.zeros((len(windows), width), dtype=np.int64)
            for w, members in enumerate(windows):
                at = 0
                for k in members:
                    i, lb = pairs[k]
                    n = min(len(i), width)
                    rows[w, at:at + n], lab[w, at:at + n] = i[:n], lb[:n]
                    lab[w, at] = ignore  # the example before does not predict this one's first token
                    pos[w, at:at + n] = np.arange(n)
                    at += n
                pos[w, at:] = np.arange(width - at)  # the padding: an example of its own
            return Examples(rows, lab, ignore, pos, left_out, notes)
        rows = np.full((len(pairs), width), pad, dtype=np.int64)
        lab = np.full((len(pairs), width), ignore, dtype=np.int64)
        for k, (i, lb) in enumerate(pairs):
            rows[k, :min(len(i), width)] = i[:width]
            lab[k, :min(len(lb), width)] = lb[:width]
        return Examples(rows, lab, ignore, None, left_out, notes)

    def __len__(self) -> int:
        return len(self.ids)

    def steps_per_epoch(self, rows: int) -> int:
        return len(self) // rows

    def order(self, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
        """The positions of epoch `epoch`'s examples, in the order its steps take them."""
        if not shuffle:
            return torch.arange(len(self))
        return torch.randperm(len(self), generator=torch.Generator().manual_seed(seed + epoch))

    def batches(self, rows: int, steps: int, seed: int, start: int = 0, shuffle: bool = True,
                positions: bool = False) -> Iterator[tuple]:
        """(epoch, index of its first example in the epoch, x, y) for steps start..steps-1, x and y
        (rows, seq) int64; with `positions` (packed examples) also each input token's position."""
        if positions and self.positions is None:
            raise TensorstowError("positions asked of examples not packed: load them with packing=True")
        per = self.steps_per_epoch(rows)
        if per < 1:
            raise TensorstowError(f"the data holds {len(self)} examples, fewer than one step's {rows} rows "
                                  f"(batch x microbatches)")
        order, epoch = None, -1
        for s in range(start, steps):
            e, k = divmod(s, per)
            if e != epoch:
                order, epoch = self.order(e, seed, shuffle), e
            at = order[k * rows:(k + 1) * rows].numpy()
            x = torch.from_numpy(self.ids[at, :-1].copy())
            y = torch.from_numpy(self.labels[at, 1:].copy())
            if positions:
                yield e, k * rows, x, y, torch.from_numpy(self.positions[at, :-1].copy())
            else:
                yield e, k * rows, x, y


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Windows of `capacity` tokens holding examples of `lengths` (each at most `capacity`), as the
    indices of their examples in packing order: best-fit decreasing as TRL packs (`_pack_bfd`): the
    examples longest first (ties in their order), each into the window whose room is the least that
    holds it (among equal rooms the window that got that room first), else a new window; windows in
    the order they were opened."""
    windows: list[list[int]] = []
    by_room: dict[int, deque] = defaultdict(deque)  # room left -> windows with that room, oldest first
    rooms: list[int] = []  # the rooms some window has, ascending
    for k in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        n = lengths[k]
        if n == 0:  # nothing to pack (TRL drops them too)
            continue
        at = bisect.bisect_left(rooms, n)
        if at < len(rooms):
            room = rooms[at]
            w = by_room[room].popleft()
            if not by_room[room]:
                del rooms[at]
        else:
            room, w = capacity, len(windows)
            windows.append([])
        windows[w].append(k)
        left = room - n
        if left > 0:
            if not by_room[left]:
                bisect.insort(rooms, left)
            by_room[left].append(w)
    return windows


def _counted(wheres, what: str) -> str:
    """`3 examples <what> (first: FILE:LINE)`."""
    n = len(wheres)
    return f"{n} example{'s' if n > 1 else ''} {what} (first: {wheres[0]})"


def _pad_id(tokenizer) -> int:
    if tokenizer is None:
        return 0  # pre-tokenized examples: padded positions are never a label, any id in the vocabulary does
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return 0
