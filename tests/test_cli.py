"""The command line: golden plans, show/diff, and one clear line for bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tensorstow.cli import main, parse_size

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tensorstow.cli", *args], capture_output=True,
                          text=True, cwd=cwd or ROOT, timeout=300)


GOLDEN = sorted((ROOT / "plans").glob("*.json"))
TINY = str(ROOT / "plans" / "gpt-tiny__lohan-rtx4090__lohan.json")


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_plan_has_not_drifted(path, capsys, monkeypatch):
    """Each golden plan re-plans to the same bytes (one test per plan, so test workers share them),
    from the repository's root, as `tensorstow check plans` runs (the mixtures of experts' plans
    name their configs `hf:plans/moe/<name>`)."""
    monkeypatch.chdir(ROOT)
    rc = main(["check", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out == f"ok     {path.name}\n"


@pytest.mark.parametrize("name", ["mobius-8b__mobius-3090ti-topo4__mobius.json", "gpt3-13b__lohan-rtx4090__ilp.json"])
def test_golden_plans_do_not_depend_on_how_python_sums_floats(name, monkeypatch, capsys):
    """Guards against goldens that drift with float rounding: Python 3.12's `sum` compensates it,
    and a MIP stopped within its gap can then take another branch (Mobius's objective 3.897 -> 3.881 s).
    With the builtin `sum` of floats made exact, as a stand-in for 3.12's, they re-plan the same."""
    import builtins
    import math
    real = builtins.sum

    def exact(iterable, /, start=0):
        xs = list(iterable)
        if type(start) is int and start == 0 and xs and all(type(x) is float for x in xs):
            return math.fsum(xs)
        return real(xs, start)

    monkeypatch.setattr(builtins, "sum", exact)
    assert main(["check", str(ROOT / "plans" / name)]) == 0, capsys.readouterr().out


def test_check_reads_a_directory_and_prints_only_its_lines(tmp_path):
    """`tensorstow check DIR` in a fresh process: one line per plan. The ILP and Mobius MIP plans
    solve with HiGHS, whose 1.16 prints a banner on a process's first solver unless planner.highs
    silences it. A drifted plan fails with its diff, and a path that is not there is one line."""
    assert len(GOLDEN) >= 4
    for name in ("mobius-8b__mobius-3090ti-topo4__mobius.json", "gpt-tiny__lohan-rtx4090__zero-infinity.json"):
        (tmp_path / name).write_text((ROOT / "plans" / name).read_text())
    r = run("check", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["ok     gpt-tiny__lohan-rtx4090__zero-infinity.json",
                                     "ok     mobius-8b__mobius-3090ti-topo4__mobius.json"]
    assert "HiGHS" not in r.stdout + r.stderr
    drifted = tmp_path / "gpt-tiny__lohan-rtx4090__zero-infinity.json"
    d = json.loads(drifted.read_text())
    d["predicted"]["step_time_s"] += 1.0
    drifted.write_text(json.dumps(d, indent=1))
    r = run("check", drifted)
    assert r.returncode == 1 and r.stdout.startswith("DRIFT  ") and "--update" in r.stdout
    r = run("check", tmp_path / "nope.json")
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "nope.json: no such plan file" in r.stderr


def test_plan_show_diff(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--batch", "2", "--policy", "zero-infinity",
                 "-o", str(a)]) == 0
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--batch", "2", "--policy", "all-gpu", "-o", str(b),
                 "--trace", str(tmp_path / "t.json")]) == 0
    capsys.readouterr()
    assert main(["show", str(a)]) == 0
    out = capsys.readouterr().out
    assert "bottleneck:" in out and "zero-infinity" in out
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "decision policy: zero-infinity -> all-gpu" in out
    assert "predicted step time" in out and "faster" in out
    assert main(["diff", str(a), str(a)]) == 0
    assert capsys.readouterr().out.strip() == "plans are identical"
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert "compute fwd:b0" in names and "mem gpu0" in names


@pytest.mark.parametrize("edit,line", [
    (lambda d: d["eval_instructions"][0].update(est_s=1.0), "eval instructions: 33 -> 33 (1 differ)"),
    (lambda d: d.update(redo_instructions=d["eval_instructions"][:1]), "redo instructions: 0 -> 1"),
    (lambda d: d["pools"]["gpu0"].update(device=2 * d["pools"]["gpu0"]["device"]),
     "pools gpu0 device: 7.2 MB -> 14.4 MB"),
    (lambda d: d["hardware"]["spec"]["dram"].update(bandwidth=1e11), "hardware dram.bandwidth: 3.75424e+11 -> 1e+11"),
], ids=["eval", "redo", "pools", "hardware-spec"])
def test_diff_names_every_part_of_a_plan_that_differs(edit, line, tmp_path, capsys):
    """Plans that differ only in their evaluation or redo program, their arenas or their hardware
    spec's numbers (under the same fingerprint) are not identical: `diff` says what differs, a line
    each, and exits 1 (it called them identical)."""
    d = json.loads(Path(TINY).read_text())
    edit(d)
    (tmp_path / "b.json").write_text(json.dumps(d))
    assert main(["diff", TINY, str(tmp_path / "b.json")]) == 1
    assert capsys.readouterr().out.splitlines() == [line]


def test_show_replays_the_file_as_written(tmp_path, capsys):
    """`show` re-simulates the plan file: a file whose instructions were edited after planning
    no longer gives its own predicted step time, and says so."""
    a, edited = tmp_path / "a.json", tmp_path / "edited.json"
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--policy", "zero-infinity", "-o", str(a)]) == 0
    capsys.readouterr()
    assert main(["show", str(a), "--trace", str(tmp_path / "t.json")]) == 0
    assert "(as predicted)" in capsys.readouterr().out
    assert "compute fwd:b0" in {e["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]}
    d = json.loads(a.read_text())
    slowest = max(d["instructions"], key=lambda i: i["est_s"])
    slowest["est_s"] *= 10
    edited.write_text(json.dumps(d))
    assert main(["show", str(edited)]) == 0
    out = capsys.readouterr().out
    assert f"the file predicts {d['predicted']['step_time_s']:.4g} s" in out and "re-plan it" in out


@pytest.mark.parametrize("args,needle", [
    (["plan", "gpt-nope"], "unknown model 'gpt-nope'"),
    (["plan", "gpt-tiny", "--hw", "no-such-hw"], "unknown hardware 'no-such-hw'"),
    (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--policy", "magic"], "unknown policy 'magic'"),
    (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--gpu-mem", "12XB"], "cannot read size '12XB'"),
    (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--seq", "4096"], "exceeds the model's block_size"),
    # what execute would refuse, plan refuses (it planned them)
    (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--precision", "fp16-mixed", "--init-scale", "0"],
     "--init-scale 0.0 must be a finite number > 0"),
    (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--precision", "fp16-mixed", "--growth-factor", "0.5"],
     "--growth-factor 0.5 must be a finite number > 1"),
    (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--precision", "fp16-mixed", "--backoff-factor", "2"],
     "--backoff-factor 2.0 must be in (0, 1)"),
    (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--microbatches", "-1"], "--microbatches -1 must be >= 1"),
    (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--lora", ""], "--lora '' must name the adapters"),
    (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--ssd-for", "weights,optimizer"],
     "--ssd-for 'weights,optimizer': 'weights' is not what an SSD holds; name some of params, optimizer, activations"),
    (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--param-groups", "*:lr_scale=nan"],
     "lr_scale must be a finite number >= 0, got nan"),
    # an output nobody can write, found before the work (it was found after planning or probing)
    (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "-o", "/no-such-dir/p.json"], "-o /no-such-dir/p.json: cannot write"),
    (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--trace", "/no-such-dir/t.json"], "--trace /no-such-dir/t.json"),
    (["probe", "-o", "/no-such-dir/spec.json"], "-o /no-such-dir/spec.json: cannot write"),
    (["export", "no-state-dir", "-o", "no-out", "--shard-size", "0"], "--shard-size 0 is 0 bytes"),
    (["export", "no-state-dir", "-o", "no-out", "--shard-size", "0.5"], "--shard-size 0.5 is 0 bytes"),
    # a seed torch.manual_seed and the data's generators cannot take (a ValueError or OverflowError)
    (["execute", TINY, "--steps", "1", "--seed", "-1"], "seed -1 is outside [0, 2**63)"),
    (["execute", TINY, "--steps", "1", "--seed", str(10 ** 23)], f"seed {10 ** 23} is outside [0, 2**63)"),
    (["evaluate", TINY, "--state-dir", "no-state-dir", "--data", "synthetic", "--seed", "-1"],
     "seed -1 is outside [0, 2**63)"),
])
def test_bad_input_gives_one_clear_line(args, needle, capsys):
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tensorstow: error:") and needle in lines[0]


@pytest.mark.parametrize("args,needle", [
    (["plan", "gpt-nope"], "unknown model 'gpt-nope'"),
    (["plan", "gpt-tiny", "--policy", "magic"], "unknown policy 'magic'"),
])
def test_bad_options_fail_before_the_machine_is_probed(args, needle, capsys, monkeypatch):
    """Guards against probing before validating: `plan gpt-nope` (on `--hw local`, the default)
    would probe the machine for 14 s before saying the model is unknown, and a busy machine's
    probe warning would come first."""
    from tensorstow import calibrate as probe_mod

    def no_probe(*a, **k):
        raise AssertionError("probed before checking the options")
    monkeypatch.setattr(probe_mod, "probe", no_probe)
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tensorstow: error:") and needle in lines[0]


@pytest.mark.parametrize("source,needle", [
    ('def make():\n    raise RuntimeError("no weights here")\n',
     "the factory raised at {file}:2: RuntimeError: no weights here"),
    ("def make(:\n    pass\n", "does not compile: {file}:1: SyntaxError: "),
    ('import json\nCONFIG = json.loads("{{")\ndef make():\n    pass\n', "raised at {file}:2: JSONDecodeError: "),
], ids=["factory-raises", "syntax-error", "import-raises"])
def test_a_model_factory_that_fails_is_one_line_naming_its_file_and_line(source, needle, tmp_path, monkeypatch,
                                                                         capsys, request):
    """A `module:function` model whose module does not compile, raises as it is imported, or whose
    factory raises: one line naming the user's file and line and the error (they were tracebacks)."""
    name = f"user_model_{request.node.callspec.id.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    assert main(["plan", f"{name}:make", "--hw", "lohan-rtx4090"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tensorstow: error: model '{name}:make': "), lines
    assert needle.format(file=tmp_path / f"{name}.py") in lines[0], lines


def test_error_exit_status_of_the_real_process():
    r = run("plan", "gpt-nope")
    assert r.returncode == 2 and r.stderr.startswith("tensorstow: error: unknown model") and not r.stdout
    # a value of the wrong type (argparse's own refusal): one line too, not the usage first
    r = run("plan", "gpt-tiny", "--batch", "x")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and not r.stdout
    assert r.stderr.startswith("tensorstow: error: tensorstow plan: argument --batch") and "--help" in r.stderr


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not valid JSON"),
    ('{"name": "x"}', "missing required key"),
    ('{"name": "x", "gpus": [{"name": "g", "memory_bytes": -1, "flops": 1, "mem_bw": 1, "h2d_bw": 1, "d2h_bw": 1}],'
     ' "dram": {"capacity_bytes": 1, "bandwidth": 1}, "ssd": {"count": 0, "read_bw": 0, "write_bw": 0,'
     ' "capacity_bytes": 0}, "cpu": {"cores": 1, "adam_rate": 1}}', "field 'gpus[0].memory_bytes': must be >= 0"),
    ('{"name": "x", "bogus": 1}', "unknown key(s) ['bogus']"),
])
def test_malformed_hardware_file(tmp_path, content, needle, capsys):
    f = tmp_path / "hw.json"
    f.write_text(content)
    assert main(["plan", "gpt-tiny", "--hw", str(f)]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("content,needle", [
    ("{trunc", "not valid JSON"),
    ('{"schema_version": 1}', "lacks"),
    ("[1, 2]", "JSON object"),
])
def test_malformed_plan_file(tmp_path, content, needle, capsys):
    f = tmp_path / "p.json"
    f.write_text(content)
    before = f.read_bytes()
    assert main(["show", str(f)]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1
    assert f.read_bytes() == before  # never damages what it read
    assert main(["show", str(tmp_path / "missing.json")]) == 2


def test_parse_size():
    assert parse_size("200MB") == 200 * 10**6
    assert parse_size("1.5GiB") == int(1.5 * 2**30)
    assert parse_size("4096") == 4096


def test_probe_writes_a_spec_and_reports_native_engines(tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["probe", "-o", str(out), "--disk-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "aio:" in err and "adam:" in err  # C++ engine or the fallback, and why
    from tensorstow.planner.presets import load_hardware
    hw = load_hardware(str(out))
    assert hw.name == "local" and hw.gpu.memory_bytes > 0 and hw.cpu.adam_rate > 0


def test_hw_local_plans_for_a_probe_of_this_machine(tmp_path, capsys):
    """`--hw local` (the default) probes this machine: the plan's hardware is the probe's spec
    (guards against resolving "local" as a preset or file name)."""
    out = tmp_path / "p.json"
    assert main(["plan", "gpt-tiny", "--hw", "local", "--policy", "all-gpu", "--precision", "fp32",
                 "-o", str(out)]) == 0, capsys.readouterr().err
    spec = json.loads(out.read_text())["hardware"]["spec"]
    assert spec["name"] == "local" and "tensorstow probe" in spec["source"]


def test_microbatches_are_refused_by_a_policy_that_cannot_accumulate_and_honoured_by_auto(tmp_path, capsys):
    """`--microbatches K` (gradient accumulation) under a one-microbatch policy is one error line,
    never ignored; under auto on one GPU it plans mobius with K microbatches."""
    common = ["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--precision", "fp32", "--microbatches", "2"]
    assert main([*common, "--policy", "lohan", "-o", str(tmp_path / "a.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorstow: error: --microbatches 2: the lohan policy") and err.count("\n") == 1
    assert not (tmp_path / "a.json").exists()
    assert main([*common, "-o", str(tmp_path / "b.json")]) == 0
    d = json.loads((tmp_path / "b.json").read_text())
    assert d["decisions"]["policy"] == "mobius" and d["decisions"]["pipeline"]["microbatches"] == 2


def test_param_groups_from_the_command_line_and_a_recipe(tmp_path, capsys):
    """`--param-groups` takes one or more "PATTERN:key=value,..." groups (as does a recipe's list);
    the plan records them; a malformed group is one error line."""
    common = ["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--policy", "all-gpu", "--precision", "fp32"]
    assert main([*common, "--param-groups", "*.bias:weight_decay=0", "h.0.*:lr_scale=0.3", "-o", str(tmp_path / "a.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["options"]["param_groups"] == ["*.bias:weight_decay=0",
                                                                                      "h.0.*:lr_scale=0.3"]
    recipe = tmp_path / "r.toml"
    recipe.write_text('model = "gpt-tiny"\nparam_groups = ["*.bias:weight_decay=0"]\n')
    assert main(["plan", "--config", str(recipe), "--hw", "lohan-rtx4090", "--policy", "all-gpu", "--precision", "fp32",
                 "-o", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["options"]["param_groups"] == ["*.bias:weight_decay=0"]
    capsys.readouterr()
    assert main([*common, "--param-groups", "*.bias:decay=0", "-o", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorstow: error: param group '*.bias:decay=0'") and err.count("\n") == 1


def test_clipping_is_refused_where_it_is_not_built_and_when_negative(tmp_path, capsys):
    common = ["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--precision", "fp32", "-o", str(tmp_path / "p.json")]
    assert main([*common, "--policy", "mobius", "--microbatches", "2", "--max-grad-norm", "1"]) == 2
    assert capsys.readouterr().err.startswith("tensorstow: error: the mobius policy does not clip gradients")
    assert main([*common, "--max-grad-norm", "-1"]) == 2
    assert capsys.readouterr().err.startswith("tensorstow: error: --max-grad-norm must be >= 0")
    assert not (tmp_path / "p.json").exists()


def test_a_plan_with_an_instruction_dropped_is_one_line_for_show_and_execute(tmp_path, capsys):
    """An edited plan file whose instruction list no longer replays (a load dropped, the ids
    renumbered) is one line in show (the simulator's ScheduleError, which was a traceback) and in
    execute (the instruction that finds nothing to move)."""
    d = json.loads((ROOT / "plans" / "gpt-tiny__lohan-rtx4090__lohan.json").read_text())
    load = next(i for i in d["instructions"] if i["kind"] == "load" and i["tensor"].startswith("P:b1"))
    kept = [i for i in d["instructions"] if i["id"] != load["id"]]
    new_id = {i["id"]: k for k, i in enumerate(kept)}  # renumbered: the file itself stays well formed
    for i in kept:
        i["id"], i["deps"] = new_id[i["id"]], [new_id[k] for k in i["deps"] if k in new_id]
    d["instructions"] = kept
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(d))
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorstow: error: the plan's instructions are inconsistent") and err.count("\n") == 1, err
    assert main(["execute", str(bad), "--hw-mismatch", "ok", "--steps", "1", "--state-dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err  # the executor stops at the instruction that finds nothing to move
    assert err.startswith("tensorstow: error: instruction ") and "P:b1" in err and err.count("\n") == 1, err


def test_a_reader_that_stops_early_gets_no_traceback():
    """`tensorstow check A B | head -1`: the command stops quietly when its reader goes away."""
    tiny = [f"plans/gpt-tiny__lohan-rtx4090__{p}.json" for p in ("all-gpu", "zero-infinity", "lohan")]
    p = subprocess.Popen([sys.executable, "-m", "tensorstow.cli", "check", *tiny], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().startswith("ok ")
        p.stdout.close()
        err = p.stderr.read()
        assert p.wait(timeout=300) == 141
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_the_demo_plans_in_fp32_where_16_bit_matmuls_are_slower_than_fp32(monkeypatch):
    """A CPU without native bf16 runs bf16 matmuls hundreds of times slower than fp32 (the probe's
    `flops` against its `flops_fp32`): the built-in demo plans fp32 there, the default elsewhere."""
    import dataclasses

    from tensorstow import cli
    from tensorstow import calibrate as probe_mod
    from tensorstow.planner.presets import load_hardware
    hw = load_hardware("lohan-rtx4090")
    g = hw.gpus[0]
    for flops, want in ((g.flops_fp32 / 400, ["--precision", "fp32"]), (g.flops_fp32 * 2, [])):
        spec = dataclasses.replace(hw, gpus=(dataclasses.replace(g, flops=flops),))
        monkeypatch.setattr(probe_mod, "probe", lambda spec=spec: spec)
        assert cli._demo_precision() == want


@pytest.mark.parametrize("damage", ["negative-buffer", "huge-buffer", "unknown-model", "deep-json"])
def test_show_refuses_a_plan_execute_could_not_run_in_one_line(damage, tmp_path, capsys):
    """`show` validates a plan file as `execute` does before it replays it: a buffer of negative or
    impossible size, a model nothing can build, JSON nested past Python's recursion limit: one
    line, exit 2 (it used to print a summary and exit 0, or a RecursionError traceback)."""
    path = tmp_path / "p.json"
    if damage == "deep-json":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        d = json.loads((ROOT / "plans" / "gpt-tiny__lohan-rtx4090__lohan.json").read_text())
        if damage == "unknown-model":
            d["options"]["model"] = "no-such-model"
        else:
            name = sorted(d["buffers"])[0]
            d["buffers"][name]["bytes"] = -4096 if damage == "negative-buffer" else 10 ** 18
        path.write_text(json.dumps(d))
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorstow: error: ") and err.count("\n") == 1, err
    assert {"negative-buffer": "bytes, outside", "huge-buffer": "bytes, outside", "unknown-model": "unknown model",
            "deep-json": "nests its JSON"}[damage] in err


def test_a_plan_for_other_hardware_is_refused_unless_asked(tmp_path, capsys):
    """A plan made for an RTX 4090 preset, executed here (a CPU device tier, or another GPU): one
    line naming what differs and the way out (it used to train without a word and print a
    prediction off by 6e4x); with `--hw-mismatch ok` it runs."""
    plan = tmp_path / "p.json"
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--precision", "fp32", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["execute", str(plan), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorstow: error: the plan was made for lohan-rtx4090, not this machine (GPU ")
    assert "--hw-mismatch ok" in err and err.count("\n") == 1
    assert main(["execute", str(plan), "--steps", "1", "--hw-mismatch", "ok"]) == 0


def test_the_summary_leaves_the_policys_search_notes_to_verbose(tmp_path, capsys):
    """`plan` and `show` print the policy's reasons; the notes that trace its search (each MIP round)
    only with -v, and a line says how many were left out."""
    plan = tmp_path / "p.json"
    assert main(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--gpu-mem", "1MB", "--policy", "ilp", "-o", str(plan)]) == 0
    quiet = capsys.readouterr().out
    search = [n for n in json.loads(plan.read_text())["decisions"]["notes"] if n.startswith("search: ")]
    assert any("MIP round" in n for n in search)
    assert "MIP round" not in quiet
    assert f"note: {len(search)} notes on the policy's search left out (-v shows them)" in quiet
    for cmd in (["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--gpu-mem", "1MB", "--policy", "ilp", "-v"],
                ["show", str(plan), "-v"]):
        assert main(cmd) == 0
        loud = capsys.readouterr().out
        assert all(f"note: {n}" in loud for n in search) and "left out (-v shows them)" not in loud


def test_a_lora_key_given_twice_is_refused():
    """`--lora r=8,r=4,...`: the last value won silently."""
    pytest.importorskip("peft")
    from tensorstow.errors import TensorstowError
    from tensorstow.ir.hf import lora_config
    with pytest.raises(TensorstowError, match="'r' is given twice; give each key once"):
        lora_config("r=8,r=4,targets=q_proj")
