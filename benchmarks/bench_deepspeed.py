"""Training step time: DeepSpeed ZeRO-Infinity vs eager PyTorch vs a tensorstow SSD plan, same run.

All three train the same GPT preset (default gpt-small: 6 layers, d 256, vocab 4096, seq 128)
with the same micro-batch (default 4), fp32, AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8,
weight decay 0), the same initial weights (`torch.manual_seed(seed)` right before `GPT(...)`,
as `tensorstow execute` does) and the same synthetic batches (`tensorstow.executor.data.batches`,
a different batch every step). Each engine runs `--warmup` untimed steps, then `--steps` timed
ones; the table shows the median (and min) step time and the losses of the first and last step.
Equal first-step losses show the three start from the same model and batch.

Every engine runs in a worker process of its own, built before any step is timed. By default
(`--order rotated`) the engines take turns: batch K on each engine, then batch K+1 on each,
so a slow minute of the shared VM (its compute and disk swing 20-40% from one minute to the next,
benchmarks/RESULTS.md) weighs on every engine alike, and round K starts with engine K mod 4, so
each engine follows each other one as often: the engine that runs right after DeepSpeed reads and
syncs on a disk still busy with what DeepSpeed wrote (`--order interleaved`, the same order every
round: tensorstow, always after DeepSpeed, 0.737-0.759 of DeepSpeed's step where rotated gave
0.716-0.741, benchmarks/RESULTS.md "tensorstow vs DeepSpeed ZeRO-Infinity"). `--order sequential`
starts one engine's worker, runs all its steps and ends it before the next engine's starts: the
engines of a billion-parameter model do not fit this box's DRAM side by side. The ratios print with the spread of
the per-round ratios (step K of the two engines): the size of the VM's noise on the median's
ratio. A step's time includes the wait for the engine's background work (tensorstow's store:
its early syncs and a commit in the
background), so none of it runs in another engine's turn. Before each step the coordinator syncs the file systems
(`os.sync()`, untimed): otherwise the first engine to sync (tensorstow's store, every step) would
flush, on this VM's write-back disk, what DeepSpeed wrote in its turn and never synced (gpt-small,
interleaved without it: the durable tensorstow row 0.43-0.58 s a step, with it 0.34 s).

  eager        plain `loss = model(x, y); loss.backward(); AdamW.step()` in this venv; nothing
               offloaded (the baseline of the ratios).
  deepspeed    ZeRO stage 3 with parameters AND optimizer state offloaded to NVMe (ZeRO-Infinity):
               DS_ACCELERATOR=cpu, gloo backend, one process (world size 1), DeepSpeed's own
               AdamW (DeepSpeedCPUAdam, adamw mode), aio block_size/queue_depth left at their
               defaults, pin_memory false, no activation checkpointing unless
               --ds-activation-checkpointing (then every transformer block is wrapped in
               deepspeed.checkpointing.checkpoint). It runs in a subprocess with the python of a
               SEPARATE venv (default <repo>/.venv-ds) so DeepSpeed never enters tensorstow's
               dependencies; if that venv is missing the row is skipped with the reason.
               --ds-offload cpu switches both offloads to device "cpu" (ZeRO-Offload) for
               comparison.
  tensorstow   `tensorstow plan PRESET --hw local --gpu-mem 90MB --dram 80MB --precision fp32
               --batch B --policy auto` (--ts-policy, --ts-hw, --ts-gpu-mem and --ts-dram change
               it): the plan the planner makes for this machine (probed at the run's thread count)
               when DRAM cannot hold the training state: what DRAM has no room for lives on SSD
               (the Adam states and part of the parameters; DeepSpeed keeps all of both on NVMe,
               beside 2.6 GB of its own host memory for gpt-small); replayed by `tensorstow.executor.executor.Executor` in
               overlap mode (--ts-mode) on this CPU (the "gpu0" tier is host memory here) with the
               crash-consistent SSDStore (--ts-store file: the FileStore fallback), committing
               a checkpoint every step (`execute`'s default: each step's fsyncs and manifest).
  tensorstow-end  the same plan and store with one checkpoint, after the last step (`execute
               --checkpoint-every` past the run): the durability of the DeepSpeed row, which
               saves nothing, so the pair shows what a durable commit per step costs.
               `--ts-policy zero-infinity --ts-hw lohan-rtx4090 --ts-dram ''` runs tensorstow's
               imitation of DeepSpeed instead (serialized fetches, gradients through SSD). Skipped
               with the reason if the executor cannot be imported or fails.

Ratios printed: deepspeed / eager, and each tensorstow row / eager and / deepspeed (step time;
below 1 is faster). The 1-minute load average is printed with every step. With other processes on the cores,
multi-threaded torch steps become erratic (2 threads on the shared 2-core VM: eager 0.23 s to
4 s per step), so a warning is printed and `--threads 1` gives the comparable numbers.

Setup (once; Debian, run as root; the commands as run on a 2-core CPU-only VM):

    apt-get update
    apt-get install -y libaio-dev            # headers + .so for DeepSpeed's async_io op (NVMe offload)
    python3 -m venv /work/main/.venv-ds      # outside tensorstow's venv; add `.venv-ds/` to .gitignore
    /work/main/.venv-ds/bin/pip install torch==2.13.0 deepspeed ninja
        # -> deepspeed 0.19.8 (sdist, no ops prebuilt), torch 2.13.0+cpu; use the CPU wheel index
        #    (--index-url https://download.pytorch.org/whl/cpu) if pip would pull CUDA torch
    # JIT-build DeepSpeed's CPU ops once (about 6 minutes on 2 cores; cached under
    # ~/.cache/torch_extensions); otherwise the first benchmark run builds them inside its
    # DeepSpeed init (not inside the timed steps). If a build is interrupted, delete the
    # stale `lock` file in ~/.cache/torch_extensions/py311_cpu/<op>/ or later builds hang.
    DS_ACCELERATOR=cpu /work/main/.venv-ds/bin/python -c \
      "from deepspeed.ops.op_builder.cpu import AsyncIOBuilder, CPUAdamBuilder; AsyncIOBuilder().load(); CPUAdamBuilder().load()"
    DS_ACCELERATOR=cpu /work/main/.venv-ds/bin/ds_report   # async_io ... [OKAY] once libaio-dev is in

tensorstow is NOT installed into .venv-ds: the DeepSpeed worker loads this checkout's package
(GPT, PRESETS and the data generator) from the repository root by file location.

Run (from the repo root, in tensorstow's venv):

    .venv/bin/python benchmarks/bench_deepspeed.py [--preset gpt-small] [--batch 4] [--warmup 2]
        [--steps 10] [--order rotated|interleaved|sequential] [--dir DIR_ON_THE_SSD] [--ds-python PATH] [--ds-offload nvme|cpu]
        [--ds-activation-checkpointing] [--ds-zero JSON] [--threads 1] [--ts-policy auto] [--ts-hw local]
        [--ts-gpu-mem 90MB] [--ts-dram 40MB] [--ts-store ssd|file] [--ts-mode overlap|sync] [--json OUT.json]
    # the defaults are the comparison in benchmarks/RESULTS.md; gpt3-125m there:
    #   --preset gpt3-125m --batch 1 --seq 512 --warmup 1 --steps 5 --ts-gpu-mem 700MB --ts-dram 1GB
    # (compute-bound on a 2-core CPU: 4.8 s a step) and the same with --seq 128 (1.5 s of compute
    # a step: the SSD traffic is what DeepSpeed's step waits for). gpt3-1.3b, one engine at a time,
    # DeepSpeed's host memory held down by its own knobs (at their defaults it keeps up to 1e9
    # parameters in DRAM, 4 optimizer buffers of a 1e9-element subgroup, a 5e8-element gradient
    # bucket; eager's 22.7 GB of fp32 training state does not fit the 24 GiB box):
    #   --preset gpt3-1.3b --batch 1 --seq 512 --warmup 1 --steps 2 --only deepspeed,tensorstow
    #   --order sequential --ts-policy lohan --ts-gpu-mem 2GB --ts-dram 6GB --ds-zero '{"sub_group_size": 1e8,
    #   "stage3_max_live_parameters": 2e8, "stage3_max_reuse_distance": 0, "reduce_bucket_size": 1.1e8,
    #   "offload_param": {"buffer_count": 8, "buffer_size": 1.1e8, "max_in_cpu": 1e8}}'
    # (buffer_size must hold the largest parameter, the 103M-element embedding; with 4 or 5 buffers
    # the second step stops: "Not enough swap in buffers")

DeepSpeed notes (0.19.8, CPU accelerator): the model is built normally and then converted
with `deepspeed.zero.Init(module=model, config_dict_or_path=cfg)` before
`deepspeed.initialize`. Both obvious alternatives are wrong here: building the model inside
`with deepspeed.zero.Init(...)` partitions each submodule as it is created, so GPT's own
weight init (normal_ on the partitioned, empty tensors) has no effect and the weights differ
from eager; and leaving the conversion to `deepspeed.initialize` makes its internal
`Init(dtype=torch.float32, ...)` pick bfloat16 for the NVMe parameter swapper on an
accelerator without fp16 (`Init._set_dtype`: `dtype or torch.float16 if fp16 else bfloat16
...` binds as `(dtype or fp16) if fp16 else bf16`), so fp32 parameters get swapped through a
folder and buffers sized for bf16. With `Init(module=..., config_dict_or_path=cfg)` and no
dtype the dtype comes from the config (fp32): swap files land in zero_stage_3/float32params.
Parameters smaller than DeepSpeed's default param_persistence_threshold (1e5 elements:
LayerNorms, biases, wpe, c_proj) stay resident in DRAM as ZeRO-3 does by default.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DS_PYTHON = REPO / ".venv-ds" / "bin" / "python"
TAG = "BENCH_DS "


# ---- shared ------------------------------------------------------------------------------------
def _import_tensorstow():
    """`import tensorstow`; in a venv where it is not installed (the DeepSpeed venv) load this
    checkout's package from the repository root (whose directory is not named tensorstow)."""
    try:
        __import__("tensorstow")
        return
    except ImportError:
        pass
    import importlib.util

    spec = importlib.util.spec_from_file_location("tensorstow", REPO / "__init__.py",
                                                  submodule_search_locations=[str(REPO)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tensorstow"] = mod
    spec.loader.exec_module(mod)


def _allocator() -> str:
    """The malloc this process runs on: jemalloc when it is mapped (LD_PRELOAD), else glibc's."""
    try:
        with open("/proc/self/maps") as f:
            return "jemalloc" if "libjemalloc" in f.read() else "glibc malloc"
    except OSError:
        return "unknown"


def _setup(a: dict, meta: bool = False):
    """Model (seeded exactly like `tensorstow execute`) and the warmup+steps batches. `meta`: the
    model on the meta device with the stream of its initial values (tensorstow's out-of-core
    initialisation: never the whole model in host memory); otherwise built whole, its values
    drawn by `torch.manual_seed(seed); GPT(cfg)`, the same values."""
    import torch

    _import_tensorstow()
    from tensorstow.executor.data import batches
    from tensorstow.ir.models import GPT, PRESETS, build_for_execution, resolve_model

    torch.set_num_threads(a["threads"])
    cfg = PRESETS[a["preset"]]
    data = list(batches("synthetic", a["batch"], a["seq"], cfg.vocab_size, a["warmup"] + a["steps"], a["seed"]))
    if meta:
        model, init = build_for_execution(resolve_model(a["preset"]), a["seed"])
        return model, data, init
    torch.manual_seed(a["seed"])
    return GPT(cfg), data, None


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# ---- the engines, each stepped by a worker process ------------------------------------------------
class EagerEngine:
    """Plain `loss = model(x, y); loss.backward(); AdamW.step()`, everything in DRAM."""

    def __init__(self, a: dict):
        import torch

        self.model, self.data, _ = _setup(a)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=a["lr"], betas=(0.9, 0.999), eps=1e-8,
                                     weight_decay=0.0)

    def step(self, x, y) -> float:
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def drain(self) -> None:
        pass

    def finish(self) -> dict:
        return {"offload": "none (all in DRAM)", "peak_rss_bytes": _peak_rss_bytes()}


class TensorstowEngine:
    """The plan at a["ts_plan"] replayed by the Executor with its state on the SSD store, the
    model initialised out of core as `execute` does (same values as the other engines');
    `every`: commit a crash-consistent checkpoint every K steps (0: none but the one after the
    last step, which `execute` also makes: inside that step's time)."""

    def __init__(self, a: dict, every: int):
        from tensorstow.executor.executor import Executor
        from tensorstow.schema.plan import Plan

        plan = Plan.load(a["ts_plan"])
        self.model, self.data, init = _setup(a, meta=True)
        state = Path(a["work"]) / f"tensorstow-state-{every}"
        every = every or 2 * len(self.data)
        if a["ts_store"] == "ssd":
            from tensorstow.executor.ssd import SSDStore

            state.mkdir()
            self.store = SSDStore(state, plan.ssd_sizes())
            self.ex = Executor(plan, self.model, mode=a["ts_mode"], ssd_store=self.store, checkpoint_every=every,
                               init_values=init)
        else:
            self.store = None
            self.ex = Executor(plan, self.model, mode=a["ts_mode"], state_dir=state, checkpoint_every=every,
                               init_values=init)
        self.steps = 0

    def step(self, x, y) -> float:
        loss = self.ex.step(x, y)
        self.steps += 1
        if self.steps == len(self.data):  # no-op where the step committed itself
            self.ex.checkpoint()
        return loss

    def drain(self) -> None:
        if self.store is not None:  # its background syncs and commit are its own turn's work
            self.store.wait_background()

    def finish(self) -> dict:
        self.ex.close()
        return {"peak_rss_bytes": _peak_rss_bytes()}


class DeepSpeedEngine:
    """ZeRO-3 with parameters and optimizer state on NVMe (runs under the DeepSpeed venv)."""

    def __init__(self, a: dict):
        import deepspeed

        t0 = time.perf_counter()
        self.a = a
        deepspeed.init_distributed(dist_backend="gloo")
        self.model, self.data, _ = _setup(a)
        cfg = ds_config(a, a["nvme_dir"])
        # Convert the already-initialised model (same weights as eager); dtype from the config (fp32).
        deepspeed.zero.Init(module=self.model, config_dict_or_path=cfg)
        if a["ds_activation_checkpointing"]:
            deepspeed.checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False)
            for blk in self.model.h:
                fwd = blk.forward
                blk.forward = lambda x, _f=fwd: deepspeed.checkpointing.checkpoint(_f, x)
        self.engine, _, _, _ = deepspeed.initialize(model=self.model, model_parameters=self.model.parameters(),
                                                    config=cfg)
        self.init_s = time.perf_counter() - t0

    def step(self, x, y) -> float:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def drain(self) -> None:
        pass  # DeepSpeed's swapper waits for its own reads and writes inside the step

    def finish(self) -> dict:
        import deepspeed
        import torch

        a, model, opt = self.a, self.model, self.engine.optimizer
        files = {}
        for root, _, fs in os.walk(a["nvme_dir"]):
            if fs:
                files[os.path.relpath(root, a["nvme_dir"])] = [len(fs), sum(os.path.getsize(os.path.join(root, f))
                                                                           for f in fs)]
        return {
            "peak_rss_bytes": _peak_rss_bytes(),
            "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
            "init_s": self.init_s,
            "deepspeed_version": deepspeed.__version__,
            "torch_version": torch.__version__,
            "accelerator": deepspeed.get_accelerator().device_name(),
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "threads": torch.get_num_threads(),
            "zero_optimizer": type(opt).__name__,
            "inner_optimizer": type(getattr(opt, "optimizer", None)).__name__,
            "param_dtype": str(next(model.parameters()).ds_tensor.dtype),
            "aio": dict(self.engine._config.aio_config),
            "offload": f"params+optimizer on {a['ds_offload']}",
            "swap_files": files,
            "activation_checkpointing": a["ds_activation_checkpointing"],
        }


ENGINES = {"eager": EagerEngine, "deepspeed": DeepSpeedEngine,
           "tensorstow": lambda a: TensorstowEngine(a, every=1),
           "tensorstow-end": lambda a: TensorstowEngine(a, every=0)}


def worker(name: str, a: dict) -> None:
    """A worker process: builds engine `name`, then runs the steps its stdin names ("step K": the
    K-th batch; "end": finish) and answers each on stdout in one TAG line of JSON: the step's seconds
    (`s`, with `drain_s`, the wait for its background work, inside), its loss."""
    import traceback

    def say(obj: dict) -> None:
        print(TAG + json.dumps(obj), flush=True)

    try:
        eng = ENGINES[name](a)
        say({"ready": True})
        for line in sys.stdin:
            cmd = line.split()
            if cmd == ["end"]:
                say({"end": {**eng.finish(), "allocator": _allocator()}})
                return
            k = int(cmd[1])
            x, y = eng.data[k]
            t0 = time.perf_counter()
            loss = eng.step(x, y)
            t1 = time.perf_counter()
            eng.drain()
            t2 = time.perf_counter()
            say({"k": k, "s": t2 - t0, "drain_s": t2 - t1, "loss": loss})
    except Exception as e:  # noqa: BLE001 - the coordinator shows it as a skipped row
        say({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"})
        sys.exit(1)


class _Worker:
    """One engine's worker process, its tagged replies read by a thread (the rest of its output,
    DeepSpeed's log lines, goes to its log file)."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, leaves: str = ""):
        import queue
        import threading

        self.name, self.log_path, self.leaves = name, log, leaves
        """`leaves`: a glob of files the process leaves behind, removed once it is gone."""
        self.log = open(log, "w")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                  text=True, bufsize=1)
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            if line.startswith(TAG):
                self.replies.put(json.loads(line[len(TAG):]))
            else:
                self.log.write(line)
                self.log.flush()
        self.replies.put({"error": f"exited with rc {self.p.wait()}"})

    def ask(self, cmd: str | None, timeout: float) -> dict:
        """Send `cmd` (None: only wait), return the reply; {"error": ...} if it fails or times out."""
        import queue

        try:
            if cmd is not None:
                self.p.stdin.write(cmd + "\n")
                self.p.stdin.flush()
            r = self.replies.get(timeout=timeout)
        except (OSError, ValueError):
            r = {"error": f"exited with rc {self.p.poll()}"}
        except queue.Empty:
            r = {"error": f"no answer to {cmd or 'its start'} in {timeout:.0f} s"}
        if "error" in r:
            self.stop()
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
            r["error"] += f"\nlast lines of its log:\n{tail}" if tail else ""
        return r

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
        self.log.close()
        if self.leaves:
            import glob

            for f in glob.glob(self.leaves):
                Path(f).unlink(missing_ok=True)


def _spawn(name: str, a: dict, work: Path) -> _Worker | dict:
    """Start engine `name`'s worker and wait until it is built; a skipped row's dict if it cannot be."""
    me = str(Path(__file__).resolve())
    wa = {**a, "work": str(work)}
    env = dict(os.environ)
    if name == "deepspeed":
        py = Path(a["ds_python"])
        if not py.exists():
            return {"skipped": f"DeepSpeed venv python {py} not found; create it as the module docstring says "
                               f"(python3 -m venv .venv-ds && .venv-ds/bin/pip install torch==2.13.0 deepspeed ninja)"}
        nvme = work / "ds-nvme"
        nvme.mkdir()
        wa["nvme_dir"] = str(nvme)
        port = _free_port()
        env.update({"DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                    "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        # its CPU accelerator's shared-memory all-reduce buffer (69 MB), which it never removes
        leaves = f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"
        env.pop("PYTHONPATH", None)  # the worker loads tensorstow from REPO itself
        cmd = [str(py), me, "--_worker", name, json.dumps(wa)]
    else:
        leaves = ""
        if name.startswith("tensorstow"):
            wa["ts_plan"] = str(work / "tensorstow-plan.json")
            if not Path(wa["ts_plan"]).exists():
                skipped = _ts_plan(a, Path(wa["ts_plan"]))
                if skipped:
                    return skipped
        cmd = [sys.executable, me, "--_worker", name, json.dumps(wa)]
    w = _Worker(name, cmd, env, work / f"{name}.log", leaves)
    r = w.ask(None, timeout=a["ds_timeout"])  # a first DeepSpeed run JIT-builds its ops
    if "error" in r:
        return {"skipped": f"{name} worker failed: {r['error']}"}
    return w


def _ts_info(a: dict, work: Path, every: int) -> dict:
    """What the tensorstow rows print about their plan."""
    from tensorstow.schema.plan import Plan

    plan = Plan.load(work / "tensorstow-plan.json")
    homes: dict[str, set] = {}
    for n, b in plan.buffers.items():
        homes.setdefault(str(b.buffer_kind), set()).add(b.home or "-")
    state = [b for b in plan.buffers.values() if b.buffer_kind in ("P", "OS")]
    on_ssd = sum(b.bytes for b in state if b.home == "ssd")
    where = "P/OS on SSD" if on_ssd == sum(b.bytes for b in state) else \
        f"P/OS {on_ssd / 2**20:.0f} of {sum(b.bytes for b in state) / 2**20:.0f} MiB on SSD"
    return {"offload": f"{where} ({a['ts_policy']}, {a['ts_store']} store, {a['ts_mode']}, "
                       f"{'checkpoint every step' if every == 1 else 'one checkpoint, at the end'})",
            "plan_predicted_step_s": plan.predicted.step_time_s,
            "disk": {k: getattr(plan.hardware.spec.ssd, k) for k in ("read_bw", "write_bw", "flush_bw")},
            "host_contention": plan.hardware.spec.gpus[0].host_contention,
            "ssd_bytes": sum(plan.ssd_sizes().values()),
            "homes": {k: sorted(v) for k, v in sorted(homes.items())}}


def run_engines(a: dict, names: list[str], work: Path, order: str) -> dict[str, dict]:
    """Step every engine: `rotated` or `interleaved`, every worker started first, then batch K on
    each engine in turn before batch K+1 (a minute when the shared VM runs slow weighs on every
    engine alike; rotated starts round K with engine K mod E), or `sequential`, one engine at a
    time: its worker started, all its steps, its worker ended before the next one starts (engines
    of a billion-parameter model do not fit this box's DRAM side by side). Each engine's first
    a["warmup"] steps are not timed."""
    n = a["warmup"] + a["steps"]
    workers: dict[str, _Worker] = {}
    res: dict[str, dict] = {}

    def start(name: str) -> None:
        t0 = time.perf_counter()
        w = _spawn(name, a, work)
        if isinstance(w, dict):
            res[name] = w
            print(f"  {name}: skipped: {w['skipped'].splitlines()[0]}", flush=True)
            return
        workers[name] = w
        res[name] = {"times_s": [], "drain_s": [], "losses": []}
        print(f"  {name}: ready ({time.perf_counter() - t0:.0f} s, load {_load()})", flush=True)

    def step(k: int, name: str) -> None:
        os.sync()  # untimed: no engine's step flushes what another one wrote and never synced
        r = workers[name].ask(f"step {k}", timeout=a["ds_timeout"])
        if "error" in r:
            res[name] = {"skipped": f"{name} failed at step {k}: {r['error']}"}
            del workers[name]
            return
        res[name]["losses"].append(r["loss"])
        if k >= a["warmup"]:
            res[name]["times_s"].append(r["s"])
            res[name]["drain_s"].append(r["drain_s"])
        print(f"  step {k} {name}: {r['s']:.4f} s (waited {r['drain_s']:.4f} s for its background work; "
              f"load {_load()})", flush=True)

    def end(name: str) -> None:
        w = workers.pop(name)
        r = w.ask("end", timeout=a["ds_timeout"])
        if "error" in r:
            res[name] = {"skipped": f"{name} failed at its end: {r['error']}"}
            return
        w.stop()
        times = res[name]["times_s"]
        res[name].update(r["end"], median_s=statistics.median(times), min_s=min(times))
        if name.startswith("tensorstow"):
            res[name].update(_ts_info(a, work, 1 if name == "tensorstow" else 0))

    try:
        if order == "sequential":
            for name in names:
                start(name)
                for k in range(n):
                    if name in workers:
                        step(k, name)
                if name in workers:
                    end(name)
            return res
        for name in names:
            start(name)
        names = list(workers)
        # rotated: round k starts with engine k mod E, so each engine follows each other one alike
        rounds = [names[k % len(names):] + names[:k % len(names)] if order == "rotated" else names
                  for k in range(n)]
        for k in range(n):
            for name in rounds[k]:
                if name in workers:
                    step(k, name)
        for name in list(workers):
            end(name)
    finally:
        for w in workers.values():
            w.stop()
    return res


def _ts_plan(a: dict, plan_path: Path) -> dict | None:
    """`tensorstow plan` for this machine into plan_path; a skipped row's dict if it fails."""
    cmd = [sys.executable, "-m", "tensorstow.cli", "plan", a["preset"], "--hw", a["ts_hw"],
           "--gpu-mem", a["ts_gpu_mem"], "--precision", "fp32", "--batch", str(a["batch"]), "--seq", str(a["seq"]),
           "--policy", a["ts_policy"], "--lr", str(a["lr"]), "-o", str(plan_path)]
    if a["ts_dram"]:
        cmd += ["--dram", a["ts_dram"]]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(a["threads"])} if a["threads"] else {}))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)  # `--hw local` probes at the run's threads
    if p.returncode != 0 or not plan_path.exists():
        return {"skipped": f"`{' '.join(cmd[3:])}` failed (rc {p.returncode}): "
                           f"{(p.stderr or p.stdout).strip()[-800:]}"}
    for line in p.stderr.splitlines():  # e.g. the probe ran beside other processes: a pessimistic plan
        if line.startswith("tensorstow: warning:"):
            print(f"  {line}", flush=True)
    return None


def ds_config(a: dict, nvme_dir: str) -> dict:
    def off():
        if a["ds_offload"] == "nvme":
            return {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False}
        return {"device": "cpu", "pin_memory": False}

    return {
        "train_micro_batch_size_per_gpu": a["batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": a["lr"], "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": _merged({"stage": 3, "offload_param": off(), "offload_optimizer": off()},
                                     json.loads(a.get("ds_zero") or "{}")),
        "aio": {},  # block_size, queue_depth, ... at DeepSpeed's defaults
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def _merged(base: dict, over: dict) -> dict:
    """`base` with `over`'s keys set, nested dicts merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- main --------------------------------------------------------------------------------------
def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--_worker":
        worker(sys.argv[2], json.loads(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: the preset's block size)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every engine (0: torch's default)")
    ap.add_argument("--dir", default=None, help="directory on the SSD for swap/state files (default: a temp dir)")
    ap.add_argument("--ds-python", default=str(DEFAULT_DS_PYTHON), help="python of the DeepSpeed venv")
    ap.add_argument("--ds-offload", choices=["nvme", "cpu"], default="nvme")
    ap.add_argument("--ds-activation-checkpointing", action="store_true")
    ap.add_argument("--ds-zero", default="", metavar="JSON",
                    help="merged into DeepSpeed's zero_optimization config, nested dicts key by key: its host-memory "
                         "knobs (sub_group_size, stage3_max_live_parameters, reduce_bucket_size, offload_param's "
                         "buffer_count / buffer_size / max_in_cpu, offload_optimizer's buffer_count), whose defaults "
                         "take tens of GB for a billion-parameter model")
    ap.add_argument("--ds-timeout", type=int, default=1800, help="seconds (a first run JIT-builds DeepSpeed ops)")
    ap.add_argument("--ts-gpu-mem", default="90MB")
    ap.add_argument("--ts-policy", default="auto", help="the tensorstow plan's policy")
    ap.add_argument("--ts-hw", default="local", help="hardware the plan is made for (local: probe this machine)")
    ap.add_argument("--ts-dram", default="80MB", help="DRAM budget of the plan (80MB: about gpt-small's 79 MiB of P/OS, "
                         "which with the step's working set cannot all stay in DRAM: the plan keeps on SSD what "
                         "its DRAM has no room for, all the Adam states and part of P on this VM; the offload "
                         "column says how much)")
    ap.add_argument("--ts-store", choices=["ssd", "file"], default="ssd")
    ap.add_argument("--ts-mode", choices=["sync", "overlap"], default="overlap")
    ap.add_argument("--order", choices=["rotated", "interleaved", "sequential"], default="rotated",
                    help="rotated: each batch on every engine in turn, round K starting with engine K mod E; "
                         "interleaved: the same, always in one order; sequential: one engine's steps after another's")
    ap.add_argument("--only", default="eager,deepspeed,tensorstow,tensorstow-end", help="comma-separated engines to run")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, swap files)")
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args()
    if args.warmup < 0 or args.steps < 1:
        ap.error("--warmup must be >= 0 and --steps >= 1")

    import torch

    _import_tensorstow()
    from tensorstow.ir.models import PRESETS

    if args.preset not in PRESETS:
        ap.error(f"unknown preset {args.preset}")
    a = {k: v for k, v in vars(args).items() if k not in ("json", "only", "keep", "dir")}
    a["threads"] = args.threads or torch.get_num_threads()
    a["seq"] = args.seq or PRESETS[args.preset].block_size
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tensorstow-bench-ds-", dir=args.dir))
    only = set(args.only.split(","))
    c = PRESETS[args.preset]
    print(f"{args.preset}: {c.n_layer} layers, d {c.n_embd}, vocab {c.vocab_size}; batch {args.batch} x seq "
          f"{a['seq']}, fp32, AdamW lr {args.lr}; {args.warmup} warmup + {args.steps} timed steps; "
          f"{a['threads']} torch threads; work dir {work}; load {_load()}", flush=True)
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    if a["threads"] > 1 and busy >= 0.75:
        print(f"warning: load average {busy:.2f} before starting: other processes share the cores, and torch's "
              f"{a['threads']}-thread OpenMP steps then swing by up to 10x (seen on the 2-core VM: eager 0.23 s "
              f"idle, 1-4 s with one busy neighbour); compare with --threads 1", flush=True)
    names = [n for n in ENGINES if n in only]
    try:
        res = run_engines(a, names, work, args.order)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"done (load {_load()})")

    tokens = args.batch * a["seq"]
    print()
    allocators = sorted({r["allocator"] for r in res.values() if "allocator" in r})
    print(f"allocator: {', '.join(allocators) or 'unknown'} (each engine's process)")
    print(f"{'engine':<14} {'offload':<36} {'median s':>9} {'min s':>8} {'tok/s':>8} {'loss@1':>8} {'loss@last':>9} "
          f"{'peak RSS':>9}")
    for name, r in res.items():
        if "skipped" in r:
            print(f"{name:<14} SKIPPED: {r['skipped'].splitlines()[0]}")
            continue
        print(f"{name:<14} {r['offload']:<36} {r['median_s']:>9.4f} {r['min_s']:>8.4f} "
              f"{tokens / r['median_s']:>8.0f} {r['losses'][0]:>8.4f} {r['losses'][-1]:>9.4f} "
              f"{r['peak_rss_bytes'] / 2**30:>7.2f} GiB")
    for name, r in res.items():
        if "skipped" in r and "\n" in r["skipped"]:
            print(f"\n{name} skipped, details:\n{r['skipped']}")
    ds = res.get("deepspeed", {})
    if "median_s" in ds:
        print(f"\ndeepspeed: {ds['deepspeed_version']} torch {ds['torch_version']}, accelerator {ds['accelerator']}, "
              f"backend {ds['backend']}, {ds['zero_optimizer']} + {ds['inner_optimizer']}, params {ds['param_dtype']}, "
              f"activation checkpointing {'on' if ds['activation_checkpointing'] else 'off'}, init {ds['init_s']:.1f} s")
        print(f"  aio {ds['aio']}")
        print("  swap files: " + ", ".join(f"{k}: {n} files {b / 2**20:.1f} MiB" for k, (n, b) in ds["swap_files"].items()))
        if "peak_rss_bytes" in ds:  # host memory of the DeepSpeed process (its own, not this one's)
            print(f"  peak RSS {ds['peak_rss_bytes'] / 2**20:.0f} MiB for {ds['params'] / 1e6:.2f}M parameters")
    ts = res.get("tensorstow") or res.get("tensorstow-end") or {}
    if "median_s" in ts:
        print(f"tensorstow: plan predicts {ts['plan_predicted_step_s']:.4g} s/step for {args.ts_hw}; "
              f"{ts['ssd_bytes'] / 2**20:.1f} MiB on the SSD tier; buffer homes {ts['homes']}")
        # the VM's disk moves 0.6-3 GB/s from one minute to the next: the rate the plan was made for
        print("  disk as planned: " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in ts["disk"].items())
              + f"; device tier host_contention {ts['host_contention']:.3f}")

    def ratio(num, den):
        if "median_s" in res.get(num, {}) and "median_s" in res.get(den, {}):
            label = {"deepspeed": "deepspeed_zero_infinity"}.get(num, num)
            # in turns: step k of both engines ran in the same round, so the spread of the
            # per-round ratios shows how far the VM's minute moves the median's ratio
            rounds = sorted(t / u for t, u in zip(res[num]["times_s"], res[den]["times_s"]))
            spread = f"   (per round: {rounds[0]:.3f} .. {rounds[-1]:.3f})" if args.order != "sequential" else ""
            print(f"  {label} / {den}: {res[num]['median_s'] / res[den]['median_s']:.3f}{spread}")

    print("\nstep-time ratios (median; < 1 is faster):")
    ratio("deepspeed", "eager")
    ratio("tensorstow", "eager")
    ratio("tensorstow", "deepspeed")
    ratio("tensorstow-end", "eager")
    ratio("tensorstow-end", "deepspeed")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": a, "results": res}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
