"""The training state between steps: where every buffer with a home tier (P, C, M, OS) lives, its
placement before the first step, the checkpoints and commits to the SSD store, and resuming from
the last commit (executor/ssd.py holds the store's crash-consistency protocol; executor/statedir.py
the state dir around it).

A store made with `executor.statedir.store_sizes` is a full checkpoint: with every commit the state
that lives off SSD and the random generator are written too, and resuming needs nothing else.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from tensorstow.errors import TensorstowError
from tensorstow.executor.aio import aligned_empty
from tensorstow.executor.amp import AMP
from tensorstow.executor.program import Program, model_state
from tensorstow.executor.ssd import SSDStore
from tensorstow.executor.statedir import RNG, rng_bytes, set_rng
from tensorstow.planner.pools import device_bytes
from tensorstow.executor.stores import DeviceTier, HostCopy, HostTier, SSDTier
from tensorstow.schema.schedule import STATE_KINDS, BufferKind, block_of, buffer_kind, units_by_block


class TrainingState:
    """One process's training state across steps (the module docstring), on its tiers."""

    def __init__(self, program: Program, dev: DeviceTier, host: HostTier, ssd: SSDTier, scaler=None):
        """`scaler`: fp16-mixed's loss scaler, whose state goes with every commit."""
        p = program
        self.homes, self.carried, self.layouts, self.gpu = p.homes, p.carried, p.layouts, p.gpu
        self.program = p
        self.dev, self.host, self.ssd, self.scaler = dev, host, ssd, scaler
        self.full_checkpoint = RNG in (getattr(ssd.store, "sizes", None) or {})
        """The store holds the whole state (`executor.statedir.store_sizes`), not only what lives on SSD."""

    @property
    def commits_in_background(self) -> bool:
        """One process with the SSD store: a step does not wait for its commit's syncs."""
        return self.program.comm is None and isinstance(self.ssd.store, SSDStore)

    def place(self, model: nn.Module, kinds=STATE_KINDS, skip_ssd: bool = False, values=None) -> None:
        """Every buffer with a home tier gets its initial copy there, block by block in forward
        order: P and C from the model's state (cast to the dtype the trace gives them), M the
        fp32 parameters, OS zeros. `values`: an iterator of (name, parameter value) in parameter
        order to take the parameters from instead of the model (out-of-core initialisation, e.g.
        `ir.models.gpt_init_stream`); each block's values are dropped once it is placed."""
        source = _Source(model, values)
        ph = self.program.joint.placeholder
        units = units_by_block(self.program.unit_rows)  # in the order the DRAM arena's replay places them
        for blk in self.program.graph.blocks:
            b = blk.name
            owners = [b, *units.get(b, ())]  # the block and its units: their parameters are the block's
            todo = [f"{k}:{o}" for o in owners for k in STATE_KINDS if k in kinds]
            todo = [n for n in todo if n in self.homes and not (skip_ssd and self.homes[n] == "ssd")]
            taken = [p for o in owners for p in self.program.block_params[o]] + self.program.block_consts.get(b, [])
            if not todo:
                if self.program.block_gpu[b] != self.gpu:  # another rank's block: an init stream is sequential
                    source.take(taken)
                continue
            state = source.take(taken)
            for name in todo:
                kind, home = buffer_kind(name), self.homes[name]
                if kind == "OS" and home != self.gpu:  # zeros, written in place: no temporaries
                    self.host.alloc(name, self.layouts[name]).blob.zero_()
                    if home == "ssd":
                        self.ssd.write(name, self.host.get(name))
                        self.host.drop(name)
                    continue
                vals = {}
                o = block_of(name)
                key, rows = self.program.row_key(o), self.program.unit_rows.get(o)
                for p in self.program.block_consts.get(b, ()) if kind == "C" else self.program.block_params[o]:
                    w = state[p].detach()
                    if rows is not None:
                        w = w[rows[0]:rows[1]]
                    if kind in ("M", "OS") and self.program.dp > 1:  # data parallel: this rank's shard
                        w = self.program.shard_value(p, w)
                    if kind in ("P", "C"):
                        vals[key(ph[p])] = w.to(self.program.joint.meta(ph[p])[0])
                    elif kind == "M":
                        vals[key(p)] = w.float()
                    else:
                        vals[key(f"{p}.exp_avg")] = torch.zeros_like(w, dtype=torch.float32)
                        vals[key(f"{p}.exp_avg_sq")] = torch.zeros_like(w, dtype=torch.float32)
                layout = self.layouts[name]
                if home == self.gpu:
                    self.dev.put_home(name, layout, device_bytes(self.program.plan.buffers[name]), vals)
                else:
                    self.host.store_from(name, layout, vals)
                    if home == "ssd":
                        self.ssd.write(name, self.host.get(name))
                        self.host.drop(name)
            del state
        self.host.peak = self.host.used
        if self.program.comm is not None and "P" in kinds:
            # Every rank drew the same initial values; from here each draws its own random numbers
            # (dropout), not the same masks in every stage: a seed from the shared stream, plus the rank.
            torch.manual_seed(int(torch.randint(2**62, (1,))) + self.program.rank)
        if self.ssd.store is not None and "OS" in kinds:
            if self.full_checkpoint:
                self.write_checkpoint(constants=True)
            self.write_scaler(0)
            self.ssd.store.commit(0)

    def resume(self, committed: int | None) -> int:
        """Read the state the SSD store committed at step `committed` back into its homes; returns
        the optimizer updates taken by then (Adam's step count: fewer than `committed` where fp16
        loss scaling skipped some)."""
        if committed is None:
            raise TensorstowError("resume=True but the SSD store holds no committed step "
                                  "(or the plan does not use the SSD tier)")
        if not self.full_checkpoint:
            elsewhere = sorted(n for n, t in self.homes.items() if buffer_kind(n) in (BufferKind.P, BufferKind.M, BufferKind.OS) and t != "ssd")
            if elsewhere:
                raise TensorstowError(f"cannot resume: the plan keeps {', '.join(elsewhere[:4])} outside the "
                                      f"SSD tier and this store is not a full checkpoint (make it with "
                                      f"executor.statedir.store_sizes, as `tensorstow execute` does)")
        for n in sorted(self.homes):
            home = self.homes[n]
            if home == "ssd":
                self.ssd.copies[n] = {}  # written contiguous (from parameters or an update)
            elif self.full_checkpoint:
                layout = self.layouts[n]
                c = self.host.alloc(n, layout)
                self.ssd.store.read(n, c.blob)
                if home == self.gpu:
                    self.dev.put_home(n, layout, device_bytes(self.program.plan.buffers[n]), {k: c[k] for k in layout.keys()})
                    self.host.drop(n)
        if self.full_checkpoint:
            blob = torch.empty(self.ssd.store.sizes[RNG], dtype=torch.uint8)
            self.ssd.store.read(RNG, blob)
            set_rng(blob)
        self.host.peak = self.host.used
        opt_steps = committed
        if self.scaler is not None:
            blob = torch.empty(16, dtype=torch.uint8)
            try:
                if not self.store_takes(AMP):
                    raise KeyError(AMP)
                self.ssd.store.read(AMP, blob)
            except (KeyError, OSError, TensorstowError):
                raise TensorstowError("cannot resume an fp16-mixed run: the store holds no loss-scaler state "
                                      "(AMP); size it with executor.statedir.store_sizes(plan), as "
                                      "`tensorstow execute` does") from None
            opt_steps = self.scaler.load_state(blob)
        return opt_steps

    def write_checkpoint(self, constants: bool = False, rng: torch.Tensor | None = None) -> None:
        """Write the training state that lives off SSD, and the random generator, into the store
        (SSD-resident buffers are the store's own). Constants never change: written at step 0."""
        st = self.ssd.store
        for name in sorted(self.homes):
            home = self.homes[name]
            if home == "ssd" or (buffer_kind(name) is BufferKind.C and not constants):
                continue
            if home == "dram":
                st.write(name, self.host.get(name).blob)
                continue
            layout = self.layouts[name]
            c = HostCopy(layout, aligned_empty(layout.nbytes))
            for k, v in self.dev.get(name).items():
                c.set(k, v)
            st.write(name, c.blob)
        st.write(RNG, rng_bytes() if rng is None else rng)

    def write_scaler(self, opt_steps: int) -> None:
        """fp16: the loss scaler's state goes with every commit, when the store has room for it
        (a store sized with `executor.statedir.store_sizes`, or a FileStore); without it the run
        trains but cannot be resumed (`_resume` says so)."""
        if self.scaler is not None and self.store_takes(AMP):
            self.ssd.store.write(AMP, self.scaler.state_bytes(opt_steps))

    def store_takes(self, name: str) -> bool:
        """Whether the SSD store has room for `name` (a sized store only for what it was made
        with; a FileStore for anything)."""
        sizes = getattr(self.ssd.store, "sizes", None)
        return sizes is None or name in sizes

    def commit(self, steps_done: int, opt_steps: int, wait: bool, rng: torch.Tensor | None = None) -> bool:
        """Commit step `steps_done` (`opt_steps` updates taken) to the store; `rng`: the random
        generator's state to record (default: now)."""
        if self.full_checkpoint:
            self.write_checkpoint(rng=rng)
        self.write_scaler(opt_steps)
        if wait or not self.commits_in_background:
            self.ssd.store.commit(steps_done)
        else:
            self.ssd.store.commit(steps_done, wait=False)
        if self.program.comm is not None:  # no rank writes the next step before every rank committed this one
            self.program.comm.barrier()
        return True

    def latest(self, buf: str):
        """The buffer's latest version: its home copy, or a carried one's DRAM copy."""
        home = "dram" if buf in self.carried else self.homes[buf]
        if home == self.gpu:
            return self.dev.get(buf)
        if home == "dram":
            return self.host.get(buf)
        layout = self.layouts[buf]
        c = HostCopy(layout, torch.empty(layout.nbytes, dtype=torch.uint8), self.ssd.copies[buf])
        self.ssd.store.read(buf, c.blob)
        return c

    def parameters(self) -> dict[str, torch.Tensor]:
        """The parameters by qualified name, as fp32 CPU tensors: trainable ones from their
        masters, frozen ones from their constants (buffers are not parameters)."""
        p, out = self.program, {}
        if p.dp > 1 and p.mixed:
            raise TensorstowError(f"the fp32 masters are sharded over the {p.dp} data-parallel ranks: export the "
                                  f"state dir (tensorstow export), which puts them together")
        rows: dict[str, list[tuple[tuple[int, int], torch.Tensor]]] = {}  # a weight's rows, unit by unit
        for b, params in p.block_params.items():
            if not params or p.block_gpu[b] != self.gpu:  # another rank's stage
                continue
            copy, key = self.latest(BufferKind.M.of(b) if p.mixed else BufferKind.P.of(b)), p.row_key(b)
            for q in params:
                v = copy[key(q if p.mixed else p.joint.placeholder[q])].detach().float().cpu().clone()
                if b in p.unit_rows:
                    rows.setdefault(q, []).append((p.unit_rows[b], v))
                else:
                    out[q] = v
        for q, parts in rows.items():
            out[q] = torch.cat([v for _, v in sorted(parts, key=lambda x: x[0])])
        for b, consts in p.block_consts.items():
            frozen = [c for c in consts if c in p.frozen and p.block_gpu[b] == self.gpu]
            if frozen:
                copy = self.latest(BufferKind.C.of(b))
                for c in frozen:
                    out[c] = copy[p.joint.placeholder[c]].detach().float().cpu().clone()
        return dict(sorted(out.items()))


class _Source:
    """Initial values of the model state: the model's own tensors, or (parameters) the next
    items of a stream in parameter order, each handed out once, or a mapping read on demand
    (`ir.hf.Checkpoint`)."""

    def __init__(self, model: nn.Module, stream):
        self.state = model_state(model)
        self.buffers = dict(model.named_buffers())
        self.stream, self.pending = stream, {}

    def take(self, names: list[str]) -> dict[str, torch.Tensor]:
        if self.stream is None:
            return {n: self.state[n] for n in names}
        if not hasattr(self.stream, "__next__"):  # a mapping read on demand (a checkpoint)
            return {n: self.buffers[n] if n in self.buffers else self._shaped(n, self.stream[n]) for n in names}
        out = {}
        for n in names:
            if n in self.buffers:
                out[n] = self.buffers[n]
                continue
            while n not in self.pending:
                try:
                    k, v = next(self.stream)
                except StopIteration:
                    raise TensorstowError(f"the initial values end before parameter {n}") from None
                self.pending[k] = v
            out[n] = self._shaped(n, self.pending.pop(n))
        return out

    def _shaped(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """`value`, refused unless it has the shape of the model's parameter `name`."""
        want = tuple(self.state[name].shape)
        if tuple(value.shape) != want:
            mismatch = getattr(self.stream, "mismatch", None)
            raise TensorstowError(mismatch(name, tuple(value.shape), want) if mismatch else
                                  f"the initial value of {name} is {tuple(value.shape)}, not the parameter's {want}")
        return value
