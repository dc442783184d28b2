"""The `tensorstow` command line: plan, show, diff, check, fit, probe, execute, export.

User errors print one line `tensorstow: error: ...` naming the problem and the fix, and
exit with status 2. Run with no arguments for the built-in demo.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tomllib
import typing
import warnings
from pathlib import Path

from tensorstow.calibrate import hardware_for
from tensorstow.errors import Interrupted, TensorstowError, check_writable
from tensorstow.planner.pools import arena_need
from tensorstow.planner.simulate import ScheduleError
from tensorstow.schema.hardware import parse_size
from tensorstow.schema.options import SSD_KINDS, asked, field_docs, from_asked, ssd_kinds
from tensorstow.schema.run import CHOICES as RUN_CHOICES
from tensorstow.schema.run import Run
from tensorstow.schema.schedule import SEARCH_NOTE, TIERS, InstrKind, UNIT, block_of, member_rows, parent_of, units_by_block


def _fmt(n: float) -> str:
    from tensorstow.planner.result import fmt_bytes
    return fmt_bytes(n)


# ---- plan files ----------------------------------------------------------------------------

def load_plan(path: str):
    """The typed plan in a file (`schema.plan.Plan`); one clear error for anything malformed."""
    from tensorstow.schema.plan import Plan
    return Plan.load(path)


def state_disk_bytes(plan) -> int:
    """Disk the plan's state dir takes: two preallocated slots of every buffer its store keeps
    (`executor.statedir.store_sizes`), each rounded up to the store's page."""
    from tensorstow.executor.aio import round_up
    from tensorstow.executor.statedir import store_sizes
    return sum(2 * round_up(n) for n in store_sizes(plan).values())


def _arena_lines(plan) -> list[str]:
    """Each GPU process's device arena (`execute --arena`) and whether it fits the budget."""
    if any(UNIT in b.block for b in plan.buffers.values()):
        return ["device arena: none (the expert units' rows of the expert weights are held outside one)"]
    cap = plan.predicted.capacity_bytes.get("gpu", 0)
    out = []
    for g, pool in sorted(plan.pools.items()):
        if pool.device:
            need = arena_need(plan, g)
            out.append(f"device arena{'' if len(plan.pools) == 1 else ' ' + g}: {_fmt(pool.device)}, {_fmt(need)} with "
                       f"what a segment holds beside it: " + ("fits the budget" if need <= cap else
                                                              f"over the budget by {_fmt(need - cap)}, so "
                                                              f"`execute --arena auto` runs without it"))
    return out


def summary(plan, sim=None, verbose: bool = False) -> str:
    """The plan's summary; `sim`: its simulation, when the caller has one (else it is replayed)."""
    m, pred, dec = plan.model, plan.predicted, plan.decisions
    step, bn, busy = pred.step_time_s, pred.bottleneck, pred.busy_s
    lines = [
        f"plan: {m.name} on {plan.hardware.name}, policy {dec.policy}"
        + (" (chosen by auto)" if plan.options.policy == "auto" else "") + " "
        f"({m.precision}, batch {m.batch}, seq {m.seq})",
        f"model: {m.params / 1e9:.3g}B parameters"
        + (f" ({m.active_params / 1e9:.3g}B active a token)" if m.active_params is not None else "")
        + (f" trained of {(m.params + m.frozen_params) / 1e9:.3g}B, the frozen ones stored in "
           f"{_fmt(sum(b.bytes for k, b in plan.buffers.items() if k.startswith('C:')))}"
           + (f" ({plan.options.quantize})" if plan.options.quantize else "") if m.frozen_params else "")
        + f", {m.layers} layers"
        + (f" (traced {m.traced_layers}, the rest replicated by similarity)" if plan.replicated else ""),
        f"predicted step: {step:.4g} s, {pred.tokens_per_s:.4g} tokens/s, {pred.model_tflops:.3g} model TFLOPS"
        + (" (the experts' matmuls counted on the token-rows routed to them: active compute)"
           if m.active_params is not None else ""),
        f"bottleneck: {bn}" + (f" (busy {busy[bn]:.4g} s = {100 * busy[bn] / step:.0f}% of the step)" if bn in busy and step else ""),
        "memory peak / capacity: " + "   ".join(
            f"{t} {_fmt(pred.peak_bytes.get(t, 0))} / {_fmt(pred.capacity_bytes.get(t, 0))}" for t in TIERS)
        + ("" if plan.options.ssd_for is None else f"   (--ssd-for {plan.options.ssd_for}: the SSDs hold "
           + (", ".join(k for k in SSD_KINDS if k in ssd_kinds(plan.options)) or "nothing") + ")"),
        *_arena_lines(plan),
        "busy: " + ", ".join(f"{k} {v:.4g} s" for k, v in sorted(busy.items(), key=lambda kv: -kv[1])),
        "traffic: " + (", ".join(f"{k} {_fmt(v)}" for k, v in pred.traffic_bytes.items()) or "none"),
        "placement: " + _placement(dec),
        *_expert_groups(plan, verbose),
    ]
    lines.append(f"state dir: {_fmt(state_disk_bytes(plan))} of disk (two slots of each buffer the store keeps: "
                 f"the training state{', the SSD tier' if plan.ssd_sizes() else ''}; --state-dir"
                 f"{', required' if plan.ssd_sizes() else ', for checkpoints'})")
    kinds: dict[str, int] = {}
    for ins in plan.instructions:
        kinds[ins.kind] = kinds.get(ins.kind, 0) + 1
    lines.append(f"instructions: {len(plan.instructions)} (" + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) + ")")
    if plan.decisions.speculated:
        lines.append(f"clipping: {len(plan.decisions.speculated)} CPU updates speculate, overlapped with the backward; "
                     f"a step whose clip fires redoes them from the last commit ({len(plan.redo_instructions)} "
                     f"instructions, predicted {plan.predicted.redo_s:.4g} s)")
    elif plan.options.max_grad_norm > 0:
        lines.append("clipping: every update waits for the backward's last gradient (the norm)")
    if plan.eval_instructions:
        lines.append(f"evaluation: a forward-only program of {len(plan.eval_instructions)} instructions, predicted "
                     f"{plan.predicted.eval_step_s:.4g} s a batch")
    lines += _pipeline_lines(plan, sim)
    search = [n for n in dec.notes if n.startswith(SEARCH_NOTE)]
    lines += [f"note: {n}" for n in dec.notes if verbose or n not in search]
    if search and not verbose:
        lines.append(f"note: {len(search)} note{'s' * (len(search) > 1)} on the policy's search left out (-v shows them)")
    return "\n".join(lines)


def _pipeline_lines(plan, sim=None) -> list[str]:
    """Stages, their GPUs and root complexes, and each GPU's simulated peak (multi-GPU plans); one
    GPU's gradient accumulation."""
    pl, dec = plan.decisions.pipeline, plan.decisions
    if pl is None and dec.dp > 1:
        o = plan.options
        moved = {k: sum(plan.buffers[i.tensor].bytes for i in plan.instructions if i.kind == k)
                 for k in (InstrKind.REDUCE, InstrKind.GATHER)}
        return [f"data parallel: {dec.dp} ranks ({o.nodes} machine(s) x {dec.dp // o.nodes} GPU(s)), each "
                f"{dec.grad_accum} x batch {plan.model.batch}: a step trains {dec.dp * dec.grad_accum * plan.model.batch} "
                f"rows; memory, capacity, traffic and busy times are one rank's (its share of DRAM, SSDs and cores; "
                f"optimizer state sharded 1/{dec.dp})",
                f"  collectives a step: gradients all-reduced {_fmt(moved[InstrKind.REDUCE])}, parameters all-gathered "
                f"{_fmt(moved[InstrKind.GATHER])} (busy {plan.predicted.busy_s.get('gpu0.reduce', 0):.4g} s and "
                f"{plan.predicted.busy_s.get('gpu0.gather', 0):.4g} s)"
                + (f"; {_fmt(o.net_bw)}/s between machines" if o.nodes > 1 else "")]
    if pl is None:
        if dec.grad_accum > 1:
            tiers = sorted({d.accum for d in dec.blocks.values()})
            return [f"gradient accumulation: {dec.grad_accum} microbatches of batch {plan.model.batch}, accumulated "
                    f"gradients on {', '.join(tiers)}"]
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
    for bd in (d for b, d in dec.blocks.items() if UNIT not in b):  # expert groups: `_expert_groups`
        for k, v in vars(bd).items():
            if k == "accum" and not v:
                continue
            counts.setdefault(k, {})
            counts[k][v] = counts[k].get(v, 0) + 1
    return "; ".join(f"{k}: " + ", ".join(f"{v} x{n}" for v, n in sorted(c.items())) for k, c in counts.items())


def _expert_groups(plan, verbose: bool) -> list[str]:
    """Where each group of experts lives (`--expert-groups`): counts over the layers, and with
    `verbose` a line per group."""
    rows = {block_of(n): member_rows(b.members[0])[1] for n, b in plan.buffers.items()
            if n.startswith("P:") and UNIT in block_of(n) and b.members}
    if not rows:
        return []
    home = {n: b.home for n, b in plan.buffers.items()}
    per = {u: (home.get(f"P:{u}"), home.get(f"OS:{u}"), plan.decisions.of(u).optimizer)
           for us in units_by_block(rows).values() for u in us}
    counts = [{}, {}, {}]
    for where in per.values():
        for c, v in zip(counts, where):
            c[v] = c.get(v, 0) + 1
    layers = len({parent_of(u) for u in rows})
    asked = plan.options.expert_groups  # 0: the planner chose the count
    flag = f"--expert-groups {asked}" if asked else f"--expert-groups 0 chose {len(rows) // layers}"
    out = [f"expert groups: {len(rows)} in {layers} layers ({flag}): "
           + "; ".join(f"{k} " + ", ".join(f"{v} x{n}" for v, n in sorted(c.items()))
                       for k, c in zip(("params", "states", "optimizer"), counts))]
    if verbose:
        out += [f"  {u}: experts {rows[u][0]}..{rows[u][1] - 1}, params {p}, states {st}, updated on {o}"
                for u, (p, st, o) in per.items()]
    return out


def diff_text(a, b) -> tuple[str, bool]:
    """What changed between two plans and why it matters; (text, identical)."""
    out = []
    for key in ("model", "hardware"):
        x, y = getattr(a, key), getattr(b, key)
        if x.fingerprint != y.fingerprint:
            out.append(f"{key}: {x.name} ({x.fingerprint}) -> {y.name} ({y.fingerprint})"
                       + ("; same model and options, so the traced graph itself changed (torch or model code)"
                          if key == "model" and x.name == y.name and a.options == b.options else ""))
    out += _hardware_lines(a.hardware.spec.to_json(), b.hardware.spec.to_json())
    for what, x, y in (("option", dataclasses.asdict(a.options), dataclasses.asdict(b.options)),
                       ("run option", a.run.to_json() if a.run else {}, b.run.to_json() if b.run else {})):
        for k in sorted(set(x) | set(y)):  # a recorded run leaves its defaults out ("-")
            if x.get(k) != y.get(k):
                out.append(f"{what} {k}: {x.get(k, '-')} -> {y.get(k, '-')}")
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
        x, y = (d["blocks"].get(blk) or d["blocks"].get(parent_of(blk), {}) for d in (da, db))  # a unit: its own, or its block's
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
    for g in sorted(set(a.pools) | set(b.pools)):
        x, y = (dataclasses.asdict(p.pools[g]) if g in p.pools else {} for p in (a, b))
        for f in sorted(set(x) | set(y)):
            if x.get(f) != y.get(f):
                out.append(f"pools {g} {f}: {_fmt(x[f]) if f in x else '-'} -> {_fmt(y[f]) if f in y else '-'}")
    for what in ("instructions", "eval_instructions", "redo_instructions"):
        ia, ib = getattr(a, what), getattr(b, what)
        if ia != ib:
            out.append(f"{what.replace('_', ' ')}: {len(ia)} -> {len(ib)}"
                       + ("" if len(ia) != len(ib) else f" ({sum(x != y for x, y in zip(ia, ib))} differ)"))
    return ("\n".join(out) if out else "plans are identical"), not out


def _hardware_lines(x: dict, y: dict, most: int = 8) -> list[str]:
    """The fields of two hardware specs (`Hardware.to_json`) that differ, a line each (a rate curve
    by its length, a long text cut short), the first `most` of them and a count of the rest."""
    def shown(v) -> str:
        if isinstance(v, list):
            return f"{len(v)} values"
        text = f"{v:.6g}" if isinstance(v, float) else str(v)
        return text if len(text) <= 60 else text[:57] + "..."
    fx, fy = _fields(x), _fields(y)
    out = [f"hardware {k}: {shown(fx.get(k, '-'))} -> {shown(fy.get(k, '-'))}"
           for k in sorted(set(fx) | set(fy)) if fx.get(k, "-") != fy.get(k, "-")]
    return out[:most] + ([f"hardware: {len(out) - most} more fields differ"] if len(out) > most else [])


def _fields(d: dict, at: str = "") -> dict:
    """A hardware spec's JSON as {field path: value}, a path like `gpus[0].flops`."""
    out = {}
    for k, v in d.items():
        name = f"{at}.{k}" if at else k
        if isinstance(v, dict):
            out |= _fields(v, name)
        elif isinstance(v, list) and v and all(isinstance(e, dict) for e in v):
            for i, e in enumerate(v):
                out |= _fields(e, f"{name}[{i}]")
        else:
            out[name] = v
    return out


def _block_key(b: str):
    """Forward order: pre, b0, b0's units (`b0/x0`, ...), b1, ..., post."""
    block, _, unit = b.partition(UNIT)
    return ((0, 0) if block == "pre" else (2, 0) if block == "post" else (1, int(block[1:]))) + (
        int(unit[1:]) + 1 if unit else 0,)


def _ranges(blocks: list[str]) -> str:
    if len(blocks) <= 3:
        return ",".join(blocks)
    return f"{blocks[0]}..{blocks[-1]} ({len(blocks)} blocks)"


# ---- commands ------------------------------------------------------------------------------

def _options(args):
    """The plan options: each the first of its flag, the `--config` recipe's value, its default."""
    from tensorstow.planner.plan import check_policy
    from tensorstow.planner.problem import check_options
    names = [k.name for k in asked() if k.name != "model"]
    values = {k: getattr(args, k) for k in names}
    model = getattr(args, "model", None)
    if getattr(args, "config", None):
        recipe = _recipe(args.config)[0]
        values = {**values, **{k: v for k, v in recipe.items() if k != "model"},
                  **{k: v for k, v in values.items() if k in args.given}}
        model = model or recipe.get("model")
    if not model:
        raise TensorstowError("name the model: tensorstow plan MODEL, or model = \"...\" in the --config recipe")
    o = from_asked(model, values, "tensorstow plan")
    check_options(o)  # before `--hw local` probes: a typo fails at once
    check_policy(o.policy)
    return o


def cmd_plan(args) -> int:
    from tensorstow.planner.plan import make_plan
    from tensorstow.planner.simulate import perfetto_trace, write_trace
    o = _options(args)
    for path, flag in ((args.output, "-o"), (args.trace, "--trace")):  # before the planning, which may take minutes
        if path:
            check_writable(path, flag)
    if args.clip_rate_from:
        o = dataclasses.replace(o, clip_rate=clip_rate_of(args.clip_rate_from, o))
    if args.sweep:
        return _sweep(args, o)
    plan = make_plan(o, hardware_for(o, args.reprobe))
    typed = plan.to_plan()
    if args.config:  # the plan records how to run it
        typed = dataclasses.replace(typed, run=Run.from_json(_recipe(args.config)[1]))
    if args.output:
        Path(args.output).write_text(typed.dumps())
    if args.trace:
        write_trace(args.trace, perfetto_trace(plan.instructions, plan.sim, f"{o.model} {o.policy}"))
    print(summary(typed, plan.sim, args.verbose))
    if args.output:
        print(f"wrote {args.output}")
    return 0


def clip_rate_of(log: str, o) -> float:
    """`plan --clip-rate-from LOG`: the fraction of the steps an `execute --log-json` file logged
    whose clip fired (a speculating run's `speculation: redone`, else `grad_norm` above the plan's
    `--max-grad-norm`) or whose fp16 update was skipped; each step counted once (its last line)."""
    try:
        lines = Path(log).read_text().splitlines()
    except OSError as e:
        raise TensorstowError(f"--clip-rate-from {log}: cannot read it ({e.strerror or e})") from None
    steps = {}
    for k, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise TensorstowError(f"--clip-rate-from {log}:{k}: not a JSON line of `execute --log-json`") from None
        if isinstance(row, dict) and "loss" in row and "step" in row:
            steps[row["step"]] = row
    if not steps:
        raise TensorstowError(f"--clip-rate-from {log}: no training steps logged (a file `execute --log-json` wrote)")

    def fired(r):
        if "speculation" in r:
            return r["speculation"] == "redone"
        return bool(r.get("skipped")) or (o.max_grad_norm > 0 and r.get("grad_norm", 0) > o.max_grad_norm)
    return sum(map(fired, steps.values())) / len(steps)


def _sweep(args, o) -> int:
    from tensorstow.planner import report
    key, values = report.parse_sweep(args.sweep)
    rows = report.sweep(o, hardware_for(o, args.reprobe), key, values)
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
    names = [args.policy] if args.policy else [*HEURISTICS, "ilp"]
    hw = None
    print(f"{'policy':<14} {'largest model':<14} {'params':>8} {'batch':>6} {'tokens/s':>10} {'step s':>9}")
    for name in names:
        if name not in POLICIES and name != "auto":
            raise TensorstowError(f"unknown policy '{name}': use one of {sorted(POLICIES) + ['auto']}")
        o = from_asked("gpt3-13b", {k: getattr(args, k) for k in FIT_OPTIONS} | {"policy": name}, "tensorstow fit")
        if o.quantize and not o.lora:
            raise TensorstowError(f"fit --quantize {o.quantize}: a quantized base trains adapters: add --lora r=...,targets=...")
        if hw is None:  # one machine for every policy (probed once with --reprobe)
            hw = hardware_for(o, args.reprobe)
        r = report.largest_fitting(o, hw)
        if r["model"] is None:
            print(f"{name:<14} {'none fits':<14}")
        else:
            print(f"{name:<14} {r['model']:<14} {r['params'] / 1e9:>7.1f}B {r['batch']:>6} "
                  f"{r['tokens_per_s']:>10.4g} {r['step_time_s']:>9.4g}")
    return 0


def cmd_show(args) -> int:
    from tensorstow.planner.simulate import perfetto_trace, simulate_plan, write_trace
    plan = load_plan(args.plan)
    if not plan.options.model.startswith("<"):  # a model execute can build (an API plan's is the caller's)
        from tensorstow.ir.models import resolve_model
        o = plan.options
        resolve_model(o.model, o.lora, o.quantize, o.quantize_skip)
    sim = simulate_plan(plan)  # once: the summary, the replay line and the trace read it
    print(summary(plan, sim, args.verbose))
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
    if args.output:  # before the probe, which takes a minute
        check_writable(args.output, "-o")
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
    plan = load_plan(args.plan)
    run = _run(args, plan)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:  # one rank under torchrun
        from tensorstow.executor.run import worker
        return worker(dict(dataclasses.replace(run, nproc=1).to_json(), plan=args.plan))
    execute(plan, run)
    return 0


def cmd_evaluate(args) -> int:
    from tensorstow.executor.run import evaluate_state
    run = Run(state_dir=args.state_dir, eval_data=args.data, eval_batches=args.batches, tokenizer=args.tokenizer,
              seed=args.seed, chat_template=args.chat_template, loss_on=args.loss_on)
    evaluate_state(load_plan(args.plan), run)
    return 0


def _run(args, plan) -> Run:
    """execute's options: each the first of its flag, the `--config` recipe's [execute] table, the
    plan's recorded recipe (`Plan.run`), and `Run`'s default."""
    values = dict(plan.run.to_json() if plan.run is not None else {})
    if args.config:
        values.update(_recipe(args.config)[1])
    values.update({k: getattr(args, k) for k in RUN_FIELDS if k in args.given})
    return Run.from_json(values, where="execute options")


RUN_FIELDS = tuple(f.name for f in dataclasses.fields(Run))


def _recipe(path) -> tuple[dict, dict]:
    """(plan options, execute options) of a recipe file: plan options (as `tensorstow plan` names
    them: model, hw, batch, ...) at the top level, execute options in an [execute] table."""
    p = Path(path)
    if not p.is_file():
        raise TensorstowError(f"recipe file {path} does not exist")
    try:
        d = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TensorstowError(f"recipe file {path}: not valid TOML ({e})") from None
    run = d.pop("execute", {})
    plan_names = {o.name for o in asked()}
    norm = {k.replace("-", "_"): v for k, v in d.items()}
    unknown = sorted(set(norm) - plan_names)
    if unknown:
        raise TensorstowError(f"recipe file {path}: unknown plan option(s) {unknown} (execute options go in its "
                              f"[execute] table); the plan options are {sorted(plan_names)}")
    if not isinstance(run, dict):
        raise TensorstowError(f"recipe file {path}: 'execute' must be a table ([execute])")
    run = {k.replace("-", "_"): v for k, v in run.items()}
    Run.from_json(run, where=f"recipe file {path}: [execute]")  # names, types and ranges checked here
    for o in asked():
        if o.name in norm:
            _check_type(o, norm[o.name], path)
    return norm, run


def _check_type(o, v, path) -> None:
    """A recipe's value for plan option `o` has the option's type (a size may be a string; a tuple
    is a list of that many values, or any number for `tuple[X, ...]`, each of its type)."""
    tp = o.type
    if typing.get_origin(tp) is tuple:
        elems = typing.get_args(tp)
        many = elems[-1] is Ellipsis
        kinds = [elems[0]] * len(v) if many and isinstance(v, list) else elems
        ok = isinstance(v, list) and len(v) == len(kinds) and all(map(_is, kinds, v))
        want = f"list of {'' if many else f'{len(elems)} '}{_type_name(elems[0])}s" + (
            f" (e.g. {o.name} = {json.dumps(list(o.default))})" if o.default else "")
    else:
        ok = (v is None and o.optional) or (isinstance(v, str) and o.size) or _is(tp, v)
        want = _type_name(tp)
    if not ok:
        raise TensorstowError(f"recipe file {path}: {o.name} = {v!r} is not a valid {want}")


def _is(tp: type, v) -> bool:
    """TOML value `v` is a `tp` (bool, int, float or str); an integer is a float too, a bool no number."""
    if tp is bool or isinstance(v, bool):
        return tp is bool and isinstance(v, bool)
    return isinstance(v, (int, float) if tp is float else tp)


def _type_name(tp: type) -> str:
    return {float: "number", str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


def cmd_export(args) -> int:
    from tensorstow.executor.export import export
    shard_bytes = parse_size(args.shard_size)
    if shard_bytes < 1:
        raise TensorstowError(f"--shard-size {args.shard_size} is {shard_bytes} bytes: give the largest file's size, "
                              f"at least 1 byte (e.g. 4GB, 500MB)")
    r = export(args.state_dir, args.output, shard_bytes=shard_bytes, merge=args.merge,
               tokenizer=args.tokenizer, chat_template=args.chat_template)
    told = f", and the tokenizer of {r['tokenizer']}" if r["tokenizer"] else ""
    print(f"exported step {r['step']}: {r['tensors']} tensors, {_fmt(r['bytes'])} in {r['files']} file(s){told} "
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
        execute(load_plan(plan_path), Run(steps=4, state_dir=str(Path(tmp) / "state"), mode="overlap"))
    return 0


DEMO_LINE = ("With no arguments, `tensorstow` runs the built-in demo: it plans gpt-medium for this "
             "machine with 80 MB of device memory and 200 MB of DRAM, so its training state lives on "
             "the SSD, then trains it 4 steps in a temporary directory and prints measured against "
             "predicted step time.")

FIT_OPTIONS = ("hw", "policy", "precision", "seq", "gpu_mem", "dram", "ssds", "ssd_for", "lora", "quantize",
               "quantize_skip")
"""The plan options `tensorstow fit` takes (it plans the GPT-3 presets itself, or with --lora the
LLaMA-shaped models of `planner.report.LLAMA_LADDER`)."""


def _shown(value) -> str:
    """A default as the command line writes it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value)) or "none"
    return str(value)


def _arg(p, *names, help: str, default=None, required: bool = False, **kw) -> None:
    """`p.add_argument` with the default at the end of the help: `(default: VALUE)`, `(required)`,
    or, where the default is None (or a switch's off), what that means, written in `help` as
    `(default: ...)`."""
    if kw.get("action") == "store_true":
        default = False
    if required or (names[0][0] != "-" and kw.get("nargs") is None):
        help += " (required)"
    elif "(default" not in help:
        help += f" (default: {_shown(default)})"
    if names[0][0] == "-":
        kw.update(default=default, required=required)
    elif default is not None:
        kw["default"] = default
    action = p.add_argument(*names, help=help.replace("%", "%%"), **kw)
    p.__dict__.setdefault("tensorstow_actions", []).append(action)  # what `reference_markdown` lists


def _group(p, title: str):
    """An argument group of command `p`, listed by `reference_markdown` after `p`'s own arguments."""
    g = p.add_argument_group(title)
    p.tensorstow_groups.append(g)
    return g


def _add_option(p, o, **override) -> None:
    """Plan option `o` (`schema.options.asked`) as an argument of `p`: the model positional, the
    others `--` and their name with `-` for `_`; typed as the field (a size stays text for
    `from_asked` to read, "24GB"; a tuple takes that many values; a bool is a switch), its
    docstring the help, its default the default. `override`: `default=` and `help=` where a
    command means something else by leaving it out."""
    kw: dict = {}
    if o.type is bool:
        kw["action"] = "store_true"
    elif typing.get_origin(o.type) is tuple:
        elems = typing.get_args(o.type)
        kw.update(type=elems[0], nargs="+" if elems[-1] is Ellipsis else len(elems))
    elif o.type in (int, float) and not o.size:
        kw["type"] = o.type
    if o.choices:
        kw["choices"] = list(o.choices)
    if o.default is dataclasses.MISSING:  # the model: or the recipe's
        _arg(p, o.name, nargs="?", help=override.get("help", o.doc) + " (default: the --config recipe's model; "
             "one of the two is needed)", **kw)
    else:
        _arg(p, "--" + o.name.replace("_", "-"), dest=o.name, help=override.get("help", o.doc),
             default=override.get("default", o.default), **kw)


def _add_run_options(p) -> None:
    """execute's options from `schema.run.Run`'s fields: `--` and the name with `-` for `_`,
    typed as the field (a bool switch; shuffle, on by default, also `--no-shuffle`), its docstring
    the help, its default the default."""
    hints, docs = typing.get_type_hints(Run), field_docs(Run)
    for f in dataclasses.fields(Run):
        tp = hints[f.name]
        args = [t for t in typing.get_args(tp) if t is not type(None)] or [tp]
        kw: dict = {}
        if args[0] is bool:
            kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        elif args[0] in (int, float):
            kw["type"] = args[0]
        if f.name in RUN_CHOICES:
            kw["choices"] = list(RUN_CHOICES[f.name])
        _arg(p, "--" + f.name.replace("_", "-"), dest=f.name, help=docs.get(f.name, ""), default=f.default, **kw)


UNSET = object()
"""An option's value in `parser(explicit=True)`'s parse where the command line does not give it."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusal of a command line is one line (argparse's own prints the
    whole usage first) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"tensorstow: error: {self.prog}: {message} (`{self.prog} --help` lists the options)\n")


def parser(explicit: bool = False) -> argparse.ArgumentParser:
    """The `tensorstow` command line. `explicit`: every option of `plan` and `execute` that a recipe
    may also give defaults to `UNSET`, so a parse says which ones the command line gave (`given`)."""
    ap = _Parser(prog="tensorstow", description=__doc__.splitlines()[0], epilog=DEMO_LINE)
    sub = ap.add_subparsers(dest="cmd", help="`tensorstow COMMAND --help` shows a command's options "
                            "(required; with no arguments at all, the demo runs).")
    ap.tensorstow_commands = {}
    """Command name -> (its help, its parser), in order: what `reference_markdown` lists."""

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.tensorstow_groups = []
        _arg(p, "--debug", action="store_true", help="On an error, also print the full traceback.")
        ap.tensorstow_commands[name] = (help, p)
        return p
    _add_planning(command, explicit)
    _add_training(command, explicit)
    return ap


def given(argv: list[str]) -> set[str]:
    """The options of `plan` and `execute` that `argv` gives itself (argparse's own reading of it)."""
    return {k for k, v in vars(parser(explicit=True).parse_args(argv)).items() if v is not UNSET}


def _add_planning(command, explicit: bool) -> None:
    """The commands that make, inspect and check plans: plan, fit, show, diff, check."""
    p = command("plan", help="trace a model and write its static schedule")
    g = _group(p, "plan options (the plan file records them)")
    for o in asked():
        _add_option(p if o.name == "model" else g, o)
    _arg(p, "--config", help="Recipe file (TOML): plan options at its top level, execute options in its "
                             "[execute] table, which the plan records; flags override it (default: none).")
    _arg(p, "-o", "--output", help="Write the plan JSON here (default: not written; the summary is printed).")
    _arg(p, "--trace", help="Write the simulated timeline as Perfetto/Chrome trace JSON (default: not written).")
    _arg(p, "--sweep", help="KEY=A..B or KEY=a,b,c over ssd_count, dram (GB) or batch: print predicted "
                            "throughput per value and plot it (default: plan once).")
    _arg(p, "--plot", help="SVG file for --sweep (default: sweep-KEY.svg).")
    _arg(p, "--reprobe", action="store_true", help="With --hw local: probe this machine again instead of "
                                                    "taking its cached probe (default: the cache's, where it has one).")
    _arg(p, "-v", "--verbose", action="store_true", help="Also print the notes that trace the policy's search "
                                                         "(each MIP round, stage count, swap count simulated).")
    _arg(p, "--clip-rate-from", help="Set --clip-rate to the fraction of steps whose clip fired (or fp16 "
                                     "update was skipped) in this `execute --log-json` file of an earlier run "
                                     "(default: --clip-rate as given).")
    p.set_defaults(fn=cmd_plan, **({o.name: UNSET for o in asked()} if explicit else {}))

    f = command("fit", help="largest preset each policy can train on a machine, and its best batch")
    g = _group(f, "plan options")
    for o in asked():
        if o.name == "policy":
            _add_option(g, o, default=None, help="Placement policy (default: each heuristic policy, then ilp).")
        elif o.name in FIT_OPTIONS:
            _add_option(g, o)
    _arg(f, "--reprobe", action="store_true", help="With --hw local: probe this machine again instead of taking "
                                                   "its cached probe.")
    f.set_defaults(fn=cmd_fit)

    s = command("show", help="summarize a plan, and replay it in the simulator")
    _arg(s, "plan", help="Plan file.")
    _arg(s, "--trace", help="Write the replay as a Perfetto/Chrome trace JSON (default: not written).")
    _arg(s, "-v", "--verbose", action="store_true", help="Also print the notes that trace the policy's search.")
    s.set_defaults(fn=cmd_show)

    d = command("diff", help="what changed between two plans and why it matters")
    _arg(d, "a", help="Plan file, before.")
    _arg(d, "b", help="Plan file, after.")
    d.set_defaults(fn=cmd_diff)

    c = command("check", help="re-plan golden plans and fail on drift")
    _arg(c, "paths", nargs="*", default=["plans"], metavar="PATH",
         help="A directory of golden plans, or plan files.")
    _arg(c, "--update", action="store_true", help="Rewrite drifted plans.")
    c.set_defaults(fn=cmd_check)


def _add_training(command, explicit: bool) -> None:
    """The commands that train and read what training wrote: execute, evaluate, export, probe."""
    x = command("execute", help="replay a plan every training step")
    _arg(x, "plan", help="Plan file.")
    _add_run_options(x)
    _arg(x, "--config", help="Recipe file (TOML): its [execute] table gives these options' values where no "
                             "flag does (docs/training.md, Recipe files) (default: the plan's recipe, if any).")
    x.set_defaults(fn=cmd_execute, **({n: UNSET for n in RUN_FIELDS} if explicit else {}))

    ev = command("evaluate", help="the held-out loss of a state dir's last committed weights")
    _arg(ev, "plan", help="Plan file the state dir trains.")
    _arg(ev, "--state-dir", dest="state_dir", required=True, help="State dir of `tensorstow execute --state-dir`.")
    _arg(ev, "--data", required=True, help="Held-out data, in any form execute's --data takes.")
    _arg(ev, "--batches", type=int, help="Batches to evaluate, in file order (default: all of the examples; a "
                                         "token file needs it).")
    _arg(ev, "--tokenizer", help="Tokenizer directory for text examples (default: the hf: model's directory).")
    _arg(ev, "--chat-template", dest="chat_template", help="Jinja chat template file for conversational examples "
                                                           "(default: the tokenizer's own).")
    _arg(ev, "--loss-on", dest="loss_on", choices=["assistant", "all"], default="assistant",
         help="Which tokens of text or conversational examples are labels: the assistant's (the completion's), or all.")
    _arg(ev, "--seed", type=int, default=0, help="Seeds synthetic data (seed + 1) and the model factory.")
    ev.set_defaults(fn=cmd_evaluate)

    ex = command("export", help="write a state dir's last committed weights as safetensors")
    _arg(ex, "state_dir", help="State dir of `tensorstow execute --state-dir`.")
    _arg(ex, "-o", "--output", required=True, help="New directory (from_pretrained-ready for hf: models).")
    _arg(ex, "--shard-size", dest="shard_size", default="4GB", help="Largest safetensors file.")
    _arg(ex, "--tokenizer", help="Tokenizer directory saved beside the weights (default: the hf: model's "
                                 "directory, where it holds one).")
    _arg(ex, "--chat-template", dest="chat_template", help="Jinja chat template file the saved tokenizer carries "
                                                           "(the run's --chat-template) (default: its own).")
    _arg(ex, "--merge", action="store_true",
         help="A PEFT (LoRA) model: write the base model with the adapters merged into its weights "
              "(from_pretrained) instead of the adapter (PeftModel.from_pretrained onto the base).")
    ex.set_defaults(fn=cmd_export)

    pr = command("probe", help="measure this machine and write a hardware spec")
    _arg(pr, "-o", "--output", help="Write the spec here (default: printed).")
    _arg(pr, "--disk-dir", dest="disk_dir", help="Directory on the SSD to measure (default: the current directory).")
    _arg(pr, "--full", action="store_true", help="Longer, steadier measurements.")
    pr.set_defaults(fn=cmd_probe)


REFERENCE_FIX = ("python -c 'from tensorstow.cli import reference_markdown; "
                 "open(\"docs/cli.md\", \"w\").write(reference_markdown())'")
"""The command that regenerates docs/cli.md."""


def _invocation(a: argparse.Action, short: bool = False) -> str:
    """An argument as the reference shows it: `-o, --output OUTPUT` (`short`: `-o OUTPUT`),
    `--betas BETAS BETAS`, `[PATH ...]`."""
    if a.choices is not None:
        meta = "{" + ",".join(a.choices) + "}"
    else:
        meta = a.metavar or (a.dest.upper() if a.option_strings else a.dest)
    if a.nargs == 0:
        value = ""
    elif a.nargs == "*":
        value = f"[{meta} ...]"
    elif a.nargs == "+":
        value = f"{meta} [{meta} ...]"
    elif isinstance(a.nargs, int):
        value = " ".join([meta] * a.nargs)
    else:
        value = meta
    names = a.option_strings[:1] if short else a.option_strings
    return ", ".join(names) + (" " if names and value else "") + value


def reference_markdown() -> str:
    """docs/cli.md: every command's usage and arguments, with their help and defaults, from `parser()`."""
    ap = parser()
    commands = ap.tensorstow_commands
    out = ["# Command line reference", "",
           "<!-- Generated from the parser (tensorstow/cli.py `reference_markdown`); regenerate with",
           f"     {REFERENCE_FIX} -->", "",
           ap.description, "", ap.epilog, "",
           "| command | |", "|---|---|"]
    out += [f"| [`tensorstow {name}`](#tensorstow-{name}) | {summary} |" for name, (summary, _) in commands.items()]
    for name, (summary, p) in commands.items():
        own = p.tensorstow_actions
        args = own + [a for g in p.tensorstow_groups for a in g.tensorstow_actions]
        must = [_invocation(a, short=True) for a in args if a.option_strings and a.required]
        pos = [_invocation(a) for a in args if not a.option_strings]
        out += ["", f"## tensorstow {name}", "", summary[0].upper() + summary[1:] + ".", "",
                "    " + " ".join([f"tensorstow {name} [options]", *must, *pos]), ""]
        sections = [("positional arguments", [a for a in own if not a.option_strings]),
                    ("options", [a for a in own if a.option_strings]),
                    *((g.title, g.tensorstow_actions) for g in p.tensorstow_groups)]
        for title, rows in sections:
            if not rows:
                continue
            out += [f"**{title}**", "", "| argument | |", "|---|---|"]
            out += [f"| `{_invocation(a)}` | {(a.help % dict(vars(a), prog=p.prog)).replace('|', '&#124;')} |"
                    for a in rows]
            out.append("")
        out.pop()
    return "\n".join(out) + "\n"


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
    ap = parser()
    args = ap.parse_args(argv)
    args.given = given(argv)
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
    except Interrupted as e:  # Ctrl-C, stopped at a safe point: where, and how to go on
        print(f"tensorstow: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # Ctrl-C before a run's safe points exist (tracing, planning, loading)
        print("tensorstow: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`tensorstow check plans | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except ScheduleError as e:  # a plan file whose instructions were edited or damaged
        if args.debug:
            import traceback
            traceback.print_exception(e)
        print(f"tensorstow: error: the plan's instructions are inconsistent ({e}); re-plan it with tensorstow plan "
              f"(a golden plan: tensorstow check --update)", file=sys.stderr)
        return 2
    except OSError as e:  # a path the command cannot read or write: which, and why
        if args.debug:
            import traceback
            traceback.print_exception(e)
        where = f"{e.filename}: " if e.filename else ""
        print(f"tensorstow: error: {where}{e.strerror or e} (check the path and its permissions)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
