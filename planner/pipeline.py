"""Lowering a multi-GPU pipeline into the static schedule (Mobius §3.1; GPipe as the baseline).

A pipeline plan cuts the blocks into stages of consecutive blocks, runs stage j on GPU
`pipeline.gpus[j]`, and cuts the step's batch into M microbatches. Per GPU, the stages it runs
form one sequence of *visits*: its forward stages in order, then its backward stages in reverse
(the last stage's forward and backward are one visit: its parameters stay). A visit loads its
stage's parameters (Mobius: from DRAM; GPipe: resident, nothing to load), runs every microbatch
through every block, and releases them. What the next visit on the same GPU can take while this
one runs is prefetched into the memory this one leaves free (Mobius Eq. 5-6); the rest is loaded
once this visit's parameters are released.

Per microbatch m the activations are their own buffers, `A:<b>@m`, `X:<b>@m`, `H:<b>@m`,
`T:<b>@m` (schema.schedule names the kinds): a forward offloads its block's saved activations
and input checkpoint to DRAM (Mobius §3.1, A_Mobius) and the backward brings them back; at a
stage boundary the output activation (`X` of the next stage's first block) and the activation
gradient (`H` of a stage's first block) go GPU to GPU as `send` instructions (through DRAM
without P2P: both GPUs' host links carry them). Gradients accumulate over the microbatches in
`G:<b>` (the later microbatches' backward lists it in `accum`); after the last one the block's
update runs (the CPU optimizer for DRAM-homed state, overlapped with the rest of the backward,
as LoHan's active gradient offloading; GPipe: on its GPU).

The data-parallel baseline (DeepSpeed ZeRO-3 with offload, the paper's comparison) runs every
block on every GPU, GPU k on microbatch k: each GPU streams every block's parameters from DRAM
(ZeRO-3's all-gather has no P2P on these machines: it goes through the host links, so the
traffic is the same), and each GPU's gradient goes to DRAM, where the CPU sums them and updates.
"""
from __future__ import annotations

import dataclasses

from tensorstow.planner.cost import BlockProfile
from tensorstow.planner.lower import Emitter, buffers_for, write_new
from tensorstow.schema.schedule import PER_MICRO, Buffer, BufferKind, Decisions, Instr, InstrKind, buffer_kind, home_tiers


def pipeline_buffers(order: list[str], prof: dict[str, BlockProfile], profile_of: dict[str, str],
                     decisions: Decisions, mixed: bool) -> dict[str, Buffer]:
    """The single-GPU buffers, with the per-microbatch kinds (and, data-parallel, each GPU's
    gradient) copied per microbatch."""
    pl = decisions.pipeline
    per = PER_MICRO + ((BufferKind.G,) if pl.kind == "data-parallel" else ())
    out = {}
    for n, b in buffers_for(order, prof, profile_of, decisions, mixed).items():
        if buffer_kind(n) in per:
            for m in range(pl.microbatches):
                out[f"{n}@{m}"] = dataclasses.replace(b, name=f"{n}@{m}")
        else:
            out[n] = b
    if pl.microbatches > 1 and pl.kind != "data-parallel":
        # A backward whose gradient accumulates makes the microbatch's gradient (compute dtype)
        # before it is added in (mixed: before its fp32 copy is made): one more G in its workspace.
        for n, g in list(out.items()):
            if buffer_kind(n) is BufferKind.G:
                ws = out.get(f"W:bwd:{g.block}")
                out[f"W:acc:{g.block}"] = Buffer(f"W:acc:{g.block}", (ws.bytes if ws else 0)
                                                 + prof[profile_of[g.block]].grad_bytes, g.block)
    return out


def lower_pipeline(order: list[str], prof: dict[str, BlockProfile], profile_of: dict[str, str],
                   decisions: Decisions, buffers: dict[str, Buffer], capacity: dict[str, int], *,
                   mixed: bool) -> list[Instr]:
    """One step's instruction list for a pipeline (`decisions.pipeline`); `capacity`: bytes the
    plan's tensors may fill on each GPU ("gpuK"), for the prefetch split; `mixed`: mixed precision
    (an fp32 master M:<b> beside each compute-precision P:<b>)."""
    if decisions.pipeline.kind == "data-parallel":
        return _DataParallel(order, prof, profile_of, decisions, buffers, mixed).lower()
    return _Pipeline(order, prof, profile_of, decisions, buffers, capacity, mixed).lower()


class _Pipeline:
    """A pipeline's step (`lower_pipeline`), emitted visit by visit: per GPU its forward stages in
    order, then its backward stages in reverse, each visit loading its stage's parameters (the
    next visit's prefetched into what it leaves free) and running every microbatch through it."""

    def __init__(self, order, prof, profile_of, decisions, buffers, capacity, mixed):
        pl = decisions.pipeline
        self.order, self.prof, self.profile_of, self.dec = order, prof, profile_of, decisions.blocks
        self.buffers, self.capacity, self.prefetch = buffers, capacity, decisions.prefetch
        self.M = pl.microbatches
        self.stages = [order[lo:hi] for lo, hi in pl.stages]
        self.gpu = [f"gpu{k}" for k in pl.gpus]
        self.gpu_of = {b: self.gpu[j] for j, bl in enumerate(self.stages) for b in bl}
        self.e = Emitter(self.gpu[0])
        self.home = home_tiers(buffers, decisions, order)
        for n, t in self.home.items():
            self.e.where[(n, t)] = None
        self.mixed = mixed
        self.nxt = {b: order[k + 1] for k, b in enumerate(order[:-1])}
        self.prev = {b: order[k - 1] for k, b in enumerate(order) if k}
        self.borrowed: list[str] = []
        """Other blocks' P:/C: copies loaded for the segment being emitted, released after it."""
        self.ring: dict[str, list[int]] = {}
        """GPU -> back-pressure points, one per microbatch x block."""

    # ---- helpers ------------------------------------------------------------------------------
    def has(self, n: str) -> bool:
        """Whether the plan has the buffer."""
        return n in self.buffers

    def state(self, b: str) -> list[str]:
        """The block's parameter-like buffers (P:, C:)."""
        return [x for x in (f"P:{b}", f"C:{b}") if self.has(x)]

    def streamed(self, b: str) -> list[str]:
        """b's parameter-like buffers that live off its GPU (loaded per visit)."""
        return [x for x in self.state(b) if self.home[x] != self.gpu_of[b]]

    def nbytes(self, names) -> int:
        """Bytes of the named buffers the plan has."""
        return sum(self.buffers[n].bytes for n in names if self.has(n))

    def footprint(self, phase: str, j: int) -> int:
        """GPU bytes a visit holds besides the next visit's prefetch: its parameters (and, in the
        backward, its gradients), plus two blocks' activations and the largest workspace."""
        blocks = self.stages[j]
        fixed = self.nbytes(x for b in blocks for x in self.state(b))
        if phase == "bwd":
            fixed += self.nbytes(f"G:{b}" for b in blocks)
        act = max(self.nbytes([f"A:{b}@0", f"X:{b}@0", f"H:{b}@0", f"T:{b}@0"]) for b in blocks)
        ws = max(self.nbytes([f"W:{phase}:{b}"]) for b in blocks)
        return fixed + 3 * act + ws

    def gate_ring(self, g: str, depth: int = 2):
        """What GPU g's next copy waits for: the back-pressure point `depth` before the last."""
        q = self.ring.get(g, [])
        return q[-depth] if len(q) >= depth else None

    def load_foreign(self, b: str, g: str) -> list[int]:
        """Other blocks' P/C that b reads (tied weights): on b's GPU (the policy puts a tie on one GPU)."""
        ready = []
        for o in self.prof[self.profile_of[b]].reads:
            for x in self.state(o):
                if (x, g) in self.e.where:
                    if self.e.where[(x, g)] is not None:
                        ready.append(self.e.where[(x, g)])
                    continue
                ready.append(self.e.move(x, self.home[x], g))
                self.borrowed.append(x)
        return ready

    def release_foreign(self, g: str, after: int) -> None:
        """Release on g the copies `load_foreign` brought for the segment `after`."""
        while self.borrowed:
            self.e.free(self.borrowed.pop(), g, (after,))

    # ---- the schedule -------------------------------------------------------------------------
    def lower(self) -> list[Instr]:
        """Every visit in turn: its loads, the next visit's prefetch, its microbatches, its releases."""
        K = len(self.stages)
        visits = [("fwd", j) for j in range(K)] + [("bwd", j) for j in reversed(range(K - 1))]
        per_gpu: dict[str, list[tuple[str, int]]] = {}
        for v in visits:
            per_gpu.setdefault(self.gpu[v[1]], []).append(v)
        nxt_visit = {v: vs[k + 1] for vs in per_gpu.values() for k, v in enumerate(vs[:-1])}
        early = {v: self.early_blocks(v, nxt_visit.get(v)) for v in visits}
        prev_visit = {w: v for v, w in nxt_visit.items()}
        loads: dict[tuple[str, int], dict[str, int]] = {}
        released: dict[tuple[str, int], list[int]] = {}
        for v in visits:
            phase, j = v
            g = self.gpu[j]
            self.e.gpu = g
            mine = loads.setdefault(v, {})
            pv = prev_visit.get(v)
            gate = max(released[pv]) if pv and released.get(pv) else None
            for b in self.stages[j]:
                if b not in mine and self.streamed(b) and self.runs(phase, b):
                    mine[b] = self.load(b, g, gate)
            w = nxt_visit.get(v)  # prefetch: the next visit's blocks that fit next to this one
            stay = w is not None and w[1] == j  # the GPU's only stage: its parameters stay for the backward
            if w and not stay:
                ahead = loads.setdefault(w, {})
                for b in early[v]:
                    ahead[b] = self.load(b, g, None)
            last = self.run_forward(j, mine) if phase == "fwd" else {}
            if phase == "bwd" or j == K - 1:  # the last stage's backward follows its forward
                last |= self.run_backward(j, mine)
            if stay:
                loads[w] = mine
                continue
            released[v] = [self.e.free(x, g, (last[b],)) for b in self.stages[j] if b in last
                           for x in self.streamed(b)]
        return self.e.instrs

    def runs(self, phase: str, b: str) -> bool:
        """Whether b has work in this phase (a block nothing below needs a gradient of has no backward)."""
        return phase == "fwd" or self.prof[self.profile_of[b]].bwd_ops[0] >= 0

    def early_blocks(self, v, w) -> list[str]:
        """Mobius Eq. 5-6: the blocks of visit w loaded while visit v runs, in w's order, as many
        as fit in what v leaves free."""
        if w is None or w[1] == v[1] or not self.prefetch:
            return []
        left = self.capacity[self.gpu[v[1]]] - self.footprint(*v)
        if v[0] == "fwd" and v[1] == len(self.stages) - 1:
            left = min(left, self.capacity[self.gpu[v[1]]] - self.footprint("bwd", v[1]))
        out = []
        blocks = self.stages[w[1]] if w[0] == "fwd" else list(reversed(self.stages[w[1]]))
        for b in blocks:
            if not self.runs(w[0], b) or not self.streamed(b):
                continue
            need = self.nbytes(self.streamed(b))
            if need > left:
                break
            left -= need
            out.append(b)
        return out

    def load(self, b: str, g: str, gate) -> int | None:
        """b's streamed parameters onto GPU g after `gate`; returns the last load."""
        last = None
        for x in self.streamed(b):
            last = self.e.move(x, self.home[x], g, (gate,))
        return last

    def run_forward(self, j: int, loaded: dict[str, int]) -> dict[str, int]:
        """Every microbatch through stage j's forward; returns each block's last compute."""
        e, g = self.e, self.gpu[j]
        last = {}
        ring = self.ring.setdefault(g, [])
        for m in range(self.M):
            for b in self.stages[j]:
                d = self.dec[b]
                x_in = f"X:{b}@{m}"
                deps = [loaded.get(b), self.gate_ring(g), *self.load_foreign(b, g)]
                if self.has(x_in):
                    deps.append(e.where.get((x_in, g)))
                allocs = [f"A:{b}@{m}"] if self.has(f"A:{b}@{m}") and d.activations != "recompute" else []
                nb = self.nxt.get(b)
                if nb and self.has(f"X:{nb}@{m}"):
                    allocs.append(f"X:{nb}@{m}")
                c = e.emit(InstrKind.COMPUTE, f"{g}.compute", deps, segment=f"fwd:{b}", micro=m, allocs=tuple(allocs),
                           workspace=f"W:fwd:{b}" if self.has(f"W:fwd:{b}") else "")
                self.release_foreign(g, c)
                for a in allocs:
                    e.where[(a, g)] = c
                last[b] = c
                done = [c]
                if self.has(f"A:{b}@{m}") and d.activations in ("swap_dram", "swap_ssd"):
                    s = e.move(f"A:{b}@{m}", g, "dram", (c,))
                    done.append(e.free(f"A:{b}@{m}", g, (s,)))
                if self.has(x_in) and d.checkpoint != "gpu":
                    s = e.move(x_in, g, "dram", (c,))
                    done.append(e.free(x_in, g, (s, c)))
                if nb and self.has(f"X:{nb}@{m}") and self.gpu_of[nb] != g:  # Mobius Eq. 8: to the next stage
                    s = self.send(f"X:{nb}@{m}", g, self.gpu_of[nb], c)
                    done.append(e.free(f"X:{nb}@{m}", g, (s,)))
                ring.append(max(done))
        return last

    def send(self, buf: str, src: str, dst: str, after: int) -> int:
        """`buf` from GPU src to GPU dst after `after` (Mobius Eq. 8)."""
        s = self.e.emit(InstrKind.SEND, f"{src}.send", (after,), tensor=buf, src=src, dst=dst)
        self.e.where[(buf, dst)] = s
        return s

    def run_backward(self, j: int, loaded: dict[str, int]) -> dict[str, int]:
        """Every microbatch through stage j's backward, then each block's update; returns each
        block's last backward compute."""
        e, g, M = self.e, self.gpu[j], self.M
        last: dict[str, int] = {}
        ring = self.ring.setdefault(g, [])
        carry_until = {b: self.prof[self.profile_of[b]].carried_until for b in self.order
                       if self.has(f"T:{b}@0")}
        for m in range(M):
            for b in reversed(self.stages[j]):
                d = self.dec[b]
                if self.prof[self.profile_of[b]].bwd_ops[0] < 0:
                    continue  # nothing below needs a gradient and nothing here trains
                deps = [loaded.get(b), *self.load_foreign(b, g)]
                for x, tier in ((f"X:{b}@{m}", d.checkpoint), (f"A:{b}@{m}", d.activations)):
                    if not self.has(x) or (x, g) in e.where:
                        deps.append(e.where.get((x, g)))
                        continue
                    if tier == "recompute" or (x, "dram") not in e.where:
                        continue
                    deps.append(e.move(x, "dram", g, (self.gate_ring(g),)))
                    e.free(x, "dram", (deps[-1],))
                if self.has(f"A:{b}@{m}") and d.activations == "recompute":
                    r = e.emit(InstrKind.RECOMPUTE, f"{g}.compute", tuple(deps), segment=f"fwd:{b}", micro=m,
                               allocs=(f"A:{b}@{m}",),
                               workspace=f"W:fwd:{b}" if self.has(f"W:fwd:{b}") else "")
                    deps.append(r)
                nb = self.nxt.get(b)
                if nb and self.has(f"H:{nb}@{m}"):
                    deps.append(e.where.get((f"H:{nb}@{m}", g)))
                allocs = [x for x in (f"T:{b}@{m}", f"H:{b}@{m}") if self.has(x)]
                accum = ()
                if self.has(f"G:{b}"):
                    if m == 0:
                        allocs.insert(0, f"G:{b}")
                    else:
                        accum = (f"G:{b}",)
                        deps.append(last.get(b))
                ws = next((w for w in (f"W:acc:{b}", f"W:bwd:{b}") if self.has(w)), "")
                c = e.emit(InstrKind.COMPUTE, f"{g}.compute", tuple(deps), segment=f"bwd:{b}", micro=m,
                           allocs=tuple(allocs), accum=accum, workspace=ws)
                self.release_foreign(g, c)
                for a in allocs:
                    e.where[(a, g)] = c
                last[b] = c
                done = [c]
                for x in (f"A:{b}@{m}", f"X:{b}@{m}"):
                    if self.has(x):
                        done.append(e.free(x, g, (c,)))
                if nb and self.has(f"H:{nb}@{m}"):  # the gradient the next block handed to b
                    done.append(e.free(f"H:{nb}@{m}", g, (c,)))
                for t in sorted(t for t, until in carry_until.items() if until == self.profile_of[b]):
                    if (f"T:{t}@{m}", g) in e.where:
                        done.append(e.free(f"T:{t}@{m}", g, (c,)))
                pb = self.prev.get(b)
                if pb and self.has(f"H:{b}@{m}") and self.gpu_of[pb] != g:  # Mobius Eq. 8, backward
                    s = self.send(f"H:{b}@{m}", g, self.gpu_of[pb], c)
                    done.append(e.free(f"H:{b}@{m}", g, (s,)))
                ring.append(max(done))
        for b in reversed(self.stages[j]):
            if b in last and self.has(f"G:{b}"):
                self.update(b, g, last[b])
        return last

    def update(self, b: str, g: str, after: int) -> None:
        """Block b's optimizer step once its gradient has every microbatch (Mobius: in DRAM, by
        the CPU; GPipe: on its GPU)."""
        e, d = self.e, self.dec[b]
        states = [s for s in (f"M:{b}", f"OS:{b}") if self.has(s)]
        if d.optimizer != "cpu":
            u = e.emit(InstrKind.OPTIMIZER_STEP, f"{g}.compute", (after,), segment=b, dst=g,
                       workspace=f"W:opt:{b}" if self.has(f"W:opt:{b}") else "")
            e.free(f"G:{b}", g, (u,))
            return
        s = e.move(f"G:{b}", g, "dram", (after,))
        e.free(f"G:{b}", g, (s,))
        ready = [s]
        for x in states + [f"P:{b}"]:
            if self.home[x] != "dram" and (x, "dram") not in e.where:
                ready.append(e.move(x, self.home[x], "dram", (after,)))
        fresh = (f"P:{b}",) if self.mixed and self.home[f"P:{b}"] != "dram" else ()
        u = e.emit(InstrKind.OPTIMIZER_STEP, "cpu.opt", tuple(ready), segment=b, dst="cpu", allocs=fresh)
        e.free(f"G:{b}", "dram", (u,))
        for x in states + [f"P:{b}"]:
            if self.home[x] == "dram":
                continue
            if x == f"P:{b}" and self.mixed:
                write_new(e, x, "dram", self.home[x], u, g)
            else:
                w = e.move(x, "dram", self.home[x], (u,))
                e.free(x, "dram", (w,))


class _DataParallel:
    """ZeRO-3 with offload, DeepSpeed's data parallelism on these machines: GPU k runs the whole
    model on microbatch k, streaming each block's parameters from DRAM for its forward and again
    for its backward (ZeRO-3 frees gathered parameters after use), recomputing each block from its
    input checkpoint (kept in DRAM), and sending each gradient to DRAM, where the CPU sums the GPUs'
    gradients and updates (ZeRO-Offload).

    As DeepSpeed (0.9.3, stage3.py) runs it, and as DOS §3-4 measured it: a block's gradient reaches
    DRAM by a blocking copy that the backward waits for (`partition_grads`; its time,
    `cost.zero3_grad_flush_time`, includes the reduce-scatter), and the optimizer runs only after
    every GPU's backward, one sub-group (block) at a time, each followed by the blocking write-back
    of its updated parameters (`step`; `cost.zero3_param_writeback_time`)."""

    def __init__(self, order, prof, profile_of, decisions, buffers, mixed):
        self.order, self.prof, self.profile_of, self.buffers = order, prof, profile_of, buffers
        self.prefetch = decisions.prefetch
        self.e = Emitter("gpu0")
        self.home = home_tiers(buffers, decisions, order)
        for n, t in self.home.items():
            self.e.where[(n, t)] = None
        self.gpus = [f"gpu{k}" for k in decisions.pipeline.gpus]
        self.mixed = mixed
        self.state = {b: [x for x in (f"P:{b}", f"C:{b}") if self.has(x)] for b in order}
        """Block -> its P:/C: buffers (streamed in for every forward and backward)."""
        self.arrived: dict[str, list[int]] = {}
        """Block -> each GPU's gradient copy to DRAM, in GPU order."""
        self.finished: list[int] = []
        """Per GPU, its last instruction: every update waits for all of them."""
        self.ring: list[int] = []
        """The GPU being emitted: each block's last instruction, forward then backward (back-pressure)."""
        self.frees: list[int] = []
        """The GPU being emitted: each block's release of its parameters (the prefetch FIFO)."""
        self.flushed: int | None = None
        """The GPU being emitted: its last gradient's blocking copy to DRAM (the next backward waits)."""

    def has(self, n: str) -> bool:
        """Whether the plan has the buffer."""
        return n in self.buffers

    def ws(self, phase: str, b: str) -> str:
        """The workspace buffer of b's `phase` segment, or "" where it needs none."""
        return f"W:{phase}:{b}" if self.has(f"W:{phase}:{b}") else ""

    def load(self, b: str, g: str) -> list[int]:
        """b's parameters onto GPU g, `prefetch` blocks ahead of their use."""
        gate = self.frees[-1 - self.prefetch] if len(self.frees) > self.prefetch else None
        return [self.e.move(x, self.home[x], g, (gate,)) for x in self.state[b]]

    def ring_gate(self) -> int | None:
        """What a block's copy waits for: the block two before it done (back-pressure)."""
        return self.ring[-2] if len(self.ring) >= 2 else None

    def lower(self) -> list[Instr]:
        """Each GPU's forward and backward, one GPU after the other, then the updates."""
        for k, g in enumerate(self.gpus):
            self.e.gpu = g
            self.ring, self.frees, self.flushed = [], [], None
            for b in self.order:
                self.forward(b, k, g)
            for b in reversed(self.order):
                if self.prof[self.profile_of[b]].bwd_ops[0] >= 0:
                    self.backward(b, k, g)
            self.finished.append(max(self.ring + self.frees))
        self.updates()
        return self.e.instrs

    def forward(self, b: str, k: int, g: str) -> None:
        """b's forward on GPU g for microbatch k: stream the parameters in, keep only the input
        checkpoint (sent to DRAM)."""
        e, has = self.e, self.has
        deps = self.load(b, g)
        deps.append(self.ring_gate())
        x_in = f"X:{b}@{k}"
        if has(x_in):
            deps.append(e.where.get((x_in, g)))
        nb = self.order[self.order.index(b) + 1] if b != self.order[-1] else None
        allocs = tuple(x for x in (f"X:{nb}@{k}",) if nb and has(x))
        c = e.emit(InstrKind.COMPUTE, f"{g}.compute", tuple(deps), segment=f"fwd:{b}", micro=k, allocs=allocs,
                   workspace=self.ws("fwd", b))
        for a in allocs:
            e.where[(a, g)] = c
        done = [c]
        if has(x_in):
            s = e.move(x_in, g, "dram", (c,))
            done.append(e.free(x_in, g, (s, c)))
        self.ring.append(max(done))
        self.frees.append(max([e.free(x, g, (c,)) for x in self.state[b]] or [c]))

    def backward(self, b: str, k: int, g: str) -> None:
        """b's backward on GPU g for microbatch k: the parameters streamed in again, the block
        recomputed from its checkpoint, then its gradient's blocking copy to DRAM."""
        e, has, order = self.e, self.has, self.order
        deps = self.load(b, g)
        deps.append(self.flushed)
        x_in = f"X:{b}@{k}"
        if has(x_in):
            deps.append(e.move(x_in, "dram", g, (self.ring_gate(),)))
            e.free(x_in, "dram", (deps[-1],))
        if has(f"A:{b}@{k}"):
            deps.append(e.emit(InstrKind.RECOMPUTE, f"{g}.compute", tuple(deps), segment=f"fwd:{b}", micro=k,
                               allocs=(f"A:{b}@{k}",), workspace=self.ws("fwd", b)))
        nb = order[order.index(b) + 1] if b != order[-1] else None
        if nb and has(f"H:{nb}@{k}"):
            deps.append(e.where.get((f"H:{nb}@{k}", g)))
        allocs = tuple(x for x in (f"G:{b}@{k}", f"T:{b}@{k}", f"H:{b}@{k}") if has(x))
        c = e.emit(InstrKind.COMPUTE, f"{g}.compute", tuple(deps), segment=f"bwd:{b}", micro=k, allocs=allocs,
                   workspace=self.ws("bwd", b))
        for a in allocs:
            e.where[(a, g)] = c
        done = [c]
        for x in (f"A:{b}@{k}", f"X:{b}@{k}") + ((f"H:{nb}@{k}",) if nb and has(f"H:{nb}@{k}") else ()):
            if has(x):
                done.append(e.free(x, g, (c,)))
        until = {t for t in order if has(f"T:{t}@{k}")
                 and self.prof[self.profile_of[t]].carried_until == self.profile_of[b]}
        for t in sorted(until):
            done.append(e.free(f"T:{t}@{k}", g, (c,)))
        self.frees.append(max([e.free(x, g, (c,)) for x in self.state[b]] or [c]))
        if has(f"G:{b}@{k}"):
            s = e.move(f"G:{b}@{k}", g, "dram", (c,))
            done.append(e.free(f"G:{b}@{k}", g, (s,)))
            self.arrived.setdefault(b, []).append(s)
            self.flushed = s  # a blocking copy: the backward goes on once it is done
        self.ring.append(max(done))

    def updates(self) -> None:
        """After every GPU's backward, sub-group by sub-group (stage3.py `step`): each block's CPU
        update of the GPUs' summed gradients."""
        e = self.e
        for b in reversed(self.order):
            if b not in self.arrived:
                continue
            fresh = (f"P:{b}",) if self.mixed and self.home[f"P:{b}"] != "dram" else ()
            u = e.emit(InstrKind.OPTIMIZER_STEP, "cpu.opt", tuple(self.arrived[b]) + tuple(self.finished), segment=b,
                       dst="cpu", allocs=fresh)
            for k in range(len(self.gpus)):
                e.free(f"G:{b}@{k}", "dram", (u,))
