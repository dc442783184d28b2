"""What every policy plans against: the `Problem` (traced model, hardware, options), built and
checked here. Its decisions are measured with `planner.passes.schedule`, which returns a
`planner.result.PlanResult`.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

from tensorstow.errors import TensorstowError
from tensorstow.ir.graph import Graph
from tensorstow.ir.models import DEFAULT_BATCH, ModelSpec, resolve_model
from tensorstow.ir.trace import PRECISIONS, model_dims, trace_model, trace_spec
from tensorstow.planner import cost
from tensorstow.schema.hardware import Hardware
from tensorstow.schema.options import LR_SCHEDULERS, Options, check_values, parse_param_group, ssd_kinds


REPLAY_BUDGET = 400_000
"""Instructions the replays a problem keeps (`Problem.replays`) hold together, at most: a search's
candidates come back after some dozens of others (a 70B model's replay holds some 4,000 to 11,000
instructions, a small model's hundreds)."""


class Memo:
    """Values by key, the least recently used dropped first once those kept weigh more than
    `budget` together (a value's weight: the caller's measure of its size)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.weight = 0
        """What the values kept weigh together."""
        self.items: OrderedDict = OrderedDict()
        """Key -> (value, weight), least recently used first."""

    def get(self, key):
        """The value kept for `key`, else None."""
        item = self.items.get(key)
        if item is None:
            return None
        self.items.move_to_end(key)
        return item[0]

    def clear(self) -> None:
        """Drop every value kept."""
        self.items.clear()
        self.weight = 0

    def put(self, key, value, weight: int) -> None:
        """Keep `value` for `key` (not where it alone weighs more than the budget)."""
        if key in self.items:
            self.weight -= self.items.pop(key)[1]
        if weight > self.budget:
            return
        self.items[key] = (value, weight)
        self.weight += weight
        while self.weight > self.budget:
            self.weight -= self.items.popitem(last=False)[1][1]


@dataclass
class Problem:
    """What every policy sees: the traced model, the hardware and the options."""

    graph: Graph
    hw: Hardware
    options: Options
    profiles: dict[str, cost.BlockProfile]
    order: list[str]
    """Block names in forward order."""
    profile_of: dict[str, str]
    frozen_params: int = 0
    """Parameters that do not train (`Traced.frozen_params`)."""
    machine: Hardware | None = None
    """Data parallel (`Options.dp`): the machine the plan names, of which `hw` is one rank's share
    (`Hardware.rank_share`); None: `hw` is the machine."""
    plans: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    """Each heuristic policy's plan for this problem, once made (`planner.policies.planned`); a
    problem made from it by `dataclasses.replace` starts without them."""
    replays: Memo = dataclasses.field(default_factory=lambda: Memo(REPLAY_BUDGET), init=False, repr=False,
                                      compare=False)
    """Replays of decisions (`planner.passes.lower_and_simulate`) by the decisions (without their
    notes) and whether copies waited for room, the latest used kept (`REPLAY_BUDGET`); a problem made
    from it by `dataclasses.replace` starts without them."""

    @property
    def mixed(self) -> bool:
        return self.options.precision != "fp32"

    def on_ssd(self, kind: str) -> bool:
        """Whether the plan may keep `kind` (`schema.options.SSD_KINDS`) on the SSDs: the machine
        has some and `Options.ssd_for` lets them hold it."""
        return self.hw.ssd.count > 0 and kind in ssd_kinds(self.options)

    def home(self, kind: str) -> str:
        """The farthest tier `kind` may live on: the SSDs where `on_ssd`, else DRAM."""
        return "ssd" if self.on_ssd(kind) else "dram"

    def capacity(self) -> dict[str, int]:
        """Per tier; "gpu" is the smallest GPU's (each GPU's own is `gpu_capacity`)."""
        return {"gpu": min(g.plan_bytes for g in self.hw.gpus), "dram": self.hw.dram.capacity_bytes,
                "ssd": self.hw.ssd.count * self.hw.ssd.capacity_bytes}

    def gpu_capacity(self) -> dict[str, int]:
        return {f"gpu{k}": g.plan_bytes for k, g in enumerate(self.hw.gpus)}


def waits_for_every_gradient(options: Options) -> bool:
    """Whether every update waits for the backward's last gradient: fp16 loss scaling (the skip
    decision) and clipping by the global norm (the factor) need all of them."""
    return options.precision == "fp16-mixed" or options.max_grad_norm > 0


def check_options(options: Options, model=None) -> ModelSpec | None:
    """Raise TensorstowError for options no problem can be built from (the model, the optimizer,
    the precision); return the model's spec (None for a module given to the Python API). The CLI
    checks them, and the policy (`check_policy`), before `--hw local` probes the machine, so a
    typo fails at once, in one line."""
    if options.optimizer not in ("adam", "adamw"):
        raise TensorstowError(f"unknown optimizer '{options.optimizer}': use adam or adamw")
    if options.precision not in PRECISIONS:
        raise TensorstowError(f"unknown precision '{options.precision}': use one of {sorted(PRECISIONS)}")
    if options.lr_scheduler not in LR_SCHEDULERS:
        raise TensorstowError(f"unknown lr scheduler '{options.lr_scheduler}': use one of {', '.join(LR_SCHEDULERS)}")
    if options.warmup_steps < 0 or not 0 <= options.min_lr_ratio <= 1:
        raise TensorstowError(f"need --warmup-steps >= 0 and 0 <= --min-lr-ratio <= 1, got {options.warmup_steps} "
                              f"and {options.min_lr_ratio}")
    check_values(options)
    if not 0 <= options.clip_rate <= 1:
        raise TensorstowError(f"--clip-rate must be in [0, 1] (the fraction of steps whose clip fires), got "
                              f"{options.clip_rate}")
    if options.max_grad_norm < 0:
        raise TensorstowError(f"--max-grad-norm must be >= 0 (0: no clipping), got {options.max_grad_norm}")
    for spec in options.param_groups:  # their patterns are matched when the executor starts
        parse_param_group(spec)
    if options.expert_groups < 0:
        raise TensorstowError(f"--expert-groups must be >= 0 (1: a layer's experts are one unit; 0: the planner "
                              f"chooses), got {options.expert_groups}")
    if options.expert_groups > 1 and (options.gpus or 1) > 1:
        raise TensorstowError(f"--expert-groups {options.expert_groups}: placement units finer than a layer are planned on "
                              f"one GPU; plan with --gpus 1 or without --expert-groups")
    _check_dp(options)
    if model is not None and options.lora:
        raise TensorstowError("lora: a model object brings its own adapters (get_peft_model); leave lora out")
    if model is not None and (options.quantize or options.quantize_skip):
        raise TensorstowError("quantize: a model object is traced as it is; quantize its base with "
                              "tensorstow.ir.quant.quantize_linears first, or plan an hf:DIR checkpoint")
    return resolve_model(options.model, options.lora, options.quantize, options.quantize_skip) if model is None else None


def _check_dp(o: Options) -> None:
    if o.dp < 1 or o.nodes < 1 or o.net_bw <= 0:
        raise TensorstowError(f"need --dp >= 1, --nodes >= 1 and --net-bw > 0, got {o.dp}, {o.nodes} and {o.net_bw:g}")
    if o.nodes > 1 and o.dp == 1:
        raise TensorstowError(f"--nodes {o.nodes}: machines train together data-parallel; give --dp (machines x "
                              f"GPUs per machine)")
    if o.dp == 1:
        return
    if o.microbatches > 1:
        raise TensorstowError(f"--dp {o.dp}: each rank runs a one-GPU plan; accumulate with --grad-accum, not "
                              f"--microbatches (a pipeline's)")
    if o.expert_groups != 1:
        raise TensorstowError(f"--dp {o.dp}: expert groups (--expert-groups {o.expert_groups}) are planned on one "
                              f"process; leave --expert-groups out")


def data_parallel_share(options: Options, hw: Hardware) -> Hardware:
    """Data parallel: one rank's share of `hw` (one machine of `options.nodes`, whose GPUs are the
    ranks on it), refused unless dp = nodes x GPUs."""
    per = len(hw.gpus)
    if options.dp != options.nodes * per:
        raise TensorstowError(f"--dp {options.dp} needs {options.nodes} machine(s) x {per} GPU(s) = "
                              f"{options.nodes * per} ranks: give --gpus {max(1, options.dp // options.nodes)} "
                              f"(GPUs per machine) or --dp {options.nodes * per}")
    return hw.rank_share(per)


def build_problem(options: Options, hw: Hardware, model=None) -> Problem:
    """`model`: an nn.Module to trace instead of building `options.model` (the Python API)."""
    spec = check_options(options, model)
    machine = None
    if options.dp > 1:
        machine, hw = hw, data_parallel_share(options, hw)
    batch = options.batch or DEFAULT_BATCH.get(options.model, 1)
    if model is not None:
        traced = trace_model(model, batch=batch, seq=options.seq or model_dims(model)[1] or 1,
                             precision=options.precision, model_name=options.model, packing=options.packing)
    else:
        traced = trace_spec(spec, batch=batch, seq=options.seq or None,
                            precision=options.precision, packing=options.packing)
    g = traced.graph
    profiles = cost.profiles(g, hw, options.expert_groups)
    if options.expert_groups > 1 and not any(p.units for p in profiles.values()):
        raise TensorstowError(f"--expert-groups {options.expert_groups}: {options.model} has no layer whose experts can be "
                              f"grouped (a grouped matmul over a trained (experts, ...) weight with at least "
                              f"{options.expert_groups} experts); plan it without --expert-groups")
    return Problem(graph=g, hw=hw, options=options, profiles=profiles,
                   order=[b.name for b in g.blocks], profile_of={b.name: b.profile for b in g.blocks},
                   frozen_params=traced.frozen_params, machine=machine)


