"""Mobius §4 in simulation: per-step time of the Mobius plan against the paper's two baselines
(GPipe, every stage resident; DeepSpeed ZeRO-3 with CPU offload, data parallel), and cross
against sequential mapping, for the paper's models (Table 3) on its three topologies.

    python benchmarks/bench_mobius.py [--models mobius-3b,mobius-8b] [--topologies topo4,topo2+2]

Prints one row per model x topology with the ratios the paper reports: ZeRO-3 / Mobius (the
paper: 3.8-5.1x, Fig. 5) and sequential / cross (the paper: 1.13-1.22x, i.e. 11.3-18.1% less
time, Fig. 10), and the traffic per step in units of the model's parameters (the paper: Mobius
~1.8x, DeepSpeed 7.3x, Fig. 6). Every number is predicted by tensorstow's simulator from the
presets (no GPU runs here).
"""
from __future__ import annotations

import argparse
import dataclasses
import time

from tensorstow import TensorstowError
from tensorstow.schema.options import Options
from tensorstow.planner.plan import policy_plan
from tensorstow.planner.problem import build_problem
from tensorstow.calibrate import hardware_for

MODELS = ("mobius-3b", "mobius-8b", "mobius-15b", "mobius-51b")
TOPOLOGIES = ("topo4", "topo2+2", "topo1+3")


def host_traffic(plan) -> float:
    """Bytes over the GPUs' host links per step (DRAM <-> GPU and GPU -> GPU through DRAM)."""
    return sum(v for k, v in plan.sim.traffic_bytes.items() if "->" in k and "ssd" not in k)


def row(model: str, topo: str) -> dict:
    o = Options(model=model, hardware=f"mobius-3090ti-{topo}", policy="mobius")
    problem = build_problem(o, hardware_for(o))
    out = {}
    t0 = time.perf_counter()
    for name, p in (("mobius", problem),
                    ("sequential", dataclasses.replace(problem, options=dataclasses.replace(o, mapping="sequential")))):
        r = policy_plan(p, "mobius")
        out[name] = r.sim.step_time_s if r.fits else None
        if name == "mobius":
            out["stages"] = len(r.decisions.pipeline.stages)
            out["resident"] = r.decisions.blocks[problem.order[0]].params == "gpu"
            out["mobius_traffic"] = host_traffic(r)
    out["plan_s"] = time.perf_counter() - t0
    for name in ("zero3-dp", "gpipe"):
        r = policy_plan(problem, name)
        out[name] = r.sim.step_time_s if r.fits else None
        if name == "zero3-dp":
            out["dp_traffic"] = host_traffic(r)
    out["model_bytes"] = 2 * problem.graph.param_count()  # fp16/bf16 parameters, the paper's unit
    return out


def fmt(t) -> str:
    return "OOM" if t is None else f"{t:.3g} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES))
    args = ap.parse_args()
    print("| model | topology | Mobius (cross) | sequential | ZeRO-3 offload | GPipe | ZeRO-3 / Mobius | "
          "sequential / cross | traffic Mobius / ZeRO-3 (x params) | stages | plan time |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for topo in args.topologies.split(","):
            try:
                r = row(model, topo)
            except TensorstowError as e:
                print(f"| {model} | {topo} | {e} |")
                continue
            m, dp, seq = r["mobius"], r["zero3-dp"], r["sequential"]
            ratio = f"{dp / m:.2f}x" if m and dp else "-"
            cross = f"{seq / m:.3f}x" if m and seq else "-"
            traffic = f"{r['mobius_traffic'] / r['model_bytes']:.1f} / {r['dp_traffic'] / r['model_bytes']:.1f}"
            print(f"| {model} | {topo} | {fmt(m)}{' (resident)' if r['resident'] else ''} | {fmt(seq)} | {fmt(dp)} | "
                  f"{fmt(r['gpipe'])} | {ratio} | {cross} | {traffic} | {r['stages']} | {r['plan_s']:.0f} s |",
                  flush=True)


if __name__ == "__main__":
    main()
