"""The plan file as one typed, immutable `Plan`: what the planner writes, and what the
executor, the simulator and `tensorstow show/diff/check` read (docs/plan-format.md).

`Plan.from_json` is strict: an unknown or missing key, a value of the wrong type, an
instruction whose id or dependencies are out of order, or a reference to a buffer the plan
does not declare is one `TensorstowError` naming the field (`plan file p.json: field
'buffers.P:b0.bytes': expected an integer, got 'x'`). `Plan.to_json()` gives back the same
dict, so a plan round-trips byte for byte. Containers are tuples and read-only mappings.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tensorstow.errors import TensorstowError
from tensorstow.schema.hardware import Hardware
from tensorstow.schema.options import Options
from tensorstow.schema.run import Run
from tensorstow.schema.schedule import (TENSOR_KINDS, Buffer, BufferKind, Decisions, Instr, InstrKind, buffer_kind,
                                        Stream, is_gpu, parent_of)
from tensorstow.schema.typed import decode, encode, freeze

SCHEMA_VERSION = 4
"""4: `pools` are each GPU process's DRAM arena (`PoolSizes`); 3: autocast semantics: profiles'
`param_bytes`/`grad_bytes`, loss-scaling options; 2: H buffers and profiles' `handed_bytes`;
1: before."""


# ---- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BlockInfo:
    name: str
    profile: str
    """The traced block whose profile (and template) it shares."""
    params: int


@dataclass(frozen=True, kw_only=True)
class ProfileInfo:
    """A traced block's costs as the plan records them (`planner.cost.BlockProfile` without the
    member lists, which the buffers carry)."""
    name: str
    fwd_ops: tuple[int, int]
    bwd_ops: tuple[int, int]
    fwd_flops: int
    bwd_flops: int
    fwd_time_s: float
    bwd_time_s: float
    param_count: int
    param_bytes: int
    grad_bytes: int
    const_bytes: int
    reads: tuple[str, ...]
    saved_bytes: int
    input_bytes: int
    output_bytes: int
    fwd_workspace: int
    bwd_workspace: int
    opt_workspace: int
    carried_bytes: int
    carried_until: str
    handed_bytes: int


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    name: str
    fingerprint: str
    """Hash of the traced IR: the executor refuses a model whose trace differs."""
    params: int
    layers: int
    traced_layers: int
    """< layers: traced as a block template (first, middle, last layer; ir.template)."""
    batch: int
    seq: int
    precision: str
    blocks: tuple[BlockInfo, ...]
    """In forward order."""
    profiles: Mapping[str, ProfileInfo]
    active_params: int | None = None
    """A mixture of experts: the parameters one token meets (`ir.graph.Graph.active_param_count`);
    None (and not written) for a dense model, whose every parameter is active."""
    frozen_params: int | None = None
    """Parameters that do not train (a LoRA model's base; a quantized weight counted by its shape),
    beside `params`, the trainable ones; None (and not written) where every parameter trains."""

    def __post_init__(self):
        freeze(self)

    def to_json(self) -> dict:
        return {f.name: encode(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in ("active_params", "frozen_params") or getattr(self, f.name) is not None}


@dataclass(frozen=True, kw_only=True)
class HardwareInfo:
    name: str
    fingerprint: str
    spec: Hardware


@dataclass(frozen=True, kw_only=True)
class Predicted:
    step_time_s: float
    tokens_per_s: float
    model_tflops: float
    peak_bytes: Mapping[str, int]
    capacity_bytes: Mapping[str, int]
    bottleneck: str
    busy_s: Mapping[str, float]
    traffic_bytes: Mapping[str, int]
    eval_step_s: float = 0.0
    """One evaluation batch through `Plan.eval_instructions` (0: the plan has none)."""
    redo_s: float = 0.0
    """`Plan.redo_instructions` after a step whose clip fired (0: the plan speculates nothing)."""

    def __post_init__(self):
        freeze(self)


@dataclass(frozen=True, kw_only=True)
class PoolSizes:
    """The arenas one GPU's executor process preallocates, in bytes (STRONGHOLD §3.4 buffer pools):
    every DRAM copy of a step is a range of the DRAM one, every device copy (but workspaces and expert
    units' rows) a range of the device one (`planner.pools`)."""
    sync: int
    """For a replay in program order (`execute --mode sync`)."""
    overlap: int
    """For lanes that run ahead of program order as the simulated replay does (`--mode overlap`): at
    least `sync`."""
    device: int = 0
    """The device arena (`planner.pools.device_arena`): the process's copies on its GPU, each at an
    offset the plan's instructions determine, in either mode; the largest of the step's, the
    evaluation's and the redo's. 0: none (a plan without one, or no copy on the GPU)."""


def _buffer_entry(name: str, entry, where: str):
    """A plan file's buffer entry as `Buffer` takes it: its name added, its `kind` (which the name
    says: `TENSOR_KINDS`) checked and left out."""
    if not isinstance(entry, dict):
        return entry
    try:
        want = TENSOR_KINDS[buffer_kind(name)]
    except ValueError:
        raise TensorstowError(f"{where}: buffer '{name}' is not a buffer name (KIND:block, KIND one of "
                              f"{', '.join(BufferKind)})") from None
    if entry.get("kind", want) != want:
        raise TensorstowError(f"{where}: field 'buffers.{name}.kind': {entry['kind']!r}, but a {buffer_kind(name)} "
                              f"buffer holds {want}; re-plan it")
    return {k: v for k, v in entry.items() if k != "kind"} | {"name": name}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One training step's static schedule for one model x hardware x options."""
    schema_version: int
    model: ModelInfo
    hardware: HardwareInfo
    options: Options
    decisions: Decisions
    buffers: Mapping[str, Buffer]
    instructions: tuple[Instr, ...]
    """In program order; `est_s` is each one's modeled duration."""
    pools: Mapping[str, PoolSizes]
    """Per GPU process, by its GPU tier (`gpu0`, ...): the DRAM arena it preallocates."""
    predicted: Predicted
    run: Run | None = None
    """How `tensorstow execute` runs it, where the plan was made from a recipe file (its
    `[execute]` table); absent otherwise."""
    redo_instructions: tuple[Instr, ...] = ()
    """A plan that speculates (`Decisions.speculated`): what runs after a step whose clip fires,
    before its commit: each speculated block's state read back from the last commit, updated
    again with the clipped gradient it kept, written home, the gradient released; program
    order, ids from 0."""
    eval_instructions: tuple[Instr, ...] = ()
    """The forward-only program an evaluation batch runs (one GPU): the parameters streamed as
    the step streams them, each block's forward keeping only what the next block reads, no
    gradient, no update; program order, ids from 0. Empty: evaluation runs the step's
    instructions with the updates left out."""

    def __post_init__(self):
        freeze(self)

    @staticmethod
    def from_json(d, where: str = "plan") -> "Plan":
        if isinstance(d, dict) and "schema_version" in d and d["schema_version"] != SCHEMA_VERSION:
            raise TensorstowError(f"{where} has schema_version {d['schema_version']!r}, this tensorstow "
                                  f"reads {SCHEMA_VERSION}; re-plan it")
        if isinstance(d, dict) and isinstance(d.get("buffers"), dict):  # the key is the buffer's name
            d = d | {"buffers": {k: _buffer_entry(k, v, where) for k, v in d["buffers"].items()}}
        plan = decode(Plan, d, where)
        plan._check(where)
        return plan

    def _check(self, where: str) -> None:
        """What types cannot say: program order and references."""
        if not self.hardware.spec.gpus:
            raise TensorstowError(f"{where}: field 'hardware.spec.gpus': expected a non-empty list of GPU objects; "
                                  f"re-plan it")
        if not self.instructions:
            raise TensorstowError(f"{where}: field 'instructions' is empty: a plan's step has instructions; re-plan it")
        for label, k, ins in [*(("instruction", k, i) for k, i in enumerate(self.instructions)),
                              *(("eval instruction", k, i) for k, i in enumerate(self.eval_instructions)),
                              *(("redo instruction", k, i) for k, i in enumerate(self.redo_instructions))]:
            at = f"{where}: {label} {k}"
            if ins.id != k or any(not 0 <= x < k for x in ins.deps):
                raise TensorstowError(f"{at}: id {ins.id} / deps {list(ins.deps)} must be the index "
                                      f"and smaller ids; re-plan it")
            for name in (ins.tensor, ins.workspace, *ins.allocs):
                if name and name not in self.buffers:
                    raise TensorstowError(f"{at} uses buffer '{name}', which the plan does not declare")
            missing = _missing_fields(ins)
            if missing:
                raise TensorstowError(f"{at} ({ins.kind}) {missing}; re-plan it")
            if ins.kind in (InstrKind.COMPUTE, InstrKind.RECOMPUTE) and not is_gpu(Stream.of(ins.stream).device):
                raise TensorstowError(f"{at} ({ins.kind}) runs on stream '{ins.stream}': segments run on a GPU's "
                                      f"compute stream; re-plan it")
        room = sum(self.predicted.capacity_bytes.values())
        for name, b in self.buffers.items():
            if not 0 <= b.bytes <= room:
                raise TensorstowError(f"{where}: buffer {name} has {b.bytes} bytes, outside 0..{room} (the "
                                      f"hardware's capacity, every tier together); re-plan it")
        names = {b.name for b in self.model.blocks}
        for b in self.model.blocks:
            if b.profile not in self.model.profiles:
                raise TensorstowError(f"{where}: block {b.name} has profile '{b.profile}', which "
                                      f"model.profiles lacks")
        for name, b in self.buffers.items():
            if parent_of(b.block) not in names:
                raise TensorstowError(f"{where}: buffer {name} belongs to block '{b.block}', which the model does "
                                      f"not have; re-plan it")
        units = {b for b in self.decisions.blocks if parent_of(b) != b}  # a block's placement units
        if set(self.decisions.blocks) - units != names or not {parent_of(u) for u in units} <= names:
            raise TensorstowError(f"{where}: decisions.blocks must name exactly the model's blocks (and units of them)")

    def to_json(self) -> dict:
        d = {f.name: encode(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if self.run is None:
            del d["run"]
        for key in ("eval_instructions", "redo_instructions"):
            if not getattr(self, key):
                del d[key]
        for key in ("eval_step_s", "redo_s"):
            if not getattr(self.predicted, key):
                del d["predicted"][key]
        d["buffers"] = {k: {"bytes": b.bytes, "kind": b.kind, "block": b.block, "home": b.home,
                            **({"members": list(b.members)} if b.members else {})}
                        for k, b in sorted(self.buffers.items())}
        return d

    def dumps(self) -> str:
        """The plan file's text: keys sorted, so the same plan is the same bytes."""
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    @staticmethod
    def load(path) -> "Plan":
        """Read a plan file; one clear error for anything missing or malformed."""
        p = Path(path)
        if not p.is_file():
            raise TensorstowError(f"plan file {path} does not exist; create one with "
                                  f"`tensorstow plan MODEL -o {path}`")
        try:
            d = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TensorstowError(f"plan file {path} is not valid JSON ({e}); re-create it with "
                                  f"`tensorstow plan`") from None
        except RecursionError:
            raise TensorstowError(f"plan file {path} nests its JSON deeper than Python reads; it is not a "
                                  f"tensorstow plan (re-create it with `tensorstow plan`)") from None
        if not isinstance(d, dict):
            raise TensorstowError(f"plan file {path}: expected a JSON object at the top level")
        missing = [f.name for f in dataclasses.fields(Plan) if f.name not in d and f.default is dataclasses.MISSING]
        if missing:
            raise TensorstowError(f"plan file {path} lacks {missing}; it is not a tensorstow plan or "
                                  f"is truncated")
        return Plan.from_json(d, where=f"plan file {path}")

    # ---- what readers ask of a plan -------------------------------------------------------
    @property
    def replicated(self) -> bool:
        """Traced as a block template: fewer layers traced than the model has."""
        return self.model.traced_layers < self.model.layers

    def ssd_sizes(self) -> dict[str, int]:
        """Buffer -> bytes for every buffer the plan ever keeps on the SSD tier (what an SSD
        store must be created with)."""
        names = {n for n, b in self.buffers.items() if b.home == "ssd"}
        names |= {i.tensor for i in self.instructions if i.kind in (InstrKind.LOAD, InstrKind.STORE) and i.dst == "ssd"}
        return {n: self.buffers[n].bytes for n in sorted(names)}

    def persistent(self) -> list[str]:
        """Buffers with a home tier: the training state a checkpoint holds."""
        return sorted(n for n, b in self.buffers.items() if b.home)


def _is_tier(t: str) -> bool:
    return t in ("dram", "ssd") or is_gpu(t)


def _missing_fields(ins: Instr) -> str:
    """What an instruction of its kind lacks (a buffer, a tier, a segment); "" when whole."""
    if ins.kind in (InstrKind.LOAD, InstrKind.STORE, InstrKind.SEND):
        if not ins.tensor:
            return "names no buffer"
        if not (_is_tier(ins.src) and _is_tier(ins.dst)) or ins.src == ins.dst:
            return f"copies {ins.src or '?'} -> {ins.dst or '?'}, not between two tiers (gpuK, dram, ssd)"
    elif ins.kind == InstrKind.REDUCE:
        if not ins.tensor or not is_gpu(ins.dst):
            return "names no gradient and GPU tier to reduce on"
    elif ins.kind == InstrKind.GATHER:
        if not ins.tensor or not (ins.dst == "dram" or is_gpu(ins.dst)):
            return "names no parameters and tier (dram, gpuK) to gather on"
    elif ins.kind == InstrKind.FREE:
        if not ins.tensor or not _is_tier(ins.dst):
            return "names no buffer and tier to release"
    elif ins.kind in (InstrKind.COMPUTE, InstrKind.RECOMPUTE, InstrKind.OPTIMIZER_STEP):
        if not ins.segment:
            return "names no segment"
        if ins.kind == InstrKind.OPTIMIZER_STEP and not (ins.dst == "cpu" or is_gpu(ins.dst)):
            return f"runs on '{ins.dst}', not cpu or gpuK"
    return ""


def as_plan(plan) -> Plan:
    """A `Plan` from what callers hand the executor: a Plan, the planner's result, or a dict."""
    if isinstance(plan, Plan):
        return plan
    if hasattr(plan, "to_plan"):
        return plan.to_plan()
    if isinstance(plan, dict):
        return Plan.from_json(plan)
    raise TensorstowError(f"expected a plan (tensorstow.plan(...), Plan.load(path) or its JSON dict), "
                          f"got {type(plan).__name__}")
