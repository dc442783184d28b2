"""`tensorstow export STATE_DIR -o OUT_DIR`: the last committed weights as safetensors.

The weights are streamed one buffer at a time out of the state dir's store (never the whole
model in memory): trainable parameters from their fp32 masters (`M:<b>`, or `P:<b>` in fp32
training), frozen ones from their constants (`C:<b>`), under the model's own parameter names
(the `model.` of the loss-contract wrapper dropped for `hf:` models). Shards of at most
`shard_bytes` go to `model-0000k-of-0000n.safetensors` with a `model.safetensors.index.json`
(one file `model.safetensors` when it fits), plus the state dir's `config.json` for `hf:`
models, so `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it. OUT_DIR is written as a
temporary directory and renamed at the end: an interrupted export leaves no half-written
OUT_DIR. The store is opened under its lock, so an `execute` still running on the same state
dir is refused rather than read mid-commit.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from tensorstow.errors import TensorstowError
from tensorstow.executor import state
from tensorstow.executor.aio import aligned_empty
from tensorstow.executor.ssd import SSDStore

SHARD_BYTES = 4 << 30


def _weight_buffers(plan, layout: dict) -> list[tuple[str, list[dict]]]:
    """(buffer, its slots to export) in block order: masters of trainable parameters, then
    the frozen ones; buffers (non-parameters) are not weights."""
    mixed = plan.model.precision != "fp32"
    order = [b.name for b in plan.model.blocks]
    out = []
    for b in order:
        for kind in ("M", "C") if mixed else ("P", "C"):
            buf = f"{kind}:{b}"
            slots = [s for s in layout["buffers"].get(buf, []) if kind != "C" or s["frozen"]]
            if slots:
                out.append((buf, slots))
    return out


def export(state_dir, out_dir, *, shard_bytes: int = SHARD_BYTES) -> dict:
    """Write the committed weights of `state_dir` to `out_dir`; returns a summary. The state dir
    of a multi-process run (`rank<K>/` per GPU) exports as one model at the last step every rank
    committed (a rank one commit ahead is rolled back to it, as a resumed run would)."""
    from safetensors.torch import save_file

    d, out = Path(state_dir), Path(out_dir)
    ranks = sorted((p for p in d.glob("rank*") if p.is_dir() and p.name[4:].isdigit()), key=lambda p: int(p.name[4:]))
    dirs = ranks if ranks and not (d / state.PLAN).exists() else [d]
    described = [state.read(x) for x in dirs]
    if dirs is ranks:
        n = len(described[0][0].hardware.spec.gpus)
        if [x.name for x in ranks] != [f"rank{k}" for k in range(n)]:
            raise TensorstowError(f"export: {d} holds {', '.join(x.name for x in ranks)} but its plan runs on {n} "
                                  f"GPUs (rank0..rank{n - 1}): a rank's state is missing; restore it")
    if out.exists() and any(out.iterdir()):
        raise TensorstowError(f"export: {out} exists and is not empty; choose a new directory")
    stores = []
    try:
        for x, (plan, _) in zip(dirs, described):
            gpu = f"gpu{x.name[4:]}" if x is not d else None
            stores.append(SSDStore(x, state.store_sizes(plan, gpu)))
        steps = [s.committed_step() for s in stores]
        if any(st is None for st in steps):
            raise TensorstowError(f"export: {dirs[steps.index(None)]} holds no committed step yet")
        step = min(steps)
        if max(steps) > step + 1:
            raise TensorstowError(f"export: the ranks' committed steps {steps} are more than one commit apart: "
                                  f"{d} was not written by one run")
        for st in stores:
            if st.committed_step() > step:
                st.rollback()  # committed a step another rank did not: not a step of the run
        tmp = out.with_name(out.name + ".tmp-export")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        prefix = described[0][1]["name_prefix"]
        shards: list[dict[str, torch.Tensor]] = [{}]
        sizes = [0]
        for (plan, layout), store in zip(described, stores):
            for buf, slots in _weight_buffers(plan, layout):
                blob = aligned_empty(store.sizes[buf])
                store.read(buf, blob)
                for s in slots:
                    t = blob[s["offset"]:s["offset"] + s["nbytes"]].view(getattr(torch, s["dtype"]))
                    name = s["name"][len(prefix):] if prefix and s["name"].startswith(prefix) else s["name"]
                    if sizes[-1] and sizes[-1] + s["nbytes"] > shard_bytes:
                        _flush(shards, tmp, save_file)
                        sizes.append(0)
                    shards[-1][name] = t.reshape(s["shape"]).clone()
                    sizes[-1] += s["nbytes"]
        total = _finish(shards, sizes, tmp, save_file)
        if (dirs[0] / state.CONFIG).exists():
            shutil.copyfile(dirs[0] / state.CONFIG, tmp / "config.json")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        for st in stores:
            st.close()
    return {"step": step, "tensors": total, "bytes": sum(sizes), "files": len(sizes)}


def _flush(shards: list[dict], tmp: Path, save_file) -> None:
    """Write the filled shard under a provisional name; _finish renames them all."""
    k = len(shards)
    save_file(shards[-1], str(tmp / f"shard-{k}.safetensors"), metadata={"format": "pt"})
    shards[-1] = {name: None for name in shards[-1]}  # keep the names for the index, drop the data
    shards.append({})


def _finish(shards: list[dict], sizes: list[int], tmp: Path, save_file) -> int:
    n = len(shards)
    save_file(shards[-1], str(tmp / f"shard-{n}.safetensors"), metadata={"format": "pt"})
    if n == 1:
        os.replace(tmp / "shard-1.safetensors", tmp / "model.safetensors")
        return len(shards[0])
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        final = f"model-{k:05d}-of-{n:05d}.safetensors"
        os.replace(tmp / f"shard-{k}.safetensors", tmp / final)
        weight_map.update({name: final for name in shard})
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return len(weight_map)
