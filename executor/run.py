"""`tensorstow execute`: replay a plan for N steps with progress, logs, resume and a trace."""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tensorstow import TensorstowError
from tensorstow.executor.data import batches
from tensorstow.executor.runtime import Executor, ssd_sizes
from tensorstow.ir.models import resolve_model


def execute(plan: dict, *, steps: int, data: str = "synthetic", state_dir: str | None = None,
            mode: str = "sync", seed: int = 0, log_json: str | None = None, trace: str | None = None,
            out=sys.stdout) -> dict:
    """Run the plan until `steps` steps are committed; resume from `state_dir` if it holds some."""
    if steps < 1:
        raise TensorstowError(f"--steps must be >= 1, got {steps}")
    m = plan["model"]
    spec = resolve_model(plan["options"]["model"])
    torch.manual_seed(seed)  # immediately before the factory: same initial weights as eager
    model = spec.build()
    store, start = None, 0
    if ssd_sizes(plan):
        if state_dir is None:
            raise TensorstowError("this plan keeps training state on the SSD tier: pass --state-dir DIR "
                                  "(a directory on the SSD; it is created if missing)")
        from tensorstow.executor.ssd import SSDStore
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        store = SSDStore(state_dir, ssd_sizes(plan))
        start = store.committed_step() or 0
    elif state_dir is not None:
        print(f"note: the plan keeps nothing on SSD; --state-dir {state_dir} is not used", file=out)
    ex = Executor(plan, model, mode=mode, ssd_store=store, resume=start > 0)
    if start >= steps:
        print(f"state dir {state_dir} already holds step {start} >= --steps {steps}: nothing to do", file=out)
        return {"steps": start, "losses": []}
    if start:
        print(f"resuming from step {start} committed in {state_dir}", file=out)
    tokens = m["batch"] * m["seq"]
    log = open(log_json, "a") if log_json else None
    times, losses = [], []
    try:
        for k, (x, y) in enumerate(batches(data, m["batch"], m["seq"], ex.vocab, steps, seed, start), start):
            t0 = time.perf_counter()
            loss = ex.step(x, y)
            dt = time.perf_counter() - t0
            times.append(dt)
            losses.append(loss)
            print(f"step {k + 1}/{steps}  loss {loss:.4f}  {dt:.3f} s  {tokens / dt:.4g} tokens/s", file=out, flush=True)
            if log:
                log.write(json.dumps({"step": k + 1, "loss": loss, "step_time_s": dt, "tokens_per_s": tokens / dt,
                                      "device_peak_bytes": ex.peak_bytes.get("gpu", 0)}) + "\n")
                log.flush()
    finally:
        if log:
            log.close()
    pred = plan["predicted"]
    steady = times[1:] or times  # the first step warms caches and allocators
    med = statistics.median(steady)
    print(f"measured step {med:.4g} s (median of {len(steady)}) vs predicted {pred['step_time_s']:.4g} s "
          f"(x{med / pred['step_time_s']:.3g}); device peak {ex.peak_bytes.get('gpu', 0) / 1e6:.1f} MB of "
          f"{pred['capacity_bytes']['gpu'] / 1e6:.1f} MB budget", file=out)
    busy = ex.lane_busy()
    print("lane busy, measured (predicted): " + ", ".join(
        f"{r} {v:.3g} s ({pred['busy_s'].get(r, 0):.3g} s)" for r, v in busy.items()), file=out)
    if trace:
        with open(trace, "w") as f:
            json.dump(ex.measured_trace(), f)
        print(f"wrote {trace}", file=out)
    ex.close()
    return {"steps": steps, "losses": losses, "median_step_s": med, "peak": ex.peak_bytes}
