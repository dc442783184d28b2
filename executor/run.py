"""`tensorstow execute`: replay a plan for N steps with progress, logs, resume and a trace."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import os
import signal
import stat
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tensorstow.errors import Interrupted, TensorstowError, check_writable
from tensorstow.executor import adam, aio, graphs, malloc, record, statedir
from tensorstow.executor.cuda import hardware_differences, resolve_device
from tensorstow.executor.data import batches, tokens
from tensorstow.executor.distributed import (LOST, TIMEOUT_S, Comm, agree_on_step, launch, peer_lost, rank_cores,
                                             rank_dir)
from tensorstow.executor.examples import HELD_OUT, TRAIN, Chat, Examples, is_examples
from tensorstow.executor.lr import LRSchedule
from tensorstow.executor.lanes import lane_cores
from tensorstow.executor.executor import Executor
from tensorstow.executor.ssd import SSDStore
from tensorstow.ir.models import build_for_execution, resolve_model
from tensorstow.planner.simulate import plan_commit_s, sync_step_s
from tensorstow.schema.plan import Plan
from tensorstow.schema.run import Run
from tensorstow.schema.schedule import InstrKind, block_gpus, gpu_tier


def execute(plan: Plan, run: Run = Run(), *, out=None, rank: int | None = None, comm=None) -> dict:
    """Run the plan as `run` says (schema.run.Run: the data, the run's length, the learning-rate
    schedule, checkpoints, logs) until its steps are committed; resume from its state dir if that
    holds some, with the inputs its run record holds (executor.record), else refuse. With a state
    dir every `checkpoint_every` steps (and the last) are a full checkpoint. `run.nproc` > 1: one
    process per GPU (executor.distributed.launch runs this in each, with its `rank` and `comm`;
    each keeps its state in `state_dir/rank<K>`)."""
    out = out or sys.stdout  # looked up per call: the stream of the caller (tests swap it)
    use_machinery(run)
    if run.nproc < 1:
        raise TensorstowError(f"--nproc must be >= 1, got {run.nproc}")
    if run.nproc > 1 or (run.nproc == 1 and rank is None and _gpus_of(plan) > 1):
        return _launch(plan, run, out)
    mode = pick_mode(run.mode, plan, run.device)
    steps, state_dir = run.steps, run.state_dir
    _check_run(plan, run, rank)
    o = plan.options
    spec = resolve_model(o.model, o.lora, o.quantize, o.quantize_skip)
    model, init = build_for_execution(spec, run.seed)
    store, start, resume, d = None, 0, False, None
    if state_dir is None and plan.ssd_sizes():
        raise TensorstowError("this plan keeps training state on the SSD tier: pass --state-dir DIR "
                              "(a directory on the SSD; it is created if missing)")
    with contextlib.ExitStack() as closing:  # the store's directory lock is released however we leave
        if state_dir is not None:
            if comm is not None:  # the ranks' directories go inside it: it must be new, empty or theirs
                statedir.claim_parent(state_dir)
            where = state_dir if comm is None else rank_dir(state_dir, rank)
            if run.restart:
                statedir.clear(where)
            d, owner = statedir.claim(where, plan)
            store = closing.enter_context(SSDStore(d, statedir.store_sizes(plan, None if comm is None else gpu_tier(0 if plan.decisions.dp > 1 else rank)),
                                                   owner=statedir.fingerprint(owner), shared=True))
            if comm is not None:
                agree_on_step(store, comm)
            resume = store.committed_step() is not None
            start = store.committed_step() or 0
        # a constant rate until the data is read: the schedule needs the run's length
        ex = Executor(plan, model, mode=mode, ssd_store=store, resume=resume, checkpoint_every=run.checkpoint_every,
                      init_values=init, built_from=spec, rank=rank, comm=comm,
                      lr_schedule=LRSchedule("constant", plan.options.lr),
                      graphs=run.graphs, device_arena=run.arena, device=run.device)
        if store is not None:
            statedir.describe(d, model, ex.program)
        steps, feed, data = _feed(ex, plan, run, start)
        held_out, eval_data = _eval_batches(ex, plan, run, out) if run.eval_data is not None else (None, None)
        past = start > steps  # a shorter run than the one committed: nothing to train, nothing recorded
        schedule = _lr_schedule(plan, run, steps, check=not past)
        if d is not None:  # the same run as the state dir's, or refused here: before any step, nothing written
            recorded = record.inputs(run, steps, data, eval_data, schedule, plan.options.packing)
            total = record.settle(d, recorded, store.committed_step(), run.resume_changed, data, eval_data, out,
                                  write=not past)
            schedule = dataclasses.replace(schedule, total_steps=total)
        if past:
            print(f"state dir {state_dir} already holds step {start}, past the {steps} steps asked for: nothing to "
                  f"train", file=out)
            return {"steps": start, "losses": [], "evals": []}
        ex.lr_schedule = schedule
        if start:
            print(f"resuming from step {start} committed in {state_dir}"
                  + (f" ({store.recovered})" if store.recovered else ""), file=out)
        evals = record.Evals(d, start)
        with _Log(run.log_json, out, _tensorboard(run, plan, mode, rank, start)) as log, \
                _StopOnInterrupt(comm is None) as stop:
            owed = bool(held_out) and evals.owed(start, steps, run.eval_every)  # stopped before its evaluation
            if comm is not None and held_out:  # every rank evaluates, or none: they exchange its boundaries
                owed = any(comm.gather(int(owed)))
            if owed:
                _evaluate(ex, held_out, start, steps, log, out, evals)
                stop.check(ex, start)
            if start >= steps:
                print(f"state dir {state_dir} already holds step {start} of {steps}: nothing left to train", file=out)
                return {"steps": start, "losses": [], "evals": list(evals.rows.values())}
            times, losses = _train(ex, plan, feed, steps, start, log, out, held_out, run.eval_every, evals, stop)
        med = _report(ex, plan, mode, times, run.trace, out)
        return {"steps": steps, "losses": losses, "median_step_s": med, "peak": ex.peak_bytes,
                "evals": list(evals.rows.values())}


def _check_run(plan: Plan, run: Run, rank: int | None) -> None:
    """Refuse, before anything is built or written, a run that cannot go as asked: its length,
    its data, its `--resume-changed` groups, a plan made for other hardware."""
    if run.steps is not None and run.steps < 1:
        raise TensorstowError(f"--steps must be >= 1, got {run.steps}")
    if run.trace is not None:
        check_writable(run.trace, "--trace")
    for flag, source in (("--data", run.data), ("--eval-data", run.eval_data)):
        if source not in (None, "synthetic") and not Path(source).exists():
            raise TensorstowError(f"{flag} {source} does not exist: pass a JSONL file, a `datasets` directory, a "
                                  f"token file (.npy or uint16 .bin) or 'synthetic'")
    if run.steps is None and (run.epochs is None or not is_examples(run.data)):
        raise TensorstowError("give --steps, or --epochs with --data examples (JSONL or a datasets directory)")
    if run.epochs is not None and run.epochs < 1:
        raise TensorstowError(f"--epochs must be >= 1, got {run.epochs}")
    record.accepted(run.resume_changed)
    if run.report_to == "tensorboard" and run.logging_dir is None and run.state_dir is None:
        raise TensorstowError("--report-to tensorboard needs --logging-dir DIR (or a --state-dir, whose runs/ "
                              "directory it writes by default)")
    differ = hardware_differences(plan, resolve_device(run.device, rank or 0), rank or 0)
    if differ and run.hw_mismatch != "ok":
        raise TensorstowError(f"the plan was made for {plan.hardware.name}, not this machine ({'; '.join(differ)}): "
                              f"re-plan it for here (--hw local, or a spec from `tensorstow probe`), or pass "
                              f"--hw-mismatch ok to run it anyway (its predictions do not hold here)")


def _feed(ex: Executor, plan: Plan, run: Run, start: int) -> tuple[int, Iterator, record.DataId]:
    """(the run's steps, an iterator of (epoch, example, x, y) from step `start` on, with a packing
    plan each token's position too, what the run reads of its data): examples (executor.examples)
    or tokens (executor.data; epoch and example None; a row of tokens is one document)."""
    m = plan.model
    rows = ex.rows
    if not is_examples(run.data):
        return run.steps, ((None, None, x, y, *_one_document(x, plan)) for x, y in batches(
            run.data, rows, m.seq, ex.vocab, run.steps, run.seed, start)), \
            _token_data(run.data, run.steps * rows * (m.seq + 1), ex.vocab)
    examples = _examples(run.data, ex, plan, run)
    per = examples.steps_per_epoch(rows)
    if per < 1:
        raise TensorstowError(f"--data {run.data} holds {len(examples)} rows, fewer than one step's {rows} (batch "
                              f"{m.batch} x {ex.M} microbatches): give more examples, or plan a smaller batch")
    steps = run.steps if run.steps is not None else run.epochs * per
    size = Path(run.data).stat().st_size if Path(run.data).is_file() else None
    ident = record.DataId({"kind": "examples", "source": run.data, "bytes": size, "examples": len(examples),
                           "xxh3": record.digest(examples.ids, examples.labels,
                                                 *(() if examples.positions is None else (examples.positions,)))})
    return steps, examples.batches(rows, steps, run.seed, start, run.shuffle, positions=plan.options.packing), ident


def _one_document(x: torch.Tensor, plan: Plan) -> tuple:
    """A packing plan's positions for rows of tokens that are one document each (a token file's):
    0..seq-1 in every row; () for another plan."""
    return (torch.arange(x.shape[1]).expand_as(x).contiguous(),) if plan.options.packing else ()


def _examples(source: str, ex: Executor, plan: Plan, run: Run, held_out: bool = False) -> Examples:
    """`source`'s examples at the plan's seq, tokenized as the run says, padding labelled with the
    model's own ignore index; `held_out`: evaluation data (a `DatasetDict`'s held-out split)."""
    ignored = ex.program.ignore_index
    examples = Examples.load(source, plan.model.seq, ex.vocab, tokenizer=_tokenizer(run.tokenizer, plan.options.model),
                             ignore=-100 if -100 in ignored else min(ignored), packing=plan.options.packing,
                             chat=Chat.of(run.chat_template, run.loss_on), splits=HELD_OUT if held_out else TRAIN)
    for note in examples.notes:
        print(f"data {source}: {note}", flush=True)
    return examples


def _token_data(source: str, need: int, vocab: int) -> record.DataId:
    """What a run of `need` tokens reads of a token file (its prefix), or of synthetic data."""
    if source == "synthetic":
        return record.DataId({"kind": "synthetic"})

    def prefix(n: int) -> str:
        return record.digest(np.asarray(tokens(source, n, vocab)))
    return record.DataId({"kind": "tokens", "source": source, "bytes": Path(source).stat().st_size, "tokens": need,
                          "xxh3": prefix(need)}, prefix)


def evaluate_state(plan: Plan, run: Run, *, out=None) -> dict:
    """`tensorstow evaluate`: the mean loss of `run.eval_data` with the weights the state dir
    `run.state_dir` committed last (`Executor.evaluate`); the state is read, never written."""
    out = out or sys.stdout
    use_machinery(run)
    if run.state_dir is None or run.eval_data is None:
        raise TensorstowError("evaluate needs --state-dir DIR (of tensorstow execute) and --data F")
    d = Path(run.state_dir)
    if not (d / statedir.PLAN).is_file() and (d / "rank0" / statedir.PLAN).is_file():
        raise TensorstowError(f"{d} holds a run of several processes (rank0, rank1, ...); tensorstow evaluate reads "
                              f"a one-process run's: evaluate during the run (--eval-data, --eval-every), or export it "
                              f"(tensorstow export {d} -o DIR) and evaluate that model")
    if not (d / statedir.PLAN).is_file():
        raise TensorstowError(f"{d} is not a tensorstow state dir (no {statedir.PLAN}); pass the --state-dir "
                              f"of a tensorstow execute run")
    owner = statedir.held(d, plan)  # the plan it trains
    o = plan.options
    spec = resolve_model(o.model, o.lora, o.quantize, o.quantize_skip)
    model, init = build_for_execution(spec, run.seed)
    # read-only: an evaluation changes nothing in the state dir, which may be read-only to it
    with SSDStore(d, statedir.store_sizes(plan), owner=statedir.fingerprint(owner), read_only=True) as store:
        step = store.committed_step()
        if step is None:
            raise TensorstowError(f"state dir {d} holds no committed step yet")
        # no update: any rate does (a linear or cosine one would need the run's length)
        ex = Executor(plan, model, mode=pick_mode(run.mode, plan, run.device), ssd_store=store, resume=True,
                      init_values=init, built_from=spec, lr_schedule=LRSchedule("constant", plan.options.lr),
                      device=run.device)
        try:
            held_out = _eval_batches(ex, plan, run, out)[0]
            t0 = time.perf_counter()
            value = ex.evaluate(held_out)
            dt = time.perf_counter() - t0
        finally:
            ex.close()
    ppl = record.perplexity(value)
    print(f"step {step}: eval loss {value:.6g}  perplexity {ppl:.6g}  ({len(held_out)} batches of "
          f"{plan.model.batch * plan.decisions.microbatches()} x {plan.model.seq}, {dt:.3f} s)", file=out)
    return {"step": step, "eval_loss": value, "eval_perplexity": ppl, "eval_batches": len(held_out)}


def _eval_batches(ex: Executor, plan: Plan, run: Run, out=None) -> tuple[list, record.DataId]:
    """`--eval-data` as (x, y) batches of the plan's shape, in file order: `--eval-batches` of
    them, or (examples) all its examples (a last partial batch dropped, and said on `out`);
    synthetic: drawn with seed + 1, apart from the training data. With what they are, for the run
    record."""
    got = _held_out(ex, plan, run, out or sys.stdout)
    return got, record.DataId({"kind": "batches", "source": run.eval_data, "batches": len(got),
                               "xxh3": record.digest(*(t.numpy() for xy in got for t in xy))})


def _held_out(ex: Executor, plan: Plan, run: Run, out) -> list:
    m = plan.model
    rows = ex.rows
    if run.eval_batches is not None and run.eval_batches < 1:
        raise TensorstowError(f"the number of evaluation batches (--eval-batches; evaluate's --batches) must be >= 1, "
                              f"got {run.eval_batches}")
    if run.eval_every < 0:
        raise TensorstowError(f"--eval-every must be >= 0, got {run.eval_every}")
    if not is_examples(run.eval_data):
        if run.eval_batches is None and run.eval_data != "synthetic":
            raise TensorstowError(f"--eval-data {run.eval_data} is a token file: give --eval-batches N")
        seed = run.seed + 1 if run.eval_data == "synthetic" else run.seed
        return [(x, y, *_one_document(x, plan))
                for x, y in batches(run.eval_data, rows, m.seq, ex.vocab, run.eval_batches or 1, seed, 0)]
    examples = _examples(run.eval_data, ex, plan, run, held_out=True)
    n = run.eval_batches or examples.steps_per_epoch(rows)
    if n < 1:
        raise TensorstowError(f"--eval-data {run.eval_data} holds fewer examples than one batch of {rows}")
    if n > examples.steps_per_epoch(rows):  # more would evaluate examples twice
        raise TensorstowError(f"{run.eval_data} holds {examples.steps_per_epoch(rows)} evaluation batches of {rows} "
                              f"rows, and {n} were asked for (--eval-batches; evaluate's --batches): ask for at most "
                              f"that many, or leave the count out to evaluate all of them")
    if run.eval_batches is None and len(examples) % rows:
        print(f"eval data {run.eval_data}: the last {len(examples) % rows} of its {len(examples)} "
              f"{'windows' if plan.options.packing else 'examples'} are not evaluated (fewer than a batch of {rows} "
              f"rows a step)", file=out)
    return [tuple(b[2:]) for b in examples.batches(rows, n, run.seed, 0, False, positions=plan.options.packing)]


def _lr_schedule(plan: Plan, run: Run, steps: int, check: bool = True) -> LRSchedule:
    """The learning rate over the run's `steps`: each of the run's settings, else the plan's;
    `check`: a warmup longer than the run is refused (a run that trains)."""
    o = plan.options

    def pick(given, planned):
        return planned if given is None else given
    schedule = LRSchedule(pick(run.lr_scheduler, o.lr_scheduler), pick(run.lr, o.lr),
                          pick(run.warmup_steps, o.warmup_steps), steps, pick(run.min_lr_ratio, o.min_lr_ratio))
    if check and schedule.warmup_steps > steps:
        raise TensorstowError(f"the warmup ({schedule.warmup_steps} optimizer steps) is longer than the run ({steps}): "
                              f"the rate would never reach its peak {schedule.lr:g}; give --warmup-steps at most "
                              f"{steps} (a few percent of the run is usual)")
    return schedule


def _tokenizer(path: str | None, model: str):
    """`AutoTokenizer` of `--tokenizer DIR`, else of an `hf:` model's directory where it holds
    one, else None (pre-tokenized examples need none)."""
    from tensorstow.ir import hf
    if path is None and not model.startswith(hf.PREFIX):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TensorstowError("tokenizing examples needs transformers (pip install 'tensorstow[hf]')") from None
    if path is not None:
        hf.check_tokenizer_dir(path, "--tokenizer")
    try:
        return AutoTokenizer.from_pretrained(path or model[len(hf.PREFIX):])
    except (OSError, ValueError) as e:
        if path is None:
            return None  # the model's directory has no tokenizer: text examples will say so
        raise TensorstowError(f"--tokenizer {path}: no tokenizer there ({str(e).splitlines()[0]})") from None


def _store_bytes(ex: Executor) -> tuple[int, int] | None:
    """(bytes read, bytes written) by the executor's SSD store so far; None without one."""
    store = ex.ssd.store
    return None if store is None else (store.bytes_read, store.bytes_written)


def _io_rates(ex: Executor, before: tuple[int, int] | None, dt: float) -> dict:
    """The step's SSD traffic for its progress line and log (`ssd_read_bytes`, `ssd_written_bytes`:
    the buffers the step read and wrote, its checkpoint's writes included)."""
    now = _store_bytes(ex)
    if now is None or before is None:
        return {}
    return {"ssd_read_bytes": now[0] - before[0], "ssd_written_bytes": now[1] - before[1]}


def _train(ex: Executor, plan: Plan, feed: Iterator, steps: int, start: int, log: "_Log", out,
           held_out: list | None, eval_every: int, evals: record.Evals, stop: "_StopOnInterrupt"
           ) -> tuple[list[float], list[float]]:
    """Steps `start`..`steps` (each printed, and logged as a JSON line), then a commit of the last
    one; returns the step times and losses. A step whose labels are all left out
    (`Executor.skip_step`) trains nothing and says so. A Ctrl-C (`stop`) ends the run after the
    step under way, committed."""
    m = plan.model
    tokens = ex.rows * m.seq
    ignored = torch.tensor(sorted(ex.program.ignore_index))
    times, losses = [], []
    for k, (epoch, example, x, y, *positions) in enumerate(feed, start):
        where = "" if epoch is None else f"  epoch {epoch}  example {example}"
        row = {"step": k + 1, **({} if epoch is None else {"epoch": epoch, "example": example})}
        if bool(torch.isin(y, ignored).all()):
            ex.skip_step()
            log.write({**row, "skipped": "no labels"})
            print(f"step {k + 1}/{steps}{where}  every label is ignored: no update", file=out, flush=True)
        else:
            taken = ex.opt_steps
            moved = _store_bytes(ex)
            t0 = time.perf_counter()
            loss = ex.step(x, y, *positions)
            dt = time.perf_counter() - t0
            io = _io_rates(ex, moved, dt)
            times.append(dt)
            losses.append(loss)
            # fp16-mixed: the loss scale after the step, and whether overflow skipped its update
            amp = {} if ex.loss_scale is None else {"loss_scale": ex.loss_scale, "skipped": ex.opt_steps == taken}
            scale = (f"  scale {amp['loss_scale']:g}" + ("  (inf/NaN: update skipped)" if amp["skipped"] else "")
                     if amp else "")
            norm = {} if ex.grad_norm is None else {"grad_norm": ex.grad_norm}  # the Trainer's grad_norm
            if ex.speculation is not None:  # whether the speculated updates held or were redone clipped
                norm["speculation"] = ex.speculation
            # logged first: a run killed once the progress line is out has the step logged
            log.write({**row, "loss": loss, **norm, "lr": ex.lr, "step_time_s": dt, "tokens_per_s": tokens / dt, **io,
                       "lane_busy_s": ex.lane_busy(), "device_peak_bytes": ex.peak_bytes.get("gpu", 0), **amp})
            shown = "" if ex.grad_norm is None else f"  grad_norm {ex.grad_norm:.4g}"
            if ex.speculation == "redone":
                shown += " (clipped: speculated updates redone)"
            disk = (f"  ssd read {io['ssd_read_bytes'] / dt / 1e9:.3g} GB/s write {io['ssd_written_bytes'] / dt / 1e9:.3g} GB/s"
                    if io.get("ssd_read_bytes") or io.get("ssd_written_bytes") else "")
            print(f"step {k + 1}/{steps}{where}  loss {loss:.4f}{shown}  lr {ex.lr:.4g}  {dt:.3f} s  "
                  f"{tokens / dt:.4g} tokens/s{disk}{scale}", file=out, flush=True)
        stop.check(ex, k + 1)
        if held_out and evals.owed(k + 1, steps, eval_every):
            _evaluate(ex, held_out, k + 1, steps, log, out, evals)
            stop.check(ex, k + 1)
    ex.checkpoint()  # the last step is always committed
    return times, losses


def _evaluate(ex: Executor, held_out: list, step: int, steps: int, log: "_Log", out, evals: record.Evals) -> None:
    """One evaluation of the held-out batches after `step`: recorded, logged and printed."""
    t0 = time.perf_counter()
    value = ex.evaluate(held_out)
    dt = time.perf_counter() - t0
    row = {"step": step, "eval_loss": value, "eval_perplexity": record.perplexity(value), "eval_batches": len(held_out)}
    evals.add(row)
    log.write({**row, "eval_time_s": dt})
    print(f"eval after step {step}/{steps}  loss {value:.4f}  perplexity {row['eval_perplexity']:.4g}  "
          f"({len(held_out)} batch{'es' * (len(held_out) != 1)}, {dt:.3f} s)", file=out, flush=True)


def _tensorboard(run: Run, plan: Plan, mode: str, rank: int | None, start: int) -> "TensorBoard | None":
    """`--report-to tensorboard`'s writer (None for `none`, and on every rank but the first). A
    resumed run drops the events of the steps after its last commit, which it runs again."""
    if run.report_to != "tensorboard" or (rank or 0) != 0:
        return None
    where = run.logging_dir or str(Path(run.state_dir) / "runs")
    return TensorBoard(where, predicted_step(plan, mode), purge_step=start + 1 if start else None)


class TensorBoard:
    """`--report-to tensorboard`: each logged record's scalars as TensorBoard events, by the names the
    Trainer gives them where it has one (`train/loss`, `train/learning_rate`, `train/grad_norm`,
    `eval/loss`; the epoch's index is `train/epoch_index`, not the Trainer's fractional
    `train/epoch`), at the record's step; flushed every step, so a killed run keeps
    what it logged."""

    NAMES = {"loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm", "epoch": "train/epoch_index",
             "tokens_per_s": "train/tokens_per_second", "step_time_s": "train/step_seconds",
             "ssd_read_bytes": "train/ssd_read_bytes", "ssd_written_bytes": "train/ssd_written_bytes",
             "eval_loss": "eval/loss", "eval_perplexity": "eval/perplexity", "eval_time_s": "eval/seconds"}
    """Log record key -> scalar name."""

    def __init__(self, logdir: str, predicted_s: float, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TensorstowError("--report-to tensorboard needs the tensorboard package (pip install tensorboard)"
                                  ) from None
        try:
            self.writer = SummaryWriter(log_dir=logdir, purge_step=purge_step)
        except OSError as e:
            raise TensorstowError(f"--logging-dir {logdir}: cannot write TensorBoard events there "
                                  f"({e.strerror or e}); pass a directory this user can write") from None
        self.predicted_s = predicted_s
        """The plan's predicted step for the run's mode, beside each measured one."""

    def write(self, row: dict) -> None:
        step = row["step"]
        for key, name in self.NAMES.items():
            if isinstance(row.get(key), (int, float)):
                self.writer.add_scalar(name, row[key], step)
        if "step_time_s" in row:
            self.writer.add_scalar("train/predicted_step_seconds", self.predicted_s, step)
        for lane, busy in sorted(row.get("lane_busy_s", {}).items()):
            self.writer.add_scalar(f"lanes/{lane}_busy_seconds", busy, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Log:
    """`--log-json`: one JSON object a line, appended whole or not at all. A record that a full
    disk tore is cut at once, and one that a killed run tore (no final newline) is cut when the
    file is opened again, so the file stays valid JSON lines across crashes and resumes. Every
    record also goes to `--report-to`'s writer."""

    def __init__(self, path: str | None, out, report: TensorBoard | None = None):
        self.path, self.fd, self.report = path, None, report
        if path is None:
            return
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)
            self._mend(out)
        except OSError as e:
            self.close()
            raise TensorstowError(f"--log-json {path}: cannot open it for appending ({e.strerror or e}); pass a "
                                  f"path this user can write") from None

    def _mend(self, out) -> None:
        """Cut a torn last record (bytes after the last newline that begin a JSON object but do not
        parse); a whole one missing its newline gets it. Anything else there is no log of ours:
        refused, never cut."""
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):  # a pipe or a terminal: nothing to read back
            return
        size = os.fstat(self.fd).st_size
        torn = self._tail(size)
        whole = size - torn  # the complete lines: the last one a record of ours, or this is no log of ours
        lines = os.pread(self.fd, min(whole, 1 << 20), whole - min(whole, 1 << 20)).split(b"\n")
        last = next((line for line in reversed(lines) if line.strip()), None)
        if last is not None:
            try:
                if not isinstance(json.loads(last), dict):
                    raise ValueError("not an object")
            except ValueError:
                self.close()
                raise TensorstowError(f"--log-json {self.path}: its last line is not a JSON record, so it is no log "
                                      f"of `execute`'s; pass a new path, or that of a log execute wrote") from None
        if not torn:
            return
        tail = os.pread(self.fd, torn, size - torn)
        try:
            json.loads(tail)
            os.write(self.fd, b"\n")
            return
        except ValueError:
            pass
        if not tail.lstrip().startswith(b"{"):
            self.close()
            raise TensorstowError(f"--log-json {self.path}: its last line is not a JSON record, so it is no log of "
                                  f"`execute`'s; pass a new path, or that of a log execute wrote")
        os.ftruncate(self.fd, size - torn)
        print(f"log {self.path}: cut a torn last record ({torn} bytes) that an interrupted run left", file=out)

    def _tail(self, size: int) -> int:
        """Bytes after the last newline of the file's first `size` bytes."""
        at = size
        while at > 0:
            chunk = os.pread(self.fd, min(1 << 16, at), max(0, at - (1 << 16)))
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                return size - (at - len(chunk) + nl + 1)
            at -= len(chunk)
        return size

    def write(self, row: dict) -> None:
        if self.report is not None:
            self.report.write(row)
        if self.fd is None:
            return
        data = memoryview((json.dumps(row) + "\n").encode())
        end = os.fstat(self.fd).st_size
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, end)  # no torn record stays behind
            why = f"disk full: {e.strerror}" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise TensorstowError(f"--log-json {self.path}: cannot write step {row.get('step')}'s record ({why}); the "
                                  f"state dir's last commit is intact: free space, then rerun the same command to "
                                  f"resume") from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.report is not None:
            self.report.close()
            self.report = None

    def __enter__(self) -> "_Log":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _StopOnInterrupt:
    """Ctrl-C while a single process trains: the first stops the run at the next safe point
    (after the step under way, which is then committed: `check`), the second at once (the last
    commit stands, as after a kill: the state dir is crash-consistent)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.asked, self._before = False, None

    def __enter__(self) -> "_StopOnInterrupt":
        if self.enabled:
            self._before = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:  # None: a handler not installed from Python, which Python cannot restore
            signal.signal(signal.SIGINT, signal.SIG_DFL if self._before is None else self._before)

    def _handle(self, signum, frame) -> None:
        # written to the descriptor: the handler may run while the main thread is inside a write
        # to the same stream, which a second buffered write would refuse as reentrant
        if self.asked:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            os.write(2, b"tensorstow: interrupted again: stopped at once; the last committed step stands; rerun "
                        b"the same command to resume\n")
            os._exit(130)
        self.asked = True
        os.write(2, b"tensorstow: stopping after this step (Ctrl-C again stops at once)\n")

    def check(self, ex: Executor, step: int) -> None:
        """Stop here, committed, if a Ctrl-C asked to."""
        if not self.asked:
            return
        ex.checkpoint()
        store = ex.ssd.store
        kept = (f"committed step {store.committed_step()}" if store is not None and store.committed_step() is not None
                else "nothing is committed without --state-dir")
        raise Interrupted(f"interrupted at step {step}; {kept}; rerun the same command to resume")


def _report(ex: Executor, plan: Plan, mode: str, times: list[float], trace: str | None, out) -> float:
    """Measured against predicted: the median step, the tiers' peaks, each lane's busy time;
    `trace`: the last step's measured timeline (Perfetto JSON). Returns the median step."""
    pred = plan.predicted
    if not times:
        print("no step trained: nothing measured", file=out)
        return 0.0
    steady = times[1:] or times  # the first step warms caches and allocators
    med = statistics.median(steady)
    expect = predicted_step(plan, mode)
    print(f"measured step {med:.4g} s (median of {len(steady)}, {mode} mode) vs predicted {expect:.4g} s "
          f"(x{med / expect:.3g}); device peak {ex.peak_bytes.get('gpu', 0) / 1e6:.1f} MB of "
          f"{pred.capacity_bytes['gpu'] / 1e6:.1f} MB budget; dram pool {ex.pool.size / 1e6:.1f} MB "
          f"(plan peak {pred.peak_bytes['dram'] / 1e6:.1f} MB)"
          + (f", {ex.pool.overflow_bytes / 1e6:.1f} MB allocated outside it over the run (no free range "
             f"long enough)" if ex.pool.overflow_bytes else "")
          + (f"; copies waited {ex.pool.room_wait_s:.3g} s for room in it" if ex.pool.room_wait_s >= 1e-3 else ""),
          file=out)
    if "gpu_reserved" in ex.peak_bytes:  # CUDA: what the caching allocator really held
        print(f"CUDA allocator peak: {ex.peak_bytes['gpu_allocated'] / 1e6:.1f} MB allocated, "
              f"{ex.peak_bytes['gpu_reserved'] / 1e6:.1f} MB reserved (held to {ex.alloc_limit / 1e6:.1f} MB: "
              f"the budget + workspaces)", file=out)
    print(f"device arena: {ex.dev.arena.numel() / 1e6:.1f} MB, every copy at its planned offset"
          if ex.dev.arena is not None else f"device arena: not used ({ex.dev.arena_note})", file=out)
    if ex.device.type == "cuda":
        segs = ex.segment_graphs
        print(f"CUDA graph: the step replayed as one graph after {graphs.WARMUP} eager steps"
              if ex.graphs.captured and not ex.graphs.blockers
              else f"CUDA graphs: the step's segments replayed one graph each after {graphs.WARMUP} eager steps "
                   f"({segs.replays} in the last step; the step as one graph: {'; '.join(ex.graphs.blockers)})"
              if segs.on and segs.captured
              else f"CUDA graph: not used ({'; '.join(ex.graphs.blockers) or 'too few steps'}; segment by segment: "
                   f"{'; '.join(segs.blockers) or 'too few steps'})", file=out)
    busy = ex.lane_busy()
    print("lane busy, measured (predicted): " + ", ".join(
        f"{r} {v:.3g} s ({pred.busy_s.get(r, 0):.3g} s)" for r, v in busy.items()), file=out)
    if trace:
        with open(trace, "w") as f:
            json.dump(ex.measured_trace(), f)
        print(f"wrote {trace}", file=out)
    return med


def _gpus_of(plan: Plan) -> int:
    """How many processes the plan needs: one per GPU of its hardware when it spans several."""
    if plan.decisions.dp > 1:
        return plan.decisions.dp
    used = set(block_gpus(plan).values())
    return len(plan.hardware.spec.gpus) if used != {gpu_tier(0)} else 1


def _launch(plan: Plan, run: Run, out) -> dict:
    need, nproc = _gpus_of(plan), run.nproc
    if nproc != need:
        raise TensorstowError((f"this plan trains data-parallel on {need} ranks, each with its shard of the state: "
                               if plan.decisions.dp > 1 else f"this plan runs on {need} GPU(s) ({plan.hardware.name}): ")
                              + f"execute it with --nproc {need}, one process per GPU")
    with tempfile.TemporaryDirectory(prefix="tensorstow-plan-") as tmp:
        path = Path(tmp) / "plan.json"
        path.write_text(plan.dumps())
        launch(nproc, dict(dataclasses.replace(run, nproc=1).to_json(), plan=str(path)), out)
    return {"steps": run.steps, "losses": []}


def predicted_step(plan: Plan, mode: str) -> float:
    """The step time the plan predicts for a mode: overlap runs its simulated schedule, sync one
    instruction after another (the sum of their modeled durations); both with the SSD store's
    commit (`cost.commit_time`) where the executor runs it (`simulate.sync_step_s`)."""
    if mode == "overlap":
        return plan.predicted.step_time_s
    return sync_step_s(list(plan.instructions), plan_commit_s(plan))


def predicted_eval(plan: Plan, mode: str) -> float:
    """One evaluation batch's time the plan predicts for a mode (`Plan.eval_instructions`; 0
    where the plan has no forward-only program): its simulated replay, or in sync mode the sum of
    its instructions' modeled durations."""
    if mode == "overlap":
        return plan.predicted.eval_step_s
    return sync_step_s(list(plan.eval_instructions), 0.0)


OVERLAP_MIN_COMPUTE_S = 1.5e-3
"""On CUDA, `auto` runs a plan that moves state only through DRAM in overlap mode where its
computations' median predicted time is at least this: below it the lanes' threads slow the host
that launches the kernels more than the overlap hides (benchmarks/RESULTS.md "On a GPU")."""


def use_machinery(run: Run) -> None:
    """The process-wide choices of `run`: the SSD store's I/O engine, the CPU Adam, malloc's tuning
    (each before its first use in this process)."""
    aio.engine_choice, adam.kernel_choice, malloc.setting = run.io_engine, run.cpu_adam, run.malloc


def pick_mode(mode: str, plan: Plan | None = None, device: str | None = None) -> str:
    """`auto`: overlap where the lanes have engines of their own and the plan has work for them to
    hide. On CUDA: overlap for a plan with SSD traffic; for one that moves state only through DRAM
    where its computations are long enough that the host keeps ahead of the GPU
    (`OVERLAP_MIN_COMPUTE_S`); sync otherwise (an all-resident plan hides nothing). On a CPU device
    tier: overlap where the compute threads leave a core for the other lanes (the executor pins
    them apart: `lanes.lane_cores`); sync where the compute takes every core, as the lanes would
    then take cores from it. `device`: the executor's (`--device`; None: its default). The measurements behind each rule: benchmarks/RESULTS.md "Sync or
    overlap"."""
    if mode != "auto":
        return mode
    device = resolve_device(device)
    if device.type == "cuda":
        if plan is None or plan.ssd_sizes():
            return "overlap"
        dram = any(v for k, v in plan.predicted.traffic_bytes.items() if "dram" in k.split("->"))
        computes = [i.est_s for i in plan.instructions if i.kind == InstrKind.COMPUTE]
        long_enough = bool(computes) and statistics.median(computes) >= OVERLAP_MIN_COMPUTE_S
        return "overlap" if dram and long_enough else "sync"
    return "overlap" if lane_cores(device, torch.get_num_threads()) else "sync"


def worker(kw: dict) -> int:
    """A rank's main: join the group, execute, leave; one error line on failure."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        plan = Plan.load(kw.pop("plan"))
        if world != _gpus_of(plan):
            raise TensorstowError(f"this plan runs on {_gpus_of(plan)} GPU(s) ({plan.hardware.name}) but {world} "
                                  f"processes were started: start one per GPU")
        # torchrun over several machines: the rank's GPU and cores are its machine's (LOCAL_RANK)
        local, local_world = int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world))
        device = resolve_device(kw.get("device"), local)
        # NCCL where every rank has a GPU of its own; else gloo (CPU device tiers, or several
        # ranks sharing one GPU), staging the boundaries through host memory
        nccl = device.type == "cuda" and torch.cuda.device_count() >= local_world and dist.is_nccl_available()
        if nccl:
            torch.cuda.set_device(device)
        if device.type == "cpu" and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, rank_cores(sorted(os.sched_getaffinity(0)), local, local_world))
        # NCCL moves device tensors; the step's agreement (losses, committed steps) is CPU tensors
        dist.init_process_group("cpu:gloo,cuda:nccl" if nccl else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
    except TensorstowError as e:
        print(f"tensorstow: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the rendezvous failed: one line, not a traceback
        print(f"tensorstow: error: rank {rank} could not join the process group: {e}", file=sys.stderr)
        return 1
    try:
        out = sys.stdout if rank == 0 else open(os.devnull, "w")
        if rank:  # one log and one trace, rank 0's
            kw = dict(kw, log_json=None, trace=None)
        comm = Comm(rank, world, on_device=nccl, data_parallel=plan.decisions.dp > 1)
        execute(plan, Run.from_json(kw, where="rank options"), rank=rank, comm=comm, out=out)
        # every rank done before any leaves: gloo aborts a process (SIGABRT) whose peer closed its
        # connections while it was still tearing its own down
        dist.barrier()
        return 0
    except TensorstowError as e:  # its line says what to change (an input refused, a full disk): the launcher
        # adds no "run the same command"
        print(f"tensorstow: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one line for the launcher, not a traceback
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"tensorstow: error: {LOST} ({first})" if peer_lost(e) else f"tensorstow: error: {type(e).__name__}: {first}",
              file=sys.stderr)
        return 1
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a dead peer may leave the group unusable
            pass


if __name__ == "__main__":  # a rank's process, started by `executor.distributed.launch`
    sys.exit(worker(json.loads(sys.argv[1])))
