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

`tok` is the model's tokenizer (`AutoTokenizer` of the `hf:` directory, or `--tokenizer DIR`).
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


def read_records(source: str) -> list[dict]:
    """The examples of a JSONL file or a `save_to_disk` directory, as dicts."""
    p = Path(source)
    if p.is_dir():
        try:
            import datasets
        except ImportError:
            raise TensorstowError(f"data {source} is a directory: reading a `datasets` directory needs the "
                                  f"datasets package (pip install 'tensorstow[hf]')") from None
        try:
            ds = datasets.load_from_disk(str(p))
        except (FileNotFoundError, ValueError) as e:
            raise TensorstowError(f"data {source}: not a directory `datasets` save_to_disk wrote ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise TensorstowError(f"data {source} holds splits {sorted(ds)}: pass the directory of one split")
            ds = ds["train"]
        return [dict(r) for r in ds]
    if not p.is_file():
        raise TensorstowError(f"data file {source} does not exist")
    out = []
    with open(p) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TensorstowError(f"{source}:{line_no}: not a JSON object ({e.msg})") from None
            if not isinstance(rec, dict):
                raise TensorstowError(f"{source}:{line_no}: expected a JSON object, got {type(rec).__name__}")
            out.append(rec)
    if not out:
        raise TensorstowError(f"data file {source} holds no examples")
    return out


def tokenize(records: list[dict], tokenizer, ignore: int, where: str) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each record (the module docstring's forms)."""
    out = []
    for k, r in enumerate(records):
        form = next((f for f in FORMATS if f in r), None)
        if form == "input_ids":
            ids = [int(t) for t in r["input_ids"]]
            labels = [int(t) for t in r.get("labels", ids)]
            if len(labels) != len(ids):
                raise TensorstowError(f"{where}: example {k} has {len(ids)} input_ids but {len(labels)} labels")
        elif form is None or (form == "prompt" and "completion" not in r):
            raise TensorstowError(f"{where}: example {k} has keys {sorted(r)}: give input_ids (and labels), "
                                  f"prompt and completion, or text")
        else:
            if tokenizer is None:
                raise TensorstowError(f"{where}: example {k} is text: pass --tokenizer DIR (or plan an hf: model, "
                                      f"whose directory holds its tokenizer)")
            eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
            if form == "prompt":
                prompt = tokenizer(r["prompt"])["input_ids"]
                completion = tokenizer(r["completion"], add_special_tokens=False)["input_ids"] + eos
                ids, labels = prompt + completion, [ignore] * len(prompt) + completion
            else:
                ids = tokenizer(r["text"])["input_ids"] + eos
                labels = list(ids)
        out.append((ids, labels))
    return out


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
        pairs = tokenize(read_records(source), tokenizer, ignore, source)
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
        if vocab is not None and (int(rows.max()) >= vocab or int(rows.min()) < 0):
            bad = int(rows.max()) if int(rows.max()) >= vocab else int(rows.min())
            raise TensorstowError(f"data {source}: token id {bad} is outside the model's vocabulary [0, {vocab}); "
                                  f"tokenize it with the model's tokenizer")
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
