"""Executor vs eager PyTorch, and an SSD-offloaded plan's measured vs simulated step time.

Prints ratios measured in the same run (the machines are shared and noisy):
  1. all-resident plan through the executor / eager PyTorch (same model, batch, optimizer); on a
     GPU also with the step replayed as one CUDA graph (executor.graphs)
  2. the zero-infinity plan with its state on SSD and (no SSD) in DRAM, for a probed spec of this
     machine with a small device budget: measured / predicted step time in sync mode (predicted:
     the instructions' modeled durations one after another) and overlap mode (the simulated
     schedule), and against the plan's bound (its busiest resource: compute, a link, the CPU
     update) and, with the all-resident runs, as a fraction of the all-resident step's model
     TFLOPS; `--arena compare` runs each with the device arena off and on (`execute
     --arena`; on CUDA, with it, each segment replays as a graph: `--graphs auto`) and prints on/off. `--repeat N` measures eager and the all-resident runs N
     times (after the first, only the graph-replayed one), each ratio against its own eager run
Usage: python benchmarks/bench_executor.py [--model gpt-small] [--batch 4] [--steps 4] [--mode both]
                                          [--precision fp32|bf16-mixed|fp16-mixed] [--device cpu|cuda]
On a GPU (`--device cuda`) eager is all-GPU PyTorch (the model and AdamW on the GPU, CUDA
autocast), the executor's device tier is the GPU, and each line also prints model TFLOPS (the
plan's FLOPs without recomputation, as the papers count them), the peak of
`torch.cuda.max_memory_allocated`, and the caching allocator's cudaMalloc / cudaFree calls and
retries (frees of its cache to satisfy a request at the device budget) over the run. `--trace-dir DIR` writes each offloaded run's measured last
step next to its simulated schedule (Perfetto JSON).
Mixed precision: eager is PyTorch AMP (the forward under autocast with CUDA's op lists, AdamW on
fp32 parameters, a GradScaler for fp16), the executor runs the plan's autocast graph.
Run under jemalloc as well:
  LD_PRELOAD=libjemalloc.so.2 MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1,retain:true python ...
"""
import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from tensorstow.executor import graphs
from tensorstow.executor.data import batches
from tensorstow.executor.executor import Executor
from tensorstow.schema.plan import as_plan
from tensorstow.executor.ssd import SSDStore
from tensorstow.ir.models import resolve_model
from tensorstow.calibrate import hardware_for
from tensorstow.schema.options import Options
from tensorstow.planner.plan import make_plan
from tensorstow.calibrate import _QUICK, _disk_bw


def median_step(fn, xs, skip: int = 1):
    """The median step time of `fn` over `xs` after the first `skip` (warmup) steps."""
    times = []
    for x, y in xs:
        t0 = time.perf_counter()
        fn(x, y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[skip:] or times)


def eager_step(spec, device: torch.device, precision: str):
    """One eager PyTorch training step of a fresh `spec.build()` (seed 0) as a function of (x, y):
    the baseline. On the CPU the same per-tensor AdamW loop as the executor's exact optimizer and
    the executor's autocast table (ir.autocast); on a GPU PyTorch's default AdamW (foreach) and
    CUDA autocast, the eager run people make; fp16 with a GradScaler."""
    import contextlib

    from tensorstow.ir.autocast import gpu_autocast
    from tensorstow.ir.trace import PRECISIONS
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = spec.build().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({} if cuda else {"foreach": False}))
    amp = torch.amp.GradScaler(device.type) if precision == "fp16-mixed" else None

    def autocast():
        if precision == "fp32":
            return contextlib.nullcontext()
        if cuda:
            return torch.autocast("cuda", dtype=PRECISIONS[precision])
        return gpu_autocast(PRECISIONS[precision])

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = model(x.to(device), y.to(device))
        if amp is None:
            loss.backward()
            opt.step()
        else:
            amp.scale(loss).backward()
            amp.step(opt)
            amp.update()
        if cuda:
            torch.cuda.synchronize(device)
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--mode", default="both", choices=["sync", "overlap", "both"])
    ap.add_argument("--gpu-mem", default="48MB")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed", "fp16-mixed"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: the model's block size)")
    ap.add_argument("--hw", default="local", help="hardware spec file from `tensorstow probe`, or local (probe now)")
    ap.add_argument("--offload-policy", dest="offload_policy", default="zero-infinity",
                    help="the offloaded plans' policy (zero-infinity: DeepSpeed's schedule; lohan, ilp, ...)")
    ap.add_argument("--offload", default="ssd,dram", help="offloaded plans to run: ssd, dram, both (ssd,dram) or none")
    ap.add_argument("--trace-dir", dest="trace_dir", help="write measured and simulated traces here")
    ap.add_argument("--arena", default="auto", choices=["auto", "on", "off", "compare"],
                    help="the offloaded runs' device arena; compare: each run off, then on, and the ratio")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure eager and the all-resident runs this many times, each ratio to its own eager run")
    ap.add_argument("--resident", default=True, action=argparse.BooleanOptionalAction,
                    help="also run the all-resident plan (--no-resident: eager and the offloaded plans only)")
    a = ap.parse_args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    spec = resolve_model(a.model)
    allocator = "jemalloc" if "jemalloc" in os.environ.get("LD_PRELOAD", "") else "glibc malloc"
    print(f"# {a.model}, batch {a.batch}, {a.precision}, {a.steps} steps (median of the last {a.steps - 1}), "
          f"executor mode {a.mode}, allocator {allocator}, torch threads {torch.get_num_threads()}, device "
          f"{torch.cuda.get_device_name(device) if cuda else 'cpu (budgeted host memory)'}")

    def plan(**kw):
        o = Options(model=a.model, hardware=a.hw, batch=a.batch, seq=a.seq, precision=a.precision, **kw)
        return json.loads(make_plan(o, hardware_for(o)).dumps())

    resident = plan(policy="all-gpu")
    seq = resident["model"]["seq"]
    data = list(batches("synthetic", a.batch, seq, spec.config.vocab_size, a.steps, seed=0))

    flops = resident["predicted"]["model_tflops"] * resident["predicted"]["step_time_s"] * 1e12

    def rate(t):  # model TFLOPS at step time t (GPU only: on the CPU it says little)
        return f"   {flops / t / 1e12:.1f} model TFLOPS" if cuda else ""

    def peak():  # the device memory the last run held at its peak, and reset for the next
        if not cuda:
            return ""
        m = torch.cuda.max_memory_allocated(device)
        st = torch.cuda.memory_stats(device)  # the caching allocator's cudaMalloc / cudaFree over the run
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
        return (f"   max_memory_allocated {m / 2**30:.2f} GiB   cudaMalloc {st.get('num_device_alloc', 0)} "
                f"cudaFree {st.get('num_device_free', 0)} alloc retries {st.get('num_alloc_retries', 0)}")

    # on a GPU each mode instruction by instruction, then the step replayed as one CUDA graph
    # (executor.graphs; timed over the replays, after the eager warmup and the capture); --repeat:
    # eager and these again, each ratio against the eager run just before
    runs = [("sync", "off"), ("overlap", "off"), ("sync", "on")] if cuda else [("sync", "off")]
    best_resident = None
    for k in range(max(a.repeat, 1)):
        eager = eager_step(spec, device, a.precision)
        t_eager = median_step(eager, data)
        tag = f" (run {k + 1})" if a.repeat > 1 else ""
        print(f"eager PyTorch step{tag:8s} {t_eager:.4f} s{rate(t_eager)}{peak()}")
        eager = None  # free the eager copy before the executor builds its own
        for mode, graphed in (runs if k == 0 else [r for r in runs if r[1] == "on"]) if a.resident else ():
            torch.manual_seed(0)
            ex = Executor(resident, spec.build(), mode=mode, device=device, graphs=graphed)
            t_res = median_step(ex.step, data, skip=graphs.WARMUP + 1 if graphed == "on" else 1)
            ex.close()
            ex = None  # its memory goes before the next run's
            best_resident = min(best_resident or t_res, t_res)
            label = "graph" if graphed == "on" else mode
            print(f"executor, all-resident {label:8s} {t_res:.4f} s   ratio executor/eager = {t_res / t_eager:.2f}x"
                  f"{rate(t_res)}{peak()}")

    from tensorstow.executor.run import predicted_step
    from tensorstow.planner.pools import arena_need
    from tensorstow.schema.hardware import parse_size
    # the same policy with the state homed on the SSD, and (no SSD) in DRAM
    offload = {"both": "ssd,dram", "none": ""}.get(a.offload, a.offload).split(",")
    for label, kw in [(lbl, kw) for key, lbl, kw in (("ssd", "SSD-offloaded", {}), ("dram", "DRAM-offloaded", {"ssds": 0}))
                      if key in offload]:
        offl = plan(policy=a.offload_policy, gpu_mem=parse_size(a.gpu_mem), **kw)
        p = as_plan(offl)
        arenas = ("off", "on") if a.arena == "compare" else (a.arena,)
        for mode, arena in [(m, x) for m in (("sync", "overlap") if a.mode == "both" else (a.mode,)) for x in arenas]:
            with tempfile.TemporaryDirectory(dir=".") as d:
                torch.manual_seed(0)
                store = SSDStore(d, p.ssd_sizes()) if p.ssd_sizes() else None
                # with the arena, room for it and what a segment holds beside it, where that is more
                budget = max(arena_need(p, "gpu0"), p.predicted.capacity_bytes["gpu"]) if arena == "on" else None
                ex = Executor(offl, spec.build(), mode=mode, ssd_store=store, device=device, device_arena=arena,
                              device_budget=budget)
                t_off = median_step(ex.step, data)
                busy = ex.lane_busy()
                used = (f"arena, device budget {ex.dev.budget / 1e9:.3g} GB"
                        + (f", {ex.segment_graphs.replays} segments replayed as graphs" if ex.segment_graphs.captured
                           else "") if ex.dev.arena is not None else "no arena")
                if a.trace_dir:
                    write_traces(a.trace_dir, f"{a.model}-{label}-{mode}-{arena}", ex, p)
                ex.close()
                ex = None  # its arena goes before the next run's
            expect = predicted_step(p, mode)
            bound = max(p.predicted.busy_s.values())  # the plan's busiest resource: compute, a link, the CPU update
            if arena == "off":
                off_s = t_off  # the baseline of the next run's ratio (compare)
            print(f"executor, {label:15s} {mode:8s} {t_off:.4f} s   predicted {expect:.4f} s   "
                  f"measured/predicted = {t_off / expect:.2f}x   ({a.offload_policy}, device budget {a.gpu_mem}, {used}, "
                  f"offloaded/eager {t_off / t_eager:.2f}x)" + (f"   arena on/off = {t_off / off_s:.2f}x" if
                                                                arena == "on" and len(arenas) == 2 else "")
                  + f"{rate(t_off)}{peak()}")
            print(f"  measured / the plan's bound (its busiest resource, {bound:.4f} s) = {t_off / bound:.2f}x"
                  + (f"; model TFLOPS of the all-resident step's: {best_resident / t_off:.2f}" if best_resident else ""))
            print("  lane busy measured/predicted: " + ", ".join(
                f"{r} {v / p.predicted.busy_s[r]:.2f}x" for r, v in busy.items() if p.predicted.busy_s.get(r)))
            if p.ssd_sizes():  # the VM's disk moves by 30% from minute to minute: its rate now, as probed
                disk = _disk_bw(".", _QUICK.disk_bytes, _QUICK.disk_chunk, 1)
                ssd = p.hardware.spec.ssd
                print(f"  disk right after (as the quick probe times it): read {disk.read_bw / 1e9:.2f} GB/s, write "
                      f"{disk.write_bw / 1e9:.2f} GB/s; the plan assumed {ssd.read_bw / 1e9:.2f} / {ssd.write_bw / 1e9:.2f}")


def write_traces(directory, name, ex, plan):
    from tensorstow.planner.simulate import perfetto_trace, simulate_plan
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{name}.measured.json"), "w") as f:
        json.dump(ex.measured_trace(), f)
    with open(os.path.join(directory, f"{name}.simulated.json"), "w") as f:
        json.dump(perfetto_trace(list(plan.instructions), simulate_plan(plan), f"{name} simulated"), f)


if __name__ == "__main__":
    main()
