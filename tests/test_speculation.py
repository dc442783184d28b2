"""Clipping without giving up the overlap: speculated CPU updates (`Decisions.speculated`) run as
their gradients arrive, before the global norm is known; where the clip fires, the plan's redo
program reads their state back from the last commit and updates again with the clipped gradients,
before anything is committed. Through lohan and ilp plans with SSD state (lohan's with its last
write-backs deferred into the next step), and one with a block whose state is in DRAM, which waits
for the norm instead, against eager `clip_grad_norm_` + AdamW (+ GradScaler) bit for bit: the clip
firing on every step, on some, on none; with accumulation; fp16 overflows; killed during a redo."""
import json
import subprocess
import sys

import pytest
import torch

from tensorstow.cli import main
from tests.test_state_dir import COMMON, MODEL, eager_clipped, execute, exported


DRAM = {"lohan": "700KB", "ilp": "600KB"}
"""Budgets tight enough that the Adam states live on SSD (the updates it speculates), and for lohan
loose enough that the blocks updated last defer their write-backs, with the DRAM arena within."""


def plan(tmp_path, policy: str, max_norm: float, *extra: str, model: str = MODEL) -> dict:
    """`policy`'s plan at clip rate 0 (speculating wherever it can), written to tmp_path/p.json."""
    assert main(["plan", model, *COMMON, "--policy", policy, "--gpu-mem", "400KB", "--dram", DRAM[policy],
                 "--max-grad-norm", str(max_norm), "--clip-rate", "0", *extra, "-o", str(tmp_path / "p.json")]) == 0
    return json.loads((tmp_path / "p.json").read_text())


def run_api(plan: dict, build, data, state) -> tuple[list, list, list, dict]:
    """The plan through the Python API from `build()`'s weights (seed 0): each step's loss, norm and
    speculation, and the trained parameters."""
    from tensorstow.executor.executor import Executor
    torch.manual_seed(0)
    ex = Executor(plan, build(), state_dir=state)
    losses, norms, held = [], [], []
    for x, y in data:
        losses.append(ex.step(x, y))
        norms.append(ex.grad_norm)
        held.append(ex.speculation)
    params = ex.parameters()
    ex.close()
    return losses, norms, held, params


def assert_trains_like_eager(tmp_path, steps: int, max_norm: float) -> list[dict]:
    """The JSON log's losses and norms and the exported weights equal eager's; returns the log."""
    rows = {}
    for line in (tmp_path / "log.jsonl").read_text().splitlines():  # a step run again after a kill: its last
        rows[json.loads(line)["step"]] = json.loads(line)
    rows = [rows[k] for k in sorted(rows)]
    losses, norms, want = eager_clipped(steps, max_norm)
    assert [r["loss"] for r in rows] == losses and [r["grad_norm"] for r in rows] == norms
    got = exported(tmp_path / "s", tmp_path / "e")
    assert got.keys() == want.keys() - {"lm_head.weight"}
    bad = [n for n in got if not torch.equal(got[n], want[n])]
    assert not bad, f"weights differ from eager: {bad[:4]}"
    return rows


@pytest.mark.parametrize("policy,max_norm,mode", [
    ("lohan", 1.0, "sync"), ("lohan", 9.3, "overlap"), ("lohan", 1e6, "sync"), ("ilp", 9.3, "sync")],
    ids=["lohan-every-step", "lohan-some-steps-overlap", "lohan-never", "ilp-some-steps"])
def test_speculated_updates_are_exact_whether_the_clip_fires_or_not(policy, max_norm, mode, tmp_path):
    p = plan(tmp_path, policy, max_norm)
    spec = p["decisions"]["speculated"]
    assert spec and p["redo_instructions"] and p["predicted"]["redo_s"] > 0
    ins = p["instructions"]
    last_bwd = max(i["id"] for i in ins if i["kind"] == "compute" and i.get("segment", "").startswith("bwd"))
    first_update = min(i["id"] for i in ins if i["kind"] == "optimizer_step")
    assert first_update < last_bwd  # the CPU optimizer overlaps the backward
    # every update whose state (fp32: P and OS) a redo can read back from SSD; lohan's are all there,
    # ilp may give one block's DRAM (that update waits for the norm)
    bufs = p["buffers"]
    on_ssd = {b for b in p["decisions"]["blocks"] if f"G:{b}" in bufs
              and all(bufs[f"{k}:{b}"]["home"] == "ssd" for k in ("P", "OS"))}
    assert set(spec) == on_ssd and len(on_ssd) >= len([b for b in p["decisions"]["blocks"] if f"G:{b}" in bufs]) - 1
    if policy == "lohan":  # a redo restores the blocks carried into the next step too
        assert p["decisions"]["deferred_writes"]
    assert execute(tmp_path / "p.json", tmp_path / "s", 5, "--log-json", str(tmp_path / "log.jsonl"),
                   "--mode", mode) == 0
    rows = assert_trains_like_eager(tmp_path, 5, max_norm)
    held = [r["speculation"] for r in rows]
    assert set(held) == {"held", "redone"} if max_norm == 9.3 else held == ["redone" if max_norm == 1.0 else "held"] * 5


def test_a_block_whose_state_is_in_dram_waits_while_the_others_speculate(tmp_path):
    """A plan mixing both forms: block b1's parameters and Adam states live in DRAM (its update
    cannot be read back from a commit), so it waits for the norm; the SSD-homed blocks speculate."""
    import dataclasses
    from tensorstow.planner.plan import POLICIES
    from tensorstow.planner.presets import load_hardware
    from tensorstow.planner.passes import schedule
    from tensorstow.planner.problem import build_problem
    from tensorstow.schema.options import Options
    o = Options(model=MODEL, hardware="lohan-rtx4090", policy="lohan", batch=2, seq=16, precision="fp32", lr=1e-3,
                exact_optimizer=True, gpu_mem=400_000, dram=1_000_000, max_grad_norm=9.3, clip_rate=0.0)
    problem = build_problem(o, load_hardware(o.hardware).with_overrides(gpu_mem=o.gpu_mem, dram=o.dram))
    d = POLICIES["lohan"](problem)
    d = dataclasses.replace(d, blocks={**d.blocks, "b1": dataclasses.replace(d.blocks["b1"], params="dram",
                                                                              states="dram")})
    r = schedule(problem, d, wait=True)
    assert r.fits and r.decisions.speculated and "b1" not in r.decisions.speculated
    (tmp_path / "p.json").write_text(r.dumps())
    assert execute(tmp_path / "p.json", tmp_path / "s", 5, "--log-json", str(tmp_path / "log.jsonl")) == 0
    rows = assert_trains_like_eager(tmp_path, 5, 9.3)
    assert {r["speculation"] for r in rows} == {"held", "redone"}


def test_speculation_with_accumulation(tmp_path):
    """`--grad-accum 2`: the speculated updates run in the last microbatch's backward, the norm is
    the summed gradients', the redo clips the sums; equal to eager accumulation + clip_grad_norm_."""
    from tensorstow.executor.data import batches
    from tests.fixtures import real_models
    from tests.oracle import train_eager
    p = plan(tmp_path, "lohan", 7.9, "--grad-accum", "2", model="tests.fixtures.real_models:nano_gpt")
    assert p["decisions"]["speculated"] and p["decisions"]["grad_accum"] == 2
    data = list(batches("synthetic", 4, 16, 128, 5, seed=0))
    torch.manual_seed(0)
    want_norms = []
    want = train_eager(real_models.nano_gpt(), data, lr=1e-3, microbatches=2, max_grad_norm=7.9, norms=want_norms,
                       loss=lambda m, x, y: m(x, y)[1])
    losses, norms, held, params = run_api(p, real_models.nano_gpt, data, tmp_path / "s")
    assert losses == want[0] and norms == want_norms and set(held) == {"held", "redone"}
    assert all(torch.equal(params[n], want[1][n]) for n in want[1])


KILL_IN_REDO = """
import os, signal, sys
from tensorstow.cli import main
from tensorstow.executor import runtime
seen = []
step = runtime.HANDLERS["optimizer_step"]
def kill_in_the_second_redo(self, ins):
    if self.sem.redoing:
        seen.append(self.sem.opt_steps)
        if len(set(seen)) == 2 and seen.count(seen[-1]) == 2:  # the second redo, between two of its updates
            os.kill(os.getpid(), signal.SIGKILL)
    return step(self, ins)
runtime.HANDLERS["optimizer_step"] = kill_in_the_second_redo
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_killed_during_a_redo_resumes_exactly(tmp_path):
    """SIGKILL in the middle of a redo (some speculated blocks redone and written, others not):
    nothing of that step was committed, so the same command resumes from the step before and the
    run equals eager's."""
    plan(tmp_path, "lohan", 1.0)
    args = ["execute", str(tmp_path / "p.json"), "--hw-mismatch", "ok", "--steps", "4", "--state-dir", str(tmp_path / "s"),
            "--log-json", str(tmp_path / "log.jsonl")]
    r = subprocess.run([sys.executable, "-c", KILL_IN_REDO, *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == -9, r.stdout + r.stderr
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 1  # the second step never finished
    assert main(args) == 0
    rows = assert_trains_like_eager(tmp_path, 4, 1.0)
    assert [r["speculation"] for r in rows] == ["redone"] * 4


def test_the_planner_weighs_speculation_by_the_clip_rate(tmp_path, capsys):
    """Clip rate 0: the plan speculates and says why; 1: a redo on every step costs more than
    waiting, so every update waits; fp16 loss scaling speculates alike (an overflow restores); a
    speculating plan commits every step (`--checkpoint-every 2` is one error line)."""
    assert plan(tmp_path, "lohan", 1.0)["decisions"]["speculated"]
    capsys.readouterr()
    assert main(["show", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "CPU updates speculate" in out and "clip rate 0 x redo" in out
    assert execute(tmp_path / "p.json", tmp_path / "s", 2, "--checkpoint-every", "2") == 2
    assert "commits every step" in capsys.readouterr().err
    assert "speculated" not in plan(tmp_path, "lohan", 1.0, "--clip-rate", "1")["decisions"]
    assert plan(tmp_path, "lohan", 1.0, "--precision", "fp16-mixed")["decisions"]["speculated"]
    # the rate measured by an earlier run: every step redone, so re-planning from its log waits
    plan(tmp_path, "lohan", 1.0)
    assert execute(tmp_path / "p.json", tmp_path / "s2", 2, "--log-json", str(tmp_path / "log.jsonl")) == 0
    again = plan(tmp_path, "lohan", 1.0, "--clip-rate-from", str(tmp_path / "log.jsonl"))
    assert again["options"]["clip_rate"] == 1.0 and "speculated" not in again["decisions"]
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    capsys.readouterr()
    assert main(["plan", MODEL, *COMMON, "--policy", "lohan", "--max-grad-norm", "1", "--clip-rate-from",
                 str(tmp_path / "bad.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorstow: error: --clip-rate-from") and "bad.jsonl:1" in err and err.count("\n") == 1


@pytest.mark.parametrize("max_norm", [0.0, 0.5], ids=["loss-scaling-alone", "with-clipping"])
def test_fp16_overflow_steps_restore_the_speculated_updates(max_norm, tmp_path):
    """fp16-mixed speculates too: a first loss scale of 2^20 overflows the first steps, whose
    speculated updates are restored from the last commit (and skipped, as GradScaler skips them),
    the later ones clipped or held: losses, norms and weights equal eager GradScaler (+
    clip_grad_norm_) bit for bit, through a lohan plan with SSD state."""
    from tensorstow.executor.data import batches
    from tensorstow.ir.models import GPT, PRESETS
    from tensorstow.planner.plan import make_plan
    from tensorstow.planner.presets import load_hardware
    from tensorstow.schema.options import Options
    from tests.oracle import train_eager
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="lohan", batch=2, seq=32, precision="fp16-mixed",
                lr=1e-3, gpu_mem=1_000_000, exact_optimizer=True, max_grad_norm=max_norm, clip_rate=0.0,
                init_scale=2.0 ** 20)
    p = json.loads(make_plan(o, load_hardware(o.hardware).with_overrides(gpu_mem=o.gpu_mem)).dumps())
    assert p["decisions"]["speculated"]
    data = list(batches("synthetic", 2, 32, PRESETS["gpt-tiny"].vocab_size, 6, seed=0))
    torch.manual_seed(0)
    want_norms = []
    want = train_eager(GPT(PRESETS["gpt-tiny"]), data, lr=1e-3, precision="fp16-mixed",
                       scaler={"init_scale": 2.0 ** 20}, max_grad_norm=max_norm or None, norms=want_norms)
    losses, norms, held, params = run_api(p, lambda: GPT(PRESETS["gpt-tiny"]), data, tmp_path / "s")
    assert losses == want[0] and all(torch.equal(params[n], want[1][n]) for n in want[1])
    if max_norm:
        assert norms == want_norms and held == ["redone" if n > max_norm else "held" for n in norms]
    assert held[0] == "redone" and held[-1] == ("redone" if max_norm else "held")  # overflow first, then clean


def test_gpt_small_offloaded_keeps_its_overlap_when_clipped():
    """gpt-small with its state on SSD, on the probed spec of a 2-core VM (tests/test_plan.py),
    `--max-grad-norm 1.0` at the default clip rate: the plan speculates, its CPU updates start
    before the last backward segment, and its predicted clean step is within 5% of the same
    policy's plan without clipping."""
    from tensorstow.planner.plan import make_plan
    from tensorstow.schema.hardware import Hardware
    from tensorstow.schema.options import Options
    from tests.test_plan import _PROBED_VM
    hw = Hardware.from_json(_PROBED_VM).with_overrides(gpu_mem=48_000_000, ssds=1)
    plans = {clip: make_plan(Options(model="gpt-small", hardware="vm", policy="lohan", batch=4, precision="fp32",
                                     gpu_mem=48_000_000, max_grad_norm=clip), hw) for clip in (0.0, 1.0)}
    clipped = plans[1.0]
    assert clipped.decisions.speculated and all(d.states == "ssd" for d in clipped.decisions.blocks.values())
    ins = clipped.instructions
    last_bwd = max(i.id for i in ins if i.kind == "compute" and i.segment.startswith("bwd"))
    assert min(i.id for i in ins if i.kind == "optimizer_step") < last_bwd
    assert clipped.sim.step_time_s <= 1.05 * plans[0.0].sim.step_time_s
