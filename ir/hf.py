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
import logging
import re
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from tensorstow.errors import TensorstowError
from tensorstow.ir.head import FUSE_FROM_CHUNKS, LOSS_CHUNK, fused_head_loss

PREFIX = "hf:"

# bitsandbytes' CPU backend (imported by peft where it is installed) warns at import that an optional
# package for an inference-only 4-bit kernel is missing; training never runs that kernel.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


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

    loss_chunk = LOSS_CHUNK
    """Tokens per chunk of the fused head (`fused_head_loss`), from FUSE_FROM_CHUNKS chunks a step on."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The mean cross-entropy of the next tokens; a mixture of experts whose config turns its
        router's load-balancing loss on (`output_router_logits`) adds it times
        `router_aux_loss_coef`, as its own forward does when given labels. From FUSE_FROM_CHUNKS
        chunks of `loss_chunk` tokens a step on, where the head is a plain linear map of the last
        hidden state, the head and loss run fused (`ir.models.fused_head_loss`): the logits never
        exist whole (a 152k vocabulary at 8 x 2048 tokens: 10 GB of fp32 logits, and as much of
        their gradient); equal to the plain head up to rounding. `positions`: each token's position
        in its document (a packed window's documents each start at 0); the model attends only within
        a document, as transformers builds its mask from packed position ids."""
        cfg = self.model.config
        aux = bool(getattr(cfg, "output_router_logits", False))
        kw = {"output_router_logits": True} if aux else {}
        if positions is not None:
            kw["position_ids"] = positions
        lm = _causal_lm(self.model)
        if idx.numel() >= FUSE_FROM_CHUNKS * self.loss_chunk and lm is not None and _plain_head(lm):
            out = lm.model(input_ids=idx, use_cache=False, **kw)
            h = out.last_hidden_state
            loss = fused_head_loss(h.reshape(-1, h.size(-1)), lm.lm_head.weight, targets.reshape(-1), self.loss_chunk)
            if aux:
                balance = sys.modules[type(lm).__module__].load_balancing_loss_func
                loss = loss + cfg.router_aux_loss_coef * balance(out.router_logits, lm.num_experts,
                                                                 lm.num_experts_per_tok, None).to(loss.device)
            return loss
        out = self.model(input_ids=idx, use_cache=False, **kw)
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten())
        return loss + cfg.router_aux_loss_coef * out.aux_loss.to(loss.device) if aux else loss


LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config keys of families whose forward transforms the head's output (Gemma 2's soft-capping,
Cohere's and Granite's scaling): their head is not fused."""


def _causal_lm(model: nn.Module) -> nn.Module | None:
    """The transformers causal LM that computes `model`'s logits: itself, or under a PEFT wrapper
    whose adapters sit inside its modules (LoRA) the base model; None under prompt learning, whose
    wrapper changes the inputs."""
    if not hasattr(model, "get_base_model"):
        return model
    config = getattr(model, "active_peft_config", None)
    return None if config is None or getattr(config, "is_prompt_learning", False) else model.get_base_model()


def _plain_head(model: nn.Module) -> bool:
    """Whether `model`'s logits are `lm_head(model.model(...).last_hidden_state)`: a bias-free
    linear head over a base model, and no transform of its output in the config."""
    head, cfg = getattr(model, "lm_head", None), model.config
    if not (isinstance(head, nn.Linear) and head.bias is None and isinstance(getattr(model, "model", None), nn.Module)):
        return False
    if any(getattr(cfg, k, None) not in (None, 1, 1.0) for k in LOGIT_TRANSFORMS):
        return False
    # a load-balancing loss is computed as the family's own forward computes it
    return not getattr(cfg, "output_router_logits", False) or hasattr(
        sys.modules[type(model).__module__], "load_balancing_loss_func")


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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A directory holding any of these has a tokenizer `AutoTokenizer.from_pretrained` reads."""


def has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in TOKENIZER_FILES)


def check_tokenizer_dir(path: str, flag: str) -> None:
    """Refuse a `--tokenizer` that is no directory: transformers would look the name up on the Hub."""
    if not Path(path).is_dir():
        raise TensorstowError(f"{flag} {path}: no such directory; pass the directory a tokenizer was saved to "
                              f"(save_pretrained)")


def lora_config(spec: str):
    """`Options.lora` ("r=8,alpha=16,targets=q_proj,v_proj[,dropout=0.1]") as a peft LoraConfig;
    `parameters=mlp.experts.gate_up_proj,...` also adapts those parameters themselves (LoraConfig's
    `target_parameters`: a mixture of experts' expert weights, each expert its own pair); one
    TensorstowError naming the fault."""
    try:
        import peft
    except ImportError:
        raise TensorstowError("--lora needs the peft package: pip install 'tensorstow[hf]'") from None
    keys = {"r": "r", "alpha": "lora_alpha", "targets": "target_modules", "parameters": "target_parameters",
            "dropout": "lora_dropout"}
    given: dict[str, list[str]] = {}
    key = None
    for item in (x.strip() for x in spec.split(",")):
        name, eq, value = item.partition("=")
        if eq:
            key = name.strip()
            if key not in keys:
                raise TensorstowError(f"--lora {spec}: unknown key '{key}'; use r, alpha, targets, parameters and dropout")
            if key in given:  # else the last would win, silently
                raise TensorstowError(f"--lora {spec}: '{key}' is given twice; give each key once")
            given[key] = [value.strip()]
        elif key in ("targets", "parameters") and item:  # targets=q_proj,v_proj: the names after the first
            given[key].append(item)
        else:
            raise TensorstowError(f"--lora {spec}: '{item}' is not key=value (r=8,alpha=16,targets=q_proj,v_proj)")
    if "r" not in given or not ({"targets", "parameters"} & set(given)):
        raise TensorstowError(f"--lora {spec}: give at least r and targets (r=8,alpha=16,targets=q_proj,v_proj)")
    try:
        kw = {"r": int(given["r"][0]), "target_modules": given.get("targets", [])}
        if "parameters" in given:
            kw["target_parameters"] = given["parameters"]
        if "alpha" in given:
            kw["lora_alpha"] = float(given["alpha"][0])
        if "dropout" in given:
            kw["lora_dropout"] = float(given["dropout"][0])
    except ValueError:
        raise TensorstowError(f"--lora {spec}: r must be an integer, alpha and dropout numbers") from None
    if kw["r"] < 1 or not 0 <= kw.get("lora_dropout", 0.0) < 1:
        raise TensorstowError(f"--lora {spec}: need r >= 1 and 0 <= dropout < 1")
    return peft.LoraConfig(task_type="CAUSAL_LM", **kw)


def _with_lora(model: nn.Module, ref: str, lora: str) -> nn.Module:
    """`get_peft_model(model, lora_config(lora))`, its adapters left where PEFT makes them: on a
    base whose parameters are on the meta device (`load_streaming`) they keep the values its
    initialisation drew (PEFT moves each adapter to its base layer's device, where it would
    have none: those moves are skipped while it builds them)."""
    import peft
    from peft.tuners.tuners_utils import BaseTunerLayer
    to, move = nn.Module.to, BaseTunerLayer._move_adapter_to_device_of_base_layer

    def not_to_meta(module, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        return module if device is not None and device.type == "meta" else to(module, *args, **kwargs)

    def not_onto_meta(layer, adapter_name, device=None):  # an embedding's adapters are moved tensor by tensor
        on_meta = any(p.device.type == "meta" for p in layer.get_base_layer().parameters())
        if not (on_meta if device is None else torch.device(device).type == "meta"):
            move(layer, adapter_name, device)

    if any(p.device.type == "meta" for p in model.parameters()):
        nn.Module.to, BaseTunerLayer._move_adapter_to_device_of_base_layer = not_to_meta, not_onto_meta
    try:
        with warnings.catch_warnings():  # peft asks transformers 5 a deprecated name: not the user's concern
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return peft.get_peft_model(model, lora_config(lora))
    except ValueError as e:  # a target module the model does not have
        raise TensorstowError(f"--lora {lora}: {ref}: {str(e).splitlines()[0]}") from None
    finally:
        nn.Module.to, BaseTunerLayer._move_adapter_to_device_of_base_layer = to, move


def load(ref: str, *, weights: bool = True, lora: str | None = None, quantize: str | None = None,
         quantize_skip: str | None = None) -> CausalLM:
    """Build the model of `hf:DIR`: from its safetensors weights when there are some (and
    `weights`), else initialised as `AutoModelForCausalLM.from_config(config)` does (the
    caller seeds torch first); with `lora`, LoRA adapters on it (`Options.lora`), and with
    `quantize` its base's linear layers stored quantized (`ir.quant`). In training mode,
    generation caches off."""
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
    if lora:
        model = _with_lora(model, ref, lora)
    if quantize:
        from tensorstow.ir.quant import Quantization, quantize_linears
        quantize_linears(model, Quantization.parse(quantize, quantize_skip))
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
    parameters as it places the block, so the whole model is never in memory. A PEFT model's
    base weights are found under their checkpoint names (`base_model.model.` and `.base_layer`
    left out); `own` holds what the model made itself (LoRA adapters). Where the family's
    checkpoints store a parameter in another form (a mixture of experts' experts one by one, where
    the model holds them as one weight), transformers' own conversion for the family (`hf_model`:
    `get_model_conversion_mapping`) makes it from its source tensors, as `from_pretrained` does."""

    def __init__(self, d: Path, own: dict[str, torch.Tensor] | None = None, hf_model: nn.Module | None = None,
                 quantized: dict[str, str] | None = None, quantization=None):
        self.own = own or {}
        self.quantized = quantized or {}
        """Parameter name -> the parameter name of the full-precision weight it is quantized from
        (`ir.quant.quantize_linears`: a quantized base, made as it is read)."""
        self.quantization = quantization
        """`ir.quant.Quantization` of the quantized parameters."""
        self._made: dict[str, dict[str, torch.Tensor]] = {}  # a weight's quantized parts, until both are taken
        self.dir = d
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
        self.converted: dict[str, tuple[object, dict[str, list[str]]]] = {}
        """Parameter key -> (transformers' converter, its source keys by source pattern, in order)."""
        self.renamed: dict[str, str] = {}
        """Parameter key -> the checkpoint key a renaming gives it under."""
        if hf_model is not None:
            self._conversions(hf_model)

    def _conversions(self, hf_model: nn.Module) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
        transforms = get_model_conversion_mapping(hf_model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        if not transforms:
            return
        owner = {p: c for c in converters for p in c.source_patterns}  # source pattern -> its converter
        sources: dict[str, dict[str, list[str]]] = {}
        by_target: dict[str, object] = {}
        for key in self.files:
            target, pattern = rename_source_key(key, renamings, converters)
            if pattern is None:
                if target != key:
                    self.renamed[target] = key
                continue
            sources.setdefault(target, {}).setdefault(pattern, []).append(key)
            by_target[target] = owner[pattern]
        for target, by_pattern in sources.items():
            self.converted[target] = (by_target[target], {p: sorted(ks, key=dot_natural_key) for p, ks in by_pattern.items()})

    def mismatch(self, name: str, got: tuple, want: tuple) -> str:
        """The line refusing a tensor of shape `got` for the parameter `name` of shape `want`."""
        return (f"model 'hf:{self.dir}': the checkpoint's {_checkpoint_key(name)} is {got} where the model its "
                f"config.json describes has {want}: the weights were saved with another configuration; save the "
                f"model and its config.json together (save_pretrained)")

    def _read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open
        with safe_open(str(self.files[key]), framework="pt") as sf:
            return sf.get_tensor(key)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.own:
            return self.own[name]
        if name in self.quantized:
            from tensorstow.ir.quant import parts_stored, quantized_parts
            source, part = self.quantized[name], name.rpartition(".")[2]
            parts = self._made.setdefault(source, {})
            if part not in parts:
                key = _checkpoint_key(source)
                stored = parts_stored(key, self.files, self._read, self.quantization)
                parts.update(stored if stored is not None else quantized_parts(self._tensor(source), self.quantization))
            value = parts.pop(part)
            if not parts:
                del self._made[source]
            return value
        return self._tensor(name)

    def _tensor(self, name: str) -> torch.Tensor:
        key = _checkpoint_key(name)
        if key in self.files:
            if f"{key}.quant_map" in self.files or f"{key.removesuffix('.weight')}.SCB" in self.files:
                raise TensorstowError(f"the checkpoint stores {key} quantized, where the plan keeps the model's parameter "
                                      f"{name} in full precision: plan it with the --quantize the checkpoint was saved "
                                      f"with (and no skip= for that layer)")
            return self._read(key)
        if key in self.renamed:
            return self._read(self.renamed[key])
        if key in self.converted:
            converter, by_pattern = self.converted[key]
            tensors = {p: [self._read(k) for k in keys] for p, keys in by_pattern.items()}
            for op in converter.operations:
                tensors = op.convert(tensors, source_patterns=converter.source_patterns,
                                     target_patterns=converter.target_patterns)
            (value,) = tensors.values()
            return value
        raise TensorstowError(f"the checkpoint has no tensor {key} (the model's parameter {name})")


def _checkpoint_key(name: str) -> str:
    """The checkpoint's key of the wrapped model's parameter `name` (`model.` dropped; for a PEFT
    model `base_model.model.` and `.base_layer` too)."""
    key = name[len("model."):]
    if key.startswith("base_model.model."):
        key = without_base_layers(key[len("base_model.model."):])
    return key


def without_base_layers(name: str) -> str:
    """A PEFT model's parameter name as its base model names it: every `.base_layer` PEFT's
    wrappers put in left out (several in a row where LoRA adapts several parameters of one module:
    `experts.base_layer.base_layer.down_proj` is `experts.down_proj`)."""
    return re.sub(r"\.base_layer(?=\.)", "", name)


def load_streaming(ref: str, lora: str | None = None, quantize: str | None = None, quantize_skip: str | None = None
                   ) -> tuple[CausalLM, "Checkpoint | None"]:
    """`hf:DIR` for execution: with safetensors weights, the model with its parameters on the
    meta device and the checkpoint to stream them from; without, as `load` builds it. With
    `lora`, the adapters are made for real (the values `get_peft_model` of the loaded base
    gives, the caller seeding torch first) and streamed with the base; with `quantize`, the
    base's linear weights are quantized as they are read (out of core: one tensor at a time)."""
    d = check_dir(ref)
    if not has_weights(d):
        return load(ref, lora=lora, quantize=quantize, quantize_skip=quantize_skip), None
    with parameters_on_meta():
        model = load(ref, weights=False)
    if lora:
        model = CausalLM(_with_lora(model.model, ref, lora).train())
    quantized, q = {}, None
    if quantize:
        from tensorstow.ir.quant import Quantization, quantize_linears
        q = Quantization.parse(quantize, quantize_skip)
        with parameters_on_meta():
            made = quantize_linears(model.model, q)
        quantized = {f"model.{n}": f"model.{src}" for n, src in made.items()}
    own = {n: p.detach() for n, p in model.named_parameters() if p.device.type != "meta"}
    base = model.model.get_base_model() if hasattr(model.model, "get_base_model") else model.model
    return model, Checkpoint(d, own, base, quantized, q)


def wrap(model: nn.Module) -> nn.Module:
    """A Hugging Face causal LM (or a PEFT model around one) gets the loss contract; any other
    module is returned as it is."""
    tf = sys.modules.get("transformers")
    peft_model = type(model).__module__.startswith("peft.")
    if peft_model or (tf is not None and isinstance(model, tf.PreTrainedModel)):
        return CausalLM(model)
    return model  # already follows the convention (a CausalLM, nanoGPT, a user model)
