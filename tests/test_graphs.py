"""The step captured as a graph and replayed (executor.graphs), checked on the CPU.

`RecordedGraph` stands in for torch.cuda.CUDAGraph on the CPU device tier with CUDA's semantics:
a capture records every op with its tensors (their memory) and scalar arguments and computes
nothing that lasts (ops that write their arguments are recorded, not run; a host read of a
value raises, as it does on a capturing stream), and a replay runs the recorded ops again on
the same tensors with the same scalars. So a step value that reaches the replay any other way
than through memory (a Python float of this step's learning rate, a freshly allocated input)
is stale there, and the executor's replayed training differs from eager PyTorch's."""
import contextlib
import json
import time
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tensorstow.errors import TensorstowError
from tensorstow.executor import graphs
from tensorstow.executor.lr import LRSchedule
from tensorstow.executor.executor import Executor
from tensorstow.executor.data import batches
from tensorstow.ir.models import GPT, PRESETS
from tensorstow.planner.plan import make_plan
from tensorstow.planner.presets import load_hardware
from tensorstow.schema.options import Options
from tests.oracle import param_groups, train_eager
from tests.test_executor import B, T, VOCAB, get_plan, tiny_trace

_SCALAR_RETURNS = ("bool", "int", "float", "number", "Scalar", "SymInt", "SymFloat", "SymBool")


class HostReadInCapture(RuntimeError):
    pass


def _writes(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _written_returns(func, args, kwargs):
    """What an op that writes its arguments returns: those arguments (None for a void op)."""
    schema = func._schema
    if not schema.returns:
        return None
    bound = dict(zip((a.name for a in schema.arguments), args)) | kwargs
    out = []
    for r in schema.returns:
        sets = r.alias_info.before_set if r.alias_info is not None else None
        arg = next(a for a in schema.arguments if a.alias_info is not None and a.alias_info.before_set == sets)
        out.append(bound[arg.name])
    return out[0] if len(out) == 1 else tuple(out)


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if func is torch.ops.aten._local_scalar_dense.default or any(
                str(r.type) in _SCALAR_RETURNS for r in schema.returns):
            raise HostReadInCapture(f"{func} reads a device value on the host during a capture")
        bound = dict(zip((a.name for a in schema.arguments), args)) | kwargs
        if torch.Tag.nondeterministic_seeded in func.tags and bound.get("dropout_p", 1.0) != 0.0:
            raise HostReadInCapture(f"{func} draws random numbers during a capture")
        if _writes(func):  # recorded, not run: its effect happens at the replays only
            self.ops.append(("write", func, args, kwargs, None))
            return _written_returns(func, args, kwargs)
        out = func(*args, **kwargs)
        # a view shares its input's memory; an op that may return a view (`to`, `reshape`) but
        # made new memory computed it, and computes it again at each replay
        views = _storages(out) <= _storages((args, kwargs))
        self.ops.append(("view" if views else "fresh", func, args, kwargs, out))
        return out


def _storages(x) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)}


class RecordedGraph:
    """torch.cuda.CUDAGraph's contract on the CPU: `capture()` records, `replay()` runs it."""

    def __init__(self, device):
        self.ops: list = []
        self.replays = 0
        self._s = 0.0

    @contextlib.contextmanager
    def capture(self, shared=None):
        assert not self.ops, "a graph is captured once"
        with _Recorder(self.ops):
            yield
        for kind, *_, out in self.ops:  # computed by nothing yet, as CUDA's capture leaves them
            for o in tree_flatten(out)[0] if kind == "fresh" else ():
                if isinstance(o, torch.Tensor) and o.is_floating_point():
                    o.fill_(float("nan"))

    def replay(self) -> None:
        t0 = time.perf_counter()
        for kind, func, args, kwargs, out in self.ops:
            if kind == "write":
                func(*args, **kwargs)
            elif kind == "fresh":  # into the memory the capture gave its outputs, as a kernel writes
                for o, v in zip(tree_flatten(out)[0], tree_flatten(func(*args, **kwargs))[0]):
                    if isinstance(o, torch.Tensor):
                        o.copy_(v)
        self.replays += 1
        self._s = time.perf_counter() - t0

    def seconds(self) -> float:
        return self._s


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Graphs on the CPU device tier: the recording stand-in for CUDA's."""
    made = []

    def backend(device):
        made.append(RecordedGraph(device))
        return made[-1]

    monkeypatch.setitem(graphs.BACKENDS, "cpu", backend)
    return made


STEPS = 6


def _resident(**options) -> dict:
    """gpt-tiny all on the device, with torch's fused AdamW (the update a graph captures)."""
    o = Options(**{"model": "gpt-tiny", "hardware": "lohan-rtx4090", "policy": "all-gpu", "batch": B, "seq": T,
                   "precision": "fp32", "lr": 1e-3, "weight_decay": 0.1, "gpu_mem": 8_000_000, **options})
    return json.loads(make_plan(o, load_hardware(o.hardware).with_overrides(gpu_mem=o.gpu_mem)).dumps())


def _eager(data=None, **kw):
    torch.manual_seed(0)
    return train_eager(GPT(PRESETS["gpt-tiny"]), data or batches("synthetic", B, T, VOCAB, STEPS, seed=0), lr=1e-3,
                       make_optimizer=lambda m: torch.optim.AdamW(param_groups(m, 0.1), lr=1e-3, fused=True), **kw)


def _train(ex, data=None):
    data = data or batches("synthetic", B, T, VOCAB, STEPS, seed=0)
    losses, norms = [], []
    for x, y in data:
        losses.append(ex.step(x, y))
        norms.append(ex.grad_norm)
    return losses, ex.parameters(), norms


def _assert_equal(got, want):
    (la, pa), (lb, pb) = got, want
    assert la == lb
    bad = [n for n in pa if not torch.equal(pa[n], pb[n])]
    assert not bad, f"parameters differ: {bad[:5]}"


@pytest.mark.parametrize("mode,arena", [("sync", "off"), ("overlap", "off"), ("sync", "on"), ("overlap", "on")])
def test_a_replayed_resident_step_trains_exactly_as_eager_fused_adamw(mode, arena, cpu_graphs):
    """A warmup-cosine schedule (a new rate every step) and clipping that fires: every replayed
    step reads its rate, its Adam step count and its batch from memory. With the device arena the
    capture records the segments' outputs copied into their planned ranges, and replays them there."""
    plan = _resident(max_grad_norm=0.05)
    torch.manual_seed(0)
    ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), mode=mode, traced=tiny_trace(), graphs="on", device_arena=arena,
                  lr_schedule=LRSchedule("cosine", 1e-3, 2, STEPS))
    assert (ex.dev.arena is not None) == (arena == "on")
    losses, params, norms = _train(ex)
    eager_norms = []
    want = _eager(max_grad_norm=0.05, norms=eager_norms, scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, LRSchedule("cosine", 1e-3, 2, STEPS).factor))
    _assert_equal((losses, params), want)
    assert norms == [float(n) for n in eager_norms] and max(norms) > 0.05  # the clip fired
    assert ex.graphs.captured == 1 and len(cpu_graphs) == 1
    assert cpu_graphs[0].replays == STEPS - graphs.WARMUP  # the capture's step is its first replay
    assert ex.lane_busy() == {"gpu0.compute": cpu_graphs[0].seconds()}


def test_microbatches_take_their_weights_through_memory(cpu_graphs):
    """grad_accum 2 with ignored labels: each step's microbatch weights differ, and reach the
    replay as the tangents' values."""
    data = []
    for k, (x, y) in enumerate(batches("synthetic", 2 * B, T, VOCAB, STEPS, seed=1)):
        y = y.clone()
        y[0, :3 * k + 1] = -100  # a different count of ignored labels each step
        data.append((x, y))
    torch.manual_seed(0)
    ex = Executor(_resident(grad_accum=2), GPT(PRESETS["gpt-tiny"]), graphs="on")
    losses, params, _ = _train(ex, data)
    _assert_equal((losses, params), _eager(data, microbatches=2))
    assert cpu_graphs[0].replays == STEPS - graphs.WARMUP


def test_bf16_mixed_replays_with_its_compute_copies_written_in_place(cpu_graphs):
    """fp32 masters and bf16 compute copies: the update writes the copies where the capture
    found them, so every step after the warmup is a replay."""
    torch.manual_seed(0)
    ex = Executor(_resident(precision="bf16-mixed"), GPT(PRESETS["gpt-tiny"]), graphs="on")
    losses, params, _ = _train(ex)
    assert ex.graphs.blockers == [] and cpu_graphs[0].replays == STEPS - graphs.WARMUP
    _assert_equal((losses, params), _eager(precision="bf16-mixed"))


def test_the_stand_in_catches_a_host_read_and_a_stale_rate(cpu_graphs, monkeypatch):
    """The checks can fail. A host read inside the capture is refused, as on a capturing CUDA
    stream; a rate that is not refilled before each replay trains differently from eager."""
    from tensorstow.executor.adam import SubgroupAdam
    step = SubgroupAdam.step

    def read_on_host(self, *a, rates=None, **kw):
        return step(self, *a, rates=rates and {s: torch.tensor(float(v)) for s, v in rates.items()}, **kw)

    with monkeypatch.context() as m:
        m.setattr(SubgroupAdam, "step", read_on_host)
        torch.manual_seed(0)
        ex = Executor(_resident(), GPT(PRESETS["gpt-tiny"]), traced=tiny_trace(), graphs="on")
        with pytest.raises(TensorstowError, match="capturing the step .* reads a device value on the host"):
            _train(ex)

    feed = graphs.StepGraph.feed

    def stale(self, ex, *a):
        kept = {s: t.clone() for s, t in self.rates.items()}
        feed(self, ex, *a)
        if self.ready:  # the capture's rates, every replay
            for s, t in self.rates.items():
                t.copy_(kept[s])

    monkeypatch.setattr(graphs.StepGraph, "feed", stale)
    torch.manual_seed(0)
    ex = Executor(_resident(), GPT(PRESETS["gpt-tiny"]), traced=tiny_trace(), graphs="on",
                  lr_schedule=LRSchedule("cosine", 1e-3, 0, STEPS))
    losses, params, _ = _train(ex)
    want = _eager(scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, LRSchedule("cosine", 1e-3, 0, STEPS).factor))
    assert losses[:graphs.WARMUP + 2] == want[0][:graphs.WARMUP + 2]  # the first replay still had the capture's rate
    assert not all(torch.equal(params[n], want[1][n]) for n in params)


def test_an_evaluation_or_a_moved_buffer_makes_the_next_step_capture_again(cpu_graphs):
    """An evaluation between steps lets the graph go (its memory would stack on the eager
    evaluation's) and runs eagerly; a persistent buffer put in other memory (as a reload would)
    is seen before the replay. Either way the next step captures again, and training stays exact."""
    data = list(batches("synthetic", B, T, VOCAB, STEPS, seed=0))
    torch.manual_seed(0)
    ex = Executor(_resident(), GPT(PRESETS["gpt-tiny"]), traced=tiny_trace(), graphs="on")
    losses = [ex.step(x, y) for x, y in data[:4]]
    ex.evaluate(data[:1])
    losses.append(ex.step(*data[4]))
    copies = ex.dev.copies["OS:b1"]
    for k in copies:
        copies[k] = copies[k].clone()
    losses.append(ex.step(*data[5]))
    _assert_equal((losses, ex.parameters()), _eager(data=data))
    assert ex.graphs.captured == 3 and [g.replays for g in cpu_graphs] == [2, 1, 1]


def test_a_failed_capture_runs_the_step_eagerly_from_where_it_began(cpu_graphs, monkeypatch):
    """graphs auto: a capture that fails half-way (here a host read in the update) leaves the
    homes as the step found them; the step and every one after run instruction by instruction."""
    from tensorstow.executor.adam import SubgroupAdam
    step = SubgroupAdam.step

    def read_on_host(self, *a, rates=None, **kw):
        return step(self, *a, rates=rates and {s: torch.tensor(float(v)) for s, v in rates.items()}, **kw)

    monkeypatch.setattr(SubgroupAdam, "step", read_on_host)
    torch.manual_seed(0)
    ex = Executor(_resident(), GPT(PRESETS["gpt-tiny"]), traced=tiny_trace())
    losses, params, _ = _train(ex)
    _assert_equal((losses, params), _eager())
    assert ex.graphs.captured == 0 and "reads a device value on the host" in ex.graphs.blockers[0]
    assert set(ex.dev.copies) == {b for b, t in ex.homes.items() if t == ex.gpu}


def test_a_plan_that_needs_the_host_is_refused_with_its_reasons(tmp_path):
    with pytest.raises(TensorstowError, match=r"graphs on: .*host work \(.*SSD reads.*; use --graphs auto"):
        Executor(get_plan("zero-infinity"), GPT(PRESETS["gpt-tiny"]), traced=tiny_trace(), graphs="on",
                 state_dir=tmp_path / "s")
    # auto: the step runs instruction by instruction, and says why
    ex = Executor(_resident(), GPT(PRESETS["gpt-tiny"]), traced=tiny_trace())
    assert ex.graphs.blockers == ["the device tier is cpu memory (graphs are CUDA's)"]
    with pytest.raises(TensorstowError, match="unknown graphs setting 'yes'"):
        Executor(_resident(), GPT(PRESETS["gpt-tiny"]), traced=tiny_trace(), graphs="yes")


@pytest.mark.parametrize("name,mode", [("zero-infinity", "sync"), ("interleaved", "overlap"), ("cut-backward", "overlap"),
                                       ("deferred", "sync")])
def test_an_offloaded_steps_segments_replay_one_graph_each_over_the_arena(name, mode, cpu_graphs, tmp_path):
    """Host work between the segments (copies to and from DRAM and SSD, CPU updates): each segment
    of the step is captured after the warmup and replayed, reading its inputs and writing its
    outputs in the device arena at the capture's addresses, the batch through static inputs; the
    loss and the norms come from the capture. Training equals eager PyTorch bit for bit."""
    from tests.test_device_arena import with_arena
    plan = get_plan(name)
    torch.manual_seed(0)
    ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), mode=mode, traced=tiny_trace(), state_dir=tmp_path / "s",
                  **with_arena(plan))
    assert ex.graphs.blockers and ex.segment_graphs.on
    losses, params, _ = _train(ex)
    torch.manual_seed(0)
    want = train_eager(GPT(PRESETS["gpt-tiny"]), batches("synthetic", B, T, VOCAB, STEPS, seed=0), lr=1e-3,
                       weight_decay=0.1)
    _assert_equal((losses, params), want)
    segments = [i for i in ex.instrs if i.kind in ("compute", "recompute")]
    assert ex.segment_graphs.captured == len(segments) == len(cpu_graphs) == ex.segment_graphs.replays
    assert all(g.replays == STEPS - graphs.WARMUP for g in cpu_graphs)  # the capture's step is its first replay


def test_segments_capture_again_after_an_evaluation_and_a_failed_capture_is_one_line(cpu_graphs, tmp_path,
                                                                                      monkeypatch):
    """An evaluation lets the segments' graphs go; the next step captures them again, and training
    stays eager PyTorch's. A capture that fails (the stand-in refuses one, as CUDA refuses a host
    read) stops the run in one line that says how to run without graphs."""
    from tests.test_device_arena import with_arena
    plan = get_plan("zero-infinity")
    torch.manual_seed(0)
    ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), traced=tiny_trace(), state_dir=tmp_path / "s", **with_arena(plan))
    data = list(batches("synthetic", B, T, VOCAB, STEPS + 2, seed=0))
    losses = [ex.step(x, y) for x, y in data[:STEPS]]
    segments = sum(i.kind in ("compute", "recompute") for i in ex.instrs)
    assert ex.segment_graphs.captured == segments == ex.segment_graphs.replays
    ex.evaluate(data[:1])
    losses += [ex.step(x, y) for x, y in data[STEPS:]]
    assert ex.segment_graphs.captured == 2 * segments
    torch.manual_seed(0)
    want = train_eager(GPT(PRESETS["gpt-tiny"]), data, lr=1e-3, weight_decay=0.1)
    _assert_equal((losses, ex.parameters()), want)

    real = RecordedGraph.capture

    @contextlib.contextmanager
    def capture(self, shared=None):
        if len(cpu_graphs) == 2 * segments + 4:
            raise HostReadInCapture("refused by the test")
        with real(self, shared):
            yield
    monkeypatch.setattr(RecordedGraph, "capture", capture)
    ex.evaluate(data[:1])
    with pytest.raises(TensorstowError, match=r"capturing segment \S+ as a CUDA graph failed \(HostReadInCapture: "
                                              r"refused by the test\); rerun the same command with --graphs off$"):
        ex.step(*data[0])


def test_a_segment_whose_outputs_the_host_reads_or_that_draws_runs_eagerly():
    """Ops whose output's size the host must know (nonzero), whose value it reads (item), or that
    draw random numbers (dropout) keep their segment out of a graph; arithmetic does not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return torch.nonzero(x), torch.bincount(x.long()), torch.nn.functional.dropout(x, 0.5, True), x * 2
    gm = make_fx(f, tracing_mode="real")(torch.ones(4))
    decided = {n.target: graphs._host_decides(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert decided[torch.ops.aten.nonzero.default] and decided[torch.ops.aten.bincount.default]
    item = types.SimpleNamespace(target=torch.ops.aten._local_scalar_dense.default, args=(), kwargs={})
    assert graphs._host_decides(item)
    assert any(v for k, v in decided.items() if "dropout" in str(k) or "bernoulli" in str(k))
    assert not decided[torch.ops.aten.mul.Tensor]
