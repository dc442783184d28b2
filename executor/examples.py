"""Fine-tuning data: examples with labels, read from JSONL or a Hugging Face `datasets` directory,
tokenized, cut to the plan's sequence, and the order the steps take them in.

Each line of a JSONL file (or each row of a directory `datasets.Dataset.save_to_disk` wrote) is
one example, in one of three forms:

    {"input_ids": [...], "labels": [...]}   pre-tokenized; labels default to input_ids; a label
                                            equal to the model's ignore index is left out
    {"prompt": str, "completion": str}      ids = tok(prompt) + tok(completion, no special
                                            tokens) + [eos]; labels ignore the prompt's ids
                                            (TRL's completion-only loss)
    {"text": str}                           ids = tok(text) + [eos]; every token is a label

A bad example (not UTF-8, not JSON, a field of the wrong type, an id or label outside the
vocabulary) is refused with where it is: `FILE:LINE` (1-based) or `DIR row N` (0-based), and its
field. `tok` is the model's tokenizer (`AutoTokenizer` of the `hf:` directory, or `--tokenizer DIR`).
Each example is truncated or right-padded to seq + 1 tokens (the tokenizer's pad id, else its
eos; padded labels ignored), or with `packing` the examples are concatenated, each kept whole
with its labels, and cut into windows of seq + 1 tokens (a last partial window is dropped). A
row's input is its first seq tokens, its targets the labels of the last seq: labels are aligned
with input_ids, as Hugging Face models shift them.

Order: epoch e visits the examples in `torch.randperm(n, generator=torch.Generator().manual_seed(
seed + e))` (in file order without shuffling); its optimizer step k takes positions
[k * R, (k + 1) * R) of that order, R the rows of one step (batch x microbatches), in order; a
last partial step is dropped (`drop_last`). Step s of the run is step s mod S of epoch s // S (S
steps an epoch), so a resumed run continues at the very example an uninterrupted one would see.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from tensorstow.errors import TensorstowError

FORMATS = ("input_ids", "prompt", "text")


def is_examples(source: str) -> bool:
    """Whether `--data` names examples (JSONL or a `datasets` directory) rather than tokens."""
    p = Path(source)
    return p.suffix in (".jsonl", ".json") or p.is_dir()


def read_records(source: str) -> list[tuple[str, dict]]:
    """The examples of a JSONL file or a `save_to_disk` directory, as dicts, each with where it is
    from: `FILE:LINE` (1-based) or `DIR row N` (0-based), the prefix of its error messages."""
    p = Path(source)
    if p.is_dir():
        return _read_datasets_dir(source)
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


def _read_datasets_dir(source: str) -> list[tuple[str, dict]]:
    """The rows of a directory `datasets.Dataset.save_to_disk` wrote (of its "train" split for a
    `DatasetDict`), as `read_records` gives them."""
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
    try:
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise TensorstowError(f"data {source} holds splits {sorted(ds)}: pass the directory of one split")
            ds = ds["train"]
        rows = list(ds)  # every row read here: a damaged arrow file fails now, not mid-run
    except TensorstowError:
        raise
    except (OSError, ValueError, KeyError, pyarrow.ArrowException) as e:  # a truncated file, damaged metadata
        first = str(e).splitlines()[0] if str(e) else type(e).__name__  # an OSError's message names its file
        raise TensorstowError(f"data {source}: cannot read the datasets directory ({first}); it is damaged or "
                              f"was not written by save_to_disk: write it again") from None
    # a row lacks a column other rows have as a None in it: drop those, as the row's JSONL line would
    return [(f"{source} row {k}", {c: v for c, v in r.items() if v is not None}) for k, r in enumerate(rows)]


def tokenize(records: list[tuple[str, dict]], tokenizer, ignore: int, vocab: int | None
             ) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each (where, record) (the module docstring's forms): every id in the model's
    vocabulary [0, vocab) (no upper bound with `vocab` None), every label too or `ignore`."""
    out = []
    for where, r in records:
        form = next((f for f in FORMATS if f in r), None)
        if form == "input_ids":
            ids = _token_ids(r["input_ids"], "input_ids", where)
            labels = _token_ids(r["labels"], "labels", where) if "labels" in r else ids
            if len(labels) != len(ids):
                raise TensorstowError(f"{where}: {len(ids)} input_ids but {len(labels)} labels; give one label "
                                      f"per input id")
            _check_vocab(ids, "input_ids", vocab, where)
            if "labels" in r:
                _check_vocab(labels, "labels", vocab, where, ignore=ignore)
        elif form is None or (form == "prompt" and "completion" not in r):
            raise TensorstowError(f"{where}: the example has keys {sorted(r)}: give input_ids (and labels), "
                                  f"prompt and completion, or text")
        else:
            if tokenizer is None:
                raise TensorstowError(f"{where}: the example is text: pass --tokenizer DIR (or plan an hf: model, "
                                      f"whose directory holds its tokenizer)")
            eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
            if form == "prompt":
                prompt = tokenizer(_text(r, "prompt", where))["input_ids"]
                completion = tokenizer(_text(r, "completion", where), add_special_tokens=False)["input_ids"] + eos
                ids, labels = prompt + completion, [ignore] * len(prompt) + completion
            else:
                ids = tokenizer(_text(r, "text", where))["input_ids"] + eos
                labels = list(ids)
            _check_vocab(ids, f"{form} (tokenized)", vocab, where)  # labels are some of the ids
        out.append((ids, labels))
    return out


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

    @staticmethod
    def load(source: str, seq: int, vocab: int | None, *, tokenizer=None, ignore: int = -100,
             packing: bool = False) -> "Examples":
        pairs = tokenize(read_records(source), tokenizer, ignore, vocab)
        width = seq + 1
        if packing:
            ids = np.array([t for i, _ in pairs for t in i], dtype=np.int64)
            labels = np.array([t for _, lab in pairs for t in lab], dtype=np.int64)
            n = len(ids) // width
            if n == 0:
                raise TensorstowError(f"data {source}: {len(ids)} tokens packed make no window of seq + 1 = {width}")
            rows, lab = ids[:n * width].reshape(n, width), labels[:n * width].reshape(n, width)
        else:
            pad = _pad_id(tokenizer)
            rows = np.full((len(pairs), width), pad, dtype=np.int64)
            lab = np.full((len(pairs), width), ignore, dtype=np.int64)
            for k, (i, lb) in enumerate(pairs):
                rows[k, :min(len(i), width)] = i[:width]
                lab[k, :min(len(lb), width)] = lb[:width]
        return Examples(rows, lab, ignore)

    def __len__(self) -> int:
        return len(self.ids)

    def steps_per_epoch(self, rows: int) -> int:
        return len(self) // rows

    def order(self, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
        """The positions of epoch `epoch`'s examples, in the order its steps take them."""
        if not shuffle:
            return torch.arange(len(self))
        return torch.randperm(len(self), generator=torch.Generator().manual_seed(seed + epoch))

    def batches(self, rows: int, steps: int, seed: int, start: int = 0, shuffle: bool = True
                ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(epoch, index of its first example in the epoch, x, y) for steps start..steps-1, x and y
        (rows, seq) int64."""
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
            yield e, k * rows, x, y


def _pad_id(tokenizer) -> int:
    if tokenizer is None:
        return 0  # pre-tokenized examples: padded positions are never a label, any id in the vocabulary does
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return 0
