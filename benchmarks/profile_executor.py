"""Where an executor step's time goes: host Python (cProfile) and device kernels (torch.profiler).

Usage: python benchmarks/profile_executor.py [--model gpt3-125m] [--batch 8] [--seq 1024]
           [--precision bf16-mixed] [--policy all-gpu] [--gpu-mem 8GB] [--hw SPEC] [--device cuda]
           [--modes sync,overlap] [--out DIR] [--depth N]
For each mode (sync, overlap, graph: the step replayed as one CUDA graph): 3 warm-up steps, the median of 3 timed steps, then one step under cProfile (the
host functions by own time, every thread's merged) and one under torch.profiler (ops by device time; a Chrome trace,
gzipped, in DIR), eager's step too. Prints the eager step time first, measured in the same run.
"""
import argparse
import cProfile
import gzip
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import threading
import time

import torch

from bench_executor import eager_step  # this directory: the same eager baseline
from tensorstow.executor.data import batches
from tensorstow.executor.executor import Executor
from tensorstow.ir.models import resolve_model
from tensorstow.schema.hardware import parse_size
from tensorstow.schema.options import Options
from tensorstow.planner.plan import make_plan
from tensorstow.calibrate import hardware_for


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt3-125m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--policy", default="all-gpu")
    ap.add_argument("--gpu-mem", dest="gpu_mem")
    ap.add_argument("--hw", default="local")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--modes", default="sync,overlap,graph",
                    help="sync and overlap run instruction by instruction; graph: the step replayed as one "
                         "CUDA graph (executor.graphs), where the plan allows it")
    ap.add_argument("--out", default="profile")
    ap.add_argument("--depth", type=int, help="CudaLanes.DEPTH (device instructions a lane queues ahead)")
    a = ap.parse_args()
    if a.depth:
        from tensorstow.executor.cuda import CudaLanes
        CudaLanes.DEPTH = a.depth
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    spec = resolve_model(a.model)
    o = Options(model=a.model, hardware=a.hw, batch=a.batch, seq=a.seq, precision=a.precision, policy=a.policy,
                gpu_mem=parse_size(a.gpu_mem) if a.gpu_mem else None)
    plan = json.loads(make_plan(o, hardware_for(o)).dumps())
    vocab = spec.config.vocab_size if spec.config else 50304
    data = list(batches("synthetic", a.batch, plan["model"]["seq"], vocab, 8, seed=0))
    os.makedirs(a.out, exist_ok=True)

    def timed(fn, xs):
        ts = []
        for x, y in xs:
            t0 = time.perf_counter()
            fn(x, y)
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    eager = eager_step(spec, device, a.precision)
    timed(eager, data[:3])
    by_device = "self_device_time_total" if cuda else "self_cpu_time_total"

    def profiled(name, fn, x, y):  # one step under torch.profiler: the ops by device time, a trace
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            fn(x, y)
            sync()
        print(prof.key_averages().table(sort_by=by_device, row_limit=16, max_name_column_width=40))
        path = os.path.join(a.out, f"{a.model}-{name}.trace.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(path)

    print(f"# {a.model} batch {a.batch} seq {plan['model']['seq']} {a.precision} {a.policy} on {device}: "
          f"{len(plan['instructions'])} instructions")
    print(f"eager step {timed(eager, data[3:6]):.4f} s")
    profiled("eager", eager, *data[6])
    eager = None  # free the eager copy before the executor builds its own
    for mode in a.modes.split(","):
        torch.manual_seed(0)
        ex = Executor(plan, spec.build(), mode="sync" if mode == "graph" else mode, device=device,
                      state_dir=os.path.join(a.out, "state"), graphs="auto" if mode == "graph" else "off")
        if mode == "graph" and ex.graphs.blockers:
            print(f"\n## executor graph: not captured ({'; '.join(ex.graphs.blockers)})")
            ex.close()
            continue
        timed(ex.step, data[:3])
        t = timed(ex.step, data[3:6])
        nodes = sum(len(s.nodes) for s in ex.joint.segments.values())
        print(f"\n## executor {mode}: step {t:.4f} s, {nodes} graph nodes, lane busy "
              + ", ".join(f"{k} {v:.4f}" for k, v in ex.lane_busy().items()))
        profiles = [cProfile.Profile()]
        run = threading.Thread.run

        def run_profiled(thread):  # the lane threads (overlap mode) are profiled too, and merged
            p = cProfile.Profile()
            profiles.append(p)
            p.enable()
            try:
                run(thread)
            finally:
                p.disable()
        if sys.version_info < (3, 12):  # 3.12's cProfile sees every thread (sys.monitoring) and allows one
            threading.Thread.run = run_profiled
        profiles[0].enable()
        ex.step(*data[6])
        sync()
        profiles[0].disable()
        threading.Thread.run = run
        s = io.StringIO()
        pstats.Stats(*profiles, stream=s).sort_stats("tottime").print_stats(22)
        print("\n".join(line for line in s.getvalue().splitlines()[6:] if line.strip()))
        profiled(f"{a.policy}-{mode}", ex.step, *data[7])
        ex.close()
        shutil.rmtree(os.path.join(a.out, "state"), ignore_errors=True)


if __name__ == "__main__":
    main()
