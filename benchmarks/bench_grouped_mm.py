"""A mixture of experts' grouped matmul against a dense matmul of the same flops, on this machine.

    python benchmarks/bench_grouped_mm.py [--rows 1024] [--k 1024] [--n 1024] [--experts 8,24,64]
        [--dtype float32] [--threads 1] [--device cpu]

transformers runs a layer's experts as one `grouped_mm` of the step's token-rows (batch x seq x
top-k), split among the experts by the routing; the planner prices it at the dense-matmul rate of
its flops (docs/cost-model.md, "Mixtures of experts"). This prints, per expert count (balanced
routing: the rows split evenly), the grouped matmul's median time against one `rows x k @ k x n`
matmul's measured in the same run, and their ratio: how far that pricing is from the kernel.
"""
from __future__ import annotations

import argparse
import time

import torch


def median_s(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024, help="token-rows a step routes (batch x seq x top-k)")
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--experts", default="8,24,64")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype, dev = getattr(torch, a.dtype), torch.device(a.device)
    x = torch.randn(a.rows, a.k, dtype=dtype, device=dev)
    w = torch.randn(a.k, a.n, dtype=dtype, device=dev)
    dense = median_s(lambda: x @ w)
    flops = 2 * a.rows * a.k * a.n
    print(f"dense {a.rows}x{a.k} @ {a.k}x{a.n} ({a.dtype}, {a.threads} thread(s), {a.device}): "
          f"{dense * 1e3:.2f} ms, {flops / dense / 1e9:.1f} GFLOP/s")
    for e in (int(v) for v in a.experts.split(",")):
        b = torch.randn(e, a.k, a.n, dtype=dtype, device=dev)
        counts = torch.full((e,), a.rows // e)
        counts[: a.rows % e] += 1
        offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
        grouped = median_s(lambda: torch.nn.functional.grouped_mm(x, b, offs=offs))
        print(f"grouped_mm, {e} experts ({a.rows // e} rows each): {grouped * 1e3:.2f} ms, "
              f"{grouped / dense:.2f}x the dense matmul")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
