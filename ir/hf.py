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

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from tensorstow import TensorstowError

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


def wrap(model: nn.Module) -> nn.Module:
    """A Hugging Face causal LM (or a PEFT model around one) gets the loss contract; any other
    module is returned as it is."""
    tf = sys.modules.get("transformers")
    peft_model = type(model).__module__.startswith("peft.")
    if peft_model or (tf is not None and isinstance(model, tf.PreTrainedModel)):
        return CausalLM(model)
    return model  # already follows the convention (a CausalLM, nanoGPT, a user model)
