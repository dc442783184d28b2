"""Traces kept within a process, for the models tensorstow builds itself from a reference.

Tracing a model's training step (`ir.trace`) takes seconds: `aot_function`'s joint capture runs
the step twice through fake tensors, 1.3-2 s for a 3-layer LLaMA on a 2-core machine. One process
often traces one model more than once: `tensorstow.plan` and then `tensorstow.Executor` of its
plan, several plans of one model (policies, budgets, batch sizes), a resumed `Executor`.

A trace is a function of the model's code and of what the model is built from. The code of
tensorstow, torch and transformers does not change within a process, so a model built from a
preset or from an `hf:` directory is determined by the preset's configuration or by the
directory's files, and the key holds those (`source_of`). A factory's model is not determined by
anything tensorstow can see (its code may read files, the environment or a global), so it is
traced every time; so is a model given as an object.

A `Traced` is shared, not copied: nothing changes it after `ir.trace` returns it (the IR is
frozen; the executor and the planner only read the joint graph).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable

import torch

KEPT = 8
"""Traces kept per process; the least recently used is dropped first."""

_kept: OrderedDict[tuple, object] = OrderedDict()

_READ = (".json", ".py")
"""Files of an `hf:` directory kept by their bytes (its configuration and any code beside it);
the others (weights, tokenizer data) by name, size and modification time."""


def source_of(spec) -> tuple | None:
    """What a model built from `spec` (an `ir.models.ModelSpec`) is made of besides code: a
    preset's configuration, an `hf:` directory's files, the LoRA and quantization options; None
    for a factory (traced every time)."""
    from tensorstow.ir import hf
    options = (spec.name, spec.lora, spec.quantize, spec.quantize_skip, torch.get_default_dtype())
    if spec.config is not None:
        return ("preset", spec.config, *options)
    if not spec.name.startswith(hf.PREFIX):
        return None
    files = []
    for f in sorted(hf.check_dir(spec.name).iterdir()):
        if not f.is_file():
            continue
        if f.suffix in _READ:
            files.append((f.name, hashlib.sha256(f.read_bytes()).hexdigest()))
        else:
            st = f.stat()
            files.append((f.name, st.st_size, st.st_mtime_ns))
    return ("hf", tuple(files), *options)


def traced_once(spec, inputs: tuple, trace: Callable[[], object]):
    """`trace()` of the model built from `spec` (None: a model built otherwise), or what it
    returned before in this process for the same source (`source_of`) and `inputs` (what the trace
    is given besides the model). A trace that raises is not kept."""
    source = None if spec is None else source_of(spec)
    if source is None:
        return trace()
    key = (source, *inputs)
    if key in _kept:
        _kept.move_to_end(key)
        return _kept[key]
    traced = _kept[key] = trace()
    while len(_kept) > KEPT:
        _kept.popitem(last=False)
    return traced


def forget() -> None:
    """Drop every kept trace."""
    _kept.clear()
