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
import math
import os
import re
import shutil
import stat
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from tensorstow.errors import TensorstowError
from tensorstow.executor import statedir
from tensorstow.executor.aio import aligned_empty
from tensorstow.executor.ssd import SSDStore
from tensorstow.ir.graph import numel
from tensorstow.ir.hf import without_base_layers
from tensorstow.ir.quant import PARTS, Quantization, dequantized
from tensorstow.schema.schedule import BufferKind, block_of, buffer_kind, member_rows, parent_of, units_by_block

SHARD_BYTES = 4 << 30


def _weight_buffers(plan, layout: dict) -> list[tuple[str, list[dict]]]:
    """(buffer, its slots to export) in block order: masters of trainable parameters, then
    the frozen ones; buffers (non-parameters) are not weights."""
    mixed = plan.model.precision != "fp32"
    order = [b.name for b in plan.model.blocks]
    out = []
    units = units_by_block(block_of(n) for n in layout["buffers"])
    for b in order:
        for kind in ("M", "C") if mixed else ("P", "C"):
            for buf in (f"{kind}:{b}", *(f"{kind}:{u}" for u in units.get(b, ()))):  # a block's units: its expert rows
                slots = [s for s in layout["buffers"].get(buf, []) if kind != "C" or s["frozen"]]
                if slots:
                    out.append((buf, slots))
    return out


def export(state_dir, out_dir, *, shard_bytes: int = SHARD_BYTES, merge: bool = False, tokenizer: str | None = None,
           chat_template: str | None = None) -> dict:
    """Write the committed weights of `state_dir` to `out_dir`; returns a summary. The state dir
    of a multi-process run (`rank<K>/` per GPU) exports as one model at the last step every rank
    committed (a rank one commit ahead is rolled back to it, as a resumed run would). A PEFT
    (LoRA) model exports as its adapter (`adapter_config.json` + `adapter_model.safetensors`,
    for `PeftModel.from_pretrained` onto the base), or with `merge` as the base model with the
    adapters merged into its weights (`from_pretrained`). The tokenizer goes beside the weights,
    so the export is a whole checkpoint: `tokenizer` (a directory), else the `hf:` model's
    directory where it holds one, saved by `save_pretrained` with `chat_template` (a Jinja file)
    as its chat template where given (a run's `--chat-template`)."""
    from safetensors.torch import save_file

    d, out = Path(state_dir), Path(out_dir)
    dirs, described = _described(d)
    dp = described[0][0].decisions.dp
    if out.exists() and any(out.iterdir()):
        raise TensorstowError(f"export: {out} exists and is not empty; choose a new directory")
    stores, tmp = [], None
    try:
        step = _open_at_one_step(d, dirs, [plan for plan, _ in described], stores)
        tmp = out.with_name(out.name + ".tmp-export")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        layout0 = described[0][1]
        prefix, adapter = layout0["name_prefix"], layout0.get("peft_adapter")
        peft = statedir.described_file(dirs[0], layout0, statedir.ADAPTER_CONFIG) if adapter else None
        hf = (dirs[0] / statedir.CONFIG).exists() or statedir.CONFIG in layout0.get("files", {})
        config = statedir.described_file(dirs[0], layout0, statedir.CONFIG) if hf else None
        if merge and peft is None:
            raise TensorstowError(f"export --merge: {d} trains no PEFT (LoRA) model; export it without --merge")
        shards: list[dict[str, torch.Tensor]] = [{}]
        sizes = [0]
        merger = (_Merger(adapter, peft, described[0][0].options.quantize,
                          peft_layers(dirs[0], peft, adapter) if hf else None) if merge else None)
        every = ([_blocks(plan, layout, store, prefix) for (plan, layout), store in zip(described, stores)] if dp == 1
                 else [_gathered_blocks(described, stores, prefix)])
        for blocks in every:
            for block in blocks:
                    if peft is not None:
                        block = merger(block) if merge else _adapter(block, adapter)
                    _check_names(block, d, adapter=peft is not None and not merge)
                    for name, t in block.items():
                        n = t.numel() * t.element_size()
                        if sizes[-1] and sizes[-1] + n > shard_bytes:
                            _flush(shards, tmp, save_file)
                            sizes.append(0)
                        shards[-1][name] = t
                        sizes[-1] += n
        if merger is not None:
            merger.close()
        if peft is not None and not merge:  # PEFT's adapter files
            total = len(shards[0])
            if len(shards) > 1:
                raise TensorstowError("export: the adapter is larger than --shard-size; raise it")
            save_file(shards[0], str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
            shutil.copyfile(dirs[0] / statedir.ADAPTER_CONFIG, tmp / "adapter_config.json")
        else:
            total = _finish(shards, sizes, tmp, save_file)
            if config is not None:  # merged: full-precision weights, whatever the base was stored as
                config.pop("quantization_config", None)
                (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        told = _save_tokenizer(tokenizer, chat_template, described[0][0], tmp)
        _give_new_file_mode(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        if tmp is not None:  # an export that failed leaves nothing behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for st in stores:
            st.close()
    return {"step": step, "tensors": total, "bytes": sum(sizes), "files": len(sizes), "tokenizer": told}


def _described(d: Path) -> tuple[list[Path], list[tuple]]:
    """The state dirs of state dir `d` (itself, or a multi-process run's `rank<K>/`, every one) and
    the (plan, layout) each holds; one error where a rank is missing or `d` holds both kinds."""
    ranks = statedir.rank_dirs(d)
    if ranks and (d / statedir.PLAN).exists():
        raise TensorstowError(f"export: {d} holds a one-process run ({statedir.PLAN}) and a run of several processes "
                              f"({ranks[0].name}/ ...), written by two runs: move one of them to a directory of its own")
    dirs = ranks or [d]
    described = [statedir.read(x) for x in dirs]
    plan = described[0][0]
    if ranks:
        n = plan.decisions.dp if plan.decisions.dp > 1 else len(plan.hardware.spec.gpus)
        if [x.name for x in ranks] != [f"rank{k}" for k in range(n)]:
            raise TensorstowError(f"export: {d} holds {', '.join(x.name for x in ranks)} but its plan runs on {n} "
                                  f"GPUs (rank0..rank{n - 1}): a rank's state is missing; restore it")
    return dirs, described


def _save_tokenizer(source: str | None, chat_template: str | None, plan, out: Path) -> str | None:
    """The tokenizer of `source` (else of the plan's `hf:` directory, where it has one) saved into
    `out` with `chat_template`'s text as its template; returns where it came from (None: none)."""
    from tensorstow.ir.hf import PREFIX, check_tokenizer_dir, has_tokenizer
    model = plan.options.model
    if source is None and model.startswith(PREFIX) and has_tokenizer(Path(model[len(PREFIX):])):
        source = model[len(PREFIX):]
    if source is None:
        if chat_template is not None:
            raise TensorstowError("export --chat-template: there is no tokenizer to give it to; pass --tokenizer DIR")
        return None
    check_tokenizer_dir(source, "export --tokenizer")
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # OSError, ValueError: no tokenizer there, or a damaged one
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TensorstowError(f"export: cannot load the tokenizer of {source} ({first}); pass --tokenizer DIR") from None
    if chat_template is not None:
        try:
            tok.chat_template = Path(chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TensorstowError(f"export --chat-template {chat_template}: cannot read it "
                                  f"({getattr(e, 'strerror', None) or e})") from None
    tok.save_pretrained(out)
    return source


def _open_at_one_step(d: Path, dirs: list[Path], plans: list, stores: list[SSDStore]) -> int:
    """Open the store of each of `dirs` (a state dir, or a multi-process run's `rank<K>/`) into
    `stores` (the caller closes them), read-only, at the last step every one committed: a rank one
    commit ahead is rolled back to it, as a resumed run would. Returns that step."""
    def store(k: int, read_only: bool) -> SSDStore:
        gpu = None if dirs[k] == d else "gpu0" if plans[k].decisions.dp > 1 else f"gpu{dirs[k].name[4:]}"
        return SSDStore(dirs[k], statedir.store_sizes(plans[k], gpu), owner=statedir.fingerprint(plans[k]),
                        read_only=read_only)

    # read-only: an export changes nothing in the state dir, which may be read-only to it
    for k in range(len(dirs)):  # one at a time: those opened are closed by the caller if another fails
        stores.append(store(k, read_only=True))
    steps = [s.committed_step() for s in stores]
    if any(st is None for st in steps):
        raise TensorstowError(f"export: {dirs[steps.index(None)]} holds no committed step yet")
    step = min(steps)
    if max(steps) > step + 1:
        raise TensorstowError(f"export: the ranks' committed steps {steps} are more than one commit apart: "
                              f"{d} was not written by one run")
    for k, st in enumerate(stores):
        if st.committed_step() > step:  # committed a step another rank did not: not a step of the run
            st.close()
            stores[k] = store(k, read_only=False)
            stores[k].rollback()
    return step


def _give_new_file_mode(tmp: Path) -> None:
    """Give each file in `tmp` the mode a file `open()` creates there gets (0o666 & ~umask):
    safetensors writes through a private temporary file, which leaves it 0o600. That mode is
    read off `tmp`, a directory `mkdir` just made with 0o777 & ~umask: reading the umask itself
    means setting it (`os.umask`), which changes it for every thread of the process meanwhile."""
    mode = stat.S_IMODE(tmp.stat().st_mode) & 0o666
    for f in tmp.iterdir():
        f.chmod(mode)


def _blocks(plan, layout: dict, store, prefix: str):
    """Per block, in forward order, its weights by name ({name: tensor}): read one buffer at a
    time, so only one block's weights are in memory."""
    current, out, rows = None, {}, {}

    def whole() -> dict:  # the units' rows of each expert weight, put together
        return {**out, **{n: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for n, parts in rows.items()}}
    for buf, slots in _weight_buffers(plan, layout):  # a block's buffers (its units' after them) come one after another
        b = parent_of(block_of(buf))
        if b != current and (out or rows):
            yield whole()
            out, rows = {}, {}
        current = b
        blob = aligned_empty(store.sizes[buf])
        store.read(buf, blob)
        for s in slots:
            t = blob[s["offset"]:s["offset"] + s["nbytes"]].view(getattr(torch, s["dtype"]))
            name, at = member_rows(s["name"][len(prefix):] if prefix and s["name"].startswith(prefix) else s["name"])
            if at is None:
                out[name] = t.reshape(s["shape"]).clone()
            else:
                rows.setdefault(name, []).append((at, t.reshape(s["shape"]).clone()))
    if out or rows:
        yield whole()


def _gathered_blocks(described: list, stores: list, prefix: str):
    """A data-parallel run's blocks (`_blocks`) with each trained weight put together from the
    ranks' shards of its master (whole rows, rank after rank, the last ones' padding cut; the
    shape is its compute copy's, P); fp32 runs keep P whole on every rank, so rank 0's is read."""
    plan, layout = described[0]
    if plan.model.precision == "fp32":
        yield from _blocks(plan, layout, stores[0], prefix)
        return
    shapes = {member_rows(s["name"][len(prefix):] if prefix and s["name"].startswith(prefix) else s["name"])[0]:
              s["shape"] for buf, slots in layout["buffers"].items() if buffer_kind(buf) == BufferKind.P for s in slots}
    for parts in zip(*(_blocks(p, lay, st, prefix) for (p, lay), st in zip(described, stores))):
        out = dict(parts[0])
        for name, t in parts[0].items():
            if name in shapes and list(t.shape) != shapes[name]:
                whole = torch.cat([part[name].reshape(-1) for part in parts])
                out[name] = whole[:numel(shapes[name])].reshape(shapes[name]).clone()
        yield out


LORA = re.compile(r"\.lora_(?:embedding_)?[AB](?:\.|$)")
"""A LoRA factor's name: `X.lora_A.<adapter>.weight`, an embedding's `X.lora_embedding_A.<adapter>`
(in an adapter file without the adapter's name)."""
PEFT_ROOT = "base_model.model."


def _adapter(block: dict, adapter: str) -> dict:
    """The LoRA tensors of a block as PEFT saves an adapter: the adapter's name dropped
    (`...q_proj.lora_A.weight`, an embedding's `...embed_tokens.lora_embedding_A`), and beside an
    embedding's factors its base weight, as PEFT saves it by default (`save_embedding_layers`)."""
    named = re.compile(rf"(\.lora_(?:embedding_)?[AB])\.{re.escape(adapter)}(?=\.|$)")
    embedded = {n[:-len(f".lora_embedding_A.{adapter}")] + ".base_layer.weight" for n in block
                if n.endswith(f".lora_embedding_A.{adapter}")}
    return {named.sub(r"\1", name): t for name, t in block.items() if LORA.search(name) or name in embedded}


def _factors(module: str, layer, adapter: str) -> tuple[str, str]:
    """The names of the LoRA factors (A, B) of PEFT `layer`, at `module`."""
    if adapter in getattr(layer, "lora_embedding_A", {}):
        return f"{module}.lora_embedding_A.{adapter}", f"{module}.lora_embedding_B.{adapter}"
    return f"{module}.lora_A.{adapter}.weight", f"{module}.lora_B.{adapter}.weight"


def peft_layers(d: Path, peft: dict, adapter: str) -> dict[str, list[tuple[str, object]]]:
    """The LoRA layers of the PEFT model trained (the `hf:` model of `d`'s config.json, adapted as `peft`
    says), built on the meta device, by the name of the weight each adapts: `X.base_layer.weight`
    for a linear or embedding layer, `X.base_layer.down_proj` for a parameter (LoRA's
    `target_parameters`; several wrappers of one module nest, each adapting one of its parameters)."""
    import peft as peft_lib
    from transformers import AutoConfig, AutoModelForCausalLM
    from peft.tuners.lora import LoraLayer
    hf_config = AutoConfig.from_pretrained(str(d))
    if hasattr(hf_config, "quantization_config"):  # the base's weights are given
        del hf_config.quantization_config
    with torch.device("meta"), warnings.catch_warnings():  # about the names it was trained under: not the user's concern
        warnings.simplefilter("ignore")
        model = peft_lib.get_peft_model(AutoModelForCausalLM.from_config(hf_config),
                                        peft_lib.LoraConfig.from_peft_type(**peft), adapter_name=adapter)
    where = {id(m): n for n, m in model.named_modules()}
    out: dict[str, list[tuple[str, object]]] = {}
    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and (adapter in layer.lora_A or adapter in layer.lora_embedding_A):
            param = getattr(layer, "parameter_name", None)  # a ParamWrapper: the base module's parameter
            weight = f"{where[id(layer.get_base_layer())]}.{param}" if param else f"{name}.base_layer.weight"
            out.setdefault(weight, []).append((name, layer))
    return out


class _Merger:
    """The weights with each LoRA pair merged into its base weight as PEFT's `merge_and_unload`
    does (W + the layer's `get_delta_weight`, PEFT's own, of the PEFT model built on the meta
    device with the trained factors put in: linear layers, embeddings, a mixture of experts'
    parameters, `fan_in_fan_out`, rslora, per-module ranks), under the base model's own names.
    `layers` (`peft_layers`) is None for a model that is no `hf:` one: its LoRA layers are linear
    ones, W + transpose(B @ A, fan_in_fan_out) * scaling. A base weight and its factors may sit in
    neighbouring blocks: each waits (alone in memory) until the other part arrives. A quantized
    base weight (`quantize`: its codes `X.weight` and scales `X.weight_absmax`) is dequantized as the
    step dequantizes it, then merged: full-precision weights, as `merge_and_unload` of the
    dequantized base gives."""

    def __init__(self, adapter: str, peft: dict, quantize: str | None = None, layers: dict | None = None):
        if layers is None and (peft.get("rank_pattern") or peft.get("alpha_pattern")):
            raise TensorstowError("export --merge: per-module LoRA ranks or alphas (rank_pattern, alpha_pattern) "
                                  "of a model that is no hf: one are not supported; export the adapter and merge it "
                                  "with PEFT")
        r, alpha = peft["r"], peft["lora_alpha"]
        self.scaling = alpha / math.sqrt(r) if peft.get("use_rslora") else alpha / r
        self.adapter, self.fan_in_fan_out, self.layers = adapter, bool(peft.get("fan_in_fan_out")), layers
        self.quant_type = Quantization.parse(quantize).quant_type if quantize else None
        """A quantized base's format (`Options.quantize`); None: the base is stored as it is."""
        self.pending: dict[str, torch.Tensor] = {}

    def _adapting(self, name: str) -> list[tuple[str, object]]:
        """The LoRA layers adapting weight `name`, as (module, PEFT layer or None: a linear one)."""
        if self.layers is not None:
            return self.layers.get(name, [])
        return [(name[:-len(".base_layer.weight")], None)] if name.endswith(".base_layer.weight") else []

    def _delta(self, module: str, layer, weight: torch.Tensor) -> torch.Tensor:
        a_name, b_name = _factors(module, layer, self.adapter)
        a, b = self.pending.pop(a_name), self.pending.pop(b_name)
        if layer is None:
            delta = b @ a
            return (delta.T if self.fan_in_fan_out else delta) * self.scaling
        if a_name.endswith(".weight"):
            layer.lora_A[self.adapter].weight, layer.lora_B[self.adapter].weight = nn.Parameter(a), nn.Parameter(b)
        else:
            layer.lora_embedding_A[self.adapter], layer.lora_embedding_B[self.adapter] = nn.Parameter(a), nn.Parameter(b)
        param = getattr(layer, "parameter_name", None)
        if param:  # PEFT casts the delta to its parameter's device and dtype
            setattr(layer.get_base_layer(), param, nn.Parameter(weight, requires_grad=False))
        try:
            return layer.get_delta_weight(self.adapter).detach()
        finally:
            if param:
                setattr(layer.get_base_layer(), param, nn.Parameter(weight.to("meta"), requires_grad=False))

    def __call__(self, block: dict) -> dict:
        self.pending.update(block)
        out = {}
        for name in list(self.pending):
            if LORA.search(name) or name not in self.pending or any(name.endswith(f".{p}") for p in PARTS[1:]):
                continue
            scales = [f"{name}{p[len('weight'):]}" for p in PARTS[1:]] if self.quant_type and name.endswith(".weight") else []
            scales = [s for s in scales if s in self.pending]  # none: a weight stored as it is (the LM head)
            adapting = self._adapting(name)
            if any(f not in self.pending for m, layer in adapting for f in _factors(m, layer, self.adapter)):
                continue  # its factors are in a block still to come
            t = self.pending.pop(name)
            if scales:
                parts = {"weight": t, **{s.rpartition(".")[2]: self.pending.pop(s) for s in scales}}
                t = dequantized(parts, self.quant_type)
            for module, layer in adapting:
                t = t + self._delta(module, layer, t)
            base = without_base_layers(name)
            out[base[len(PEFT_ROOT):] if base.startswith(PEFT_ROOT) else base] = t
        return out

    def close(self) -> None:
        if self.pending:
            raise TensorstowError(f"export --merge: {sorted(self.pending)[0]} has no LoRA counterpart in the state "
                                  f"dir; export the adapter instead")


def _check_names(block: dict, d: Path, adapter: bool) -> None:
    """No export writes names its loader would skip (and load random weights instead): PEFT's
    wrapper names in a model's weights, or anything but LoRA factors in an adapter."""
    if adapter:
        bad = [n for n in block if not (n.startswith(PEFT_ROOT) and (LORA.search(n) or n.endswith(".base_layer.weight")))]
    else:
        bad = [n for n in block if n.startswith(PEFT_ROOT) or LORA.search(n)
               or ".base_layer." in n or ".modules_to_save." in n or ".original_module." in n]
    if bad:
        raise TensorstowError(f"export: {d} holds {bad[0]}, a name no from_pretrained loads (a PEFT model whose "
                              f"state dir lacks its adapter config, or modules_to_save); refusing to write it")


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
