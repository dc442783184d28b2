"""The device arena (`planner.pools.device_arena`, `execute --arena`): every copy a step makes
on the device is a range of one arena the plan sizes, at an offset the plan's order gives it.

The placement is checked against a reference written apart from it (networkx reachability over the
dependencies and the streams' order, the copies and their readers found by walking the program):
two copies share bytes only where one is gone, its free and its readers ended, before the other is
made, in program order and lane by lane. Training through the arena is checked against eager
PyTorch; the executor's own aliasing check is shown to fire on a placement that breaks the rule."""
import json
from pathlib import Path

import networkx as nx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorstow import TensorstowError
from tensorstow.cli import main
from tensorstow.executor.data import batches
from tensorstow.executor.executor import Executor
from tensorstow.ir.models import GPT, PRESETS
from tensorstow.planner import pools
from tensorstow.planner.plan import make_plan
from tensorstow.planner.presets import load_hardware
from tensorstow.schema.options import Options
from tensorstow.schema.plan import Plan
from tensorstow.schema.schedule import BufferKind, InstrKind, Stream, block_gpus, home_tiers, member_rows, runs_on
from tests.oracle import train_eager
from tests.test_executor import (B, STEPS, T, VOCAB, assert_device_accounting_balanced, assert_same, eager,
                                 get_plan, run)

ROOT = Path(__file__).resolve().parents[1]


def reference_copies(instrs, buffers, gpu, homes):
    """Each copy a program makes on `gpu` outside its homes, walked in program order: (buffer, the
    instruction that makes it, its free or None, the instructions on `gpu` that read it: those
    depending on the make directly, before the free)."""
    out, live, present = [], {}, set(homes)
    for i in instrs:
        if i.kind == InstrKind.FREE and i.dst == gpu:
            present.discard(i.tensor)
            if i.tensor in live:
                c = live.pop(i.tensor)
                c[2] = i.id
                c[3] = {u.id for u in instrs if c[1] in u.deps and c[1] < u.id < i.id
                        and Stream.of(u.stream).device == gpu}
            continue
        on_gpu = Stream.of(i.stream).device == gpu
        if i.kind in (InstrKind.LOAD, InstrKind.SEND):
            made = [i.tensor] if i.dst == gpu else []
        else:
            made = list(i.allocs) if on_gpu and i.kind != InstrKind.FREE else []
        for b in made:
            spec = buffers[b]
            rows = spec.buffer_kind not in (BufferKind.M, BufferKind.OS) and any(
                member_rows(m)[1] is not None for m in spec.members)
            if b in present or spec.buffer_kind is BufferKind.W or rows:
                continue
            live[b] = [b, i.id, None, set()]
            out.append(live[b])
        present.update(made)
    return out


def ends_before(x, y, ancestors) -> bool:
    """Copy x is freed and every reader of it has ended before y's make starts."""
    return x[2] is not None and {x[2], *x[3]} <= ancestors[y[1]]


def ancestors_of(instrs) -> dict[int, set[int]]:
    """Instruction -> those that end before it starts in either mode: its dependencies, the one
    before it on its stream, and theirs (networkx reachability)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(i.id for i in instrs)
    last = {}
    ids = set(graph)
    for i in instrs:
        graph.add_edges_from((d, i.id) for d in i.deps if d in ids)
        if i.stream in last:
            graph.add_edge(last[i.stream], i.id)
        last[i.stream] = i.id
    return {n: nx.ancestors(graph, n) for n in graph}


def check_program(instrs, buffers, gpu, homes) -> tuple[int, int]:
    """The arena of one program obeys the rule (the module docstring); returns its bytes and how many
    pairs of copies share bytes."""
    arena = pools.device_arena(instrs, buffers, gpu, homes)
    ancestors = ancestors_of(instrs)
    base = sum(pools.device_bytes(buffers[n]) for n in homes if n in arena.homes)
    assert sorted(arena.homes.values()) == sorted({*arena.homes.values()})  # homes packed, apart
    copies = reference_copies(instrs, buffers, gpu, homes)
    assert {(c[1], c[0]) for c in copies} == set(arena.at)
    shared = 0
    for k, x in enumerate(copies):
        xa = arena.at[x[1], x[0]]
        xz = xa + pools.device_bytes(buffers[x[0]])
        assert xa % pools.DEVICE_ALIGN == 0 and base <= xa and xz <= arena.nbytes
        for y in copies[k + 1:]:
            ya = arena.at[y[1], y[0]]
            if ya < xz and xa < ya + pools.device_bytes(buffers[y[0]]):
                shared += 1
                assert ends_before(x, y, ancestors) or ends_before(y, x, ancestors), (x, y)
    return arena.nbytes, shared


def check_plan(plan: Plan) -> int:
    """Every process's step, evaluation and redo programs obey the rule, and the plan records the
    largest arena; returns how many pairs of copies share bytes."""
    bufs = dict(plan.buffers)
    gpu_of = block_gpus(plan)
    homes = home_tiers(bufs, plan.decisions, [b.name for b in plan.model.blocks])
    shared = 0
    for gpu in sorted(set(gpu_of.values())):
        mine = [n for n, t in homes.items() if t == gpu]
        sizes = []
        for prog in (plan.instructions, plan.eval_instructions, plan.redo_instructions):
            nbytes, n = check_program([i for i in prog if runs_on(i, gpu, gpu_of, bufs)], bufs, gpu, mine)
            sizes.append(nbytes)
            shared += n
        assert plan.pools[gpu].device == max(sizes)
    return shared


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(policy=st.sampled_from(["lohan", "zero-infinity", "ilp", "stronghold", "all-gpu"]),
       precision=st.sampled_from(["fp32", "bf16-mixed"]), gpu_mem=st.sampled_from([1_500_000, 2_500_000, 8_000_000]),
       accum=st.sampled_from([1, 2]), clip=st.sampled_from([0.0, 1.0]))
def test_two_copies_share_bytes_only_where_one_is_gone_before_the_other_is_made(policy, precision, gpu_mem, accum,
                                                                               clip):
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy=policy, batch=B, seq=T, precision=precision,
                gpu_mem=gpu_mem if policy != "all-gpu" else 8_000_000, grad_accum=accum, max_grad_norm=clip)
    try:
        r = make_plan(o, load_hardware(o.hardware).with_overrides(gpu_mem=o.gpu_mem))
    except TensorstowError:
        return  # no plan fits this budget
    check_plan(r.to_plan())


def with_arena(plan: dict) -> dict:
    """Executor options that run `plan` through its device arena: a device budget of at least the
    arena and the most a segment holds beside it (the executor's own bound, which the run must keep)."""
    p = Plan.from_json(plan)
    return {"device_arena": "on", "device_budget": max(pools.arena_need(p, "gpu0"), p.predicted.capacity_bytes["gpu"])}


def executor_reads(prog, instrs) -> list[tuple[int, str, int]]:
    """What the executor really reads on the device, walked in program order: (reader, buffer, the
    instruction that made the copy it reads) for each segment's inputs found in the buffers that hold
    them (as `Runtime._fetch` finds them) and the gradients it adds into, each copy a store or send
    moves away, each gradient reduced or parameter gathered, and what a GPU update reads."""
    j, gpu = prog.joint, prog.gpu
    made = {n: None for n, t in prog.homes.items() if t == gpu}  # buffer on the device -> its make
    out = []
    for i in instrs:
        reads = set()
        if i.kind in (InstrKind.COMPUTE, InstrKind.RECOMPUTE):
            seg = j.segments[i.segment]
            wanted = set(seg.ext_roots)
            for a in (*i.allocs, *i.accum):
                wanted |= set(prog.members.get(a, ())) - seg.produced
            for r in wanted - set(j.inputs) - set(j.constants):
                holder = next((h for h in prog.holders_of(r, i.micro) if h in made), None)
                if holder is not None and holder not in prog.parts:
                    reads.add(holder)
            reads |= set(i.accum) & set(made)
        elif i.kind in (InstrKind.STORE, InstrKind.SEND) and i.src == gpu or i.kind in (InstrKind.REDUCE,
                                                                                         InstrKind.GATHER):
            reads.add(i.tensor)
        elif i.kind == InstrKind.OPTIMIZER_STEP and i.dst == gpu:
            reads |= {f"{k}:{i.segment}" for k in ("G", "OS", "M", "P")} & set(made) - set(i.allocs)
        out += [(i.id, b, made[b]) for b in reads if made.get(b) is not None and made[b] != i.id]
        if i.kind == InstrKind.FREE and i.dst == gpu:
            made.pop(i.tensor, None)
        elif i.kind in (InstrKind.LOAD, InstrKind.SEND) and i.dst == gpu:
            made.setdefault(i.tensor, i.id)
        elif Stream.of(i.stream).device == gpu and i.kind != InstrKind.FREE:
            made.update((a, i.id) for a in i.allocs)
    return out


@pytest.mark.parametrize("name", ["zero-infinity", "swap-gpuopt", "partial-swap", "cut-backward", "interleaved",
                                  "deferred"])
def test_no_copy_is_written_over_while_the_executor_still_reads_it(name, tmp_path):
    """The reads the executor makes, found from the traced segments (not the dependencies the
    placement reasons with): each ends before any later copy that shares bytes with the copy it
    reads is made, in either mode."""
    ex = run(get_plan(name), "sync", tmp_path, **with_arena(get_plan(name)))[0]
    prog, bufs = ex.program, ex.plan.buffers
    for instrs in (prog.instrs, prog.eval_instrs):
        homes = [n for n, t in prog.homes.items() if t == prog.gpu]
        at = pools.device_arena(instrs, bufs, prog.gpu, homes).at
        ancestors = ancestors_of(instrs)
        span = {key: (o, o + pools.device_bytes(bufs[key[1]])) for key, o in at.items()}
        reads = executor_reads(prog, instrs)
        assert reads
        for reader, buf, make in reads:
            if (make, buf) not in span:
                continue  # a home, or a unit's rows
            a, z = span[make, buf]
            later = [m for (m, _), (c, d) in span.items() if m > make and c < z and a < d]
            assert all(reader in ancestors[m] for m in later), (reader, buf, make)


@pytest.mark.parametrize("name", ["mobius-8b__mobius-3090ti-topo2+2__mobius", "gpt3-13b-dp4__lohan-rtx4090__ilp"])
def test_golden_plans_arenas_keep_live_copies_apart(name):
    """Pipeline stages with sends, data-parallel ranks: each process's arena obeys the rule, and
    copies do share bytes (the arena is reused, not a copy per instruction)."""
    assert check_plan(Plan.load(ROOT / "plans" / f"{name}.json")) > 0


def test_the_arena_is_at_least_what_is_live_at_once_in_program_order():
    """A lower bound the placement cannot beat: the bytes of the copies live at once in program order."""
    plan = Plan.from_json(get_plan("zero-infinity"))
    bufs = dict(plan.buffers)
    instrs = list(plan.instructions)
    copies = reference_copies(instrs, bufs, "gpu0", [])
    live = max(sum(pools.device_bytes(bufs[c[0]]) for c in copies if c[1] <= i.id and (c[2] is None or i.id < c[2]))
               for i in instrs)
    assert 0 < live <= plan.pools["gpu0"].device < sum(pools.device_bytes(bufs[c[0]]) for c in copies)


@pytest.mark.parametrize("name,mode", [(n, "overlap") for n in ["zero-infinity", "swap-gpuopt", "partial-swap",
                                                                 "cut-backward", "interleaved", "deferred", "all-gpu"]]
                         + [("interleaved", "sync"), ("cut-backward", "sync")])
def test_training_through_the_arena_is_bit_identical_to_eager(name, mode, tmp_path):
    """Loads, swapped activations read back, segments' outputs, GPU updates' new copies and homes, all
    in the arena: the same bits as eager PyTorch, every copy where the plan placed it."""
    ex, losses, params = run(get_plan(name), mode, tmp_path, **with_arena(get_plan(name)))
    assert ex.dev.arena is not None and ex.dev.arena.numel() == ex.plan.pools["gpu0"].device
    assert ex.peak_bytes["gpu"] <= pools.arena_need(ex.plan, "gpu0")  # the bound the executor checks the budget with
    assert_same((losses, params), eager())
    assert_device_accounting_balanced(ex)
    base = ex.dev.arena.data_ptr()
    for buf, at in ex.dev.homes_at.items():  # between steps only the homes are there
        start, end = ex.dev.ranges[buf]
        assert start == at and all(start <= t.data_ptr() - base < end for t in ex.dev.get(buf).values())
    assert set(ex.dev.ranges) == set(ex.dev.homes_at)


def test_the_executor_refuses_a_placement_that_overlaps_a_live_copy(tmp_path, monkeypatch):
    """The check can fail: every copy placed at the arena's first offset overlaps the one before."""
    real = pools.device_arena

    def squashed(*a, **k):
        r = real(*a, **k)
        first = min(r.at.values())
        return pools.DeviceArena(homes=r.homes, at={key: first for key in r.at}, nbytes=r.nbytes)
    monkeypatch.setattr("tensorstow.executor.runtime.device_arena", squashed)
    with pytest.raises(TensorstowError, match=r"arena range .* overlaps .* still on gpu0: the plan's order"):
        run(get_plan("zero-infinity"), "sync", tmp_path, **with_arena(get_plan("zero-infinity")))


def test_the_arena_setting_is_one_line_where_it_cannot_be_used(tmp_path, capsys):
    plan = get_plan("zero-infinity")
    older = json.loads(json.dumps(plan))
    older["pools"]["gpu0"].pop("device")
    p = tmp_path / "older.json"
    p.write_text(json.dumps(older))
    args = ["execute", str(p), "--steps", "1", "--state-dir", str(tmp_path / "s"), "--hw-mismatch", "ok"]
    assert main([*args, "--arena", "on"]) == 2
    assert capsys.readouterr().err == ("tensorstow: error: device arena on: the plan sizes no device arena (a plan "
                                       "of an older tensorstow): re-plan it\n")
    with pytest.raises(TensorstowError, match=r"the device arena \(.* MB\) and what a segment holds beside it \(.* "
                                              r"MB: its workspace, its outputs before they are copied in, the inputs\) "
                                              r"exceed the device budget \(0.5 MB\)"):
        run(plan, "sync", tmp_path, device_arena="on", device_budget=500_000)
    ex, _, _ = run(plan, "sync", tmp_path / "auto")  # auto on a CPU device tier: none
    assert ex.dev.arena is None and ex.dev.arena_note.startswith("auto: not on a CPU device tier")


def test_a_mixed_precision_run_casts_into_the_arena_as_eager_autocast_rounds(tmp_path):
    """bf16-mixed with the exact optimizer: fp32 gradients cast as they are copied in, updated bf16
    copies written into their ranges; the same bits as eager autocast with torch's AdamW."""
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="lohan", batch=B, seq=T, precision="bf16-mixed",
                lr=1e-3, weight_decay=0.1, gpu_mem=2_500_000, exact_optimizer=True)
    plan = json.loads(make_plan(o, load_hardware(o.hardware).with_overrides(gpu_mem=o.gpu_mem)).dumps())
    torch.manual_seed(0)
    want = train_eager(GPT(PRESETS["gpt-tiny"]), batches("synthetic", B, T, VOCAB, STEPS, seed=0), lr=1e-3,
                       weight_decay=0.1, precision="bf16-mixed")
    for mode in ("sync", "overlap"):
        torch.manual_seed(0)
        ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), mode=mode, state_dir=tmp_path / mode, **with_arena(plan))
        losses = [ex.step(x, y) for x, y in batches("synthetic", B, T, VOCAB, STEPS, seed=0)]
        assert ex.dev.arena is not None
        assert_same((losses, ex.parameters()), want)


def test_a_hugging_face_mixture_of_experts_trains_through_the_arena_as_eager_hf(tmp_path, monkeypatch):
    """A tiny Qwen3-MoE checkpoint (transformers), offloaded under lohan, lanes side by side, its
    segments replayed as graphs (the CPU stand-in for CUDA's) but those whose routing counts tokens
    per expert (`bincount`: an output size the host must know) and run eagerly beside the graphs'
    pool (the device budget leaves room for both): the same bits as eager Hugging Face training.
    With its experts in groups (units whose rows the device holds outside the arena) `--arena on`
    is one line."""
    pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")
    from tensorstow.executor import graphs
    from tests.test_graphs import RecordedGraph
    monkeypatch.setitem(graphs.BACKENDS, "cpu", RecordedGraph)
    seen = []
    real_run = graphs.SegmentGraphs.run

    def run_segment(self, rt, ins, interpret):
        seen.append((ins.segment, ins.segment in self.eager))
        return real_run(self, rt, ins, interpret)
    monkeypatch.setattr(graphs.SegmentGraphs, "run", run_segment)
    from tensorstow.ir.models import resolve_model
    from tests import test_real_models as real
    from tests.test_moe import eager as eager_hf, moe_ref
    ref = moe_ref("qwen3_moe", tmp_path)
    pj = real.offloaded_plans(ref, policies=("lohan",))["lohan"]
    p = Plan.from_json(pj)
    room = 2 * pools.arena_need(p, "gpu0") - p.pools["gpu0"].device  # the pool beside the eager segments
    got = real.run_executor(pj, resolve_model(ref).build, tmp_path / "s", mode="overlap", device_arena="on",
                            device_budget=max(room, p.predicted.capacity_bytes["gpu"]))
    real.assert_equal(got, eager_hf(ref), prefix="model.")
    assert any(eager for _, eager in seen) and not all(eager for _, eager in seen)
    grouped = real.offloaded_plans(ref, policies=("lohan",), expert_groups=2)["lohan"]
    with pytest.raises(TensorstowError, match="device arena on: the plan's expert units hold their rows of the "
                                              "expert weights outside it: run without one"):
        real.run_executor(grouped, resolve_model(ref).build, tmp_path / "g", device_arena="on")
