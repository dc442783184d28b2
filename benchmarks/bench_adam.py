"""CPU optimizer step: torch's fused AdamW (+ a separate fp16/bf16 cast) vs the one-pass C++ kernel.

All methods update the same fp32 tensors (params, grads, exp_avg, exp_avg_sq; the torch
optimizers' state points at them), so every method streams the same memory:

    fused            torch.optim.AdamW(fused=True).step()
    single           torch.optim.AdamW(foreach=False).step()   (torch's default CPU path)
    fused+bf16/fp16  fused step, then p16.copy_(p32)            (what a mixed-precision optimizer needs)
    cast bf16/fp16   p16.copy_(p32) alone
    kernel(+...)     executor.adam.adamw_step_ in the C++ kernel (csrc/adam.cpp): the update and
                     the downcast in one pass; `single`'s op order with a correctly rounded sqrt
    kernel-exact     the same with exact=True: torch's own (MKL) sqrt, bit-identical to `single`

Each round runs every method once, interleaved, after an untimed warm-up; the table shows
the best and the median over rounds (params/s), and the ratios the choice of kernel rests on:
kernel+16 over fused+16 (>= 1.1x on every size keeps the kernel).

    python benchmarks/bench_adam.py [--sizes-m 16 64] [--rounds 25] [--allocators default jemalloc]
    python benchmarks/bench_adam.py --lane [--model gpt-medium] [--precision fp32] [--steps 4]

`--lane` measures what the executor really runs: a plan whose every subgroup is updated on
the CPU (zero-infinity: states on SSD, in a temporary state dir), executed a few steps in sync mode;
the cpu.opt lane's busy time per step (every optimizer_step instruction: gradient views, the
update, the 16-bit copy) against torch.optim.AdamW(fused=True) on tensors of the same shapes,
in the same process: rate ratio = lane params/s over fused params/s (the bar: >= 0.9).
Both the default fused path and --exact-optimizer's torch single-tensor path are run.

Each allocator runs in its own child process; jemalloc is LD_PRELOADed with
MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1,retain:true (DESIGN.md, Pitfalls) and is
skipped with a note when libjemalloc.so.2 is not installed (apt-get install libjemalloc2).
"""

from __future__ import annotations

import argparse
import ctypes.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from tensorstow.executor import adam

JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1,retain:true"
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def allocator() -> str:
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    return "jemalloc" if "libjemalloc" in maps else "default (glibc malloc)"


def attach_state(opt: torch.optim.Optimizer, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    """Points the optimizer's state for `p` at the shared moment tensors."""
    opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": m, "exp_avg_sq": v}


def bench_size(n: int, rounds: int, kernel: bool) -> None:
    torch.manual_seed(0)
    p = torch.randn(n)
    p.grad = torch.randn(n) * 1e-2
    m, v = torch.zeros(n), torch.full((n,), 1e-6)
    out = {torch.bfloat16: torch.empty(n, dtype=torch.bfloat16), torch.float16: torch.empty(n, dtype=torch.float16)}
    fused = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    single = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    attach_state(fused, p, m, v)
    attach_state(single, p, m, v)
    step = [10]

    def kernel_step(out16, exact=False):
        step[0] += 1
        adam.adamw_step_(p, p.grad, m, v, step[0], LR, BETAS, EPS, WD, out16, exact=exact)

    methods = {
        "fused": fused.step,
        "single": single.step,
        "fused+bf16": lambda: (fused.step(), out[torch.bfloat16].copy_(p)),
        "fused+fp16": lambda: (fused.step(), out[torch.float16].copy_(p)),
        "cast bf16": lambda: out[torch.bfloat16].copy_(p),
        "cast fp16": lambda: out[torch.float16].copy_(p),
    }
    if kernel:
        methods.update({
            "kernel": lambda: kernel_step(None),
            "kernel+bf16": lambda: kernel_step(out[torch.bfloat16]),
            "kernel+fp16": lambda: kernel_step(out[torch.float16]),
            "kernel-exact+bf16": lambda: kernel_step(out[torch.bfloat16], True),
            "kernel-exact+fp16": lambda: kernel_step(out[torch.float16], True),
        })
    times = {name: [] for name in methods}
    for name, fn in methods.items():  # warm-up: first touch, lazy state, page faults
        fn()
    for r in range(rounds):
        for name, fn in methods.items():
            if name == "single" and r >= max(3, rounds // 3):
                continue  # ~10x slower than the rest; a few rounds suffice
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

    best = {name: min(ts) for name, ts in times.items()}
    median = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"\n{n / 2**20:.0f} M params ({n * 4 / 2**20:.0f} MiB per fp32 array), {len(times['fused'])} rounds")
    print(f"  {'method':<18}{'best Mparam/s':>14}{'median':>10}")
    for name, ts in times.items():
        print(f"  {name:<18}{n / min(ts) / 1e6:>14.0f}{n / statistics.median(ts) / 1e6:>10.0f}")

    def ratio(a, b):  # speed of a over speed of b
        return f"{best[b] / best[a]:.2f}x best, {median[b] / median[a]:.2f}x median"

    print(f"  fused / single: {ratio('fused', 'single')}")
    if kernel:
        for d in ("bf16", "fp16"):
            print(f"  kernel+{d} / fused+{d}: {ratio(f'kernel+{d}', f'fused+{d}')}   "
                  f"(kernel-exact+{d}: {ratio(f'kernel-exact+{d}', f'fused+{d}')})")


def child(args) -> None:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    info = adam.kernel_info()
    kernel = "C++ kernel" in info
    if not kernel:
        info += "; kernel rows skipped"
    print(f"== allocator: {allocator()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"   {info}")
    for size_m in args.sizes_m:
        bench_size(int(size_m * 2**20), args.rounds, kernel)


def bench_lane(args) -> None:
    import tempfile

    import tensorstow
    from tensorstow.executor.data import batches
    from tensorstow.ir.models import resolve_model

    torch.set_num_threads(args.threads or torch.get_num_threads())
    print(f"== executor cpu.opt lane: {args.model}, {args.precision}, zero-infinity on lohan-rtx4090 with "
          f"--gpu-mem {args.gpu_mem}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"   {adam.kernel_info()}")
    spec = resolve_model(args.model)
    rows = {}
    for exact in (False, True):
        plan = tensorstow.plan(args.model, hw="lohan-rtx4090", policy="zero-infinity", batch=1, seq=args.seq,
                               precision=args.precision, gpu_mem=args.gpu_mem, exact_optimizer=exact).to_plan()
        cpu_blocks = {b for b, d in plan.decisions.blocks.items() if d.optimizer == "cpu"}
        torch.manual_seed(0)
        model = spec.build()
        n = sum(q.numel() for q in model.parameters())
        with tempfile.TemporaryDirectory() as d:
            ex = tensorstow.Executor(plan, model, state_dir=d)
            busy = []
            for x, y in batches("synthetic", 1, plan.model.seq, ex.vocab, args.steps, 0):
                ex.step(x, y)
                busy.append(ex.lane_busy().get("cpu.opt", 0.0))
            ex.close()
        steady = busy[1:] or busy
        rows["exact" if exact else "fused (default)"] = (n, min(steady), statistics.median(steady), len(cpu_blocks))
    # the baseline: torch's fused AdamW over tensors of the model's shapes, same process
    torch.manual_seed(0)
    params = [q.detach().clone() for q in spec.build().parameters()]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    opt.step()  # state allocated, untimed
    ts = []
    for _ in range(max(args.steps, 5)):
        t0 = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t0)
    fused_best, fused_med = min(ts), statistics.median(ts)
    n = sum(q.numel() for q in params)
    print(f"  {'path':<18}{'best Mparam/s':>14}{'median':>10}{'vs fused AdamW (best, median)':>32}")
    print(f"  {'torch fused AdamW':<18}{n / fused_best / 1e6:>14.0f}{n / fused_med / 1e6:>10.0f}")
    for name, (n_, best, med, k) in rows.items():
        print(f"  {'lane, ' + name:<18}{n_ / best / 1e6:>14.0f}{n_ / med / 1e6:>10.0f}"
              f"{fused_best / best:>20.2f}x{fused_med / med:>10.2f}x   ({k} CPU subgroups)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lane", action="store_true", help="time the executor's cpu.opt lane on a plan")
    ap.add_argument("--model", default="gpt-medium")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--gpu-mem", dest="gpu_mem", default="200MB")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sizes-m", type=float, nargs="+", default=[16, 64], help="params per tensor, in Mi")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--allocators", nargs="+", default=["default", "jemalloc"], choices=["default", "jemalloc"])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.lane:
        bench_lane(args)
        return
    if args.child:
        child(args)
        return
    adam.kernel_info()  # build once here, not in each child
    for name in args.allocators:
        env = dict(os.environ)
        if name == "jemalloc":
            lib = ctypes.util.find_library("jemalloc")
            if lib is None:
                print("\n== allocator: jemalloc: libjemalloc not found (apt-get install libjemalloc2); skipped")
                continue
            env["LD_PRELOAD"] = "libjemalloc.so.2"
            env["MALLOC_CONF"] = JEMALLOC_CONF
        cmd = [sys.executable, __file__, "--child", "--rounds", str(args.rounds), "--threads", str(args.threads),
               "--sizes-m", *map(str, args.sizes_m)]
        sys.stdout.flush()
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
