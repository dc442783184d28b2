"""Simulator invariants on random instruction DAGs (hypothesis)."""
import dataclasses

import networkx as nx
import pytest
from hypothesis import given, settings, strategies as st

from tensorstow.schema.schedule import Instr
from tensorstow.planner.simulate import ScheduleError, simulate
from tensorstow.schema.schedule import resource_of

STREAMS = ["gpu0.compute", "gpu0.h2d", "gpu0.d2h", "ssd.read", "ssd.write", "cpu.opt"]


@st.composite
def dags(draw):
    n = draw(st.integers(1, 40))
    instrs, dur = [], []
    allocs = {}
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        stream = draw(st.sampled_from(STREAMS))
        kind = draw(st.sampled_from(["compute", "load", "free"]))
        kw = {}
        if kind == "compute" and stream == "gpu0.compute":
            kw = {"allocs": (f"buf{i}",), "workspace": f"ws{i}"}
            allocs[f"buf{i}"] = i
        elif kind == "load":
            kind = "compute"
        elif kind == "free":
            kind = "compute"
        instrs.append(Instr(id=i, kind=kind, stream=stream, deps=tuple(sorted(deps)), **kw))
        dur.append(draw(st.floats(0, 5, allow_nan=False)))
    # free every allocated buffer after its producer
    for name, producer in sorted(allocs.items()):
        i = len(instrs)
        extra = draw(st.lists(st.integers(0, i - 1), max_size=2, unique=True))
        instrs.append(Instr(id=i, kind="free", stream="gpu0.compute",
                            deps=tuple(sorted({producer, *extra})), tensor=name, dst="gpu0"))
        dur.append(0.0)
    sizes = {f"buf{i}": draw(st.integers(1, 100)) for i in range(len(instrs))}
    sizes |= {f"ws{i}": draw(st.integers(0, 50)) for i in range(len(instrs))}
    return instrs, dur, sizes


@settings(max_examples=150, deadline=None)
@given(dags())
def test_simulator_invariants(case):
    instrs, dur, sizes = case
    sim = simulate(instrs, dur, sizes, set())
    eps = 1e-9
    for ins in instrs:
        for d in ins.deps:  # dependencies respected
            assert sim.start[ins.id] >= sim.end[d] - eps
    by_res = {}
    for ins in instrs:
        by_res.setdefault(resource_of(ins.stream), []).append((sim.start[ins.id], sim.end[ins.id], ins.id))
    for res, spans in by_res.items():  # no resource runs two things at once
        spans.sort()
        for (s1, e1, a), (s2, e2, b) in zip(spans, spans[1:]):
            assert s2 >= e1 - eps, (res, a, b)
    for s in {i.stream for i in instrs}:  # streams are FIFO in program order
        ids = [i.id for i in instrs if i.stream == s]
        assert [sim.start[i] for i in ids] == sorted(sim.start[i] for i in ids)
    # makespan >= critical path and >= the busiest resource
    g = nx.DiGraph()
    for ins in instrs:
        g.add_node(ins.id)
        for d in ins.deps:
            g.add_edge(d, ins.id)
    longest = {}
    for v in nx.topological_sort(g):
        longest[v] = dur[v] + max((longest[u] for u in g.predecessors(v)), default=0.0)
    assert sim.step_time_s >= max(longest.values()) - eps
    assert sim.step_time_s >= max(sim.busy_s.values()) - eps
    # memory never negative, peak = brute-force maximum over event times
    for tier, pts in sim.timeline.items():
        assert all(v >= 0 for _, v in pts)
        assert sim.peak_bytes.get(tier, 0) == max(v for _, v in pts)
    for t, _ in sim.timeline.get("gpu0", []):
        live = 0
        for ins in instrs:
            if ins.allocs and sim.start[ins.id] <= t:
                free = next(f for f in instrs if f.kind == "free" and f.tensor == ins.allocs[0])
                if sim.start[free.id] > t:
                    live += sizes[ins.allocs[0]]
            if ins.workspace and sim.start[ins.id] <= t < sim.end[ins.id]:
                live += sizes[ins.workspace]
        assert live <= sim.peak_bytes["gpu0"]


def test_simplex_ssd_shares_one_resource():
    instrs = [Instr(id=0, kind="load", stream="ssd.read", deps=(), tensor="a", src="ssd", dst="dram"),
              Instr(id=1, kind="store", stream="ssd.write", deps=(), tensor="b", src="dram", dst="ssd")]
    sim = simulate(instrs, [2.0, 3.0], {"a": 1, "b": 1}, {("a", "ssd"), ("a", "dram"), ("b", "dram"), ("b", "ssd")})
    assert sim.step_time_s == 5.0  # reads and writes do not overlap (Fuyou Eq. 3-4)
    h2d_d2h = [Instr(id=0, kind="load", stream="gpu0.h2d", deps=(), tensor="a", src="dram", dst="gpu0"),
               Instr(id=1, kind="store", stream="gpu0.d2h", deps=(), tensor="b", src="gpu0", dst="dram")]
    sim = simulate(h2d_d2h, [2.0, 3.0], {"a": 1, "b": 1}, {("a", "dram"), ("a", "gpu0"), ("b", "gpu0"), ("b", "dram")})
    assert sim.step_time_s == 3.0  # the host link is duplex


def test_the_commit_runs_beside_a_one_process_step_and_after_a_several_process_one():
    """One GPU, one process: the previous step's commit runs from the step's start and only the
    SSD writes wait for it. Several GPUs: each process commits after its last instruction, then
    they wait for each other, so the commit ends the step."""
    from tensorstow.planner.simulate import sync_step_s

    def step(gpus):
        instrs = [Instr(id=k, kind="compute", stream=f"gpu{k}.compute", deps=(), est_s=1.0) for k in range(gpus)]
        n = len(instrs)
        instrs.append(Instr(id=n, kind="store", stream="ssd.write", deps=(0,), tensor="b", src="dram", dst="ssd",
                            est_s=0.5))
        instrs.append(Instr(id=n + 1, kind="load", stream="ssd.read", deps=(), tensor="a", src="ssd", dst="dram",
                            est_s=0.25))
        initial = {("a", "ssd"), ("a", "dram"), ("b", "dram"), ("b", "ssd")}
        return instrs, simulate(instrs, [i.est_s for i in instrs], {"a": 1, "b": 1}, initial, commit_s=2.0)
    instrs, one = step(1)
    assert (one.start[2], one.end[2]) == (0.0, 0.25)  # a read does not wait for the commit
    assert (one.start[1], one.end[1]) == (2.0, 2.5)  # the write does
    assert one.step_time_s == 2.5 and one.busy_s["ssd.commit"] == 2.0 and one.busy_s["ssd"] == 0.75
    assert sync_step_s(instrs, 2.0) == 1.75 + (2.0 - 1.0)  # the compute before the write covers 1 s of it
    instrs, two = step(2)
    assert two.start[2] == 1.0 and two.step_time_s == 1.5 + 2.0  # read, write, then the commit
    assert "ssd.commit" not in two.busy_s and two.busy_s["ssd"] == 0.75 + 2.0
    assert sync_step_s(instrs, 2.0) == 2.75 + 2.0


def test_a_plan_that_commits_itself_has_no_commit_at_its_start():
    """With deferred write-backs the plan's own `commit` instruction commits the previous step once
    they are home: it takes its modeled time on the SSD where the plan puts it, the writes after it
    wait for it (their dependency), and no separate commit runs from the step's start."""
    from tensorstow.planner.simulate import sync_step_s
    instrs = [Instr(id=0, kind="store", stream="ssd.write", deps=(), tensor="c", src="dram", dst="ssd", est_s=0.5),
              Instr(id=1, kind="commit", stream="ssd.commit", deps=(0,), est_s=0.25),
              Instr(id=2, kind="compute", stream="gpu0.compute", deps=(), est_s=1.0),
              Instr(id=3, kind="store", stream="ssd.write", deps=(1, 2), tensor="b", src="dram", dst="ssd",
                    est_s=0.5)]
    initial = {("b", "dram"), ("b", "ssd"), ("c", "dram"), ("c", "ssd")}
    sim = simulate(instrs, [i.est_s for i in instrs], {"b": 1, "c": 1}, initial, commit_s=2.0)
    assert (sim.start[0], sim.end[0]) == (0.0, 0.5)  # the carried write-back does not wait for a commit
    assert (sim.start[1], sim.end[1]) == (0.5, 0.75) and resource_of("ssd.commit") == "ssd"
    assert (sim.start[3], sim.end[3]) == (1.0, 1.5)
    assert sim.step_time_s == 1.5 and "ssd.commit" not in sim.busy_s and sim.busy_s["ssd"] == 1.25
    assert sync_step_s(instrs, 2.0) == 2.25  # the instructions, the commit among them


def test_inconsistent_schedules_are_rejected():
    import pytest
    free_missing = [Instr(id=0, kind="free", stream="gpu0.compute", deps=(), tensor="x", dst="gpu0")]
    with pytest.raises(ScheduleError, match="does not hold"):
        simulate(free_missing, [0.0], {"x": 1}, set())
    leak = [Instr(id=0, kind="compute", stream="gpu0.compute", deps=(), allocs=("x",))]
    with pytest.raises(ScheduleError, match="final state"):
        simulate(leak, [1.0], {"x": 1}, set())
    cycle = [Instr(id=0, kind="compute", stream="a", deps=(1,)), Instr(id=1, kind="compute", stream="b", deps=(0,))]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(cycle, [1.0, 1.0], {}, set())


def test_op_dispatch_cost_adds_to_every_op_and_stays_out_of_specs_without_it():
    """`GPU.op_s` (the executor's host cost per op, probed): every op's time grows by it; a spec
    without it (the papers' presets) writes no such key, so its fingerprint is unchanged."""
    import dataclasses

    from tensorstow.planner import cost
    from tensorstow.schema.hardware import Hardware
    from tensorstow.planner.presets import load_hardware
    hw = load_hardware("lohan-rtx4090")
    assert "op_s" not in hw.to_json()["gpus"][0]
    slow = dataclasses.replace(hw, gpus=(dataclasses.replace(hw.gpus[0], op_s=2e-5),))
    assert slow.to_json()["gpus"][0]["op_s"] == 2e-5
    assert Hardware.from_json(slow.to_json()) == slow
    for flops, nbytes in ((10 ** 12, 10), (10, 10 ** 9), (0, 0)):
        assert cost.op_time(flops, nbytes, slow) == cost.op_time(flops, nbytes, hw) + 2e-5


def test_an_ssd_read_pauses_the_write_in_progress():
    """The aio engine runs the chunks of `ssd.first` reads before queued write chunks
    (csrc/aio.cpp), so such a read that becomes ready during a long write-back runs at once and the
    write ends later by the read's time: the SSD stays simplex (busy = the sum) but reads that
    computations wait for do not queue behind writes. On `ssd.read` a read waits for the write."""
    instrs = [Instr(id=0, kind="store", stream="ssd.write", deps=(), tensor="w", src="dram", dst="ssd"),
              Instr(id=1, kind="compute", stream="gpu0.compute", deps=()),
              Instr(id=2, kind="load", stream="ssd.first", deps=(1,), tensor="r", src="ssd", dst="dram"),
              Instr(id=3, kind="load", stream="ssd.first", deps=(), tensor="r2", src="ssd", dst="dram"),
              Instr(id=4, kind="store", stream="ssd.write", deps=(), tensor="w2", src="dram", dst="ssd"),
              Instr(id=5, kind="compute", stream="gpu0.compute", deps=(2,))]
    present = {(b, t) for b in ("w", "r", "r2", "w2") for t in ("dram", "ssd")}
    sim = simulate(instrs, [1.0, 0.2, 0.1, 0.3, 0.5, 0.4], {b: 1 for b in ("w", "r", "r2", "w2")}, present)
    assert (sim.start[2], sim.end[2]) == (0.2, 0.30000000000000004)  # the read runs at once
    assert (sim.start[3], sim.end[3]) == (sim.end[2], sim.end[2] + 0.3)  # the next one after it
    assert sim.end[0] == 1.0 + 0.1 + 0.3  # the write, paused by both
    assert sim.start[4] == sim.end[0]  # the next write waits for the paused one
    assert sim.start[5] == sim.end[2]  # what waits for the read does not wait for the write
    assert abs(sim.busy_s["ssd"] - 1.9) < 1e-12 and sim.step_time_s == sim.end[4]
    in_order = [dataclasses.replace(i, stream="ssd.read") if i.stream == "ssd.first" else i for i in instrs]
    sim = simulate(in_order, [1.0, 0.2, 0.1, 0.3, 0.5, 0.4], {b: 1 for b in ("w", "r", "r2", "w2")}, present)
    assert sim.start[2] == 1.0 and sim.end[0] == 1.0  # behind the whole write


def test_a_computation_beside_host_copies_is_stretched_by_the_device_s_host_contention():
    """`slowdown` (`GPU.host_contention`, the CPU device tier): a computation runs longer by the
    factor times the share of its time that copies or SSD transfers overlapped; the optimizer does
    not count, nor does a computation with nothing beside it. Without a slowdown nothing moves."""
    instrs = [Instr(id=0, kind="compute", stream="gpu0.compute", deps=()),
              Instr(id=1, kind="load", stream="gpu0.h2d", deps=(), tensor="a", src="dram", dst="gpu0"),
              Instr(id=2, kind="compute", stream="gpu0.compute", deps=(0,)),
              Instr(id=3, kind="optimizer_step", stream="cpu.opt", deps=(0,), segment="b0", dst="cpu"),
              Instr(id=4, kind="compute", stream="gpu0.compute", deps=(2,))]
    dur = [1.0, 0.5, 1.0, 1.0, 1.0]
    present = {("a", "dram"), ("a", "gpu0")}
    plain = simulate(instrs, dur, {"a": 1}, present)
    assert plain.step_time_s == 3.0 and plain.durations == dur
    sim = simulate(instrs, dur, {"a": 1}, present, slowdown={"gpu0.compute": (0.2, 0.0)})
    assert sim.durations == [1.0 * (1 + 0.2 * 0.5), 0.5, 1.0, 1.0, 1.0]  # half of it beside the copy
    assert sim.step_time_s == 3.1 and sim.busy_s["gpu0.compute"] == 3.1
    assert simulate(instrs, dur, {"a": 1}, present, slowdown={"gpu1.compute": (0.2, 0.2)}).step_time_s == 3.0


def test_a_computation_beside_ssd_transfers_is_stretched_by_the_ssd_factor_and_beside_a_copy_by_the_copy_one():
    """`GPU.ssd_contention` prices the time only SSD transfers overlap; where a copy overlaps too,
    the copy's factor applies (`GPU.host_contention`), never both."""
    instrs = [Instr(id=0, kind="compute", stream="gpu0.compute", deps=()),
              Instr(id=1, kind="load", stream="ssd.read", deps=(), tensor="s", src="ssd", dst="dram"),
              Instr(id=2, kind="load", stream="gpu0.h2d", deps=(), tensor="a", src="dram", dst="gpu0")]
    present = {("a", "dram"), ("a", "gpu0"), ("s", "ssd"), ("s", "dram")}
    sizes = {"a": 1, "s": 1}
    # the SSD read covers all of the computation, the copy its first quarter
    sim = simulate(instrs, [1.0, 1.0, 0.25], sizes, present, slowdown={"gpu0.compute": (0.4, 0.1)})
    assert sim.durations[0] == pytest.approx(1.0 * (1 + (0.4 * 0.25 + 0.1 * 0.75) / 1.0))
    only_ssd = simulate(instrs[:2], [1.0, 1.0], sizes, present, slowdown={"gpu0.compute": (0.4, 0.1)})
    assert only_ssd.durations[0] == pytest.approx(1.1)
    same = simulate(instrs, [1.0, 1.0, 0.25], sizes, present, slowdown={"gpu0.compute": (0.4, 0.4)})
    assert same.durations[0] == pytest.approx(1.4)  # one factor for both: the union, as before


def test_a_cpu_device_plan_records_the_stretch_its_overlapped_replay_gives_and_sync_mode_leaves_it_out():
    """On the CPU device tier (host_contention, ssd_contention > 0) the plan's computations carry `contended_s`, the
    replay of the plan file reproduces its predicted step, and sync mode's sum is the plain `est_s`."""
    import dataclasses as dc
    import json

    from tensorstow.planner.presets import load_hardware
    from tensorstow.schema.options import Options
    from tensorstow.planner.plan import make_plan
    from tensorstow.schema.plan import as_plan
    from tensorstow.planner.simulate import plan_commit_s, simulate_plan, sync_step_s
    base = load_hardware("lohan-rtx4090")
    g = base.gpus[0]
    hw = dc.replace(base, gpus=(dc.replace(g, memory_bytes=40 << 20, reserved_bytes=0, h2d_bw=2e9, d2h_bw=2e9),))
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", batch=4, precision="fp32", policy="zero-infinity")
    plain = as_plan(json.loads(make_plan(o, hw).dumps()))
    slow = dc.replace(hw, gpus=(dc.replace(hw.gpus[0], host_contention=0.5, ssd_contention=0.5),))
    plan = as_plan(json.loads(make_plan(o, slow).dumps()))
    stretched = [i for i in plan.instructions if i.contended_s > 0]
    assert stretched and all(i.kind in ("compute", "recompute") for i in stretched)
    assert all(i.contended_s == 0 for i in plain.instructions)
    assert plan.predicted.step_time_s > plain.predicted.step_time_s
    assert abs(simulate_plan(plan).step_time_s - plan.predicted.step_time_s) <= 1e-4 * plan.predicted.step_time_s
    assert sync_step_s(list(plan.instructions), plan_commit_s(plan)) == pytest.approx(
        sync_step_s(list(plain.instructions), plan_commit_s(plain)), rel=1e-6)


def test_a_write_of_the_state_pays_its_flush_and_a_steps_own_swap_does_not():
    """The store syncs the buffers homed on SSD and never a step's transient swaps
    (`SSDStore.set_transient`): the cost model prices the flush on the first only."""
    import dataclasses as dc

    from tensorstow.planner import cost
    from tensorstow.planner.presets import load_hardware
    hw = load_hardware("lohan-rtx4090")
    hw = dc.replace(hw, ssd=dc.replace(hw.ssd, count=1, write_bw=2e9, flush_bw=1e9, request_s=1e-4, sync_s=2e-4))
    n = 10 ** 9
    assert cost.transfer_time(n, "dram", "ssd", hw, durable=False) == pytest.approx(0.5 + 1e-4)
    assert cost.transfer_time(n, "dram", "ssd", hw) == pytest.approx(0.5 + 1.0 + 1e-4 + 2e-4)


def _prefetch_race(load_deps=()):
    """A computation allocates A (6 bytes) for 2 s; a load of P (6 bytes) later in program order
    has nothing to wait for; the GPU holds 10."""
    instrs = [Instr(id=0, kind="compute", stream="gpu0.compute", deps=(), allocs=("A",), est_s=2.0),
              Instr(id=1, kind="free", stream="gpu0.compute", deps=(0,), tensor="A", dst="gpu0"),
              Instr(id=2, kind="load", stream="gpu0.h2d", deps=tuple(load_deps), tensor="P", src="dram", dst="gpu0",
                    est_s=1.0),
              Instr(id=3, kind="compute", stream="gpu0.compute", deps=(2,), est_s=1.0),
              Instr(id=4, kind="free", stream="gpu0.compute", deps=(3,), tensor="P", dst="gpu0")]
    return instrs, [i.est_s for i in instrs], {"A": 6, "P": 6}, {("P", "dram")}


def test_a_copy_waits_for_room_where_the_replay_has_a_capacity():
    """Fuyou §4.4's memory-aware prefetch: without a capacity the load runs beside the computation
    (12 bytes live); with one it waits for the release of A, and the computation before it in
    program order is not the one that waits."""
    instrs, dur, sizes, initial = _prefetch_race()
    free_run = simulate(instrs, dur, sizes, initial)
    assert free_run.peak_bytes["gpu0"] == 12 and free_run.start[2] == 0.0
    waiting = simulate(instrs, dur, sizes, initial, capacity={"gpu0": 10})
    assert waiting.peak_bytes["gpu0"] == 6 and waiting.start[2] == 2.0 and waiting.start[0] == 0.0
    assert 2 in waiting.waited and waiting.fences[2] == (1,)
    # the waits as dependencies: a replay without the capacity keeps the peak
    fenced = [dataclasses.replace(i, deps=tuple(sorted({*i.deps, *waiting.fences.get(i.id, ())}))) for i in instrs]
    assert simulate(fenced, dur, sizes, initial).peak_bytes["gpu0"] == 6


def test_a_copy_with_no_room_ever_runs_and_the_peak_shows_the_overflow():
    instrs, dur, sizes, initial = _prefetch_race()
    sim = simulate(instrs, dur, sizes, initial, capacity={"gpu0": 5})
    assert sim.peak_bytes["gpu0"] > 5 and sim.step_time_s > 0


def test_a_one_core_process_with_the_cpu_as_its_device_runs_its_host_work_one_at_a_time():
    """A data-parallel rank's share of a 2-core machine has one core: its computation, its copies
    between DRAM and the CPU device tier, its optimizer steps and collectives share it, while SSD
    transfers (paced by the disk) run beside them. With two cores they run side by side."""
    from tensorstow.planner.presets import load_hardware
    from tensorstow.planner.simulate import contention
    from tensorstow.schema.hardware import CPU_GPU_NAME
    instrs = [Instr(id=0, kind="compute", stream="gpu0.compute", deps=()),
              Instr(id=1, kind="load", stream="gpu0.h2d", deps=(), tensor="a", src="dram", dst="gpu0"),
              Instr(id=2, kind="optimizer_step", stream="cpu.opt", deps=(), segment="b0", dst="cpu"),
              Instr(id=3, kind="load", stream="ssd.read", deps=(), tensor="b", src="ssd", dst="dram")]
    dur = [1.0, 0.5, 0.25, 2.0]
    present = {("a", "dram"), ("a", "gpu0"), ("b", "ssd"), ("b", "dram")}
    hw = load_hardware("lohan-rtx4090")
    cpu_tier = dataclasses.replace(hw, gpus=(dataclasses.replace(hw.gpus[0], name=CPU_GPU_NAME),))

    def step(h):
        return simulate(instrs, dur, {"a": 1, "b": 1}, present, links=contention(instrs, h)).step_time_s
    one = dataclasses.replace(cpu_tier, cpu=dataclasses.replace(hw.cpu, cores=1))
    assert step(one) == 2.0  # 1.75 s of host work one at a time, beside the 2 s SSD read
    assert step(dataclasses.replace(one, ssd=dataclasses.replace(hw.ssd, read_bw=hw.ssd.read_bw * 100))) == 2.0
    dur[3] = 0.1
    assert step(one) == pytest.approx(1.75)
    assert step(dataclasses.replace(cpu_tier, cpu=dataclasses.replace(hw.cpu, cores=2))) == 1.0
    assert step(dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, cores=1))) == 1.0  # a GPU computes apart
    two = dataclasses.replace(one, gpus=one.gpus * 2)  # two CPU devices on one core already share its rates
    assert step(two) == 1.0


def test_a_data_parallel_plan_replays_on_its_ranks_share_as_it_was_planned():
    """`simulate_plan` replays a data-parallel plan on one rank's share of its recorded machine, as the
    planner simulated it: with the CPU as the device tier and two ranks on a 2-core machine, each
    rank's host work on its one core."""
    from tensorstow.planner.plan import make_plan
    from tensorstow.planner.presets import load_hardware
    from tensorstow.planner.simulate import simulate_plan
    from tensorstow.schema.hardware import CPU_GPU_NAME
    from tensorstow.schema.options import Options
    o = Options(model="gpt-small", hardware="lohan-rtx4090", policy="lohan", batch=2, seq=32, dp=2, gpus=2)
    hw = load_hardware("lohan-rtx4090").with_overrides(gpus=2)
    hw = dataclasses.replace(hw, gpus=tuple(dataclasses.replace(g, name=CPU_GPU_NAME) for g in hw.gpus),
                             cpu=dataclasses.replace(hw.cpu, cores=2))
    plan = make_plan(o, hw).to_plan()
    assert simulate_plan(plan).step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-6)
    host = [i for i in plan.instructions if i.kind in ("compute", "reduce", "gather", "optimizer_step")]
    assert sum(i.est_s for i in host) <= plan.predicted.step_time_s + 1e-9  # one at a time
