"""What planning found: `PlanResult` (the problem, the decisions, their schedule and its
simulation), its side programs (evaluation, a speculating plan's redo), its typed plan file
(`to_plan`), and the modeled duration of each instruction (`durations`).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from tensorstow.planner import cost
from tensorstow.planner.lower import lower_eval, lower_redo
from tensorstow.planner.pools import process_pools
from tensorstow.planner.problem import Problem
from tensorstow.planner.simulate import SimResult, compute_slowdown, contention, simulate
from tensorstow.schema.plan import (SCHEMA_VERSION, BlockInfo, HardwareInfo, ModelInfo, Plan, PoolSizes, Predicted,
                                    ProfileInfo)
from tensorstow.schema.schedule import (TIERS, Buffer, Decisions, Instr, InstrKind, final_residency, gpu_index,
                                        gpus_of_blocks, initial_residency, is_gpu, split_segment)


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
    """Where copies wait for room (`wait_for_room`): the tiers its replay without the waits went
    over, (peak, capacity) as `over_capacity`; empty where nothing waits."""

    @property
    def samples(self) -> int:
        """Microbatches of `model.batch` one step trains on (over every data-parallel rank)."""
        return self.decisions.microbatches() * self.decisions.dp

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
            return max([v for k, v in self.sim.peak_bytes.items() if is_gpu(k)] or [0])
        return self.sim.peak_bytes.get(tier, 0)

    def breakdown(self, tier: str) -> dict[str, int]:
        """Bytes by kind live on `tier` at its peak (the GPU: the fullest one)."""
        if tier == "gpu":
            tier = max(sorted(k for k in self.sim.peak_bytes if is_gpu(k)) or ["gpu0"],
                       key=lambda k: self.sim.peak_bytes[k] if k in self.sim.peak_bytes else 0)
        snap = self.sim.peak_live.get(tier, [])
        out: dict[str, int] = {}
        for b in snap:
            buf = self.buffers[b]
            out[buf.kind] = out.get(buf.kind, 0) + buf.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @functools.cached_property
    def pools(self) -> dict[str, PoolSizes]:
        """Each GPU process's DRAM and device arenas (`planner.pools`), from the schedule, its replay
        and the side programs (`make_plan` checks the DRAM ones against the budget, `to_plan`
        writes them)."""
        order = self.problem.order
        return process_pools(self.instructions, self.sim.start, self.buffers, self.decisions, order,
                             gpus_of_blocks(self.decisions, order), (self.eval_program[0], self.redo_program[0]))

    @functools.cached_property
    def redo_program(self) -> tuple[list[Instr], float]:
        """A speculating plan's redo program (`Plan.redo_instructions`) and its simulated time."""
        return side_program(self, lower_redo, redo=True) if self.decisions.speculated else ([], 0.0)

    @functools.cached_property
    def eval_program(self) -> tuple[list[Instr], float]:
        """The forward-only program of one evaluation batch (`Plan.eval_instructions`, one GPU:
        none for a pipeline) with its memory fences, and its simulated time."""
        return side_program(self, lower_eval) if self.decisions.pipeline is None else ([], 0.0)

    def to_plan(self) -> Plan:
        p, g = self.problem, self.problem.graph
        tokens = g.batch * g.seq * self.samples
        flops = 0
        for b in p.order:
            prof = p.profiles[p.profile_of[b]]
            flops += prof.fwd_flops + prof.bwd_flops
        flops *= self.samples
        sim = self.sim
        eval_instrs, eval_s = self.eval_program
        redo_instrs, redo_s = self.redo_program
        return Plan(
            schema_version=SCHEMA_VERSION,
            model=ModelInfo(
                name=g.model, fingerprint=g.fingerprint(), params=g.param_count(),
                active_params=_moe_active(g), frozen_params=p.frozen_params or None,
                layers=len(g.layer_blocks()), traced_layers=g.traced_layers,
                batch=g.batch, seq=g.seq, precision=g.precision,
                blocks=tuple(BlockInfo(name=b.name, profile=b.profile, params=b.param_count) for b in g.blocks),
                profiles={k: _profile_info(v) for k, v in sorted(p.profiles.items())}),
            hardware=HardwareInfo(name=(p.machine or p.hw).name, fingerprint=(p.machine or p.hw).fingerprint(),
                                  spec=p.machine or p.hw),
            options=p.options,
            decisions=self.decisions,
            buffers=dict(sorted(self.buffers.items())),
            instructions=tuple(dataclasses.replace(i, est_s=_r(self.durations[i.id]), contended_s=_r(i.contended_s))
                               for i in self.instructions),
            pools=self.pools,
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
    """The modeled duration of each instruction. It follows from the instruction's kind, segment and
    tiers and its buffer's size, member count, home and kind alone, so each distinct one is worked
    out once (a step repeats them: each layer's copies, each microbatch)."""
    pl = decisions.pipeline
    zero3 = len(pl.gpus) if pl is not None and pl.kind == "data-parallel" else 0  # DeepSpeed ZeRO-3 on N GPUs
    # DeepSpeed's gradient to the host on one GPU: the same blocking copy_, whether the optimizer's
    # sub-group is in DRAM or swapped to NVMe (stage3.py `partition_grads`: the fp16 partition to a
    # host buffer, `.float()` there, then `swap_out_gradients` for NVMe)
    flushes = zero3 or (1 if decisions.blocking_copies else 0)
    # what the converting copy reads: the gradient's 16-bit bytes, where G is sized fp32 for SSD
    half = 2 if problem.mixed and decisions.swap_grads else 1
    out, known = [], {}
    for ins in instrs:
        if ins.kind == InstrKind.FREE:
            out.append(0.0)
            continue
        buf = buffers.get(ins.tensor)
        key = (ins.kind, ins.segment, ins.src, ins.dst, ins.tensor if buf is None else
               (buf.bytes, len(buf.members), bool(buf.home), buf.kind if flushes else ""))
        t = known.get(key)
        if t is None:
            t = known[key] = _duration(problem, ins, instrs, buffers, zero3, flushes, half)
        out.append(t)
    return out


def _duration(problem: Problem, ins: Instr, instrs: list[Instr], buffers: dict[str, Buffer], zero3: int,
              flushes: int, half: int) -> float:
    """One instruction's modeled duration (`durations`)."""
    hw = problem.hw
    if ins.kind in (InstrKind.COMPUTE, InstrKind.RECOMPUTE):
        phase, b = split_segment(ins.segment)
        prof = problem.profiles[problem.profile_of[b]]
        return {"fwd": prof.fwd_time_s, "bwd": prof.bwd_time_s, "refwd": prof.refwd_time_s,
                "bwd1": prof.bwd1_time_s, "bwd2": prof.bwd2_time_s}[phase]
    if flushes and ins.kind == InstrKind.STORE and buffers[ins.tensor].kind == "gradient" and is_gpu(ins.src):
        buf = buffers[ins.tensor]
        return cost.zero3_grad_flush_time(buf.bytes // half, gpu_index(ins.src), flushes, problem.mixed, hw,
                                          tensors=max(1, len(buf.members)))
    if ins.kind in (InstrKind.LOAD, InstrKind.STORE, InstrKind.SEND):
        buf = buffers[ins.tensor]
        return cost.transfer_time(buf.bytes, ins.src, ins.dst, hw, tensors=max(1, len(buf.members)),
                                  durable=bool(buf.home))
    if ins.kind == InstrKind.COMMIT:
        return cost.commit_time(hw, instrs)
    if ins.kind in (InstrKind.REDUCE, InstrKind.GATHER):
        buf = buffers[ins.tensor]
        collective = cost.all_reduce_time if ins.kind == InstrKind.REDUCE else cost.all_gather_time
        return collective(buf.bytes, ins.dst, problem, tensors=max(1, len(buf.members)))
    if ins.kind == InstrKind.OPTIMIZER_STEP:
        prof = problem.profiles[problem.profile_of[ins.segment]] if zero3 else None
        return (cost.segment_update_time(problem, ins.segment, ins.dst)
                + (cost.zero3_param_writeback_time(prof.param_bytes, zero3, problem.mixed, hw) if zero3 else 0.0))
    return 0.0


def side_program(plan: PlanResult, lowering, redo: bool = False) -> tuple[list[Instr], float]:
    """A program the plan runs besides its step (evaluation, a speculating plan's redo), lowered
    from its decisions, with memory fences from its own replay, and that replay's time. The redo
    program starts where the step ends: the homes, and the gradients the speculated updates kept."""
    problem, d = plan.problem, plan.decisions
    instrs = lowering(problem.order, problem.profiles, problem.profile_of, d, plan.buffers, mixed=problem.mixed)
    dur = durations(problem, instrs, plan.buffers, d)
    initial = initial_residency(plan.buffers, d, problem.order)
    final = set(initial)
    if redo:
        initial = final_residency(plan.buffers, d, problem.order)
    sizes = {n: b.bytes for n, b in plan.buffers.items()}
    links = contention(instrs, problem.hw)
    sim = simulate(instrs, dur, sizes, initial, links=links, reserved=d.reserved(),
                   slowdown=compute_slowdown(problem.hw), final=final)
    # memory fences, as the step's (`lower_and_simulate`): overlap mode never holds more than the replay
    instrs = [dataclasses.replace(i, deps=tuple(sorted(set(i.deps) | set(sim.fences.get(i.id, ())))),
                                  est_s=_r(t), contended_s=_r(max(0.0, ran - t)))
              for i, t, ran in zip(instrs, dur, sim.durations)]
    return instrs, sim.step_time_s


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


def _moe_active(g) -> int | None:
    """A mixture of experts' active parameters (`Graph.active_param_count`); None for a dense model."""
    active = g.active_param_count()
    return active if active != g.param_count() else None
