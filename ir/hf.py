"""Hugging Face causal LMs as tensorstow models: `hf:DIR` and the loss contract.

DIR is what `save_pretrained` writes: `config.json` and, optionally, `*.safetensors`
weights. Any `AutoModelForCausalLM` family works; the model is wrapped so that
`forward(idx, targets)` returns the loss of the loss contract, which makes results
comparable with eager Hugging Face training:

    logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

x and y are the data windows of `tensorstow execute --data` (y is x shifted by one, so the
model shifts nothing). Generation caches are off. `transformers` is the optional extra
`tensorstow[hf]`.
"""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from tensorstow.errors import TensorstowError

PREFIX = "hf:"


class CausalLM(nn.Module):
    """A transformers causal LM under the loss contract. Its parameters are the wrapped
    model's, named `model.<name>`; `vocab_size` and `block_size` come from the config."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        cfg = model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.vocab_size = int(cfg.vocab_size)
        self.block_size = _max_positions(cfg)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=idx, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _max_positions(cfg) -> int:
    """The config's sequence limit; 0 when it has none (ALiBi models such as BLOOM: pass --seq)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 0


def _transformers():
    try:
        import transformers
    except ImportError:
        raise TensorstowError("hf: models need the transformers package: pip install 'tensorstow[hf]'") from None
    return transformers


def check_dir(ref: str) -> Path:
    """The directory of an `hf:DIR` reference, checked for a config.json."""
    d = Path(ref[len(PREFIX):]).expanduser()
    if not (d / "config.json").is_file():
        raise TensorstowError(f"model '{ref}': {d} has no config.json; point hf: at a directory written by "
                              f"save_pretrained (config.json, optionally *.safetensors)")
    _transformers()
    return d


def has_weights(d: Path) -> bool:
    return any(d.glob("*.safetensors"))


def load(ref: str, *, weights: bool = True) -> CausalLM:
    """Build the model of `hf:DIR`: from its safetensors weights when there are some (and
    `weights`), else initialised as `AutoModelForCausalLM.from_config(config)` does (the
    caller seeds torch first). In training mode, generation caches off."""
    d = check_dir(ref)
    tf = _transformers()
    verbosity = tf.logging.get_verbosity()
    tf.logging.set_verbosity_error()  # config warnings about unused token ids are not errors here
    try:
        config = tf.AutoConfig.from_pretrained(str(d))
        config.use_cache = False
        if weights and has_weights(d):
            model = tf.AutoModelForCausalLM.from_pretrained(str(d), config=config, dtype=torch.float32)
        else:
            model = tf.AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as e:
        raise TensorstowError(f"model '{ref}': transformers cannot build it ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from e
    finally:
        tf.logging.set_verbosity(verbosity)
    model.train()
    return CausalLM(model)


@contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no random
    draws) and their buffers for real: the buffers are computed from the config (rotary tables)
    and are not in checkpoints."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class Checkpoint:
    """The tensors of a safetensors checkpoint by the wrapped model's parameter names
    (`model.<name>`), read one at a time when asked for: the executor takes each block's
    parameters as it places the block, so the whole model is never in memory."""

    def __init__(self, d: Path):
        index = d / "model.safetensors.index.json"
        if index.is_file():
            files = {n: d / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            from safetensors import safe_open
            files = {}
            for f in sorted(d.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as sf:
                    files.update({n: f for n in sf.keys()})
        self.files = files

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open
        key = name[len("model."):]
        if key not in self.files:
            raise TensorstowError(f"the checkpoint has no tensor {key} (the model's parameter {name})")
        with safe_open(str(self.files[key]), framework="pt") as sf:
            return sf.get_tensor(key)


def load_streaming(ref: str) -> tuple[CausalLM, "Checkpoint | None"]:
    """`hf:DIR` for execution: with safetensors weights, the model with its parameters on the
    meta device and the checkpoint to stream them from; without, as `load` builds it."""
    d = check_dir(ref)
    if not has_weights(d):
        return load(ref), None
    with parameters_on_meta():
        model = load(ref, weights=False)
    return model, Checkpoint(d)


def wrap(model: nn.Module) -> nn.Module:
    """A Hugging Face causal LM (or a PEFT model around one) gets the loss contract; any other
    module is returned as it is."""
    tf = sys.modules.get("transformers")
    peft_model = type(model).__module__.startswith("peft.")
    if peft_model or (tf is not None and isinstance(model, tf.PreTrainedModel)):
        return CausalLM(model)
    return model  # already follows the convention (a CausalLM, nanoGPT, a user model)
