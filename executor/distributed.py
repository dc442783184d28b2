"""One process per GPU: `tensorstow execute PLAN --nproc N` (or N processes under torchrun).

Each process (rank K) replays GPU K's share of a multi-GPU plan (executor.runtime: its stages'
instructions, their DRAM, SSD and CPU-optimizer work, both ends of its `send`s) on GPU K. Stage
boundaries go through torch.distributed: NCCL where every rank has a GPU of its own (device
memory to device memory; without P2P NCCL itself goes through host memory, the path the plan
models), else gloo, the sender staging the buffer in host memory and the receiver copying it
onto its device: on a machine without CUDA each process's device tier is CPU memory under its
own budget. Only the gloo path has run (no machine with several GPUs was available).

Crash-safety across processes: every rank keeps its training state in its own store,
`STATE_DIR/rank<K>`; a step is committed when every rank has committed it. After its commit a
rank waits for all the others before it writes anything for the next step, so when a rank dies
the others are at most one commit ahead, and their store still holds the commit before
(ssd.SSDStore.rollback). On start the ranks agree on the last step they all committed and the
ones ahead roll back to it. If one rank dies, `launch` stops the others and says which rank died
and that the same command resumes.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tensorstow.errors import Interrupted, TensorstowError

LOST = "lost its peers"
TIMEOUT_S = 600
"""How long a rank waits for its peers in one exchange before it gives up (a hung peer)."""


class Comm:
    """Stage boundaries and step agreement between the ranks (torch.distributed, gloo)."""

    def __init__(self, rank: int, world: int, on_device: bool = False, data_parallel: bool = False):
        self.rank, self.world = rank, world
        self.on_device = on_device
        """NCCL: boundaries move GPU to GPU in device memory; gloo: staged in host memory."""
        self.groups: dict[str, object] = {}
        """Data parallel: a process group per lane that issues collectives (`gpuK.reduce`: the
        gradients' all-reduces, `gpuK.gather`: the updated parameters' all-gathers), so each group
        sees its lane's collectives in the schedule's order, the same on every rank, however the
        lanes interleave."""
        if data_parallel:
            import torch.distributed as dist
            self.groups = {lane: dist.new_group(backend="cpu:gloo,cuda:nccl" if on_device else "gloo",
                                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
                           for lane in ("reduce", "gather")}

    def all_reduce(self, tensors: list[torch.Tensor], in_order: bool = False) -> None:
        """Sum each of `tensors` over the ranks, in place (ring all-reduce, no copy of them). `in_order`:
        summed rank after rank, ((t0 + t1) + t2) + ..., as one process accumulating the ranks'
        microbatches in order sums them (bit-identical with it; a ring's partial sums start at a
        different rank for each chunk): every rank gathers every rank's tensor, (N - 1) x its bytes
        instead of 2 (N - 1) / N, into a temporary of N x its bytes (two ranks: the same sum either
        way, as a + b == b + a)."""
        import torch.distributed as dist
        for t in tensors:
            if not (in_order and self.world > 2):
                c = t if t.is_contiguous() else t.contiguous()  # a gradient the graph made transposed
                dist.all_reduce(c, group=self.groups["reduce"])
                if c is not t:
                    t.copy_(c)
                continue
            every = self.all_gather(t.reshape(-1).contiguous(), "reduce").view(self.world, -1)
            total = every[0].clone()
            for r in range(1, self.world):
                total += every[r]
            t.copy_(total.view_as(t))

    def all_gather(self, mine: torch.Tensor, lane: str = "gather") -> torch.Tensor:
        """Every rank's `mine` (equal sizes, 1-D), end to end in rank order, in `lane`'s group."""
        import torch.distributed as dist
        out = mine.new_empty(self.world * mine.numel())
        dist.all_gather_into_tensor(out, mine, group=self.groups[lane])
        return out

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> list:
        """Start sending `tensors` (CPU, contiguous) to `peer`; returns the requests to wait for."""
        import torch.distributed as dist
        return [dist.isend(t, peer, tag=tag + k) for k, t in enumerate(tensors)]

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        import torch.distributed as dist
        for k, t in enumerate(tensors):
            dist.recv(t, peer, tag=tag + k)

    def share(self, value: float | None, src: int) -> float:
        """`src`'s value on every rank."""
        import torch.distributed as dist
        t = torch.tensor([0.0 if value is None else value], dtype=torch.float64)
        dist.broadcast(t, src)
        return float(t[0])

    def gather_floats(self, values: list[float]) -> list[float]:
        """Every rank's `values` (as many on each), end to end in rank order."""
        import torch.distributed as dist
        out = [torch.zeros(len(values), dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(out, torch.tensor(values, dtype=torch.float64))
        return [float(v) for t in out for v in t]

    def barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier()

    def gather(self, value: int) -> list[int]:
        """Every rank's `value`, by rank."""
        import torch.distributed as dist
        out = [torch.zeros(1, dtype=torch.long) for _ in range(self.world)]
        dist.all_gather(out, torch.tensor([value], dtype=torch.long))
        return [int(t[0]) for t in out]


def rank_dir(state_dir, rank: int) -> Path:
    return Path(state_dir) / f"rank{rank}"


def agree_on_step(store, comm: Comm) -> int | None:
    """The last step every rank committed; a rank one commit ahead rolls back to it."""
    mine = store.committed_step()
    steps = comm.gather(-1 if mine is None else mine)
    low = min(steps)
    if low < 0 and max(steps) == 0:  # stopped inside the first commit: step 0 is the initial state,
        return None                  # which a rank without it makes afresh and one with it resumes
    if low < 0 and max(steps) > 0:
        raise TensorstowError(f"ranks {[k for k, s in enumerate(steps) if s < 0]} have no committed step while "
                              f"others have step {max(steps)}: the state dir is not one run's (use a fresh one)")
    if max(steps) > low + 1:
        raise TensorstowError(f"the ranks' committed steps {steps} are more than one commit apart: the state dir "
                              f"was not written by one run")
    if mine is not None and mine > low:
        store.rollback()  # this rank committed a step another rank did not
    return None if low < 0 else low


def rank_cores(cores: list[int], rank: int, world: int) -> set[int]:
    """The cores rank `rank` of `world` runs on when its device tier is the CPU: an equal share of
    `cores` (a core each, round robin, when there are fewer cores than ranks), so the ranks' compute
    lanes (and the executor's pinning inside each: `lanes.lane_cores`) never share a core."""
    k = len(cores) // world
    return set(cores[rank * k:(rank + 1) * k]) if k else {cores[rank % len(cores)]}


def peer_lost(e: Exception) -> bool:
    """A transport error: another rank went away (gloo raises plain RuntimeErrors naming itself)."""
    import torch.distributed as dist
    return isinstance(e, (dist.DistError, ConnectionError, TimeoutError)) or (
        isinstance(e, RuntimeError) and any(w in str(e) for w in ("gloo", "NCCL", "Connection", "timed out")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, kw: dict, out=None) -> None:
    """Run `execute(**kw)` in `nproc` processes, rank K on GPU K; rank 0's output is ours. If a
    rank fails or dies, stop the others and raise one error naming it."""
    out = out or sys.stdout
    env = dict(os.environ, WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))))
    with tempfile.TemporaryDirectory(prefix="tensorstow-ranks-") as tmp:
        errs = [Path(tmp) / f"rank{k}.err" for k in range(nproc)]
        procs = []
        seen: dict[int, int] = {}
        try:
            for k in range(nproc):
                with open(errs[k], "w") as err:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "tensorstow.executor.run", json.dumps(kw)],
                        env=dict(env, RANK=str(k)), stdout=None if k == 0 else subprocess.DEVNULL, stderr=err,
                        start_new_session=True))
            seen = _watch(procs)
        except KeyboardInterrupt:  # Ctrl-C: the ranks (process groups of their own) are stopped where they are
            _stop(procs)
            state = kw.get("state_dir")
            raise Interrupted("interrupted: every rank stopped" + (
                f"; {state} keeps the last step all ranks committed: rerun the same command to resume" if state
                else "; nothing is committed without --state-dir")) from None
        finally:
            stopped = _stop(procs)
        why = {}
        for k, p in enumerate(procs):
            if p.returncode == 0:
                continue
            lines = [ln for ln in errs[k].read_text().splitlines() if ln.strip()]
            why[k] = (f"was killed by signal {signal.Signals(-p.returncode).name}" if p.returncode < 0
                      else "failed: " + (lines[-1].removeprefix("tensorstow: error: ") if lines
                                         else f"exit status {p.returncode}"))
        if not why:
            return
        cause = _cause(why, stopped, seen)
        state = kw.get("state_dir")
        refused = procs[cause].returncode == 2  # a TensorstowError: its line says what to change first
        resume = "; every rank stopped" + (f", and {state} keeps the last step all ranks committed" if state else "") + (
            "" if refused or not state else ": run the same command to resume")
        raise TensorstowError(f"rank {cause} of {nproc} {why[cause]}{resume}")


def _watch(procs: list[subprocess.Popen], poll_s: float = 0.05, grace_s: float = 2.0) -> dict[int, int]:
    """Wait until every rank succeeds or one does not; then give the others `grace_s` to notice and
    end. Returns rank -> the poll round in which it was first seen ended (the order of deaths)."""
    seen: dict[int, int] = {}
    deadline, rnd = None, 0
    while len(seen) < len(procs) and (deadline is None or time.monotonic() < deadline):
        for k, p in enumerate(procs):
            if k not in seen and p.poll() is not None:
                seen[k] = rnd
                if p.returncode != 0 and deadline is None:
                    deadline = time.monotonic() + grace_s
        rnd += 1
        if len(seen) < len(procs):
            time.sleep(poll_s)
    return seen


def _cause(why: dict[int, str], stopped: set[int], seen: dict[int, int] | None = None) -> int:
    """The rank to blame of those that did not succeed (rank -> what happened): not one this
    launcher terminated when another ended by itself; then the first seen ended (one it never saw
    end, after all); then one that did not only lose its peers; then a rank that died by another's
    hand (not SIGABRT, which a rank raises itself when its transport loses a peer), then one that
    died; else the first."""
    seen = seen or {}
    return min(why, key=lambda k: (k in stopped, seen.get(k, math.inf), LOST in why[k], "SIGABRT" in why[k],
                                   "killed" not in why[k], k))


def _stop(procs: list[subprocess.Popen]) -> set[int]:
    """Terminate the ranks still running (their process groups), then reap them; returns the ranks
    it terminated."""
    stopped = set()
    for k, p in enumerate(procs):
        if p.poll() is None:
            stopped.add(k)
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return stopped

