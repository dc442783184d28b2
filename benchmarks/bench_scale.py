"""Train a model whose training state is several times this machine's DRAM budget, from SSD.

    python benchmarks/bench_scale.py [--model gpt3-1.3b] [--dram 6GB] [--gpu-mem 2GB] [--batch 1]
        [--seq 512] [--precision fp32] [--steps 3] [--mode both] [--threads 1] [--dir DIR] [--expert-groups N]
        [--llama llama-3b --lora SPEC --quantize nf4 --ssd-for KINDS]

QLoRA (benchmarks/RESULTS.md, "QLoRA larger than DRAM"): `--llama llama-3b` writes a 3.2B
LLaMA-shaped checkpoint with random bf16 weights under --dir (6.4 GB, more than --dram), and
`--lora ... --quantize nf4` trains adapters on its base stored in NF4 (about 2.4 GB with the
full-precision embeddings and head), quantized from the checkpoint as it is read.

Probes this machine (`tensorstow probe`, its disk under DIR) with `--threads` torch threads,
plans the model for it with the given DRAM and device budgets (the device tier is CPU memory
without a GPU), and runs `tensorstow execute` from a state dir on that disk in a child process,
in sync mode, then (a fresh state dir) in overlap mode. Reports, per mode:

- step time against the plan's prediction for that mode (ratio);
- the bound: max(the compute lane alone, the SSD's bytes at the probed read / write rates,
  the CPU optimizer alone), the lanes "alone" as the sync run measured them (one lane at a
  time), and the step against it (ratio);
- bytes the child really read and wrote per step (/proc/PID/io: storage I/O, O_DIRECT
  included) against the plan's, and the achieved bandwidth;
- the child's peak RSS against --dram + --gpu-mem + torch's imports + the stated overhead;
- whether the two modes' losses are equal;
and the largest GPT preset `tensorstow fit` finds trainable with this box's real DRAM.

Needs the state dir's disk (`tensorstow show` states it: two store slots per buffer) free once;
the modes run one after the other.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorstow.executor.run import predicted_step
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


HOST_OVERHEAD_MB = 300
"""Host memory a run takes beyond --dram, --gpu-mem (CPU memory without a GPU) and torch's imports,
as docs/architecture.md states it (the model's trace, allocator arenas, the optimizer's transients)."""


def imports_rss_mb(env: dict, extra: str = "") -> float:
    """Peak RSS of a process that only imports what `tensorstow execute` imports (and `extra`,
    comma-separated modules: an `hf:` model's transformers, a quantized base's bitsandbytes): its
    own mapping's high-water mark (VmHWM). `getrusage`'s maxrss keeps what the process held before
    its exec, the forked copy of this one (2.8 GB after `write_llama`, where the imports take 0.36)."""
    code = (f"import pathlib, tensorstow.cli, tensorstow.executor.run{', ' + extra if extra else ''}; "
            "print(pathlib.Path('/proc/self/status').read_text())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return int(re.search(r"^VmHWM:\s+(\d+) kB", r.stdout, re.M).group(1)) / 1024


def write_llama(name: str, root: Path, seq: int) -> tuple[str, int]:
    """A LLaMA-shaped checkpoint of `planner.report.LLAMA_LADDER` with random bf16 weights (norms
    1), written tensor by tensor in shards of about 2 GB as `save_pretrained` writes them, so
    nothing downloads and the writer never holds more than a shard; returns (its `hf:` reference,
    its bytes)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from tensorstow.planner.report import llama_config
    config = llama_config(name, seq) | {"torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(LlamaConfig(**config)).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    shards, shard, size, total = [], {}, 0, 0  # shards: each one's tensor names
    for k, shape in shapes.items():
        t = (torch.ones(shape) if k.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02)
        shard[k] = t.to(torch.bfloat16)
        size += shard[k].nbytes
        if size >= 2e9 or k == list(shapes)[-1]:
            shards.append(list(shard))
            save_file(shard, root / f"shard-{len(shards)}.safetensors", metadata={"format": "pt"})
            total, shard, size = total + size, {}, 0
    n = len(shards)
    for i in range(1, n + 1):
        (root / f"shard-{i}.safetensors").rename(root / f"model-{i:05d}-of-{n:05d}.safetensors")
    index = {k: f"model-{i:05d}-of-{n:05d}.safetensors" for i, names in enumerate(shards, 1) for k in names}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": index}))
    return f"hf:{root}", total


def run_mode(plan: Path, state: Path, mode: str, steps: int, env: dict) -> dict:
    """`tensorstow execute` of `plan` in `mode` from a fresh `state`: its log rows, the child's
    I/O counters per step, and its peak RSS."""
    log = state.with_name(state.name + ".jsonl")
    t0 = time.time()
    child = subprocess.Popen([sys.executable, "-m", "tensorstow.cli", "execute", str(plan), "--steps", str(steps),
                              "--mode", mode, "--state-dir", str(state), "--log-json", str(log)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    io = (0, 0)
    peak = 0.0
    marks = {}  # step -> io counters when its log line appeared
    while child.poll() is None:
        try:
            io = io_counters(child.pid)
            peak = max(peak, rss_peak_mb(child.pid))
        except (FileNotFoundError, ProcessLookupError, AttributeError):
            pass
        if log.exists():
            for line in log.read_text().splitlines():
                marks.setdefault(json.loads(line)["step"], io)
        time.sleep(0.2)
    out = child.stdout.read()
    print(out)
    if child.returncode:
        raise SystemExit(f"execute --mode {mode} failed")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    first, last = min(marks), max(marks)
    return {"rows": rows, "peak_mb": peak, "wall_s": time.time() - t0,
            "read": (marks[last][0] - marks[first][0]) / max(last - first, 1),
            "written": (marks[last][1] - marks[first][1]) / max(last - first, 1)}


def describe(p: Plan, a, base_bytes: int) -> None:
    """What the plan trains against --dram: the training state, and a frozen base's bytes in the
    checkpoint, stored as planned, and its home."""
    state = sum(b.bytes for n, b in p.buffers.items() if b.buffer_kind in ("P", "M", "OS", "G"))
    print(f"{a.llama or a.model}: {p.model.params / 1e9:.3g}B parameters trained, {a.precision} training state "
          f"(P+M+G+OS) {state / 1e9:.2g} GB = {state / p.predicted.capacity_bytes['dram']:.2g}x --dram {a.dram}; "
          f"{a.threads} torch thread(s)")
    if p.model.frozen_params:  # a frozen base (LoRA): what it takes stored as planned, and where it lives
        stored = {n: b for n, b in p.buffers.items() if b.buffer_kind == "C"}
        homes = sorted({b.home for b in stored.values()})
        print(f"frozen base: {p.model.frozen_params / 1e9:.2f}B parameters, {base_bytes / 1e9:.2f} GB in the checkpoint "
              f"({base_bytes / p.predicted.capacity_bytes['dram']:.1f}x --dram {a.dram}), stored as planned "
              f"({a.quantize or 'full precision'}) {sum(b.bytes for b in stored.values()) / 1e9:.2f} GB, home "
              f"{', '.join(homes)}; {p.model.params / 1e6:.3g}M parameters trained")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-1.3b")
    ap.add_argument("--dram", default="6GB")
    ap.add_argument("--gpu-mem", default="2GB")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--seq", default="512")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--policy", default="lohan")
    ap.add_argument("--expert-groups", default="1", help="a mixture of experts: its experts in this many units a layer")
    ap.add_argument("--llama", default=None, help="train a LLaMA-shaped model of planner.report.LLAMA_LADDER (llama-3b, "
                                                  "...) with random bf16 weights written under --dir, instead of --model")
    ap.add_argument("--lora", default=None, help="plan --lora: train adapters on the frozen base")
    ap.add_argument("--quantize", default=None, help="plan --quantize (with --lora): the base stored quantized (QLoRA)")
    ap.add_argument("--ssd-for", default=None, help="plan --ssd-for: what the SSDs may hold")
    ap.add_argument("--mode", default="both", choices=["sync", "overlap", "both"])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the compute (1 on a 2-core box leaves a core to the other lanes)")
    ap.add_argument("--dir", default=None, help="directory on the disk to train from (default: a temp dir here)")
    return ap.parse_args()


def main() -> int:
    a = parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=a.dir or "."))
    try:
        spec = work / "hw.json"
        r = tensorstow("probe", "--disk-dir", str(work), "-o", str(spec), env=env)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        hw = json.loads(spec.read_text())
        ssd_read, ssd_write = hw["ssd"]["read_bw"], hw["ssd"]["write_bw"]
        plan = work / "plan.json"
        model, base_bytes = a.model, 0
        if a.llama:
            (work / a.llama).mkdir()
            model, base_bytes = write_llama(a.llama, work / a.llama, int(a.seq))
        extra = [f"--{k.replace('_', '-')}={v}" for k, v in (("lora", a.lora), ("quantize", a.quantize),
                                                            ("ssd_for", a.ssd_for)) if v]
        r = tensorstow("plan", model, "--hw", str(spec), "--dram", a.dram, "--gpu-mem", a.gpu_mem, "--ssds", "1",
                       "--policy", a.policy, "--precision", a.precision, "--batch", a.batch, "--seq", a.seq, *extra,
                       *(["--expert-groups", a.expert_groups] if a.expert_groups != "1" else []), "-o", str(plan), env=env)
        print(r.stdout)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        p = Plan.load(plan)
        describe(p, a, base_bytes)
        plan_r = p.predicted.traffic_bytes.get("ssd->dram", 0)
        plan_w = p.predicted.traffic_bytes.get("dram->ssd", 0)
        budget_mb = (p.predicted.capacity_bytes["dram"] + p.predicted.capacity_bytes["gpu"]) / 2**20
        imports_mb = imports_rss_mb(env, ", ".join(m for m, on in (("transformers", model.startswith("hf:")),
                                                                  ("bitsandbytes", a.quantize)) if on))
        runs = {}
        for mode in ("sync", "overlap") if a.mode == "both" else (a.mode,):
            runs[mode] = run_mode(plan, work / f"state-{mode}", mode, a.steps, env)
            shutil.rmtree(work / f"state-{mode}", ignore_errors=True)  # the next mode's room on the disk
        bound = None
        if "sync" in runs:  # one lane at a time: each lane's busy time is its time alone
            alone = runs["sync"]["rows"][-1]["lane_busy_s"]
            compute = sum(v for k, v in alone.items() if k.endswith(".compute"))
            disk = plan_r / ssd_read + plan_w / ssd_write
            bound = max(compute, disk, alone.get("cpu.opt", 0.0))
            print(f"\nbound: max(compute alone {compute:.3g} s, SSD {plan_r / 1e9:.1f} GB read + {plan_w / 1e9:.1f} GB "
                  f"written at the probed {ssd_read / 1e9:.2f} / {ssd_write / 1e9:.2f} GB/s {disk:.3g} s, CPU optimizer "
                  f"alone {alone.get('cpu.opt', 0.0):.3g} s) = {bound:.3g} s")
        for mode, run in runs.items():
            steady = run["rows"][1:] or run["rows"]
            step_s = sum(r["step_time_s"] for r in steady) / len(steady)
            pred = predicted_step(p, mode)
            achieved = (run["read"] + run["written"]) / step_s
            print(f"{mode}: step (mean of steps 2..{a.steps}) {step_s:.3g} s; predicted {pred:.3g} s; measured/predicted "
                  f"{step_s / pred:.2f}" + (f"; step/bound {step_s / bound:.2f}" if bound else ""))
            print(f"  SSD bytes per step: read {run['read'] / 1e9:.1f} GB (plan {plan_r / 1e9:.1f}), written "
                  f"{run['written'] / 1e9:.1f} GB (plan {plan_w / 1e9:.1f}); {achieved / 1e9:.2f} GB/s over the step")
            print("  lanes, last step: " + ", ".join(f"{k} {v:.3g} s" for k, v in run["rows"][-1]["lane_busy_s"].items()))
            allowed = budget_mb + imports_mb + HOST_OVERHEAD_MB
            print(f"  peak RSS {run['peak_mb']:.0f} MiB vs --dram + --gpu-mem {budget_mb:.0f} MiB + imports {imports_mb:.0f} "
                  f"MiB + {HOST_OVERHEAD_MB} MiB stated = {allowed:.0f} MiB: {'within' if run['peak_mb'] <= allowed else 'OVER'}; "
                  f"wall {run['wall_s']:.0f} s; losses {[round(r['loss'], 6) for r in run['rows']]}")
        if len(runs) == 2:
            same = [r["loss"] for r in runs["sync"]["rows"]] == [r["loss"] for r in runs["overlap"]["rows"]]
            print(f"losses of the two modes equal: {same}")
        fit = tensorstow("fit", "--hw", "local", "--policy", a.policy, *extra, env=env)
        print(f"largest {'LLaMA-shaped model' if a.lora else 'GPT-3 preset'} per `tensorstow fit --hw local` "
              f"{' '.join(extra)} (this box's real DRAM and disk):")
        print(fit.stdout or fit.stderr)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
