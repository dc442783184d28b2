"""`tensorstow.calibrate`: measures this machine into a Hardware spec."""
from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from tensorstow import TensorstowError
from tensorstow import calibrate as probe_mod
from tensorstow.schema.hardware import GB, Hardware
from tensorstow.calibrate import CPU_GPU_NAME, probe

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One quick probe shared by the tests below: (Hardware, disk dir, wall seconds)."""
    d = tmp_path_factory.mktemp("probe_disk")
    probe_mod.clear_cache()
    t = time.perf_counter()
    hw = probe(disk_dir=str(d), quick=True)
    return hw, d, time.perf_counter() - t


def test_returns_local_hardware_with_plausible_numbers(measured):
    hw, _, _ = measured
    assert isinstance(hw, Hardware)
    assert hw.name == "local"
    assert len(hw.gpus) >= 1
    for g in hw.gpus:
        assert g.memory_bytes > 0
        assert g.flops > 1e8
        assert g.mem_bw > 1e8
        assert g.h2d_bw > 1e7 and g.d2h_bw > 1e7
    assert 0 < hw.dram.capacity_bytes < 1 << 50
    assert hw.dram.bandwidth > 1e8
    assert hw.ssd.count == 1
    assert hw.ssd.read_bw > 1e6 and hw.ssd.write_bw > 1e6
    assert hw.ssd.capacity_bytes > 0
    # Nobody's disk is faster than 100 GB/s; a number above that means we timed the page cache
    # or mis-sized the transfer.
    assert hw.ssd.read_bw < 100 * GB and hw.ssd.write_bw < 100 * GB
    assert hw.cpu.cores == os.cpu_count()
    assert hw.cpu.adam_rate > 1e5
    if not HAS_CUDA:  # data-parallel ranks on the CPU reduce and gather through gloo
        assert hw.cpu.gloo_bw > 0 and hw.cpu.gloo_gather_bw > 0 and hw.cpu.gloo_step_s > 0
        assert "gloo between 2 processes" in hw.source
    assert hw.source.startswith("tensorstow probe")
    assert "SSD:" in hw.source and "AdamW" in hw.source


@pytest.mark.skipif(HAS_CUDA, reason="the CPU device tier is probed only without CUDA")
def test_the_cpu_tier_prices_matmuls_and_attention_at_both_precisions(measured):
    """Without CUDA the device tier carries matmul and attention rate curves in bf16 and fp32
    (ascending FLOPs, positive rates) and the bandwidth its other ops reach, at most a memcpy's."""
    g = measured[0].gpus[0]
    for curve in (g.matmul_rates, g.matmul_rates_fp32, g.attention_rates, g.attention_rates_fp32, g.grouped_mm_rates,
                  g.grouped_mm_rates_fp32, g.grouped_mm_wgrad_rates, g.grouped_mm_wgrad_rates_fp32):
        assert curve and all(r > 0 for _, r in curve)
        assert [f for f, _ in curve] == sorted({f for f, _ in curve})
    rows = [r for r, _ in g.grouped_mm_rates_fp32]  # the smallest always, larger ones where they are quick
    assert rows == [r for r, _ in g.grouped_mm_wgrad_rates_fp32] == list(probe_mod.CPU_GROUPED_ROWS[:len(rows)])
    assert 0 < g.elementwise_bw <= g.mem_bw
    # the share of the 512-token rate at fewer tokens: every probed row count, the last one itself
    assert [r for r, _ in g.matmul_row_factors] == list(map(float, probe_mod.CPU_ROWS))
    assert g.matmul_row_factors[-1] == (float(probe_mod.CPU_ROWS_FULL), 1.0)
    assert all(f > 0 for _, f in g.matmul_row_factors) and "matmul_row_factors" in measured[0].source
    assert "matmul_rates[_fp32]" in measured[0].source and "elementwise_bw" in measured[0].source
    assert "grouped_mm[_wgrad]_rates[_fp32]" in measured[0].source


def test_quick_probe_says_how_long_it_took(measured):
    # ~12 s on a 2-core CPU VM (plus a one-time ~1.5 s torch import on the first optimizer
    # step); no bound asserted: a loaded machine takes longer
    hw, _, seconds = measured
    assert seconds > 0 and "(quick, torch" in hw.source


def test_json_round_trip(measured):
    hw, _, _ = measured
    d = json.loads(json.dumps(hw.to_json()))
    back = Hardware.from_json(d)
    assert back == hw
    assert back.fingerprint() == hw.fingerprint()


def test_no_temp_files_left_behind(measured):
    _, d, _ = measured
    assert list(d.iterdir()) == []


def test_cached_per_process(measured):
    """Compares two calls of its own and times nothing: comparing with the fixture's result, or
    timing the call (< 0.1 s), would fail whenever a test that clears the cache runs in between
    (test order, xdist), and on a loaded machine."""
    _, d, _ = measured
    first = probe(disk_dir=str(d), quick=True)  # the fixture's, unless a test cleared the cache since
    assert probe(disk_dir=str(d), quick=True) is first


def test_missing_disk_dir_is_a_user_error(tmp_path):
    with pytest.raises(TensorstowError, match="not an existing directory"):
        probe(disk_dir=str(tmp_path / "nope"))


def test_no_gpu_path(measured):
    if HAS_CUDA:
        pytest.skip("CUDA is available: the pseudo-GPU path is not taken on this machine")
    hw, _, _ = measured
    (g,) = hw.gpus
    assert g.name == CPU_GPU_NAME
    total = probe_mod._meminfo()["total"]
    assert g.memory_bytes == total // probe_mod.CPU_GPU_FRACTION
    # CPU memory is shared between the pseudo-device tier and DRAM: not counted twice.
    assert hw.dram.capacity_bytes + g.memory_bytes <= total
    assert g.h2d_bw == g.d2h_bw
    assert hw.gpu_p2p_bw == 0.0
    assert "no CUDA" in hw.source
    # measured costs are positive and finite; how large depends on the machine's load, never asserted
    # the executor's per-op dispatch (the segment runner, torch's dispatcher)
    assert 0 < g.op_s < math.inf and "op_s = the executor's segment runner" in hw.source
    # 16-bit matmuls at this CPU's own bf16 rate (no faster than fp32; far slower without native bf16)
    assert 0 < g.flops <= g.flops_fp32 and "bf16" in hw.source
    # the executor's stores: per tensor of a DRAM <-> device copy, per SSD read or write
    assert 0 < g.copy_tensor_s < math.inf and "copy_tensor_s = the executor's stores" in hw.source
    # the executor's CPU update: per tensor, besides its elements
    assert 0 < hw.cpu.adam_tensor_s < math.inf and "adam_tensor_s = the executor's update" in hw.source
    # computing beside a copy loop: slower or the same (a stretch, never a speed-up)
    assert 0 <= g.host_contention < math.inf and "host_contention = that block beside" in hw.source
    assert 0 <= g.ssd_contention < math.inf and "ssd_contention = the same beside verified" in hw.source
    assert 0 < hw.ssd.request_s < math.inf and "one at a time" in hw.source and "fitted as request_s" in hw.source
    # the store's commit that ends a step: fixed, per written file, per written byte (flush_bw 0:
    # nothing left to flush, when the host had written the bytes back before the commit's sync,
    # as it now and then has on a loaded machine)
    assert 0 <= hw.ssd.commit_s < 10 and 0 <= hw.ssd.sync_s < 10 and hw.ssd.flush_bw >= 0
    assert "a commit" in hw.source and "through the executor's store" in hw.source


def test_gpu_path(measured):
    if not HAS_CUDA:
        pytest.skip("no CUDA on this machine: GPU measurements cannot be checked")
    hw, _, _ = measured
    assert len(hw.gpus) == torch.cuda.device_count()
    for i, g in enumerate(hw.gpus):
        assert g.name == torch.cuda.get_device_properties(i).name
        assert g.memory_bytes == torch.cuda.get_device_properties(i).total_memory
        assert g.flops > 1e12          # any CUDA GPU of the last decade at bf16/fp16
        assert g.h2d_bw > 1e9 and g.d2h_bw > 1e9   # pinned copies over PCIe/NVLink-C2C
        assert g.mem_bw > g.h2d_bw


def test_disk_fallback_without_o_direct(tmp_path, monkeypatch):
    """Where O_DIRECT is refused (EINVAL on tmpfs & co.) the probe uses buffered I/O and says so."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this OS: the fallback is the only path")
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(probe_mod.os, "open", refusing_open)
    r = probe_mod._disk_bw(str(tmp_path), 8 * 2**20, 2**20, 2)
    assert r.method.startswith("buffered")  # the executor's store falls back the same way
    assert "Invalid argument" in r.method
    assert r.read_bw > 1e6 and r.write_bw > 1e6
    assert list(tmp_path.iterdir()) == []


def test_disk_temp_dir_removed_on_error(tmp_path, monkeypatch):
    def failing_fsync(fd):
        raise OSError(errno.EIO, "simulated I/O error")

    monkeypatch.setattr(probe_mod.os, "fsync", failing_fsync)
    with pytest.raises((OSError, TensorstowError), match="simulated"):
        probe_mod._disk_bw(str(tmp_path), 2**20, 2**20, 1)
    assert list(tmp_path.iterdir()) == []


def test_disk_direct_io_where_supported(tmp_path):
    r = probe_mod._disk_bw(str(tmp_path), 4 * 2**20, 2**20, 2)
    assert r.method == "O_DIRECT" or r.method.startswith("buffered")
    assert r.read_bw > 1e6 and r.write_bw > 1e6
    assert list(tmp_path.iterdir()) == []


def test_request_fit_recovers_a_fixed_cost_and_a_rate_and_survives_noise():
    sizes = [2**18, 2**20, 2**22, 2**24]
    fixed, bw = probe_mod._fit_requests(sizes, [5e-4 + n / 2e9 for n in sizes])
    assert fixed == pytest.approx(5e-4) and bw == pytest.approx(2e9)
    # noise that tilts the line below zero at the origin: no fixed cost, the largest request's rate
    assert probe_mod._fit_requests(sizes, [1e-4, 4e-4, 2e-3, 9e-3]) == (0.0, pytest.approx(2**24 / 9e-3))
    assert probe_mod._fit_requests([2**20], [1e-3]) == (0.0, pytest.approx(2**20 / 1e-3))


def test_extension_cache_is_keyed_by_the_source(tmp_path, monkeypatch):
    """Different C++ sources build into different directories, one source into the same one each
    time; the same source at another path (another checkout) and another venv build their own (a
    build records its source's and its environment's paths: sharing one directory, each rebuilt
    it for itself, 35 s a first step)."""
    from tensorstow.executor import aio
    monkeypatch.setenv("TENSORSTOW_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int f() { return 1; }\n")
    b.write_text("int f() { return 2; }\n")
    assert aio.ext_cache_dir("x", a) != aio.ext_cache_dir("x", b)
    assert aio.ext_cache_dir("x", a) == aio.ext_cache_dir("x", tmp_path / "." / "a.cpp")
    b.write_text(a.read_text())
    assert aio.ext_cache_dir("x", a) != aio.ext_cache_dir("x", b)
    assert str(aio.cache_dir()).startswith(str(tmp_path / "cache"))
    here = aio.ext_cache_dir("x", a)
    monkeypatch.setattr("sys.prefix", str(tmp_path / "other-venv"))  # another environment: its own build
    assert aio.ext_cache_dir("x", a) != here


def test_a_builder_killed_mid_build_does_not_wedge_later_builds():
    """Guards against a wedged build: torch's build lock (before 2.14) is a file only a finishing
    builder removes, so one killed mid-build would make every later `load_engine` wait forever. A
    builder that dies holding that lock leaves nothing the next ones wait on. (torch 2.14 holds an flock on
    the same file instead, which outlives no builder; the file itself stays.)"""
    import signal
    import subprocess
    from tensorstow.executor import aio
    build_dir = aio.cache_dir()
    # a builder of torch before 2.14, killed holding its lock file: it takes the lock as
    # `compile_extension` does, under the sidecar flock (so it waits for a live builder elsewhere,
    # another test worker's cold build, rather than finding that builder's lock taken)
    dead_builder = ("import fcntl, os, signal; from torch.utils.file_baton import FileBaton; "
                    f"held = open({str(build_dir / 'build.flock')!r}, 'a'); fcntl.flock(held, fcntl.LOCK_EX); "
                    f"lock = {str(build_dir / 'lock')!r}; os.path.exists(lock) and os.unlink(lock); "
                    "assert FileBaton(lock).try_acquire(); os.kill(os.getpid(), signal.SIGKILL)")
    build_dir.mkdir(parents=True, exist_ok=True)
    load = ["-c", "from tensorstow.executor import aio; aio.load_engine(); print(aio.engine_info())"]
    try:
        killed = subprocess.run([sys.executable, "-c", dead_builder], capture_output=True)
        assert killed.returncode == -signal.SIGKILL and (build_dir / "lock").exists()
        # the timeout only guards against the old hang; a cold build takes ~1 min
        for _ in range(2):  # and what the first load leaves does not stop the next
            after = subprocess.run([sys.executable, *load], capture_output=True, text=True, timeout=900)
            assert after.returncode == 0, after.stderr[-2000:]
            assert "C++" in after.stdout or "building the C++ aio engine" in after.stdout
    finally:
        (build_dir / "lock").unlink(missing_ok=True)


def _fake_measurements(monkeypatch, tmp_path, calls: list) -> None:
    """Every measurement of a no-CUDA probe replaced by a fake that records its name in calls."""
    def recorder(name, result):
        def fake(*args, **kwargs):
            calls.append(name)
            return result
        return fake

    disk = probe_mod._DiskResult(read_bw=1e9, write_bw=1e9, capacity=1 << 40, method="O_DIRECT",
                                 fs_dir=str(tmp_path))
    monkeypatch.setattr(probe_mod, "_disk_bw", recorder("disk", disk))
    for fn, result in (("_cpu_memcpy_bw", 1e10), ("_adam_rate", (1e8, "fake")), ("_cpu_block_flops", 1e10),
                       ("_cpu_rate_curves", {k: ((1e9, 1e10),) for k in ("matmul_rates", "matmul_rates_fp32",
                                                                              "attention_rates", "attention_rates_fp32",
                                                                              "grouped_mm_rates", "grouped_mm_rates_fp32",
                                                                              "grouped_mm_wgrad_rates",
                                                                              "grouped_mm_wgrad_rates_fp32")}), ("_cpu_elementwise_bw", 4e9),
                       ("_cpu_bf16_ratio", 0.5), ("_cpu_row_factors", ((512.0, 1.0),)), ("_op_dispatch_s", 1e-5), ("_copy_tensor_s", 1e-5), ("_adam_tensor_s", 2e-5),
                       ("_host_contention", 0.1), ("_ssd_contention", 0.05)):
        monkeypatch.setattr(probe_mod, fn, recorder(fn, result))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(probe_mod, "_machine_cpu_s", lambda: (5.0, 0.0))  # an idle machine


def _fake_probe(tmp_path):
    probe_mod.clear_cache()
    try:
        return probe(disk_dir=str(tmp_path), quick=True)
    finally:
        probe_mod.clear_cache()


def test_the_disk_is_timed_before_any_other_measurement(tmp_path, monkeypatch):
    """Timed after the memcpy test had freed its 256 MiB, the disk runs at 0.8-1.7 GB/s on a
    2-core CPU VM (median 1.1, 24 processes) against 2.5-2.9 GB/s in the executor's own store in
    the same process, which predicts SSD plans ~1.4x too slow. So the disk goes
    first, before anything allocates and frees."""
    calls = []
    _fake_measurements(monkeypatch, tmp_path, calls)
    hw = _fake_probe(tmp_path)
    assert calls[0] == "disk" and "_cpu_memcpy_bw" in calls[1:]
    assert hw.ssd.read_bw == 1e9  # the probe used what the disk measurement returned


def test_a_probe_on_a_busy_machine_warns_and_says_so_in_the_spec(tmp_path, monkeypatch):
    """Guards against a silent probe of a busy machine: with a compiler running on a 2-core CPU
    VM's other core, the probe measures host_contention 1.08 (0.19 idle) and the planner
    recomputes every block of gpt-small instead of swapping: a plan 1.35x slower, made without
    a word."""
    _fake_measurements(monkeypatch, tmp_path, [])
    machine = {"busy": 0.0}

    def machine_cpu_s():  # another process burns 3 s of CPU between any two readings
        machine["busy"] += 3.0
        return machine["busy"], 0.0
    monkeypatch.setattr(probe_mod, "_machine_cpu_s", machine_cpu_s)
    with pytest.warns(probe_mod.ProbeWarning, match=r"other processes kept .* cores busy.*probe again"):
        hw = _fake_probe(tmp_path)
    assert "other processes kept" in hw.source and "host_contention" in hw.source

    monkeypatch.setattr(probe_mod, "_machine_cpu_s", lambda: (5.0, 0.0))  # idle again
    with warnings.catch_warnings():
        warnings.simplefilter("error", probe_mod.ProbeWarning)
        hw = _fake_probe(tmp_path)
    assert "other processes" not in hw.source


def test_other_load_counts_another_process_but_not_this_one():
    """`_OtherLoad` sees a busy child process (its CPU is the machine's, not this process's) and
    leaves this process's own work out."""
    if probe_mod._machine_cpu_s() is None:
        pytest.skip("no /proc/stat on this platform")
    child = subprocess.Popen([sys.executable, "-c", "import sys\nprint('go', flush=True)\nwhile True: pass"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "go"
        load = probe_mod._OtherLoad()
        with load:
            time.sleep(1.0)
    finally:
        child.kill()
        child.wait()
    assert load.wall_s >= 1.0
    assert load.cores > 0.3, load.cores  # the child spun throughout (a loaded machine only adds)


def test_the_cli_shows_a_probe_warning_as_one_line(capsys):
    from tensorstow import cli
    cli._show_warning(probe_mod.ProbeWarning("the machine was busy"), probe_mod.ProbeWarning, "probe.py", 1)
    assert capsys.readouterr().err == "tensorstow: warning: the machine was busy\n"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and at least 2 cores (the contention rounds pin threads apart)")
def test_contention_rounds_give_every_thread_its_cores_back(tmp_path):
    """The contention rounds pin the block to the compute lane's cores and the loop, with every
    thread helping it, to the others (as overlap mode does); afterwards the process must run where
    it ran before, or every later computation of the caller would be squeezed onto one core."""
    import threading
    mine = os.sched_getaffinity(0)
    helper_ready, release = threading.Event(), threading.Event()

    def helper():  # a thread of the caller's, started before the probe
        helper_ready.set()
        release.wait()
    th = threading.Thread(target=helper)
    th.start()
    helper_ready.wait()
    before = os.sched_getaffinity(th.native_id)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # leaves a core to spare: the rounds pin
        assert probe_mod._host_contention(2) >= 0
        assert probe_mod._ssd_contention(2, str(tmp_path)) >= 0
        assert os.sched_getaffinity(0) == mine
        assert os.sched_getaffinity(th.native_id) == before
    finally:
        torch.set_num_threads(threads)
        release.set()
        th.join()


def test_local_hardware_is_probed_once_per_machine_and_kept(measured, tmp_path, monkeypatch):
    """`--hw local` takes the probe cached for what the probe measures; its capacities are read again
    each time; --reprobe, a damaged file or another key (here: torch's threads) measures again."""
    hw = measured[0]
    calls = []

    def counted():
        calls.append(1)
        return hw
    monkeypatch.setattr(probe_mod, "probe", counted)
    monkeypatch.setattr(probe_mod, "probe_cache_dir", tmp_path / "cache")
    monkeypatch.chdir(tmp_path)
    first = probe_mod.local_hardware()
    assert first is hw and len(calls) == 1
    files = list((tmp_path / "cache").iterdir())
    assert [f.name for f in files] == [f"local-{probe_mod.machine_key(str(tmp_path.resolve()))}.json"]
    again = probe_mod.local_hardware()
    assert len(calls) == 1  # from the cache
    assert again.to_json()["gpus"] == hw.to_json()["gpus"] and again.ssd.read_bw == hw.ssd.read_bw
    budget = hw.gpus[0].memory_bytes if hw.gpus[0].name == CPU_GPU_NAME else 0
    avail = probe_mod._meminfo()["available"] - budget
    assert abs(again.dram.capacity_bytes - avail) < 256 << 20  # read now, not the cached figure's moment
    assert probe_mod.local_hardware(reprobe=True) is hw and len(calls) == 2
    files[0].write_text("{not json")
    assert probe_mod.local_hardware() is hw and len(calls) == 3  # damaged: measured again and replaced
    assert json.loads(files[0].read_text())["name"] == "local"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        probe_mod.local_hardware()
        assert len(calls) == 4 and len(list((tmp_path / "cache").iterdir())) == 2
    finally:
        torch.set_num_threads(threads)


def test_a_gpu_without_grouped_matmuls_is_probed_without_their_curves(monkeypatch):
    """Where a GPU (or torch) runs no `torch._grouped_mm` at a precision, the CUDA probe leaves that
    precision's grouped curves out and says why: its mixtures of experts' grouped matmuls are priced
    at the dense matmul curve. It times fp32 too: experts compute in fp32 under autocast."""
    def bf16_only(device, dtype, *args):
        if dtype == torch.float32:
            raise RuntimeError("grouped gemm is only supported for bf16\nmore")
        return ((64.0, 1e14), (256.0, 2e14)), ((64.0, 5e13),)
    monkeypatch.setattr(probe_mod, "_grouped_rates", bf16_only)
    curves, note = probe_mod._cuda_grouped_rates(0, torch.bfloat16, None)
    assert curves == {"grouped_mm_rates": ((64.0, 1e14), (256.0, 2e14)), "grouped_mm_wgrad_rates": ((64.0, 5e13),)}
    assert "bfloat16 forward and input gradient 100-200, weight gradient 50-50 TFLOPS" in note
    assert "float32 not timed (RuntimeError: grouped gemm is only supported for bf16)" in note
