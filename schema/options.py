"""What a plan is asked for: the model, the hardware and the training recipe, as one typed,
keyword-only dataclass (a docstring under each field). The plan file records it.

`Options` is also the one source of the plan options' defaults and help: `tensorstow plan`'s
flags and `tensorstow.plan(...)`'s keyword arguments are derived from its fields (`asked`), with
`ASKED` for what a field's name, type and default do not say."""
from __future__ import annotations

import ast
import dataclasses
import fnmatch
import functools
import inspect
import math
import textwrap
import typing
from collections.abc import Mapping
from dataclasses import dataclass

from tensorstow.errors import TensorstowError
from tensorstow.schema.hardware import parse_size
from tensorstow.schema.typed import decode


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str
    """Preset name (gpt3-13b, gpt-tiny, ...), `hf:DIR`, `pkg.module:factory`, or `<ClassName>` for
    a module given to the Python API (such a plan is executed from Python:
    `tensorstow.Executor(plan, model)`)."""
    hardware: str
    """Hardware preset name, spec file (`tensorstow probe -o`), or "local": probe this machine."""
    policy: str = "auto"
    """Placement policy: all-gpu, zero-infinity, lohan, stronghold, dos, ilp, mobius, ... or auto
    (the fastest feasible one)."""
    batch: int = 0
    """Micro-batch size (0: the preset's default, else 1)."""
    seq: int = 0
    """Sequence length (0: the model's block_size)."""
    precision: str = "bf16-mixed"
    """fp32, bf16-mixed or fp16-mixed: each op in the dtype CUDA autocast gives it, fp32 masters
    and optimizer states, 16-bit compute copies of the weights autocast only reads cast;
    fp16-mixed adds dynamic loss scaling."""
    gpu_mem: int | None = None
    """GPU memory the plan's tensors may fill, in bytes (e.g. 200MB, 24GB); the GPU's reserve for
    the CUDA context and workspaces comes on top (default: the hardware's)."""
    dram: int | None = None
    """Host memory (DRAM) capacity in bytes, e.g. 256GB (default: the hardware's)."""
    ssds: int | None = None
    """Number of SSDs (default: the hardware's)."""
    ssd_for: str | None = None
    """What the SSDs may hold, comma-separated: params (the parameters' homes, a frozen base's
    too), optimizer (fp32 master weights, Adam states and the gradients that wait for them, as
    DeepSpeed's offload_optimizer), activations (swapped activations and layer inputs); none; or
    all (the default). What is kept off them lives in DRAM or on the GPU, or is recomputed: a
    frozen base kept in DRAM reads nothing from the SSDs, and activations kept off them write
    nothing to them every step (the SSD's endurance)."""
    optimizer: str = "adamw"
    """adam or adamw, with the semantics of torch.optim.Adam / AdamW."""
    lr: float = 1e-4
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's coefficients for the running averages of the gradient and its square."""
    eps: float = 1e-8
    """Adam's term added to the denominator for numerical stability."""
    weight_decay: float = 0.0
    """Weight decay: decoupled from the gradient for adamw, added to it (L2) for adam. It applies to
    the parameters with two or more dimensions (matrices, embeddings), not to biases and norm
    weights: nanoGPT's `configure_optimizers` and, for these models, the Hugging Face Trainer's
    rule."""
    decay_all: bool = False
    """Apply the weight decay to every parameter, biases and norm weights too."""
    param_groups: tuple[str, ...] = ()
    """Parameter groups as torch.optim takes them: each "PATTERN:lr_scale=X,weight_decay=Y"
    (either key may be left out), PATTERN an fnmatch pattern of the model's parameter names; a
    parameter takes the first group it matches, its learning rate lr x lr_scale (the schedule
    scales it as LambdaLR scales a group's), its weight decay Y (without it, the weight_decay rule).
    A pattern that matches no trainable parameter is an error."""
    max_grad_norm: float = 0.0
    """Clip the gradients by their global norm (torch.nn.utils.clip_grad_norm_: norm 2 over every
    trainable parameter; fp16-mixed unscales first, as GradScaler.unscale_ then clip); 0: no
    clipping. Every update then waits for the backward's last gradient (the factor needs all of
    them), as fp16 loss scaling does. The step's norm is logged either way."""
    clip_rate: float = 0.5
    """With clipping (or fp16 loss scaling): the fraction of steps whose clip is expected to fire
    (or whose gradients overflow). The planner weighs speculating (updates overlapped with the
    backward, redone when the clip fires) against waiting for the norm by step + clip_rate x redo,
    simulated."""
    lr_scheduler: str = "constant"
    """The learning rate over the run, transformers' `get_scheduler` semantics (executor/lr.py):
    constant, constant_with_warmup, linear or cosine (to 0, or to min_lr_ratio x lr, at the run's
    last step). A runtime input of the optimizer: `execute` may override it."""
    warmup_steps: int = 0
    """Optimizer steps over which the learning rate rises linearly from 0 to lr."""
    min_lr_ratio: float = 0.0
    """linear and cosine end at this fraction of lr instead of 0."""
    exact_optimizer: bool = False
    """Update with torch.optim.Adam/AdamW(foreach=False), bit-identical with eager's default CPU
    path (slower); otherwise the fast update (csrc/adam.cpp on the CPU, with the fused downcast of
    the fresh compute copy; torch's fused kernel on a GPU), within a few ulps of torch's. With
    `dp` above 2 the ranks' gradients are also summed in rank order, as one process accumulating
    their microbatches sums them (each rank gathers every rank's: more traffic than a ring); with
    `grad_accum` too, each rank sums its own microbatches first, (g0 + g1) + (g2 + g3), which
    differs from one process's ((g0 + g1) + g2) + g3 in the last bits."""
    init_scale: float = 65536.0
    """fp16-mixed: the initial loss scale. Dynamic loss scaling has torch.amp.GradScaler's
    semantics and defaults; the loss-scaling options are ignored for other precisions."""
    growth_factor: float = 2.0
    """fp16-mixed: the loss scale is multiplied by this after growth_interval steps without
    inf/NaN gradients."""
    backoff_factor: float = 0.5
    """fp16-mixed: the loss scale is multiplied by this after a step with inf/NaN gradients (the
    step's update is skipped)."""
    growth_interval: int = 2000
    """fp16-mixed: steps without inf/NaN gradients before the loss scale grows."""
    gpus: int | None = None
    """Number of GPUs: the first N of the hardware's; more repeat the last one (default: the
    hardware's)."""
    microbatches: int = 0
    """Pipelines: microbatches per step (0: as many as GPUs, Mobius §3.1); the step's batch is
    microbatches x batch, its gradients accumulated. Above 1, only the mobius policy (also on one
    GPU, and what auto then picks) honours it; other policies refuse it."""
    lora: str | None = None
    """Train LoRA adapters (PEFT) on an `hf:` checkpoint instead of every weight, as
    "r=8,alpha=16,targets=q_proj,v_proj[,dropout=0.1]" (LoraConfig's r, lora_alpha,
    target_modules, lora_dropout; `parameters=mlp.experts.gate_up_proj,...` adapts parameters
    themselves, target_parameters: a mixture of experts' expert weights):
    `get_peft_model(AutoModelForCausalLM.from_pretrained(DIR), LoraConfig(...))`, the frozen base
    streamed from the checkpoint; `export` writes the adapter (or, with --merge, merged weights)."""
    grad_accum: int = 1
    """Gradient accumulation on one GPU: an optimizer step runs the forward and backward of K
    microbatches of `batch` rows one after the other, their gradients summed in fp32 where the
    planner keeps them between microbatches (GPU, DRAM or SSD: the fastest that fits), and updates
    once, overlapped with the last microbatch's backward. The step's loss is the Hugging Face
    Trainer's: the token losses of all K microbatches over their count of labels. Pipelines
    accumulate over `microbatches` instead."""
    mapping: str = "cross"
    """Pipelines: stage -> GPU mapping, cross (from the root complexes, Mobius §3.3) or
    sequential."""
    quantize: str | None = None
    """With lora: the base's linear layers (all but the LM head) stored quantized as bitsandbytes
    stores them (QLoRA: `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=...)`, or
    `load_in_8bit=True`): nf4, fp4 or int8, 4-bit ones with ",double" to quantize the scales too
    (`bnb_4bit_use_double_quant`); quantized from the checkpoint as it is read, moved and kept
    quantized, dequantized on the device in the segment that uses them (`ir.quant`)."""
    quantize_skip: str | None = None
    """With quantize: more linear layers to keep in full precision besides the LM head, as
    comma-separated fnmatch patterns on their module names or last names (`*.down_proj`, `o_proj`;
    `llm_int8_skip_modules`)."""
    expert_groups: int = 1
    """A mixture of experts: each layer's experts in this many groups, each a placement unit of its
    own (its rows of the expert weights, their gradient, master copy and Adam states on a tier of
    their own, updated on its own as its gradient arrives); 1: a layer is one unit; 0: the planner
    plans 1, 2, 4 and 8 (as many as a layer has experts for) and keeps the fastest. The device
    holds a layer's experts whole while the layer computes (its grouped matmul reads them all)."""
    dp: int = 1
    """Data parallel: this many replicas of a one-GPU plan (one process each, `execute --nproc`),
    each on its own `batch` rows (the Trainer's per-device batch; `grad_accum` on top), their
    gradients summed over the ranks as each block's backward makes them (ring all-reduce); each
    rank's CPU updates its 1/dp of every block's rows and the ranks gather the updated parameters.
    The hardware is `nodes` machines of `gpus` GPUs each (dp = nodes x gpus); each rank plans on
    its GPU and its machine's DRAM, SSDs and cores shared by that machine's ranks."""
    nodes: int = 1
    """Data parallel: machines (each with the hardware's GPUs, DRAM, SSDs and cores)."""
    net_bw: float = 25e9
    """Data parallel across machines: each machine's network bandwidth to the others, bytes/s (25
    GB/s: 200 Gb/s InfiniBand)."""
    packing: bool = False
    """Train on windows of seq tokens that pack several examples (best-fit decreasing, as TRL packs):
    the step takes each token's position in its document, every document starts at position 0 and
    attends only to itself, and no document's first token is a target of the one before (`hf:`
    models, whose forward takes position ids; `execute` packs its examples so)."""

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        for k, default in _LATER_OPTIONS.items():  # keys added later appear once set, so older
            if d[k] == default:                    # plans keep their bytes
                del d[k]
        return d

    @staticmethod
    def from_json(d: dict, where: str = "plan options") -> "Options":
        return decode(Options, d, where)


def check_values(o: Options) -> None:
    """One TensorstowError for sizes, optimizer and loss-scaling settings no step can run with
    (torch.optim's own rules for Adam: lr, eps, weight decay >= 0, each beta in [0, 1); fp16-mixed:
    `check_loss_scaling`), and an empty --lora spec."""
    finite = "must be a finite number >= 0"
    bad = [f"--{name.replace('_', '-')} {value} {rule}" for name, value, ok, rule in (
        ("batch", o.batch, o.batch >= 0, "must be >= 1 (0: the model's default)"),
        ("seq", o.seq, o.seq >= 0, "must be >= 1 (0: the model's default)"),
        ("grad_accum", o.grad_accum, o.grad_accum >= 1, "must be >= 1"),
        ("microbatches", o.microbatches, o.microbatches >= 0, "must be >= 1 (0: as many as GPUs)"),
        ("lora", repr(o.lora), o.lora is None or o.lora.strip(),
         "must name the adapters, r=8,alpha=16,targets=q_proj,v_proj (leave --lora out to train every weight)"),
        ("lr", o.lr, math.isfinite(o.lr) and o.lr >= 0, finite), ("eps", o.eps, math.isfinite(o.eps) and o.eps >= 0, finite),
        ("weight_decay", o.weight_decay, math.isfinite(o.weight_decay) and o.weight_decay >= 0, finite),
        ("betas", " ".join(map(str, o.betas)), all(math.isfinite(b) and 0 <= b < 1 for b in o.betas),
         "must each be in [0, 1)")) if not ok]
    if bad:
        raise TensorstowError(f"plan options: {'; '.join(bad)}")
    ssd_kinds(o)
    if o.precision == "fp16-mixed":
        check_loss_scaling(o)


SSD_KINDS = ("params", "optimizer", "activations")
"""What `Options.ssd_for` names."""


def ssd_kinds(o: Options) -> frozenset[str]:
    """The kinds of tensor `Options.ssd_for` lets the SSDs hold; one TensorstowError for a name
    that is none of them."""
    names = [x.strip() for x in (o.ssd_for or "all").split(",") if x.strip()]
    if names in (["all"], ["none"]):
        return frozenset(SSD_KINDS if names == ["all"] else ())
    wrong = [n for n in names if n not in SSD_KINDS]
    if wrong or not names:
        what = f"{', '.join(map(repr, wrong))} is not what an SSD holds" if wrong else "names nothing"
        raise TensorstowError(f"--ssd-for {o.ssd_for!r}: {what}; name some of {', '.join(SSD_KINDS)} "
                              f"(comma-separated), all, or none")
    return frozenset(names)


def check_loss_scaling(o: Options) -> None:
    """One TensorstowError for dynamic loss scaling settings torch.amp.GradScaler's update cannot
    run with: a finite init_scale > 0, a finite growth_factor > 1, 0 < backoff_factor < 1 and
    growth_interval >= 1 (the scale must grow after clean steps and shrink after an overflow)."""
    bad = [f"--{name.replace('_', '-')} {value} {rule}" for name, value, ok, rule in (
        ("init_scale", o.init_scale, math.isfinite(o.init_scale) and o.init_scale > 0, "must be a finite number > 0"),
        ("growth_factor", o.growth_factor, math.isfinite(o.growth_factor) and o.growth_factor > 1,
         "must be a finite number > 1"),
        ("backoff_factor", o.backoff_factor, 0 < o.backoff_factor < 1, "must be in (0, 1)"),
        ("growth_interval", o.growth_interval, o.growth_interval >= 1, "must be >= 1")) if not ok]
    if bad:
        raise TensorstowError(f"plan options: fp16-mixed loss scaling: {'; '.join(bad)}")


@dataclass(frozen=True)
class ParamGroup:
    """One of `Options.param_groups`, parsed."""
    pattern: str
    lr_scale: float = 1.0
    weight_decay: float | None = None
    """None: the `weight_decay` rule (decay_all, or 2-D and larger)."""


def parse_param_group(spec: str) -> ParamGroup:
    """"PATTERN[:lr_scale=X][,weight_decay=Y]" as a ParamGroup; one TensorstowError naming the fault."""
    pattern, _, rest = spec.partition(":")
    values: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if key not in ("lr_scale", "weight_decay") or not eq:
            raise TensorstowError(f"param group {spec!r}: {item!r} is not lr_scale=X or weight_decay=Y")
        try:
            values[key] = float(value)
        except ValueError:
            raise TensorstowError(f"param group {spec!r}: {key} must be a number, got {value.strip()!r}") from None
        if not 0 <= values[key] < math.inf:  # nan or inf would train to NaN, or fail at the first update
            raise TensorstowError(f"param group {spec!r}: {key} must be a finite number >= 0, got {value.strip()}")
    if not pattern.strip():
        raise TensorstowError(f"param group {spec!r}: no parameter name pattern before ':'")
    return ParamGroup(pattern.strip(), **values)


def param_groups_of(specs, names) -> dict[str, ParamGroup]:
    """The group each parameter of `names` takes (the first whose pattern matches; unmatched
    names are left out). A group that matches no name is an error listing a few names."""
    groups = [parse_param_group(s) for s in specs]
    names = list(names)
    out: dict[str, ParamGroup] = {}
    for g in groups:
        hits = [n for n in names if fnmatch.fnmatchcase(n, g.pattern)]
        if not hits:
            raise TensorstowError(f"param group {g.pattern!r} matches no trainable parameter; they are named "
                                  f"like {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}")
        for n in hits:
            out.setdefault(n, g)
    return out


LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
"""Learning rate schedules by transformers' `get_scheduler` names (`executor.lr`)."""

_LATER_OPTIONS = {"gpus": None, "microbatches": 0, "grad_accum": 1, "lora": None, "clip_rate": 0.5, "mapping": "cross", "decay_all": False, "param_groups": (), "max_grad_norm": 0.0,
                  "lr_scheduler": "constant", "warmup_steps": 0, "min_lr_ratio": 0.0, "packing": False, "quantize": None, "quantize_skip": None,
                  "expert_groups": 1, "dp": 1, "nodes": 1, "net_bw": 25e9, "ssd_for": None}


# ---- the options as the command line and the Python API take them -------------------------------

@dataclass(frozen=True)
class Asked:
    """How the command line and `tensorstow.plan` take a field, where its name, type and default
    do not say it all."""
    name: str = ""
    """The keyword (`hw=`) and flag (`--hw`), where not the field's name."""
    default: str | None = None
    """The default of a field that has none (a plan file must name its value)."""
    choices: tuple[str, ...] = ()
    """The values it takes, where they are a few names."""
    size: bool = False
    """A byte count, also written as a size ("24GB", `schema.hardware.parse_size`)."""


ASKED: Mapping[str, Asked] = {
    "hardware": Asked(name="hw", default="local"),
    "precision": Asked(choices=("fp32", "bf16-mixed", "fp16-mixed")),
    "gpu_mem": Asked(size=True),
    "dram": Asked(size=True),
    "net_bw": Asked(size=True),
    "optimizer": Asked(choices=("adam", "adamw")),
    "mapping": Asked(choices=("cross", "sequential")),
    "lr_scheduler": Asked(choices=LR_SCHEDULERS),
}


@dataclass(frozen=True)
class Option:
    """One field of `Options` as the command line and `tensorstow.plan` take it."""
    field: str
    name: str
    """The keyword argument; the flag is `--` and the name with `-` for `_`."""
    type: type
    """int, float, str, bool or a tuple type (`tuple[float, float]`: that many values)."""
    optional: bool
    """None is a value (a field typed `X | None`)."""
    default: object
    """`dataclasses.MISSING` for the one required option, the model (a positional argument)."""
    choices: tuple[str, ...]
    size: bool
    doc: str
    """The field's docstring, on one line."""


@functools.cache
def field_docs(cls: type = Options) -> dict[str, str]:
    """Each field's attribute docstring (the string literal under it), whitespace collapsed."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}


@functools.cache
def asked() -> tuple[Option, ...]:
    """Every field of `Options`, in order, as the command line and `tensorstow.plan` take it."""
    hints, docs = typing.get_type_hints(Options), field_docs()
    out = []
    for f in dataclasses.fields(Options):
        tp, a = hints[f.name], ASKED.get(f.name, Asked())
        args = typing.get_args(tp)
        optional = type(None) in args and typing.get_origin(tp) is not tuple
        if optional:
            (tp,) = [t for t in args if t is not type(None)]
        out.append(Option(field=f.name, name=a.name or f.name, type=tp, optional=optional,
                          default=f.default if a.default is None else a.default,
                          choices=a.choices, size=a.size, doc=docs.get(f.name, "")))
    return tuple(out)


def from_asked(model: str, values: Mapping[str, object], where: str) -> Options:
    """Options for `model` from keyword values as the command line and `tensorstow.plan` take them:
    by their names (`hw` for hardware), sizes as bytes or size strings ("24GB"), a tuple as any
    sequence; an absent value, or None where the field's type has no None, is the default. A name that is
    no option is one TensorstowError naming it and listing the valid ones."""
    options = [o for o in asked() if o.default is not dataclasses.MISSING]
    unknown = sorted(set(values) - {o.name for o in options})
    if unknown:
        raise TensorstowError(f"{where}: unknown option{'s' * (len(unknown) > 1)} "
                              f"{', '.join(map(repr, unknown))}; the options are "
                              f"{', '.join(sorted(o.name for o in options))}")
    kw = {"model": model}
    for o in options:
        v = values.get(o.name)
        if v is None and not o.optional:
            v = o.default
        elif o.size and isinstance(v, str):
            v = parse_size(v)
        elif typing.get_origin(o.type) is tuple and v is not None:
            v = tuple(v)
        kw[o.field] = v
    return Options(**kw)
