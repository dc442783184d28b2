"""Multi-GPU plans executed: one process per GPU (gloo; each process's device tier is CPU memory
under its own budget), trained bit for bit like single-process eager PyTorch with gradient
accumulation over the same microbatches; a rank killed mid-step stops every rank and the
committed state resumes; the pipeline path on one GPU in one process.

Eager runs here use 1 torch thread, as every rank does (`launch` gives each rank cpu_count /
nproc threads: 1 on a 2-core machine; the comparison pins it so that it holds anywhere)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tensorstow import TensorstowError
from tensorstow.executor.data import batches
from tensorstow.executor.distributed import agree_on_step
from tensorstow.executor.executor import Executor
from tensorstow.executor.ssd import SSDStore
from tensorstow.ir.models import GPT, PRESETS
from tensorstow.schema.options import Options
from tensorstow.planner.plan import make_plan
from tensorstow.calibrate import hardware_for
from tests.oracle import train_eager

ROOT = Path(__file__).resolve().parent.parent
MODEL = "gpt-small"  # 6 layers (8 blocks)
B, T = 2, 32


def mobius_plan(gpus: int, microbatches: int = 0, precision: str = "fp32", gpu_mem: int = 24_000_000,
                model: str = MODEL, policy: str = "mobius"):
    o = Options(model=model, hardware="lohan-rtx4090", policy=policy, batch=B, seq=T, precision=precision,
                lr=1e-3, weight_decay=0.1, exact_optimizer=True, gpus=gpus, gpu_mem=gpu_mem,
                microbatches=microbatches)
    return make_plan(o, hardware_for(o))


def eager(steps: int, microbatches: int, precision: str = "fp32", model: str = MODEL):
    c = PRESETS[model]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        return train_eager(GPT(c), batches("synthetic", B * microbatches, T, c.vocab_size, steps, seed=0), lr=1e-3,
                           weight_decay=0.1, microbatches=microbatches, precision=precision)
    finally:
        torch.set_num_threads(threads)


def cli(*args, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "tensorstow.cli", *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def finish(p: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return p.returncode, out, err


def exported(state: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / "export"
    rc, _, err = finish(cli("export", state, "-o", out))
    assert rc == 0, err
    return load_file(str(out / "model.safetensors"))


def assert_bit_identical(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, f"parameters differ: {bad[:5]}"


# mobius on 3 processes holds what 2 would (a first and a last stage) and a middle one
@pytest.mark.parametrize("gpus,policy", [(3, "mobius"), (2, "gpipe")])
def test_pipelines_on_n_processes_train_bit_identically_to_eager(gpus, policy, tmp_path):
    plan = mobius_plan(gpus, policy=policy, gpu_mem=24_000_000 if policy == "mobius" else 200_000_000)
    pl = plan.decisions.pipeline
    assert len(set(pl.gpus)) == gpus
    if policy == "mobius":
        assert len(pl.stages) > gpus  # stages swapped in and out of every GPU
    assert any(i.kind == "send" for i in plan.instructions)
    path = tmp_path / "plan.json"
    path.write_text(plan.dumps())
    rc, out, err = finish(cli("execute", path, "--hw-mismatch", "ok", "--nproc", gpus, "--steps", 3, "--state-dir", tmp_path / "state",
                              "--log-json", tmp_path / "log.jsonl"))
    assert rc == 0, err
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 3  # one log: rank 0's
    losses, params = eager(3, pl.microbatches)
    printed = [float(ln.split("loss ")[1].split()[0]) for ln in out.splitlines() if ln.startswith("step ")]
    assert printed == pytest.approx(losses, abs=1e-4)  # rank 0 prints the loss the last stage's rank computed
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [*(f"rank{k}" for k in range(gpus)), "tensorstow.json"]
    assert_bit_identical(exported(tmp_path / "state", tmp_path), params)
    if policy == "mobius":
        # rank 1 one commit behind (a kill between the ranks' commits): export takes the step every
        # rank holds, rolling the others back, and gives eager's weights after 2 steps
        from tensorstow.executor import statedir
        with SSDStore(tmp_path / "state" / "rank1", statedir.store_sizes(plan, "gpu1")) as st:
            assert st.rollback() == 2
        assert_bit_identical(exported(tmp_path / "state", tmp_path / "again"), eager(2, pl.microbatches)[1])


def test_a_rank_killed_mid_step_stops_every_rank_and_the_committed_step_resumes(tmp_path):
    plan = mobius_plan(2)
    path = tmp_path / "plan.json"
    path.write_text(plan.dumps())
    args = ("execute", path, "--hw-mismatch", "ok", "--nproc", 2, "--steps", 5, "--state-dir", tmp_path / "state")
    p = cli(*args)
    kill_rank_1_inside_step_3(p, finish)
    assert not Path(f"/proc/{p.pid}").exists() or p.poll() is not None
    rc, out, err = finish(cli(*args))
    assert rc == 0, err
    assert "resuming from step 2" in out or "resuming from step 3" in out
    assert_bit_identical(exported(tmp_path / "state", tmp_path), eager(5, plan.decisions.pipeline.microbatches)[1])
    # a rank's state gone: export refuses rather than write part of the model
    import shutil
    shutil.rmtree(tmp_path / "state" / "rank1")
    rc, _, err = finish(cli("export", tmp_path / "state", "-o", tmp_path / "partial"))
    assert rc != 0 and "a rank's state is missing" in err and not (tmp_path / "partial").exists()


def kill_rank_1_inside_step_3(p: subprocess.Popen, finish) -> None:
    """SIGKILL rank 1 of the launcher `p` (`execute --nproc 2`) once step 2 is printed; every rank
    then stops with one line naming it and saying the same command resumes."""
    for line in p.stdout:
        if line.startswith("step 2/"):
            time.sleep(0.05)  # inside step 3
            ranks = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
            os.kill(int(ranks[1]), signal.SIGKILL)
            break
    rc, _, err = finish(p)
    lines = err.strip().splitlines()
    assert rc != 0 and len(lines) == 1, err
    assert "rank 1 of 2 was killed by signal SIGKILL" in lines[0] and "run the same command to resume" in lines[0]


class _Comm:
    """Two ranks in one process: `gather` sees both stores' steps."""

    def __init__(self, stores):
        self.stores = stores

    def gather(self, value):
        return [-1 if s.committed_step() is None else s.committed_step() for s in self.stores]


def test_a_rank_one_commit_ahead_rolls_back_to_the_step_every_rank_committed(tmp_path):
    """A rank dies after another committed step n+1 but before it did: the survivor's store
    still holds step n (nothing is written before every rank committed) and rolls back to it."""
    sizes = {"w": 4096}
    a, b = SSDStore(tmp_path / "a", sizes), SSDStore(tmp_path / "b", sizes)
    for s, steps in ((a, (1, 2)), (b, (1,))):
        for n in steps:
            s.write("w", torch.full((4096,), n, dtype=torch.uint8))
            s.commit(n)
    comm = _Comm([a, b])
    assert agree_on_step(b, comm) == 1 and b.committed_step() == 1
    assert agree_on_step(a, comm) == 1 and a.committed_step() == 1
    out = torch.empty(4096, dtype=torch.uint8)
    a.read("w", out)
    assert bool((out == 1).all())  # step 1's bytes
    a.close()
    a = SSDStore(tmp_path / "a", sizes)  # and it stays rolled back
    assert a.committed_step() == 1
    a.close()
    b.close()


def test_a_run_stopped_inside_its_first_commit_starts_again(tmp_path):
    """One rank committed step 0 (the initial state), the other was stopped before it did: the
    first resumes step 0, the second makes it afresh; no rollback, nothing refused."""
    sizes = {"w": 4096}
    a, b = SSDStore(tmp_path / "a", sizes), SSDStore(tmp_path / "b", sizes)
    a.write("w", torch.zeros(4096, dtype=torch.uint8))
    a.commit(0)
    comm = _Comm([a, b])
    assert agree_on_step(a, comm) is None and agree_on_step(b, comm) is None
    assert a.committed_step() == 0 and b.committed_step() is None
    a.close()
    b.close()


def test_transport_errors_name_a_lost_peer_and_others_their_own_cause():
    from tensorstow.executor.distributed import peer_lost
    assert peer_lost(RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: "
                                   "Connection reset by peer"))
    assert peer_lost(ConnectionResetError())
    assert not peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_the_rank_to_blame_is_not_one_the_launcher_stopped():
    """Guards against blaming the rank the launcher stopped: on a loaded machine rank 1 is SIGKILLed,
    rank 0 has not noticed within the launcher's grace period, so the launcher terminates it; the
    error blames rank 1, not rank 0's SIGTERM."""
    from tensorstow.executor.distributed import LOST, _cause
    assert _cause({0: "was killed by signal SIGTERM", 1: "was killed by signal SIGKILL"}, stopped={0}) == 1
    assert _cause({0: f"failed: {LOST} (rank 1)", 1: "failed: out of memory"}, stopped=set()) == 1
    assert _cause({0: "was killed by signal SIGTERM", 1: "was killed by signal SIGTERM"}, stopped={0, 1}) == 0


def test_the_rank_to_blame_is_the_first_seen_dead_not_the_peer_that_aborted():
    """Regression: rank 1 SIGKILLed, rank 0's transport aborts it (SIGABRT) before the launcher's
    next poll; the error blamed rank 0. The first seen dead is to blame, and within one poll a rank
    that aborted itself is not."""
    from tensorstow.executor.distributed import LOST, _cause
    why = {0: "was killed by signal SIGABRT", 1: "was killed by signal SIGKILL"}
    assert _cause(why, stopped=set(), seen={0: 7, 1: 7}) == 1
    assert _cause(why, stopped=set(), seen={0: 7, 1: 8}) == 0
    assert _cause({0: "was killed by signal SIGKILL", 1: "was killed by signal SIGKILL"}, set(), {0: 9, 1: 8}) == 1
    # a rank that aborted by itself is to blame before a peer that only lost it in the same poll
    assert _cause({0: f"failed: {LOST} (rank 1)", 1: "was killed by signal SIGABRT"}, set(), {0: 7, 1: 7}) == 1
    # a rank the launcher never saw end (it ended after the watch, not stopped) comes after the seen
    assert _cause({0: f"failed: {LOST} (rank 1)", 1: "was killed by signal SIGKILL"}, set(), {1: 40}) == 1


def test_the_launcher_watch_records_the_order_ranks_ended():
    from tensorstow.executor.distributed import _stop, _watch
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True),
             subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)]
    try:
        seen = _watch(procs, grace_s=0.2)
    finally:
        stopped = _stop(procs)
    assert list(seen) == [1] and procs[1].returncode == 3 and stopped == {0}


def test_torchrun_with_the_wrong_number_of_processes_is_one_line(tmp_path):
    plan = mobius_plan(2)
    path = tmp_path / "plan.json"
    path.write_text(plan.dumps())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "3"}
    p = subprocess.run([sys.executable, "-m", "tensorstow.cli", "execute", str(path), "--hw-mismatch", "ok", "--hw-mismatch", "ok", "--steps", "1"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "runs on 2 GPU(s)" in p.stderr and "3 processes were started" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_pipeline_on_one_gpu_accumulates_microbatches_like_eager(precision):
    """--gpus 1: the Mobius stages take turns on one GPU, in one process (no sends); the step is
    3 microbatches, and the gradients accumulate (in fp32 for bf16-mixed, as eager's .grad)."""
    plan = mobius_plan(1, microbatches=3, precision=precision, gpu_mem=20_000_000)
    assert len(plan.decisions.pipeline.stages) > 1
    c = PRESETS[MODEL]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        ex = Executor(plan, GPT(c), mode="overlap")
        losses = [ex.step(x, y) for x, y in batches("synthetic", 3 * B, T, c.vocab_size, 2, seed=0)]
        assert ex.peak_bytes["gpu"] <= plan.to_plan().predicted.capacity_bytes["gpu"]
    finally:
        torch.set_num_threads(threads)
    want_losses, want = eager(2, 3, precision)
    assert losses == want_losses
    assert_bit_identical(ex.parameters(), want)


def test_a_multi_gpu_plan_needs_one_process_per_gpu(tmp_path):
    plan = mobius_plan(2)
    with pytest.raises(TensorstowError, match="--nproc 2"):
        Executor(plan, GPT(PRESETS[MODEL]))
    path = tmp_path / "plan.json"
    path.write_text(plan.dumps())
    rc, _, err = finish(cli("execute", path, "--hw-mismatch", "ok", "--nproc", 3, "--steps", 1))
    assert rc != 0 and "--nproc 2, one process per GPU" in err and "Traceback" not in err


def test_the_data_parallel_baseline_is_simulation_only():
    o = Options(model=MODEL, hardware="lohan-rtx4090", policy="zero3-dp", batch=B, seq=T, precision="fp32", gpus=2)
    plan = make_plan(o, hardware_for(o))
    with pytest.raises(TensorstowError, match="simulated baseline"):
        Executor(plan, GPT(PRESETS[MODEL]))


def test_torchrun_launches_the_same_ranks(tmp_path):
    """`torchrun --nproc-per-node 2 -m tensorstow.cli execute PLAN`: each process is one rank."""
    plan = mobius_plan(2)
    path = tmp_path / "plan.json"
    path.write_text(plan.dumps())
    # TMPDIR: torchrun's rendezvous leaves a torchelastic_* folder behind; keep it in tmp_path
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    torchrun = Path(sys.executable).with_name("torchrun")
    p = subprocess.Popen([str(torchrun), "--nproc-per-node", "2", "-m", "tensorstow.cli", "execute", str(path), "--hw-mismatch", "ok",
                          "--steps", "2", "--state-dir", str(tmp_path / "state")], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    rc, out, err = finish(p)
    assert rc == 0, err
    assert out.count("step 1/2") == 1  # rank 0 reports, the other rank is quiet
    assert_bit_identical(exported(tmp_path / "state", tmp_path), eager(2, plan.decisions.pipeline.microbatches)[1])


def test_a_tied_model_on_two_processes_trains_bit_identically_to_eager(tmp_path):
    """nanoGPT's head shares the embedding's weight: both blocks run on one rank (the planner keeps
    ties on one GPU), whose backward carries the head's partial gradient to the embedding's."""
    from tests.fixtures.real_models import nano_gpt
    o = Options(model="tests.fixtures.real_models:nano_gpt", hardware="lohan-rtx4090", policy="mobius", batch=B,
                seq=16, precision="fp32", lr=1e-3, weight_decay=0.1, exact_optimizer=True, gpus=2, gpu_mem=1_000_000)
    plan = make_plan(o, hardware_for(o))
    pl = plan.decisions.pipeline
    assert len(set(pl.gpus)) == 2 and any(i.kind == "send" for i in plan.instructions)
    path = tmp_path / "plan.json"
    path.write_text(plan.dumps())
    rc, _, err = finish(cli("execute", path, "--hw-mismatch", "ok", "--nproc", 2, "--steps", 3, "--state-dir", tmp_path / "state"))
    assert rc == 0, err
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = nano_gpt()
        vocab = model.wte.num_embeddings
        _, want = train_eager(model, batches("synthetic", B * pl.microbatches, 16, vocab, 3, seed=0), lr=1e-3,
                              weight_decay=0.1, microbatches=pl.microbatches, loss=lambda m, x, y: m(x, y)[1])
    finally:
        torch.set_num_threads(threads)
    assert_bit_identical(exported(tmp_path / "state", tmp_path), want)


def test_dropout_across_ranks_draws_each_ranks_own_masks_and_resumes_exactly(tmp_path):
    """With dropout each rank draws from its own generator (seeded from the shared stream plus its
    rank): training is eager's in distribution, not bit for bit. Each rank's generator is part of
    its committed state: a run stopped after step 1 and resumed ends where an uninterrupted one does."""
    o = Options(model="tests.fixtures.real_models:nano_gpt_dropout", hardware="lohan-rtx4090", policy="mobius",
                batch=B, seq=16, precision="fp32", lr=1e-3, exact_optimizer=True, gpus=2, gpu_mem=1_000_000)
    path = tmp_path / "plan.json"
    path.write_text(make_plan(o, hardware_for(o)).dumps())
    runs = {}
    for name, stops in (("whole", (3,)), ("resumed", (1, 3))):
        for steps in stops:
            rc, out, err = finish(cli("execute", path, "--hw-mismatch", "ok", "--nproc", 2, "--steps", steps, "--state-dir", tmp_path / name))
            assert rc == 0, err
        runs[name] = exported(tmp_path / name, tmp_path / f"x{name}")
    assert_bit_identical(runs["resumed"], runs["whole"])
    assert all(torch.isfinite(v).all() for v in runs["whole"].values())
