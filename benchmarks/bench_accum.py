"""What gradient accumulation (`--grad-accum K`) costs an offloaded plan, and what an evaluation
batch costs: the same policy planned for one microbatch a step and for K, each run in sync and
overlap mode through an SSD store; prints each step measured and predicted, the K-microbatch step
against K one-microbatch steps (measured and predicted, in the same run), and one evaluation batch
(`Executor.evaluate`: the plan's forward-only program) measured and predicted, and against the
training step.

Accumulation runs the forward and backward K times and the updates once: the K-step's cost over
K single steps is what the update (and the parameter and state traffic that goes with it) weighs
in a step, less what the accumulated gradients' round trips to their tier add.

Usage: python benchmarks/bench_accum.py [--model gpt-small] [--policy lohan] [--batch 2] [--accum 4]
                                        [--steps 4] [--gpu-mem 48MB] [--hw local|spec.json]
"""
import argparse
import json
import tempfile
import time

import torch

from tensorstow.calibrate import hardware_for
from tensorstow.executor.data import batches
from tensorstow.executor.run import predicted_eval, predicted_step
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
    ap.add_argument("--batch", type=int, default=2, help="rows of one microbatch")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gpu-mem", default="48MB")
    ap.add_argument("--hw", default="local", help="hardware spec file from `tensorstow probe`, or local (probe now)")
    a = ap.parse_args()
    spec = resolve_model(a.model)
    seq, vocab = spec.config.block_size, spec.config.vocab_size
    print(f"# {a.model}, microbatch {a.batch} x {seq}, fp32, policy {a.policy}, device budget {a.gpu_mem}, state on "
          f"SSD, {a.steps} steps (median of the last {a.steps - 1}), torch threads {torch.get_num_threads()}")
    results = {}
    for k in (1, a.accum):
        o = Options(model=a.model, hardware=a.hw, batch=a.batch, precision="fp32", policy=a.policy,
                    gpu_mem=parse_size(a.gpu_mem), grad_accum=k)
        planned = make_plan(o, hardware_for(o))
        plan = json.loads(planned.dumps())
        p = as_plan(plan)
        tiers = sorted({d.accum for d in planned.decisions.blocks.values()}) if k > 1 else ["-"]
        data = list(batches("synthetic", a.batch * k, seq, vocab, a.steps, seed=0))
        for mode in ("sync", "overlap"):
            with tempfile.TemporaryDirectory(dir=".") as d:
                torch.manual_seed(0)
                ex = Executor(plan, spec.build(), mode=mode, ssd_store=SSDStore(d, p.ssd_sizes()))
                t = median_step(ex.step, data)
                evals = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    ex.evaluate(data[:1])
                    evals.append(time.perf_counter() - t0)
                ev = sorted(evals)[1]
                ex.close()
            results[k, mode] = (t, predicted_step(p, mode), ev)
            pe = predicted_eval(p, mode)
            print(f"grad_accum {k} ({planned.decisions.policy}, sums on {','.join(tiers)}) {mode:8s} "
                  f"step measured {t:.4f} s   predicted {results[k, mode][1]:.4f} s   measured/predicted "
                  f"{t / results[k, mode][1]:.2f}x")
            print(f"{'':42s} eval batch measured {ev:.4f} s   predicted {pe:.4f} s   measured/predicted "
                  f"{ev / pe:.2f}x   eval / step measured {ev / t:.2f}x, predicted {pe / results[k, mode][1]:.2f}x")
    for mode in ("sync", "overlap"):
        (tk, pk, _), (t1, p1, _) = results[a.accum, mode], results[1, mode]
        print(f"step of {a.accum} microbatches / {a.accum} steps of one, {mode:8s}: measured "
              f"{tk / (a.accum * t1):.2f}x, predicted {pk / (a.accum * p1):.2f}x")


if __name__ == "__main__":
    main()
