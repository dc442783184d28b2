"""Compiling a plan for one executor process, once, before its first step: the runtime tables the
dispatch loop reads.

`compile_program(plan, model)` traces `model` as the planner traced it (`trace_for`: the IR layer's
`trace_model`, or the caller's trace of it), and `Program(plan, traced, model)` refuses a plan whose
model fingerprint differs and turns the plan into tables, checking each against the traced model:
this process's share of the instructions (validated, numbered 0.. in program order), every buffer's
layout (its named tensors, dtypes and shapes), which buffers may hold each joint-graph value, the
values each segment leaves on the device, the recomputed segments that draw random numbers, the
homes of the training state, and the DRAM arena (`Plan.pools`). It decides nothing: every table is
read from the plan, and a plan the traced model contradicts is one error naming the instruction or
buffer and "re-plan it".
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
import torch.nn as nn

from tensorstow.errors import TensorstowError
from tensorstow.executor.segments import Joint
from tensorstow.executor.stores import Layout
from tensorstow.ir.graph import numel
from tensorstow.ir.hf import wrap
from tensorstow.ir.models import IGNORE_INDEX, build_for_execution, resolve_model
from tensorstow.ir.trace import Traced, model_dims, trace_model
from tensorstow.schema.options import param_groups_of
from tensorstow.schema.plan import Plan, as_plan
from tensorstow.schema.schedule import (HELD_KINDS, MADE_BY_COMPUTE, UNIT, BufferKind, Instr, InstrKind, block_gpus,
                                        block_of, buffer_kind, carried_buffers, gpu_index, gpu_tier, home_tiers,
                                        is_gpu, member_rows, parent_of, rows_member, runs_on, split_micro,
                                        split_segment)

OPTIMIZER_STATE = (BufferKind.M, BufferKind.OS)
"""Buffer kinds that hold the optimizer's fp32 state (no joint-graph value)."""
KINDS = tuple(InstrKind)
"""The instruction kinds an executor runs (`runtime.HANDLERS`)."""


class Program:
    """One process's share of a plan, compiled against the traced model (the module docstring)."""

    def __init__(self, plan, traced: Traced, model: nn.Module, *, rank: int | None = None, comm=None):
        """`plan`: a Plan, the planner's result or its JSON dict; `traced`: `model`'s trace with the
        plan's batch, seq and precision (`trace_for`); `model`: the module it was made for
        (wrapped: `ir.hf.wrap`); `rank`: the GPU this process drives (None: a one-GPU plan);
        `comm`: the process group of a multi-GPU run."""
        plan = as_plan(plan)  # the typed plan, as its file would read (a dict is validated)
        self.plan: Plan = plan
        self._placement(rank, comm)
        self.traced = traced
        _check_model_graph(plan.model, traced)
        self.graph = traced.graph
        self.joint = Joint(traced)
        self._model_tables(model)
        self.instrs, self.plan_id = self._read_instructions(plan.instructions)
        """This process's share of the step's instructions; `plan_id`: each one's id in the plan."""
        self.eval_instrs, self.eval_plan_id = self._read_instructions(plan.eval_instructions)
        """The same of the forward-only program an evaluation batch runs (`Plan.eval_instructions`;
        empty: evaluation runs the step's, updates left out)."""
        self.redo_instrs, self.redo_plan_id = self._read_instructions(plan.redo_instructions)
        """The redo program of a speculating plan (`Plan.redo_instructions`), run after a step whose
        clip fired."""
        self._units(plan)
        self.layouts, self.members = self._buffers(plan)
        self._add_reforwards()
        self._add_backward_parts()
        for instrs in (self.instrs, self.eval_instrs, self.redo_instrs):
            self._check_references(instrs)
        if self.speculated and not self.redo_instrs:
            raise TensorstowError("the plan speculates updates but has no redo program; re-plan it")
        self.holders: dict[str, list[str]] = defaultdict(list)
        """Joint-graph value -> the buffers whose members include it."""
        for buf, roots in self.members.items():
            if buffer_kind(buf) in HELD_KINDS:
                for r in roots:
                    self.holders[r].append(buf)
        self._holders_of: dict[tuple[str, int], list[str]] = {}  # `holders_of`, made once per key
        recomputed = {i.segment for i in self.instrs if i.kind == InstrKind.RECOMPUTE}
        self.random_segments = {name for name in recomputed if _draws_random(self.joint.segments[name])}
        """Recomputed segments that draw random numbers (dropout): their recompute replays the
        generator state their first run started from, so masks equal the original forward's."""
        pred = plan.predicted
        if pred.peak_bytes["gpu"] > pred.capacity_bytes["gpu"]:
            raise TensorstowError(f"the plan does not fit its GPU ({pred.peak_bytes['gpu']} bytes at peak > "
                                  f"{pred.capacity_bytes['gpu']} capacity); re-plan it")
        self.keep = self._kept_values(self.instrs, self.plan_id)
        """Per compute instruction, the values its segment leaves on the device."""
        self.eval_keep = self._kept_values(self.eval_instrs, self.eval_plan_id) if self.eval_instrs else {}

    def _placement(self, rank: int | None, comm) -> None:
        """What the plan says of this process: its GPU, its microbatches, its blocks, its homes."""
        plan = self.plan
        self.M = plan.decisions.microbatches()
        """Microbatches per step (a pipeline's, or gradient accumulation's): `step` takes M x the
        plan's batch."""
        self.block_gpu = block_gpus(plan)
        """Block -> the GPU tier that runs it."""
        self.rank = rank = check_runnable(plan, rank, comm)
        self.dp = plan.decisions.dp
        """Data parallel: the ranks that each run this schedule on their own rows (`Decisions.dp`)."""
        self.gpu, self.comm = gpu_tier(0 if self.dp > 1 else rank), comm
        """The GPU tier this process drives: the plan's "gpuK" (every data-parallel rank's is gpu0)."""
        order = [b.name for b in plan.model.blocks]
        self.homes = {n: t for n, t in home_tiers(dict(plan.buffers), plan.decisions, order).items()
                      if self.block_gpu[plan.buffers[n].block] == self.gpu}
        """This process's buffers with a home tier -> that tier: the training state it holds."""
        self.carried = [x for x in carried_buffers(plan.decisions, dict(plan.buffers)) if x in self.homes]
        """SSD-homed buffers whose latest version stays in DRAM between steps
        (`Decisions.deferred_writes`): each step writes them home first, then commits the step
        before (its `commit` instruction)."""
        self.precision = plan.model.precision
        self.mixed = self.precision != "fp32"
        self.fp32_grads = plan.decisions.fp32_grads(self.mixed)
        """G holds fp32 gradients (`Decisions.fp32_grads`: accumulated over microbatches, or on
        their way to SSD)."""
        self.speculated = frozenset(plan.decisions.speculated)
        """Blocks updated before the step's norm is known (`Decisions.speculated`)."""

    def _model_tables(self, model: nn.Module) -> None:
        """What the traced model says: its parameters per block, their groups, its vocabulary and
        the labels its loss ignores."""
        j, o = self.joint, self.plan.options
        shapes = {n: tuple(p.shape) for n, p in model_state(model).items()}
        if sorted(shapes) != j.param_names or any(shapes[n] != j.meta(j.placeholder[n])[1] for n in shapes):
            raise TensorstowError(f"the model's parameters and buffers do not match the traced graph of "
                                  f"{self.plan.model.name}; pass the model the trace was made from")
        self.vocab = model_dims(model)[0]
        """The model's vocabulary size (token ids a step may hold), None where it has none."""
        self.ignore_index = ignored_labels(self.traced)
        """Label values the model's loss leaves out (nanoGPT's -1, Hugging Face's -100)."""
        self.block_params = {b: ps for b, (ps, _) in j.block_state.items()}
        """Trainable parameters per block (P, G, M, OS, the optimizer)."""
        self.block_consts = {b: cs for b, (_, cs) in j.block_state.items() if cs}
        """Frozen parameters and buffers per block (C: read, never written)."""
        self.frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        self.param_order = [n for n, p in model.named_parameters() if p.requires_grad]
        """Trainable parameters in the model's order (`model.parameters()`, a tied one once): the
        order torch's clip_grad_norm_ stacks their norms in."""
        self.forward_draws_random = any(draws_random_node(n) for seg in j.segments.values() for n in seg.nodes)
        """Whether the step draws random numbers (dropout above 0: eval mode would not): `evaluate`
        refuses such a model."""
        self.decayed = {p for ps in self.block_params.values() for p in ps
                        if o.decay_all or len(j.meta(j.placeholder[p])[1]) >= 2}
        """Trainable parameters the weight decay applies to (`Options.weight_decay`, `decay_all`)."""
        named = param_groups_of(o.param_groups, [p for ps in self.block_params.values() for p in ps])
        self.groups: dict[str, tuple[float, float]] = {
            p: (g.lr_scale if g else 1.0,
                g.weight_decay if g and g.weight_decay is not None else o.weight_decay if p in self.decayed else 0.0)
            for ps in self.block_params.values() for p in ps for g in (named.get(p),)}
        """Per trainable parameter, its group's (learning rate scale, weight decay): the first of
        `Options.param_groups` it matches, else (1, the weight decay rule)."""

    def pool_bytes(self, mode: str) -> int:
        """Bytes of the DRAM arena this process preallocates in `mode` (`Plan.pools`)."""
        sizes = self.plan.pools.get(self.gpu)
        if sizes is None:
            raise TensorstowError(f"the plan's pools have no entry for {self.gpu}; re-plan it")
        return sizes.sync if mode == "sync" else sizes.overlap

    def _read_instructions(self, instructions) -> tuple[list[Instr], list[int]]:
        """This executor's share of a plan's instruction list, checked against what it drives (the
        plan's own consistency, ids, deps and buffer names, `Plan.from_json` has checked), numbered
        0.. in program order, and each one's id in the plan; dependencies on other ranks'
        instructions are dropped: what crosses ranks is a `send`, which both ends replay."""
        plan = self.plan
        g = self.gpu
        links = {(g, "dram"), ("dram", g), ("dram", "ssd"), ("ssd", "dram")}
        mine: list[Instr] = []
        local: dict[int, int] = {}
        plan_id: list[int] = []
        for k, ins in enumerate(instructions):
            if ins.kind not in KINDS:
                raise TensorstowError(f"plan instruction {k}: unknown kind '{ins.kind}' (this executor "
                                      f"runs {', '.join(KINDS)})")
            if not runs_on(ins, g, self.block_gpu, plan.buffers):
                continue
            if ins.kind in (InstrKind.COMPUTE, InstrKind.RECOMPUTE) and not self._known_segment(ins):
                raise TensorstowError(f"plan instruction {k}: unknown segment '{ins.segment}'")
            if ins.kind in (InstrKind.COMPUTE, InstrKind.RECOMPUTE) and ins.stream != f"{g}.compute":
                raise TensorstowError(f"plan instruction {k}: segments run on {g}.compute, not "
                                      f"'{ins.stream}' (one device, one compute stream)")
            if ins.kind in (InstrKind.LOAD, InstrKind.STORE) and (ins.src, ins.dst) not in links:
                raise TensorstowError(f"plan instruction {k}: no copy {ins.src} -> {ins.dst} (this executor "
                                      f"drives {g}, with dram and ssd)")
            if ins.kind == InstrKind.SEND and (self.comm is None or not (is_gpu(ins.src) and is_gpu(ins.dst))):
                raise TensorstowError(f"plan instruction {k}: a send {ins.src} -> {ins.dst} needs one process "
                                      f"per GPU (`tensorstow execute PLAN --nproc N`)")
            if ins.kind == InstrKind.FREE and ins.dst not in (g, "dram", "ssd"):
                raise TensorstowError(f"plan instruction {k}: unknown tier '{ins.dst}'")
            if ins.kind == InstrKind.OPTIMIZER_STEP and ins.dst not in ("cpu", g):
                raise TensorstowError(f"plan instruction {k}: optimizer device '{ins.dst}' is not cpu or {g}")
            if ins.micro >= self.M:
                raise TensorstowError(f"plan instruction {k}: microbatch {ins.micro} of {self.M}")
            local[k] = len(mine)
            plan_id.append(k)
            mine.append(dataclasses.replace(ins, id=local[k], deps=tuple(local[d] for d in ins.deps if d in local)))
        return mine, plan_id

    def _known_segment(self, ins: Instr) -> bool:
        """A traced segment, or a partial swap's re-forward of a block that has a forward (built
        from the plan's buffers by `_add_reforwards`)."""
        seg = ins.segment
        if seg in self.joint.segments:
            return True
        phase, b = split_segment(seg)
        if phase in ("bwd1", "bwd2"):  # a cut backward (`_add_backward_parts`)
            return ins.kind == InstrKind.COMPUTE and f"bwd:{b}" in self.joint.segments
        return ins.kind == InstrKind.RECOMPUTE and phase == "refwd" and f"fwd:{b}" in self.joint.segments

    def _add_reforwards(self) -> None:
        """The `refwd:<b>` segments a partial swap's recompute runs: the part of b's forward that
        makes R:<b> again from what A:<b> brought back (and X, P)."""
        for ins in self.instrs:
            phase, b = split_segment(ins.segment)
            if ins.kind != InstrKind.RECOMPUTE or phase != "refwd" or ins.segment in self.joint.segments:
                continue
            given = [r for x in (f"A:{b}", f"AE:{b}") for r in self.members.get(x, ())]
            if not ins.allocs or set(ins.allocs) - {f"R:{b}", f"RE:{b}"} or not given:
                raise TensorstowError(f"plan instruction {ins.id}: recompute {ins.segment} needs buffers A:{b} "
                                      f"and R:{b}; re-plan it")
            seg = self.joint.add_reforward(b, [r for x in ins.allocs for r in self.members[x]], given)
            if _draws_random(seg):
                raise TensorstowError(f"plan instruction {ins.id}: {ins.segment} would draw random numbers "
                                      f"again (dropout); a block that draws them is swapped whole; re-plan it")

    def _add_backward_parts(self) -> None:
        """The `bwd1:<b>` / `bwd2:<b>` segments of a cut backward: the first `bwd_cut` ops of b's
        backward in the traced graph's order (`BlockDecision.bwd_cut`, as the planner's profile
        counted them), and the rest."""
        cut = {b for phase, b in (split_segment(ins.segment) for ins in self.instrs) if phase == "bwd1"}
        for b in sorted(cut):
            if f"bwd1:{b}" in self.joint.segments:
                continue
            n = self.plan.decisions.blocks[b].bwd_cut if b in self.plan.decisions.blocks else 0
            profile = self.joint.inst.profile.get(b, b)
            ops = [o.name for o in self.graph.ops if o.block == profile and o.phase == "bwd"]
            if not 0 < n < len(ops):
                raise TensorstowError(f"the plan runs block {b}'s backward in two parts but cuts it after {n} "
                                      f"of its {len(ops)} ops; re-plan it")
            self.joint.add_backward_parts(b, set(ops[:n]))

    def _check_references(self, instrs: list[Instr]) -> None:
        """Every buffer an instruction names exists, and each kind creates what it can."""
        for ins in instrs:
            named = [ins.tensor] if ins.kind in (InstrKind.LOAD, InstrKind.STORE, InstrKind.FREE) else []
            for n in named + list(ins.allocs):
                if n not in self.layouts:
                    raise TensorstowError(f"plan instruction {ins.id}: unknown buffer '{n}'; re-plan it")
            if ins.kind in (InstrKind.COMPUTE, InstrKind.RECOMPUTE):
                bad = [a for a in ins.allocs if buffer_kind(a) not in MADE_BY_COMPUTE]
            elif ins.kind == InstrKind.OPTIMIZER_STEP:
                if not self.block_params.get(ins.segment):
                    raise TensorstowError(f"plan instruction {ins.id}: '{ins.segment}' is not a block "
                                          f"with parameters")
                bad = [a for a in ins.allocs if a != f"P:{ins.segment}"]
            else:
                bad = list(ins.allocs)
            if bad:
                raise TensorstowError(f"plan instruction {ins.id} ({ins.kind}) cannot create {bad}")

    def _units(self, plan) -> None:
        """A block's placement units (`schema.schedule.UNIT`, `Options.expert_groups`): each takes
        its rows of the block's expert weights out of the block's own parameters."""
        inst = self.joint.inst
        whole = {b: set(ps) for b, ps in self.block_params.items()}
        self.unit_rows: dict[str, tuple[int, int]] = {}
        """Unit -> the rows [a, b) of its block's expert weights it holds."""
        self.parts: dict[str, list[tuple[str, str, tuple[int, int], tuple[int, ...]]]] = {}
        """Buffer of a unit's P or G -> (layout key, joint-graph root, rows, the root's shape) of each
        member: the device holds the root whole, the buffer those rows of it (`stores.DeviceTier.parts`)."""
        for name, spec in sorted(plan.buffers.items()):
            u = block_of(name)
            if buffer_kind(name) is not BufferKind.P or UNIT not in u or self.block_gpu[u] != self.gpu:
                continue
            b, names, rows = parent_of(u), [], set()
            for m in spec.members:
                base, r = member_rows(m)
                names.append(inst.state_name(b, base))
                rows.add(r)
            if len(rows) != 1 or None in rows or not set(names) <= whole.get(b, set()):
                raise TensorstowError(f"plan buffer {name} holds {', '.join(spec.members)}, which are not rows of "
                                      f"block {b}'s weights in the traced model; re-plan it")
            self.unit_rows[u] = rows.pop()
            self.block_params[u] = names
            self.block_params[b] = [q for q in self.block_params[b] if q not in names]

    def _buffers(self, plan):
        """Layout (named tensors) of every data buffer, read from the plan's `members` (by the
        profile's names; a replicated layer's are its own instances), checked against the traced
        model and the plan's bytes."""
        j, inst = self.joint, self.joint.inst
        layouts: dict[str, Layout] = {}
        members: dict[str, list[str]] = {}
        for name, spec in sorted(plan.buffers.items()):
            kind, b = buffer_kind(name), parent_of(block_of(name))
            if kind == BufferKind.W:
                continue  # a workspace: the segment's real temporaries, counted as they are made
            if kind not in (*HELD_KINDS, BufferKind.M, BufferKind.OS) or b not in inst.profile:
                raise TensorstowError(f"plan buffer {name} names nothing in the traced model; re-plan it")
            if not spec.members:
                raise TensorstowError(f"plan buffer {name} does not list its members (a plan of an older "
                                      f"tensorstow); re-plan it")
            entries, roots = [], []
            for m in spec.members:
                base, rows = member_rows(m)
                try:
                    key, meta = self._member(kind, b, base)
                    dtype, shape = j.meta(meta)
                except KeyError:
                    raise TensorstowError(f"plan buffer {name} holds {m}, which the traced model does not "
                                          f"have; re-plan it") from None
                if rows is not None:  # a unit's rows of a weight, its gradient or its states
                    if not (len(shape) >= 1 and 0 <= rows[0] < rows[1] <= shape[0]):
                        raise TensorstowError(f"plan buffer {name} holds {m}, rows the traced model's {base} "
                                              f"of shape {tuple(shape)} does not have; re-plan it")
                    if kind not in OPTIMIZER_STATE:
                        self.parts.setdefault(name, []).append((rows_member(key, rows), key, rows, tuple(shape)))
                    key, shape = rows_member(key, rows), (rows[1] - rows[0], *shape[1:])
                if kind in OPTIMIZER_STATE and self.dp > 1:  # this rank's shard: whole rows, padded
                    shape = shard_shape(tuple(shape), self.dp)
                fp32 = kind in OPTIMIZER_STATE or kind is BufferKind.G and self.fp32_grads
                entries.append((key, torch.float32 if fp32 else dtype, shape))
                if kind not in OPTIMIZER_STATE:
                    roots.append(key if rows is None else member_rows(key)[0])
            layouts[name] = Layout(entries)
            if roots:
                members[name] = roots
            if layouts[name].nbytes != spec.bytes:
                raise TensorstowError(f"plan buffer {name}: {spec.bytes} bytes in the plan, "
                                      f"{layouts[name].nbytes} in the traced model; re-plan it")
        for b, params in self.block_params.items():
            if UNIT in b:
                continue  # checked with its block
            want = {"P": [j.placeholder[p] for p in params], "C": [j.placeholder[c] for c in self.block_consts.get(b, ())],
                    "G": sorted({r for p in params if p in j.grad for r in j.roots_of(j.grad[p])})}
            if self.block_gpu[b] != self.gpu:
                continue
            units = [u for u in self.unit_rows if parent_of(u) == b]
            if units:  # the block's and its units' buffers hold it together
                every = params + sorted({q for u in units for q in self.block_params[u]})
                want = {"P": [j.placeholder[p] for p in every], "C": want["C"],
                        "G": sorted({r for p in every if p in j.grad for r in j.roots_of(j.grad[p])})}
            for kind, names in want.items():
                held = members.get(f"{kind}:{b}", []) + [r for u in units for r in members.get(f"{kind}:{u}", [])]
                if kind != "C" and units:
                    held = sorted(set(held))
                if sorted(held) != sorted(names):
                    raise TensorstowError(f"plan buffer {kind}:{b} does not hold what block {b} of the traced "
                                          f"model has for it; re-plan it")
        return layouts, members

    def shard(self, p: str) -> tuple[int, int]:
        """Data parallel: the elements [a, b) of parameter `p` (flattened) whose update is this
        rank's: its whole rows [r c, (r + 1) c) of ceil(rows / dp) = c each, cut at the end."""
        shape = self.joint.meta(self.joint.placeholder[p])[1]
        rows, row = (shape[0], numel(shape[1:])) if len(shape) else (1, 1)
        c = -(-rows // self.dp)
        lo, hi = min(rows, self.rank * c), min(rows, (self.rank + 1) * c)
        return lo * row, hi * row

    def shard_numel(self, p: str) -> int:
        """Elements of one rank's shard of parameter p, padding included (`shard_shape`)."""
        return numel(shard_shape(tuple(self.joint.meta(self.joint.placeholder[p])[1]), self.dp))

    def shard_value(self, p: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's shard (`shard_shape`, its padding zeros) of a value of parameter `p`'s shape."""
        a, b = self.shard(p)
        out = torch.zeros(shard_shape(tuple(w.shape), self.dp), dtype=w.dtype)
        out.view(-1)[:b - a] = w.reshape(-1)[a:b]
        return out

    def row_key(self, b: str):
        """A layout key of block b's buffers, for a unit its rows' (`w` -> `w[0:4]`)."""
        rows = self.unit_rows.get(b)
        return (lambda k: k) if rows is None else (lambda k: rows_member(k, rows))

    def _member(self, kind: BufferKind, b: str, m: str) -> tuple[str, str]:
        """(layout key, traced node giving its dtype and shape) of a plan member of buffer kind:b."""
        j, inst = self.joint, self.joint.inst
        if kind in (BufferKind.P, BufferKind.C):
            ph = j.placeholder[inst.state_name(b, m)]
            return ph, ph
        if kind in OPTIMIZER_STATE:
            q, _, suffix = m.rpartition(".")
            if kind is BufferKind.M and suffix != "master" or kind is BufferKind.OS and suffix not in ("exp_avg", "exp_avg_sq"):
                raise KeyError(m)
            real = inst.state_name(b, q)
            return (real if kind is BufferKind.M else f"{real}.{suffix}"), j.placeholder[real]
        name = inst.name(b, m)
        j.node[inst.template_of(name)[0]]  # KeyError: not in the trace
        return name, name

    def _kept_values(self, instrs: list[Instr], plan_id: list[int]) -> dict[int, frozenset]:
        """Per compute instruction, the values its segment leaves on the device: what its
        `allocs` buffers hold (and the loss). Nothing else outlives a segment: every value read
        across segments is in a planned buffer (X, A, G, T, H), and this walk over the
        instructions in program order, tracking which buffers are on the device, refuses a plan under
        which a segment would read one that is not there.
        """
        j, g = self.joint, self.gpu
        present = set(self.homes.items())
        last_made: dict[str, int] = {}
        for ins in instrs:
            if ins.kind in (InstrKind.LOAD, InstrKind.STORE, InstrKind.SEND):
                present.add((ins.tensor, ins.dst))
            elif ins.kind == InstrKind.FREE:
                present.discard((ins.tensor, ins.dst))
            elif ins.kind == InstrKind.OPTIMIZER_STEP:
                for a in ins.allocs:
                    present.add((a, "dram" if ins.dst == "cpu" else ins.dst))
            elif ins.kind in (InstrKind.COMPUTE, InstrKind.RECOMPUTE):
                seg = j.segments[ins.segment]
                need = set(seg.ext_roots)
                for a in ins.allocs + ins.accum:
                    need |= set(self.members.get(a, ())) - seg.produced
                for r in sorted(need):
                    if r in j.inputs or r in j.constants or any((h, g) in present
                                                                 for h in self.holders_of(r, ins.micro)):
                        continue
                    where = self.holders.get(r)
                    if where:
                        why = (f"in {', '.join(where)} but none of them (for microbatch {ins.micro}) is on {g} "
                               f"at that point of the schedule: the plan is missing a load")
                    elif r in last_made:
                        why = (f"made by instruction {last_made[r]} but held by no buffer of the plan in "
                               f"between (every value that crosses segments is planned: X, A, G, T or H)")
                    else:
                        why = ("in no buffer of the plan (X:<b> holds only what the block and the blocks "
                               "after it read), so a recompute cannot get it")
                    raise TensorstowError(f"plan instruction {plan_id[ins.id]} ({ins.kind} {ins.segment}) reads {r}, "
                                          f"which is {why}; re-plan it")
                for r in seg.produced:
                    last_made[r] = ins.id
                for a in ins.allocs:
                    present.add((a, g))
        keep = {}
        loss_done: dict[int, bool] = {}
        for ins in instrs:
            if ins.kind not in (InstrKind.COMPUTE, InstrKind.RECOMPUTE):
                continue
            seg = j.segments[ins.segment]
            k = set()
            for a in ins.allocs + ins.accum:
                k |= set(self.members.get(a, ())) & seg.produced
            if j.loss in seg.produced and ins.kind == InstrKind.COMPUTE and not loss_done.get(ins.micro):
                k.add(j.loss)
                loss_done[ins.micro] = True
            keep[ins.id] = frozenset(k)
        if len(loss_done) < self.M and self.block_gpu[self.loss_block()] == self.gpu:
            raise TensorstowError("the plan never computes the segment that produces the loss; re-plan it")
        return keep

    def loss_block(self) -> str:
        """The block whose forward computes the loss."""
        for name, seg in self.joint.segments.items():
            if split_segment(name)[0] == "fwd" and self.joint.loss in seg.produced:
                return split_segment(name)[1]
        raise TensorstowError("the traced model has no segment that produces the loss")

    def holders_of(self, root: str, micro: int) -> list[str]:
        """The buffers that may hold `root` for microbatch `micro` (per-microbatch copies of the
        others' microbatches excluded). Every fetch asks: made once per (root, micro)."""
        out = self._holders_of.get((root, micro))
        if out is None:
            out = self._holders_of[root, micro] = [h for h in self.holders.get(root, ())
                                                   if split_micro(h)[1] in (None, micro)]
        return out


def shard_shape(shape: tuple, ranks: int) -> tuple:
    """The shape of one data-parallel rank's shard of a parameter of `shape`'s optimizer state:
    ceil(rows / ranks) of its rows (a scalar: one element)."""
    return (-(-shape[0] // ranks), *shape[1:]) if shape else (1,)


def check_runnable(plan: Plan, rank: int | None, comm=None) -> int:
    """The GPU a process runs of `plan` (`rank`; None: a one-GPU plan's, 0), or one clear refusal
    before anything is traced: a simulated baseline, or a multi-GPU plan without a rank."""
    pl = plan.decisions.pipeline
    if pl is not None and pl.kind == "data-parallel":
        raise TensorstowError("a zero3-dp plan is a simulated baseline (the Mobius comparison), not "
                              "executable: execute a mobius, gpipe or single-GPU plan")
    if comm is None and plan.decisions.dp > 1:
        raise TensorstowError(f"this plan trains data-parallel on {plan.decisions.dp} ranks, which exchange gradients "
                              f"and parameters: execute it with one process each (`tensorstow execute PLAN --nproc "
                              f"{plan.decisions.dp}`, or torchrun)")
    if rank is None:
        if sorted({gpu_index(g) for g in block_gpus(plan).values()}) != [0]:
            n = len(plan.hardware.spec.gpus)
            raise TensorstowError(f"this plan runs on {n} GPUs: execute it with one process per GPU "
                                  f"(`tensorstow execute PLAN --nproc {n}`)")
        rank = 0
    return rank


def trace_for(plan: Plan, model: nn.Module, spec=None) -> Traced:
    """`model` traced as the planner traced it for `plan` (ir.trace: the plan's batch, seq and
    precision; a replicated plan's block templates): the joint graph the segments are made from.
    `spec`: the reference `model` was built from, which keeps its trace for the process (`ir.kept`)."""
    from tensorstow.ir.kept import traced_once
    m = plan.model
    inputs = ("execute", m.name, m.batch, m.seq, m.precision, plan.replicated, plan.options.packing)
    return traced_once(spec, inputs, lambda: trace_model(model, batch=m.batch, seq=m.seq, precision=m.precision,
                                                         model_name=m.name, template=plan.replicated,
                                                         packing=plan.options.packing))


def compile_program(plan, model, *, rank: int | None = None, comm=None, traced: Traced | None = None,
                    init_values=None, seed: int = 0, built_from=None) -> tuple[Program, nn.Module, object]:
    """(program, the model as it runs, its initial values): `model` a module, or a model as plans
    name it (a preset, `hf:DIR`, `pkg.module:factory`: built as `tensorstow execute` builds it,
    with `seed`'s weights or the checkpoint's, streamed); traced for `plan` unless `traced` is
    given; compiled into `plan`'s runtime tables for GPU `rank`."""
    plan = as_plan(plan)
    check_runnable(plan, rank, comm)
    spec = built_from  # the ModelSpec a module was built from (`ExecutorConfig.built_from`)
    if isinstance(model, str):
        if init_values is not None:
            raise TensorstowError("init_values is for a model object; a model named by a string brings its own")
        o = plan.options  # the plan's LoRA adapters go on the model it names
        same = model == o.model
        spec = resolve_model(model, *((o.lora, o.quantize, o.quantize_skip) if same else ()))
        model, init_values = build_for_execution(spec, seed)
    model = wrap(model)
    program = Program(plan, traced if traced is not None else trace_for(plan, model, spec), model, rank=rank,
                      comm=comm)
    return program, model, init_values


def _check_model_graph(m, traced: Traced) -> None:
    """The traced model is the one the plan was made for: same graph, same fingerprint. (A
    replicated plan's trace is its block template, so the fingerprint covers the traced layers;
    `trace_model` has checked that the other layers share the middle one's structure.)"""
    depth = len(traced.graph.layer_blocks())
    if depth != m.layers:
        raise TensorstowError(f"the model has {depth} layers but the plan for {m.name} describes "
                              f"{m.layers}; pass the model the plan was made for, or re-plan it")
    fp = traced.graph.fingerprint()
    if fp != m.fingerprint:
        raise TensorstowError(
            f"plan fingerprint mismatch: the plan was made for model graph {m.fingerprint} but "
            f"{m.name} (batch {m.batch}, seq {m.seq}, {m.precision}) traces to {fp} here (the model "
            f"code, its configuration or the torch version changed); re-plan it with "
            f"`tensorstow plan {m.name} ...`")


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, then buffers, by qualified name: the state inputs of the traced graph, in
    its placeholder order."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def ignored_labels(traced: Traced) -> frozenset[int]:
    """The `ignore_index` of every negative-log-likelihood loss in the traced step (what
    `F.cross_entropy(..., ignore_index=...)` becomes), else F.cross_entropy's default, -100 (a
    loss written without nll_loss, as the fused head, leaves out -100: `ir.models.IGNORE_INDEX`)."""
    losses = (torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss2d_forward.default)
    found = {int(n.args[4]) for n in traced.gm.graph.nodes if n.op == "call_function" and n.target in losses}
    return frozenset(found or {IGNORE_INDEX})


def _draws_random(seg) -> bool:
    return any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in seg.nodes)


def draws_random_node(n) -> bool:
    """Whether a traced op draws random numbers: a seeded op, unless its dropout probability is 0
    (attention kernels carry the tag whatever their dropout_p; native_dropout with p = 0)."""
    if torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
        return False
    schema = getattr(n.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    for arg in ("dropout_p", "p"):
        if arg in names:
            k = names.index(arg)
            p = n.kwargs.get(arg, n.args[k] if k < len(n.args) else schema.arguments[k].default_value)
            return bool(p)
    return True

