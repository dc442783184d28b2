"""What a state dir records of its run, so that a resume is the same run or is refused.

`run.json` holds the run's inputs as its first step saw them: the training data's identity (its
path and a hash of what the run reads: the tokenized examples, or the token file's prefix),
packing, the order's seed and shuffling, the run's length, the learning-rate schedule and the
evaluation's data and cadence. A resume compares the inputs it is given with the record and
refuses, before any step and writing nothing, where one differs, naming each difference and the
group that accepts it. `execute --resume-changed GROUP,...` accepts these groups:

    data      another training set, tokenization or packing: step s takes the rows the new data
              puts at step s of its own order; the rows already trained are not revisited
    order     another --seed or --shuffle: the rest of the run follows the new order, so some of
              the current epoch's examples may be seen twice and others not at all
    length    another --steps or --epochs under a linear or cosine schedule: the run ends at the
              new length; the schedule keeps the length it was made for (past its end the rate
              stays at its last value), unless `schedule` is accepted too. Under a constant rate
              (with or without warmup) a run of another length is the same run: no difference
    schedule  another --lr, --lr-scheduler, --warmup-steps or --min-lr-ratio (or a re-plan that
              changes only these): from the next update on the rate is the new schedule's at the
              updates already taken, over the run's present length (the rate may jump)
    eval      another --eval-data, --eval-every or --eval-batches: evaluations from now on follow
              them; those already recorded stay

An accepted change is written into the record, with the step it came in at (`changes`), so the
next resume compares against it.

`evals.json` holds the evaluation after each committed step that had one: a resume drops those
of steps it will train again, and runs the one its last committed step is owed before it trains
on (a run stopped during an evaluation owes it), or at the end, the final one.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from tensorstow.errors import TensorstowError

FORMAT = "tensorstow-run"
GROUPS = {"data": ("data", "packing"), "order": ("seed", "shuffle"), "length": ("steps",),
          "schedule": ("lr_scheduler", "lr", "warmup_steps", "min_lr_ratio"),
          "eval": ("eval_data", "eval_every")}
"""`--resume-changed` groups -> the recorded inputs each accepts a change of."""
REQUIRED = {k for keys in GROUPS.values() for k in keys} | {"schedule_steps"}
"""The keys a run record's inputs must have."""
SPANNING = {"linear", "cosine"}
"""Schedules whose rate at a step depends on the run's length (executor.lr)."""
FLAGS = {"data": "--data", "packing": "plan --packing", "seed": "--seed", "shuffle": "--shuffle", "steps": "--steps/--epochs",
         "lr_scheduler": "--lr-scheduler", "lr": "--lr", "warmup_steps": "--warmup-steps",
         "min_lr_ratio": "--min-lr-ratio", "eval_data": "--eval-data/--eval-batches", "eval_every": "--eval-every"}


CHUNK = 1 << 24
"""Elements hashed at a time: a token file's memory map is read in pieces, never copied whole."""


def digest(*arrays: np.ndarray) -> str:
    """XXH3-64 of the arrays' dtypes, shapes and elements, as 16 hex digits."""
    h = xxhash.xxh3_64()
    for a in arrays:
        h.update(repr((a.dtype.str, a.shape)).encode())
        flat = a.reshape(-1)
        for at in range(0, flat.size, CHUNK):
            h.update(memoryview(np.ascontiguousarray(flat[at:at + CHUNK])).cast("B"))
    return f"{h.intdigest():016x}"


@dataclass(frozen=True)
class DataId:
    """What a run reads of its data, as the record compares it."""
    record: dict
    """JSON: the source, its size, how many rows (examples, or tokens) the run reads and their hash."""
    prefix: Callable[[int], str] | None = None
    """A token file's hash of its first n tokens (the record of a run of another length read
    another prefix of the same file); None for examples, which are read whole."""

    def same(self, old: dict | None) -> bool:
        """Whether `old` (a recorded `record`) names the same rows; the source's path and size are
        not compared (a copy of the file elsewhere is the same data)."""
        old = old or {}
        if self.prefix is not None and old.get("kind") == "tokens" and old.get("tokens") != self.record["tokens"]:
            n = old.get("tokens")
            try:
                return isinstance(n, int) and self.prefix(n) == old.get("xxh3")
            except TensorstowError:  # the file holds fewer tokens than the recorded run read
                return False
        return all(old.get(k) == self.record.get(k) for k in ("kind", "examples", "batches", "tokens", "xxh3"))


def describe(d: dict | None) -> str:
    """A data identity for a message: `train.jsonl (40 examples, xxh3 0123...)`."""
    if d is None:
        return "none"
    if d.get("kind") == "synthetic":
        return "synthetic"
    rows = next(f"{d[k]} {k}" for k in ("examples", "batches", "tokens") if k in d)
    return f"{d.get('source')} ({rows}, xxh3 {str(d.get('xxh3'))[:8]})"


def inputs(run, steps: int, data: DataId, eval_data: DataId | None, schedule, packing: bool = False) -> dict:
    """The record of a run's inputs: `run` (schema.run.Run), its length in optimizer steps, the
    identities of its training and held-out data, its learning-rate schedule (executor.lr), whether
    its plan packs examples (`Options.packing`)."""
    examples = data.record["kind"] == "examples"
    return {"data": data.record, "packing": packing if examples else None,
            "shuffle": run.shuffle if examples else None,
            "seed": run.seed, "steps": steps,
            "epochs": run.epochs, "lr_scheduler": schedule.name, "lr": schedule.lr,
            "warmup_steps": schedule.warmup_steps, "min_lr_ratio": schedule.min_lr_ratio,
            "schedule_steps": schedule.total_steps, "eval_data": None if eval_data is None else eval_data.record,
            "eval_every": run.eval_every if eval_data is not None else 0}


def accepted(text: str | None) -> set[str]:
    """`--resume-changed`'s groups."""
    if not text:
        return set()
    got = {g.strip() for g in text.split(",") if g.strip()}
    unknown = sorted(got - set(GROUPS))
    if unknown:
        raise TensorstowError(f"--resume-changed: unknown group(s) {', '.join(unknown)}; the groups are "
                              f"{', '.join(GROUPS)} (docs/training.md, Resuming)")
    return got


def differences(old: dict, new: dict, data: DataId, eval_data: DataId | None) -> dict[str, str]:
    """Recorded input -> "old -> new", for each that differs."""
    out = {}
    for keys in GROUPS.values():
        for k in keys:
            a, b = old.get(k), new.get(k)
            if k in ("data", "eval_data"):
                now = data if k == "data" else eval_data
                if (a is None) != (now is None) or (now is not None and not now.same(a)):
                    out[k] = f"{describe(a)} -> {describe(b)}"
            elif k == "steps" and not {old.get("lr_scheduler"), new.get("lr_scheduler")} & SPANNING:
                continue  # a rate that does not depend on the run's length: a longer run is the same run
            elif a != b:
                out[k] = f"{a} -> {b}"
    return out


def settle(d: Path, new: dict, step: int | None, text: str | None, data: DataId, eval_data: DataId | None,
           out, write: bool = True) -> int:
    """Check a run against state dir `d`'s record (`step`: its committed step, None for a run not
    yet begun) and, with `write`, write the record where the run begins or accepts a change.
    Returns the length the learning-rate schedule spans (the recorded one, unless `schedule` is
    accepted)."""
    groups = accepted(text)
    path = d / "run.json"
    old = read(d)
    if step is None or old is None:
        if step:  # trained steps, and no record: a state dir of an older release, nothing to compare with
            print(f"state dir {d} has no record of its run's inputs (an older tensorstow wrote it): recorded "
                  f"this run's; a resume from now on is checked against them", file=out)
        if write:
            _write(path, {"format": FORMAT, "version": 1, "inputs": new, "changes": []})
        return new["schedule_steps"]
    diff = differences(old["inputs"], new, data, eval_data)
    refused = {k: v for k, v in diff.items() if not any(k in GROUPS[g] for g in groups)}
    if refused:
        need = sorted({g for g, keys in GROUPS.items() for k in diff if k in keys})
        raise TensorstowError(
            f"state dir {d} holds a run with other inputs ({'; '.join(f'{FLAGS[k]} {v}' for k, v in diff.items())}): "
            f"resume with the inputs it was started with, or accept the change with --resume-changed "
            f"{','.join(need)} (docs/training.md, Resuming), or start over with --restart")
    was = old["inputs"]
    total = new["steps"] if "schedule" in groups else was["schedule_steps"]
    now = {**new, "schedule_steps": total}
    changes = old["changes"]
    if diff and write:
        print(f"resuming with changed inputs ({'; '.join(f'{FLAGS[k]} {v}' for k, v in diff.items())}), accepted "
              f"by --resume-changed {','.join(sorted(groups))}", file=out)
        changes = [*changes, {"step": step, "accepted": sorted(groups), "was": {k: was.get(k) for k in diff}}]
    if now != was and write:  # also a length a constant rate does not see, or the same data elsewhere: recorded as it is now
        _write(path, {**old, "inputs": now, "changes": changes})
    return total


def read(d: Path) -> dict | None:
    """State dir `d`'s run record; None where it has none."""
    path = d / "run.json"
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TensorstowError(f"state dir {d}: {path.name} is unreadable ({e}); it was damaged: resume with "
                              f"--restart to start over") from None
    inputs = rec.get("inputs") if isinstance(rec, dict) else None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT or not isinstance(inputs, dict) \
            or not isinstance(rec.get("changes"), list) or not REQUIRED <= set(inputs) \
            or not isinstance(inputs["data"], dict) or not isinstance(inputs["schedule_steps"], int) \
            or not (inputs["eval_data"] is None or isinstance(inputs["eval_data"], dict)):
        raise TensorstowError(f"state dir {d}: {path.name} is not a tensorstow run record; it was damaged or "
                              f"edited: resume with --restart to start over")
    return rec


def _write(path: Path, rec) -> None:
    from tensorstow.executor.statedir import write_atomic
    write_atomic(path, json.dumps(rec, indent=1, sort_keys=True) + "\n")


class Evals:
    """The evaluations a state dir recorded, by step (`evals.json`); without a state dir, in memory."""

    def __init__(self, d: Path | None, committed: int):
        self.path = None if d is None else d / "evals.json"
        self.rows: dict[int, dict] = {}
        if self.path is not None and self.path.exists():
            try:
                rows = json.loads(self.path.read_text())
                self.rows = {int(r["step"]): r for r in rows if int(r["step"]) <= committed}
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
                raise TensorstowError(f"state dir {d}: evals.json is unreadable ({e}); it was damaged: delete it to "
                                      f"resume without its records (the evaluation the last committed step is owed "
                                      f"runs again), or start over with --restart") from None

    def owed(self, step: int, steps: int, every: int) -> bool:
        """Whether an evaluation belongs after `step` and is not recorded."""
        due = (every and step % every == 0) or step == steps
        return bool(step) and bool(due) and step not in self.rows

    def add(self, row: dict) -> None:
        self.rows[row["step"]] = row
        if self.path is not None:
            _write(self.path, [self.rows[k] for k in sorted(self.rows)])


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")
