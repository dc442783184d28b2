"""Data parallel (`plan --dp N`, `execute --nproc N`): N ranks each run an offloaded one-GPU plan on
their rows of the step's batch (gloo; each rank's device tier is CPU memory under its budget),
reduce each block's gradient over the ranks, update their shard of its rows and gather the
parameters; trained like one process accumulating every rank's microbatches in order (eager
gradient accumulation, the Trainer's label-count normalisation over the whole step); a rank
killed mid-step stops every rank and the committed step resumes; torchrun across two "machines"
on this box runs the same ranks.

Eager runs here use 1 torch thread, as every rank does (`launch` gives each rank cpu_count /
nproc threads: 1 on a 2-core machine)."""
import dataclasses
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tensorstow import TensorstowError
from tensorstow.calibrate import hardware_for
from tensorstow.executor.data import batches
from tensorstow.executor.executor import Executor
from tensorstow.ir.models import GPT, PRESETS
from tensorstow.planner.plan import make_plan
from tensorstow.schema.options import Options
from tests.oracle import train_eager
from tests.test_multigpu import kill_rank_1_inside_step_3

transformers = pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")

ROOT = Path(__file__).resolve().parent.parent
B, T, VOCAB, LR = 2, 16, 128, 1e-3
LLAMA = dict(vocab_size=VOCAB, max_position_embeddings=64, hidden_size=32, intermediate_size=64,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A tiny LLaMA checkpoint with its weights (every process and eager start from them)."""
    d = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA)).save_pretrained(d)
    return str(d)


def dp_plan(ckpt: str, dp: int, precision: str = "fp32", **kw):
    o = Options(model=f"hf:{ckpt}", hardware="lohan-rtx4090", policy="lohan", batch=B, seq=T, precision=precision,
                lr=LR, exact_optimizer=True, dp=dp, gpu_mem=kw.pop("gpu_mem", 400_000), **kw)
    plan = make_plan(o, hardware_for(o))
    assert any(b.home == "ssd" for b in plan.buffers.values()), "the plan must offload"
    return plan


def cli(*args, env=None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "tensorstow.cli", *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def finish(p: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    return p.returncode, out, err


def exported(state: Path, out: Path) -> dict[str, torch.Tensor]:
    rc, _, err = finish(cli("export", state, "-o", out))
    assert rc == 0, err
    return load_file(str(out / "model.safetensors"))


def logged_losses(path: Path) -> list[float]:
    import json
    return [json.loads(ln)["loss"] for ln in path.read_text().splitlines()]


def eager(ckpt: str, dp: int, steps: int, accum: int = 1, precision: str = "fp32", max_grad_norm=None):
    """One process accumulating every rank's microbatches in rank order: the step's rows are
    dp x accum microbatches of B, rank r's accum after the r x accum before them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
        model.train()

        def loss(m, x, y):
            return F.cross_entropy(m(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
        return train_eager(model, batches("synthetic", B * dp * accum, T, VOCAB, steps, seed=0), lr=LR, loss=loss,
                           microbatches=dp * accum, precision=precision, max_grad_norm=max_grad_norm,
                           norms=[] if max_grad_norm else None)
    finally:
        torch.set_num_threads(threads)


def train(plan, tmp_path: Path, steps: int = 3, nproc: int | None = None) -> tuple[list[float], dict]:
    path = tmp_path / "plan.json"
    path.write_text(plan.dumps())
    rc, _, err = finish(cli("execute", path, "--hw-mismatch", "ok", "--nproc", nproc or plan.decisions.dp,
                            "--steps", steps, "--state-dir", tmp_path / "state", "--log-json", tmp_path / "log.jsonl"))
    assert rc == 0, err
    return logged_losses(tmp_path / "log.jsonl"), exported(tmp_path / "state", tmp_path / "export")


def assert_bit_identical(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, f"parameters differ: {bad[:5]}"


def test_three_ranks_train_an_hf_model_bit_identically_to_eager_accumulation(llama, tmp_path):
    """(Two ranks: `test_a_rank_killed_mid_run_...`, which ends bit-identical with eager too.)"""
    dp = 3
    plan = dp_plan(llama, dp)
    reduces = [i for i in plan.instructions if i.kind == "reduce"]
    assert len(reduces) == sum(1 for n in plan.buffers if n.startswith("G:"))  # each block's gradient once
    losses, params = train(plan, tmp_path)
    want_losses, want = eager(llama, dp, 3)
    assert losses == want_losses
    assert_bit_identical(params, want)
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [*(f"rank{k}" for k in range(dp)),
                                                                      "tensorstow.json"]


def test_accumulation_clipping_and_bf16_on_two_ranks_train_as_eager_autocast(llama, tmp_path):
    plan = dp_plan(llama, 2, precision="bf16-mixed", grad_accum=2, max_grad_norm=1.0, gpu_mem=600_000)
    losses, params = train(plan, tmp_path)
    want_losses, want = eager(llama, 2, 3, accum=2, precision="bf16-mixed", max_grad_norm=1.0)
    assert losses == pytest.approx(want_losses, rel=1e-2)
    for n, w in want.items():
        assert (params[n] - w).norm() <= 1e-2 * w.norm(), n


def test_two_machines_under_torchrun_train_the_same(llama, tmp_path):
    """Two `torchrun --nnodes 2 --nproc-per-node 1` commands, each a "machine" with one rank, meeting
    at a localhost rendezvous (c10d), train as `execute --nproc 2` does."""
    plan = dp_plan(llama, 2, nodes=2, gpus=1)
    assert plan.to_plan().options.nodes == 2
    path = tmp_path / "plan.json"
    path.write_text(plan.dumps())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    procs = [subprocess.Popen([str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(k),
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dp",
                               "-m", "tensorstow.cli", "execute", str(path), "--hw-mismatch", "ok", "--steps", "3",
                               "--state-dir", str(tmp_path / "state")], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
              for k in range(2)]
    results = [finish(p) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), [err[-2000:] for _, _, err in results]
    assert sum(out.count("step 3/3") for _, out, _ in results) == 1  # rank 0 reports
    assert_bit_identical(exported(tmp_path / "state", tmp_path / "export"), eager(llama, 2, 3)[1])


def test_a_rank_killed_mid_run_stops_every_rank_and_the_rerun_resumes_exactly(llama, tmp_path):
    plan = dp_plan(llama, 2)
    path = tmp_path / "plan.json"
    path.write_text(plan.dumps())
    args = ("execute", path, "--hw-mismatch", "ok", "--nproc", 2, "--steps", 5, "--state-dir", tmp_path / "state",
            "--log-json", tmp_path / "log.jsonl")
    kill_rank_1_inside_step_3(cli(*args), finish)
    rc, out, err = finish(cli(*args))
    assert rc == 0, err
    assert "resuming from step" in out
    want_losses, want = eager(llama, 2, 5)
    assert logged_losses(tmp_path / "log.jsonl") == want_losses  # every step, the killed run's and the resumed one's
    assert_bit_identical(exported(tmp_path / "state", tmp_path / "export"), want)
    # another number of ranks cannot resume it: the shards are the plan's
    rc, _, err = finish(cli("execute", path, "--hw-mismatch", "ok", "--nproc", 3, "--steps", 6, "--state-dir",
                            tmp_path / "state"))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--nproc 2" in err
    # a rank that refuses its input (another seed than the run's): one line, which does not say that
    # rerunning the same command resumes
    rc, _, err = finish(cli(*args, "--seed", 1))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "seed" in err
    assert "every rank stopped" in err and "run the same command" not in err


def test_the_plan_reduces_each_gradient_and_shards_the_optimizer_state():
    o = Options(model="gpt-small", hardware="lohan-rtx4090", policy="lohan", batch=2, seq=32, precision="bf16-mixed")
    one = make_plan(o, hardware_for(o)).to_plan()
    o2 = dataclasses.replace(o, dp=2)
    two = make_plan(o2, hardware_for(o2)).to_plan()
    assert len(two.hardware.spec.gpus) == 2 and two.decisions.dp == 2
    for name, buf in one.buffers.items():
        if name.startswith(("M:", "OS:")):  # whole rows, ceil(rows / 2) of each parameter
            assert buf.bytes / 2 <= two.buffers[name].bytes < buf.bytes
    instrs = two.instructions
    for r in (i for i in instrs if i.kind == "reduce"):
        (bwd,) = [instrs[d] for d in r.deps]
        assert bwd.kind == "compute" and bwd.segment.startswith("bwd")
        assert r.stream == "gpu0.reduce" and any(r.id in i.deps and i.tensor == r.tensor for i in instrs)
    for u in (i for i in instrs if i.kind == "optimizer_step"):  # then the other ranks' rows of P
        (g,) = [i for i in instrs if i.kind == "gather" and u.id in i.deps]
        assert g.tensor == f"P:{u.segment}" and g.stream == "gpu0.gather" and g.dst == "dram"
        assert all(g.id in i.deps for i in instrs if i.kind == "store" and i.tensor == g.tensor and i.id > g.id)
    # the step trains both ranks' rows: twice the tokens in about the step time
    assert two.predicted.tokens_per_s > 1.5 * one.predicted.tokens_per_s


@pytest.mark.parametrize("extra,message", [
    (dict(policy="mobius"), "one-GPU policy"),
    (dict(microbatches=2), "--grad-accum"),
    (dict(gpus=3), "--dp 2 needs 1 machine"),
    (dict(nodes=3), "--dp 2 needs 3 machine"),
    (dict(expert_groups=2), "--expert-groups"),
])
def test_data_parallel_plans_refuse_what_they_cannot_run_in_one_line(extra, message):
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", **{"policy": "lohan", "dp": 2, **extra})
    with pytest.raises(TensorstowError, match=message):
        make_plan(o, hardware_for(o))


def test_a_data_parallel_plan_is_not_run_in_one_process():
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="lohan", dp=2, precision="fp32")
    with pytest.raises(TensorstowError, match="--nproc 2"):
        Executor(make_plan(o, hardware_for(o)), GPT(PRESETS["gpt-tiny"]))


def test_collectives_are_priced_on_the_rings_slowest_link():
    """Inside a machine without P2P the ring runs through host memory at the slower copy engine;
    across machines the network bounds it (Patarasuk & Yuan's ring: an all-reduce moves
    2 (N - 1) / N of the bytes through each link, an all-gather (N - 1) / N)."""
    def reduce_and_gather(**kw):
        o = Options(model="gpt-small", hardware="lohan-rtx4090", policy="lohan", batch=2, seq=32, **kw)
        plan = make_plan(o, hardware_for(o)).to_plan()
        first = {k: next(i for i in plan.instructions if i.kind == k) for k in ("reduce", "gather")}
        return plan, {k: (plan.buffers[i.tensor].bytes, i.est_s) for k, i in first.items()}
    plan, one = reduce_and_gather(dp=4)
    pcie = min(plan.hardware.spec.gpu.h2d_bw, plan.hardware.spec.gpu.d2h_bw)
    nbytes, est = one["reduce"]
    assert est == pytest.approx(2 * 3 / 4 * nbytes / pcie, rel=1e-4)
    _, two = reduce_and_gather(dp=8, nodes=2, gpus=4, net_bw=5e9)
    nbytes, est = two["reduce"]
    assert est == pytest.approx(2 * 7 / 8 * nbytes / 5e9, rel=1e-4)
    # the CPU update's P is gathered in host memory, through gloo
    assert two["gather"][1] > 7 / 8 * two["gather"][0] / pcie


def test_collectives_through_gloo_pay_a_step_per_tensor_and_gather_at_the_gathers_rate():
    """Through gloo (a CPU device tier, host memory) each collective the executor makes (one per
    tensor) costs its ring steps at `CPU.gloo_step_s` (2 (N - 1) an all-reduce, N - 1 an
    all-gather) besides its bytes, and an all-gather moves them at `CPU.gloo_gather_bw`, which gloo
    reaches at about half its all-reduce's bus bandwidth."""
    import dataclasses

    from tensorstow.schema.hardware import CPU_GPU_NAME
    def first(dp, kind, **kw):
        o = Options(model="gpt-small", hardware="lohan-rtx4090", policy="lohan", batch=2, seq=32, dp=dp, gpus=dp, **kw)
        hw = hardware_for(o)
        hw = dataclasses.replace(hw, gpus=tuple(dataclasses.replace(g, name=CPU_GPU_NAME) for g in hw.gpus),
                                 cpu=dataclasses.replace(hw.cpu, gloo_bw=1e9, gloo_gather_bw=5e8, gloo_step_s=1e-4))
        plan = make_plan(o, hw).to_plan()
        ins = [i for i in plan.instructions if i.kind == kind]
        assert ins, kind
        return [(len(plan.buffers[i.tensor].members), plan.buffers[i.tensor].bytes, i.est_s) for i in ins]
    # 2 ranks: an all-reduce is 2 ring steps a tensor and moves 2 (N - 1) / N = 1 x its bytes, an
    # all-gather 1 step a tensor and (N - 1) / N = 1/2 x its bytes
    for kind, steps, bw in (("reduce", 2, 1e9), ("gather", 1, 5e8)):
        for tensors, nbytes, est in first(2, kind):
            assert est == pytest.approx(tensors * steps * 1e-4 + steps / 2 * nbytes / bw, rel=1e-4)
    # 3 ranks summing in rank order: every rank gathers every rank's gradient, (N - 1) steps a tensor
    # and (N - 1) x its bytes at the all-gather's rate
    for tensors, nbytes, est in first(3, "reduce", exact_optimizer=True):
        assert est == pytest.approx(tensors * 2 * 1e-4 + 2 * nbytes / 5e8, rel=1e-4)


def test_evaluate_of_a_several_process_state_dir_says_what_to_do(tmp_path):
    from tensorstow.executor.run import evaluate_state
    from tensorstow.schema.run import Run
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="lohan", dp=2, precision="fp32")
    plan = make_plan(o, hardware_for(o)).to_plan()
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "plan.json").write_text(plan.dumps())
    with pytest.raises(TensorstowError, match="several processes.*--eval-data"):
        evaluate_state(plan, Run(state_dir=str(tmp_path), eval_data="synthetic"))


@pytest.mark.parametrize("dp,policy,precision,gpu_mem", [(3, "dos", "bf16-mixed", 50_000)])
def test_scalars_and_parameters_with_fewer_rows_than_ranks_train_as_eager(dp, policy, precision, gpu_mem, tmp_path):
    """0-d parameters and ones of 1 or 2 rows on 3 ranks (some ranks' shards of them empty); the
    GPU update of a mixed-precision plan whose P lives in DRAM makes P anew on the device."""
    from tests.fixtures.user_models import odd_shapes
    o = Options(model="tests.fixtures.user_models:odd_shapes", hardware="lohan-rtx4090", policy=policy, batch=B,
                seq=T, precision=precision, lr=LR, exact_optimizer=True, dp=dp, gpu_mem=gpu_mem)
    plan = make_plan(o, hardware_for(o))
    if policy == "dos":
        assert {d.optimizer for d in plan.decisions.blocks.values()} == {"gpu"}
        assert {d.params for d in plan.decisions.blocks.values()} == {"dram"}
    losses, params = train(plan, tmp_path)
    model = odd_shapes()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want_losses, want = train_eager(model, batches("synthetic", B * dp, T, model.vocab_size, 3, seed=0), lr=LR,
                                        microbatches=dp, precision=precision)
    finally:
        torch.set_num_threads(threads)
    if precision == "fp32":
        assert losses == want_losses
        assert_bit_identical(params, want)
    else:
        assert losses == pytest.approx(want_losses, rel=1e-2)
        for n, w in want.items():
            assert (params[n] - w).norm() <= 1e-2 * w.norm(), n
