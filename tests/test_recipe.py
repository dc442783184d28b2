"""One recipe file (TOML) for a whole run: `tensorstow plan --config` takes its plan options and
records its [execute] table in the plan; `tensorstow execute` runs that record; flags override
both; a bad key or value is one error line naming it."""
import json

import pytest

from tensorstow.cli import main

RECIPE = """
model = "gpt-tiny"
hw = "lohan-rtx4090"
policy = "zero-infinity"
precision = "fp32"
batch = 2
seq = 32
gpu-mem = "2MB"
lr = 1e-3
weight_decay = 0.1

[execute]
steps = 3
lr_scheduler = "cosine"
warmup_steps = 1
"""


def write(path, text):
    path.write_text(text)
    return str(path)


def test_plan_takes_the_recipe_and_records_its_execute_table(tmp_path, capsys):
    recipe = write(tmp_path / "r.toml", RECIPE)
    assert main(["plan", "--config", recipe, "--batch", "4", "-o", str(tmp_path / "p.json")]) == 0
    pj = json.loads((tmp_path / "p.json").read_text())
    o = pj["options"]
    assert (o["model"], o["hardware"], o["policy"], o["precision"], o["seq"], o["gpu_mem"], o["lr"]) == \
        ("gpt-tiny", "lohan-rtx4090", "zero-infinity", "fp32", 32, 2_000_000, 1e-3)
    assert o["batch"] == 4  # the flag overrides the recipe
    assert pj["run"] == {"steps": 3, "lr_scheduler": "cosine", "warmup_steps": 1}
    # `diff` names a recorded run option that differs (it called such plans identical)
    other = write(tmp_path / "r2.toml", RECIPE.replace("steps = 3", "steps = 5"))
    assert main(["plan", "--config", other, "--batch", "4", "-o", str(tmp_path / "p2.json")]) == 0
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "p.json"), str(tmp_path / "p2.json")]) == 1
    assert capsys.readouterr().out.strip() == "run option steps: 3 -> 5"


def test_execute_runs_the_plans_recipe_and_flags_override_it(tmp_path, capsys):
    recipe = write(tmp_path / "r.toml", RECIPE)
    plan = str(tmp_path / "p.json")
    assert main(["plan", "--config", recipe, "-o", plan]) == 0
    log = tmp_path / "log.jsonl"
    assert main(["execute", plan, "--hw-mismatch", "ok", "--state-dir", str(tmp_path / "s"), "--log-json", str(log)]) == 0
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # steps = 3 from the plan's recipe
    assert rows[0]["lr"] == 0.0 and rows[1]["lr"] == 1e-3  # one warmup step, then the cosine from the peak
    more = write(tmp_path / "more.toml", "[execute]\nsteps = 5\n")
    longer = ["execute", plan, "--hw-mismatch", "ok", "--config", more, "--state-dir", str(tmp_path / "s"), "--log-json",
              str(log)]
    capsys.readouterr()
    assert main(longer) == 2  # a cosine over 5 steps is another run than the one over 3 begun here
    assert "--steps/--epochs 3 -> 5" in capsys.readouterr().err
    assert main([*longer, "--resume-changed", "length,schedule"]) == 0
    assert "resuming from step 3" in capsys.readouterr().out
    assert main([*longer, "--steps", "6", "--resume-changed", "length"]) == 0  # the flag over the file over the plan
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("text, where", [
    ("batchsize = 2\n" + RECIPE, "unknown plan option(s) ['batchsize']"),
    (RECIPE.replace("batch = 2", 'batch = "two"'), "batch = 'two' is not a valid int"),
    (RECIPE + "stepz = 2\n", "[execute]: unknown key(s) ['stepz']"),
    (RECIPE.replace("steps = 3", 'steps = "3"'), "[execute]: field 'steps': expected an integer"),
    ("model = \"gpt-tiny\"\n[execute\n", "not valid TOML"),
    ("hw = \"lohan-rtx4090\"\n", "name the model"),
    ('betas = ["a", "b"]\n' + RECIPE,
     "betas = ['a', 'b'] is not a valid list of 2 numbers (e.g. betas = [0.9, 0.999])"),
    ("betas = [0.9]\n" + RECIPE, "betas = [0.9] is not a valid list of 2 numbers"),
    ("param_groups = [1, 2]\n" + RECIPE, "param_groups = [1, 2] is not a valid list of strings"),
    (RECIPE + "seed = -1\n", "seed -1 is outside [0, 2**63)"),
])
def test_a_bad_recipe_is_one_line_naming_the_key(text, where, tmp_path, capsys):
    recipe = write(tmp_path / "r.toml", text)
    assert main(["plan", "--config", recipe, "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorstow: error: ") and where in err and err.count("\n") == 1
    assert not (tmp_path / "p.json").exists()


def test_a_flag_given_in_any_form_argparse_reads_overrides_the_recipe(tmp_path):
    """Which options the command line gave is argparse's own reading of it: an abbreviated flag
    (`--weight-dec`) or `--flag=value` overrides the recipe like the full form; a flag left out
    leaves the recipe's value."""
    from tensorstow.cli import given
    recipe = write(tmp_path / "r.toml", RECIPE)
    plan = tmp_path / "p.json"
    assert main(["plan", "--config", recipe, "--weight-dec", "0.2", "--batch=4", "-o", str(plan)]) == 0
    o = json.loads(plan.read_text())["options"]
    assert (o["weight_decay"], o["batch"], o["seq"], o["lr"]) == (0.2, 4, 32, 1e-3)
    assert {"lr_scheduler", "batch"} <= given(["plan", "--config", recipe, "--lr-sch", "linear", "--batch=4"])
    assert not {"seq", "lr"} & given(["plan", "--config", recipe, "--lr-sch", "linear", "--batch=4"])
    assert {"device", "io_engine", "shuffle"} <= given(["execute", str(plan), "--dev", "cpu", "--io-engine=python",
                                                         "--no-shuffle"])
    assert "malloc" not in given(["execute", str(plan), "--dev", "cpu"])
