"""A state dir that checks itself: the manifest carries its own checksum, the newest valid manifest
wins (and the resume says which), a dir whose committed state cannot be read is refused in one line
until `--restart` starts over deliberately, a missing shadow slot or a damaged layout.json is made
again. Each case trains on and exports the weights eager training gives."""
import errno
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorstow.cli import main
from tests.test_state_dir import COMMON, MODEL, eager_params, execute, exported


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """zero-infinity with its state on SSD."""
    path = tmp_path_factory.mktemp("plan") / "p.json"
    assert main(["plan", MODEL, *COMMON, "--policy", "zero-infinity", "--gpu-mem", "400KB", "-o", str(path)]) == 0
    assert "ssd" in {b["home"] for b in json.loads(path.read_text())["buffers"].values()}
    return path


def assert_eager(state, tmp_path, steps):
    got, want = exported(state, tmp_path / "e"), eager_params(steps)
    assert got.keys() == want.keys() - {"lm_head.weight"}
    assert all(torch.equal(got[n], want[n]) for n in got)


def test_deleted_manifests_are_refused_until_restart(plan, tmp_path, capsys):
    """MANIFEST and MANIFEST.prev deleted: the slot files hold state nothing can read, so execute
    refuses in one line naming --restart (it used to start over and overwrite 3 committed steps
    without a word); `--restart` starts over from step 0 and trains as eager does."""
    s = tmp_path / "s"
    assert execute(plan, s, 3) == 0
    (s / "MANIFEST").unlink()
    (s / "MANIFEST.prev").unlink()
    capsys.readouterr()
    assert execute(plan, s, 4) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorstow: error: ") and err.count("\n") == 1
    assert "no valid manifest" in err and "--restart" in err
    assert len(list(s.glob("*.slot[01]"))) > 0  # nothing was deleted
    (s / "config.json").write_text('{"mine": 1}\n')  # not the state dir's: the model is no hf: model
    (s / "adapter_config.json").write_text('{"mine": 2}\n')
    assert execute(plan, s, 2, "--restart") == 0
    out = capsys.readouterr().out
    assert "resuming" not in out and "step 1/2" in out and "older tensorstow" not in out
    assert (s / "config.json").read_text() == '{"mine": 1}\n' and (s / "adapter_config.json").read_text() == '{"mine": 2}\n'
    assert_eager(s, tmp_path, 2)


@pytest.mark.parametrize("damage", ["edited-step", "empty", "deleted"])
def test_a_damaged_manifest_resumes_from_the_newest_valid_one_and_says_so(damage, plan, tmp_path, capsys):
    """MANIFEST edited ("step": 3 -> 1, which its own checksum catches; it used to be trusted),
    emptied, or deleted: the resume takes MANIFEST.prev, the commit before, says so, and training
    on from there gives eager's weights."""
    s = tmp_path / "s"
    assert execute(plan, s, 3) == 0
    m = s / "MANIFEST"
    if damage == "edited-step":
        d = json.loads(m.read_text())
        assert d["step"] == 3
        m.write_text(json.dumps({**d, "step": 1}, sort_keys=True, indent=1))
    elif damage == "empty":
        m.write_text("")
    else:
        m.unlink()
    capsys.readouterr()
    assert execute(plan, s, 5) == 0
    out = capsys.readouterr().out
    assert "resuming from step 2 committed in" in out and "resumed from MANIFEST.prev (step 2)" in out
    if damage == "edited-step":
        assert "fails its own checksum" in out
    assert_eager(s, tmp_path, 5)


def test_a_missing_shadow_slot_and_a_garbage_layout_are_made_again(plan, tmp_path):
    """A shadow slot file (the one the last commit does not name) deleted, and layout.json
    overwritten with garbage: the resume preallocates the slot again (it used to refuse the dir as
    damaged) and writes the description again from the plan; export reads it."""
    s = tmp_path / "s"
    assert execute(plan, s, 2) == 0
    manifest = json.loads((s / "MANIFEST").read_text())
    name, e = sorted(manifest["buffers"].items())[0]
    shadow = s / e["files"][1 - e["slot"]]
    shadow.unlink()
    (s / "layout.json").write_text("garbage")
    assert execute(plan, s, 4) == 0
    assert shadow.exists() and json.loads((s / "layout.json").read_text())["buffers"]
    assert_eager(s, tmp_path, 4)


KILL_AT = """
import os, signal, sys
from tensorstow.cli import main
from tensorstow.executor.runtime import Runtime
at, seen = int(sys.argv[1]), [0]
dispatch = Runtime.dispatch
def counting(self, ins):
    seen[0] += 1
    if seen[0] == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return dispatch(self, ins)
Runtime.dispatch = counting
sys.exit(main(sys.argv[2:]))
"""


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.integers(1, 4 * 160))
def test_a_sigkill_at_any_instruction_then_a_resume_equals_eager(plan, tmp_path_factory, at):
    """Property: SIGKILL-ed at a random instruction of a random one of its 4 steps (a commit's
    background part included), the same command resumes and the exported weights equal 4 eager
    steps; a run the kill never reached finished as it should."""
    import subprocess
    import sys
    tmp = tmp_path_factory.mktemp("kill")
    args = ["execute", str(plan), "--hw-mismatch", "ok", "--steps", "4", "--state-dir", str(tmp / "s")]
    r = subprocess.run([sys.executable, "-c", KILL_AT, str(at), *args], capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, -9), r.stderr
    assert main(args) == 0
    assert_eager(tmp / "s", tmp, 4)


def test_a_store_of_another_plan_is_refused_even_with_its_plan_json_replaced(plan, tmp_path, capsys):
    """The manifest records the fingerprint of the plan whose state it holds: 2 steps of the plan,
    then its plan.json replaced by another plan with the same buffers (another learning rate), and
    that plan executed: one line (it used to resume the other plan's state silently, since the
    buffers' sizes agree); export refuses likewise."""
    other = tmp_path / "other.json"
    assert main(["plan", MODEL, *[c if c != "1e-3" else "2e-3" for c in COMMON], "--policy", "zero-infinity",
                 "--gpu-mem", "400KB", "-o", str(other)]) == 0
    s = tmp_path / "s"
    assert execute(plan, s, 2) == 0
    assert json.loads((s / "MANIFEST").read_text())["owner"]
    (s / "plan.json").write_text(other.read_text())
    capsys.readouterr()
    assert execute(other, s, 4) == 2
    err = capsys.readouterr().err
    assert "holds the training state of another plan" in err and err.count("\n") == 1
    assert main(["export", str(s), "-o", str(tmp_path / "e")]) == 2
    assert "another plan" in capsys.readouterr().err


def _read_only(monkeypatch, root, err=errno.EROFS):
    """Every call that would create, change or remove something under `root` fails as the kernel
    fails it on a read-only filesystem (or, EACCES, in a directory this user may not write); a
    test running as root cannot make the kernel refuse it with permissions alone."""
    import builtins
    import pathlib
    root = os.path.realpath(root)

    def under(path) -> bool:
        return os.path.realpath(os.fspath(path)).startswith(root)

    def refuse(path):
        raise OSError(err, os.strerror(err), os.fspath(path))

    real_open = os.open

    def fake_open(path, flags, *a, **kw):
        if under(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            refuse(path)
        return real_open(path, flags, *a, **kw)

    def guard(real):
        def call(path, *a, **kw):
            if under(path):
                refuse(path)
            return real(path, *a, **kw)
        return call

    real_builtin_open = builtins.open

    def fake_builtin_open(file, mode="r", *a, **kw):
        if isinstance(file, (str, os.PathLike)) and under(file) and any(c in mode for c in "wax+"):
            refuse(file)
        return real_builtin_open(file, mode, *a, **kw)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(builtins, "open", fake_builtin_open)
    for name in ("replace", "rename", "unlink", "remove", "mkdir"):
        monkeypatch.setattr(os, name, guard(getattr(os, name)))
    real_mkdir = pathlib.Path.mkdir

    def fake_mkdir(self, *a, **kw):
        if under(self) and not self.is_dir():
            refuse(self)
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "mkdir", fake_mkdir)


def test_a_read_only_state_dir_exports_and_refuses_execute_in_one_line(plan, tmp_path, monkeypatch, capsys):
    """A state dir on a read-only filesystem (or one this user may not write): export reads its
    last commit, taking nothing but reads (it needed write access to LOCK, and ran the O_DIRECT
    probe's write), and equals eager; execute stops before any step with one line saying the dir
    is not writable (a permission failure was reported as "refuses O_DIRECT" and a step trained
    before the commit failed)."""
    s = tmp_path / "s"
    assert execute(plan, s, 2) == 0
    before = {p.name: p.stat().st_mtime_ns for p in s.iterdir()}
    _read_only(monkeypatch, s)
    want = eager_params(2)
    got = exported(s, tmp_path / "e")
    assert got.keys() == want.keys() - {"lm_head.weight"} and all(torch.equal(got[n], want[n]) for n in got)
    capsys.readouterr()
    for err in (errno.EROFS, errno.EACCES):
        _read_only(monkeypatch, s, err)
        assert execute(plan, s, 4) == 2
        out, msg = capsys.readouterr()
        assert msg.startswith("tensorstow: error: ") and msg.count("\n") == 1, msg
        assert "cannot write in" in msg and "write access" in msg and "O_DIRECT" not in msg
        assert "step 3/4" not in out
    monkeypatch.undo()
    assert {p.name: p.stat().st_mtime_ns for p in s.iterdir()} == before


def test_a_read_only_store_refuses_writes_commits_and_rollbacks(tmp_path):
    """`SSDStore(read_only=True)` reads the committed state and refuses whatever would change it;
    a directory without a store is refused, not made into one."""
    from tensorstow.errors import TensorstowError
    from tensorstow.executor.ssd import SSDStore
    with SSDStore(tmp_path / "s", {"a": 4096}) as st:
        st.write("a", torch.arange(1024, dtype=torch.float32))
        st.commit(0)
    with SSDStore(tmp_path / "s", {"a": 4096}, read_only=True) as ro:
        out = torch.empty(1024)
        ro.read("a", out)
        assert torch.equal(out, torch.arange(1024, dtype=torch.float32))
        for attempt in (lambda: ro.write("a", out), lambda: ro.commit(1), lambda: ro.rollback()):
            with pytest.raises(TensorstowError, match="open read-only"):
                attempt()
    (tmp_path / "none").mkdir()
    with pytest.raises(TensorstowError, match="holds no store"):
        SSDStore(tmp_path / "none", {"a": 4096}, read_only=True)
    assert {p.name for p in (tmp_path / "none").iterdir()} <= {"LOCK"}  # no store made there
