"""`tensorstow execute` end to end: logs, traces, and SIGKILL + resume == an uninterrupted run."""
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tensorstow.executor.statedir import store_sizes
from tensorstow.executor.ssd import SSDStore
from tensorstow.cli import main

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5


@pytest.fixture(scope="module")
def ssd_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "p.json"
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--policy", "zero-infinity", "--precision", "fp32",
                 "--batch", "2", "--seq", "32", "--gpu-mem", "2MB", "-o", str(out)]) == 0
    return out


def execute(plan, state, *extra, wait=True):
    cmd = [sys.executable, "-m", "tensorstow.cli", "execute", str(plan), "--hw-mismatch", "ok", "--steps", str(STEPS),
           "--state-dir", str(state), *extra]
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def committed_state(plan_path, state):
    plan = json.loads(Path(plan_path).read_text())
    sizes = store_sizes(plan)
    with SSDStore(state, sizes) as store:
        out = {}
        for name, n in sizes.items():
            if name.startswith(("P:", "M:", "OS:")):
                buf = torch.empty(n, dtype=torch.uint8)
                store.read(name, buf)
                out[name] = buf
        return store.committed_step(), out


def test_log_json_and_measured_trace(ssd_plan, tmp_path):
    log, trace = tmp_path / "log.jsonl", tmp_path / "trace.json"
    r = execute(ssd_plan, tmp_path / "s", "--log-json", str(log), "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(row["loss"] > 0 and row["step_time_s"] > 0 for row in rows)
    assert "measured step" in r.stdout and "predicted" in r.stdout
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}
    assert "compute fwd:b0" in names and "load P:b0" in names
    again = execute(ssd_plan, tmp_path / "s")  # a finished state dir has nothing left to do
    assert again.returncode == 0 and "nothing left to train" in again.stdout


SCHEDULE = ("--lr", "1e-3", "--lr-scheduler", "cosine", "--warmup-steps", "2")


def test_log_records_each_steps_learning_rate_as_transformers_schedules_it(ssd_plan, tmp_path):
    """`--lr-scheduler cosine --warmup-steps 2`: the rate of every logged step is the one
    transformers' `get_cosine_schedule_with_warmup` gives the optimizer for that step."""
    transformers = pytest.importorskip("transformers")
    log = tmp_path / "log.jsonl"
    r = execute(ssd_plan, tmp_path / "s", *SCHEDULE, "--log-json", str(log))
    assert r.returncode == 0, r.stderr
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    sched = transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)
    want = []
    for _ in range(STEPS):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [json.loads(line)["lr"] for line in log.read_text().splitlines()] == want
    assert want[0] == 0.0 and len(set(want)) == STEPS
    assert "lr 0  " in r.stdout and "lr 0.001  " in r.stdout


def test_sigkill_then_resume_equals_uninterrupted(ssd_plan, tmp_path):
    """Killed at a random moment and resumed, a run with a warmup + cosine schedule commits the
    same state as an uninterrupted one: the schedule continues where the commit left it."""
    ref = tmp_path / "ref"
    r = execute(ssd_plan, ref, *SCHEDULE)
    assert r.returncode == 0, r.stderr
    ref_step, ref_state = committed_state(ssd_plan, ref)
    assert ref_step == STEPS
    rng = random.Random(1234)
    state = tmp_path / "killed"  # one kill: tests/test_state_dir.py and test_resume.py kill at many more moments
    p = execute(ssd_plan, state, *SCHEDULE, wait=False)
    # wait until a random step has been printed, then kill at a random moment inside the next
    target = rng.randint(1, STEPS - 2)
    seen = 0
    for line in p.stdout:
        if line.startswith("step "):
            seen += 1
            if seen >= target:
                break
    time.sleep(rng.uniform(0, 0.3))
    p.send_signal(signal.SIGKILL)
    p.wait()
    step, _ = committed_state(ssd_plan, state)
    # "step N" printed: step N-1 is durable, N's commit may still be in the background; the
    # child may have run to the end before its output was read (a loaded machine)
    assert step is not None and target - 1 <= step <= STEPS
    r = execute(ssd_plan, state, *SCHEDULE)
    assert r.returncode == 0, r.stderr
    assert (f"resuming from step {step}" if step < STEPS else "nothing left to train") in r.stdout
    final_step, final = committed_state(ssd_plan, state)
    assert final_step == STEPS
    for name, buf in ref_state.items():
        assert torch.equal(final[name], buf), name


def test_execute_errors(ssd_plan, tmp_path, capsys):
    assert main(["execute", str(ssd_plan), "--hw-mismatch", "ok", "--steps", "2"]) == 2
    assert "--state-dir" in capsys.readouterr().err
    assert main(["execute", str(ssd_plan), "--hw-mismatch", "ok", "--steps", "2", "--state-dir", str(tmp_path / "s"),
                 "--data", str(tmp_path / "nope.bin")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("extra,needle", [
    (["--lr", "nan"], "--lr must be a finite number >= 0"),
    (["--lr", "inf"], "--lr must be a finite number >= 0"),
    (["--seed", "-1"], "seed -1 is outside [0, 2**63)"),
    (["--seed", str(2 ** 70)], f"seed {2 ** 70} is outside [0, 2**63)"),
    (["--trace", "/no-such-dir/trace.json"], "--trace /no-such-dir/trace.json: cannot write"),
])
def test_run_options_out_of_range_are_one_line_before_anything_is_written(extra, needle, ssd_plan, tmp_path, capsys):
    """A learning rate that is no finite number (it trained to NaN, or failed at the first update
    after the run record held it, so that the right rerun was refused), a seed torch cannot take,
    a trace nobody can write (found only after training)."""
    assert main(["execute", str(ssd_plan), "--hw-mismatch", "ok", "--steps", "2", "--state-dir", str(tmp_path / "s"),
                 *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and not (tmp_path / "s").exists()


def test_fp16_execute_logs_the_loss_scale_and_skipped_updates(tmp_path, capsys):
    """fp16-mixed runs say which steps overflow skipped, with the scale (text and JSON log)."""
    plan = tmp_path / "p.json"
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--policy", "lohan", "--precision", "fp16-mixed",
                 "--init-scale", str(2 ** 20), "--growth-interval", "2", "--batch", "2", "--seq", "32",
                 "-o", str(plan)]) == 0
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--steps", "4", "--state-dir", str(tmp_path / "st"),
                 "--log-json", str(tmp_path / "log.jsonl")]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step ")]
    records = [json.loads(l) for l in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [True, True, True, False]  # as GradScaler (test_executor)
    assert [r["loss_scale"] for r in records] == [2.0 ** 19, 2.0 ** 18, 2.0 ** 17, 2.0 ** 17]
    assert ["update skipped" in l for l in lines] == [True, True, True, False]


def test_auto_mode_overlaps_where_the_lanes_have_cores_of_their_own(monkeypatch):
    """`--mode auto` (the default): on CUDA overlap for a plan with SSD traffic and sync for one
    without; on a CPU device tier overlap when torch's threads leave a core for the other lanes,
    sync where the compute takes every core (the lanes would take cores from it); an explicit mode
    is kept."""
    import os

    import torch

    from tensorstow.executor.run import pick_mode
    from tensorstow.schema.plan import as_plan
    from tests.test_executor import get_plan
    on_ssd, resident = as_plan(get_plan("zero-infinity")), as_plan(get_plan("all-gpu"))
    assert on_ssd.ssd_sizes() and not resident.ssd_sizes()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert pick_mode("auto", device="cpu") == "sync"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert pick_mode("auto", device="cpu") == "overlap"
    assert pick_mode("overlap") == "overlap" and pick_mode("sync") == "sync"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from tensorstow.executor import cuda
    monkeypatch.setattr(cuda, "default_device", "cuda")  # as --device cuda
    assert pick_mode("auto", on_ssd) == "overlap"
    assert pick_mode("auto", resident, "cuda") == "sync"
    assert pick_mode("overlap", resident) == "overlap"
    # a plan that moves state through DRAM only: overlap where its computations are long enough
    # for the host to keep ahead of the GPU, else sync; an all-resident one stays sync however long
    import dataclasses

    from tensorstow.executor.run import OVERLAP_MIN_COMPUTE_S
    from tests.test_executor import policy_plan
    in_dram = as_plan(policy_plan("stronghold", gpu_mem=2_000_000))
    assert not in_dram.ssd_sizes() and any(k.endswith("->dram") for k in in_dram.predicted.traffic_bytes)

    def lasting(plan, seconds):
        return dataclasses.replace(plan, instructions=tuple(
            dataclasses.replace(i, est_s=seconds) if i.kind == "compute" else i for i in plan.instructions))
    assert pick_mode("auto", lasting(in_dram, OVERLAP_MIN_COMPUTE_S / 2)) == "sync"
    assert pick_mode("auto", lasting(in_dram, OVERLAP_MIN_COMPUTE_S)) == "overlap"
    assert pick_mode("auto", lasting(resident, 10 * OVERLAP_MIN_COMPUTE_S)) == "sync"


def test_ranks_on_cpu_devices_get_disjoint_cores():
    """`execute --nproc N` with CPU device tiers: each rank runs on its own share of the cores."""
    from tensorstow.executor.distributed import rank_cores
    assert [rank_cores([0, 1, 2, 3], r, 2) for r in range(2)] == [{0, 1}, {2, 3}]
    assert [rank_cores([0, 1, 2, 3, 4], r, 2) for r in range(2)] == [{0, 1}, {2, 3}]
    assert [rank_cores([4, 7], r, 3) for r in range(3)] == [{4}, {7}, {4}]


@pytest.mark.parametrize("name", ["gpu", "mps", "cuda:x"])
def test_an_unknown_device_is_one_clear_error(name, monkeypatch):
    """A device the executor cannot use, named by the argument or the process's default, is refused
    with one line naming it (torch's parser raised a bare RuntimeError for some)."""
    from tensorstow import TensorstowError
    from tensorstow.executor import cuda
    with pytest.raises(TensorstowError, match=rf"executor device '{name}'.*use cuda or cpu"):
        cuda.resolve_device(name)
    monkeypatch.setattr(cuda, "default_device", name)
    with pytest.raises(TensorstowError, match=rf"executor device '{name}' \(--device"):
        cuda.resolve_device(None)
