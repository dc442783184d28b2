"""Training batches: a token file (nanoGPT's train.bin / .npy) or a seeded synthetic stream.

Sample j = step * batch + b is tokens[j*(T+1) : (j+1)*(T+1)]: x its first T tokens, y its
last T (the next-token targets). Batches are sequential and reproducible.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from tensorstow.errors import TensorstowError


TEXT_SUFFIXES = (".txt", ".text", ".md", ".csv", ".tsv")
"""Files `--data` takes for text, which a token file never is."""


def tokens(source: str, need: int, vocab: int, seed: int = 0) -> np.ndarray:
    """At least `need` token ids: "synthetic" (numpy default_rng(seed), uniform in [0, vocab))
    or a file: `.npy`, else flat little-endian uint16 (nanoGPT's train.bin)."""
    if source == "synthetic":
        return np.random.default_rng(seed).integers(0, vocab, size=need, dtype=np.int64)
    path = Path(source)
    if not path.is_file():
        raise TensorstowError(f"data file {source} does not exist; pass a token file (uint16 .bin "
                              f"or .npy) or 'synthetic'")
    if path.suffix.lower() in TEXT_SUFFIXES:  # read as uint16 it would be noise in the vocabulary's range
        raise TensorstowError(f"data file {source} is text, not token ids: write it as JSONL examples "
                              f"({{\"text\": ...}} a line, tokenized with the model's tokenizer; docs/training.md) "
                              f"or tokenize it into a .npy / uint16 .bin file")
    try:
        data = np.load(path, mmap_mode="r") if path.suffix == ".npy" else np.memmap(path, dtype="<u2", mode="r")
    except (ValueError, OSError) as e:
        raise TensorstowError(f"data file {source}: cannot read it as tokens ({e})") from None
    if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
        raise TensorstowError(f"data file {source}: expected a flat array of integer token ids, "
                              f"got {data.dtype} with shape {data.shape}")
    if len(data) < need:
        raise TensorstowError(f"data file {source} holds {len(data)} tokens but {need} are needed "
                              f"(steps x batch x (seq+1)); use fewer steps, a smaller batch/seq, or more data")
    return data[:need]


def batches(source: str, batch: int, seq: int, vocab: int, steps: int,
            seed: int = 0, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) pairs of int64 tensors of shape (batch, seq) for steps start..steps-1 (a resumed
    run continues with the very samples an uninterrupted one would have seen)."""
    if min(batch, seq, vocab, steps) < 1:
        raise TensorstowError(f"batch, seq, vocab and steps must be >= 1 (got {batch}, {seq}, {vocab}, {steps})")
    per = batch * (seq + 1)
    data = tokens(source, steps * per, vocab, seed)
    for step in range(start, steps):
        rows = np.array(data[step * per:(step + 1) * per], dtype=np.int64).reshape(batch, seq + 1)
        hi = int(rows.max())
        if hi >= vocab or int(rows.min()) < 0:
            raise TensorstowError(f"data {source}: token id {hi} at step {step} is outside the model's "
                                  f"vocabulary [0, {vocab}); the file was tokenized for another model")
        t = torch.from_numpy(rows)
        yield t[:, :-1].contiguous(), t[:, 1:].contiguous()
