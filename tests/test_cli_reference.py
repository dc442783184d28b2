"""The command line and `tensorstow.plan` are derived from `Options`: one default per option, a
help text for every argument that shows its default, and docs/cli.md generated from the parser."""
import argparse
import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tensorstow import cli
from tensorstow.errors import TensorstowError
from tensorstow.schema.options import ASKED, Options, asked, field_docs, from_asked

ROOT = Path(__file__).resolve().parents[1]


def commands() -> dict[str, argparse.ArgumentParser]:
    """'tensorstow' and every subcommand's parser, by name."""
    ap = cli.parser()
    (sub,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    return {"tensorstow": ap} | {f"tensorstow {n}": p for n, p in sub.choices.items()}


def test_every_options_field_has_a_docstring():
    docs = field_docs()
    missing = [f.name for f in dataclasses.fields(Options) if not docs.get(f.name)]
    assert not missing, f"Options fields without a docstring: {missing}"
    assert set(ASKED) <= {f.name for f in dataclasses.fields(Options)}


def test_the_precision_choices_are_the_tracers():
    from tensorstow.ir.trace import PRECISIONS
    assert ASKED["precision"].choices == tuple(PRECISIONS)


def undocumented(parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """Every action whose help does not say `(default: ...)` or `(required)` (argparse's own -h
    excepted)."""
    return [f"{name} {'/'.join(a.option_strings) or a.dest}: {a.help!r}"
            for name, p in parsers.items() for a in p._actions
            if not isinstance(a, argparse._HelpAction) and not re.search(r"\((default: .+|required\b.*)\)", a.help or "")]


def test_every_argument_has_help_that_shows_its_default():
    bad = undocumented(commands())
    assert not bad, "arguments whose help does not show their default:\n" + "\n".join(bad)


def test_the_walk_finds_an_argument_without_its_default():
    parsers = commands()
    parsers["tensorstow show"].add_argument("--quiet", action="store_true", help="say less")
    parsers["tensorstow diff"].add_argument("--context", type=int, default=3)
    assert undocumented(parsers) == ["tensorstow show --quiet: 'say less'", "tensorstow diff --context: None"]


def test_a_default_shown_is_the_default_used():
    """Where the help shows a value, argparse uses that value: the help is written from it."""
    for name, p in commands().items():
        for a in p._actions:
            m = re.search(r"\(default: ([^)]+)\)", a.help or "")
            if m and a.default not in (None, False) and not isinstance(a, argparse._SubParsersAction):
                shown = cli._shown(a.default)
                assert m.group(1) == shown, f"{name} {a.dest}: help shows {m.group(1)!r}, default {shown!r}"


def test_plan_flags_and_api_keywords_are_the_options_fields():
    """`tensorstow plan` has one argument per Options field, with the field's default and type;
    `tensorstow.plan`'s signature has one keyword per field (the model is the first argument)."""
    actions = {a.dest: a for a in commands()["tensorstow plan"]._actions}
    for o in asked():
        a = actions[o.name]
        if o.default is dataclasses.MISSING:  # the model: the positional, or the --config recipe's
            assert not a.option_strings and a.nargs == "?"
            continue
        assert a.option_strings == ["--" + o.name.replace("_", "-")]
        assert a.default == o.default, o.name
        assert o.doc in a.help, o.name
    assert actions["hw"].option_strings == ["--hw"] and actions["hw"].default == "local"
    assert actions["gpu_mem"].option_strings == ["--gpu-mem"] and actions["betas"].nargs == 2
    assert actions["exact_optimizer"].const is True and actions["precision"].choices == ["fp32", "bf16-mixed", "fp16-mixed"]
    import tensorstow
    sig = inspect.signature(tensorstow.plan)
    assert list(sig.parameters)[0] == "model_or_spec"
    assert {k: p.default for k, p in list(sig.parameters.items())[1:]} == {
        o.name: o.default for o in asked() if o.default is not dataclasses.MISSING}
    assert "hw='local'" in tensorstow.plan.__doc__ and "lr=0.0001: Learning rate." in tensorstow.plan.__doc__


def test_the_flags_build_the_same_options_as_the_fields_defaults():
    """`tensorstow plan MODEL` with no flags asks for `Options(model=MODEL, hardware="local")`; sizes
    are read as sizes, pairs as tuples."""
    args = cli.parser().parse_args(["plan", "gpt-tiny"])
    assert cli._options(args) == Options(model="gpt-tiny", hardware="local")
    args = cli.parser().parse_args(["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--gpu-mem", "24GB",
                                    "--betas", "0.8", "0.9", "--exact-optimizer", "--growth-factor", "3"])
    o = cli._options(args)
    assert (o.hardware, o.gpu_mem, o.betas, o.exact_optimizer, o.growth_factor) == \
        ("lohan-rtx4090", 24 * 10**9, (0.8, 0.9), True, 3.0)


def test_an_unknown_keyword_is_one_error_naming_it():
    import tensorstow
    with pytest.raises(TensorstowError) as e:
        tensorstow.plan("gpt-tiny", hw="lohan-rtx4090", learning_rate=1e-3)
    msg = str(e.value)
    assert "'learning_rate'" in msg and "\n" not in msg and "lr" in msg and "hw" in msg
    with pytest.raises(TensorstowError, match="'hardware'"):  # the keyword is hw, as the flag is --hw
        from_asked("gpt-tiny", {"hardware": "local"}, "tensorstow.plan")
    assert from_asked("gpt-tiny", {"precision": None, "dram": "2MB"}, "x") == \
        Options(model="gpt-tiny", hardware="local", dram=2 * 10**6)


def test_execute_mode_help_says_what_pick_mode_does():
    (mode,) = [a for a in commands()["tensorstow execute"]._actions if a.dest == "mode"]
    assert "CPU-only" not in mode.help
    assert "SSD traffic" in mode.help and "core" in mode.help


def test_bare_help_says_the_bare_command_runs_the_demo():
    r = subprocess.run([sys.executable, "-m", "tensorstow.cli", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "With no arguments, `tensorstow` runs the built-in demo: it plans gpt-medium" in text


def test_docs_cli_md_is_generated_from_the_parser():
    text = (ROOT / "docs" / "cli.md").read_text()
    assert text == cli.reference_markdown(), f"docs/cli.md is stale: regenerate it with {cli.REFERENCE_FIX}"
    for name in commands():
        if name != "tensorstow":
            assert f"## {name}\n" in text
