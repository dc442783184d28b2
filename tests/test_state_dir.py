"""The state dir: self-describing, full checkpoints (off-SSD state and the RNG included),
export to safetensors, one execute at a time, and disk full without losing the last commit.

Runs go through the CLI in-process (`main([...])`), as a user would type them."""
import gc
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tensorstow.executor.ssd import SSDStore
from tensorstow.executor.statedir import store_sizes
from tensorstow.cli import main
from tensorstow.schema.plan import Plan

MODEL = "tests.fixtures.real_models:nano_gpt_dropout"  # tied head, dropout: the RNG must resume too
COMMON = ["--hw", "lohan-rtx4090", "--batch", "2", "--seq", "16", "--precision", "fp32", "--lr", "1e-3",
          "--exact-optimizer"]  # compared with eager bit for bit


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Three offloaded plans of one model: stronghold keeps parameters and Adam states in DRAM,
    zero-infinity on SSD, and lohan through 600 KB of DRAM on SSD, with the write-backs of the
    blocks updated last deferred to the next step (`Decisions.deferred_writes`: each step commits
    the one before once they are home)."""
    d = tmp_path_factory.mktemp("plans")
    out = {}
    for policy, extra in (("stronghold", []), ("zero-infinity", []), ("lohan", ["--dram", "600KB"])):
        path = d / f"{policy}.json"
        assert main(["plan", MODEL, *COMMON, "--policy", policy, "--gpu-mem", "400KB", *extra, "-o", str(path)]) == 0
        homes = {b["home"] for b in json.loads(path.read_text())["buffers"].values() if b["home"]}
        assert homes - {"gpu"}, f"{policy} does not offload"
        out[policy] = path
    assert "ssd" not in {b["home"] for b in json.loads(out["stronghold"].read_text())["buffers"].values()}
    assert json.loads(out["lohan"].read_text())["decisions"]["deferred_writes"]
    return out


def execute(plan, state, steps, *extra):
    return main(["execute", str(plan), "--hw-mismatch", "ok", "--steps", str(steps), "--state-dir", str(state), *extra])


def exported(state, out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    assert main(["export", str(state), "-o", str(out)]) == 0
    tensors = {}
    for f in sorted(Path(out).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def eager_params(steps: int) -> dict[str, torch.Tensor]:
    """Eager training of the same model and data as `tensorstow execute --seed 0`."""
    from tensorstow.executor.data import batches
    from tests.fixtures import real_models
    from tests.oracle import train_eager
    torch.manual_seed(0)
    return train_eager(real_models.nano_gpt_dropout(), batches("synthetic", 2, 16, 128, steps, seed=0), lr=1e-3,
                       loss=lambda m, x, y: m(x, y)[1])[1]


@pytest.mark.parametrize("policy", ["stronghold", "zero-infinity", "lohan"])
def test_interrupted_and_resumed_equals_uninterrupted_and_eager(policy, plans, tmp_path):
    """Stop after 2 steps, resume to 4: the exported weights equal 4 uninterrupted steps and 4
    eager steps (DRAM-resident state and the dropout stream come back from the checkpoint)."""
    assert execute(plans[policy], tmp_path / "a", 4) == 0
    assert execute(plans[policy], tmp_path / "b", 2) == 0
    assert execute(plans[policy], tmp_path / "b", 4) == 0
    a, b = exported(tmp_path / "a", tmp_path / "ea"), exported(tmp_path / "b", tmp_path / "eb")
    want = eager_params(4)
    assert a.keys() == b.keys() == want.keys() - {"lm_head.weight"}  # tied: stored once
    for n in a:
        assert torch.equal(a[n], b[n]) and torch.equal(a[n], want[n]), n


def test_state_dir_is_self_describing_and_trains_one_plan(plans, tmp_path, capsys):
    assert execute(plans["stronghold"], tmp_path / "s", 1) == 0
    held = json.loads((tmp_path / "s" / "plan.json").read_text())
    assert held == json.loads(plans["stronghold"].read_text())
    assert (tmp_path / "s" / "layout.json").is_file()
    capsys.readouterr()
    assert execute(plans["zero-infinity"], tmp_path / "s", 2) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trains another plan" in err[0]


def test_a_second_execute_on_a_state_dir_is_refused(plans, tmp_path, capsys):
    assert execute(plans["zero-infinity"], tmp_path / "s", 1) == 0
    plan = json.loads(plans["zero-infinity"].read_text())
    with SSDStore(tmp_path / "s", store_sizes(plan)):  # as if another execute held it
        capsys.readouterr()
        assert execute(plans["zero-infinity"], tmp_path / "s", 2) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "lock" in err[0].lower(), err
        assert main(["export", str(tmp_path / "s"), "-o", str(tmp_path / "out")]) == 2
        assert not (tmp_path / "out").exists()
    assert execute(plans["zero-infinity"], tmp_path / "s", 2) == 0  # released: it resumes


def test_a_state_dir_holds_a_one_process_run_or_a_several_process_one_never_both(plans, tmp_path, capsys):
    """A one-process run's state dir refuses a run of several processes (their rank<K>/ would sit
    beside its store), and theirs a one-process run, in one line before anything is written;
    export refuses a directory holding both rather than pick one; `--nproc` below 1 is refused
    before anything is written; a rank<K>/ of the user's makes its parent no state dir."""
    from tensorstow.errors import TensorstowError
    from tensorstow.executor import statedir
    plan = Plan.load(plans["zero-infinity"])
    one = tmp_path / "one"
    assert execute(plans["zero-infinity"], one, 1) == 0
    before = sorted(p.name for p in one.iterdir())
    with pytest.raises(TensorstowError, match="holds a one-process run"):
        statedir.claim_parent(one)
    assert sorted(p.name for p in one.iterdir()) == before
    many = tmp_path / "many"
    statedir.claim_parent(many)
    statedir.claim(many / "rank0", plan)
    capsys.readouterr()
    assert execute(plans["zero-infinity"], many, 1) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank0/" in err and "--nproc" in err
    assert sorted(p.name for p in many.iterdir()) == ["rank0", "tensorstow.json"]
    both = tmp_path / "both"
    shutil.copytree(one, both)
    shutil.copytree(one, both / "rank0")
    assert main(["export", str(both), "-o", str(tmp_path / "out")]) == 2
    assert "written by two runs" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert execute(plans["zero-infinity"], tmp_path / "zero", 1, "--nproc", "0") == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err and not (tmp_path / "zero").exists()
    users = tmp_path / "users"
    (users / "rank0").mkdir(parents=True)
    (users / "rank0" / "notes.txt").write_text("mine")
    with pytest.raises(TensorstowError, match="not a tensorstow state dir"):
        statedir.claim_parent(users)
    assert sorted(p.name for p in users.iterdir()) == ["rank0"]


def test_export_shards_and_index(plans, tmp_path):
    from safetensors.torch import load_file
    assert execute(plans["zero-infinity"], tmp_path / "s", 1) == 0
    assert main(["export", str(tmp_path / "s"), "-o", str(tmp_path / "out"), "--shard-size", "20KB"]) == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((tmp_path / "out" / f).is_file() for f in files)
    assert all(name in load_file(tmp_path / "out" / f) for name, f in index["weight_map"].items())
    one = exported(tmp_path / "s", tmp_path / "one")
    assert set(one) == set(index["weight_map"])


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MB tmpfs, so the disk really fills (needs root, as CI has; skipped otherwise)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_is_one_line_and_keeps_the_last_commit(plans, small_fs, tmp_path, capsys):
    state = small_fs / "s"
    assert execute(plans["zero-infinity"], state, 2) == 0
    filler = small_fs / "filler"
    with open(filler, "wb") as f:  # take every byte that is left
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    capsys.readouterr()
    gc.disable()  # the failed run must release the store's lock itself, not by being collected
    try:
        assert execute(plans["zero-infinity"], state, 4) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "No space left" in err[0] and str(small_fs) in err[0], "\n".join(err)
        filler.unlink()
        assert execute(plans["zero-infinity"], state, 4) == 0  # resumes from the intact step 2
    finally:
        gc.enable()
    assert execute(plans["zero-infinity"], tmp_path / "ref", 4) == 0
    got, want = exported(state, tmp_path / "e1"), exported(tmp_path / "ref", tmp_path / "e2")
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_disk_too_small_for_the_state_dir_is_refused_before_anything_is_written(plans, tmp_path, capsys):
    """The summary states the disk the state dir takes (two slots of every buffer its store keeps:
    exactly what the store preallocates); on a filesystem with less free, execute stops before
    the first step with one line naming both figures and writes no slot (a real tmpfs of half
    the need); with room, every step's progress line and log give its SSD traffic, the reads
    exactly the plan's loads from SSD."""
    from tensorstow.cli import _fmt, load_plan, state_disk_bytes
    plan = load_plan(str(plans["zero-infinity"]))
    need = state_disk_bytes(plan)
    assert main(["show", str(plans["zero-infinity"])]) == 0
    out = capsys.readouterr().out
    assert f"state dir: {_fmt(need)} of disk" in out and "--state-dir, required" in out
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={need // 2 // 1024}k", "tmpfs", str(mnt)],
            capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        assert execute(plans["zero-infinity"], mnt / "s", 2) == 2
        out, err = capsys.readouterr()
        assert err.startswith("tensorstow: error: SSD store: ") and err.count("\n") == 1, err
        assert "needs" in err and "free space or choose a larger disk" in err
        assert "step 1/2" not in out and not list((mnt / "s").glob("*.slot[01]"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    log = tmp_path / "log.jsonl"
    assert execute(plans["zero-infinity"], tmp_path / "s", 2, "--log-json", str(log)) == 0
    slots = sum(p.stat().st_size for p in (tmp_path / "s").glob("*.slot[01]"))
    assert slots == need
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2 and all(" ssd read " in ln and " GB/s write " in ln for ln in lines)
    loads = sum(plan.buffers[i.tensor].bytes for i in plan.instructions if i.kind == "load" and i.src == "ssd")
    stores = sum(plan.buffers[i.tensor].bytes for i in plan.instructions if i.kind == "store" and i.dst == "ssd")
    for row in map(json.loads, log.read_text().splitlines()):
        assert row["ssd_read_bytes"] == loads and row["ssd_written_bytes"] >= stores > 0


def _cli(*args) -> subprocess.Popen:
    import os
    import sys
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}  # tests.fixtures
    return subprocess.Popen([sys.executable, "-m", "tensorstow.cli", *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _killed_at_random(args, rng, runtime: float, kills: int) -> int:
    """Start `tensorstow ARGS` again and again, SIGKILL-ing each run at a random moment of a run's
    length (import, initialisation, any step, the commit), `kills` times; then let one finish."""
    import time
    for _ in range(kills):
        p = _cli(*args)
        try:
            time.sleep(rng.uniform(0, runtime))
        finally:
            p.kill()
            p.wait()
    p = _cli(*args)
    return p.wait()


@pytest.mark.parametrize("policy", ["zero-infinity", "lohan"])
def test_sigkills_then_resume_equal_an_uninterrupted_run(policy, plans, tmp_path):
    """Four kills of each: a plan committing at the end of each step, and one whose steps commit
    the step before once its deferred write-backs are home."""
    import random
    import time
    rng = random.Random(7)
    args = ["execute", plans[policy], "--hw-mismatch", "ok", "--steps", 6, "--state-dir"]
    t0 = time.monotonic()
    p = _cli(*args, tmp_path / "ref")
    assert p.wait() == 0
    runtime = time.monotonic() - t0  # this machine's pace, now: kills land all over a run
    assert _killed_at_random([*args, tmp_path / "killed"], rng, runtime, kills=4) == 0
    # export killed at random moments: OUT_DIR is never half-written (absent, or complete)
    from safetensors.torch import load_file
    out = tmp_path / "out"
    for _ in range(4 if policy == "zero-infinity" else 0):
        p = _cli("export", tmp_path / "killed", "-o", out)
        time.sleep(rng.uniform(0, 3.0))
        p.kill()
        p.wait()
        if out.exists():
            assert (out / "model.safetensors").is_file() and load_file(out / "model.safetensors")
            shutil.rmtree(out)
    assert _cli("export", tmp_path / "killed", "-o", out).wait() == 0
    got = load_file(out / "model.safetensors")
    want = exported(tmp_path / "ref", tmp_path / "ref-out")
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("policy", ["stronghold", "zero-infinity"])
def test_the_api_state_dir_checkpoints_resumes_and_exports_any_plan(policy, plans, tmp_path):
    """`tensorstow.Executor(plan, model, state_dir=D)` keeps the run as `execute --state-dir` does,
    for a plan with DRAM-resident state (stronghold) as for one on SSD: 2 steps, `checkpoint()`,
    a new executor resuming from D for 2 more, then `tensorstow export D` equals 4 eager steps."""
    import tensorstow
    from tensorstow.executor.data import batches
    from tests.fixtures import real_models
    data = list(batches("synthetic", 2, 16, 128, 4, seed=0))
    torch.manual_seed(0)
    ex = tensorstow.Executor(tensorstow.Plan.load(plans[policy]), real_models.nano_gpt_dropout(), state_dir=tmp_path / "s")
    for x, y in data[:2]:
        ex.step(x, y)
    ex.checkpoint()
    ex.close()
    with pytest.raises(Exception, match="resume=True"):
        tensorstow.Executor(tensorstow.Plan.load(plans[policy]), real_models.nano_gpt_dropout(), state_dir=tmp_path / "s")
    torch.manual_seed(1)  # its values must not be used
    ex = tensorstow.Executor(tensorstow.Plan.load(plans[policy]), real_models.nano_gpt_dropout(), state_dir=tmp_path / "s", resume=True)
    assert ex.steps_done == 2
    for x, y in data[2:]:
        ex.step(x, y)
    ex.checkpoint()
    ex.close()
    got, want = exported(tmp_path / "s", tmp_path / "e"), eager_params(4)
    assert got.keys() == want.keys() - {"lm_head.weight"}
    for n in got:
        assert torch.equal(got[n], want[n]), n


def eager_clipped(steps: int, max_norm: float) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Eager training with `clip_grad_norm_(model.parameters(), max_norm)` before each AdamW step:
    (losses, the norms it returned, parameters)."""
    from tensorstow.executor.data import batches
    from tests.fixtures import real_models
    from tests.oracle import param_groups
    torch.manual_seed(0)
    model = real_models.nano_gpt_dropout()
    opt = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-3, foreach=False)
    losses, norms = [], []
    for x, y in batches("synthetic", 2, 16, 128, steps, seed=0):
        opt.zero_grad()
        loss = model(x, y)[1]
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["lohan", "zero-infinity"])
@pytest.mark.parametrize("max_norm", [1.0, 9.3, 1e6], ids=["every-step", "some-steps", "never"])
def test_clipping_by_the_global_norm_equals_eager_clip_grad_norm(policy, max_norm, tmp_path):
    """`--max-grad-norm`: through offloaded plans with SSD state, the losses, the logged norms
    (the Trainer's grad_norm) and the weights equal eager `clip_grad_norm_` + AdamW bit for bit,
    whether the clip fires on every step (norms ~9 > 1), on some, or on none; every update waits
    for the last backward (its factor needs every gradient)."""
    plan = tmp_path / "p.json"
    extra = ["--dram", "600KB"] if policy == "lohan" else []
    assert main(["plan", MODEL, *COMMON, "--policy", policy, "--gpu-mem", "400KB", *extra,
                 "--max-grad-norm", str(max_norm), "--clip-rate", "1", "-o", str(plan)]) == 0
    p = json.loads(plan.read_text())
    assert p["options"]["max_grad_norm"] == max_norm and not p["decisions"].get("deferred_writes")
    assert "speculated" not in p["decisions"]  # clip rate 1: waiting for the norm is the faster form
    ins = p["instructions"]
    last_bwd = max(i["id"] for i in ins if i["kind"] == "compute" and i.get("segment", "").startswith("bwd"))
    ancestors, todo = set(), [i["id"] for i in ins if i["kind"] == "optimizer_step"]
    by_id = {i["id"]: i for i in ins}
    while todo:
        k = todo.pop()
        for d in by_id[k]["deps"]:
            if d not in ancestors:
                ancestors.add(d)
                todo.append(d)
    assert last_bwd in ancestors  # the updates wait for the backward's end
    log = tmp_path / "log.jsonl"
    assert execute(plan, tmp_path / "s", 4, "--log-json", str(log)) == 0
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    losses, norms, want = eager_clipped(4, max_norm)
    assert [r["loss"] for r in rows] == losses and [r["grad_norm"] for r in rows] == norms
    got = exported(tmp_path / "s", tmp_path / "e")
    assert got.keys() == want.keys() - {"lm_head.weight"}
    for n in got:
        assert torch.equal(got[n], want[n]), n
    if max_norm == 1.0:
        assert all(n > max_norm for n in norms)  # it did clip every step


@pytest.mark.parametrize("policy", ["stronghold", "zero-infinity", "lohan"])
def test_evaluate_between_steps_equals_eager_eval_and_changes_nothing(policy, tmp_path):
    """`ex.evaluate(batches)` after 2 steps: the mean loss equals eager's under `model.eval()` and
    `torch.no_grad()` bit for bit, and training on for 2 more steps gives eager's 4-step weights
    (no update, step, commit or random draw leaks from the evaluation), through plans with state
    in DRAM, on SSD, and with deferred write-backs (lohan)."""
    import tensorstow
    from tensorstow.executor.data import batches
    from tests.fixtures import real_models
    from tests.oracle import param_groups
    ref = "tests.fixtures.real_models:nano_gpt"  # no dropout: eval mode computes what training does
    plan = tmp_path / "p.json"
    extra = ["--dram", "600KB"] if policy == "lohan" else []
    assert main(["plan", ref, *COMMON, "--policy", policy, "--gpu-mem", "400KB", *extra, "-o", str(plan)]) == 0
    if policy == "lohan":
        assert json.loads(plan.read_text())["decisions"]["deferred_writes"]
    train = list(batches("synthetic", 2, 16, 128, 4, seed=0))
    held_out = list(batches("synthetic", 2, 16, 128, 3, seed=7))
    torch.manual_seed(0)
    ex = tensorstow.Executor(tensorstow.Plan.load(plan), real_models.nano_gpt(), state_dir=tmp_path / "s")
    losses = [ex.step(x, y) for x, y in train[:2]]
    ran = []
    dispatch = ex.runtime.dispatch
    ex.runtime.dispatch = lambda ins: (ran.append(ins), dispatch(ins))[1]
    got_eval = ex.evaluate(held_out)
    del ex.runtime.dispatch
    # the forward-only program: forwards, their parameters' loads, no backward, gradient or update
    assert len(ran) == 3 * len(ex.program.eval_instrs) > 0
    assert {i.segment.split(":")[0] for i in ran if i.kind == "compute"} == {"fwd"}
    assert not [i for i in ran if i.kind in ("optimizer_step", "store", "recompute") or i.tensor.startswith(("G:", "A:"))]
    assert ex.steps_done == 2
    losses += [ex.step(x, y) for x, y in train[2:]]
    got = ex.parameters()
    ex.close()

    torch.manual_seed(0)
    model = real_models.nano_gpt()
    opt = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-3, foreach=False)
    want_losses, want_eval = [], None
    for k, (x, y) in enumerate(train):
        if k == 2:
            model.eval()
            with torch.no_grad():
                want_eval = sum(model(a, b)[1].item() for a, b in held_out) / len(held_out)
            model.train()
        opt.zero_grad()
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        want_losses.append(loss.item())
    assert got_eval == want_eval and losses == want_losses
    for n, p in model.named_parameters():
        assert torch.equal(got[n], p.detach()), n


@pytest.mark.parametrize("policy", ["stronghold", "zero-infinity", "lohan"])
def test_the_evaluation_program_is_the_forward_streamed_as_the_step_streams_it(policy, tmp_path):
    """A one-GPU plan carries the forward-only program of an evaluation batch: every block's forward
    once per microbatch, the parameters loaded from their homes (a deferred write-back's from its
    DRAM copy), nothing stored, no gradient or update; its predicted time is below the step's and
    its simulated peaks within the step's; `show` prints it."""
    from tensorstow.planner.simulate import simulate
    ref = "tests.fixtures.real_models:nano_gpt"
    plan = tmp_path / "p.json"
    extra = ["--dram", "600KB"] if policy == "lohan" else []
    assert main(["plan", ref, *COMMON, "--policy", policy, "--gpu-mem", "400KB", "--grad-accum", "2", *extra,
                 "-o", str(plan)]) == 0
    p = Plan.load(plan)
    ev = p.eval_instructions
    computes = [i for i in ev if i.kind == "compute"]
    assert [(i.segment, i.micro) for i in computes] == [(f"fwd:{b.name}", m) for m in range(2) for b in p.model.blocks]
    assert {i.kind for i in ev} <= {"load", "free", "compute"}
    homes = {n: b.home for n, b in p.buffers.items() if b.home}
    carried = {f"{k}:{b}" for b in p.decisions.deferred_writes for k in ("P",)}
    assert all(i.tensor.startswith(("P:", "C:")) for i in ev if i.kind == "load")
    assert all(i.src in ("dram", homes[i.tensor]) for i in ev if i.kind == "load")
    assert not [i for i in ev if i.tensor in carried and i.src == "ssd"]  # its latest version is in DRAM
    assert 0 < p.predicted.eval_step_s < p.predicted.step_time_s
    from tensorstow.schema.schedule import initial_residency
    sizes = {n: b.bytes for n, b in p.buffers.items()}
    order = [b.name for b in p.model.blocks]
    sim = simulate(list(ev), [i.est_s for i in ev], sizes, initial_residency(dict(p.buffers), p.decisions, order),
                   reserved=p.decisions.reserved())
    for tier in ("gpu0", "dram"):
        assert sim.peak_bytes.get(tier, 0) <= p.predicted.peak_bytes["gpu" if tier == "gpu0" else tier]
    if policy == "lohan":
        assert carried and any(i.tensor in carried for i in ev if i.kind == "load")


def test_evaluate_refuses_a_model_whose_forward_draws_random_numbers(plans, tmp_path):
    import tensorstow
    from tests.fixtures import real_models
    ex = tensorstow.Executor(tensorstow.Plan.load(plans["stronghold"]), real_models.nano_gpt_dropout(),
                             state_dir=tmp_path / "s")
    with pytest.raises(tensorstow.TensorstowError, match="dropout"):
        ex.evaluate([])
    ex.close()


def test_execute_evaluates_held_out_data_every_n_steps_like_eager(tmp_path, capsys):
    """`execute --eval-data synthetic --eval-every 2 --eval-batches 2`: after steps 2 and 4 the
    JSON log holds eval_loss (and its perplexity) equal to eager's eval-mode mean loss over the same
    batches (drawn with seed + 1) at that point of the same training."""
    import math

    from tensorstow.executor.data import batches
    from tests.fixtures import real_models
    from tests.oracle import param_groups
    ref = "tests.fixtures.real_models:nano_gpt"
    plan = tmp_path / "p.json"
    assert main(["plan", ref, *COMMON, "--policy", "zero-infinity", "--gpu-mem", "400KB", "-o", str(plan)]) == 0
    log = tmp_path / "log.jsonl"
    assert execute(plan, tmp_path / "s", 4, "--log-json", str(log), "--eval-data", "synthetic", "--eval-every", "2",
                   "--eval-batches", "2") == 0
    assert "eval after step 2/4  loss" in capsys.readouterr().out
    evals = [json.loads(line) for line in log.read_text().splitlines() if "eval_loss" in line]
    held_out = list(batches("synthetic", 2, 16, 128, 2, seed=1))
    torch.manual_seed(0)
    model = real_models.nano_gpt()
    opt = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-3, foreach=False)
    want = []
    for k, (x, y) in enumerate(batches("synthetic", 2, 16, 128, 4, seed=0), 1):
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
        if k % 2 == 0:
            model.eval()
            with torch.no_grad():
                want.append(sum(model(a, b)[1].item() for a, b in held_out) / len(held_out))
            model.train()
    assert [e["step"] for e in evals] == [2, 4] and [e["eval_loss"] for e in evals] == want
    assert all(e["eval_perplexity"] == math.exp(e["eval_loss"]) and e["eval_batches"] == 2 for e in evals)


def test_evaluate_command_reads_a_state_dirs_last_commit(tmp_path, capsys):
    """`tensorstow evaluate PLAN --state-dir D --data F`: the held-out loss of the weights D
    committed last equals the loss `execute --eval-data` logged after that step (a lohan plan with
    deferred write-backs), and D is left as it was (a second evaluate gives the same); a directory
    that is not a state dir is one error line."""
    from tensorstow.executor.run import evaluate_state
    from tensorstow.schema.plan import Plan
    from tensorstow.schema.run import Run
    ref = "tests.fixtures.real_models:nano_gpt"
    plan = tmp_path / "p.json"
    assert main(["plan", ref, *COMMON, "--policy", "lohan", "--gpu-mem", "400KB", "--dram", "600KB", "-o", str(plan)]) == 0
    log = tmp_path / "log.jsonl"
    assert execute(plan, tmp_path / "s", 3, "--log-json", str(log), "--eval-data", "synthetic", "--eval-batches", "2") == 0
    logged = [json.loads(line) for line in log.read_text().splitlines() if "eval_loss" in line]
    assert [e["step"] for e in logged] == [3]
    run = Run(state_dir=str(tmp_path / "s"), eval_data="synthetic", eval_batches=2)
    first = evaluate_state(Plan.load(plan), run)
    assert first["step"] == 3 and first["eval_loss"] == logged[0]["eval_loss"]
    assert evaluate_state(Plan.load(plan), run)["eval_loss"] == first["eval_loss"]
    capsys.readouterr()
    assert main(["evaluate", str(plan), "--state-dir", str(tmp_path / "s"), "--data", "synthetic", "--batches", "2"]) == 0
    assert capsys.readouterr().out.startswith(f"step 3: eval loss {first['eval_loss']:.6g}")
    assert main(["evaluate", str(plan), "--state-dir", str(tmp_path / "none"), "--data", "synthetic"]) == 2
    assert "is not a tensorstow state dir" in capsys.readouterr().err


def test_claims_racing_for_one_state_dir_leave_one_plan_and_one_clear_error(plans, tmp_path):
    """Two runs claiming one new state dir at once with different plans: one plan is written whole,
    the run with the other gets the one-line "trains another plan" error, never a file error on a
    temporary the other run moved (each writes under a name of its own, then links it into place)."""
    import threading

    from tensorstow.errors import TensorstowError
    from tensorstow.executor.statedir import claim
    from tensorstow.schema.plan import Plan
    a, b = Plan.load(plans["stronghold"]), Plan.load(plans["zero-infinity"])
    for k in range(20):
        d = tmp_path / f"d{k}"
        start, results = threading.Barrier(2), {}

        def run(name, plan, d=d, start=start, results=results):
            start.wait()
            try:
                claim(d, plan)
                results[name] = "ok"
            except TensorstowError as e:
                results[name] = str(e)
        threads = [threading.Thread(target=run, args=("a", a)), threading.Thread(target=run, args=("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(v == "ok" for v in results.values()) == [False, True], results
        loser = next(v for v in results.values() if v != "ok")
        assert "trains another plan" in loser
        assert sorted(p.name for p in d.iterdir()) == ["plan.json", "tensorstow.json"]  # no temporary left behind
        held = json.loads((d / "plan.json").read_text())
        assert held in (json.loads(a.dumps()), json.loads(b.dumps()))


def test_bad_optimizer_values_and_unwritable_paths_are_one_line(plans, tmp_path, capsys):
    """A negative or NaN learning rate, a beta of 1, a negative batch: refused when planned, and a
    beta of 1 in an edited plan file when it reaches the executor (not the kernel's ValueError); a
    --log-json in a missing directory is one line naming the path."""
    common = ["plan", MODEL, *COMMON[:-1], "--policy", "stronghold", "--gpu-mem", "400KB"]
    for bad, rule in ((["--lr=-1e-3"], "--lr -0.001 must be a finite number >= 0"),
                      (["--lr", "nan"], "--lr nan must be a finite number >= 0"),
                      (["--betas", "0.9", "1.0"], "--betas 0.9 1.0 must each be in [0, 1)"),
                      (["--batch=-2"], "--batch -2 must be >= 1 (0: the model's default)")):
        assert main([*common, *bad, "-o", str(tmp_path / "x.json")]) == 2, bad
        assert capsys.readouterr().err == f"tensorstow: error: plan options: {rule}\n"
    edited = json.loads(Path(plans["stronghold"]).read_text())
    edited["options"]["betas"] = [0.9, 1.0]
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    assert main(["execute", str(tmp_path / "edited.json"), "--hw-mismatch", "ok", "--steps", "1"]) == 2
    assert capsys.readouterr().err.startswith("tensorstow: error: plan options: --betas 0.9 1.0")
    assert execute(plans["stronghold"], tmp_path / "s", 1, "--log-json", str(tmp_path / "no" / "log.jsonl")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tensorstow: error: --log-json {tmp_path / 'no' / 'log.jsonl'}: cannot open it") \
        and "No such file" in err and err.count("\n") == 1
