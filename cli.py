"""The `tensorstow` command line: plan, show, diff, check, fit, probe, execute, export.

User errors print one line `tensorstow: error: ...` naming the problem and the fix, and
exit with status 2. Run with no arguments for the built-in demo.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from tensorstow.calibrate import hardware_for
from tensorstow.errors import TensorstowError
from tensorstow.schema.hardware import parse_size
from tensorstow.schema.schedule import TIERS


def _fmt(n: float) -> str:
    from tensorstow.planner.problem import fmt_bytes
    return fmt_bytes(n)


# ---- plan files ----------------------------------------------------------------------------

def load_plan(path: str):
    """The typed plan in a file (`schema.plan.Plan`); one clear error for anything malformed."""
    from tensorstow.schema.plan import Plan
    return Plan.load(path)


def summary(plan, sim=None) -> str:
    """The plan's summary; `sim`: its simulation, when the caller has one (else it is replayed)."""
    m, pred, dec = plan.model, plan.predicted, plan.decisions
    step, bn, busy = pred.step_time_s, pred.bottleneck, pred.busy_s
    lines = [
        f"plan: {m.name} on {plan.hardware.name}, policy {dec.policy}"
        + (" (chosen by auto)" if plan.options.policy == "auto" else "") + " "
        f"({m.precision}, batch {m.batch}, seq {m.seq})",
        f"model: {m.params / 1e9:.3g}B parameters, {m.layers} layers"
        + (f" (traced {m.traced_layers}, the rest replicated by similarity)" if plan.replicated else ""),
        f"predicted step: {step:.4g} s, {pred.tokens_per_s:.4g} tokens/s, {pred.model_tflops:.3g} model TFLOPS",
        f"bottleneck: {bn}" + (f" (busy {busy[bn]:.4g} s = {100 * busy[bn] / step:.0f}% of the step)" if bn in busy and step else ""),
        "memory peak / capacity: " + "   ".join(
            f"{t} {_fmt(pred.peak_bytes.get(t, 0))} / {_fmt(pred.capacity_bytes.get(t, 0))}" for t in TIERS),
        "busy: " + ", ".join(f"{k} {v:.4g} s" for k, v in sorted(busy.items(), key=lambda kv: -kv[1])),
        "traffic: " + (", ".join(f"{k} {_fmt(v)}" for k, v in pred.traffic_bytes.items()) or "none"),
        "placement: " + _placement(dec),
    ]
    kinds: dict[str, int] = {}
    for ins in plan.instructions:
        kinds[ins.kind] = kinds.get(ins.kind, 0) + 1
    lines.append(f"instructions: {len(plan.instructions)} (" + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) + ")")
    lines += _pipeline_lines(plan, sim)
    lines += [f"note: {n}" for n in dec.notes]
    return "\n".join(lines)


def _pipeline_lines(plan, sim=None) -> list[str]:
    """Stages, their GPUs and root complexes, and each GPU's simulated peak (multi-GPU plans)."""
    pl = plan.decisions.pipeline
    if pl is None:
        return []
    from tensorstow.planner.simulate import simulate_plan
    names = [b.name for b in plan.model.blocks]
    gpus = plan.hardware.spec.gpus
    out = [f"pipeline: {pl.kind}, {len(pl.stages)} stage(s) on {len(set(pl.gpus))} GPU(s) ({pl.mapping} mapping), "
           f"{pl.microbatches} microbatches of batch {plan.model.batch}"]
    if pl.kind != "data-parallel":
        out += [f"  stage {j}: {_ranges(names[lo:hi])} on gpu{k} (root complex {gpus[k].root_complex})"
                for j, ((lo, hi), k) in enumerate(zip(pl.stages, pl.gpus))]
    peaks = (sim or simulate_plan(plan)).peak_bytes
    out.append("gpu peaks: " + ", ".join(f"gpu{k} {_fmt(peaks.get(f'gpu{k}', 0))}" for k in range(len(gpus))))
    return out


def replay_line(plan, sim=None) -> str:
    """What the simulator makes of the file as it stands (a hand-edited plan shows here); `sim`:
    `simulate_plan(plan)`, when the caller has it."""
    from tensorstow.planner.simulate import simulate_plan
    sim = sim or simulate_plan(plan)
    same = abs(sim.step_time_s - plan.predicted.step_time_s) <= 1e-5 * max(plan.predicted.step_time_s, 1e-9)
    return (f"replay of this file: step {sim.step_time_s:.4g} s, bottleneck {sim.bottleneck}"
            + (" (as predicted)" if same else f" (the file predicts {plan.predicted.step_time_s:.4g} s: "
               "it was edited or comes from another tensorstow; re-plan it)"))


def _placement(dec) -> str:
    counts: dict[str, dict[str, int]] = {}
    for bd in dec.blocks.values():
        for k, v in vars(bd).items():
            counts.setdefault(k, {})
            counts[k][v] = counts[k].get(v, 0) + 1
    return "; ".join(f"{k}: " + ", ".join(f"{v} x{n}" for v, n in sorted(c.items())) for k, c in counts.items())


def diff_text(a, b) -> tuple[str, bool]:
    """What changed between two plans and why it matters; (text, identical)."""
    out = []
    for key in ("model", "hardware"):
        x, y = getattr(a, key), getattr(b, key)
        if x.fingerprint != y.fingerprint:
            out.append(f"{key}: {x.name} ({x.fingerprint}) -> {y.name} ({y.fingerprint})"
                       + ("; same model and options, so the traced graph itself changed (torch or model code)"
                          if key == "model" and x.name == y.name and a.options == b.options else ""))
    oa, ob = a.options.to_json(), b.options.to_json()
    for k in sorted(oa):
        if oa[k] != ob[k]:
            out.append(f"option {k}: {oa[k]} -> {ob[k]}")
    pa, pb = a.predicted, b.predicted
    if pa.step_time_s != pb.step_time_s:
        ch = (pb.step_time_s - pa.step_time_s) / pa.step_time_s * 100 if pa.step_time_s else float("inf")
        out.append(f"predicted step time: {pa.step_time_s:.6g} s -> {pb.step_time_s:.6g} s ({ch:+.1f}%"
                   + (", faster)" if ch < 0 else ", slower)"))
    if pa.bottleneck != pb.bottleneck:
        out.append(f"bottleneck: {pa.bottleneck} -> {pb.bottleneck}")
    for t in TIERS:
        x, y = pa.peak_bytes.get(t, 0), pb.peak_bytes.get(t, 0)
        if x != y:
            cap = pb.capacity_bytes.get(t, 0)
            out.append(f"peak {t}: {_fmt(x)} -> {_fmt(y)}" + (f" ({100 * y / cap:.0f}% of capacity)" if cap else ""))
    da, db = a.decisions.to_json(), b.decisions.to_json()
    for k in sorted((set(da) | set(db)) - {"blocks"}):  # a key only one side has (pipeline, host_reserved)
        if da.get(k) != db.get(k):
            out.append(f"decision {k}: {da.get(k, '-')} -> {db.get(k, '-')}")
    changes: dict[str, list[str]] = {}
    for blk in sorted(set(da["blocks"]) | set(db["blocks"]), key=_block_key):
        x, y = da["blocks"].get(blk, {}), db["blocks"].get(blk, {})
        for f in sorted(set(x) | set(y)):
            if x.get(f) != y.get(f):
                changes.setdefault(f"{f}: {x.get(f)} -> {y.get(f)}", []).append(blk)
    for what, blks in changes.items():
        out.append(f"blocks {_ranges(blks)}: {what}")
    ba, bb = a.buffers, b.buffers
    for what, names in (("added", sorted(set(bb) - set(ba))), ("removed", sorted(set(ba) - set(bb))),
                        ("changed", sorted(n for n in set(ba) & set(bb) if ba[n] != bb[n]))):
        if names:
            fields = sorted({f for n in names for f in ("bytes", "kind", "block", "home", "members")
                             if getattr(ba[n], f) != getattr(bb[n], f)}) if what == "changed" else []
            out.append(f"buffers {what}: {len(names)} ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
                       + (f"; fields {', '.join(fields)}" if fields else ""))
    ia, ib = a.instructions, b.instructions
    if ia != ib:
        out.append(f"instructions: {len(ia)} -> {len(ib)}"
                   + ("" if len(ia) != len(ib) else f" ({sum(x != y for x, y in zip(ia, ib))} differ)"))
    return ("\n".join(out) if out else "plans are identical"), not out


def _block_key(b: str):
    return (0, 0) if b == "pre" else (2, 0) if b == "post" else (1, int(b[1:]))


def _ranges(blocks: list[str]) -> str:
    if len(blocks) <= 3:
        return ",".join(blocks)
    return f"{blocks[0]}..{blocks[-1]} ({len(blocks)} blocks)"


# ---- commands ------------------------------------------------------------------------------

def _options(args):
    from tensorstow.planner.plan import check_policy
    from tensorstow.planner.problem import check_options
    from tensorstow.schema.options import Options
    kw = dict(model=args.model, hardware=args.hw, policy=args.policy, batch=args.batch, seq=args.seq,
              precision=args.precision, optimizer=args.optimizer, lr=args.lr, betas=tuple(args.betas),
              eps=args.eps, weight_decay=args.weight_decay,
              exact_optimizer=args.exact_optimizer, init_scale=args.init_scale,
              growth_interval=args.growth_interval)
    for k in ("gpu_mem", "dram"):
        v = getattr(args, k)
        kw[k] = parse_size(v) if v is not None else None
    kw["ssds"] = args.ssds
    kw.update(gpus=args.gpus, microbatches=args.microbatches, mapping=args.mapping)
    o = Options(**kw)
    check_options(o)  # before `--hw local` probes: a typo fails at once
    check_policy(o.policy)
    return o


def cmd_plan(args) -> int:
    from tensorstow.planner.plan import make_plan
    from tensorstow.planner.simulate import perfetto_trace, write_trace
    o = _options(args)
    if args.sweep:
        return _sweep(args, o)
    plan = make_plan(o, hardware_for(o))
    typed = plan.to_plan()
    if args.output:
        Path(args.output).write_text(typed.dumps())
    if args.trace:
        write_trace(args.trace, perfetto_trace(plan.instructions, plan.sim, f"{o.model} {o.policy}"))
    print(summary(typed, plan.sim))
    if args.output:
        print(f"wrote {args.output}")
    return 0


def _sweep(args, o) -> int:
    from tensorstow.planner import report
    key, values = report.parse_sweep(args.sweep)
    rows = report.sweep(o, hardware_for(o), key, values)
    unit = " (GB)" if key == "dram" else ""
    print(f"{key}{unit:>6} {'fits':>5} {'step s':>10} {'tokens/s':>10} {'TFLOPS':>8}  bottleneck  policy")
    for r in rows:
        print(f"{r['value']:>10} {'yes' if r['fits'] else 'no':>5} {r['step_time_s']:>10.4g} {r['tokens_per_s']:>10.4g} "
              f"{r['model_tflops']:>8.3g}  {r['bottleneck']:<11} {r['policy']}")
    plot = args.plot or f"sweep-{key}.svg"
    report.svg_plot(plot, [r["value"] for r in rows], [r["tokens_per_s"] for r in rows],
                    xlabel=key + unit, ylabel="predicted tokens/s",
                    title=f"{o.model} on {o.hardware}, policy {o.policy}")
    print(f"wrote {plot}")
    return 0


def cmd_fit(args) -> int:
    from tensorstow.planner import report
    from tensorstow.planner.plan import POLICIES
    from tensorstow.planner.policies import HEURISTICS
    from tensorstow.schema.options import Options
    names = [args.policy] if args.policy else [*HEURISTICS, "ilp"]
    print(f"{'policy':<14} {'largest model':<14} {'params':>8} {'batch':>6} {'tokens/s':>10} {'step s':>9}")
    for name in names:
        if name not in POLICIES and name != "auto":
            raise TensorstowError(f"unknown policy '{name}': use one of {sorted(POLICIES) + ['auto']}")
        o = Options(model="gpt3-13b", hardware=args.hw, policy=name, precision=args.precision,
                    gpu_mem=parse_size(args.gpu_mem) if args.gpu_mem else None,
                    dram=parse_size(args.dram) if args.dram else None, ssds=args.ssds)
        r = report.largest_fitting(o, hardware_for(o))
        if r["model"] is None:
            print(f"{name:<14} {'none fits':<14}")
        else:
            print(f"{name:<14} {r['model']:<14} {r['params'] / 1e9:>7.1f}B {r['batch']:>6} "
                  f"{r['tokens_per_s']:>10.4g} {r['step_time_s']:>9.4g}")
    return 0


def cmd_show(args) -> int:
    from tensorstow.planner.simulate import perfetto_trace, simulate_plan, write_trace
    plan = load_plan(args.plan)
    sim = simulate_plan(plan)  # once: the summary, the replay line and the trace read it
    print(summary(plan, sim))
    print(replay_line(plan, sim))
    if args.trace:
        write_trace(args.trace, perfetto_trace(plan.instructions, sim, f"{plan.model.name} {plan.decisions.policy}"))
        print(f"wrote {args.trace}")
    return 0


def cmd_diff(args) -> int:
    text, same = diff_text(load_plan(args.a), load_plan(args.b))
    print(text)
    return 0 if same else 1


def cmd_check(args) -> int:
    """Re-plan every golden plan (each PATH: a directory of them or one plan file) from its own
    options; fail on any drift."""
    from tensorstow.planner.plan import make_plan
    files = []
    for p in map(Path, args.paths):
        if p.is_dir():
            found = sorted(p.glob("*.json"))
            if not found:
                raise TensorstowError(f"no golden plans (*.json) in {p}")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise TensorstowError(f"{p}: no such plan file or directory (give golden plans' directory, "
                                  "e.g. plans, or plan files)")
    drift = 0
    for f in files:
        try:
            old, unreadable = load_plan(str(f)), ""
            o = old.options
        except TensorstowError as e:  # another format version: re-plan from its options alone
            old, unreadable = None, str(e)
            o = _old_options(f, e)
        new = make_plan(o, hardware_for(o)).to_plan()
        new_text = new.dumps()
        if new_text == f.read_text():
            print(f"ok     {f.name}")
            continue
        if args.update:
            f.write_text(new_text)
            print(f"update {f.name}")
            continue
        drift += 1
        text = f"not readable as this version's plan: {unreadable}" if old is None else diff_text(old, new)[0]
        print(f"DRIFT  {f.name}\n" + "\n".join("       " + line for line in text.splitlines()))
    if drift:
        print(f"{drift} golden plan(s) drifted; if the change is intended run "
              f"`tensorstow check {' '.join(args.paths)} --update` and say why in the commit")
        return 1
    return 0


def _old_options(f: Path, why: TensorstowError):
    """The options of a plan file this version cannot read as a whole (to re-plan it)."""
    from tensorstow.schema.options import Options
    try:
        return Options.from_json(json.loads(f.read_text())["options"], where=f"plan file {f}: options")
    except (json.JSONDecodeError, KeyError, TypeError):
        raise why from None


def cmd_probe(args) -> int:
    from tensorstow.calibrate import probe
    hw = probe(disk_dir=args.disk_dir, quick=not args.full)
    from tensorstow.executor import adam, aio
    aio.default_engine()
    adam.kernel_info()
    for line in (aio.engine_info(), adam.kernel_info()):  # which native code is in use
        print(line, file=sys.stderr)
    text = json.dumps(hw.to_json(), indent=1, sort_keys=True) + "\n"
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0


DEMO = ["plan", "gpt-medium", "--hw", "local", "--gpu-mem", "80MB", "--dram", "200MB", "--ssds", "1",
        "--batch", "1", "--seq", "128"]


def cmd_execute(args) -> int:
    from tensorstow.executor.run import execute
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:  # one rank under torchrun
        from tensorstow.executor.run import worker
        return worker(dict(plan=args.plan, steps=args.steps, data=args.data, state_dir=args.state_dir,
                           mode=args.mode, seed=args.seed, log_json=args.log_json, trace=args.trace,
                           checkpoint_every=args.checkpoint_every))
    execute(load_plan(args.plan), steps=args.steps, data=args.data, state_dir=args.state_dir,
            mode=args.mode, seed=args.seed, log_json=args.log_json, trace=args.trace,
            checkpoint_every=args.checkpoint_every, nproc=args.nproc)
    return 0


def cmd_export(args) -> int:
    from tensorstow.executor.export import export
    r = export(args.state_dir, args.output, shard_bytes=parse_size(args.shard_size))
    print(f"exported step {r['step']}: {r['tensors']} tensors, {_fmt(r['bytes'])} in {r['files']} file(s) "
          f"to {args.output}")
    return 0


def _demo_precision() -> list[str]:
    """fp32 where this machine's device tier computes 16-bit matmuls slower than fp32 ones (a CPU
    without native bf16: the probe's `flops` below its `flops_fp32`); the default otherwise."""
    from tensorstow.calibrate import probe
    g = probe().gpus[0]
    return ["--precision", "fp32"] if g.flops_fp32 and g.flops < g.flops_fp32 / 2 else []


def cmd_demo() -> int:
    """The built-in main job: plan gpt-medium (60M parameters, 0.72 GB of fp32 training state)
    for this machine with 80 MB of device and 200 MB of DRAM budget, so its state lives on the
    SSD; execute a few steps from a state dir and compare measured with predicted."""
    import tempfile

    from tensorstow.executor.run import execute
    with tempfile.TemporaryDirectory(prefix="tensorstow-demo-", dir=".") as tmp:
        plan_path = str(Path(tmp) / "plan.json")
        args = [*DEMO, *_demo_precision(), "-o", plan_path]
        print("tensorstow demo: " + " ".join(["tensorstow", *args]), flush=True)
        rc = main(args)
        if rc:
            return rc
        print(f"\ntensorstow demo: tensorstow execute {plan_path} --steps 4 --state-dir {tmp}/state", flush=True)
        # its plan is SSD-bound: overlap hides the compute behind the I/O (1.17 vs 1.40 s per step here)
        execute(load_plan(plan_path), steps=4, state_dir=str(Path(tmp) / "state"), mode="overlap")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tensorstow", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="on an error, also print the full traceback")
    sub = ap.add_subparsers(dest="cmd")
    _add = sub.add_parser
    sub.add_parser = lambda *a, **kw: _add(*a, parents=[common], **kw)  # every command takes --debug
    p = sub.add_parser("plan", help="trace a model and write its static schedule")
    p.add_argument("model", help="preset (gpt3-13b, gpt-tiny, ...), hf:DIR or pkg.module:factory")
    p.add_argument("--hw", default="local", help="hardware preset, spec file, or 'local' (probe this machine)")
    p.add_argument("--policy", default="auto", help="all-gpu, zero-infinity, ilp, ... or auto (fastest feasible)")
    p.add_argument("--batch", type=int, default=0, help="micro-batch size (default: preset's, else 1)")
    p.add_argument("--seq", type=int, default=0, help="sequence length (default: model block_size)")
    p.add_argument("--precision", default="bf16-mixed", choices=["fp32", "bf16-mixed", "fp16-mixed"],
                   help="ops in the dtype CUDA autocast gives them, fp32 masters (default bf16-mixed); "
                        "fp16-mixed adds dynamic loss scaling")
    p.add_argument("--gpu-mem", dest="gpu_mem", help="GPU memory the plan's tensors may fill (e.g. 200MB, "
                   "24GB); the GPU's reserve for the CUDA context and workspaces comes on top")
    p.add_argument("--dram", help="override DRAM capacity (e.g. 256GB)")
    p.add_argument("--ssds", type=int, help="override the number of SSDs")
    p.add_argument("--gpus", type=int, help="override the number of GPUs (the first N; more repeat the last)")
    p.add_argument("--microbatches", type=int, default=0,
                   help="pipelines (mobius, gpipe): microbatches per step (default: one per GPU)")
    p.add_argument("--mapping", default="cross", choices=["cross", "sequential"],
                   help="mobius: stage -> GPU mapping (cross: from the root complexes, Mobius §3.3)")
    p.add_argument("--optimizer", default="adamw", choices=["adam", "adamw"])
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.999])
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", dest="weight_decay", type=float, default=0.0)
    p.add_argument("--exact-optimizer", dest="exact_optimizer", action="store_true",
                   help="torch.optim's single-tensor Adam/AdamW, bit-identical with eager (slower); "
                        "default: the fused kernel, within a few ulps")
    p.add_argument("--init-scale", dest="init_scale", type=float, default=65536.0,
                   help="fp16-mixed: initial loss scale (GradScaler's init_scale)")
    p.add_argument("--growth-interval", dest="growth_interval", type=int, default=2000,
                   help="fp16-mixed: clean steps before the loss scale doubles (GradScaler's growth_interval)")
    p.add_argument("-o", "--output", help="write the plan JSON here")
    p.add_argument("--trace", help="write the simulated timeline as Perfetto/Chrome trace JSON")
    p.add_argument("--sweep", help="KEY=A..B or KEY=a,b,c over ssd_count, dram (GB) or batch: "
                                   "print predicted throughput per value and plot it")
    p.add_argument("--plot", help="SVG file for --sweep (default sweep-KEY.svg)")
    p.set_defaults(fn=cmd_plan)
    f = sub.add_parser("fit", help="largest preset each policy can train on a machine, and its best batch")
    f.add_argument("--hw", default="local")
    f.add_argument("--policy")
    f.add_argument("--precision", default="bf16-mixed", choices=["fp32", "bf16-mixed", "fp16-mixed"],
                   help="ops in the dtype CUDA autocast gives them, fp32 masters (default bf16-mixed); "
                        "fp16-mixed adds dynamic loss scaling")
    f.add_argument("--gpu-mem", dest="gpu_mem")
    f.add_argument("--dram")
    f.add_argument("--ssds", type=int)
    f.set_defaults(fn=cmd_fit)
    s = sub.add_parser("show", help="summarize a plan, and replay it in the simulator")
    s.add_argument("plan")
    s.add_argument("--trace", help="write the replay as a Perfetto/Chrome trace JSON")
    s.set_defaults(fn=cmd_show)
    d = sub.add_parser("diff", help="what changed between two plans and why it matters")
    d.add_argument("a")
    d.add_argument("b")
    d.set_defaults(fn=cmd_diff)
    c = sub.add_parser("check", help="re-plan golden plans and fail on drift")
    c.add_argument("paths", nargs="*", default=["plans"], metavar="PATH",
                   help="a directory of golden plans (default: plans) or plan files")
    c.add_argument("--update", action="store_true", help="rewrite drifted plans")
    c.set_defaults(fn=cmd_check)
    x = sub.add_parser("execute", help="replay a plan every training step")
    x.add_argument("plan")
    x.add_argument("--steps", type=int, required=True, help="train until this many steps are committed")
    x.add_argument("--data", default="synthetic", help="uint16 token file (nanoGPT train.bin), .npy, or 'synthetic'")
    x.add_argument("--state-dir", dest="state_dir",
                   help="checkpoint directory (SSD-resident state lives there); resumes from it")
    x.add_argument("--mode", default="auto", choices=["auto", "sync", "overlap"],
                   help="overlap: one worker per stream; sync: one instruction at a time in program "
                        "order (the reference); auto (default): overlap on CUDA, sync on a CPU-only machine")
    x.add_argument("--seed", type=int, default=0, help="torch.manual_seed right before the model factory")
    x.add_argument("--nproc", type=int, default=1,
                   help="processes, one per GPU: a multi-GPU plan (mobius, gpipe) needs one per GPU of its hardware")
    x.add_argument("--log-json", dest="log_json", help="append one JSON object per step")
    x.add_argument("--trace", help="write the measured timeline of the last step (Perfetto JSON)")
    x.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=1,
                   help="commit a full checkpoint to the state dir every N steps (and after the last)")
    x.set_defaults(fn=cmd_execute)
    ex = sub.add_parser("export", help="write a state dir's last committed weights as safetensors")
    ex.add_argument("state_dir")
    ex.add_argument("-o", "--output", required=True, help="new directory (from_pretrained-ready for hf: models)")
    ex.add_argument("--shard-size", dest="shard_size", default="4GB", help="largest safetensors file")
    ex.set_defaults(fn=cmd_export)
    pr = sub.add_parser("probe", help="measure this machine and write a hardware spec")
    pr.add_argument("-o", "--output")
    pr.add_argument("--disk-dir", dest="disk_dir", help="directory on the SSD to measure")
    pr.add_argument("--full", action="store_true", help="longer, steadier measurements")
    pr.set_defaults(fn=cmd_probe)
    return ap


_python_show_warning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """tensorstow's own warnings as one line each (`tensorstow: warning: ...`), not Python's
    file:line and source; other libraries' as Python shows them."""
    from tensorstow.calibrate import ProbeWarning
    if issubclass(category, ProbeWarning):
        print(f"tensorstow: warning: {message}", file=file or sys.stderr)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> int:
    with warnings.catch_warnings():  # restores Python's own display when main returns
        warnings.showwarning = _show_warning
        return _main(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    if not argv:
        try:
            return cmd_demo()
        except TensorstowError as e:
            print(f"tensorstow: error: {e}", file=sys.stderr)
            return 2
    args = parser().parse_args(argv)
    if not getattr(args, "fn", None):
        parser().print_help()
        return 2
    try:
        return args.fn(args)
    except TensorstowError as e:
        if args.debug:
            import traceback
            traceback.print_exception(e)
        print(f"tensorstow: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`tensorstow check plans | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
