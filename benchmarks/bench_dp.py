"""Data parallel on this machine: the same offloaded plan on one rank and on N (`plan --dp N`,
`execute --nproc N`, gloo, each rank's device tier budgeted CPU memory on its share of the cores),
each step measured against its prediction, and the CPU update a rank runs on N ranks against one
(each rank updates 1/N of every block's rows: the per-rank optimizer time should fall N-fold, less
the gather of the others' rows).

    python benchmarks/bench_dp.py [--model gpt-small] [--ranks 2] [--batch 2] [--steps 6]
                                  [--gpu-mem 24MB] [--policy lohan] [--modes sync,overlap]

Runs one rank on the whole machine, one rank on one rank's share of it (its cores, planned on
`Hardware.rank_share`), and N ranks. Prints per run the median step (steps 2..), its prediction
and their ratio, and the per-rank cpu.opt lane busy time (rank 0's, measured and predicted); then
the N-rank / share-of-the-machine ratio of a rank's optimizer time, measured in the same run."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorstow.calibrate import hardware_for
from tensorstow.executor.run import predicted_step
from tensorstow.planner.plan import make_plan
from tensorstow.schema.hardware import parse_size
from tensorstow.schema.options import Options
from tensorstow.schema.plan import as_plan


def run(plan_json: str, ranks: int, mode: str, steps: int, tmp: Path, share: int = 0) -> dict:
    """`share`: run the one rank as one of that many on this machine (its cores, one thread each)."""
    path, log = tmp / "plan.json", tmp / "log.jsonl"
    path.write_text(plan_json)
    cmd = [sys.executable, "-m", "tensorstow.cli", "execute", str(path), "--nproc", str(ranks), "--steps", str(steps),
           "--state-dir", str(tmp / "state"), "--mode", mode, "--log-json", str(log), "--hw-mismatch", "ok"]
    env = dict(os.environ)
    if share:
        cores = sorted(os.sched_getaffinity(0))
        cmd = ["taskset", "-c", ",".join(map(str, cores[:max(1, len(cores) // share)])), *cmd]
        env["OMP_NUM_THREADS"] = str(max(1, len(cores) // share))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(r.stderr.strip().splitlines()[-1])
    rows = [json.loads(ln) for ln in log.read_text().splitlines()][1:]  # the first step warms up
    return {"step": statistics.median(x["step_time_s"] for x in rows),
            "opt": statistics.median(x["lane_busy_s"].get("cpu.opt", 0.0) for x in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--gpu-mem", default="24MB")
    ap.add_argument("--policy", default="lohan")
    ap.add_argument("--modes", default="sync,overlap")
    a = ap.parse_args()
    print(f"# {a.model}, batch {a.batch} x {a.seq} a rank, fp32, policy {a.policy}, device budget {a.gpu_mem} a rank, "
          f"state on SSD, median of steps 2..{a.steps}")
    print("| ranks | mode | measured step | predicted | measured / predicted | cpu.opt a rank, measured | predicted |")
    print("|---|---|---|---|---|---|---|")
    opt = {}
    machine = hardware_for(Options(model=a.model, hardware="local", gpus=a.ranks))
    with tempfile.TemporaryDirectory() as spec_dir:
        share = Path(spec_dir) / "share.json"  # one rank's share of this machine, as a machine of its own
        share.write_text(json.dumps(dataclasses.replace(machine.rank_share(a.ranks), name="local").to_json()))
        for label, ranks, hw in (("1", 1, "local"), (f"1 on 1/{a.ranks} of the machine", 1, str(share)),
                                 (str(a.ranks), a.ranks, "local")):
            o = Options(model=a.model, hardware=hw, policy=a.policy, batch=a.batch, seq=a.seq, precision="fp32",
                        gpu_mem=parse_size(a.gpu_mem), dp=ranks, gpus=ranks)
            text = make_plan(o, hardware_for(o)).dumps()
            plan = as_plan(json.loads(text))
            for mode in a.modes.split(","):
                with tempfile.TemporaryDirectory(dir=".") as d:
                    m = run(text, ranks, mode, a.steps, Path(d), share=a.ranks if hw != "local" else 0)
                pred = predicted_step(plan, mode)
                pred_opt = plan.predicted.busy_s.get("cpu.opt", 0.0)
                opt[label, mode] = (m["opt"], pred_opt)
                print(f"| {label} | {mode} | {m['step']:.4g} s | {pred:.4g} s | {m['step'] / pred:.2f} | "
                      f"{m['opt']:.4g} s | {pred_opt:.4g} s |", flush=True)
    for mode in a.modes.split(","):
        (m1, p1), (mn, pn) = opt[f"1 on 1/{a.ranks} of the machine", mode], opt[str(a.ranks), mode]
        print(f"{mode}: a rank's CPU update on {a.ranks} ranks / one rank on the same cores: measured {mn / m1:.2f}, "
              f"predicted {pn / p1:.2f}")


if __name__ == "__main__":
    main()
