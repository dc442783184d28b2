"""Executor: plans replayed step by step train exactly like eager PyTorch.

Every plan here runs gpt-tiny (fp32, batch 2, seq 32) for 3 steps and is compared with 3
steps of plain PyTorch (same seed, same data, torch.optim.AdamW/Adam with the plan's
hyperparameters): losses and parameters must be bit-identical (torch.equal). They are: the
segments run the very aten ops eager autograd runs, in the same order, on tensors with the
same strides (buffers move storage roots and views are replayed), and each subgroup's
update is torch's own single-tensor Adam.
"""
import contextlib
import copy
import dataclasses
import functools
from collections import Counter
import json
import math
import os
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from tensorstow import TensorstowError
from tests.oracle import train_eager
from tensorstow.executor.data import batches
from tensorstow.executor.executor import Executor
from tensorstow.executor.runtime import Runtime
from tensorstow.executor.stores import DeviceMemoryError, FileStore
from tensorstow.ir.models import GPT, PRESETS
from tensorstow.ir.trace import trace
from tensorstow.planner.presets import load_hardware
from tensorstow.schema.options import Options
from tensorstow.planner.plan import make_plan, POLICIES
from tensorstow.planner.passes import schedule
from tensorstow.planner.problem import build_problem
from tensorstow.schema.schedule import BlockDecision, Decisions

B, T, STEPS = 2, 32, 3
VOCAB = PRESETS["gpt-tiny"].vocab_size


@functools.lru_cache(maxsize=None)
def _traced_problem():
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="custom", batch=B, seq=T,
                precision="fp32", lr=1e-3, weight_decay=0.1, exact_optimizer=True)  # bit-identity
    return build_problem(o, load_hardware(o.hardware))


def problem(optimizer="adamw", gpu_mem=3_000_000):
    """gpt-tiny traced once; optimizer and GPU memory are overrides (as --optimizer, --gpu-mem)."""
    p = _traced_problem()
    return dataclasses.replace(p, hw=p.hw.with_overrides(gpu_mem=gpu_mem),
                               options=dataclasses.replace(p.options, gpu_mem=gpu_mem, optimizer=optimizer))


@functools.lru_cache(maxsize=None)
def tiny_trace():
    """One trace of the real gpt-tiny shared by the executors below (each still checks it
    against its plan's fingerprint); test_fingerprint_mismatch_is_refused re-traces."""
    return trace(GPT(PRESETS["gpt-tiny"]), batch=B, seq=T, precision="fp32", model_name="gpt-tiny")


def plan_json(decisions: Decisions, **kw) -> dict:
    plan = schedule(problem(**kw), decisions)
    assert_fits(plan)
    return json.loads(plan.dumps())


def assert_fits(plan) -> None:
    assert not plan.over_capacity(), plan.over_capacity()


def policy_plan(name: str, **kw) -> dict:
    p = problem(**kw)
    return plan_json(POLICIES[name](p), **kw)


def mix(choose) -> Decisions:
    """Decisions from a function block -> BlockDecision."""
    order = problem().order
    return Decisions(policy="custom", blocks={b: choose(b) for b in order}, overlap_optimizer=True)


PLANS = {
    "all-gpu": lambda: policy_plan("all-gpu", gpu_mem=6_000_000),
    # streamed params from SSD, DRAM checkpoints + recompute, CPU AdamW after backward
    "zero-infinity": lambda: policy_plan("zero-infinity", gpu_mem=2_000_000),
    # activations swapped to DRAM and SSD, params home DRAM, GPU optimizer with states in DRAM
    "swap-gpuopt": lambda: plan_json(mix(lambda b: BlockDecision(
        params="dram", states="dram", optimizer="gpu",
        activations={"b0": "swap_dram", "b1": "swap_ssd", "b2": "recompute"}.get(b, "keep"),
        checkpoint="ssd" if b == "b2" else ("dram" if b.startswith("b") else "gpu")))),
    # partial swaps (Fuyou Table 2): b0, b1 move only their linear and attention outputs, to DRAM
    # and SSD, and re-forward their norms, GELU and residual sums before the backward
    "partial-swap": lambda: plan_json(mix(lambda b: BlockDecision(
        params="dram", states="dram", optimizer="cpu",
        activations={"b0": "swap_dram", "b1": "swap_ssd", "b2": "recompute"}.get(b, "keep"),
        checkpoint="dram" if b.startswith("b") else "gpu", reforward=b in ("b0", "b1")))),
    # cut backwards (LoHan's layer-by-layer swapping): every layer block's backward in two parts,
    # the first releasing what only it reads; b0 swaps partially to DRAM, b1 whole to SSD (its load
    # waits for b2's first part), b2 is recomputed, b3 keeps its activations
    "cut-backward": lambda: plan_json(mix(lambda b: BlockDecision(
        params="dram", states="dram", optimizer="cpu",
        activations={"b0": "swap_dram", "b1": "swap_ssd", "b2": "recompute"}.get(b, "keep"),
        checkpoint="dram" if b.startswith("b") else "gpu", reforward=b == "b0",
        bwd_cut=problem().profiles[problem().profile_of[b]].bwd_cut if b.startswith("b") else 0))),
    # interleaved subgroups: CPU updates overlapped with backward (states on SSD) next to GPU
    # updates whose states live in DRAM; params resident on the GPU for some blocks
    "interleaved": lambda: plan_json(mix(lambda b: BlockDecision(
        params="gpu" if b in ("pre", "b1") else "ssd",
        states="ssd" if b in ("b0", "b2", "post") else "dram",
        optimizer="cpu" if b in ("b0", "b2", "post") else "gpu",
        activations="swap_ssd" if b == "b3" else ("swap_dram" if b == "post" else "keep"),
        checkpoint="gpu"))),
    # P and the Adam states on different tiers, CPU updates (`--ssd-for params` keeps the states off
    # the SSDs, `--ssd-for optimizer` the parameters): fp32's P is the master the update reads
    "split-homes": lambda: plan_json(mix(lambda b: BlockDecision(
        params="ssd" if b in ("b0", "b2") else "dram", states="dram" if b in ("b0", "b2") else "ssd",
        optimizer="cpu", activations="keep", checkpoint="gpu"))),
    # every block's P and Adam states on SSD, CPU updates; the write-backs of the last two updated
    # (the embedding, b0) run at the start of the next step (Decisions.deferred_writes)
    "deferred": lambda: plan_json(dataclasses.replace(mix(lambda b: BlockDecision(
        params="ssd", states="ssd", optimizer="cpu", activations="swap_dram" if b == "b1" else "keep",
        checkpoint="gpu")), deferred_writes=("pre", "b0"))),
}


@functools.lru_cache(maxsize=None)
def get_plan(name: str) -> dict:
    """A named plan as JSON (copy it before changing it)."""
    return PLANS[name]()


@functools.lru_cache(maxsize=None)
def eager(optimizer="adamw", lr=1e-3, weight_decay=0.1):
    torch.manual_seed(0)
    return train_eager(GPT(PRESETS["gpt-tiny"]), batches("synthetic", B, T, VOCAB, STEPS, seed=0), lr=lr,
                       weight_decay=weight_decay, optimizer=optimizer)


def executor(plan: dict, state_dir=None, mode="sync", **kw) -> Executor:
    torch.manual_seed(0)
    return Executor(plan, GPT(PRESETS["gpt-tiny"]), mode=mode, state_dir=state_dir, traced=tiny_trace(), **kw)


def run(plan: dict, mode: str, tmp_path, **kw):
    ex = executor(plan, tmp_path / f"ssd-{mode}", mode, **kw)
    losses = [ex.step(x, y) for x, y in batches("synthetic", B, T, VOCAB, STEPS, seed=0)]
    return ex, losses, ex.parameters()


_sync_runs = {}


def sync_run(name: str, tmp_path_factory):
    """The sync run of a named plan, shared by the tests that compare against it."""
    if name not in _sync_runs:
        _sync_runs[name] = run(get_plan(name), "sync", tmp_path_factory.mktemp(name))
    return _sync_runs[name]


def assert_device_accounting_balanced(ex: Executor) -> None:
    """Between steps the device tier counts exactly the storages of the buffers it holds, each
    once per tensor that holds it: no temporary of a step is still counted, none released twice
    (the compiled segments skip views' holds and pass kept roots' holds on to their buffers)."""
    refs: dict[int, list[int]] = {}
    for values in ex.dev.copies.values():
        for t in values.values():
            st = t.untyped_storage()
            if st.nbytes():
                refs.setdefault(st.data_ptr(), [st.nbytes(), 0])[1] += 1
    if ex.dev.arena is not None:  # held itself besides its views
        refs.setdefault(ex.dev.arena.data_ptr(), [ex.dev.arena.numel(), 0])[1] += 1
    assert ex.dev._live == refs
    assert ex.dev.used == sum(n for n, _ in refs.values())


def assert_same(a, b):
    (la, pa), (lb, pb) = a, b
    assert la == lb
    assert pa.keys() == pb.keys()
    bad = [n for n in pa if not torch.equal(pa[n], pb[n])]
    assert not bad, f"parameters differ: {bad[:5]}"


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_trains_exactly_like_eager_pytorch(name, tmp_path_factory):
    ex, losses, params = sync_run(name, tmp_path_factory)
    assert_same((losses, params), eager())
    # the executor's own accounting of the device tier stays within the plan's simulated peak:
    # every value that outlives a segment is a planned buffer (the gradient each backward hands
    # to the next is H:<b>), the rest is inside the segments' workspaces
    assert 0 < ex.peak_bytes["gpu"] <= ex.plan.predicted.peak_bytes["gpu"]
    if name != "all-gpu":  # the SSD tier really held state: the store committed each buffer homed there
        homed = {n: b.bytes for n, b in ex.plan.buffers.items() if b.home == "ssd"}
        assert ex.plan.ssd_sizes() and ex.ssd.store.committed_step() is not None
        assert all(ex.ssd.store.committed_path(n).stat().st_size >= n_ for n, n_ in homed.items())
        if ex.carried:  # each step commits the one before, once its deferred write-backs are home
            assert ex.ssd.store.committed_step() == STEPS - 1
            return
        assert ex.ssd.store.committed_step() == STEPS


def test_parameters_read_for_the_backward_stay_in_dram_for_their_cpu_update():
    """fp32, P on SSD, CPU update: the backward's DRAM copy of P serves the update, so P is read
    from SSD once less per step (the "interleaved" plan, whose equivalence with eager is tested
    above); the DeepSpeed baseline reads it again, as DeepSpeed does."""
    def ssd_reads(plan):
        return Counter(i["tensor"] for i in plan["instructions"]
                       if i["kind"] == "load" and i["src"] == "ssd" and i["tensor"].startswith("P:"))

    plan = get_plan("interleaved")
    assert plan["decisions"]["keep_params_for_update"]
    # b0, b2: the forward's read and the backward's, which the update uses too; post, the last
    # forward, is read once for its forward, backward and update; b3 (GPU update) as before: three
    assert ssd_reads(plan) == {"P:b0": 2, "P:b2": 2, "P:post": 1, "P:b3": 3}
    by_id = {i["id"]: i for i in plan["instructions"]}
    for b in ("b0", "b2", "post"):  # the update waits for the very load the backward's copy came from
        upd = next(i for i in plan["instructions"] if i["kind"] == "optimizer_step" and i["segment"] == b)
        assert any(by_id[d]["kind"] == "load" and by_id[d]["tensor"] == f"P:{b}" and by_id[d]["dst"] == "dram"
                   for d in upd["deps"])
    zi = get_plan("zero-infinity")
    assert "keep_params_for_update" not in zi["decisions"]
    assert all(n == 3 for t, n in ssd_reads(zi).items() if t.startswith("P:b")), ssd_reads(zi)


@pytest.mark.parametrize("name", ["zero-infinity", "swap-gpuopt", "partial-swap", "cut-backward", "interleaved",
                                  "deferred"])
def test_overlap_mode_is_bit_identical_to_sync(name, tmp_path, tmp_path_factory):
    """One worker per stream, each instruction waiting only for its deps. Copies here are memcpys
    far faster than the interpreted compute, so the real timing is nothing like the modeled one;
    the plan's memory fences (planner/simulate.py) must still keep the device within the plan's
    own capacity."""
    budget = get_plan(name)["predicted"]["capacity_bytes"]["gpu"]
    ex, losses, params = run(get_plan(name), "overlap", tmp_path, device_budget=budget)
    _, sync_losses, sync_params = sync_run(name, tmp_path_factory)
    assert_same((losses, params), (sync_losses, sync_params))
    assert ex.peak_bytes["gpu"] <= budget
    assert_device_accounting_balanced(ex)


def test_overlap_lanes_keep_their_threads_from_step_to_step(tmp_path):
    """Guards against a thread per stream every step: a new thread starts with cold per-thread
    state (the allocator's thread cache and arena, torch's and CUDA's thread-locals), and under
    jemalloc gpt-small's all-resident step runs 12% slower in overlap mode than in sync mode that
    way, and as fast with threads that last. Each stream's lane runs on one thread for the
    Executor's life; `close`, or the Executor's garbage collection, ends them."""
    import gc

    plan = get_plan("zero-infinity")
    names = {f"tensorstow-{i['stream']}" for i in plan["instructions"]}
    data = list(batches("synthetic", B, T, VOCAB, 3, seed=0))

    def lane_threads(before):
        return {t for t in threading.enumerate() if t.name in names and t not in before}

    before = set(threading.enumerate())
    ex = executor(plan, tmp_path / "a", "overlap")
    seen = []
    for x, y in data:
        ex.step(x, y)
        seen.append(lane_threads(before))
    assert {t.name for t in seen[0]} == names and seen[0] == seen[1] == seen[2]
    ex.close()
    assert not any(t.is_alive() for t in seen[0])

    before = set(threading.enumerate())
    ex = executor(plan, tmp_path / "b", "overlap")
    ex.step(*data[0])
    kept = lane_threads(before)
    assert {t.name for t in kept} == names
    del ex  # never closed: collecting it ends its lanes
    gc.collect()
    assert not any(t.is_alive() for t in kept)


def test_a_lane_error_that_escapes_is_raised_and_its_thread_serves_the_next_step():
    from tensorstow.executor.lanes import LaneThreads

    def bad():
        raise ValueError("escaped")
    lanes, ran = LaneThreads(), []
    try:
        with pytest.raises(ValueError, match="escaped"):
            lanes.run({"a": bad, "b": lambda: ran.append("b")})
        lanes.run({"a": lambda: ran.append(threading.current_thread().name)})
    finally:
        lanes.close()
    assert ran == ["b", "tensorstow-a"]


@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2,
                    reason="needs 2 cores: with 1 torch thread the compute lane is pinned to one, the others to the rest")
def test_overlap_with_a_core_to_spare_pins_compute_apart_and_stays_bit_identical(tmp_path, monkeypatch):
    """On a CPU device tier whose compute threads leave cores free, each overlap lane pins itself:
    the compute lane to the first `threads` cores, every other lane (and the I/O threads it
    starts) to the rest; the numbers stay those of sync mode."""
    pinned: dict[str, set] = {}
    real = os.sched_setaffinity

    def record(pid, cores):
        if pid == 0:  # a thread pinning itself (the main thread moves others: see the test below)
            pinned[threading.current_thread().name] = set(cores)
        real(pid, cores)

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # the CPU device tier also on a machine with a GPU (CUDA lanes are not pinned)
        want = run(get_plan("zero-infinity"), "sync", tmp_path / "sync", device="cpu")
        monkeypatch.setattr(os, "sched_setaffinity", record)
        got = run(get_plan("zero-infinity"), "overlap", tmp_path / "overlap", device="cpu")
    finally:
        torch.set_num_threads(old)
    assert_same(got[1:], want[1:])
    cores = sorted(os.sched_getaffinity(0))
    assert pinned.pop("tensorstow-gpu0.compute") == {cores[0]}
    assert pinned and all(c == set(cores[1:]) for c in pinned.values()), pinned


def test_overlap_moves_other_threads_off_the_compute_core_during_a_step(tmp_path, monkeypatch):
    """The threads that work for the lanes are started elsewhere (the checksum and sync pools and
    the aio engine's workers: by the store, in the main thread) and, left with every core, run on
    the compute lane's. During an overlap step on a CPU device tier with a
    core to spare, every thread but the main thread and the compute lane runs on the other lanes'
    cores; after the step each has its own affinity back."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to keep for the compute lane (overlap mode does not pin)")
    stop = threading.Event()
    bystander = threading.Thread(target=stop.wait, name="a thread of the user's")
    bystander.start()
    during: dict[str, set] = {}
    real = Runtime.dispatch

    def dispatch(self, ins):
        if ins.kind == "compute":  # the last one seen: every helper has started by then
            during.clear()
            names = {t.native_id: t.name for t in threading.enumerate()}
            for e in os.scandir("/proc/self/task"):  # the native ones too (the aio engine's workers)
                tid = int(e.name)
                if tid != threading.main_thread().native_id:
                    with contextlib.suppress(ProcessLookupError):  # it ended since the listing
                        during[names.get(tid, f"native thread {tid}")] = os.sched_getaffinity(tid)
        return real(self, ins)

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(Runtime, "dispatch", dispatch)
    try:
        run(get_plan("zero-infinity"), "overlap", tmp_path, device="cpu")  # also on a machine with a GPU
        after = os.sched_getaffinity(bystander.native_id)
    finally:
        torch.set_num_threads(old)
        stop.set()
        bystander.join()
    assert during.pop("tensorstow-gpu0.compute") == {cores[0]}
    assert during["a thread of the user's"] == set(cores[1:])
    assert any(n.startswith("tensorstow-ssd") for n in during), sorted(during)
    assert all(c == set(cores[1:]) for c in during.values()), during
    assert after == set(cores)



@pytest.mark.parametrize("schedule", ["constant_with_warmup", "linear", "cosine"])
def test_learning_rate_schedules_equal_transformers(schedule, tmp_path):
    """Each update's rate follows the schedule as transformers' schedulers drive torch.optim (2
    warmup steps over 6; cosine down to 0.1 of the peak): an offloaded plan with its state on SSD
    trains bit for bit like eager with that scheduler."""
    transformers = pytest.importorskip("transformers")
    from tensorstow.executor.lr import LRSchedule
    steps, warmup = 6, 2
    data = list(batches("synthetic", B, T, VOCAB, steps, seed=0))
    make = {"constant_with_warmup": lambda o: transformers.get_constant_schedule_with_warmup(o, warmup),
            "linear": lambda o: transformers.get_linear_schedule_with_warmup(o, warmup, steps),
            "cosine": lambda o: transformers.get_cosine_with_min_lr_schedule_with_warmup(o, warmup, steps,
                                                                                      min_lr_rate=0.1)}[schedule]
    sched = LRSchedule(schedule, 1e-3, warmup, steps, 0.1 if schedule == "cosine" else 0.0)
    torch.manual_seed(0)
    ex = Executor(get_plan("zero-infinity"), GPT(PRESETS["gpt-tiny"]), state_dir=tmp_path / "s", lr_schedule=sched)
    rates, losses = [], []
    for x, y in data:
        losses.append(ex.step(x, y))
        rates.append(ex.lr)
    got = (losses, ex.parameters())
    ex.close()
    torch.manual_seed(0)
    want = train_eager(GPT(PRESETS["gpt-tiny"]), data, lr=1e-3, weight_decay=0.1, scheduler=make)
    assert_same(got, want)
    assert rates[0] == 0.0 and len(set(rates)) > 2


def test_a_resumed_run_continues_the_schedule(tmp_path):
    """Three steps, then a new executor resuming from the SSD store for three more, equal six
    steps in one: the rate follows the updates the store committed."""
    transformers = pytest.importorskip("transformers")
    from tensorstow.executor.lr import LRSchedule
    from tensorstow.executor.ssd import SSDStore
    from tensorstow.executor.statedir import store_sizes
    plan = get_plan("zero-infinity")
    data = list(batches("synthetic", B, T, VOCAB, 6, seed=0))
    sched = LRSchedule("cosine", 1e-3, 2, 6)
    losses = []
    for part, resume in ((data[:3], False), (data[3:], True)):
        torch.manual_seed(0)
        store = SSDStore(tmp_path / "s", store_sizes(plan))
        ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), ssd_store=store, resume=resume, lr_schedule=sched)
        losses += [ex.step(x, y) for x, y in part]
        params = ex.parameters()
        ex.close()
    torch.manual_seed(0)
    want = train_eager(GPT(PRESETS["gpt-tiny"]), data, lr=1e-3, weight_decay=0.1,
                       scheduler=lambda o: transformers.get_cosine_schedule_with_warmup(o, 2, 6))
    assert_same((losses, params), want)


def test_a_model_named_by_a_string_is_built_as_execute_builds_it(tmp_path):
    """`Executor(plan, "gpt-tiny")`: the preset built on the meta device and its initial values
    streamed into the tiers, the weights `torch.manual_seed(0); GPT(config)` gives: trains as eager."""
    ex = Executor(get_plan("zero-infinity"), "gpt-tiny", state_dir=tmp_path / "s")
    losses = [ex.step(x, y) for x, y in batches("synthetic", B, T, VOCAB, STEPS, seed=0)]
    assert_same((losses, ex.parameters()), eager())
    ex.close()
    with pytest.raises(TensorstowError, match="init_values is for a model object"):
        Executor(get_plan("zero-infinity"), "gpt-tiny", state_dir=tmp_path / "t", init_values={})

def test_adam_with_l2_weight_decay(tmp_path):
    o = dict(optimizer="adam")
    p = problem(**o)
    plan = plan_json(Decisions(policy="custom", blocks={b: BlockDecision(
        params="dram", states="dram", optimizer="cpu", activations="recompute" if b == "b1" else "keep",
        checkpoint="dram" if b == "b1" else "gpu") for b in p.order}), **o)
    _, losses, params = run(plan, "sync", tmp_path)
    assert_same((losses, params), eager(optimizer="adam"))


def test_device_budget_is_enforced(tmp_path, tmp_path_factory):
    ex, _, _ = sync_run("zero-infinity", tmp_path_factory)
    tight = ex.plan.to_json()
    pred = tight["predicted"]
    with pytest.raises(TensorstowError, match="does not fit"):  # a plan over its own capacity
        pred["capacity_bytes"]["gpu"] = pred["peak_bytes"]["gpu"] - 1
        executor(tight, tmp_path / "over")
    # a plan that claims to fit but needs one byte more than the device has while running
    pred["capacity_bytes"]["gpu"] = ex.peak_bytes["gpu"] - 1
    pred["peak_bytes"]["gpu"] = min(pred["peak_bytes"]["gpu"], pred["capacity_bytes"]["gpu"])
    ex2 = executor(tight, tmp_path / "tight")
    x, y = next(batches("synthetic", B, T, VOCAB, 1))
    with pytest.raises(DeviceMemoryError, match=r"instruction \d+ .*budget of"):
        ex2.step(x, y)


def test_compiled_segments_count_the_same_bytes_as_the_interpreter(tmp_path, monkeypatch):
    """The segments run as Python compiled for them (`Joint.run`); `Joint.interpret` walks the
    nodes, holding and releasing every value. Over a step of a plan with recomputed and offloaded
    blocks (views of fetched roots, multi-output ops, template instances), both count the same
    bytes on the device when each allocation is made, reach the same peak and end at the same
    count, with the same loss; the compiled run skips the holds of views (`_view_holders`)."""
    from tensorstow.executor import segments
    from tensorstow.executor.stores import DeviceTier
    log: list = []
    hold, release = DeviceTier.hold, DeviceTier.release

    def logged_hold(self, value, what=""):
        before = self.used
        hold(self, value, what)
        log.append(("hold", what, before, self.used))

    def logged_release(self, value):
        release(self, value)
        log.append(("release", self.used))
    monkeypatch.setattr(DeviceTier, "hold", logged_hold)
    monkeypatch.setattr(DeviceTier, "release", logged_release)
    x, y = next(batches("synthetic", B, T, VOCAB, 1, seed=0))
    runs = {}
    for way in ("interpret", "run"):
        if way == "interpret":
            monkeypatch.setattr(segments.Joint, "run", segments.Joint.interpret)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(DeviceTier, "hold", logged_hold)
            monkeypatch.setattr(DeviceTier, "release", logged_release)
        log.clear()
        ex = executor(get_plan("zero-infinity"), tmp_path / way)
        log.clear()  # the step's own accounting, not the executor's setup
        loss = ex.step(x, y)
        allocations = [e for e in log if e[0] == "hold" and e[3] != e[2]]
        runs[way] = (loss, allocations, ex.dev.peak, ex.dev.used, len(log))
        ex.close()
    interp, run = runs["interpret"], runs["run"]
    assert len(run[1]) > 100 and any(e[0] == "release" for e in log)
    assert run[:4] == interp[:4]
    assert run[4] < 0.8 * interp[4]  # the views' holds and releases are gone


def test_fingerprint_mismatch_is_refused(tmp_path):
    plan = json.loads(json.dumps(get_plan("all-gpu")))
    good = plan["model"]["fingerprint"]
    plan["model"]["fingerprint"] = "0123456789abcdef"
    with pytest.raises(TensorstowError) as e:
        Executor(plan, GPT(PRESETS["gpt-tiny"]))
    msg = str(e.value)
    assert "0123456789abcdef" in msg and good in msg and "re-plan" in msg


def test_plan_for_another_depth_is_refused():
    plan = json.loads(json.dumps(get_plan("all-gpu")))
    plan["model"]["layers"] = 40  # as if gpt-tiny had been planned as a 40-layer replicated trace
    with pytest.raises(TensorstowError, match="describes 40"):
        executor(plan)


def test_plan_missing_a_load_is_refused(tmp_path):
    plan = json.loads(json.dumps(get_plan("zero-infinity")))
    ins = next(i for i in plan["instructions"] if i["kind"] == "load" and i["tensor"] == "X:b2"
               and i["dst"] == "gpu0")
    ins["tensor"] = "X:b1"
    with pytest.raises(TensorstowError, match="missing a load"):
        executor(plan, tmp_path)


def test_a_value_crossing_segments_outside_the_plan_is_refused(tmp_path):
    """The gradient bwd:b2 hands to bwd:b1 is the planned buffer H:b2; a plan without it (an
    older tensorstow's) would have the executor keep bytes the simulator never counted."""
    plan = json.loads(json.dumps(get_plan("zero-infinity")))
    assert plan["buffers"]["H:b2"]["members"] and plan["buffers"]["H:b2"]["bytes"] > 0
    del plan["buffers"]["H:b2"]
    plan["instructions"] = [i for i in plan["instructions"] if i.get("tensor") != "H:b2"]
    for k, i in enumerate(plan["instructions"]):  # renumber: ids are positions
        i["allocs"] = [a for a in i.get("allocs", ()) if a != "H:b2"]
    old_ids = {i["id"]: k for k, i in enumerate(plan["instructions"])}
    for k, i in enumerate(plan["instructions"]):
        i["id"], i["deps"] = k, sorted(old_ids[d] for d in i["deps"] if d in old_ids)
    with pytest.raises(TensorstowError, match=r"compute bwd:b1\) reads \w+, which is made by instruction \d+ "
                                              r"but held by no buffer of the plan"):
        executor(plan, tmp_path)


def test_ssd_plan_needs_a_state_dir():
    with pytest.raises(TensorstowError, match="state_dir"):
        executor(get_plan("zero-infinity"))


def test_file_store_round_trip_and_commit(tmp_path):
    s = FileStore(tmp_path)
    assert s.committed_step() is None
    a = torch.arange(10, dtype=torch.float32)
    s.write("P:b0", a)
    out = torch.empty(10, dtype=torch.float32)
    s.read("P:b0", out)
    assert torch.equal(a, out)
    s.commit(3)
    assert FileStore(tmp_path).committed_step() == 3
    with pytest.raises(TensorstowError, match="never written"):
        s.read("OS:b0", out)


def test_batches_synthetic_and_files(tmp_path):
    a = list(batches("synthetic", 2, 4, 50, 3, seed=1))
    b = list(batches("synthetic", 2, 4, 50, 3, seed=1))
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    toks = np.arange(100, dtype=np.uint16)
    toks.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "train.npy", toks.astype(np.int64))
    for f in ("train.bin", "train.npy"):
        (x0, y0), (x1, y1) = batches(str(tmp_path / f), 2, 4, 200, 2)
        assert x0.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]] and y0.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]
        assert x1[0].tolist() == [10, 11, 12, 13] and x1.dtype == torch.long
    with pytest.raises(TensorstowError, match="holds 100 tokens"):
        list(batches(str(tmp_path / "train.bin"), 4, 9, 200, 5))
    with pytest.raises(TensorstowError, match="does not exist"):
        list(batches(str(tmp_path / "nope.bin"), 2, 4, 200, 1))
    (tmp_path / "my.txt").write_text("plain text is not token ids\n" * 20)
    with pytest.raises(TensorstowError, match=r"is text, not token ids: write it as JSONL"):
        list(batches(str(tmp_path / "my.txt"), 2, 4, 30000, 1))
    with pytest.raises(TensorstowError, match="vocabulary"):
        list(batches(str(tmp_path / "train.bin"), 2, 4, 10, 2))


@pytest.mark.parametrize("name", ["zero-infinity", "deferred"])
def test_resume_from_the_ssd_store(name, tmp_path, tmp_path_factory):
    """Two steps, a new executor resuming from the committed step, one more step: the same
    parameters as three uninterrupted steps. With deferred write-backs the second step is
    committed by `checkpoint()` (the third would commit it), which writes the carried buffers
    home first."""
    plan = get_plan(name)
    data = list(batches("synthetic", B, T, VOCAB, STEPS, seed=0))
    first = executor(plan, tmp_path)
    for x, y in data[:2]:
        first.step(x, y)
    if first.carried:
        assert first.ssd.store.committed_step() == 1
        assert first.checkpoint() and first.ssd.store.committed_step() == 2
    first.close()
    with pytest.raises(TensorstowError, match="resume=True"):
        executor(plan, tmp_path)
    torch.manual_seed(1)  # a differently initialized model: its values must not be used
    ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), state_dir=tmp_path, resume=True, traced=tiny_trace())
    assert ex.steps_done == 2
    loss = ex.step(*data[2])
    _, losses, params = sync_run(name, tmp_path_factory)
    assert_same(([loss], ex.parameters()), (losses[2:], params))


@pytest.mark.parametrize("precision,deferred", [("bf16-mixed", False), ("fp16-mixed", False), ("bf16-mixed", True)],
                         ids=["bf16", "fp16", "bf16-deferred"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_mixed_precision_matches_eager_autocast(precision, deferred, exact, tmp_path):
    """Eager AMP is the reference: fp32 parameters, the forward under autocast (CUDA's op lists:
    matmuls in 16 bits, layer norms, softmax and the loss in fp32), torch's AdamW on the fp32
    parameters, and for fp16 a GradScaler. The executor keeps fp32 masters M, 16-bit compute
    copies P of the weights autocast casts (norm weights and embeddings stay fp32), and every
    tier and optimizer device in one plan. Exact: bit-identical. Fast (the fused kernel, which
    also writes P in its pass): within `assert_close_to_eager`'s tolerance. `deferred`: the
    write-backs of b0 and b3 (M, OS and b3's P on SSD) run at the start of the next step."""
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="custom", batch=B, seq=T,
                precision=precision, lr=1e-3, weight_decay=0.1, gpu_mem=4_000_000, exact_optimizer=exact)
    p = build_problem(o, load_hardware(o.hardware).with_overrides(gpu_mem=o.gpu_mem))
    dec = Decisions(policy="custom", overlap_optimizer=True, blocks={b: BlockDecision(
        params="gpu" if b in ("pre", "b1") else ("ssd" if b == "b2" or deferred and b == "b3" else "dram"),
        states="ssd" if b in ("b0", "b3") else ("dram" if b == "post" else "gpu"),
        optimizer="cpu" if b in ("b0", "b3") else "gpu",
        activations={"b0": "recompute", "b2": "swap_dram", "b3": "swap_ssd"}.get(b, "keep"),
        checkpoint="dram" if b == "b0" else "gpu") for b in p.order},
        deferred_writes=("b0", "b3") if deferred else ())
    sched = schedule(p, dec)
    if deferred:  # the carried copies go home first (b0's P lives in DRAM)
        commit = next(i.id for i in sched.instructions if i.kind == "commit")
        assert sorted(i.tensor for i in sched.instructions[:commit] if i.kind == "store") == \
            ["M:b0", "M:b3", "OS:b0", "OS:b3", "P:b3"]
    assert_fits(sched)
    plan = json.loads(sched.dumps())
    dtypes = {t.dtype for t in p.graph.tensors if t.kind == "parameter" and t.producer is None}
    assert dtypes == {"float32", {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[precision]}

    torch.manual_seed(0)
    model = GPT(PRESETS["gpt-tiny"])
    traced = trace(model, batch=B, seq=T, precision=precision, model_name="gpt-tiny")
    ref = train_eager(model, batches("synthetic", B, T, VOCAB, STEPS, seed=0), lr=1e-3, weight_decay=0.1,
                      precision=precision)
    for mode in ("sync", "overlap"):
        torch.manual_seed(0)
        budget = o.gpu_mem  # the plan's own capacity in both modes (memory fences)
        ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), mode=mode, state_dir=tmp_path / mode, traced=traced,
                      device_budget=budget)
        losses = [ex.step(x, y) for x, y in batches("synthetic", B, T, VOCAB, STEPS, seed=0)]
        if exact:
            assert_same((losses, ex.parameters()), ref)
        else:
            assert_close_to_eager((losses, ex.parameters()), ref, lr=1e-3, precision=precision)
        assert ex.peak_bytes["gpu"] <= budget
        assert_device_accounting_balanced(ex)


def test_fp16_loss_scaling_skips_exactly_the_steps_grad_scaler_skips(tmp_path):
    """An initial scale of 2^20 overflows fp16 gradients: GradScaler skips the first three
    steps (halving the scale), grows it after two clean ones, and overflows once more. The
    executor must skip the same steps (Adam's step count included), follow the same scale, end
    bit-identical, and leave the SSD-resident masters and moments untouched by a skipped step."""
    steps, lr = 8, 1e-3
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="lohan", batch=B, seq=T,
                precision="fp16-mixed", lr=lr, exact_optimizer=True, init_scale=2.0 ** 20, growth_interval=2)
    plan = make_plan(o, load_hardware(o.hardware)).to_plan()
    assert any(b.home == "ssd" for n, b in plan.buffers.items() if n.startswith(("M:", "OS:")))
    data = list(batches("synthetic", B, T, VOCAB, steps, seed=0))
    torch.manual_seed(0)
    scales = []
    ref = train_eager(GPT(PRESETS["gpt-tiny"]), data, lr=lr, precision="fp16-mixed",
                      scaler=dict(init_scale=2.0 ** 20, growth_interval=2, scales=scales))
    skipped_ref = [s < prev for prev, s in zip([2.0 ** 20] + scales, scales)]
    assert skipped_ref[:3] == [True] * 3 and not all(skipped_ref)  # the run this test is about

    torch.manual_seed(0)
    store = FileStore(tmp_path)
    ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), ssd_store=store)
    states = sorted(store.root.glob("M-*.bin")) + sorted(store.root.glob("OS-*.bin"))
    assert states
    losses, got_scales, skipped = [], [], []
    for x, y in data:
        before = [f.read_bytes() for f in states]
        taken = ex.opt_steps
        losses.append(ex.step(x, y))
        got_scales.append(ex.loss_scale)
        skipped.append(ex.opt_steps == taken)
        if skipped[-1]:
            assert [f.read_bytes() for f in states] == before
    assert got_scales == scales
    assert skipped == skipped_ref
    assert_same((losses, ex.parameters()), ref)


def test_fp16_loss_scaler_state_is_checkpointed_and_resumed(tmp_path):
    """A checkpointed fp16 run resumed after 3 of 6 steps (overflowing, skipping and growing
    steps on both sides) ends bit-identical to the uninterrupted run, loss scale included; a
    store with no room for the scaler trains, and refuses to resume with the fix named."""
    from tensorstow.executor.ssd import SSDStore
    from tensorstow.executor.statedir import store_sizes
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="lohan", batch=B, seq=T, precision="fp16-mixed",
                lr=1e-3, exact_optimizer=True, init_scale=2.0 ** 20, growth_interval=2)
    plan = make_plan(o, load_hardware(o.hardware)).to_plan()
    data = list(batches("synthetic", B, T, VOCAB, 6, seed=0))

    def run(d, steps, resume=False, sizes=None):
        torch.manual_seed(0)
        store = SSDStore(d, sizes or store_sizes(plan))
        ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), ssd_store=store, resume=resume)
        out = [ex.step(x, y) for x, y in data[ex.steps_done:steps]], ex.loss_scale, ex.opt_steps, ex.parameters()
        ex.close()
        return out

    losses, scale, taken, params = run(tmp_path / "whole", 6)
    first, _, _, _ = run(tmp_path / "cut", 3)
    rest, scale2, taken2, params2 = run(tmp_path / "cut", 6, resume=True)
    assert first + rest == losses and (scale2, taken2) == (scale, taken) and 0 < taken < 6
    assert all(torch.equal(params2[n], params[n]) for n in params)

    run(tmp_path / "small", 2, sizes=plan.ssd_sizes())  # no AMP (nor RNG) in this store: trains
    with pytest.raises(TensorstowError, match="store_sizes|full checkpoint"):
        run(tmp_path / "small", 4, resume=True, sizes=plan.ssd_sizes())


def test_a_failed_fp16_step_does_not_make_the_next_one_skip(tmp_path):
    """The scaler's inf/NaN flag of a step that raised half-way is not carried into the next."""
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="all-gpu", batch=B, seq=T, precision="fp16-mixed")
    plan = make_plan(o, load_hardware(o.hardware)).to_plan()
    torch.manual_seed(0)
    ex = Executor(plan, GPT(PRESETS["gpt-tiny"]))
    x, y = next(iter(batches("synthetic", B, T, VOCAB, 1, seed=0)))
    ex.step(x, y)
    assert ex.opt_steps == 1
    ex.scaler.found_inf.fill_(1.0)  # what a step that failed after an overflowing backward leaves
    ex.scaler.skip()
    ex.step(x, y)
    assert ex.opt_steps == 2 and ex.loss_scale == 65536.0


def assert_close_to_eager(got, want, *, lr: float, precision: str = "fp32") -> None:
    """The fast optimizer's tolerance. It differs from torch's single-tensor AdamW only in the
    rounding of sqrt (correctly rounded vs MKL's, 1 ulp apart for some inputs), so the first
    step's parameters differ by at most an ulp; later steps see slightly different gradients.
    Adam bounds every element's move by about lr per step (|m^/(sqrt(v^)+eps)| <~ 1), so however
    that difference propagates, a parameter stays within a small fraction of one step's move:
    atol = lr / 10 per step. Not so where the gradient is zero but for rounding (`_noise_gradients`:
    attention's key bias, which softmax cannot see): Adam scales that noise to a full step of
    either sign, so two runs may part by up to 2 lr a step there. Losses: a relative 1e-5 in fp32
    (sums of ~1e4 terms). With 16-bit compute copies, a master an ulp apart can round to the
    neighbouring 16-bit value (2^-8 apart in bf16), and the loss moves with the weights that
    flip: which flip depends on the CPU's sqrt kernel (AVX2's gave a relative 7.8e-5 in bf16), so
    a relative 1e-3, ten times under the 1% eager autocast is held to elsewhere."""
    (gl, gp), (wl, wp) = got, want
    assert gl == pytest.approx(wl, rel=1e-5 if precision == "fp32" else 1e-3)
    assert gp.keys() == wp.keys()
    noise = _noise_gradients(precision)
    for n in wp:
        atol = torch.where(noise[n], 2 * lr, lr / 10) * STEPS if n in noise else lr / 10 * STEPS
        assert ((gp[n] - wp[n]).abs() <= atol).all(), f"{n}: {(gp[n] - wp[n]).abs().max().item()}"


@functools.lru_cache(maxsize=None)
def _noise_gradients(precision: str) -> dict[str, torch.Tensor]:
    """Per parameter of gpt-tiny, the elements whose first eager gradient is rounding noise
    (below 1e-4 of the tensor's largest): the key projection's bias, whose exact gradient is zero
    (adding it shifts every score of a query's row alike, and softmax is blind to that)."""

    from tensorstow.ir.autocast import gpu_autocast
    from tensorstow.ir.trace import PRECISIONS
    torch.manual_seed(0)
    model = GPT(PRESETS["gpt-tiny"])
    x, y = next(iter(batches("synthetic", B, T, VOCAB, 1, seed=0)))
    with gpu_autocast(PRECISIONS[precision]) if precision != "fp32" else contextlib.nullcontext():
        loss = model(x, y)
    loss.backward()
    return {n: p.grad.abs() <= 1e-4 * p.grad.abs().max() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["zero-infinity", "swap-gpuopt", "partial-swap", "interleaved"])
def test_fast_optimizer_is_the_default_and_close_to_eager(name, tmp_path):
    """Without exact_optimizer, CPU and device-tier subgroups run the fused kernel
    (executor.adam: csrc/adam.cpp, or torch's fused AdamW): close to eager, not bit-identical."""
    plan = json.loads(json.dumps(get_plan(name)))
    plan["options"]["exact_optimizer"] = False
    ex, losses, params = run(plan, "sync", tmp_path)
    assert all(not a.exact for a in ex.adam.values())
    assert_close_to_eager((losses, params), eager(), lr=1e-3)
    assert any(not torch.equal(params[n], eager()[1][n]) for n in params)  # it is the other path


def test_pinned_host_copies_are_accounted_at_the_caching_allocators_size():
    from tensorstow.executor.stores import HostTier
    pinned, plain = HostTier(pin=True), HostTier(pin=False)
    assert [pinned.footprint(n) for n in (0, 1, 4096, 4097, 3 * 2**20)] == [0, 1, 4096, 8192, 4 * 2**20]
    assert plain.footprint(4097) == 4097


@pytest.mark.parametrize("mode", ["sync", "overlap"])
@pytest.mark.parametrize("name", ["zero-infinity", "swap-gpuopt", "partial-swap", "interleaved"])
def test_dram_tier_is_one_preallocated_pool_reused_every_step(name, mode, tmp_path):
    """Every DRAM copy is a range of one arena, as large as the plan's `pools` say for the mode,
    allocated before the first step; in sync mode a further step takes and gives back the same
    ranges and allocates nothing (overlap mode's lanes may order their allocations unlike the
    simulated replay the arena was sized for)."""
    ex, _, _ = run(get_plan(name), mode, tmp_path)
    pool, plan = ex.pool, ex.plan
    sizes = plan.pools["gpu0"]
    assert pool.size == (sizes.sync if mode == "sync" else sizes.overlap) > 0
    lo = pool.arena.data_ptr()
    held = {n: c.blob.data_ptr() for n, c in ex.host.copies.items()}  # DRAM homes (none if all on SSD)
    assert all(lo <= p < lo + pool.size for p in held.values())
    assert pool.high_water > 0
    if mode == "overlap":
        return
    assert pool.overflow_bytes == 0  # every copy of the steps came from the arena
    free = [list(r) for r in pool.free]
    x, y = next(iter(batches("synthetic", B, T, VOCAB, 1, seed=5)))
    ex.step(x, y)
    assert pool.overflow_bytes == 0
    assert [list(r) for r in pool.free] == free
    assert {n: c.blob.data_ptr() for n, c in ex.host.copies.items()} == held


def test_the_dram_arena_is_what_the_plan_says(tmp_path):
    """The executor takes the arena's size from the plan, never from a replay of its own: a
    hand-edited `pools` entry is what it allocates, and a step that the smaller arena cannot
    hold takes the rest from fresh allocations (counted) and still trains as eager does."""
    plan = copy.deepcopy(get_plan("zero-infinity"))
    need = plan["pools"]["gpu0"]["sync"]
    plan["pools"]["gpu0"]["sync"] = 8 * 4096
    ex, losses, params = run(plan, "sync", tmp_path)
    assert ex.pool.size == 8 * 4096 < need
    assert ex.pool.overflow_bytes > 0
    assert_same((losses, params), eager())
    plan["pools"]["gpu0"]["sync"] = need + 10 * 4096 + 1
    assert executor(plan, tmp_path / "again").pool.size == need + 11 * 4096  # whole pages


def test_a_copy_the_pool_has_no_room_for_waits_while_another_lane_runs():
    """Overlap mode: a lane whose copy finds no free range long enough waits until another lane
    gives one back (the range it gets is the arena's, nothing allocated outside it); where every
    lane has stalled, no range can come back, and the pool says so at once."""
    import threading

    from tensorstow.executor.stores import HostPool, RoomWait
    pool = HostPool(2 * 4096)
    off, _ = pool.take(2 * 4096)
    room = RoomWait(lanes=2)  # this thread and the waiter
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.take(4096, room)))
    waiter.start()
    while room.stalled == 0:  # the waiter found no room and waits
        threading.Event().wait(0.001)
    assert waiter.is_alive() and not got
    pool.give(off, 2 * 4096)
    waiter.join()
    assert got[0] is not None and got[0][0] == 0
    assert pool.room_wait_s > 0 and room.stalled == 0
    alone = RoomWait(lanes=1)  # the asking lane is the only one: nothing can free a range
    assert pool.take(2 * 4096, alone) is None and alone.stalled == 0


def test_overlap_mode_trains_as_eager_when_its_arena_is_too_small(tmp_path):
    """With an arena far smaller than the step needs, overlap mode's copies wait for room while
    another lane runs and are allocated outside the arena once every lane has stalled: the step
    ends (no lane waits forever) and trains as eager does."""
    plan = copy.deepcopy(get_plan("zero-infinity"))
    plan["pools"]["gpu0"]["overlap"] = 8 * 4096
    ex, losses, params = run(plan, "overlap", tmp_path)
    assert ex.pool.size == 8 * 4096 and ex.pool.overflow_bytes > 0
    assert_same((losses, params), eager())


def test_a_plan_without_this_gpus_pool_is_refused(tmp_path):
    plan = copy.deepcopy(get_plan("zero-infinity"))
    plan["pools"] = {"gpu1": plan["pools"]["gpu0"]}
    with pytest.raises(TensorstowError, match="pools have no entry for gpu0; re-plan it"):
        executor(plan, tmp_path / "s")


def test_a_gpu_smaller_than_the_plans_is_refused_with_both_named(monkeypatch):
    """On CUDA the executor checks the machine against the plan before placing anything: GPU
    count and gpu0's memory. (Checked here with torch.cuda's answers replaced: no GPU needed.)"""
    from types import SimpleNamespace

    from tensorstow.executor.cuda import check_device
    from tensorstow.schema.plan import Plan
    plan = Plan.from_json(get_plan("zero-infinity"))
    cap = plan.predicted.capacity_bytes["gpu"]
    need = cap + plan.hardware.spec.gpu.reserved_bytes  # the CUDA context and workspaces on top
    assert plan.hardware.spec.gpu.reserved_bytes > 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Tiny GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(total_memory=need))
    check_device(plan)  # exactly the plan's budget and the reserve: fine
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(total_memory=need - 1))
    with pytest.raises(TensorstowError, match=r"lohan-rtx4090: RTX 4090\) but cuda:0 here \(Tiny GPU\)"):
        check_device(plan)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(TensorstowError, match=r"runs on 1 GPU\(s\) .* but this machine has 0"):
        check_device(plan)


def test_glibc_malloc_is_tuned_unless_left_alone():
    """The executor keeps freed buffers for reuse (executor.malloc): set on glibc, and
    `--malloc default` leaves the allocator as it is."""
    import platform
    import subprocess
    import sys
    code = "import sys; from tensorstow.executor import malloc; malloc.setting = sys.argv[1]; print(malloc.tune(), malloc.tune())"
    out = {v: subprocess.run([sys.executable, "-c", code, v], capture_output=True, text=True, check=True).stdout.split()
           for v in ("tuned", "default")}
    glibc = platform.libc_ver()[0] == "glibc"
    assert out == {"tuned": [str(glibc)] * 2, "default": ["False", "False"]}


@pytest.mark.parametrize("mib", [24, 320])
def test_the_dram_tier_keeps_tunes_heap_reuse_for_buffer_sized_blocks(mib):
    """Guards against the DRAM tier pinning glibc's mmap threshold at 1 MiB after `tune()` has set
    it to 32 MiB, which maps, faults in and unmaps again each step every activation or device
    copy of 1-32 MiB the heap has no room for. With the DRAM tier built after `tune()`, a
    24 MiB block freed and allocated again comes from the heap: most of its pages stay (24,576
    faults for 20 rounds on a 2-core CPU VM, the heap's trim taking some back; 122,900, every page
    every time, with the threshold pinned). So does a 320 MiB one, more than the heap's top keeps
    free (`TOP_PAD`), which glibc mapped afresh each time above its 32 MiB threshold, every page
    faulted in again, until `tune()` turned its own mappings off (a QLoRA step's 96 MiB dequantized
    weights took 3.4x the dequantization's time where the heap had no room for them)."""
    import platform
    import subprocess
    import sys
    if platform.libc_ver()[0] != "glibc" or "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("glibc's malloc only: another allocator keeps its own settings")
    code = textwrap.dedent("""
        import resource, torch
        from tensorstow.executor.malloc import tune
        from tensorstow.executor.stores import HostPool, HostTier
        tune()  # as Executor.__init__ does, then its DRAM tier
        host = HostTier(pin=False, pool=HostPool(1 << 20))
        def churn(n):
            for _ in range(n):
                t = torch.empty(MIB << 18)
                t.fill_(1.0)
                del t
        churn(3)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        churn(20)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """).replace("MIB", str(mib))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    faults = int(out.stdout.split()[-1])
    every_page = 20 * (mib << 20) // 4096
    assert faults < every_page // 2, f"{faults} page faults for 20 reallocations of a {mib} MiB block"


def test_the_heap_keeps_what_a_step_frees_for_the_next_step():
    """Guards against glibc trimming the heap as a step frees its blocks: with `tune()`, eight 64
    MiB blocks allocated, written and freed together, 20 rounds, fault their pages in once. Trimmed
    whenever 128 MiB lay free at the heap's top, each round gave 256 MiB back and faulted it in again
    (1,310,720 faults, half of every page, on a 2-core VM), as a 3B QLoRA step faulted 2.1 GB a step
    and ran 1.1x slower."""
    import platform
    import subprocess
    import sys
    if platform.libc_ver()[0] != "glibc" or "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("glibc's malloc only: another allocator keeps its own settings")
    code = textwrap.dedent("""
        import resource, torch
        from tensorstow.executor.malloc import tune
        tune()
        small = [torch.empty(256) for _ in range(20000)]  # freed below the heap's top: where a step's
        del small                                         # small allocations then come from
        def step():
            blocks = [torch.empty(16 << 20) for _ in range(8)]  # 8 x 64 MiB, live together
            [b.fill_(1.0) for b in blocks]
            del blocks  # the heap's top now holds them: 512 MiB free
        step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):
            step()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    faults = int(out.stdout.split()[-1])
    every_page = 20 * 8 * (64 << 20) // 4096
    assert faults < every_page // 20, f"{faults} page faults for 20 rounds of 8 x 64 MiB blocks"


def test_freed_blocks_are_reused_across_steps_and_across_lane_threads():
    """After `tune()` a block a step frees is reused by the next step's allocation of its size:
    CPU tensors come from malloc aligned by hand (glibc before 2.38 leaves freed posix_memalign
    blocks with small allocations between them unused, bug 14581), and overlap mode's lane threads
    share one arena. Five rounds of four 24 MiB blocks with a small tensor kept between rounds
    stay about 96 MiB resident (410 MiB with torch's posix_memalign); four long-lived threads in
    turn doing the same, 122 MiB (386 MiB with an arena per thread)."""
    import platform
    import subprocess
    import sys
    if platform.libc_ver()[0] != "glibc" or "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("glibc's malloc only: another allocator keeps its own settings")
    code = textwrap.dedent("""
        import re, threading, torch
        from tensorstow.executor import malloc
        assert malloc.tune(), "tune() set nothing"
        print(malloc.allocator_status)
        def rss_mib():
            return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) >> 10
        kept = []
        def step():
            blocks = [torch.ones(6 << 20) for _ in range(4)]  # 4 x 24 MiB, under the mmap threshold
            assert all(b.data_ptr() % 64 == 0 for b in blocks)  # torch's alignment, kept
            kept.append(torch.ones(1000))  # a small allocation that outlives them
        before = rss_mib()
        for _ in range(5):
            step()
        print(rss_mib() - before)
        end = threading.Event()
        def lane(done):
            step()
            done.set()
            end.wait()  # lanes live on, as overlap mode's do
        before = rss_mib()
        threads = []
        for _ in range(4):
            done = threading.Event()
            threads.append(threading.Thread(target=lane, args=(done,)))
            threads[-1].start()
            done.wait()
        print(rss_mib() - before)
        end.set()
        for t in threads:
            t.join()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith("malloc, aligned by hand"), out[0]
    steps, lanes = int(out[1]), int(out[2])
    assert steps < 2 * 96, f"five steps' 96 MiB of blocks left {steps} MiB resident"
    assert lanes < 2 * 96, f"four lane threads' 96 MiB of blocks left {lanes} MiB resident"


def test_free_heap_goes_back_to_the_system_where_much_of_it_is_free():
    """`give_back_free_heap` returns the pages of freed heap blocks that small allocations keep
    from the heap's top (the forward's blocks, freed before the backward's large gradients are
    mapped beside them), and leaves a heap with little free alone. 768 MiB of 24 MiB blocks
    freed under kept small tensors: resident before and after."""
    import platform
    import subprocess
    import sys
    if platform.libc_ver()[0] != "glibc" or "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("glibc's malloc only: another allocator keeps its own settings")
    code = textwrap.dedent("""
        import re, torch
        from tensorstow.executor import malloc
        assert malloc.tune(), "tune() set nothing"
        print(malloc._libc is not None)
        def rss_mib():
            return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) >> 10
        print(malloc.give_back_free_heap())  # nothing much free yet
        blocks, kept = [], []
        for _ in range(32):  # 32 x 24 MiB, under the mmap threshold, each with a small tensor after it
            blocks.append(torch.ones(6 << 20))
            kept.append(torch.ones(1000))
        del blocks
        before = rss_mib()
        print(malloc.give_back_free_heap())
        print(before - rss_mib())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    if out[0] == "False":
        pytest.skip("this glibc lacks mallinfo2 / malloc_trim (before 2.33)")
    assert out[1:3] == ["False", "True"], out
    assert int(out[3]) > 512, f"768 MiB of free heap gave back only {out[3]} MiB"


def test_the_measured_ssd_lane_includes_the_stores_early_syncs(tmp_path):
    """The SSD store syncs each written file on its own thread as the write completes (the
    simulator prices that flush with the write, on the SSD): the executor's measured SSD lane
    counts those syncs, and the run trains as one without them does."""
    from tensorstow.executor.ssd import SSDStore
    from tensorstow.executor.statedir import store_sizes
    from tensorstow.schema.schedule import resource_of
    plan = get_plan("zero-infinity")
    data = list(batches("synthetic", B, T, VOCAB, 2, seed=0))
    runs = {}
    for early in (True, False):
        torch.manual_seed(0)
        store = SSDStore(tmp_path / f"early-{early}", store_sizes(plan), early_sync=early)
        ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), traced=tiny_trace(), ssd_store=store)
        losses = [ex.step(x, y) for x, y in data]
        instr_ssd = sum(t1 - t0 for i, t0, t1 in ex.timeline if resource_of(ex.instrs[i].stream) == "ssd")
        assert (ex.early_sync_s > 0) == early
        assert ex.lane_busy()["ssd"] == pytest.approx(instr_ssd + ex.commit_s + ex.early_sync_s)
        runs[early] = losses, ex.parameters()
        ex.close()
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(runs[True][1][n], runs[False][1][n]) for n in runs[True][1])
    # committing every second step: the step that does not commit does not sync early
    torch.manual_seed(0)
    store = SSDStore(tmp_path / "every-2", store_sizes(plan))
    ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), traced=tiny_trace(), ssd_store=store, checkpoint_every=2)
    synced = []
    for x, y in data:
        ex.step(x, y)
        synced.append(ex.early_sync_s)
    assert synced[0] == 0 < synced[1] and store.committed_step() == 2
    ex.close()


def test_the_measured_ssd_lane_includes_the_steps_commit(tmp_path, monkeypatch):
    """The simulator counts the store's commit on the SSD (cost.commit_time), so the executor's
    measured SSD lane counts it too (with the store's early syncs): without it measured/predicted
    per lane compares different things (gpt-medium's SSD lane reads 0.25x)."""
    plan = get_plan("zero-infinity")
    ex = executor(plan, tmp_path)
    real_commit = ex.ssd.store.commit

    def slow_commit(step, **kw):
        time.sleep(0.05)  # a commit long enough to see next to the instructions' own time
        real_commit(step, **kw)

    monkeypatch.setattr(ex.ssd.store, "commit", slow_commit)
    x, y = next(iter(batches("synthetic", B, T, VOCAB, 1, seed=0)))
    ex.step(x, y)
    from tensorstow.schema.schedule import resource_of
    instr_ssd = sum(t1 - t0 for i, t0, t1 in ex.timeline if resource_of(ex.instrs[i].stream) == "ssd")
    assert ex.commit_s >= 0.05
    assert ex.lane_busy()["ssd"] == pytest.approx(instr_ssd + ex.commit_s + ex.early_sync_s)
    ex.close()


def test_a_steps_own_swaps_to_ssd_are_not_synced_and_it_still_trains_like_eager(tmp_path, monkeypatch):
    """Activations a step swaps to SSD and reads back are not its training state: the store marks
    them transient (`SSDStore.set_transient`), so neither their early syncs nor the commit flush
    them (the cost model prices their writes without the flush), while P and the Adam states are
    synced as before; the run equals eager PyTorch."""
    from tensorstow.executor.ssd import SSDStore
    from tensorstow.executor.statedir import store_sizes
    from tensorstow.schema.plan import as_plan
    plan = get_plan("interleaved")
    p = as_plan(plan)
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    torch.manual_seed(0)
    store = SSDStore(tmp_path / "st", store_sizes(p))
    ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), ssd_store=store)
    losses = [ex.step(x, y) for x, y in batches("synthetic", B, T, VOCAB, STEPS, seed=0)]
    assert_same((losses, ex.parameters()), eager())
    by_fd = {fd: n for n, b in store._bufs.items() for fd in b.fds}
    names = {by_fd[fd] for fd in synced if fd in by_fd}
    transient = {n for n, b in store._bufs.items() if b.transient}
    assert transient == {n for n in p.ssd_sizes() if not p.buffers[n].home} and "A:b3" in transient
    assert names and not names & transient  # the state's files were synced, the swaps' never
    assert {n for n in names if n.startswith(("P:", "OS:"))}
    ex.close()


def test_a_plan_whose_copies_wait_for_room_trains_exactly_like_eager(tmp_path):
    """stronghold's plan for gpt-tiny in 1.2 MB of device memory on the probed VM spec of
    tests/test_plan.py is over capacity where nothing waits (1.29 MB); its copies wait for room
    and the waits are dependencies. Run in overlap mode, where memcpys are far faster than that
    spec's links: the same losses and parameters as eager, within the plan's device budget."""
    from tensorstow.schema.hardware import Hardware
    from tensorstow.planner.plan import policy_plan
    from tests.test_plan import _PROBED_VM
    o = Options(model="gpt-tiny", hardware="x", policy="stronghold", batch=B, seq=T, precision="fp32", lr=1e-3,
                weight_decay=0.1, exact_optimizer=True, gpu_mem=1_200_000)
    hw = Hardware.from_json(_PROBED_VM).with_overrides(gpu_mem=o.gpu_mem, ssds=1)
    pl = policy_plan(build_problem(o, hw), "stronghold")
    assert pl.fits and pl.over_unless_waiting.get("gpu", (0, 0))[0] > 1_200_000
    ex, losses, params = run(json.loads(pl.dumps()), "overlap", tmp_path, device_budget=1_200_000)
    assert_same((losses, params), eager())
    assert ex.peak_bytes["gpu"] <= 1_200_000


@pytest.mark.parametrize("precision", ["fp16-mixed", "bf16-mixed"])
def test_clipping_under_mixed_precision_matches_eager_amp(precision, tmp_path):
    """`max_grad_norm` with eager AMP's order: the norm of the unscaled fp32 gradients
    (GradScaler.unscale_, then clip_grad_norm_), the clipped update, and for fp16 the steps whose
    gradients overflow (a first scale of 2^20 overflows until it backs off) skipped with their norm
    inf: losses, norms and weights bit-identical with the exact optimizer, through an SSD plan."""
    steps = 6
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="lohan", batch=B, seq=T, precision=precision,
                lr=1e-3, gpu_mem=1_000_000, exact_optimizer=True, max_grad_norm=0.5, init_scale=2.0 ** 20)
    plan = json.loads(make_plan(o, load_hardware(o.hardware).with_overrides(gpu_mem=o.gpu_mem)).dumps())
    assert any(b["home"] == "ssd" for b in plan["buffers"].values())
    data = list(batches("synthetic", B, T, VOCAB, steps, seed=0))
    torch.manual_seed(0)
    want_norms = []
    ref = train_eager(GPT(PRESETS["gpt-tiny"]), data, lr=1e-3, precision=precision,
                      scaler={"init_scale": 2.0 ** 20} if precision == "fp16-mixed" else None,
                      max_grad_norm=0.5, norms=want_norms)
    torch.manual_seed(0)
    ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), state_dir=tmp_path / "s")
    losses, norms = [], []
    for x, y in data:
        losses.append(ex.step(x, y))
        norms.append(ex.grad_norm)
    assert_same((losses, ex.parameters()), ref)
    assert norms == want_norms
    if precision == "fp16-mixed":
        assert math.isinf(norms[0]) and not math.isinf(norms[-1])  # overflow steps, then clipped ones
    assert max(n for n in norms if not math.isinf(n)) > 0.5
    ex.close()


def test_a_plain_directory_as_data_is_named_as_not_a_datasets_directory(tmp_path):
    """A directory that `datasets` did not write, passed as data: one error saying so (it was
    reported as a file that "does not exist")."""
    pytest.importorskip("datasets")
    from tensorstow.executor.examples import read_records
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello\n")
    with pytest.raises(TensorstowError, match=r"not a directory `datasets` save_to_disk wrote"):
        read_records(str(tmp_path / "notes"))


def test_the_executor_takes_one_typed_config_or_its_fields_as_keywords(tmp_path):
    """`Executor(plan, model, ExecutorConfig(...))` and the same fields as keywords build the same
    executor (the same losses and weights, as eager's: test_matches_eager); a field the config
    does not have, or a config and keywords both, are TypeErrors."""
    import tensorstow
    plan = get_plan("zero-infinity")
    data = list(batches("synthetic", B, T, VOCAB, 2, seed=0))
    torch.manual_seed(0)
    by_config = tensorstow.Executor(plan, GPT(PRESETS["gpt-tiny"]), tensorstow.ExecutorConfig(
        mode="overlap", state_dir=tmp_path / "a", traced=tiny_trace()))
    torch.manual_seed(0)
    by_keywords = Executor(plan, GPT(PRESETS["gpt-tiny"]), mode="overlap", state_dir=tmp_path / "b", traced=tiny_trace())
    try:
        assert by_config.config == dataclasses.replace(by_keywords.config, state_dir=tmp_path / "a")
        assert [by_config.step(x, y) for x, y in data] == [by_keywords.step(x, y) for x, y in data]
        assert all(torch.equal(a, b) for a, b in zip(by_config.parameters().values(), by_keywords.parameters().values()))
    finally:
        by_config.close()
        by_keywords.close()
    with pytest.raises(TypeError, match="mdoe"):
        Executor(plan, GPT(PRESETS["gpt-tiny"]), mdoe="sync")
    with pytest.raises(TypeError, match="not both"):
        Executor(plan, GPT(PRESETS["gpt-tiny"]), tensorstow.ExecutorConfig(), mode="sync")
    with pytest.raises(TypeError, match="not both"):
        Executor(plan, GPT(PRESETS["gpt-tiny"]), "sync")


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_an_expanded_gradient_updates_as_eager_with_the_fast_cpu_adam(max_grad_norm, tmp_path):
    """`w.sum(0)` makes w's gradient an expanded view (stride 0): the fast CPU update read it as if
    it held an element per parameter (5 learning-rate steps off after 3), and clipping multiplied
    it in place ("more than one element ... refers to a single memory location")."""
    from tests.fixtures.user_models import expanded_gradient
    o = Options(model="tests.fixtures.user_models:expanded_gradient", hardware="lohan-rtx4090", policy="lohan",
                batch=2, seq=16, precision="fp32", lr=1e-3, gpu_mem=60_000, max_grad_norm=max_grad_norm)
    plan = make_plan(o, load_hardware("lohan-rtx4090").with_overrides(gpu_mem=60_000))
    assert {d.optimizer for d in plan.decisions.blocks.values()} == {"cpu"}
    data = list(batches("synthetic", 2, 16, 64, 3, seed=0))
    ex = Executor(plan, expanded_gradient(), state_dir=tmp_path / "state", mode="sync")
    try:
        got = [ex.step(x, y) for x, y in data]
        params = ex.parameters()
    finally:
        ex.close()
    kw = dict(max_grad_norm=max_grad_norm, norms=[]) if max_grad_norm else {}
    want, weights = train_eager(expanded_gradient(), data, lr=1e-3, **kw)
    assert got == pytest.approx(want, rel=1e-6)
    for n, w in weights.items():
        torch.testing.assert_close(params[n], w, rtol=1e-5, atol=1e-6, msg=n)
