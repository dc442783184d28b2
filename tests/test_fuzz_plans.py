"""Plan files mutated at random (a key deleted, a value replaced by one of another type or range,
two instructions or dependencies swapped): `show` and `execute` either run or print one line
`tensorstow: error: ...` and exit 2; never a traceback or a hang (hypothesis, derandomized, so a
failure reproduces)."""
import copy
import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorstow.cli import main

ROOT = Path(__file__).resolve().parents[1]
BASE = json.loads((ROOT / "plans" / "gpt-tiny__lohan-rtx4090__lohan.json").read_text())


def _paths(d, pre=()):
    """Every key path of the plan, the first few entries of each list."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield pre + (k,)
            yield from _paths(v, pre + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d[:6]):
            yield pre + (i,)
            yield from _paths(v, pre + (i,))


PATHS = list(_paths(BASE))
VALUES = [None, -1, 0, 1, 10 ** 30, 1.5, float("nan"), float("inf"), "", "x", "gpu0", "gpu7", "ssd", "cpu", [], {},
          True, [1, 2], {"a": 1}]


@st.composite
def mutated(draw):
    d = copy.deepcopy(BASE)
    path = draw(st.sampled_from(PATHS))
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    op = draw(st.sampled_from(["delete", "swap", "set"]))
    if op == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    elif op == "swap" and isinstance(parent, list) and len(parent) > 1:
        j = draw(st.integers(0, len(parent) - 1))
        parent[path[-1]], parent[j] = parent[j], parent[path[-1]]
    else:
        parent[path[-1]] = draw(st.sampled_from(VALUES))
    return d


def one_line_or_ran(rc: int, err: str) -> bool:
    return rc == 0 or (rc == 2 and err.startswith("tensorstow: error: ") and err.count("\n") == 1)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(mutated())
def test_show_of_a_mutated_plan_runs_or_says_one_line(tmp_path_factory, capsys, plan):
    path = tmp_path_factory.mktemp("fuzz") / "p.json"
    path.write_text(json.dumps(plan))
    capsys.readouterr()
    rc = main(["show", str(path)])
    err = capsys.readouterr().err
    assert one_line_or_ran(rc, err), err


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(mutated())
def test_execute_of_a_mutated_plan_runs_or_says_one_line(tmp_path_factory, capsys, plan):
    d = tmp_path_factory.mktemp("fuzz")
    (d / "p.json").write_text(json.dumps(plan))
    capsys.readouterr()
    rc = main(["execute", str(d / "p.json"), "--steps", "1", "--state-dir", str(d / "s"), "--hw-mismatch", "ok"])
    err = capsys.readouterr().err
    assert one_line_or_ran(rc, err), err


def test_a_segment_on_a_stream_off_the_gpu_is_one_line(tmp_path, capsys):
    """A compute instruction moved to the SSD's stream: `show` (which places the plan's device arena)
    and `execute` refuse it in one line instead of looking its buffer up."""
    plan = copy.deepcopy(BASE)
    k = next(i for i, ins in enumerate(plan["instructions"]) if ins["kind"] == "compute")
    plan["instructions"][k]["stream"] = "ssd"
    (tmp_path / "p.json").write_text(json.dumps(plan))
    for args in (["show"], ["execute", "--steps", "1", "--state-dir", str(tmp_path / "s")]):
        capsys.readouterr()
        assert main([args[0], str(tmp_path / "p.json"), *args[1:]]) == 2
        assert capsys.readouterr().err == (f"tensorstow: error: plan file {tmp_path / 'p.json'}: instruction {k} (compute) "
                                           f"runs on stream 'ssd': segments run on a GPU's compute stream; re-plan it\n")


def test_a_buffer_of_no_block_is_one_line(tmp_path, capsys):
    """A buffer whose block is gone (the fuzzed case that reached the device arena's bookkeeping)."""
    plan = copy.deepcopy(BASE)
    name = sorted(plan["buffers"])[0]
    plan["buffers"][name]["block"] = ""
    (tmp_path / "p.json").write_text(json.dumps(plan))
    assert main(["show", str(tmp_path / "p.json")]) == 2
    assert capsys.readouterr().err == (f"tensorstow: error: plan file {tmp_path / 'p.json'}: buffer {name} belongs to "
                                       f"block '', which the model does not have; re-plan it\n")
