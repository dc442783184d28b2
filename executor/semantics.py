"""What a step computes besides its instructions, as eager PyTorch and the Hugging Face Trainer
define it: the weight of each microbatch's loss, the gradient norms and clipping
(`torch.nn.utils.clip_grad_norm_`), the learning rate of each update (a schedule, parameter
groups), fp16 loss scaling (`executor.amp`, GradScaler's semantics), the Adam update itself, and
whether a speculating plan's updates stand or are redone.

The runtime (`executor.runtime`) calls in here from its handlers: a backward's gradients are
checked and their norms recorded (`record_norms`), an `optimizer_step` runs `update`. The
executor (`executor.executor`) opens and closes each step (`begin`, `finish`). Nothing here
moves a buffer between tiers.
"""
from __future__ import annotations

import contextlib

import torch

from tensorstow.errors import TensorstowError
from tensorstow.executor.adam import SubgroupAdam
from tensorstow.executor.amp import LossScaler, distinct
from tensorstow.executor.lr import LRSchedule
from tensorstow.executor.program import Program
from tensorstow.schema.schedule import parent_of


class StepSemantics:
    """The step's loss, norms, clip, learning rate, loss scale and updates (the module docstring)."""

    def __init__(self, program: Program, device: torch.device, lr_schedule: LRSchedule | None = None,
                 total_steps: int | None = None):
        o = program.plan.options
        self.program, self.M = program, program.M
        self.ignored = torch.tensor(sorted(program.ignore_index), dtype=torch.long)
        """Labels the loss leaves out."""
        self.lr_schedule = lr_schedule or LRSchedule(o.lr_scheduler, o.lr, o.warmup_steps, total_steps or 0,
                                                     o.min_lr_ratio)
        """Each update's learning rate, from the updates taken before it (`opt_steps`); None: the
        rate `set_lr` gave."""
        self.lr_step = 0
        """The update the schedule last gave its rate for."""
        self.adam = {b: SubgroupAdam(o) for b, ps in program.block_params.items() if ps}
        self.lr = self.lr_schedule(0)
        """The learning rate of the last step's update (of the next one before the first step)."""
        self.scaler = LossScaler(o, device) if program.precision == "fp16-mixed" else None
        """fp16-mixed: dynamic loss scaling (executor.amp, GradScaler's semantics)."""
        self.max_grad_norm = o.max_grad_norm
        self.opt_steps = 0
        """Optimizer updates taken: Adam's step count (fewer than the steps done when fp16 loss
        scaling skipped some)."""
        self.evaluating = False
        """Within `Executor.evaluate`: steps leave their updates out."""
        self.redoing = False
        """Running the redo program: SSD reads take the last commit's version, updates clip."""
        self.speculation: str | None = None
        """A speculating plan's last step: "held" (the clip did not fire: the speculated updates
        stand) or "redone" (they were redone from the last commit with the clipped gradients)."""
        self.norms: dict[str, torch.Tensor] = {}
        """This step's gradient norms by parameter, as each block's backward makes them."""
        self.clip: torch.Tensor | None = None
        self.grad_norm: float | None = None
        """The last step's global gradient norm (clip_grad_norm_'s total_norm, before clipping;
        fp16-mixed: of the unscaled gradients; with microbatches, of their sum); None before
        the first step, and for plans on several processes (not computed yet)."""
        self.losses: list = [None] * self.M
        """This step's loss per microbatch, as its forward makes it."""
        self.weights: list[float] = [1.0]
        """This step's microbatch weights (`micro_weights`)."""

    # ---- a step's begin and end -------------------------------------------------------------
    def check_batch(self, idx: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """idx and targets (and a packing plan's positions) are what the plan was made for: int64 of
        its shape, token ids in the model's vocabulary (labels the loss ignores aside), positions
        from 0 below seq."""
        m, vocab = self.program.plan.model, self.program.vocab
        rows = m.batch * self.M * self.program.dp
        packing = self.program.plan.options.packing
        if packing != (positions is not None):
            raise TensorstowError("the plan packs several examples a window (--packing): give each token's position "
                                  "too (Examples.batches(..., positions=True))" if packing else
                                  "positions given, but the plan runs one example a row: plan with --packing")
        for what, t in (("idx", idx), ("targets", targets), *((("positions", positions),) if packing else ())):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (rows, m.seq) \
                    or t.dtype != torch.long:
                raise TensorstowError(f"{what} must be an int64 tensor of shape ({rows}, {m.seq}) "
                                      + (f"({self.M} microbatches of {m.batch}) " if self.M > 1 else "")
                                      + (f"(the step's rows on all {self.program.dp} ranks) " if self.program.dp > 1 else "")
                                      + f"as planned, got {getattr(t, 'dtype', type(t))} "
                                      f"{tuple(getattr(t, 'shape', ()))}")
        if packing and not bool(((positions >= 0) & (positions < m.seq)).all()):
            raise TensorstowError(f"positions must lie in [0, {m.seq}) (each token's place in its document)")
        if vocab is not None:
            token = (targets >= 0) & (targets < vocab)
            if not bool(((idx >= 0) & (idx < vocab)).all()) or not bool((token | torch.isin(targets, self.ignored)).all()):
                raise TensorstowError(f"idx/targets hold token ids outside the model's vocabulary "
                                      f"[0, {vocab}) (labels its loss ignores: "
                                      f"{', '.join(map(str, self.ignored.tolist()))})")

    def begin(self, targets: torch.Tensor) -> None:
        """A step starts: its microbatch weights, its update's learning rate, no inf/NaN seen, no
        norm recorded."""
        self.weights = self.micro_weights(targets)
        self.losses = [None] * self.M
        if self.lr_schedule is not None:
            self.lr_step = self.opt_steps
            self.apply_lr(self.lr_schedule(self.opt_steps))
        if self.scaler is not None:
            self.scaler.begin_step()
        self.norms.clear()
        self.clip, self.grad_norm = None, None

    def finish(self) -> None:
        """A training step's end: its global norm; the update counted unless fp16 loss scaling
        skipped it (GradScaler.update)."""
        if self.scaler is None or not self.scaler.update():
            self.opt_steps += 1

    def measure_norm(self) -> None:
        """The step's global norm, once its backward is done (`grad_norm`)."""
        if self.norms:
            self.grad_norm = float(self.total_norm())

    @contextlib.contextmanager
    def evaluation(self):
        """Within it, steps leave their updates out, and the last step's norm and clip are kept."""
        norm, clip = self.grad_norm, self.clip
        self.evaluating = True
        try:
            yield
        finally:
            self.evaluating = False
            self.grad_norm, self.clip = norm, clip

    def micro_weights(self, targets: torch.Tensor) -> list[float]:
        """Per microbatch k of a step's `targets`, the weight w_k of its loss (the mean over its
        labels) in the step's: its count of labels the loss does not ignore over the step's count,
        so the step's loss is the sum of every token loss over the count of labels in all M
        microbatches (the Hugging Face Trainer's `num_items_in_batch` normalisation; eager:
        `(loss_k * w_k).backward()` per microbatch). 1/M each where no label counts; [1.0] for one. Data parallel: `targets` are
        the step's rows on every rank, dp x M microbatches, rank r's M after the r x M before
        them (one process accumulating all dp x M in that order trains the same); the weights
        are this rank's."""
        dp = self.program.dp
        if self.M * dp == 1:
            return [1.0]
        counts = [int((~torch.isin(t, self.ignored)).sum()) for t in targets.chunk(self.M * dp)]
        total = sum(counts)
        weights = [n / total if total else 1 / (self.M * dp) for n in counts]
        return weights[self.program.rank * self.M:(self.program.rank + 1) * self.M] if dp > 1 else weights

    def loss_terms(self) -> list[float]:
        """This rank's microbatches' terms loss_k * w_k of the step's loss (`step_loss`)."""
        return [float(v * w) for v, w in zip(self.losses, self.weights)]

    def step_loss(self) -> float | None:
        """The step's loss: sum over its microbatches of loss_k * w_k (`micro_weights`), in
        microbatch order, leaving out those whose every label is ignored (their mean is 0 / 0 and
        their weight 0); None on a rank that does not compute the loss."""
        if any(v is None for v in self.losses):
            return None
        if self.M == 1:
            return float(self.losses[0])
        return sum(t for t, w in zip(self.loss_terms(), self.weights) if w)

    # ---- gradients: norms, clipping, speculation --------------------------------------------
    def record_norms(self, b: str, grads: dict[str, torch.Tensor]) -> None:
        """Block b's gradients' 2-norms as torch.nn.utils.clip_grad_norm_ takes them from eager's
        fp32 `.grad` (`torch._foreach_norm`): a 16-bit gradient cast to fp32, fp16-mixed's unscaled
        as GradScaler.unscale_ computes it (times 1/scale in fp32), one temporary copy at a time;
        for the step's global norm (`total_norm`)."""
        j = self.program.joint
        inv = None if self.scaler is None else self.scaler.scale.double().reciprocal().float()
        rows = self.program.unit_rows.get(b)
        if rows is not None and rows[0]:
            return  # a layer's first unit takes its weights' norms, whole (`grads`: `DeviceTier.wholes`)
        get = grads.__getitem__ if rows is None else (lambda r: grads[r][0])
        for p in self.program.block_params.get(b, ()):
            if p not in j.grad:
                continue
            g = j.materialize(j.grad[p], get).float().contiguous()  # eager's .grad has its parameter's layout, and a
            # norm's sum runs in memory order (an embedding's LoRA factor A gets a transposed gradient)
            if inv is not None:
                g = g * inv.to(g.device)  # a copy: G itself is unscaled at its update
            self.norms[p] = torch._foreach_norm([g], 2.0)[0]

    def total_norm(self) -> torch.Tensor:
        """clip_grad_norm_'s total_norm: the 2-norm of the parameters' norms stacked in the model's
        parameter order."""
        norms = [self.norms[p] for p in self.program.param_order if p in self.norms]
        dev = norms[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms]), 2.0)

    def clip_coef(self) -> torch.Tensor:
        """clip_grad_norm_'s clip_coef_clamped, once a step (every gradient is in by the first
        update: the plan makes the updates wait for the last backward)."""
        if self.clip is None:
            self.clip = torch.clamp(self.max_grad_norm / (self.total_norm() + 1e-6), max=1.0)
        return self.clip

    def speculation_stands(self) -> bool:
        """A speculating plan's step, its norm now known: whether its speculated updates stand (the
        clip does not fire and fp16 gradients did not overflow) rather than being redone."""
        overflow = self.scaler is not None and self.scaler.skip()  # every gradient is checked by now
        return not overflow and (self.max_grad_norm <= 0 or float(self.clip_coef()) >= 1.0)

    # ---- the learning rate ------------------------------------------------------------------
    def group_lr(self, scale: float) -> float:
        """The learning rate of a parameter group whose rate is lr x `scale` (`Options.param_groups`):
        as torch's LambdaLR, the group's base rate times the schedule's factor."""
        s = self.lr_schedule
        return self.lr * scale if s is None else (s.lr * scale) * s.factor(self.lr_step)

    def apply_lr(self, lr: float) -> None:
        self.lr = lr
        for adam in self.adam.values():
            adam.lr = lr

    # ---- the update -------------------------------------------------------------------------
    def updates(self, b: str) -> bool:
        """Whether block b's `optimizer_step` updates it in this step: not in an evaluation, and
        not after an fp16 overflow (a speculated update runs and is judged after the step)."""
        speculative = parent_of(b) in self.program.speculated and not self.redoing
        return not (self.evaluating or self.scaler is not None and not speculative and self.scaler.skip())

    def update(self, b: str, grads, states, master, on_dev: bool, dev, fresh_p, scalars=None) -> set[str]:
        """One Adam/AdamW update of block b's trained parameters from the copies `grads` (G:b) and
        `states` (OS:b) into `master` (M:b, or P:b in fp32), on the device tier `dev` or the host;
        returns the compute-copy entries the update wrote itself (the fast CPU kernel's fused
        downcast into `fresh_p`). `scalars`: a captured graph's step count and rates, read from
        memory (executor.graphs)."""
        prog = self.program
        j, mixed = prog.joint, prog.mixed
        ph, key = j.placeholder, prog.row_key(b)
        trained = [p for p in prog.block_params[b] if p in j.grad]  # no gradient: torch.optim skips it too
        if prog.dp > 1:  # data parallel: this rank's rows of each (`Program.shard`), a rank with none skips it
            trained = [p for p in trained if prog.shard(p)[1] > prog.shard(p)[0]]
        params, gs, moments, held = [], [], [], []
        # a speculated update's gradients are kept for a redo: unscaled on copies, never in place
        kept = self.scaler is not None and parent_of(b) in prog.speculated and not self.redoing
        # the fast CPU update reads a 16-bit gradient in its width and scales it as it reads
        # (`adamw_steps_`): no fp32 copy of it is allocated and written first (benchmarks/RESULTS.md
        # "On a GPU")
        direct = mixed and not on_dev and not self.adam[b].exact and self.scaler is None
        clipping = self.max_grad_norm > 0 and (self.redoing or parent_of(b) not in prog.speculated)
        try:
            for p in trained:
                g = j.materialize(j.grad[p], lambda r: grads[key(r)])
                if any(st == 0 and n > 1 for st, n in zip(g.stride(), g.shape)):
                    g = g.contiguous()  # an expanded gradient (of `w.sum(0)`): its elements, one each
                if prog.dp > 1:
                    g = _rows(g, *prog.shard(p))
                if kept and g.dtype == torch.float32:
                    g = g.clone()
                if mixed and g.dtype != torch.float32 and not direct:
                    g = g.float()
                    if on_dev:
                        dev.hold(g, f"{p} fp32 gradient")
                        held.append(g)
                m, v = states[key(f"{p}.exp_avg")], states[key(f"{p}.exp_avg_sq")]
                w = master[key(p) if mixed else key(ph[p])]
                if prog.dp > 1:  # the shards' first rows hold it; fp32's P is whole
                    n = g.numel()
                    w = w.view(-1)[:n] if mixed else _rows(w, *prog.shard(p))
                    m, v = m.view(-1)[:n], v.view(-1)[:n]
                params.append(w)
                gs.append(g)
                moments.append((m, v))
            if self.scaler is not None:
                self.scaler.unscale_(gs)
            grad_scale = 1.0
            if clipping and direct:
                grad_scale = float(self.clip_coef())
            elif clipping:
                # clip_grad_norm_: every gradient times min(1, max / (norm + 1e-6)); a speculated
                # update runs with factor 1 before the norm is known (`speculation_stands`)
                unique = distinct(gs)
                torch._foreach_mul_(unique, self.clip_coef().to(unique[0].device))
            out16, written = None, set()
            if mixed and not on_dev and not self.adam[b].exact:
                out16 = [(fresh_p[key(ph[p])] if prog.dp == 1 else _rows(fresh_p[key(ph[p])], *prog.shard(p)))
                         if fresh_p[key(ph[p])].dtype != torch.float32 else None for p in trained]
                written = {key(ph[p]) for p, o in zip(trained, out16) if o is not None}
            # torch's single-tensor Adam allocates two parameter-sized temporaries (sqrt, denom)
            scratch = 2 * max((t.numel() * 4 for t in params), default=0) if on_dev and self.adam[b].exact else 0
            with dev.reserve(scratch, f"Adam scratch of {b}") if scratch else contextlib.nullcontext():
                self.adam[b].step(params, gs, moments, self.opt_steps if scalars is None else scalars.step_count,
                                  out16, groups=[prog.groups[p] for p in trained], lr_of=self.group_lr,
                                  grad_scale=grad_scale, rates=None if scalars is None else scalars.rates)
        finally:
            for g in held:
                dev.release(g)
        return written


def _rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Elements [a, b) of `t` flattened, whole rows of it (a data-parallel rank's): a view where `t`
    is contiguous, else a copy of those rows only (a gradient the graph makes transposed)."""
    if t.is_contiguous() or t.dim() == 0:
        return t.reshape(-1)[a:b]
    row = t[0].numel() if t.shape[0] else 1
    return t.narrow(0, a // row, (b - a) // row).reshape(-1)
