"""What gradient clipping (`--max-grad-norm`) costs an offloaded plan, in its two forms: every update
waiting for the norm (`--clip-rate 1`), and speculating (`--clip-rate 0`: the CPU updates of
SSD-homed state overlap the backward and are redone from the last commit when the clip fires).
Each runs in sync and overlap mode through an SSD store, against the same policy without
clipping; the speculating plan both with a clip that never fires (clean steps) and one that fires
on every step (redo steps). Prints each step measured and predicted, and each against the
unclipped one, measured and predicted, in the same run.

Usage: python benchmarks/bench_clipping.py [--model gpt-small] [--policy lohan] [--batch 4]
                                          [--steps 4] [--gpu-mem 48MB] [--hw local|spec.json]
"""
import argparse
import json
import tempfile

import torch

from tensorstow.calibrate import hardware_for
from tensorstow.executor.data import batches
from tensorstow.executor.run import predicted_step
from tensorstow.executor.executor import Executor
from tensorstow.executor.ssd import SSDStore
from tensorstow.ir.models import resolve_model
from tensorstow.planner.plan import make_plan
from tensorstow.schema.hardware import parse_size
from tensorstow.schema.options import Options
from tensorstow.schema.plan import as_plan

from bench_executor import median_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--policy", default="lohan")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gpu-mem", default="48MB")
    ap.add_argument("--hw", default="local", help="hardware spec file from `tensorstow probe`, or local (probe now)")
    a = ap.parse_args()
    spec = resolve_model(a.model)
    print(f"# {a.model}, batch {a.batch}, fp32, policy {a.policy}, device budget {a.gpu_mem}, state on SSD, "
          f"{a.steps} steps (median of the last {a.steps - 1}), torch threads {torch.get_num_threads()}")
    data = list(batches("synthetic", a.batch, spec.config.block_size, spec.config.vocab_size, a.steps, seed=0))
    runs = {"no clipping": (0.0, 1.0), "waiting": (1.0, 1.0), "speculating, clean": (1e9, 0.0),
            "speculating, redo": (1e-9, 0.0)}
    results = {}
    for name, (clip, rate) in runs.items():
        o = Options(model=a.model, hardware=a.hw, batch=a.batch, precision="fp32", policy=a.policy,
                    gpu_mem=parse_size(a.gpu_mem), max_grad_norm=clip, clip_rate=rate)
        plan = json.loads(make_plan(o, hardware_for(o)).dumps())
        p = as_plan(plan)
        if name.startswith("speculating") and not p.decisions.speculated:
            print(f"{name}: the plan speculates nothing (no CPU update of SSD-homed state); skipped")
            continue
        for mode in ("sync", "overlap"):
            with tempfile.TemporaryDirectory(dir=".") as d:
                torch.manual_seed(0)
                ex = Executor(plan, spec.build(), mode=mode, ssd_store=SSDStore(d, p.ssd_sizes()))
                t = median_step(ex.step, data)
                held = ex.speculation
                ex.close()
            redo = p.predicted.redo_s if name.endswith("redo") else 0.0
            if mode == "sync" and redo:
                redo = sum(i.est_s for i in p.redo_instructions)
            results[name, mode] = (t, predicted_step(p, mode) + redo)
            print(f"{name:20s} {mode:8s} measured {t:.4f} s   predicted {results[name, mode][1]:.4f} s   "
                  f"measured/predicted {t / results[name, mode][1]:.2f}x" + (f"   last step {held}" if held else ""))
    for name in runs:
        for mode in ("sync", "overlap"):
            if name == "no clipping" or (name, mode) not in results:
                continue
            (tc, pc), (tn, pn) = results[name, mode], results["no clipping", mode]
            print(f"{name} / no clipping, {mode:8s}: measured {tc / tn:.2f}x, predicted {pc / pn:.2f}x")


if __name__ == "__main__":
    main()
