"""The state dir: a self-describing, crash-consistent checkpoint of one plan's training.

    STATE_DIR/plan.json     the plan it trains (a second plan is refused)
    STATE_DIR/layout.json   what each persistent buffer holds: tensors, dtypes, offsets, names
    STATE_DIR/config.json   the Hugging Face config, for `hf:` models (export hands it on)
    STATE_DIR/MANIFEST, *.slot0|1, LOCK    the SSD store (executor/ssd.py)

The store holds every buffer that lives across steps (P, C, M, OS, wherever their home tier
is) and every buffer the plan moves to SSD, plus the random-number generator state (`RNG`), so
resuming from any committed step gives the bits an uninterrupted run gives. SSD-resident
buffers are the store's own; a DRAM- or GPU-resident buffer is written at each checkpoint.
Constants (C) are written once, at step 0.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from tensorstow.errors import TensorstowError
from tensorstow.executor.amp import AMP
from tensorstow.schema.plan import Plan, as_plan
from tensorstow.schema.schedule import block_gpus

PLAN, LAYOUT, CONFIG, ADAPTER_CONFIG = "plan.json", "layout.json", "config.json", "adapter_config.json"
RNG = "RNG"
"""Store buffer holding the CPU generator state (and CUDA's, with a GPU) at the commit."""


def rng_bytes() -> torch.Tensor:
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if torch.cuda.is_available() else [])
    return torch.cat(states)


def set_rng(blob: torch.Tensor) -> None:
    cpu = torch.get_rng_state().numel()
    torch.set_rng_state(blob[:cpu].clone())
    if torch.cuda.is_available() and blob.numel() > cpu:
        torch.cuda.set_rng_state(blob[cpu:].clone())


def store_sizes(plan: Plan, gpu: str | None = None) -> dict[str, int]:
    """Every buffer the store holds: the training state (`plan.persistent()`), what the plan
    moves to SSD, the RNG, and for fp16-mixed the loss scaler's state. `gpu`: of a multi-GPU
    plan, only the buffers of the blocks that GPU's process runs (its rank's store)."""
    plan = as_plan(plan)
    names = set(plan.persistent()) | set(plan.ssd_sizes())
    if gpu is not None:
        own = block_gpus(plan)
        names = {n for n in names if own[plan.buffers[n].block] == gpu}
    sizes = {n: plan.buffers[n].bytes for n in sorted(names)}
    sizes[RNG] = rng_bytes().numel()
    if plan.model.precision == "fp16-mixed":
        sizes[AMP] = 16  # the loss scaler (executor.amp)
    return sizes


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_atomic(path: Path, text: str) -> None:
    """Create `path` holding `text`, whole or not at all, unless it exists: written under a name
    of this call's own, then linked into place (a link fails where the name exists), so two
    processes claiming one directory at once never see a torn file or each other's temporary."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.unlink(tmp)


def fingerprint(plan: Plan) -> str:
    """The plan's fingerprint as its state dir's store records it (`SSDStore(owner=...)`): XXH3-64 of
    its file's text, so any change to the plan (options, decisions, schedule) is another owner."""
    import xxhash
    return f"{xxhash.xxh3_64_intdigest(plan.dumps().encode()):016x}"


def clear(state_dir) -> None:
    """`execute --restart`: remove what tensorstow keeps in `state_dir` (the store's files, the plan
    and the description; nothing else), so it starts over there."""
    from tensorstow.executor.ssd import OWN_FILE
    d = Path(state_dir)
    if not d.is_dir():
        return
    for p in d.iterdir():
        if p.is_file() and OWN_FILE.fullmatch(p.name) and p.name != "LOCK":
            try:
                p.unlink()
            except OSError as e:
                raise TensorstowError(f"--restart: cannot delete {p}: {e.strerror or e}") from None


def claim(state_dir, plan: Plan) -> Path:
    """Make `state_dir` the home of `plan`'s training, or check that it already is."""
    d = Path(state_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TensorstowError(f"cannot create the state dir {d}: {e.strerror or e}") from None
    text = plan.dumps()
    held = d / PLAN
    if not held.exists():
        _create_atomic(held, text)  # two claims at once: one creates it, the other reads it below
    try:
        old = json.loads(held.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TensorstowError(f"state dir {d}: {PLAN} is unreadable ({e}); it is not a tensorstow state "
                              f"dir, or it was damaged") from None
    if old != json.loads(text):
        raise TensorstowError(
            f"state dir {d} trains another plan ({old.get('model', {}).get('name')}, policy "
            f"{old.get('decisions', {}).get('policy')}, fingerprint {old.get('model', {}).get('fingerprint')}); "
            f"use an empty --state-dir, or execute the plan it holds ({held})")
    return d


def write_description(d: Path, layouts: dict, names: dict[str, str], frozen: set[str], prefix: str,
                      hf_config=None, peft=None) -> None:
    """layout.json (and config.json for an `hf:` model; for a PEFT model its adapter_config.json
    and, in the layout, its adapter's name), unless already there. `peft`: (adapter name, its
    config as a dict)."""
    if peft is not None and not (d / ADAPTER_CONFIG).exists():
        _write_atomic(d / ADAPTER_CONFIG, json.dumps(peft[1], indent=2, sort_keys=True, default=_jsonable) + "\n")
    desc = {"name_prefix": prefix, "buffers": {}, **({"peft_adapter": peft[0]} if peft else {})}
    for buf, layout in sorted(layouts.items()):
        desc["buffers"][buf] = [
            {"key": s.key, "name": names.get(s.key, s.key), "dtype": str(s.dtype).replace("torch.", ""),
             "shape": list(s.shape), "offset": s.offset, "nbytes": s.nbytes,
             "frozen": names.get(s.key, s.key) in frozen}
            for s in layout.slots.values()]
    text = json.dumps(desc, indent=1, sort_keys=True) + "\n"
    try:
        held = (d / LAYOUT).read_text()
    except (OSError, UnicodeDecodeError):
        held = None
    if held != text:  # missing, damaged or edited: it is derived from the plan, so written again
        _write_atomic(d / LAYOUT, text)
    if hf_config is not None and not (d / CONFIG).exists():
        _write_atomic(d / CONFIG, hf_config.to_json_string())


def _jsonable(v):
    """PEFT configs hold sets (target_modules) and enums: as PEFT writes them, a sorted list, a value."""
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    return getattr(v, "value", str(v))


def read(d) -> tuple[Plan, dict]:
    """(plan, layout) of a state dir, with one clear error if it is not one."""
    d = Path(d)
    if not (d / PLAN).is_file() or not (d / LAYOUT).is_file():
        raise TensorstowError(f"{d} is not a tensorstow state dir (no {PLAN} / {LAYOUT}); pass the --state-dir "
                              f"of a `tensorstow execute` run")
    try:
        layout = json.loads((d / LAYOUT).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TensorstowError(f"state dir {d}: {LAYOUT} is unreadable ({e}); it was damaged") from None
    return Plan.load(d / PLAN), layout
