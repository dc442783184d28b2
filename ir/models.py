"""Built-in models: a nanoGPT-style decoder-only GPT and the papers' configurations.

User models follow nanoGPT's convention: a factory with no arguments returns an
`nn.Module` whose `forward(idx, targets)` returns the scalar loss and which has
`vocab_size` and `block_size` attributes. Its repeated layers should live in an
`nn.ModuleList` (the tracer uses the first ModuleList it finds as the list of blocks).
"""
from __future__ import annotations

import importlib
import inspect
import math
import traceback
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tensorstow.errors import TensorstowError
from tensorstow.ir.head import FUSE_FROM_CHUNKS, IGNORE_INDEX, LOSS_CHUNK, fused_head_loss  # noqa: F401 (IGNORE_INDEX: ir.models' API)


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads."""
    n_embd: int
    """Hidden dimension."""
    vocab_size: int = 50257
    """Vocabulary (the papers use GPT-2's 50257)."""
    block_size: int = 1024
    """Default sequence length T."""
    loss_chunk: int = 0
    """Tokens per chunk of the fused LM head + cross-entropy (`fused_head_loss`), used from
    FUSE_FROM_CHUNKS chunks of tokens per step on; 0: always the plain head, whose logits exist
    whole (batch x seq x vocab, in fp32 under autocast)."""
    source: str = ""
    """Where the configuration comes from (paper and table)."""


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)); x + mlp(ln(x)). No dropout, no bias tricks."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        self.ln_1 = nn.LayerNorm(c.n_embd)
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.mlp_proj = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """Decoder-only GPT (nanoGPT layout) with untied embedding and LM head.

    The head is untied so that every parameter belongs to exactly one place in the
    execution order; parameter count is 12·L·d² + 13·L·d + 2·V·d + T·d + 2·d.
    """

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.vocab_size = c.vocab_size
        self.block_size = c.block_size
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                scale = std / math.sqrt(2 * c.n_layer) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else std
                nn.init.normal_(p, 0.0, scale)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        h = self.ln_f(x)
        if self.config.loss_chunk and idx.numel() >= FUSE_FROM_CHUNKS * self.config.loss_chunk:
            return fused_head_loss(h.view(-1, h.size(-1)), self.lm_head.weight, targets.reshape(-1),
                                   self.config.loss_chunk)
        logits = self.lm_head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt_init_stream(c: GPTConfig):
    """(name, value) of every parameter of `GPT(c)`, in `named_parameters` order, equal to what
    `GPT(c)` gives after the same `torch.manual_seed`, without ever holding more than one module
    or parameter. It replays `GPT.__init__`'s random stream: here, at the call, the constructors
    run one module at a time and are dropped (they draw from the generator); the returned
    iterator then replays the re-initialisation loop parameter by parameter. Keep it in step
    with `GPT.__init__` (tests/test_scale.py compares the two)."""
    with torch.device("meta"):  # shapes only: meta tensors draw nothing
        shapes = [(n, tuple(p.shape)) for n, p in GPT(c).named_parameters()]
    nn.Embedding(c.vocab_size, c.n_embd)
    nn.Embedding(c.block_size, c.n_embd)
    for _ in range(c.n_layer):
        Block(c)
    nn.LayerNorm(c.n_embd)
    nn.Linear(c.n_embd, c.vocab_size, bias=False)
    return _gpt_reinit(c, shapes)


def _gpt_reinit(c: GPTConfig, shapes):
    std = 0.02
    for name, shape in shapes:
        if len(shape) >= 2:
            scale = std / math.sqrt(2 * c.n_layer) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else std
            yield name, torch.empty(shape).normal_(0.0, scale)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape)
        else:  # LayerNorm weights keep their constructor's ones
            yield name, torch.ones(shape)


def gpt_param_count(c: GPTConfig) -> int:
    L, d, V, T = c.n_layer, c.n_embd, c.vocab_size, c.block_size
    return 12 * L * d * d + 13 * L * d + 2 * V * d + T * d + 2 * d


def _gpt3(L, H, d, src):
    return GPTConfig(n_layer=L, n_head=H, n_embd=d, vocab_size=50257, block_size=1024, source=src,
                     loss_chunk=LOSS_CHUNK)


_FUYOU = "Fuyou Table 4 (seq 1024, vocab 50257)"
_LOHAN = "LoHan Table IV (seq 1024, vocab 50257)"
PRESETS: dict[str, GPTConfig] = {
    # Fuyou Table 4 and LoHan Table IV share 13B/135B/175B/276B/412B.
    "gpt3-6b": _gpt3(28, 32, 4096, _LOHAN),
    "gpt3-13b": _gpt3(40, 40, 5120, _FUYOU + "; " + _LOHAN),
    "gpt3-30b": _gpt3(48, 56, 7168, _LOHAN),
    "gpt3-33b": _gpt3(60, 52, 6656, _FUYOU),
    "gpt3-65b": _gpt3(80, 64, 8192, _FUYOU),
    "gpt3-70b": _gpt3(80, 64, 8192, _LOHAN),
    "gpt3-135b": _gpt3(88, 88, 11264, _FUYOU + "; " + _LOHAN),
    "gpt3-175b": _gpt3(96, 96, 12288, _FUYOU + "; " + _LOHAN),
    "gpt3-276b": _gpt3(112, 112, 14336, _FUYOU + "; " + _LOHAN),
    "gpt3-412b": _gpt3(128, 128, 16384, _FUYOU + "; " + _LOHAN),
    "gpt3-805b": _gpt3(160, 160, 20480, _FUYOU),
    # Mobius Table 3 (seq 512; micro-batch 2, 2, 1, 1).
    "mobius-3b": GPTConfig(n_layer=64, n_head=32, n_embd=2048, block_size=512, source="Mobius Table 3"),
    "mobius-8b": GPTConfig(n_layer=40, n_head=32, n_embd=4096, block_size=512, source="Mobius Table 3"),
    "mobius-15b": GPTConfig(n_layer=40, n_head=64, n_embd=5120, block_size=512, source="Mobius Table 3"),
    "mobius-51b": GPTConfig(n_layer=50, n_head=72, n_embd=9216, block_size=512,
                            source="Mobius Table 3 ([OURS] 72 heads of 128: its 80 do not divide 9216)"),
    # Deep Optimizer States Table 2 (seq 2048).
    "dos-7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048, source="Deep Optimizer States Table 2"),
    "dos-8.3b": GPTConfig(n_layer=72, n_head=24, n_embd=3072, block_size=2048, source="Deep Optimizer States Table 2"),
    "dos-10b": GPTConfig(n_layer=50, n_head=32, n_embd=4096, block_size=2048, source="Deep Optimizer States Table 2"),
    "dos-13b": GPTConfig(n_layer=40, n_head=40, n_embd=5120, block_size=2048, source="Deep Optimizer States Table 2"),
    "dos-20b": GPTConfig(n_layer=48, n_head=64, n_embd=6144, block_size=2048, source="Deep Optimizer States Table 2"),
    # GPT-3 paper (Brown et al. 2020) Table 2.1, the sizes that train on one workstation (n_ctx
    # 2048, vocab 50257). The table gives 1.3B 24 heads of d_head 128, which does not multiply to
    # d_model 2048; 16 heads of 128 do (as Megatron's and Pythia's 1.3-1.4B configurations).
    "gpt3-125m": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=2048, source="GPT-3 Table 2.1"),
    "gpt3-350m": GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=2048, source="GPT-3 Table 2.1"),
    "gpt3-760m": GPTConfig(n_layer=24, n_head=16, n_embd=1536, block_size=2048, source="GPT-3 Table 2.1"),
    "gpt3-1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=2048,
                           source="GPT-3 Table 2.1 (16 heads of 128: the table's 24 x 128 != 2048)"),
    "gpt3-2.7b": GPTConfig(n_layer=32, n_head=32, n_embd=2560, block_size=2048, source="GPT-3 Table 2.1"),
    # Tiny models for tests and CPU-only runs.
    "gpt-tiny": GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=512, block_size=64, source="tensorstow test model"),
    "gpt-small": GPTConfig(n_layer=6, n_head=8, n_embd=256, vocab_size=4096, block_size=128, source="tensorstow CPU demo model"),
    "gpt-medium": GPTConfig(n_layer=8, n_head=12, n_embd=768, vocab_size=4096, block_size=256,
                            source="tensorstow CPU model: 60M parameters, 0.7 GB of fp32 training state"),
    "gpt-deep": GPTConfig(n_layer=24, n_head=4, n_embd=64, vocab_size=512, block_size=64,
                          source="tensorstow test model: deep enough to be planned from a replicated trace"),
}

# Mobius Table 3 micro-batch sizes, used as the default batch of those presets.
DEFAULT_BATCH = {"mobius-3b": 2, "mobius-8b": 2, "mobius-15b": 1, "mobius-51b": 1}


@dataclass(frozen=True)
class ModelSpec:
    """What the planner knows about a model before tracing."""

    name: str
    """Preset name, `hf:DIR` or `pkg.module:factory`."""
    config: GPTConfig | None
    """Set for built-in presets (enables tracing a few blocks and replicating by similarity)."""
    lora: str | None = None
    """`Options.lora`: LoRA adapters on an `hf:` model."""
    quantize: str | None = None
    """`Options.quantize`: the LoRA model's base stored quantized (`ir.quant`)."""
    quantize_skip: str | None = None
    """`Options.quantize_skip`."""

    def build(self, n_layer: int | None = None, *, weights: bool = True) -> nn.Module:
        """The model. `weights=False`: a Hugging Face checkpoint is built from its config alone
        (tracing needs shapes, not values)."""
        if self.config is not None:
            c = self.config
            if n_layer is not None:
                c = GPTConfig(**{**c.__dict__, "n_layer": n_layer})
            return GPT(c)
        from tensorstow.ir import hf
        if self.name.startswith(hf.PREFIX):
            return hf.load(self.name, weights=weights, lora=self.lora, quantize=self.quantize,
                           quantize_skip=self.quantize_skip)
        fn = _load_factory(self.name)
        try:
            m = fn()
        except TensorstowError:
            raise
        except Exception as e:  # the user's code: where in it, and what
            raise FactoryError(f"model '{self.name}': the factory raised at {_raised(e, _files_of(fn))}; fix "
                               f"it (--debug prints the traceback)") from e
        if not isinstance(m, nn.Module):
            raise TensorstowError(f"model '{self.name}': the factory returned {type(m).__name__}, "
                                  f"not an nn.Module")
        return hf.wrap(m)


class FactoryError(TensorstowError):
    """A model factory raised (`ModelSpec.build`); the exception it raised is the cause. Tracing
    builds on fake tensors or the meta device first, which some factories' code cannot run on."""


def _load_factory(ref: str):
    """The factory `pkg.module:function` names; one TensorstowError where the module cannot be
    found, does not compile or raises as it is imported (naming its file and line)."""
    mod_name, _, attr = ref.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise TensorstowError(f"model '{ref}': cannot import module '{mod_name}' ({e}); "
                              f"check PYTHONPATH or the spelling") from None
    except SyntaxError as e:  # also its subclasses IndentationError and TabError
        raise TensorstowError(f"model '{ref}': module '{mod_name}' does not compile: {e.filename}:{e.lineno}: "
                              f"{type(e).__name__}: {e.msg}; fix the module") from e
    except Exception as e:
        raise TensorstowError(f"model '{ref}': importing module '{mod_name}' raised at {_raised(e, module=mod_name)}; "
                              f"fix the module (--debug prints the traceback)") from e
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise TensorstowError(f"model '{ref}': module '{mod_name}' has no callable '{attr}'")
    return fn


def _files_of(fn) -> set[str]:
    """The source files of a factory: its own code's and its module's."""
    code = getattr(fn, "__code__", None)
    module = inspect.getmodule(fn)
    return {f for f in (code and code.co_filename, getattr(module, "__file__", None)) if f}


def _raised(e: Exception, files: set[str] = frozenset(), module: str | None = None) -> str:
    """"FILE:LINE: TYPE: message" for an exception the user's code raised, FILE:LINE the deepest
    frame of its traceback in one of `files` or in `module` (the user's own code rather than the
    library it called), else its deepest frame."""
    frames = list(traceback.walk_tb(e.__traceback__))
    mine = [(f, n) for f, n in frames if f.f_code.co_filename in files or
            (module is not None and f.f_globals.get("__name__") == module)] or frames
    at = f"{mine[-1][0].f_code.co_filename}:{mine[-1][1]}: " if mine else ""
    return f"{at}{type(e).__name__}: {' '.join(str(e).split())}"


def resolve_model(name: str, lora: str | None = None, quantize: str | None = None,
                  quantize_skip: str | None = None) -> ModelSpec:
    """The spec of a model reference; `lora` (`Options.lora`) only for an `hf:` model, `quantize`
    (`Options.quantize`) only with `lora`."""
    from tensorstow.ir import hf
    if quantize and not lora:
        raise TensorstowError(f"--quantize {quantize}: a quantized base is frozen, so it trains only adapters: add "
                              f"--lora r=...,targets=... (QLoRA)")
    if quantize:
        from tensorstow.ir.quant import Quantization, bitsandbytes_functional
        Quantization.parse(quantize, quantize_skip)  # fail early with a clear message
        bitsandbytes_functional()  # which stores and dequantizes the base: its absence said before any planning
    elif quantize_skip:
        raise TensorstowError(f"--quantize-skip {quantize_skip}: it names layers --quantize leaves alone; give --quantize")
    if lora and not name.startswith(hf.PREFIX):
        raise TensorstowError(f"--lora {lora}: LoRA from the command line adapts an hf:DIR checkpoint, not '{name}'; "
                              f"for another model give a PEFT model to the Python API (tensorstow.plan(model))")
    if lora:
        hf.check_dir(name)
        hf.lora_config(lora)  # fail early with a clear message
        return ModelSpec(name, None, lora, quantize, quantize_skip)
    if name in PRESETS:
        return ModelSpec(name, PRESETS[name])
    if name.startswith("<"):
        raise TensorstowError(f"model '{name}': the plan was made from a Python object with "
                              f"tensorstow.plan(model); run it from Python: tensorstow.Executor(plan, model)")
    from tensorstow.ir import hf
    if name.startswith(hf.PREFIX):
        hf.check_dir(name)
        return ModelSpec(name, None)
    if ":" in name:
        _load_factory(name)  # fail early with a clear message
        return ModelSpec(name, None)
    raise TensorstowError(f"unknown model '{name}': use a preset ({', '.join(sorted(PRESETS))}), "
                          f"hf:DIR (a save_pretrained directory) or a factory as 'pkg.module:function'")


def build_for_execution(spec, seed: int):
    """(model, initial values) with the weights `torch.manual_seed(seed); factory()` gives.
    Presets are built on the meta device and their values streamed block by block into their
    home tiers (never the whole model in host memory); so are `hf:` models with safetensors
    weights, read tensor by tensor from the checkpoint; other models are built whole."""
    from tensorstow.ir import hf
    if spec.name.startswith(hf.PREFIX):  # from its safetensors, one tensor at a time, if it has some
        torch.manual_seed(seed)
        return hf.load_streaming(spec.name, spec.lora, spec.quantize, spec.quantize_skip)
    if spec.config is not None:
        with torch.device("meta"):
            model = spec.build()
        torch.manual_seed(seed)
        return model, gpt_init_stream(spec.config)
    torch.manual_seed(seed)  # immediately before the factory: same initial weights as eager
    return spec.build(), None
