"""The state dir: a self-describing, crash-consistent checkpoint of one plan's training.

    STATE_DIR/tensorstow.json  the mark of a state dir, written first into an empty directory
    STATE_DIR/plan.json     the plan it trains (a second plan is refused)
    STATE_DIR/layout.json   what each persistent buffer holds: tensors, dtypes, offsets, names
    STATE_DIR/config.json   the Hugging Face config, for `hf:` models (export hands it on)
    STATE_DIR/run.json      the inputs of the run it trains (executor/record.py): a resume with
                            other inputs is refused
    STATE_DIR/evals.json    the evaluations of the committed steps (executor/record.py)
    STATE_DIR/MANIFEST, *.slot0|1, LOCK    the SSD store (executor/ssd.py, its files: executor/manifest.py)

tensorstow claims a directory only if it is new or empty, or already a state dir (its mark, or
the store's manifest of an older release), and never writes into any other; `--restart` deletes
only the files these records name (the store's slots as its manifests and the plan name them),
so a user's files in or beside a state dir are never touched.

The store holds every buffer that lives across steps (P, C, M, OS, wherever their home tier
is) and every buffer the plan moves to SSD, plus the random-number generator state (`RNG`), so
resuming from any committed step gives the bits an uninterrupted run gives. SSD-resident
buffers are the store's own; a DRAM- or GPU-resident buffer is written at each checkpoint.
Constants (C) are written once, at step 0.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import torch

from tensorstow.errors import TensorstowError
from tensorstow.executor.amp import AMP
from tensorstow.schema.plan import Plan, as_plan
from tensorstow.schema.schedule import block_gpus, member_rows, rows_member

PLAN, LAYOUT, CONFIG, ADAPTER_CONFIG = "plan.json", "layout.json", "config.json", "adapter_config.json"
RNG = "RNG"
"""Store buffer holding the CPU generator state (and CUDA's, with a GPU) at the commit."""


def rng_bytes() -> torch.Tensor:
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if torch.cuda.is_available() else [])
    return torch.cat(states)


def set_rng(blob: torch.Tensor) -> None:
    cpu = torch.get_rng_state().numel()
    torch.set_rng_state(blob[:cpu].clone())
    if torch.cuda.is_available() and blob.numel() > cpu:
        torch.cuda.set_rng_state(blob[cpu:].clone())


def store_sizes(plan: Plan, gpu: str | None = None) -> dict[str, int]:
    """Every buffer the store holds: the training state (`plan.persistent()`), what the plan
    moves to SSD, the RNG, and for fp16-mixed the loss scaler's state. `gpu`: of a multi-GPU
    plan, only the buffers of the blocks that GPU's process runs (its rank's store)."""
    plan = as_plan(plan)
    names = set(plan.persistent()) | set(plan.ssd_sizes())
    if gpu is not None:
        own = block_gpus(plan)
        names = {n for n in names if own[plan.buffers[n].block] == gpu}
    sizes = {n: plan.buffers[n].bytes for n in sorted(names)}
    sizes[RNG] = rng_bytes().numel()
    if plan.model.precision == "fp16-mixed":
        sizes[AMP] = 16  # the loss scaler (executor.amp)
    return sizes


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text`, whole or not at all (a temporary, synced, renamed over it); one
    error naming the file where that fails (a full disk: the old file stays)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        why = f"disk full: {e.strerror}" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise TensorstowError(f"cannot write {path} ({why}); the state dir's last commit is intact: free space "
                              f"or fix the permissions, then rerun the same command to resume") from None


def _create_atomic(path: Path, text: str) -> None:
    """Create `path` holding `text`, whole or not at all, unless it exists: written under a name
    of this call's own, then linked into place (a link fails where the name exists), so two
    processes claiming one directory at once never see a torn file or each other's temporary."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.unlink(tmp)


def fingerprint(plan: Plan) -> str:
    """The plan's fingerprint as its state dir's store records it (`SSDStore(owner=...)`): XXH3-64 of
    its file's text, so any change to the plan (options, decisions, schedule) is another owner."""
    import xxhash
    return f"{xxhash.xxh3_64_intdigest(plan.dumps().encode()):016x}"


MARK = "tensorstow.json"
MARK_FORMAT = "tensorstow-state-dir"
RUN, EVALS = "run.json", "evals.json"
DESCRIPTION = (MARK, PLAN, LAYOUT, CONFIG, ADAPTER_CONFIG, RUN, EVALS)
"""The state dir's own files besides the store's (each also written as NAME.tmp or NAME.*.tmp)."""
RUN_FIELDS_OF_PLAN = ("lr", "lr_scheduler", "warmup_steps", "min_lr_ratio")
"""Plan options that are inputs of the run, not of the plan's state: the learning rate is a
runtime input of the optimizer lane (executor/lr.py). A plan that differs from the one a state
dir holds only in these (and in its recorded `[execute]` table) trains the same state; the run
record (executor/record.py) compares them."""


RANK_DIR = re.compile(r"rank\d+")
"""A multi-process run's directory of one rank's state, inside its state dir."""


def _own_temporary(name: str) -> bool:
    """A temporary of one of the state dir's or the store's files (`write_atomic`, `_create_atomic`)."""
    from tensorstow.executor.manifest import MANIFEST
    return any(name.startswith(base + ".") and name.endswith(".tmp") for base in (*DESCRIPTION, MANIFEST))


def _store_manifest(d: Path) -> bool:
    """Whether `d` holds a manifest of tensorstow's SSD store (a state dir of a release before the mark)."""
    from tensorstow.executor.manifest import FORMAT, MANIFEST, PREVIOUS
    for name in (MANIFEST, PREVIOUS):
        try:
            if json.loads((d / name).read_bytes()).get("format") == FORMAT:
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def survey(state_dir, ranks: bool = False) -> str:
    """What `state_dir` is: "new" (missing, or empty but for the temporaries of a claim under way),
    "state" (a state dir: its mark, or an older release's store manifest) or "foreign" (anything
    else: a directory of the user's, which tensorstow never writes into). `ranks`: the directory
    of a multi-process run, whose `rank<K>` directories its processes may be making now."""
    d = Path(state_dir)
    if not d.exists():
        return "new"
    if not d.is_dir():
        return "foreign"
    names = [p.name for p in d.iterdir()]  # first: a claim under way writes its mark before anything else
    if MARK in names:
        try:
            if json.loads((d / MARK).read_text()).get("format") == MARK_FORMAT:
                return "state"
        except (OSError, ValueError, AttributeError):
            pass
        return "foreign"
    if _store_manifest(d):
        return "state"
    return "new" if all(_own_temporary(n) or (ranks and RANK_DIR.fullmatch(n) and _survey_or_foreign(d / n) != "foreign")
                        for n in names) else "foreign"


def _survey_or_foreign(d: Path) -> str:
    """`survey(d)`, a directory it cannot read being "foreign" (the user's, untouched)."""
    try:
        return survey(d)
    except OSError:
        return "foreign"


def _refuse_foreign(d: Path, verb: str) -> TensorstowError:
    held = sorted(p.name for p in d.iterdir())[:3] if d.is_dir() else []
    what = f"holds other files ({', '.join(held)}{', ...' if len(held) == 3 else ''})" if d.is_dir() else "is a file"
    return TensorstowError(f"--state-dir {d} is not a tensorstow state dir: it {what}; {verb} nothing there. "
                           f"Give --state-dir a new or empty directory")


def owned_files(d: Path) -> list[Path]:
    """The files of state dir `d` that its records name: the description, the store's manifests,
    lock and probe, and every slot file a manifest or the held plan's buffers name."""
    from tensorstow.executor import manifest as ssd
    manifests = (ssd.MANIFEST, ssd.PREVIOUS, ssd.MANIFEST + ".tmp", ssd.MANIFEST + ".damaged")
    names = {*DESCRIPTION, *manifests, ".direct-probe"}
    try:
        plan = json.loads((d / PLAN).read_text())
        options, buffers = dict(plan["options"]), [*plan["buffers"], RNG, AMP]
    except (OSError, ValueError, KeyError, TypeError):
        options, buffers = {}, []
    # config.json and adapter_config.json are the state dir's only for a model that has them
    if not str(options.get("model", "")).startswith("hf:"):
        names.discard(CONFIG)
    if not options.get("lora"):
        names.discard(ADAPTER_CONFIG)
    names.update(f for b in buffers for f in ssd.slot_files(b))  # for a store whose manifests are all damaged
    for m in manifests:
        try:
            entries = json.loads((d / m).read_bytes())["buffers"].values()
            names.update(f for e in entries for f in e["files"] if isinstance(f, str) and "/" not in f)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return sorted(p for p in d.iterdir() if p.is_file() and (p.name in names or _own_temporary(p.name)))


def clear(state_dir) -> list[Path]:
    """`execute --restart`: delete the files the state dir's records name (`owned_files`), under
    the store's lock, keeping its mark, so it starts over there; returns what it deleted. A
    directory that is not a state dir is refused untouched."""
    from tensorstow.executor.manifest import dir_lock
    d = Path(state_dir)
    kind = survey(d)
    if kind == "new":
        return []
    if kind == "foreign":
        raise _refuse_foreign(d, "--restart deleted")
    gone = []
    with dir_lock(d):
        for p in owned_files(d):
            if p.name in (MARK, "LOCK"):
                continue
            try:
                p.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                raise TensorstowError(f"--restart: cannot delete {p}: {e.strerror or e}") from None
            gone.append(p)
    return gone


def claim_parent(state_dir) -> Path:
    """The directory of a multi-process run's `rank<K>` state dirs: new, empty or already one (its
    mark), else refused before anything is written (also the state dir of a one-process run);
    every rank claims it, so it is race-free."""
    d = Path(state_dir)
    if (d / PLAN).is_file():
        raise TensorstowError(f"--state-dir {d} holds a one-process run ({d / PLAN}): a run of several processes "
                              f"keeps each rank's state in a rank<K>/ of a directory of its own. Use an empty "
                              f"--state-dir, or execute the plan it holds without --nproc")
    return _take(d, ranks=True)


def rank_dirs(d: Path) -> list[Path]:
    """The `rank<K>` state dirs of a multi-process run in `d`, in rank order."""
    found = [p for p in d.iterdir() if p.is_dir() and RANK_DIR.fullmatch(p.name) and _survey_or_foreign(p) == "state"] if d.is_dir() else []
    return sorted(found, key=lambda p: int(p.name[4:]))


def claim(state_dir, plan: Plan) -> tuple[Path, Plan]:
    """Make `state_dir` the home of `plan`'s training, or check that it already is; returns (the
    directory, the plan it holds: the store's owner). A directory that is neither new nor a
    state dir (nor the directory of a multi-process run's ranks) is refused before anything is
    written in it."""
    ranks = rank_dirs(Path(state_dir))
    if ranks:
        raise TensorstowError(f"--state-dir {state_dir} holds the ranks' state of a run of several processes "
                              f"({ranks[0].name}/ ...): execute the plan it holds ({ranks[0] / PLAN}) with one process "
                              f"a rank (--nproc), or use an empty --state-dir")
    d = _take(Path(state_dir), ranks=False)
    if not (d / PLAN).exists():
        _create_atomic(d / PLAN, plan.dumps())  # two claims at once: one creates it, the other reads it below
    return d, held(d, plan)


def _take(d: Path, ranks: bool) -> Path:
    """`d`, made a state dir (`survey`'s "new" or "state" only): created if missing and marked,
    the mark first of all, so a claim under way is never taken for a directory of the user's."""
    if survey(d, ranks) == "foreign":
        raise _refuse_foreign(d, "wrote")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TensorstowError(f"cannot create the state dir {d}: {e.strerror or e}") from None
    if not (d / MARK).exists():
        _create_atomic(d / MARK, json.dumps({"format": MARK_FORMAT, "version": 1}) + "\n")
    return d


def held(d: Path, plan: Plan) -> Plan:
    """The plan state dir `d` holds, where `plan` trains the same state (they differ at most in
    `RUN_FIELDS_OF_PLAN` and the recorded run); else one error naming what differs. Reads only."""
    path = d / PLAN
    try:
        old = json.loads(path.read_text())
        if not isinstance(old, dict) or not isinstance(old.get("options"), dict):
            raise ValueError("not a plan: no options")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TensorstowError(f"state dir {d}: {PLAN} is unreadable ({e}); it is not a tensorstow state "
                              f"dir, or it was damaged") from None
    new = json.loads(plan.dumps())
    if _state_part(old) != _state_part(new):
        was, now = old.get("options", {}), new.get("options", {})
        opts = [f"{k} {was.get(k)} -> {now.get(k)}" for k in sorted(set(was) | set(now))
                if k not in RUN_FIELDS_OF_PLAN and was.get(k) != now.get(k)]
        raise TensorstowError(
            f"state dir {d} trains another plan ({old.get('model', {}).get('name')}, policy "
            f"{old.get('decisions', {}).get('policy')}"
            + (f"; options {', '.join(opts[:4])}" if opts else "; its decisions or schedule differ") +
            f"): use an empty --state-dir, or execute the plan it holds ({path}); `tensorstow diff {path} PLAN` "
            f"shows every difference")
    return plan if old == new else Plan.load(path)


def _state_part(plan: dict) -> dict:
    """A plan's JSON without the run's inputs (`RUN_FIELDS_OF_PLAN`, the recorded run)."""
    out = {k: v for k, v in plan.items() if k != "run"}
    out["options"] = {k: v for k, v in plan.get("options", {}).items() if k not in RUN_FIELDS_OF_PLAN}
    return out


def describe(d, model, program) -> None:
    """layout.json (what each persistent buffer of `program` holds, by `model`'s own names) and, for
    an `hf:` model, its config.json, in state dir `d`: what `tensorstow export` needs besides the
    store."""
    from tensorstow.ir.hf import CausalLM
    names = {ph: name for name, ph in program.joint.placeholder.items()}
    layouts = {n: program.layouts[n] for n in sorted(program.homes)}
    hf = isinstance(model, CausalLM)
    inner = model.model if hf else model
    peft = None
    if hasattr(inner, "peft_config") and hasattr(inner, "active_adapter"):  # a PEFT model: its adapter's config
        name = inner.active_adapter if isinstance(inner.active_adapter, str) else inner.active_adapter[0]
        peft = (name, inner.peft_config[name].to_dict())
    write_description(Path(d), layouts, names, program.frozen, "model." if hf else "",
                      model.model.config if hf else None, peft)


def write_description(d: Path, layouts: dict, names: dict[str, str], frozen: set[str], prefix: str,
                      hf_config=None, peft=None) -> None:
    """layout.json (and config.json for an `hf:` model; for a PEFT model its adapter_config.json
    and, in the layout, its adapter's name), unless already there. `peft`: (adapter name, its
    config as a dict)."""
    files = {}  # what export copies: written again where missing, damaged or edited, with its digest
    if peft is not None:
        files[ADAPTER_CONFIG] = json.dumps(peft[1], indent=2, sort_keys=True, default=_jsonable) + "\n"
    if hf_config is not None:
        files[CONFIG] = hf_config.to_json_string()
    for file, text in files.items():
        _write_unless_held(d / file, text)
    desc = {"name_prefix": prefix, "buffers": {}, **({"peft_adapter": peft[0]} if peft else {}),
            "files": {file: digest(text) for file, text in files.items()}}
    def name(key: str) -> str:  # a unit's rows of a weight: the weight's name with the rows, `w[0:4]`
        base, rows = member_rows(key)
        return names.get(base, base) if rows is None else rows_member(names.get(base, base), rows)
    for buf, layout in sorted(layouts.items()):
        desc["buffers"][buf] = [
            {"key": s.key, "name": name(s.key), "dtype": str(s.dtype).replace("torch.", ""),
             "shape": list(s.shape), "offset": s.offset, "nbytes": s.nbytes,
             "frozen": member_rows(name(s.key))[0] in frozen}
            for s in layout.slots.values()]
    _write_unless_held(d / LAYOUT, json.dumps(desc, indent=1, sort_keys=True) + "\n")


def _write_unless_held(path: Path, text: str) -> None:
    """`text` into `path` unless it holds it: a missing, damaged or edited description is derived
    from the plan and the model, so written again."""
    try:
        held = path.read_text()
    except (OSError, UnicodeDecodeError):
        held = None
    if held != text:
        write_atomic(path, text)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def described_file(d: Path, layout: dict, file: str) -> dict:
    """The JSON of `file` (config.json, adapter_config.json) in state dir `d`, as `execute` wrote
    it (its digest in the layout), else one error: export must not copy an edited or damaged one."""
    try:
        text = (d / file).read_text()
        want = layout.get("files", {}).get(file)
        if want is not None and digest(text) != want:
            raise ValueError("it differs from what execute wrote: edited or damaged")
        return json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TensorstowError(f"state dir {d}: {file} cannot be used ({e}); run the same `tensorstow execute` "
                              f"command on it again, which writes it anew from the plan and the model") from None


def _jsonable(v):
    """PEFT configs hold sets (target_modules) and enums: as PEFT writes them, a sorted list, a value."""
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    return getattr(v, "value", str(v))


def read(d) -> tuple[Plan, dict]:
    """(plan, layout) of a state dir, with one clear error if it is not one."""
    d = Path(d)
    if not (d / PLAN).is_file() or not (d / LAYOUT).is_file():
        raise TensorstowError(f"{d} is not a tensorstow state dir (no {PLAN} / {LAYOUT}); pass the --state-dir "
                              f"of a `tensorstow execute` run")
    try:
        layout = json.loads((d / LAYOUT).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TensorstowError(f"state dir {d}: {LAYOUT} is unreadable ({e}); it was damaged") from None
    return Plan.load(d / PLAN), layout
