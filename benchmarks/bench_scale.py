"""Train a model whose training state is several times this machine's DRAM budget, from SSD.

    python benchmarks/bench_scale.py [--model gpt3-1.3b] [--dram 6GB] [--gpu-mem 2GB]
                                     [--batch 1] [--seq 512] [--steps 3] [--dir DIR]

Probes this machine's disk (`tensorstow probe`), plans the model for it with the given DRAM
and device budgets (the device tier is CPU memory without a GPU), runs `tensorstow execute`
from a state dir on that disk in a child process, and reports, in one run:

- step time, measured against the plan's prediction (ratio);
- bytes the child really read and wrote per step (/proc/PID/io: storage I/O, O_DIRECT
  included), and the achieved bandwidth against the disk's probed bandwidth (ratio);
- the child's peak RSS against --dram + --gpu-mem;
- the largest GPT preset `tensorstow fit` finds trainable with this box's real DRAM.

Needs about 2.2x the training state in free disk (two store slots per buffer).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorstow.schema.plan import Plan


def tensorstow(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorstow.cli", *args], capture_output=True,
                          text=True, **kw)


def io_counters(pid: int) -> tuple[int, int]:
    text = Path(f"/proc/{pid}/io").read_text()
    get = lambda k: int(re.search(rf"^{k}: (\d+)", text, re.M).group(1))  # noqa: E731
    return get("read_bytes"), get("write_bytes")


def rss_peak_mb(pid: int) -> float:
    m = re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m.group(1)) / 1024 if m else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-1.3b")
    ap.add_argument("--dram", default="6GB")
    ap.add_argument("--gpu-mem", default="2GB")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--seq", default="512")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--policy", default="lohan")
    ap.add_argument("--dir", default=None, help="directory on the disk to train from (default: a temp dir here)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=a.dir or "."))
    try:
        spec = work / "hw.json"
        r = tensorstow("probe", "--disk-dir", str(work), "-o", str(spec))
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        hw = json.loads(spec.read_text())
        ssd_read, ssd_write = hw["ssd"]["read_bw"], hw["ssd"]["write_bw"]
        plan = work / "plan.json"
        r = tensorstow("plan", a.model, "--hw", str(spec), "--dram", a.dram, "--gpu-mem", a.gpu_mem, "--ssds", "1",
                       "--policy", a.policy, "--precision", "fp32", "--batch", a.batch, "--seq", a.seq, "-o", str(plan))
        print(r.stdout)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        p = Plan.load(plan)
        state = sum(b.bytes for n, b in p.buffers.items() if n.split(":")[0] in ("P", "M", "OS", "G"))
        log = work / "log.jsonl"
        t0 = time.time()
        child = subprocess.Popen([sys.executable, "-m", "tensorstow.cli", "execute", str(plan), "--steps",
                                  str(a.steps), "--state-dir", str(work / "state"), "--log-json", str(log)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        io = [(time.time(), (0, 0))]
        peak = 0.0
        marks = {}  # step -> io counters when its log line appeared
        while child.poll() is None:
            try:
                io.append((time.time(), io_counters(child.pid)))
                peak = max(peak, rss_peak_mb(child.pid))
            except (FileNotFoundError, ProcessLookupError, AttributeError):
                pass
            if log.exists():
                for line in log.read_text().splitlines():
                    marks.setdefault(json.loads(line)["step"], io[-1][1])
            time.sleep(0.2)
        out = child.stdout.read()
        print(out)
        if child.returncode:
            return 1
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        steady = rows[1:] or rows
        step_s = sum(r["step_time_s"] for r in steady) / len(steady)
        pred = p.predicted.step_time_s
        first, last = min(marks), max(marks)
        per_step_r = (marks[last][0] - marks[first][0]) / max(last - first, 1)
        per_step_w = (marks[last][1] - marks[first][1]) / max(last - first, 1)
        plan_r = p.predicted.traffic_bytes.get("ssd->dram", 0)
        plan_w = p.predicted.traffic_bytes.get("dram->ssd", 0)
        achieved = (per_step_r + per_step_w) / step_s
        budget_mb = (p.predicted.capacity_bytes["dram"] + p.predicted.capacity_bytes["gpu"]) / 2**20
        shutil.rmtree(work / "state", ignore_errors=True)  # fit probes the disk's free space
        fit = tensorstow("fit", "--hw", "local", "--policy", a.policy)
        print(f"\n{a.model}: {p.model.params / 1e9:.2f}B parameters, fp32 training state (P+G+OS) "
              f"{state / 1e9:.1f} GB = {state / p.predicted.capacity_bytes['dram']:.1f}x --dram {a.dram}")
        print(f"step time (mean of steps 2..{a.steps}): {step_s:.1f} s; predicted {pred:.1f} s; "
              f"measured/predicted {step_s / pred:.2f}")
        print(f"SSD bytes per step: read {per_step_r / 1e9:.1f} GB (plan {plan_r / 1e9:.1f} GB), written "
              f"{per_step_w / 1e9:.1f} GB (plan {plan_w / 1e9:.1f} GB)")
        print(f"achieved I/O {achieved / 1e9:.2f} GB/s over the whole step vs probed disk read {ssd_read / 1e9:.2f} / "
              f"write {ssd_write / 1e9:.2f} GB/s: ratio {achieved / ((ssd_read + ssd_write) / 2):.2f} of the mean")
        print(f"peak RSS {peak:.0f} MB vs --dram + --gpu-mem {budget_mb:.0f} MB (+ fixed overhead, "
              f"tests/test_scale.py: 512 MB)")
        print(f"total wall time {time.time() - t0:.0f} s")
        print("largest GPT-3 preset per `tensorstow fit --hw local` (this box's real DRAM and disk):")
        print(fit.stdout or fit.stderr)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
