"""`execute --report-to tensorboard`: each step's scalars as TensorBoard events, read back with
tensorboard's own reader and compared with the JSON log of the same run."""
import json

import pytest

pytest.importorskip("tensorboard", reason="tensorboard (the test extra) reads the events back")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from tensorstow.cli import main  # noqa: E402


def scalars(logdir) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_the_logged_steps(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--gpu-mem", "1MB", "--batch", "2", "--seq", "32",
                 "-o", str(plan)]) == 0
    log, state = tmp_path / "log.jsonl", tmp_path / "state"
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--steps", "3", "--state-dir", str(state),
                 "--log-json", str(log), "--eval-data", "synthetic", "--eval-batches", "1", "--eval-every", "2",
                 "--report-to", "tensorboard"]) == 0
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    train = {r["step"]: r for r in rows if "loss" in r}
    evals = {r["step"]: r for r in rows if "eval_loss" in r}
    got = scalars(state / "runs")  # the state dir's runs/ by default
    # the same values as the JSON log, at float32 (TensorBoard's scalar precision)
    assert got["train/loss"] == {k: pytest.approx(r["loss"], rel=1e-6) for k, r in train.items()}
    assert got["train/learning_rate"] == {k: pytest.approx(r["lr"], rel=1e-6) for k, r in train.items()}
    assert got["train/tokens_per_second"] == {k: pytest.approx(r["tokens_per_s"], rel=1e-6) for k, r in train.items()}
    assert got["eval/loss"] == {k: pytest.approx(r["eval_loss"], rel=1e-6) for k, r in evals.items()}
    assert sorted(got["eval/loss"]) == [2, 3]
    from tensorstow.executor.run import predicted_step
    from tensorstow.schema.plan import Plan
    p = Plan.load(plan)
    predicted = set(got["train/predicted_step_seconds"].values())
    assert set(got["train/predicted_step_seconds"]) == {1, 2, 3} and len(predicted) == 1
    assert predicted.pop() in [pytest.approx(predicted_step(p, m), rel=1e-6) for m in ("sync", "overlap")]
    lanes = {tag for tag in got if tag.startswith("lanes/")}
    assert lanes == {f"lanes/{lane}_busy_seconds" for lane in train[1]["lane_busy_s"]}
    other = tmp_path / "tb"
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--steps", "1", "--report-to", "tensorboard",
                 "--logging-dir", str(other)]) == 0
    assert list(scalars(other)["train/loss"]) == [1]


def test_tensorboard_without_a_place_for_its_events_is_one_line(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--batch", "2", "--seq", "32", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["execute", str(plan), "--hw-mismatch", "ok", "--steps", "1", "--report-to", "tensorboard"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--report-to tensorboard needs --logging-dir DIR" in err


def test_a_resumed_run_replaces_the_events_of_the_steps_it_runs_again(tmp_path):
    """A run killed after logging a step it had not committed, then resumed: TensorBoard holds each step
    once (the resumed run drops the events after its last commit before logging those steps again)."""
    import signal
    import subprocess
    import sys
    plan = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--gpu-mem", "1MB", "--batch", "2", "--seq", "32",
                 "-o", str(plan)]) == 0
    state = tmp_path / "state"
    cmd = [sys.executable, "-m", "tensorstow.cli", "execute", str(plan), "--hw-mismatch", "ok", "--steps", "6",
           "--state-dir", str(state), "--report-to", "tensorboard", "--checkpoint-every", "2"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:
        if line.startswith("step 3/"):  # logged, and committed only at step 4
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "resuming from step" in r.stdout
    acc = EventAccumulator(str(state / "runs"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
