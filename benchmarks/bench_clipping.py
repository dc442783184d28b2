"""What gradient clipping (`--max-grad-norm`) costs an offloaded plan: the same policy planned with
and without it, each run in sync and overlap mode through an SSD store; prints the measured and
predicted step of each, and clipped / unclipped, measured and predicted, in the same run.

Clipping needs every gradient before the first update, so the plan makes each update wait for
the backward's end: the CPU optimizer's overlap with the backward (LoHan §IV) is given up, and
the overlap-mode step grows by what the overlap hid. The norms themselves cost one read of the
gradients on the device.

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
from tensorstow.executor.runtime import Executor
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
    results = {}
    for clip in (0.0, 1.0):
        o = Options(model=a.model, hardware=a.hw, batch=a.batch, precision="fp32", policy=a.policy,
                    gpu_mem=parse_size(a.gpu_mem), max_grad_norm=clip)
        plan = json.loads(make_plan(o, hardware_for(o)).dumps())
        p = as_plan(plan)
        for mode in ("sync", "overlap"):
            with tempfile.TemporaryDirectory(dir=".") as d:
                torch.manual_seed(0)
                ex = Executor(plan, spec.build(), mode=mode, ssd_store=SSDStore(d, p.ssd_sizes()))
                t = median_step(ex.step, data)
                norm = ex.grad_norm
                ex.close()
            results[clip, mode] = (t, predicted_step(p, mode))
            label = f"max_grad_norm {clip:g}" if clip else "no clipping"
            print(f"{label:18s} {mode:8s} measured {t:.4f} s   predicted {results[clip, mode][1]:.4f} s   "
                  f"measured/predicted {t / results[clip, mode][1]:.2f}x   last grad_norm {norm:.3g}")
    for mode in ("sync", "overlap"):
        (tc, pc), (tn, pn) = results[1.0, mode], results[0.0, mode]
        print(f"clipped / unclipped, {mode:8s}: measured {tc / tn:.2f}x, predicted {pc / pn:.2f}x")


if __name__ == "__main__":
    main()
