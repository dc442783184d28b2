"""What every policy plans against: the `Problem` (traced model, hardware, options), and the one
yardstick every policy's decisions are measured with: `schedule` lowers them, simulates the
schedule and returns a `PlanResult`, whose `to_plan()` is the typed plan file.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tensorstow.errors import TensorstowError
from tensorstow.ir.graph import Graph
from tensorstow.ir.models import DEFAULT_BATCH, ModelSpec, resolve_model
from tensorstow.ir.trace import PRECISIONS, model_dims, trace_model, trace_spec
from tensorstow.planner import cost
from tensorstow.planner.pipeline import lower_pipeline, pipeline_buffers
from tensorstow.planner.pools import host_pools
from tensorstow.planner.schedule import buffers_for, lower, lower_eval, lower_redo
from tensorstow.planner.simulate import SimResult, compute_slowdown, contention, simulate
from tensorstow.schema.hardware import Hardware
from tensorstow.schema.options import LR_SCHEDULERS, Options, check_values, parse_param_group
from tensorstow.schema.plan import (SCHEMA_VERSION, BlockInfo, HardwareInfo, ModelInfo, Plan, PoolSizes, Predicted,
                                    ProfileInfo)
from tensorstow.schema.schedule import (TIERS, Buffer, Decisions, Instr, carried_buffers, final_residency, gpu_index,
                                        gpus_of_blocks, initial_residency)


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

    @property
    def mixed(self) -> bool:
        return self.options.precision != "fp32"

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
    if model is not None and options.lora:
        raise TensorstowError("lora: a model object brings its own adapters (get_peft_model); leave lora out")
    return resolve_model(options.model, options.lora) if model is None else None


def build_problem(options: Options, hw: Hardware, model=None) -> Problem:
    """`model`: an nn.Module to trace instead of building `options.model` (the Python API)."""
    spec = check_options(options, model)
    batch = options.batch or DEFAULT_BATCH.get(options.model, 1)
    if model is not None:
        traced = trace_model(model, batch=batch, seq=options.seq or model_dims(model)[1] or 1,
                             precision=options.precision, model_name=options.model)
    else:
        traced = trace_spec(spec, batch=batch, seq=options.seq or None,
                            precision=options.precision)
    g = traced.graph
    return Problem(graph=g, hw=hw, options=options, profiles=cost.profiles(g, hw),
                   order=[b.name for b in g.blocks], profile_of={b.name: b.profile for b in g.blocks})


@dataclass
class PlanResult:
    """What planning found: the problem, the decisions, their schedule and its simulation.
    `to_plan()` is the plan file's typed content; `dumps()` its text."""
    problem: Problem
    decisions: Decisions
    buffers: dict[str, Buffer]
    instructions: list[Instr]
    sim: SimResult
    durations: list[float]
    over_unless_waiting: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Where copies wait for room (`_wait_for_room`): the tiers its replay without the waits went
    over, (peak, capacity) as `over_capacity`; empty where nothing waits."""

    @property
    def samples(self) -> int:
        """Microbatches of `model.batch` one step trains on."""
        return self.decisions.microbatches()

    @property
    def time_per_sample(self) -> float:
        return self.sim.step_time_s / self.samples

    @property
    def fits(self) -> bool:
        return not self.over_capacity()

    def over_capacity(self) -> dict[str, tuple[int, int]]:
        cap = self.problem.capacity()
        over = {t: (self.peak(t), cap[t]) for t in TIERS[1:] if self.peak(t) > cap[t]}
        gpus = self.problem.gpu_capacity()
        worst = max(gpus, key=lambda g: (self.sim.peak_bytes.get(g, 0) - gpus[g], g))
        if self.sim.peak_bytes.get(worst, 0) > gpus[worst]:
            over = {"gpu": (self.sim.peak_bytes[worst], gpus[worst]), **over}
        return over

    def peak(self, tier: str) -> int:
        if tier == "gpu":
            return max([v for k, v in self.sim.peak_bytes.items() if k.startswith("gpu")] or [0])
        return self.sim.peak_bytes.get(tier, 0)

    def breakdown(self, tier: str) -> dict[str, int]:
        """Bytes by kind live on `tier` at its peak (the GPU: the fullest one)."""
        if tier == "gpu":
            tier = max(sorted(k for k in self.sim.peak_bytes if k.startswith("gpu")) or ["gpu0"],
                       key=lambda k: self.sim.peak_bytes[k] if k in self.sim.peak_bytes else 0)
        snap = self.sim.peak_live.get(tier, [])
        out: dict[str, int] = {}
        for b in snap:
            buf = self.buffers[b]
            out[buf.kind] = out.get(buf.kind, 0) + buf.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def pools(self) -> dict[str, PoolSizes]:
        """Each GPU process's DRAM arena (`planner.pools`), from the schedule and its replay; made
        once (`make_plan` checks them against the budget, `to_plan` writes them)."""
        if "_pools" not in self.__dict__:
            order = self.problem.order
            self.__dict__["_pools"] = host_pools(self.instructions, self.sim.start, self.buffers, self.decisions,
                                                 order, gpus_of_blocks(self.decisions, order))
        return self.__dict__["_pools"]

    def redo_program(self) -> tuple[list[Instr], float]:
        """A speculating plan's redo program (`Plan.redo_instructions`) and its simulated time;
        made once."""
        if "_redo" not in self.__dict__:
            self.__dict__["_redo"] = _side_program(self, lower_redo, redo=True) if self.decisions.speculated else ([], 0.0)
        return self.__dict__["_redo"]

    def eval_program(self) -> tuple[list[Instr], float]:
        """The forward-only program of one evaluation batch (`Plan.eval_instructions`, one GPU:
        none for a pipeline) with its memory fences, and its simulated time; made once."""
        if "_eval" not in self.__dict__:
            self.__dict__["_eval"] = _side_program(self, lower_eval) if self.decisions.pipeline is None else ([], 0.0)
        return self.__dict__["_eval"]

    def to_plan(self) -> PlanResult:
        p, g = self.problem, self.problem.graph
        tokens = g.batch * g.seq * self.samples
        flops = 0
        for b in p.order:
            prof = p.profiles[p.profile_of[b]]
            flops += prof.fwd_flops + prof.bwd_flops
        flops *= self.samples
        sim = self.sim
        eval_instrs, eval_s = self.eval_program()
        redo_instrs, redo_s = self.redo_program()
        return Plan(
            schema_version=SCHEMA_VERSION,
            model=ModelInfo(
                name=g.model, fingerprint=g.fingerprint(), params=g.param_count(),
                layers=len(g.layer_blocks()), traced_layers=g.traced_layers,
                batch=g.batch, seq=g.seq, precision=g.precision,
                blocks=tuple(BlockInfo(name=b.name, profile=b.profile, params=b.param_count) for b in g.blocks),
                profiles={k: _profile_info(v) for k, v in sorted(p.profiles.items())}),
            hardware=HardwareInfo(name=p.hw.name, fingerprint=p.hw.fingerprint(), spec=p.hw),
            options=p.options,
            decisions=self.decisions,
            buffers=dict(sorted(self.buffers.items())),
            instructions=tuple(dataclasses.replace(i, est_s=_r(self.durations[i.id]), contended_s=_r(i.contended_s))
                               for i in self.instructions),
            pools=self.pools(),
            eval_instructions=tuple(eval_instrs),
            redo_instructions=tuple(redo_instrs),
            predicted=Predicted(
                eval_step_s=_r(eval_s),
                redo_s=_r(redo_s),
                step_time_s=_r(sim.step_time_s),
                tokens_per_s=_r(tokens / sim.step_time_s) if sim.step_time_s else 0.0,
                model_tflops=_r(flops / sim.step_time_s / 1e12) if sim.step_time_s else 0.0,
                peak_bytes={t: self.peak(t) for t in TIERS},
                capacity_bytes=p.capacity(),
                bottleneck=sim.bottleneck,
                busy_s={k: _r(v) for k, v in sorted(sim.busy_s.items())},
                traffic_bytes=dict(sorted(sim.traffic_bytes.items()))))

    def to_json(self) -> dict:
        return self.to_plan().to_json()

    def dumps(self) -> str:
        return self.to_plan().dumps()


def _r(x: float) -> float:
    return float(f"{x:.6g}")


def _profile_info(p: cost.BlockProfile) -> ProfileInfo:
    """The profile as the plan records it: its costs, not its member lists (buffers carry those)."""
    kept = {f.name for f in dataclasses.fields(ProfileInfo)}
    d = {k: v for k, v in vars(p).items() if k in kept}
    d["fwd_time_s"], d["bwd_time_s"] = _r(p.fwd_time_s), _r(p.bwd_time_s)
    return ProfileInfo(**d)


def durations(problem: Problem, instrs: list[Instr], buffers: dict[str, Buffer], decisions: Decisions) -> list[float]:
    hw, out = problem.hw, []
    pl = decisions.pipeline
    zero3 = len(pl.gpus) if pl is not None and pl.kind == "data-parallel" else 0  # DeepSpeed ZeRO-3 on N GPUs
    # DeepSpeed's gradient to the host on one GPU: the same blocking copy_, whether the optimizer's
    # sub-group is in DRAM or swapped to NVMe (stage3.py `partition_grads`: the fp16 partition to a
    # host buffer, `.float()` there, then `swap_out_gradients` for NVMe)
    flushes = zero3 or (1 if decisions.blocking_copies else 0)
    # what the converting copy reads: the gradient's 16-bit bytes, where G is sized fp32 for SSD
    half = 2 if problem.mixed and decisions.swap_grads else 1
    for ins in instrs:
        if ins.kind in ("compute", "recompute"):
            phase, b = ins.segment.split(":", 1)
            prof = problem.profiles[problem.profile_of[b]]
            out.append({"fwd": prof.fwd_time_s, "bwd": prof.bwd_time_s, "refwd": prof.refwd_time_s,
                        "bwd1": prof.bwd1_time_s, "bwd2": prof.bwd2_time_s}[phase])
        elif flushes and ins.kind == "store" and buffers[ins.tensor].kind == "gradient" and ins.src.startswith("gpu"):
            buf = buffers[ins.tensor]
            out.append(cost.zero3_grad_flush_time(buf.bytes // half, gpu_index(ins.src), flushes, problem.mixed, hw,
                                                  tensors=max(1, len(buf.members))))
        elif ins.kind in ("load", "store", "send"):
            buf = buffers[ins.tensor]
            out.append(cost.transfer_time(buf.bytes, ins.src, ins.dst, hw, tensors=max(1, len(buf.members)),
                                          durable=bool(buf.home)))
        elif ins.kind == "commit":
            out.append(cost.commit_time(hw, instrs))
        elif ins.kind == "optimizer_step":
            prof = problem.profiles[problem.profile_of[ins.segment]]
            out.append(cost.update_time(prof, ins.dst, problem)
                       + (cost.zero3_param_writeback_time(prof.param_bytes, zero3, problem.mixed, hw) if zero3 else 0.0))
        else:
            out.append(0.0)
    return out


def schedule(problem: Problem, decisions: Decisions, wait: bool = False) -> PlanResult:
    """Lower decisions and simulate them: the one yardstick every policy is measured with.
    `wait` (a policy's final plan, `policy_plan`): a plan over capacity is replayed again with copies
    that wait for room (`_wait_for_room`) and kept where that fits. Policies search without it: a
    candidate that fits only by waiting ranks as one that does not, as before, so waiting rescues a
    plan whose probed timings let a prefetch take the memory of what runs before it, and changes
    no plan that fits without it.
    A plan that reads from SSD runs the reads a computation waits for ahead of queued writes
    (`Decisions.ssd_reads_first`) where that still fits, else keeps every read in program order.
    An fp32 plan whose CPU updates read parameters from SSD is replayed both ways and keeps the
    backward's DRAM copy of them for the update (`Decisions.keep_params_for_update`) where
    that still fits and is not slower; the DeepSpeed baseline reads them again, as DeepSpeed does.
    With gradient accumulation (`Options.grad_accum`) the accumulated gradients wait between
    microbatches on the GPU, else in DRAM, else on SSD: the first of those that fits (each moves
    more than the one before it), unless the decisions already place them."""
    candidates = accumulating(problem, decisions)
    if len(candidates) > 1:
        for d in candidates:
            r = schedule(problem, d, wait)
            if r.fits:
                return r
        return r
    decisions = candidates[0]
    spec = speculating(problem, decisions)
    if spec is not None:  # deferred write-backs are decided for the speculating form (`_speculate_or_wait`)
        return _speculate_or_wait(problem, spec, dataclasses.replace(decisions, speculated=(), deferred_writes=()), wait)
    return _schedule_decided(problem, dataclasses.replace(decisions, speculated=()), wait)


def _schedule_decided(problem: Problem, decisions: Decisions, wait: bool) -> PlanResult:
    """`schedule` once the accumulation tiers and the speculation are decided."""
    reads_ssd = any("ssd" in (d.params, d.states, d.checkpoint) or d.activations == "swap_ssd"
                    for d in decisions.blocks.values())
    if reads_ssd and decisions.pipeline is None and not decisions.ssd_reads_first:
        first = _schedule_keep(problem, dataclasses.replace(decisions, ssd_reads_first=True))
        if first.fits:
            return first
    r = _schedule_keep(problem, decisions)
    if wait and not r.fits:
        waited = _schedule(problem, r.decisions, wait=True)
        if waited.fits:
            return waited
    return r


def accumulating(problem: Problem, decisions: Decisions) -> list[Decisions]:
    """The decisions with `Options.grad_accum`: as they are where they place every accumulated
    gradient already (or there is no accumulation), else one candidate per tier the accumulated
    gradients may wait on (`BlockDecision.accum`), fastest first."""
    k = problem.options.grad_accum
    if k <= 1 or decisions.pipeline is not None:
        return [decisions]
    if decisions.grad_accum == k and all(d.accum for d in decisions.blocks.values()):
        return [decisions]
    return [dataclasses.replace(decisions, grad_accum=k,
                                blocks={b: dataclasses.replace(d, accum=t) for b, d in decisions.blocks.items()})
            for t in TIERS]


def speculating(problem: Problem, decisions: Decisions) -> Decisions | None:
    """With clipping or fp16 loss scaling (whose updates would wait for every gradient), the
    decisions that update speculatively every block whose update can be redone exactly
    (`Decisions.speculated`: CPU updates of state whose home is SSD, so the last commit still holds
    it: fp32's P, OS, mixed precision's M, OS); None where none can, or the plan cannot speculate
    (pipelines, updates after the backward by design)."""
    o = problem.options
    if not waits_for_every_gradient(o) or decisions.pipeline is not None or not decisions.overlap_optimizer:
        return None
    decisions = dataclasses.replace(decisions, deferred_writes=())
    bufs = buffers_for(problem.order, problem.profiles, problem.profile_of, decisions, problem.mixed)
    state = ("M", "OS") if problem.mixed else ("P", "OS")
    blocks = tuple(b for b in problem.order if f"G:{b}" in bufs and decisions.blocks[b].optimizer == "cpu"
                   and all(bufs[f"{k}:{b}"].home == "ssd" for k in state))
    return dataclasses.replace(decisions, speculated=blocks) if blocks else None


def _speculate_or_wait(problem: Problem, spec: Decisions, waiting: Decisions, wait: bool) -> PlanResult:
    """The faster of the two clipping forms, by simulated time: every update waiting for the
    norm, or the speculated ones overlapped with the backward at the price of the redo program
    in the expected fraction of steps whose clip fires (`Options.clip_rate`). For a policy's final
    plan (`wait`) the speculating one is compared with its write-backs deferred where faster."""
    a = _schedule_decided(problem, waiting, wait)
    b = _schedule_decided(problem, spec, wait)
    if not b.fits:
        return a
    if wait:  # a policy's final plan: speculating, it may also defer its last write-backs (`defer_writes`)
        b = defer_writes(b)
    redo = b.redo_program()[1]
    expected = b.sim.step_time_s + problem.options.clip_rate * redo
    if a.fits and a.sim.step_time_s <= expected:
        return a
    note = (f"clipping: {len(spec.speculated)} CPU updates speculate (overlapped with the backward, redone from "
            f"the last commit when the clip fires or fp16 gradients overflow): step {b.sim.step_time_s:.4g} s + clip rate "
            f"{problem.options.clip_rate:g} x redo {redo:.4g} s = {expected:.4g} s expected, against "
            f"{a.sim.step_time_s:.4g} s with every update waiting for the norm" + ("" if a.fits else " (does not fit)"))
    return dataclasses.replace(b, decisions=dataclasses.replace(b.decisions, notes=(*b.decisions.notes, note)))


DEFERRED_MAX = 4
"""Blocks `defer_writes` tries to carry across the step boundary, at most."""


def defer_writes(plan: PlanResult) -> PlanResult:
    """The plan with the write-backs of the blocks updated last run at the start of the next step
    (`Decisions.deferred_writes`): one block, then two, ... while each is faster and still fits.
    Their updates end the step after its last backward, and their parameters begin the next one,
    so the step's tail of SSD writes overlaps the next forward and its first read is gone. One-GPU
    plans whose updates overlap the backward (with clipping or fp16 loss scaling, speculated ones:
    a redo restores a carried block from the commit the step made of the one before); not the
    zero-infinity baseline (DeepSpeed writes every subgroup back before the step ends)."""
    d, problem = plan.decisions, plan.problem
    if (d.pipeline is not None or not d.overlap_optimizer or d.policy == "zero-infinity"
            or (waits_for_every_gradient(problem.options) and not d.speculated)
            or d.deferred_writes or not plan.fits):
        return plan
    updated = [i.segment for i in plan.instructions if i.kind == "optimizer_step"]
    blocks = [b for b in reversed(updated)
              if carried_buffers(dataclasses.replace(d, deferred_writes=(b,)), plan.buffers)]
    best = plan
    for k in range(1, min(DEFERRED_MAX, len(blocks)) + 1):
        r = _schedule(problem, dataclasses.replace(d, deferred_writes=tuple(blocks[:k])))
        if not r.fits or r.sim.step_time_s >= best.sim.step_time_s:
            break
        best = r
    return best


def _schedule_keep(problem: Problem, decisions: Decisions) -> PlanResult:
    plain = _schedule(problem, decisions)
    eligible = (not problem.mixed and decisions.pipeline is None and decisions.policy != "zero-infinity"
                and not decisions.keep_params_for_update
                and any(d.params == "ssd" and d.optimizer == "cpu" for d in decisions.blocks.values()))
    if not eligible:
        return plain
    kept = _schedule(problem, dataclasses.replace(decisions, keep_params_for_update=True))
    if kept.fits and (not plain.fits or kept.sim.step_time_s <= plain.sim.step_time_s):
        return kept
    return plain


def _schedule(problem: Problem, decisions: Decisions, wait: bool = False) -> PlanResult:
    micro = decisions.microbatches()
    inputs = sum(t.nbytes for t in problem.graph.tensors if t.kind == "input")
    decisions = dataclasses.replace(decisions, device_reserved=micro * inputs)
    if decisions.pipeline is None:
        bufs = buffers_for(problem.order, problem.profiles, problem.profile_of, decisions, problem.mixed)
        instrs = lower(problem.order, problem.profiles, problem.profile_of, decisions, bufs,
                       loss_scaling=waits_for_every_gradient(problem.options))
    else:
        bufs = pipeline_buffers(problem.order, problem.profiles, problem.profile_of, decisions, problem.mixed)
        instrs = lower_pipeline(problem.order, problem.profiles, problem.profile_of, decisions, bufs,
                                problem.gpu_capacity())
    dur = durations(problem, instrs, bufs, decisions)
    initial = initial_residency(bufs, decisions, problem.order)
    sizes = {n: b.bytes for n, b in bufs.items()}
    reserved = decisions.reserved()
    commit = cost.commit_time(problem.hw, instrs)
    final = final_residency(bufs, decisions, problem.order)
    sim = simulate(instrs, dur, sizes, initial, links=contention(instrs, problem.hw), reserved=reserved,
                   commit_s=commit, slowdown=compute_slowdown(problem.hw), final=final)
    over = {}
    caps = {**problem.gpu_capacity(), "dram": problem.capacity()["dram"]}
    if wait and any(sim.peak_bytes.get(t, 0) > c for t, c in caps.items()):
        fitted = _wait_for_room(problem, instrs, dur, sizes, initial, reserved, commit, caps, final)
        if fitted is not None:
            over = {"gpu" if t.startswith("gpu") else t: (sim.peak_bytes[t], c) for t, c in caps.items()
                    if sim.peak_bytes.get(t, 0) > c}
            instrs, sim = fitted
            decisions = dataclasses.replace(decisions, notes=(*decisions.notes, "copies wait for room on " + ", ".join(
                f"{t} (without the waits {fmt_bytes(n)} at peak > {fmt_bytes(c)})" for t, (n, c) in sorted(over.items()))))
    # Memory fences: an allocation waits for the releases that preceded it in the replay, so an
    # executor whose real timing differs (overlap mode) never holds more than the simulated peak.
    # They change no start or end of this replay, which stands for the fenced schedule
    # (`check_fences` replays a policy's final plan to make sure).
    instrs = [_with(i, deps=tuple(sorted(set(i.deps) | set(sim.fences.get(i.id, ())))), contended_s=max(0.0, ran - d))
              for i, ran, d in zip(instrs, sim.durations, dur)]
    return PlanResult(problem, decisions, bufs, instrs, sim, dur, over_unless_waiting=over)


def _with(ins: Instr, **fields) -> Instr:
    """`ins` with `fields` replaced; `ins` itself where they hold those values already (most
    instructions of a search's candidates: no fence, no contention)."""
    if all(getattr(ins, k) == v for k, v in fields.items()):
        return ins
    return dataclasses.replace(ins, **fields)


def check_fences(plan: PlanResult) -> None:
    """The plan's memory fences change nothing of its replay: its instructions, the fences among
    their dependencies, replayed with the durations they ran for (host contention's stretch
    included) start and end as the replay they were taken from."""
    problem, d, instrs = plan.problem, plan.decisions, plan.instructions
    sizes = {n: b.bytes for n, b in plan.buffers.items()}
    fenced = simulate(instrs, plan.sim.durations, sizes, initial_residency(plan.buffers, d, problem.order),
                      links=contention(instrs, problem.hw), reserved=d.reserved(),
                      commit_s=cost.commit_time(problem.hw, instrs), final=final_residency(plan.buffers, d, problem.order))
    if (fenced.start, fenced.end) != (plan.sim.start, plan.sim.end):
        raise RuntimeError(f"internal: memory fences change the replay of the {d.policy} plan "
                           f"({fenced.step_time_s} s against {plan.sim.step_time_s} s)")


def _side_program(plan: PlanResult, lowering, redo: bool = False) -> tuple[list[Instr], float]:
    """A program the plan runs besides its step (evaluation, a speculating plan's redo), lowered
    from its decisions, with memory fences from its own replay, and that replay's time. The redo
    program starts where the step ends: the homes, and the gradients the speculated updates kept."""
    problem, d = plan.problem, plan.decisions
    instrs = lowering(problem.order, problem.profiles, problem.profile_of, d, plan.buffers)
    dur = durations(problem, instrs, plan.buffers, d)
    initial = initial_residency(plan.buffers, d, problem.order)
    final = set(initial)
    if redo:
        initial = final_residency(plan.buffers, d, problem.order)
    sizes = {n: b.bytes for n, b in plan.buffers.items()}
    links = contention(instrs, problem.hw)
    sim = simulate(instrs, dur, sizes, initial, links=links, reserved=d.reserved(),
                   slowdown=compute_slowdown(problem.hw), final=final)
    # memory fences, as the step's (`_schedule`): overlap mode never holds more than the replay
    instrs = [dataclasses.replace(i, deps=tuple(sorted(set(i.deps) | set(sim.fences.get(i.id, ())))),
                                  est_s=_r(t), contended_s=_r(max(0.0, ran - t)))
              for i, t, ran in zip(instrs, dur, sim.durations)]
    return instrs, sim.step_time_s


def _wait_for_room(problem, instrs, dur, sizes, initial, reserved, commit, caps, final):
    """A replay over capacity, again with copies that wait for room (Fuyou §4.4's memory-aware
    prefetch: a copy that ran ahead of the computations before it in program order took their
    memory, because the probed timings let it). The waits become dependencies: on the releases that
    made room (memory fences) and on the instructions it let go first, so the executor keeps them
    under any timing. The instructions and their replay where that fits, else None."""
    links = contention(instrs, problem.hw)
    slow = compute_slowdown(problem.hw)
    waiting = simulate(instrs, dur, sizes, initial, links=links, reserved=reserved, commit_s=commit, slowdown=slow,
                       capacity=caps, final=final)
    if any(waiting.peak_bytes.get(t, 0) > c for t, c in caps.items()):
        return None
    extra = {i: set(waiting.waited.get(i, ())) | set(waiting.fences.get(i, ())) for i in waiting.waited}
    waits = [dataclasses.replace(i, deps=tuple(sorted(set(i.deps) | extra[i.id]))) if i.id in extra else i
             for i in instrs]
    fitted = simulate(waits, dur, sizes, initial, links=links, reserved=reserved, commit_s=commit, slowdown=slow,
                      final=final)
    if any(fitted.peak_bytes.get(t, 0) > c for t, c in caps.items()):
        return None
    return waits, fitted


def fmt_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def infeasible_message(plan: PlanResult, over: dict[str, tuple[int, int]]) -> str:
    o = plan.problem.options
    parts = []
    for tier, (need, cap) in over.items():
        kinds = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.breakdown(tier).items())
        parts.append(f"{tier} needs {fmt_bytes(need)} at peak > {fmt_bytes(cap)} capacity ({kinds})")
    offload = "an offloading policy (--policy auto, lohan, ilp), " if o.policy == "all-gpu" else ""
    fp16 = ("; fp16-mixed holds every gradient until the backward ends (the loss-scaling check comes "
            "before any update): bf16-mixed overlaps the updates with the backward") if o.precision == "fp16-mixed" else ""
    hint = {"gpu": f"try {offload}a smaller --batch, or more --gpu-mem",
            "dram": "add --dram, use SSDs (--ssds N), or a smaller --batch" + fp16,
            "ssd": "add SSDs (--ssds N) or use a smaller model"}
    return (f"{o.model} does not fit on {plan.problem.hw.name} with policy {o.policy}: "
            + "; ".join(parts) + "; " + "; ".join(hint[t] for t in over))
