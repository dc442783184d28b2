"""SSD tier: the async I/O engines (C++ and Python fallback) and the crash-consistent SSDStore.

The kill tests run a child process that writes and commits steps in a loop, SIGKILL it at
random moments (and at chosen points of the commit protocol), then check that the store
resumes at a step the child committed, with exactly that step's bytes (DESIGN.md,
invariant 4).
"""

import errno
import json
import multiprocessing
import os
import random
import runpy
import signal
import textwrap
import threading
import time

import pytest
import torch

from tensorstow import TensorstowError
from tensorstow.executor import aio
from tensorstow.executor.ssd import SSDStore


@pytest.fixture(scope="session")
def cpp_module():
    try:
        return aio.build_extension()
    except RuntimeError as e:
        pytest.skip(f"C++ aio engine unavailable: {e}")


def _engines(cpp_module):
    return {"cpp": cpp_module.Engine(3, 64 << 10, 8), "python": aio.PythonEngine(3, 64 << 10, 8)}


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# ---- engines ----------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False])
def test_engines_write_identical_bytes(tmp_path, cpp_module, direct):
    n = (1 << 20) + 3 * 4096  # several 64 KiB chunks across 3 threads, queue depth 8
    data = aio.aligned_empty(n)
    data.copy_(_random_bytes(n, 7))
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    contents = {}
    for name, engine in _engines(cpp_module).items():
        path = tmp_path / f"{name}.bin"
        fd = os.open(path, flags, 0o644)
        try:
            engine.wait(engine.submit_write(fd, data, 4096))
            back = aio.aligned_empty(n)
            h = engine.submit_read(fd, back, 4096)
            engine.wait(h)
            assert torch.equal(back, data)
        finally:
            os.close(fd)
        contents[name] = path.read_bytes()
    assert contents["cpp"] == contents["python"] == bytes(4096) + data.numpy().tobytes()


@pytest.mark.parametrize("which", ["cpp", "python"])
def test_engine_caller_errors(tmp_path, cpp_module, which):
    engine = _engines(cpp_module)[which]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        buf = aio.aligned_empty(8192)
        with pytest.raises(ValueError, match="O_DIRECT.*4096"):
            engine.submit_write(fd, buf[1:4097], 0)  # unaligned pointer
        with pytest.raises(ValueError, match="O_DIRECT.*4096"):
            engine.submit_write(fd, buf, 512)  # unaligned offset
        with pytest.raises(ValueError, match="contiguous"):
            engine.submit_write(fd, torch.zeros(8, 8).t(), 0)
        with pytest.raises(ValueError, match="unknown handle"):
            engine.wait(12345)
        # Reading past the end of the file: OSError naming the offset.
        engine.wait(engine.submit_write(fd, buf, 0))
        h = engine.submit_read(fd, buf, 4096)
        with pytest.raises(OSError, match="offset 4096.*end of file") as info:
            engine.wait(h)
        assert info.value.errno == errno.EIO
    finally:
        os.close(fd)
    ro = os.open(tmp_path / "f", os.O_RDONLY)
    try:  # errno from the kernel comes through with the offset
        h = engine.submit_write(ro, torch.zeros(100, dtype=torch.uint8), 8192)
        with pytest.raises(OSError, match="pwrite of 100 bytes at file offset 8192") as info:
            engine.wait(h)
        assert info.value.errno == errno.EBADF
    finally:
        os.close(ro)


def test_engine_info_and_aligned_empty():
    assert aio.engine_info().startswith("aio: ")
    for n, dtype in [(0, torch.uint8), (12, torch.float32), (4096 * 3 + 8, torch.float64)]:
        t = aio.aligned_empty(n, dtype)
        assert t.data_ptr() % 4096 == 0 and t.numel() * t.element_size() == n and t.dtype == dtype
    with pytest.raises(ValueError, match="whole number"):
        aio.aligned_empty(6, torch.float32)


def test_huge_empty_is_aligned_moves_through_the_store_and_outlives_its_first_tensor(tmp_path):
    """The DRAM pool's arena (`aio.huge_empty`): a mapping of its own, 2 MiB-aligned, that O_DIRECT
    I/O moves in place, and that stays mapped while any view of it lives."""
    import gc
    for n in (0, 4096, (3 << 20) + 4096):
        t = aio.huge_empty(n)
        assert t.dtype == torch.uint8 and t.numel() == n and t.is_contiguous()
        assert n == 0 or t.data_ptr() % aio.HUGE_PAGE == 0
    arena = aio.huge_empty(3 << 20)
    a, b = arena[: 1 << 20], arena[1 << 20: (1 << 20) + 8192]
    data = _random_bytes(1 << 20, 3)
    a.copy_(data)
    with SSDStore(tmp_path / "s", {"a": 1 << 20}) as store:
        store.write("a", a)
        a.zero_()
        store.read("a", a)
    assert torch.equal(a, data)
    del arena, a
    gc.collect()
    b.fill_(5)  # the mapping is still there while a view of it lives
    assert int(b.sum()) == 5 * 8192


def test_falls_back_to_python_when_the_build_fails(monkeypatch):
    def broken():
        raise RuntimeError("building the C++ aio engine failed: ninja: not found")

    monkeypatch.setattr(aio, "build_extension", broken)
    monkeypatch.setattr(aio, "_default_engine", None)
    monkeypatch.setattr(aio, "_default_info", None)
    assert isinstance(aio.load_engine(), aio.PythonEngine)
    assert "Python fallback engine" in aio.engine_info() and "ninja: not found" in aio.engine_info()
    monkeypatch.setattr(aio, "engine_choice", "cpp")
    with pytest.raises(RuntimeError, match="ninja"):
        aio.load_engine()
    monkeypatch.setattr(aio, "engine_choice", "python")
    monkeypatch.setattr(aio, "build_extension", lambda: pytest.fail("must not build"))
    assert isinstance(aio.load_engine(), aio.PythonEngine)


# ---- store round trips ------------------------------------------------------------------------

SIZES = {"layers.0.w": (1 << 20) + 12, "opt/m": 4096 * 5, "odd": 4097, "one": 1, "empty": 0, "big": (17 << 20) + 4}
DTYPES = {"layers.0.w": torch.float32, "opt/m": torch.bfloat16, "odd": torch.uint8, "one": torch.bool,
          "empty": torch.float16, "big": torch.int32}


def _tensor(name: str, seed: int, aligned: bool) -> torch.Tensor:
    raw = _random_bytes(SIZES[name], seed) if name != "one" else torch.tensor([seed % 2], dtype=torch.uint8)
    dtype = DTYPES[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if SIZES[name] % itemsize:
        dtype = torch.uint8
    if aligned:
        out = aio.aligned_empty(SIZES[name], dtype)
    else:  # deliberately misaligned: a view 64 bytes into a larger allocation
        out = torch.empty(SIZES[name] + 64, dtype=torch.uint8)[64:].view(dtype)
    out.view(torch.uint8).copy_(raw)
    return out


@pytest.mark.parametrize("direct,aligned", [(True, True), (True, False), (False, False)])
def test_round_trip_and_resume(tmp_path, direct, aligned):
    with SSDStore(tmp_path, SIZES, direct=direct) as store:
        assert store.direct == direct, store.io_mode_reason
        assert store.committed_step() is None
        step1 = {k: _tensor(k, 1, aligned) for k in SIZES}
        handles = [store.write_async(k, t) for k, t in step1.items()]
        for h in handles:
            store.wait(h)
        for k, t in step1.items():  # latest version = this step's write, before commit
            out = torch.empty_like(t)
            store.read(k, out)
            assert torch.equal(out.view(torch.uint8), t.view(torch.uint8)), k
        store.commit(1)
        # Step 2 rewrites some buffers, is read back, but never committed.
        step2 = {k: _tensor(k, 2, not aligned) for k in ("layers.0.w", "odd", "big")}
        for k, t in step2.items():
            store.write(k, t)
        for k in SIZES:
            out = torch.empty_like(step1[k])
            store.wait(store.read_async(k, out))
            expect = step2.get(k, step1[k])
            assert torch.equal(out.view(torch.uint8), expect.view(torch.uint8)), k
    with SSDStore(tmp_path, SIZES, direct=direct) as store:  # resume: step 1, not the uncommitted step 2
        assert store.committed_step() == 1
        for k, t in step1.items():
            out = aio.aligned_empty(SIZES[k]) if aligned else torch.empty(SIZES[k], dtype=torch.uint8)
            store.read(k, out)
            assert torch.equal(out, t.view(torch.uint8).reshape(-1)), k
        store.write("odd", step2["odd"])
        store.commit(3)  # only "odd" changes slot; the others keep step 1's slot
    with SSDStore(tmp_path, SIZES, direct=direct) as store:
        assert store.committed_step() == 3
        out = torch.empty(SIZES["odd"], dtype=torch.uint8)
        store.read("odd", out)
        assert torch.equal(out, step2["odd"].view(torch.uint8))
        store.read("layers.0.w", out2 := torch.empty(SIZES["layers.0.w"], dtype=torch.uint8))
        assert torch.equal(out2, step1["layers.0.w"].view(torch.uint8).reshape(-1))


def test_cpp_and_python_store_files_identical(tmp_path, cpp_module):
    data = {k: _tensor(k, 5, aligned=False) for k in SIZES}
    for name, engine in _engines(cpp_module).items():
        with SSDStore(tmp_path / name, SIZES, engine=engine) as store:
            for k, t in data.items():
                store.write(k, t)
            store.commit(5)
    files = sorted(p.name for p in (tmp_path / "cpp").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "python").iterdir())
    for f in files:
        assert (tmp_path / "cpp" / f).read_bytes() == (tmp_path / "python" / f).read_bytes(), f
    engines = _engines(cpp_module)
    for writer, reader in (("cpp", "python"), ("python", "cpp")):
        with SSDStore(tmp_path / writer, SIZES, engine=engines[reader]) as store:
            for k, t in data.items():
                out = torch.empty(SIZES[k], dtype=torch.uint8)
                store.read(k, out)
                assert torch.equal(out, t.view(torch.uint8).reshape(-1))


# ---- clear errors ------------------------------------------------------------------------------


def test_corrupted_block_is_detected(tmp_path):
    sizes = {"w": 3 << 20, "b": 100}
    with SSDStore(tmp_path, sizes) as store:
        store.write("w", _random_bytes(3 << 20, 1))
        store.write("b", _random_bytes(100, 2))
        store.commit(7)
        path = store.committed_path("w")
    with open(path, "r+b") as f:  # flip one byte in the committed slot
        f.seek(2_000_000)
        byte = f.read(1)
        f.seek(2_000_000)
        f.write(bytes([byte[0] ^ 0x40]))
    with SSDStore(tmp_path, sizes) as store:
        out = torch.empty(100, dtype=torch.uint8)
        store.read("b", out)  # the other buffer is fine
        with pytest.raises(TensorstowError, match=rf"buffer 'w' is corrupted in {path}.*committed step 7"):
            store.read("w", torch.empty(3 << 20, dtype=torch.uint8))


def test_manifest_checksums_are_xxh3_and_stores_of_version_1_resume_with_crc32(tmp_path, monkeypatch):
    """New stores record XXH3-64 per 16 MiB block; a store made before (manifest version 1, CRC-32)
    resumes, is still verified with CRC-32 and stays version 1."""
    import zlib

    import xxhash

    from tensorstow.executor import ssd
    data = _random_bytes((16 << 20) + 5, 3)
    blocks = [data[:16 << 20].numpy().tobytes(), data[16 << 20:].numpy().tobytes()]
    with SSDStore(tmp_path / "new", {"w": data.numel()}) as store:
        store.write("w", data)
        store.commit(1)
    m = json.loads((tmp_path / "new" / "MANIFEST").read_text())
    assert (m["version"], m["checksum"]) == (3, "xxh3_64") and m["manifest_xxh3"]
    assert m["buffers"]["w"]["checksums"] == [xxhash.xxh3_64_intdigest(b) for b in blocks]

    with monkeypatch.context() as old:  # a version-1 store, as earlier tensorstow releases wrote it
        old.setattr(ssd, "VERSION", 1)
        with SSDStore(tmp_path / "old", {"w": data.numel()}) as store:
            store.write("w", data)
            store.commit(1)
    m = json.loads((tmp_path / "old" / "MANIFEST").read_text())
    assert m["version"] == 1 and "checksum" not in m
    assert m["buffers"]["w"]["crc32"] == [zlib.crc32(b) for b in blocks]
    with SSDStore(tmp_path / "old", {"w": data.numel()}) as store:
        out = torch.empty_like(data)
        store.read("w", out)
        assert torch.equal(out, data)
        store.write("w", data.flip(0))
        store.commit(2)
        path = store.committed_path("w")
    assert json.loads((tmp_path / "old" / "MANIFEST").read_text())["version"] == 1
    with open(path, "r+b") as f:
        f.write(b"\x00\x01")
    with SSDStore(tmp_path / "old", {"w": data.numel()}) as store:
        with pytest.raises(TensorstowError, match=r"corrupted .*committed step 2; crc32 0x"):
            store.read("w", torch.empty_like(data))


def test_mismatched_plan_and_bad_dirs(tmp_path):
    with SSDStore(tmp_path / "s", {"a": 100, "b": 200}):
        with pytest.raises(TensorstowError, match="is locked by another"):
            SSDStore(tmp_path / "s", {"a": 100, "b": 200})
    with pytest.raises(TensorstowError, match=r"different plan.*sizes differ: 'b' stored 200 B, plan 300 B"):
        SSDStore(tmp_path / "s", {"a": 100, "b": 300})
    with pytest.raises(TensorstowError, match=r"different plan.*not in the store: 'c'.*not in the plan: 'b'"):
        SSDStore(tmp_path / "s", {"a": 100, "c": 200})
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(TensorstowError, match="no MANIFEST but holds other files"):
        SSDStore(tmp_path / "home", {"a": 1})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "MANIFEST").write_text("{trunc")
    with pytest.raises(TensorstowError, match="not a valid tensorstow SSD store manifest"):
        SSDStore(tmp_path / "bad", {"a": 1})
    with SSDStore(tmp_path / "s", {"a": 100, "b": 200}) as store:
        with pytest.raises(TensorstowError, match="no data yet"):
            store.read("a", torch.empty(100, dtype=torch.uint8))
        with pytest.raises(TensorstowError, match="tensor has 99 bytes, the buffer 100"):
            store.write("a", torch.empty(99, dtype=torch.uint8))
        with pytest.raises(TensorstowError, match="unknown buffer 'zz'"):
            store.write("zz", torch.empty(1))


class _GatedEngine(aio.PythonEngine):
    """Records the order its chunks run in; the first write chunk waits for `gate`."""

    def __init__(self, *a):
        super().__init__(*a)
        self.gate, self.busy, self.ran = threading.Event(), threading.Event(), []

    def _run_chunk(self, fd, chunk, offset, write):
        if write and not self.ran and not self.busy.is_set():
            self.busy.set()
            self.gate.wait()
        self.ran.append(("write" if write else "read", offset))
        return aio.PythonEngine._run_chunk(fd, chunk, offset, write)


def test_first_reads_go_before_queued_writes(tmp_path, cpp_module):
    """A read submitted with `first` behind a write-back runs before the write's queued chunks
    (the simulator lets such a read pause the write in progress, planner/simulate.py); other
    reads keep their place in line. The bytes are right in both engines."""
    n = 4 * 4096
    old, new = _random_bytes(n, 1), _random_bytes(3 * 4096, 2)
    engine = _GatedEngine(1, 4096, 16)  # one worker, 4 KiB chunks
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, old.numpy().tobytes(), 0)
        w = engine.submit_write(fd, new, 0)  # 3 chunks: the worker holds the first at the gate
        assert engine.busy.wait(60)
        later, back = torch.empty(4096, dtype=torch.uint8), torch.empty(4096, dtype=torch.uint8)
        r_later = engine.submit_read(fd, later, 2 * 4096)
        r = engine.submit_read(fd, back, 3 * 4096, first=True)
        engine.gate.set()
        for h in (r, w, r_later):
            engine.wait(h)
        assert engine.ran == [("write", 0), ("read", 3 * 4096), ("write", 4096), ("write", 2 * 4096),
                              ("read", 2 * 4096)]
        assert torch.equal(back, old[3 * 4096:]) and torch.equal(later, new[2 * 4096:])
        os.ftruncate(fd, 2 << 20)  # zeros past what the writes below cover
        for name, eng in _engines(cpp_module).items():  # both queues at once: nothing lost or mixed up
            big = _random_bytes(1 << 20, 3)
            w = eng.submit_write(fd, big, 0)
            r = eng.submit_read(fd, back, (1 << 20) + 4096, first=True)
            eng.wait(r)
            eng.wait(w)
            got = torch.empty(1 << 20, dtype=torch.uint8)
            eng.wait(eng.submit_read(fd, got, 0))
            assert torch.equal(got, big) and not back.any(), name
    finally:
        os.close(fd)


class _DiskFullEngine(aio.PythonEngine):
    """Writes half of each chunk, then reports ENOSPC: a torn shadow slot."""

    full = False

    def _run_chunk(self, fd, chunk, offset, write):
        if write and self.full:
            os.pwrite(fd, chunk[: len(chunk) // 2], offset)
            return errno.ENOSPC, f"pwrite of {len(chunk)} bytes at file offset {offset}: No space left on device"
        return aio.PythonEngine._run_chunk(fd, chunk, offset, write)


def test_disk_full_leaves_committed_state(tmp_path, monkeypatch):
    sizes = {"w": 1 << 20, "m": 5000}
    engine = _DiskFullEngine(2, 256 << 10, 4)
    old = {k: _random_bytes(n, 1) for k, n in sizes.items()}
    new = {k: _random_bytes(n, 2) for k, n in sizes.items()}
    with SSDStore(tmp_path, sizes, engine=engine) as store:
        for k, t in old.items():
            store.write(k, t)
        store.commit(1)
        engine.full = True
        with pytest.raises(TensorstowError, match=r"writing buffer 'w' to .*slot0 failed: disk full.*offset"):
            store.write("w", new["w"])
        with pytest.raises(TensorstowError, match=r"cannot commit step 2: the write of 'w' failed.*step 1 is untouched"):
            store.commit(2)
        engine.full = False
        for k, t in new.items():
            store.write(k, t)
        with monkeypatch.context() as m:  # the manifest cannot be written: ENOSPC on rename
            def no_space(*a):
                raise OSError(errno.ENOSPC, "No space left on device")
            m.setattr(os, "replace", no_space)
            with pytest.raises(TensorstowError, match=r"cannot commit step 2: writing .*MANIFEST failed: disk full"):
                store.commit(2)
        assert not (tmp_path / "MANIFEST.tmp").exists()
        assert store.committed_step() == 1
    with SSDStore(tmp_path, sizes) as store:  # a crash now would resume at step 1, intact
        assert store.committed_step() == 1
        for k, t in old.items():
            out = torch.empty_like(t)
            store.read(k, out)
            assert torch.equal(out, t)
    monkeypatch.setattr("tensorstow.executor.manifest.shutil.disk_usage", lambda p: type("U", (), {"free": 10**6})())
    with pytest.raises(TensorstowError, match=r"needs 16.0 MiB more .* only 976.6 KiB is free"):
        SSDStore(tmp_path / "small", {"x": 8 << 20})


@pytest.mark.parametrize("early_sync", [True, False])
def test_a_commit_in_the_background_is_durable_before_anything_overwrites_the_last_one(tmp_path, monkeypatch,
                                                                                     early_sync):
    """commit(wait=False): reads see the step at once; the next write waits for the syncs (run
    early, as the writes complete, or by the commit) and the manifest (it overwrites the files of
    the last durable commit), and so does committed_step()."""
    import threading
    sizes = {"w": 1 << 20, "m": 5000}
    step1 = {k: _random_bytes(n, 1) for k, n in sizes.items()}
    step2 = {k: _random_bytes(n, 2) for k, n in sizes.items()}
    release = threading.Event()
    real_sync = os.fdatasync

    def slow_sync(fd):  # the host's flush, held until the test lets it go
        release.wait()
        real_sync(fd)
    store = SSDStore(tmp_path, sizes, early_sync=early_sync)
    try:
        for k, t in step1.items():
            store.write(k, t)
        store.commit(1)
        monkeypatch.setattr(os, "fdatasync", slow_sync)
        for k, t in step2.items():
            store.write(k, t)
        store.commit(2, wait=False)
        assert json.loads((tmp_path / "MANIFEST").read_text())["step"] == 1  # not durable yet
        for k, t in step2.items():  # reads do not wait
            out = torch.empty_like(t)
            store.read(k, out)
            assert torch.equal(out, t)
        writer = threading.Thread(target=store.write, args=("w", step1["w"]))
        writer.start()
        writer.join(0.2)
        assert writer.is_alive()  # waiting for the commit
        release.set()
        writer.join()
        assert json.loads((tmp_path / "MANIFEST").read_text())["step"] == 2
        assert store.committed_step() == 2
    finally:
        release.set()  # a failed assert must not leave close() waiting for the held syncs
        store.close()
    with SSDStore(tmp_path, sizes) as store:
        assert store.committed_step() == 2
        for k, t in step2.items():
            out = torch.empty_like(t)
            store.read(k, out)
            assert torch.equal(out, t)


def test_wait_background_returns_once_the_early_syncs_and_the_background_commit_are_done(tmp_path, monkeypatch):
    """What a benchmark taking turns with other processes waits for: with the syncs held,
    wait_background blocks; released, it returns with the commit durable and the data intact."""
    import threading
    sizes = {"w": 1 << 20, "m": 5000}
    data = {k: _random_bytes(n, 3) for k, n in sizes.items()}
    release = threading.Event()
    real_datasync, real_fsync = os.fdatasync, os.fsync
    synced = []

    def slow(real):
        def sync(fd):  # the host's flush, held until the test lets it go
            release.wait()
            real(fd)
            synced.append(fd)
        return sync
    store = SSDStore(tmp_path, sizes)
    monkeypatch.setattr(os, "fdatasync", slow(real_datasync))
    monkeypatch.setattr(os, "fsync", slow(real_fsync))
    try:
        for k, t in data.items():
            store.write(k, t)  # each file's early sync starts, held
        waiter = threading.Thread(target=store.wait_background)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and not synced  # waiting for the early syncs
        release.set()
        waiter.join()
        assert len(synced) == len(sizes)  # both written files synced before it returned
        synced.clear()
        release.clear()
        store.commit(1, wait=False)
        waiter = threading.Thread(target=store.wait_background)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and not synced  # the commit's manifest and directory syncs are held
        release.set()
        waiter.join()
        assert synced  # its syncs ran before it returned
        assert json.loads((tmp_path / "MANIFEST").read_text())["step"] == 1
        for k, t in data.items():
            out = torch.empty_like(t)
            store.read(k, out)
            assert torch.equal(out, t)
    finally:
        release.set()
        store.close()


@pytest.mark.parametrize("early_sync", [True, False])
def test_a_commit_that_fails_in_the_background_stops_the_store_and_keeps_the_last_one(tmp_path, monkeypatch,
                                                                                     early_sync):
    """The written files' syncs fail (EIO): run early, as each write completes, or by the commit;
    either way the background commit fails and the last durable one stays."""
    sizes = {"w": 1 << 20, "m": 5000}
    step1 = {k: _random_bytes(n, 1) for k, n in sizes.items()}
    with SSDStore(tmp_path, sizes, early_sync=early_sync) as store:
        for k, t in step1.items():
            store.write(k, t)
        store.commit(1)

        def failing_sync(fd):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(os, "fdatasync", failing_sync)
        for k, n in sizes.items():
            store.write(k, _random_bytes(n, 2))
        store.commit(2, wait=False)
        for _ in range(2):  # every later write refuses, not only the first
            with pytest.raises(TensorstowError, match=r"cannot commit step 2: syncing .* failed.*step 1 is untouched"
                                                      r".*in the background.*resume from the committed step"):
                store.write("w", step1["w"])
        with pytest.raises(TensorstowError, match="in the background"):
            store.commit(3)
        monkeypatch.undo()
    with SSDStore(tmp_path, sizes) as store:  # resumes at step 1, intact
        assert store.committed_step() == 1
        for k, t in step1.items():
            out = torch.empty_like(t)
            store.read(k, out)
            assert torch.equal(out, t)


def test_each_written_file_is_synced_as_its_write_completes_and_the_commit_waits_for_it(tmp_path, monkeypatch):
    """Guards against a commit that syncs every file the step wrote at its end, in the background,
    where the next step's first read queues behind that flush (53 ms of a 0.38 s gpt-small step on a
    2-core CPU VM). The store syncs each shadow slot on its own thread once the write completes; the
    commit syncs nothing itself, waits for those syncs, and what it commits reads back after a
    reopen. A buffer written twice in a step is synced after its last write."""
    import threading
    real_sync = os.fdatasync
    synced = []  # (thread name, fd) of every fdatasync

    def recording_sync(fd):
        real_sync(fd)
        synced.append((threading.current_thread().name, fd))
    monkeypatch.setattr(os, "fdatasync", recording_sync)
    sizes = {"w": 1 << 20, "m": 5000, "untouched": 4096}
    data = {k: _random_bytes(n, 3) for k, n in sizes.items()}
    with SSDStore(tmp_path, sizes) as store:
        for k, t in data.items():
            store.write(k, t)
        store.commit(1)
        synced.clear()
        w2, m2 = _random_bytes(sizes["w"], 4), _random_bytes(sizes["m"], 5)
        store.write("w", _random_bytes(sizes["w"], 6))
        store.write("w", w2)
        store.write("m", m2)
        store.commit(2)
        shadow = {k: store._bufs[k].fds[store._bufs[k].slot] for k in ("w", "m")}  # the slots step 2 wrote
        assert {t for t, _ in synced} == {"tensorstow-sync_0"}  # none on the committing thread
        assert {fd for _, fd in synced} == set(shadow.values())
        assert store.early_sync_s > 0
    with SSDStore(tmp_path, sizes) as store:
        assert store.committed_step() == 2
        for k, want in (("w", w2), ("m", m2), ("untouched", data["untouched"])):
            out = torch.empty_like(want)
            store.read(k, out)
            assert torch.equal(out, want)
    synced.clear()
    with SSDStore(tmp_path, sizes, early_sync=False) as store:  # off: the commit syncs them itself
        store.write("m", data["m"])
        store.commit(3)
        assert [t for t, _ in synced] == [threading.current_thread().name] and store.early_sync_s == 0


# ---- kill tests -------------------------------------------------------------------------------
# Children are forked from a forkserver that has imported torch once, so a child starts in
# milliseconds. Each appends a step to its progress file after commit(step) returned.

CHILD = textwrap.dedent(
    """
    import os, signal
    import torch
    from tensorstow.executor.ssd import SSDStore

    SIZES = {"w0": (6 << 20) + 123, "w1": 3 << 20, "opt.m": (4 << 20) + 4095, "tiny": 10}

    def data(step, i):
        g = torch.Generator().manual_seed(step * 1000 + i)
        return torch.randint(0, 256, (SIZES[list(SIZES)[i]],), dtype=torch.uint8, generator=g)

    def writes(step, i):  # step k writes buffer i unless (k + i) % 3 == 0; step 1 writes all
        return step == 1 or (step + i) % 3 != 0

    if __name__ == "__main__":
        directory, progress, crash_step, crash_point = ARGS
        die = lambda: os.kill(os.getpid(), signal.SIGKILL)
        store = SSDStore(directory, SIZES)
        step = (store.committed_step() or 0) + 1
        while True:
            if step == crash_step and crash_point == "before_replace":
                os.replace = lambda *a: die()
            if step == crash_step and crash_point == "after_replace":  # the new manifest is in place
                real = os.replace
                os.replace = lambda a, b: (real(a, b), die() if str(b).endswith("MANIFEST") else None)
            if step == crash_step and crash_point == "between_renames":  # MANIFEST went to MANIFEST.prev
                real = os.replace
                os.replace = lambda a, b: (real(a, b), die() if str(b).endswith("MANIFEST.prev") else None)
            for i, name in enumerate(SIZES):
                if writes(step, i):
                    store.write_async(name, data(step, i))
                    if step == crash_step and crash_point == "mid_step":
                        die()
            store.commit(step)  # waits for the writes
            with open(progress, "a") as f:
                f.write(f"{step}\\n")
            step += 1
    """
)


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """(path of the child script, its namespace, a forkserver context with torch preloaded)."""
    path = tmp_path_factory.mktemp("child") / "child.py"
    path.write_text(CHILD)
    namespace = {"__name__": "child"}
    exec(compile(CHILD, str(path), "exec"), namespace)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensorstow.executor.ssd"])
    return path, namespace, ctx


def _start(child, directory, crash_step=-1, crash_point="none"):
    path, _, ctx = child
    progress = f"{directory}.progress"
    args = (str(directory), progress, crash_step, crash_point)
    proc = ctx.Process(target=runpy.run_path, args=(str(path),),
                       kwargs={"init_globals": {"ARGS": args}, "run_name": "__main__"})
    proc.start()
    return proc, progress


def _steps(progress) -> list[int]:
    try:
        text = open(progress).read()
    except FileNotFoundError:
        return []
    return [int(line) for line in text.split("\n")[:-1]]  # complete lines only


def _check_store(directory, child, low, high):
    """The store resumes at a step in [low, high] with exactly the bytes that step left behind."""
    sizes, data, writes = child[1]["SIZES"], child[1]["data"], child[1]["writes"]
    with SSDStore(directory, sizes) as store:
        step = store.committed_step()
        assert step is not None and low <= step <= high, (step, low, high)
        for i, name in enumerate(sizes):
            last = max(s for s in range(1, step + 1) if writes(s, i))
            out = torch.empty(sizes[name], dtype=torch.uint8)
            store.read(name, out)
            assert torch.equal(out, data(last, i)), (name, step, last)
    return step


def test_sigkill_at_random_points_keeps_last_commit(tmp_path, child):
    store_dir = tmp_path / "store"
    rng = random.Random(int(os.environ.get("TENSORSTOW_KILL_SEED", "20261121")))
    committed = 0
    for kill in range(8):  # each run resumes from the previous run's committed step
        proc, progress = _start(child, store_dir)
        try:
            # wait (however slow the machine) until it is in its write/commit loop
            while len(_steps(progress)) <= committed:
                assert proc.is_alive(), f"child exited with {proc.exitcode}"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.25))
        finally:  # never leave a child behind, whatever failed
            proc.kill()
            proc.join()
        assert proc.exitcode == -signal.SIGKILL
        steps = _steps(progress)
        assert steps == list(range(1, steps[-1] + 1))  # each run resumed right after the committed step
        # commit() returned for steps[-1], so it is durable; steps[-1] + 1 may have landed too.
        committed = _check_store(store_dir, child, steps[-1], steps[-1] + 1)
        if committed > steps[-1]:  # record the step the child committed but could not report
            with open(progress, "a") as f:
                f.write(f"{committed}\n")


def test_sigkill_inside_commit_protocol(tmp_path, child):
    # crash point -> step that survives (a commit renames MANIFEST to MANIFEST.prev, for rollback,
    # then the new manifest over MANIFEST; between the two the previous manifest stands)
    points = {"mid_step": 2, "before_replace": 2, "between_renames": 2, "after_replace": 3}
    procs = {p: _start(child, tmp_path / p, crash_step=3, crash_point=p) for p in points}
    try:
        for proc, _ in procs.values():
            proc.join()  # each kills itself at its crash point
    finally:
        for proc, _ in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join()
    for point, (proc, progress) in procs.items():
        assert proc.exitcode == -signal.SIGKILL, point
        assert _steps(progress) == [1, 2], point
        assert _check_store(tmp_path / point, child, points[point], points[point]) == points[point], point
        # the check only read the store: a MANIFEST the crash left missing is put back by the first
        # write or commit, so MANIFEST.prev still stands for it
        standing = next(p for p in (tmp_path / point / "MANIFEST", tmp_path / point / "MANIFEST.prev") if p.exists())
        assert json.loads(standing.read_text())["step"] == points[point], point


def test_transient_buffers_are_neither_synced_nor_committed(tmp_path, monkeypatch):
    """A buffer marked transient (a step's swapped activations) reads back what the step wrote, but
    no early sync or commit flushes it and the commit leaves it out: after the commit, and after a
    resume, it holds no data until written; durable buffers are committed as before."""
    sizes = {"w": 1 << 20, "a": 3 << 20}
    data = {k: _random_bytes(n, 4) for k, n in sizes.items()}
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    with SSDStore(tmp_path, sizes) as store:
        with pytest.raises(TensorstowError, match="no buffer 'x' to mark transient"):
            store.set_transient(["x"])
        store.set_transient(["a"])
        for k, t in data.items():
            store.write(k, t)
        out = torch.empty_like(data["a"])
        store.read("a", out)
        assert torch.equal(out, data["a"])
        store.commit(1)
        a_fds = set(store._bufs["a"].fds)
        assert synced and not a_fds & set(synced)
        assert set(store._bufs["w"].fds) & set(synced)
        with pytest.raises(TensorstowError, match="has no data yet"):
            store.read("a", out)
        store.write("a", data["a"])  # the next step swaps again
        store.read("a", out)
        assert torch.equal(out, data["a"])
    with SSDStore(tmp_path, sizes) as store:
        assert store.committed_step() == 1
        out = torch.empty_like(data["w"])
        store.read("w", out)
        assert torch.equal(out, data["w"])
        with pytest.raises(TensorstowError, match="has no data yet"):
            store.read("a", torch.empty_like(data["a"]))


def test_a_store_dropped_during_its_background_commit_closes_quietly(tmp_path, monkeypatch):
    """An executor left unclosed drops its store while the background commit runs: the commit's
    thread then holds the last reference, and the store closes on it (`__del__`), which must not
    try to join that very thread."""
    import sys
    errors = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: errors.append(u.exc_value))
    real = SSDStore._sync_and_record

    def sync_and_record(self, *args):
        time.sleep(0.2)  # the caller lets go of the store meanwhile
        return real(self, *args)

    monkeypatch.setattr(SSDStore, "_sync_and_record", sync_and_record)
    store = SSDStore(tmp_path, {"a": 4096})
    store.write("a", torch.ones(1024))
    store.commit(1, wait=False)
    thread = store._durable
    del store  # the commit's thread keeps the store alive until it ends
    thread.join()
    import gc
    gc.collect()
    assert errors == []
    assert SSDStore(tmp_path, {"a": 4096}).committed_step() == 1  # committed, and the lock released


def test_an_open_that_writes_nothing_leaves_a_crashed_store_as_it_was(tmp_path):
    """A kill between a commit's two renames leaves MANIFEST.prev alone: an open resumes from it and,
    until it writes, changes no file (a resume refused before any step leaves the directory as it
    found it); its first commit puts the manifests right."""
    d = tmp_path / "s"
    with SSDStore(d, {"a": 4096}) as st:
        for step in (1, 2):
            st.write("a", torch.full((1024,), float(step)))
            st.commit(step)
    os.replace(d / "MANIFEST", d / "MANIFEST.prev")  # step 2's manifest moved aside, the new one never renamed in
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.name != "LOCK"}
    with SSDStore(d, {"a": 4096}) as st:
        assert st.committed_step() == 2 and "resumed from MANIFEST.prev" in st.recovered
        out = torch.empty(1024)
        st.read("a", out)
        assert torch.equal(out, torch.full((1024,), 2.0))
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.name != "LOCK"} == before
    with SSDStore(d, {"a": 4096}) as st:
        st.write("a", torch.full((1024,), 3.0))
        st.commit(3)
    assert json.loads((d / "MANIFEST").read_text())["step"] == 3
    assert json.loads((d / "MANIFEST.prev").read_text())["step"] == 2
