"""The host threads that run a plan's lanes: one long-lived thread per stream in overlap mode
(`LaneThreads`), the cores they are pinned to on a CPU device tier (`lane_cores`,
`pin_off_compute`), and the CPU optimizer's intra-op threads (`optimizer_threads`). The CUDA
side of the lanes, streams and events, is `executor.cuda`'s."""
from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

import torch

from tensorstow.schema.schedule import CPU_OPTIMIZER


def lane_cores(device: torch.device, nthreads: int) -> tuple[set[int], set[int]] | None:
    """(the other lanes' cores, the compute lane's cores) when the device tier is the CPU and the
    compute's `nthreads` leave cores to spare; None otherwise. On a CPU device the copy, SSD and
    optimizer lanes (and the I/O and checksum threads they start) would otherwise preempt the
    compute thread on its own core; pinned apart, each runs where the simulator puts it: on a
    resource of its own."""
    if device.type != "cpu" or not hasattr(os, "sched_getaffinity"):
        return None
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) <= nthreads:
        return None
    return set(mine[nthreads:]), set(mine[:nthreads])


def optimizer_threads(device: torch.device, nthreads: int, streams: list[str]) -> int:
    """Intra-op threads of the CPU optimizer's lane in overlap mode. With a GPU, every other lane
    is a host thread that drives it (launches, copies, SSD requests) beside the update: the
    update leaves one core to each, else they wait for a core and the GPU idles
    (benchmarks/RESULTS.md "On a GPU").
    On a CPU device tier `lane_cores` already keeps the lanes apart: `nthreads`."""
    if device.type != "cuda":
        return nthreads
    others = sum(1 for s in streams if s != CPU_OPTIMIZER)
    return max(1, min(nthreads, (os.cpu_count() or 1) - others))


def pin_off_compute(cores: tuple[set[int], set[int]]) -> dict[int, set[int]]:
    """Move every thread of this process but the main thread and the compute lane's (those whose
    affinity is the compute cores: the lane and the intra-op threads it started) onto the other
    lanes' cores; returns {thread id: its affinity before} for `unpin`. `lane_cores` pins the lanes
    themselves, but the threads that work for them were mostly started elsewhere (the checksum
    and sync pools and the aio engine's workers: by the store, in the main thread), so they could
    run on -- and take -- the compute lane's core (benchmarks/RESULTS.md "Host memory and threads")."""
    others, compute = cores
    main = threading.main_thread().native_id
    before: dict[int, set[int]] = {}
    try:
        tids = [int(e.name) for e in os.scandir("/proc/self/task")]
    except OSError:  # no procfs
        return before
    for tid in tids:
        if tid == main:
            continue
        try:
            now = os.sched_getaffinity(tid)
            if now <= others or now == compute:
                continue
            os.sched_setaffinity(tid, others)
            before[tid] = now
        except OSError:  # it ended meanwhile
            continue
    return before


def unpin(before: dict[int, set[int]]) -> None:
    """Give each thread `pin_off_compute` moved its affinity back (one that ended is skipped)."""
    for tid, cores in before.items():
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            continue


class LaneThreads:
    """One long-lived thread per stream of the plan, which overlap mode runs that stream's lane
    on, step after step. A thread made anew each step starts with cold per-thread state: its
    allocator's thread cache and arena (a step's compute ran measurably slower in a new thread
    each step: benchmarks/RESULTS.md "Host memory and threads"), torch's thread-local
    state, a CUDA thread's stream and handles. The threads wait on their queues between steps and
    end when `close` (or the Executor's garbage collection) stops them."""

    def __init__(self):
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []

    def run(self, jobs: dict[str, Callable[[], None]]) -> None:
        """Run each stream's job on that stream's thread, all at once; return when all are done.
        A job handles its own errors (`runtime.Executor`'s overlap lanes record them); one that
        escapes is raised here, and its thread serves the next step all the same."""
        done = [(threading.Event(), []) for _ in jobs]
        for (stream, job), (ev, error) in zip(sorted(jobs.items()), done):
            q = self._queues.get(stream)
            if q is None:
                q = self._queues[stream] = queue.SimpleQueue()
                t = threading.Thread(target=self._serve, args=(q,), name=f"tensorstow-{stream}", daemon=True)
                t.start()
                self._threads.append(t)
            q.put((job, ev, error))
        for ev, _ in done:
            ev.wait()
        for _, error in done:
            if error:
                raise error[0]

    @staticmethod
    def _serve(q) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            job, ev, error = item
            del item  # waiting for the next job must not keep this one's Executor alive
            try:
                job()
            except BaseException as e:
                error.append(e)
            finally:
                del job, error
                ev.set()

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        self._queues, self._threads = {}, []
