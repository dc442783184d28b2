"""A resume is the same run or it is refused; nothing of the user's is deleted; evaluations and
logs survive crashes; Ctrl-C stops at a safe point.

The run is the README's fine-tune on a tiny pretrained LLaMA: prompt/completion JSONL tokenized by
its own tokenizer, training state on the SSD, 4 microbatches a step, clipping with speculated
updates redone when it fires and deferred write-backs (`PLAN`), 2 epochs of 5 steps, warmup +
cosine, an evaluation every 3 steps and after the last. Runs go through the CLI in
this process (`main`), or, where a run must be killed, in a child process that SIGKILLs or
SIGINTs itself at a chosen point (`CHILD`).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from tensorstow.cli import main  # noqa: E402
from tensorstow.executor.lr import LRSchedule  # noqa: E402
from tests.test_finetune import LR, pairs, recipe, write_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVAL_AT = 10, (3, 6, 9, 10)
PLAN = ["--hw", "lohan-rtx4090", "--policy", "lohan", "--precision", "fp32", "--batch", "2", "--seq", "24",
        "--gpu-mem", "1MB", "--lr", str(LR), "--grad-accum", "4", "--max-grad-norm", "1", "--clip-rate", "0"]
"""Training state on the SSD; CPU updates that speculate (the clip fires every step here: each is
redone from the last commit) and the last blocks' write-backs deferred into the next step, which
commits the one before."""


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The checkpoint, data, plan and the uninterrupted run's result: {"dir", "plan", "train",
    "eval", "other", "weights", "evals"}."""
    d = tmp_path_factory.mktemp("resume")
    ckpt, _tok, _rows, _held, train, evals = recipe(d)
    plan = d / "plan.json"
    assert main(["plan", f"hf:{ckpt}", *PLAN, "--lr-scheduler", "cosine", "--warmup-steps", "2", "-o", str(plan)]) == 0
    decided = json.loads(plan.read_text())["decisions"]
    assert decided["speculated"] and decided["deferred_writes"]  # the hardest case of crash consistency
    out = {"dir": d, "plan": plan, "train": train, "eval": evals, "other": write_jsonl(d / "other.jsonl", pairs(40, 5))}
    assert main(args(out, d / "ref")) == 0
    out["weights"], out["evals"] = exported(d / "ref", d / "ref-out"), eval_losses(d / "ref")
    assert sorted(out["evals"]) == list(EVAL_AT)
    return out


def args(b, state, *extra) -> list[str]:
    return ["execute", str(b["plan"]), "--hw-mismatch", "ok", "--data", str(b["train"]), "--epochs", "2",
            "--eval-data", str(b["eval"]), "--eval-every", "3", "--state-dir", str(state), *map(str, extra)]


def exported(state, out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    assert main(["export", str(state), "-o", str(out)]) == 0
    return load_file(Path(out) / "model.safetensors")


def eval_losses(state) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in json.loads((Path(state) / "evals.json").read_text())}


def snapshot(root) -> dict[str, tuple[bytes, int]]:
    """Every file under `root`: its bytes and mode."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mode)
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def stopped_at(b, state, step: int) -> None:
    """Train in `state` until `step` is committed: a Ctrl-C (SIGINT) at that step's start stops the
    run after it, committed, exit 130."""
    from tensorstow.executor.executor import Executor
    real = Executor.step

    def step_then_stop(self, x, y):
        if self.steps_done + 1 == step:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, x, y)
    Executor.step = step_then_stop
    try:
        assert main(args(b, state)) == 130
    finally:
        Executor.step = real


@pytest.fixture(scope="module")
def at4(base, tmp_path_factory):
    """A state dir stopped by Ctrl-C after step 4 (committed), beside a copy of the data."""
    d = tmp_path_factory.mktemp("at4")
    shutil.copy(base["train"], d / "train.jsonl")
    stopped_at({**base, "train": d / "train.jsonl"}, d / "s", 4)
    return d


def copy_of(at4, tmp_path) -> tuple[dict, Path]:
    shutil.copytree(at4, tmp_path / "w")
    return tmp_path / "w", tmp_path / "w" / "s"


# ---- a resume with other inputs ------------------------------------------------------------------

CHANGES = {
    "edited data": (lambda w, b: ["--data", edited(w / "train.jsonl")], "--data", "data"),
    "other data": (lambda w, b: ["--data", b["other"]], "--data", "data"),
    "seed": (lambda w, b: ["--seed", "1"], "--seed 0 -> 1", "order"),
    "no shuffle": (lambda w, b: ["--no-shuffle"], "--shuffle True -> False", "order"),
    "epochs": (lambda w, b: ["--epochs", "3"], "--steps/--epochs 10 -> 15", "length"),
    "scheduler": (lambda w, b: ["--lr-scheduler", "linear"], "--lr-scheduler cosine -> linear", "schedule"),
    "warmup": (lambda w, b: ["--warmup-steps", "1"], "--warmup-steps 2 -> 1", "schedule"),
    "lr": (lambda w, b: ["--lr", "1e-3"], f"--lr {LR} -> 0.001", "schedule"),
    "eval cadence": (lambda w, b: ["--eval-every", "2"], "--eval-every 3 -> 2", "eval"),
    "eval data": (lambda w, b: ["--eval-data", b["other"]], "--eval-data/--eval-batches", "eval"),
    "recipe": (lambda w, b: ["--config", recipe_file(w / "r.toml", "warmup_steps = 1")], "--warmup-steps 2 -> 1",
               "schedule"),
}


def edited(path: Path) -> Path:
    """`path` with one example's completion changed, in place."""
    lines = path.read_text().splitlines(keepends=True)
    row = json.loads(lines[2])
    row["completion"] += " the park"
    lines[2] = json.dumps(row) + "\n"
    path.write_text("".join(lines))
    return path


def recipe_file(path: Path, line: str) -> Path:
    path.write_text(f"[execute]\n{line}\n")
    return path


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_resume_with_another_input_is_refused_before_any_step_and_changes_nothing(change, base, at4, tmp_path,
                                                                                    capsys):
    """Each input a run records, changed: one line naming it (old -> new) and the
    `--resume-changed` group that would accept it; no step trained; every file in the work dir
    (state dir and data) byte for byte as it was. Each of these resumed silently into another run."""
    w, s = copy_of(at4, tmp_path)
    extra, named, group = CHANGES[change]
    extra = extra(w, base)
    before = snapshot(w)
    capsys.readouterr()
    assert main([*args({**base, "train": w / "train.jsonl"}, s), *map(str, extra)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("tensorstow: error: state dir") and err.count("\n") == 1, err
    assert named in err and f"--resume-changed {group}" in err, err
    assert "step 5/" not in out
    assert snapshot(w) == before


def test_accepted_changes_continue_as_documented_and_are_recorded(base, at4, tmp_path, capsys):
    """`--resume-changed length`: 3 epochs, the cosine still spans the 10 steps it was made for (its
    end's rate, 0, after them); `length,schedule`: the cosine spread over the 15 steps. Both record
    the change and the step it came in at; the next resume with the new inputs needs no flag."""
    for accepted, total in (("length", STEPS), ("length,schedule", 15)):
        w, s = copy_of(at4, tmp_path / accepted)
        log = w / "log.jsonl"
        run = [*args({**base, "train": w / "train.jsonl"}, s), "--epochs", "3", "--log-json", str(log)]
        assert main([*run, "--resume-changed", accepted]) == 0
        assert "resuming with changed inputs (--steps/--epochs 10 -> 15)" in capsys.readouterr().out
        want = LRSchedule("cosine", LR, 2, total)
        rates = {r["step"]: r["lr"] for r in map(json.loads, log.read_text().splitlines()) if "lr" in r}
        assert sorted(rates) == list(range(5, 16))
        assert all(rates[k] == want(k - 1) for k in rates), (accepted, rates)
        record = json.loads((s / "run.json").read_text())
        assert record["inputs"]["steps"] == 15 and record["inputs"]["schedule_steps"] == total
        assert record["changes"] == [{"step": 4, "accepted": sorted(accepted.split(",")), "was": {"steps": 10}}]
        assert main(run) == 0
        assert "nothing left to train" in capsys.readouterr().out
    assert rates[15] > 0 and want(9) < LR  # schedule spread over 15 steps: still decaying at the end


def test_a_replan_of_the_schedule_alone_is_a_changed_input_and_diff_names_it(base, at4, tmp_path, capsys):
    """A plan re-made with another --lr-scheduler and --warmup-steps trains the same state: its
    resume is refused as a changed schedule (not "another plan"), accepted with `--resume-changed
    schedule`; `tensorstow diff` names both options (it called the two plans identical)."""
    other = tmp_path / "linear.json"
    opts = json.loads(Path(base["plan"]).read_text())["options"]
    assert main(["plan", opts["model"], *PLAN, "--lr-scheduler", "linear", "-o", str(other)]) == 0
    capsys.readouterr()
    assert main(["diff", str(base["plan"]), str(other)]) == 1
    shown = capsys.readouterr().out
    assert "option lr_scheduler: cosine -> linear" in shown and "option warmup_steps: 2 -> 0" in shown
    w, s = copy_of(at4, tmp_path)
    run = args({**base, "plan": other, "train": w / "train.jsonl"}, s)
    before = snapshot(w)
    assert main(run) == 2
    err = capsys.readouterr().err
    assert "another plan" not in err and "--lr-scheduler cosine -> linear" in err and "--resume-changed schedule" in err
    assert snapshot(w) == before
    assert main([*run, "--resume-changed", "schedule"]) == 0


# ---- nothing of the user's deleted ---------------------------------------------------------------

def user_tree(root: Path, base) -> Path:
    """A model directory as a user keeps one: the checkpoint's files (config.json among them),
    a subdirectory, and files whose names the store uses for its own."""
    shutil.copytree(Path(base["dir"]) / "ckpt", root)
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("fine-tune me\n")
    (root / "plan.json").write_text('{"my": "plan"}\n')
    (root / "weights.slot0").write_bytes(b"mine")
    return root


@pytest.mark.parametrize("restart", [True, False])
def test_a_directory_that_is_not_a_state_dir_is_refused_untouched(restart, base, tmp_path, capsys):
    """`--state-dir` naming a model directory: refused in one line before anything is written or
    deleted (`--restart` deleted its config.json, plan.json and every other name the store owns,
    and a plain refusal left plan.json and LOCK behind)."""
    d = user_tree(tmp_path / "base_copy", base)
    before = snapshot(d)
    capsys.readouterr()
    assert main([*args(base, d), *(["--restart"] if restart else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tensorstow: error: --state-dir {d} is not a tensorstow state dir") and err.count("\n") == 1
    assert snapshot(d) == before


def test_restart_deletes_only_what_the_state_dirs_records_name(base, at4, tmp_path, capsys):
    """A state dir the user also keeps files in (a subdirectory, a `.slot0` of their own):
    `--restart` deletes the store's files and the run's description and record, keeps every file
    of the user's byte for byte, and trains from step 0 to the uninterrupted run's weights; while
    another process holds the state dir, `--restart` is refused and deletes nothing."""
    from tensorstow.executor.manifest import dir_lock
    w, s = copy_of(at4, tmp_path)
    user_tree(tmp_path / "u", base)
    shutil.copytree(tmp_path / "u" / "notes", s / "notes")
    shutil.copy(tmp_path / "u" / "weights.slot0", s / "weights.slot0")
    mine = {k: v for k, v in snapshot(s).items() if k.startswith("notes") or k == "weights.slot0"}
    before = snapshot(s)
    with dir_lock(s):
        assert main([*args({**base, "train": w / "train.jsonl"}, s), "--restart"]) == 2
    assert "locked by another tensorstow process" in capsys.readouterr().err
    assert snapshot(s) == before
    assert main([*args({**base, "train": w / "train.jsonl"}, s), "--restart"]) == 0
    assert "resuming" not in capsys.readouterr().out
    after = snapshot(s)
    assert {k: after[k] for k in mine} == mine
    got = exported(s, tmp_path / "e")
    assert all(torch.equal(got[n], base["weights"][n]) for n in base["weights"])
    assert eval_losses(s) == base["evals"]


# ---- crashes, Ctrl-C and logs: a property of any sequence of them --------------------------------

CHILD = """
import os, signal, sys
from tensorstow.cli import main
from tensorstow.executor.executor import Executor
from tensorstow.executor.manifest import StoreFiles
point, at = sys.argv[1], int(sys.argv[2])

def hook(cls, name, when):
    real = getattr(cls, name)
    def call(self, *a, **kw):
        when(self, a)
        return real(self, *a, **kw)
    setattr(cls, name, call)

if point == "step":       # SIGKILL as step `at` begins
    hook(Executor, "step", lambda ex, a: ex.steps_done + 1 == at and os.kill(os.getpid(), signal.SIGKILL))
elif point == "commit":   # SIGKILL inside the commit of step `at`: its slots written, the manifest not
    hook(StoreFiles, "write", lambda files, a: a[0]["step"] == at and os.kill(os.getpid(), signal.SIGKILL))
elif point == "eval":     # SIGKILL inside the evaluation after step `at`, its batches evaluated
    real_evaluate = Executor.evaluate
    def evaluate(self, batches):
        def killing():
            yield from batches
            os.kill(os.getpid(), signal.SIGKILL)
        return real_evaluate(self, killing() if self.steps_done == at else batches)
    Executor.evaluate = evaluate
elif point in ("sigint", "sigint2"):  # Ctrl-C as step `at` begins (sigint2: twice)
    def ctrl_c(ex, a):
        if ex.steps_done + 1 == at:
            for _ in range(1 + (point == "sigint2")):
                os.kill(os.getpid(), signal.SIGINT)
    hook(Executor, "step", ctrl_c)
sys.exit(main(sys.argv[3:]))
"""


def child(point: str, at: int, argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", CHILD, point, str(at), *argv], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)


def committed(state: Path) -> int | None:
    from tensorstow.executor import statedir as sd
    from tensorstow.executor.ssd import SSDStore
    from tensorstow.schema.plan import Plan
    if not (state / "plan.json").exists():
        return None
    plan = Plan.load(state / "plan.json")
    try:
        with SSDStore(state, sd.store_sizes(plan), read_only=True) as st:
            return st.committed_step()
    except Exception:  # noqa: BLE001 - no store yet
        return None


EVENTS = st.one_of(
    st.tuples(st.just("step"), st.integers(1, STEPS)),
    st.tuples(st.just("commit"), st.integers(1, STEPS)),
    st.tuples(st.just("eval"), st.sampled_from(EVAL_AT)),
    st.tuples(st.sampled_from(["sigint", "sigint2"]), st.integers(1, STEPS)),
    st.tuples(st.just("changed"), st.sampled_from(sorted(set(CHANGES) - {"edited data", "recipe"}))))


# the two examples hold every kind of event, the random sequence mixes them otherwise
@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(events=st.lists(EVENTS, min_size=1, max_size=3))
@example(events=[("eval", 3), ("changed", "seed"), ("sigint", 5), ("eval", 10)])  # killed in an evaluation, another
#   seed refused, Ctrl-C, killed in the final evaluation
@example(events=[("sigint2", 2), ("changed", "epochs"), ("commit", 7), ("step", 9)])  # Ctrl-C twice, a longer run
#   refused, killed mid-commit, killed as a step begins
def test_any_sequence_of_kills_ctrl_c_and_changed_resumes_ends_as_the_uninterrupted_run(events, base, tmp_path_factory):
    """Random sequences of {SIGKILL at a step's start, inside a commit or inside an evaluation;
    Ctrl-C once or twice; a resume with one input changed}, then a resume with the same inputs to
    the end: the weights and every evaluation equal the uninterrupted run's, bit for bit; each
    changed resume of a committed run is refused before any step, the state dir byte-identical;
    each Ctrl-C exits 130 with one line and no traceback."""
    w = tmp_path_factory.mktemp("seq")
    s = w / "s"
    run = args(base, s)
    for point, at in events:
        if point == "changed":
            if committed(s) is None:
                continue  # nothing committed: the run begins again with these inputs, no resume to refuse
            before = snapshot(s)
            assert main([*run, *map(str, CHANGES[at][0](w, base))]) == 2
            assert snapshot(s) == before
            continue
        r = child(point, at, run)
        assert "Traceback" not in r.stderr, r.stderr
        assert r.returncode in (0, -9, 130), r.stderr
        if r.returncode == 130:
            last = r.stderr.strip().splitlines()[-1]
            assert last.startswith("tensorstow: interrupted"), r.stderr
            if point == "sigint":
                assert last == f"tensorstow: interrupted at step {at}; committed step {at}; rerun the same command " \
                               f"to resume"
    assert main(run) == 0
    got = exported(s, w / "out")
    assert got.keys() == base["weights"].keys()
    assert all(torch.equal(got[n], base["weights"][n]) for n in got)
    assert eval_losses(s) == base["evals"]


def test_a_torn_log_record_is_cut_on_resume_and_a_full_disk_leaves_none(base, at4, tmp_path, monkeypatch, capsys):
    """A log whose last record a kill tore (no newline): the resume cuts it, says so, and appends
    whole records. A write that fails half-way (a full disk) is cut at once, and the error names the
    log's path (it named none, and the torn record made the log invalid for good)."""
    from tensorstow.errors import TensorstowError
    from tensorstow.executor import run as run_module
    w, s = copy_of(at4, tmp_path)
    log = w / "log.jsonl"
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert main([*args({**base, "train": w / "train.jsonl"}, s), "--log-json", str(log)]) == 0
    assert f"log {log}: cut a torn last record (15 bytes)" in capsys.readouterr().out
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert rows[0] == {"step": 1, "loss": 2.0} and [r["step"] for r in rows if "loss" in r][1:] == list(range(5, 11))
    size = log.stat().st_size
    real_write = os.write

    def half_then_full(fd, data):
        real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(28, os.strerror(28))
    monkeypatch.setattr(run_module.os, "write", half_then_full)
    with run_module._Log(str(log), sys.stdout) as lg, pytest.raises(TensorstowError) as e:
        lg.write({"step": 11, "loss": 1.0})
    assert str(e.value).startswith(f"--log-json {log}: cannot write step 11's record (disk full")
    monkeypatch.undo()
    assert log.stat().st_size == size


@pytest.mark.parametrize("extra, says", [
    (["--warmup-steps", "50"], "the warmup (50 optimizer steps) is longer than the run (10)"),
    (["--data", "FEW"], "holds 3 rows, fewer than one step's 8 (batch 2 x 4 microbatches)"),
    (["--data", "MISSING"], "does not exist: pass a JSONL file, a `datasets` directory"),
    (["--resume-changed", "seeds"], "--resume-changed: unknown group(s) seeds"),
])
def test_a_run_that_would_not_train_as_asked_is_one_line(extra, says, base, tmp_path, capsys):
    """A warmup longer than the run (its rate stayed under 5e-9 throughout), fewer examples than
    one step (it trained nothing and said "nothing to do"), a missing data directory (it said
    "give --steps, or --epochs"), a misspelt group: each refused in one line."""
    few = write_jsonl(tmp_path / "few.jsonl", pairs(3))
    extra = [{"FEW": str(few), "MISSING": str(tmp_path / "no" / "such-dir")}.get(a, a) for a in extra]
    capsys.readouterr()
    assert main([*args(base, tmp_path / "s"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorstow: error: ") and says in err and err.count("\n") == 1, err


def test_evaluate_reads_a_read_only_state_dir(base, at4, tmp_path, monkeypatch, capsys):
    """`tensorstow evaluate` only reads the state dir, so it reads one on a read-only filesystem
    (as export does; it was refused as not writable), and evaluates a plan with a cosine schedule
    (it asked for the run's length, which an evaluation has no use for)."""
    from tests.test_state_selfcheck import _read_only
    w, s = copy_of(at4, tmp_path)
    before = snapshot(w)
    _read_only(monkeypatch, w)
    capsys.readouterr()
    assert main(["evaluate", str(base["plan"]), "--state-dir", str(s), "--data", str(base["eval"])]) == 0
    assert capsys.readouterr().out.startswith("step 4: eval loss ")
    monkeypatch.undo()
    assert snapshot(w) == before


def test_a_token_file_is_the_same_data_for_a_longer_run_and_other_data_once_edited(tmp_path):
    """A token file's identity is the prefix a run reads: a longer run of the same file is the same
    data; an edit inside the recorded run's prefix is other data, one past it is not."""
    import numpy as np
    from tensorstow.executor.run import _token_data
    path = tmp_path / "train.npy"
    tokens = np.arange(400, dtype=np.int64) % 97
    np.save(path, tokens)
    recorded = _token_data(str(path), 100, 97).record
    assert _token_data(str(path), 300, 97).same(recorded)
    tokens[150] += 1  # past what the recorded run read
    np.save(path, tokens)
    assert _token_data(str(path), 300, 97).same(recorded)
    tokens[50] += 1
    np.save(path, tokens)
    assert not _token_data(str(path), 300, 97).same(recorded)
    assert not _token_data("synthetic", 300, 97).same(recorded)


def test_a_shorter_run_than_committed_trains_nothing_and_records_nothing(base, at4, tmp_path, capsys):
    """`--steps 2` on a state dir at step 4: under a cosine a changed length (refused); accepted,
    nothing to train, and neither the run record nor the evaluations change (step 4's weights were
    evaluated and recorded as step 2's)."""
    w, s = copy_of(at4, tmp_path)
    run = [*args({**base, "train": w / "train.jsonl"}, s), "--steps", "2"]
    before = snapshot(w)
    capsys.readouterr()
    assert main(run) == 2 and "--steps/--epochs 10 -> 2" in capsys.readouterr().err
    assert main([*run, "--resume-changed", "length"]) == 0
    assert "already holds step 4, past the 2 steps asked for: nothing to train" in capsys.readouterr().out
    assert snapshot(w) == before


def test_damaged_records_and_files_that_are_no_log_are_one_line(base, at4, tmp_path, capsys):
    """A run record edited into another shape, and a --log-json file that is not a log (its last
    line cut as if torn): one line each, nothing changed."""
    w, s = copy_of(at4, tmp_path)
    rec = json.loads((s / "run.json").read_text())
    del rec["changes"]
    (s / "run.json").write_text(json.dumps(rec))
    notes = w / "notes.txt"
    notes.write_text("first line\nsecond line, no newline")
    before = snapshot(w)
    capsys.readouterr()
    assert main(args({**base, "train": w / "train.jsonl"}, s)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tensorstow: error: state dir {s}: run.json is not a tensorstow run record") and \
        err.count("\n") == 1, err
    (s / "run.json").write_text(json.dumps({**rec, "changes": []}))
    assert main([*args({**base, "train": w / "train.jsonl"}, s), "--log-json", str(notes)]) == 2
    err = capsys.readouterr().err
    assert "its last line is not a JSON record" in err and err.count("\n") == 1, err
    assert notes.read_bytes() == before["notes.txt"][0]


def test_the_directory_of_a_multi_process_run_is_claimed_as_a_state_dir(tmp_path):
    """A multi-process run keeps each rank's state in `rank<K>/` inside its --state-dir: that
    directory, too, must be new, empty or already theirs (the ranks making their directories at
    once), else it is refused before anything is written in it."""
    from tensorstow.errors import TensorstowError
    from tensorstow.executor.statedir import claim_parent
    user = tmp_path / "model"
    user.mkdir()
    (user / "config.json").write_text("{}")
    with pytest.raises(TensorstowError, match="is not a tensorstow state dir"):
        claim_parent(user)
    assert sorted(p.name for p in user.iterdir()) == ["config.json"]
    racing = tmp_path / "state"
    (racing / "rank1").mkdir(parents=True)  # another rank got there first
    assert claim_parent(racing) == racing and (racing / "tensorstow.json").is_file()


@pytest.mark.parametrize("text", ["my notes\nsecond line\n", "my notes\n{\"step\": 1", "[1, 2]\n"],
                         ids=["text", "text-then-torn-record", "json-not-a-record"])
def test_a_log_path_holding_a_users_file_is_refused_untouched(text, tmp_path):
    """`--log-json` on a file that is no log of execute's (its last whole line is no JSON record):
    refused in one line, the file left as it was (a text ending in a newline had a record appended)."""
    from tensorstow.errors import TensorstowError
    from tensorstow.executor import run as run_module
    path = tmp_path / "notes.txt"
    path.write_text(text)
    with pytest.raises(TensorstowError, match="no log of"):
        run_module._Log(str(path), sys.stdout)
    assert path.read_text() == text


@pytest.mark.parametrize("text", ["", "\n", '{"step": 1, "loss": 2.0}\n\n'], ids=["empty", "blank", "blank-after-a-record"])
def test_a_log_of_ours_or_an_empty_file_is_appended_to(text, tmp_path):
    """An empty file, or a log whose last record a blank line follows, is taken as a log."""
    from tensorstow.executor import run as run_module
    path = tmp_path / "log.jsonl"
    path.write_text(text)
    with run_module._Log(str(path), sys.stdout) as lg:
        lg.write({"step": 2, "loss": 1.0})
    assert path.read_text().endswith('{"step": 2, "loss": 1.0}\n') and path.read_text().startswith(text)
