"""The CUDA lanes' ordering protocol (executor.cuda.CudaLanes), checked on the CPU.

The executor runs a real plan on the CPU while its `CudaLanes` drive a stand-in for torch.cuda
that logs every stream, event and wait. From the log a happens-before check replays CUDA's
rules (a stream runs its work in order, `wait_event` orders a stream after an event, an event
`synchronize` orders the host after it) and asserts that every dependency of the plan is
ordered that way, with no synchronize per instruction. The same protocol drives real streams in
tests/test_executor_cuda.py when a GPU is lent."""
import contextlib
import itertools
import threading
import time

import pytest

from tensorstow.executor.cuda import CudaLanes, on_host
from tests.test_executor import B, STEPS, T, VOCAB, assert_same, batches, eager, executor, get_plan

_tick = itertools.count()


class FakeStream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def wait_event(self, ev):
        self.cuda.log.append(("wait", next(_tick), self, ev))

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
        self.log, self.main, self._local = [], None, threading.local()
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
    """Marks where each instruction's handler runs: its thread, and (device work) its stream."""

    def before(self, ins):
        super().before(ins)
        self.cuda.log.append(("run", next(_tick), ins.id, threading.get_ident(), self.cuda.current_stream(None)))


def check_protocol(cuda: FakeCuda, instrs, steps: int) -> None:
    log = sorted(cuda.log, key=lambda e: e[1])
    runs = [e for e in log if e[0] == "run"]
    assert len(runs) == steps * len(instrs)
    per_step = len(instrs)
    for k in range(steps):
        step = runs[k * per_step:(k + 1) * per_step]
        lo, hi = step[0][1], step[-1][1]
        at = {e[2]: e for e in step}
        assert sorted(at) == [i.id for i in instrs]
        # each device instruction's end event: its stream's first record after it runs
        end = {}
        for i in instrs:
            if not on_host(i):
                _, t, _, _, s = at[i.id]
                end[i.id] = next(e for e in log if e[0] == "record" and e[1] > t and e[2] is s)
        waits = [e for e in log if e[0] == "wait" and e[1] <= hi + 1]
        host_waits = [e for e in log if e[0] == "host_wait" and e[1] <= hi + 1]
        for i in instrs:
            _, t, _, thread, s = at[i.id]
            for d in i.deps:
                if on_host(instrs[d]):  # host work is complete when its future is
                    assert at[d][1] < t
                    continue
                ev = end[d]
                if not on_host(i):
                    if ev[2] is s:
                        continue  # one stream runs its work in order
                    # the stream of i waits on d's end event (or a later one of d's stream) before i
                    assert any(w[2] is s and w[3].stream is ev[2] and w[3].at >= ev[1] and ev[1] < w[1] < t
                               for w in waits), f"step {k}: device {i.id} does not wait for {d} on the GPU"
                else:
                    assert any(h[2] == thread and h[3] is ev[2] and h[4] >= ev[1] and h[1] < t
                               for h in host_waits), f"step {k}: host {i.id} does not wait for device {d}"
        # no synchronize per instruction: the host waits only where host work needs device
        # results, plus once per lane when the step ends
        n_host_waits = sum(1 for h in host_waits if lo <= h[1] <= hi)
        budget = sum(1 + sum(not on_host(instrs[d]) for d in i.deps) for i in instrs if on_host(i))
        assert n_host_waits <= budget
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
    check_protocol(cuda, ex.instrs, STEPS)
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
