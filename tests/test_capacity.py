"""auto, --sweep and fit: the capacity questions users ask."""
import json

import pytest

from tensorstow import TensorstowError
from tensorstow.cli import main
from tensorstow.planner.presets import load_hardware
from tensorstow.schema.options import Options
from tensorstow.planner.plan import plan_problem, POLICIES
from tensorstow.planner.problem import build_problem
from tensorstow.planner import report


def test_auto_keeps_the_fastest_feasible_policy(tmp_path, capsys):
    hw = load_hardware("lohan-rtx4090").with_overrides(gpu_mem=3 * 10**6)
    p = build_problem(Options(model="gpt-tiny", hardware="lohan-rtx4090", batch=2, gpu_mem=3 * 10**6), hw)
    plans = {name: plan_problem(p, name) for name in POLICIES}
    feasible = {n: pl.sim.step_time_s for n, pl in plans.items() if pl.fits}
    assert "all-gpu" not in feasible  # 3 MB cannot hold everything
    auto = plan_problem(p, "auto")
    assert auto.fits and auto.sim.step_time_s == min(feasible.values())
    assert any(n.startswith("auto chose") for n in auto.decisions.notes)
    out = tmp_path / "auto.json"
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--batch", "2", "--gpu-mem", "3MB", "-o", str(out)]) == 0
    assert "(chosen by auto)" in capsys.readouterr().out
    assert json.loads(out.read_text())["options"]["policy"] == "auto"


def test_every_policy_fits_or_says_why_with_numbers():
    hw = load_hardware("lohan-rtx4090").with_overrides(gpu_mem=3 * 10**6)
    p = build_problem(Options(model="gpt-tiny", hardware="lohan-rtx4090", batch=2, gpu_mem=3 * 10**6), hw)
    for name in POLICIES:
        pl = plan_problem(p, name)
        for tier, pts in pl.sim.timeline.items():  # the simulator's own accounting never goes negative
            assert min(v for _, v in pts) >= 0
        if not pl.fits:
            from tensorstow.planner.result import infeasible_message
            msg = infeasible_message(pl, pl.over_capacity())
            assert "needs" in msg and "capacity" in msg and ("MB" in msg or "KB" in msg)


def test_sweep_table_and_plot(tmp_path, capsys):
    plot = tmp_path / "s.svg"
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--batch", "2", "--policy", "zero-infinity",
                 "--sweep", "ssd_count=1..3", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    tps = [float(r[3]) for r in rows]
    assert tps[0] < tps[2]  # more SSD bandwidth, more throughput for an SSD-bound baseline
    svg = plot.read_text()
    assert svg.startswith("<svg") and svg.count("<circle") == 3
    with pytest.raises(TensorstowError, match="KEY=A..B"):
        report.parse_sweep("gpus=1..2")
    assert report.parse_sweep("batch=1,2,4") == ("batch", [1, 2, 4])


def test_fit_finds_the_largest_model_and_best_batch():
    hw = load_hardware("lohan-rtx4090").with_overrides(dram=256 * 10**9)
    r = report.largest_fitting(Options(model="gpt3-13b", hardware="lohan-rtx4090", policy="zero-infinity",
                                       dram=256 * 10**9), hw, batches=(1, 2, 4))
    # ZeRO-Infinity parks all fp16 gradients in DRAM until its optimizer stage: 2P bytes must fit in 256 GB
    assert r["model"] is not None and r["params"] * 2 < 256e9
    assert r["batch"] in (1, 2, 4) and r["tokens_per_s"] > 0
