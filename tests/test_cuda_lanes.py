"""The CUDA lanes' ordering protocol (executor.cuda.CudaLanes), checked on the CPU.

The executor runs a real plan on the CPU while its `CudaLanes` drive a stand-in for torch.cuda
that logs every stream, event and wait. From the log a happens-before check replays CUDA's
rules (a stream runs its work in order, `wait_event` orders a stream after an event, an event
`synchronize` orders the host after it) and asserts that every dependency of the plan is
ordered that way, with no synchronize per instruction. The same protocol drives real streams in
tests/test_executor_cuda.py on a machine with a GPU."""
import contextlib
import itertools
import threading
import time

import pytest
import torch

from tensorstow.executor.cuda import CudaLanes, on_host
from tests.test_executor import B, STEPS, T, VOCAB, assert_same, batches, eager, executor, get_plan

_tick = itertools.count()


class FakeStream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def wait_event(self, ev):  # what the event marks at the time of the wait
        self.cuda.log.append(("wait", next(_tick), self, ev.stream, ev.at))

    def wait_stream(self, other):
        self.cuda.log.append(("wait_stream", next(_tick), self, other))

    def synchronize(self):
        self.cuda.log.append(("stream_sync", next(_tick), self))


class FakeEvent:
    def __init__(self, cuda):
        self.cuda, self.stream, self.at, self.t = cuda, None, None, 0.0

    def record(self, stream):
        self.stream, self.at, self.t = stream, next(_tick), time.perf_counter()
        self.cuda.log.append(("record", self.at, stream, self))

    def synchronize(self):
        self.cuda.log.append(("host_wait", next(_tick), threading.get_ident(), self.stream, self.at))

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


class FakeCuda:
    """torch.cuda's stream and event API, logging what is asked of it."""

    def __init__(self):
        self.log, self._local = [], threading.local()
        self.main = FakeStream(self, "main")
        self.streams = []

    def Stream(self, device):
        s = FakeStream(self, f"s{len(self.streams)}")
        self.streams.append(s)
        return s

    def Event(self, enable_timing=False):
        return FakeEvent(self)

    def current_stream(self, device):
        return getattr(self._local, "s", self.main)

    @contextlib.contextmanager
    def stream(self, s):
        old = self.current_stream(None)
        self._local.s = s
        try:
            yield
        finally:
            self._local.s = old

    def synchronize(self, device=None):
        self.log.append(("device_sync", next(_tick)))

    def record_stream(self, t, s):
        self.log.append(("record_stream", next(_tick), t.untyped_storage().data_ptr(), s))


class Logged(CudaLanes):
    """Marks where each instruction's handler starts and ends: its thread and current stream."""

    def before(self, ins):
        super().before(ins)
        self.cuda.log.append(("run", next(_tick), ins.id, threading.get_ident(), self.cuda.current_stream(None)))

    def after(self, ins):
        self.cuda.log.append(("done", next(_tick), ins.id))
        super().after(ins)


def check_protocol(cuda: FakeCuda, instrs, steps: int, depth: int | None = CudaLanes.DEPTH) -> None:
    """CUDA's rules replayed on the log: every dependency of the plan is ordered (device work by
    a stream wait on the producer's event, host work by a host wait), lanes start after the
    step's inputs and the step joins them, and the host never waits where the GPU would idle.
    `depth`: the device instructions a lane keeps queued (overlap mode); None: no bound (sync
    mode), the host waits only before host work."""
    log = sorted(cuda.log, key=lambda e: e[1])
    runs = [e for e in log if e[0] == "run"]
    assert len(runs) == steps * len(instrs)
    starts = [e for e in log if e[0] == "record" and e[2] is cuda.main][::2]  # begin(), then end()'s join
    for k in range(steps):
        step = runs[k * len(instrs):(k + 1) * len(instrs)]
        lo, hi = step[0][1], step[-1][1]
        at = {e[2]: e for e in step}
        assert sorted(at) == [i.id for i in instrs]
        done = {}  # each instruction's end in this step: its first "done" after it runs
        for e in log:
            if e[0] == "done" and e[1] > at[e[2]][1]:
                done.setdefault(e[2], e[1])
        # each device instruction's end event: its stream's first record after it runs
        end = {}
        for i in instrs:
            if not on_host(i):
                _, t, _, _, s = at[i.id]
                end[i.id] = next(e for e in log if e[0] == "record" and e[1] > t and e[2] is s)
        waits = [e for e in log if e[0] == "wait"]
        host_waits = [e for e in log if e[0] == "host_wait"]
        start = starts[k]
        for s in {e[4] for e in step} - {cuda.main}:  # a lane's stream starts from the inputs
            first = min(e[1] for e in step if e[4] is s)
            assert any(w[2] is s and w[3] is cuda.main and w[4] == start[1] and w[1] < first for w in waits)
        for i in instrs:
            _, t, _, thread, s = at[i.id]
            for d in i.deps:
                if on_host(instrs[d]):  # host work has finished before anything that needs it starts
                    assert done[d] < t
                    continue
                ev = end[d]
                if not on_host(i):
                    if ev[2] is s:
                        continue  # one stream runs its work in order
                    assert any(w[2] is s and w[3] is ev[2] and w[4] >= ev[1] and ev[1] < w[1] < t
                               for w in waits), f"step {k}: device {i.id} does not wait for {d} on the GPU"
                else:
                    assert any(h[2] == thread and h[3] is ev[2] and h[4] >= ev[1] and h[1] < t
                               for h in host_waits), f"step {k}: host {i.id} does not wait for device {d}"
        # host waits: for the device work a host instruction reads, or (before enqueuing device
        # work) for an event with at least depth-1 more device instructions queued behind it
        for h in (h for h in host_waits if lo <= h[1] <= hi):
            nxt = min((e for e in step if e[3] == h[2] and e[1] > h[1]), key=lambda e: e[1])
            if on_host(instrs[nxt[2]]):
                continue
            assert depth is not None, f"step {k}: the host waits before enqueuing device instruction {nxt[2]}"
            behind = [e for e in log if e[0] == "record" and e[2] is h[3] and h[4] < e[1] < h[1]]
            assert len(behind) >= 2 * (depth - 1), f"step {k}: the GPU idles while instruction {nxt[2]} waits"
        # the join: the caller's stream waits for every lane stream, then the host for it
        joins = [e for e in log if e[0] == "wait_stream" and hi < e[1] < (runs[(k + 1) * len(instrs)][1]
                                                                           if k + 1 < steps else float("inf"))]
        assert {e[3] for e in joins} == set(cuda.streams) and all(e[2] is cuda.main for e in joins)
        assert any(h[3] is cuda.main and h[1] > max((e[1] for e in joins), default=hi) for h in host_waits)
    assert not any(e[0] in ("stream_sync", "device_sync") for e in log)


@pytest.mark.parametrize("name", ["zero-infinity", "interleaved"])
@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_lanes_order_every_dependency_by_events(name, mode, tmp_path):
    plan = get_plan(name)
    ex = executor(plan, tmp_path / "ssd", mode)
    cuda = FakeCuda()
    ex.lanes = Logged(ex.instrs, ex.device, overlap=mode == "overlap", cuda=cuda)
    losses = [ex.step(x, y) for x, y in batches("synthetic", B, T, VOCAB, STEPS, seed=0)]
    assert_same((losses, ex.parameters()), eager())  # the protocol changes no result
    check_protocol(cuda, ex.instrs, STEPS, depth=CudaLanes.DEPTH if mode == "overlap" else None)
    frees = [i for i in ex.instrs if i.kind == "free" and i.dst == "gpu0"]
    recorded = [e for e in cuda.log if e[0] == "record_stream"]
    if mode == "sync":  # one stream: the allocator's stream order is enough
        assert not recorded and not cuda.streams
    else:  # one stream per lane, kept across steps; a freed device copy is recorded on each
        assert len(cuda.streams) == len({i.stream for i in ex.instrs})
        assert frees and {e[3] for e in recorded} == set(cuda.streams)
    # the step's timings cover every instruction
    assert sorted(i for i, _, _ in ex.timeline) == [i.id for i in ex.instrs]
    assert all(t0 <= t1 for _, t0, t1 in ex.timeline)


def test_the_protocol_check_catches_a_missing_wait(tmp_path):
    """The check above fails when a cross-stream dependency is not waited for."""
    class Forgetful(Logged):
        def before(self, ins):
            deps = ins.deps
            if not on_host(ins) and ins.kind == "compute":
                object.__setattr__(ins, "deps", ())  # as if the plan had none
            try:
                super().before(ins)
            finally:
                object.__setattr__(ins, "deps", deps)

    plan = get_plan("zero-infinity")
    ex = executor(plan, tmp_path / "ssd", "overlap")
    cuda = FakeCuda()
    ex.lanes = Forgetful(ex.instrs, ex.device, overlap=True, cuda=cuda)
    ex.step(*next(iter(batches("synthetic", B, T, VOCAB, 1, seed=0))))
    with pytest.raises(AssertionError, match="does not wait for"):
        check_protocol(cuda, ex.instrs, 1)


def test_with_a_gpu_the_cpu_update_leaves_a_core_to_each_lane_that_drives_it(monkeypatch):
    """Overlap mode's CPU optimizer lane: with a GPU it runs on the cores the other lanes' host
    threads leave (each drives the GPU: launches, copies, SSD requests), at least one thread; on
    a CPU device tier, where `lane_cores` keeps the lanes apart, on all of the compute's threads."""
    from tensorstow.executor import lanes
    monkeypatch.setattr(lanes.os, "cpu_count", lambda: 16)
    streams = ["gpu0.compute", "gpu0.h2d", "gpu0.d2h", "cpu.opt"]
    assert lanes.optimizer_threads(torch.device("cuda"), 16, streams) == 13
    assert lanes.optimizer_threads(torch.device("cuda"), 8, streams) == 8
    assert lanes.optimizer_threads(torch.device("cuda"), 16, streams + ["ssd.read", "ssd.write"]) == 11
    assert lanes.optimizer_threads(torch.device("cpu"), 16, streams) == 16
    monkeypatch.setattr(lanes.os, "cpu_count", lambda: 2)
    assert lanes.optimizer_threads(torch.device("cuda"), 2, streams) == 1
