"""How `tensorstow execute` runs a plan: the data, the run's length, the learning-rate schedule,
checkpoints and logs, as one typed, keyword-only dataclass (a docstring under each field).

`execute`'s flags are derived from it. A recipe file's `[execute]` table holds the same keys; a
plan made from a recipe records them (`Plan.run`), and `execute` takes, for each field, the
first of: its flag, the recipe file it is given, the plan's record, the default below.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tensorstow.errors import TensorstowError
from tensorstow.schema.options import LR_SCHEDULERS
from tensorstow.schema.typed import decode

MODES = ("auto", "sync", "overlap")
GRAPHS = ("auto", "on", "off")
ARENA = ("auto", "on", "off")
"""`execute --arena`: `executor.executor.open_device_arena`."""


@dataclass(frozen=True, kw_only=True)
class Run:
    data: str = "synthetic"
    """Token file (uint16 nanoGPT train.bin, or .npy), 'synthetic', or examples with labels: JSONL
    (input_ids/labels, prompt/completion or text per line) or a `datasets` save_to_disk directory
    (docs/training.md)."""
    steps: int | None = None
    """Train until this many optimizer steps are committed (default: epochs epochs of the data's
    examples; one of the two is needed)."""
    epochs: int | None = None
    """With examples and no steps: the run is this many epochs (default: none)."""
    tokenizer: str | None = None
    """Tokenizer directory for text examples (default: the hf: model's directory)."""
    chat_template: str | None = None
    """A Jinja chat template file for conversational examples (`messages`, or prompt and completion
    as lists of messages) (default: the tokenizer's own, from tokenizer_config.json or
    chat_template.jinja)."""
    loss_on: str = "assistant"
    """Which tokens of a text or conversational example are labels: assistant (the assistant's tokens
    of `messages`, which the chat template marks with {% generation %}; the completion of a prompt
    and completion, TRL's completion-only loss) or all (every token)."""
    shuffle: bool = True
    """Each epoch visits the examples in torch.randperm order (seeded seed + epoch); --no-shuffle:
    in file order."""
    seed: int = 0
    """torch.manual_seed right before the model factory; also seeds the epochs' order."""
    mode: str = "auto"
    """overlap: one worker per stream; sync: one instruction at a time in program order (the
    reference); auto: on CUDA overlap for a plan with SSD traffic, or with DRAM traffic and
    computations long enough for the host to keep ahead (a median of 1.5 ms predicted), else
    sync; on a CPU device tier overlap where the compute threads leave a core for the other lanes,
    else sync."""
    arena: str = "auto"
    """Every copy on the device a view of one arena the plan sizes, at the offset the plan's order
    gives it (no allocation in the step, the addresses the same every step): auto on CUDA where it fits
    the device budget with what a segment holds beside it, on (refuse a plan where it does not), off."""
    graphs: str = "auto"
    """Capture the step as a CUDA graph after 2 eager steps and replay it, one launch a step:
    auto where nothing in the step needs the host (every buffer resident on the GPU, the optimizer
    there, no fp16 loss scaling or dropout), and where something does but the device arena is in
    use, each segment as a graph of its own (one launch a segment); on (the whole step: refuse a
    plan where it cannot), off."""
    device: str | None = None
    """Where the device tier lives: cuda, or cpu (host memory held under the plan's GPU budget:
    every movement still happens) (default: CUDA when there is one)."""
    io_engine: str = "auto"
    """The SSD store's asynchronous I/O engine: cpp (a C++ thread pool, built on first use; a failed
    build is an error), python (os.preadv/os.pwritev threads), or auto (cpp where it builds)."""
    cpu_adam: str = "auto"
    """The CPU optimizer's update: cpp (the fused C++ kernel, built on first use; a failed build is an
    error), torch (torch's AdamW), or auto (cpp where it builds)."""
    malloc: str = "tuned"
    """tuned: glibc malloc keeps freed buffers for the next step instead of unmapping them
    (executor/malloc.py); default: the allocator as it is."""
    state_dir: str | None = None
    """Checkpoint directory (SSD-resident state lives there); resumes from it (default: none; a
    plan that homes state on the SSD needs one)."""
    checkpoint_every: int = 1
    """Commit a full checkpoint to the state dir every N steps, and after the last."""
    hw_mismatch: str = "refuse"
    """A plan made for other hardware than the device it would run on here (a GPU's model or
    memory, or a GPU plan on a machine without CUDA): refuse (say which fields differ), or ok (run
    it anyway: its predictions do not hold here)."""
    restart: bool = False
    """Start over in the state dir: delete the training state and description tensorstow keeps
    there (never other files), then train from step 0. Without it a state dir is resumed, and one
    whose state cannot be read is refused."""
    resume_changed: str | None = None
    """Resume a state dir although these groups of its run's recorded inputs differ, comma-separated:
    data, order (seed, shuffle), length (steps, epochs), schedule (lr, lr_scheduler,
    warmup_steps, min_lr_ratio), eval (eval_data, eval_every, eval_batches); docs/training.md,
    Resuming, says what each accepted change means (default: none: a resume with other inputs is
    refused)."""
    log_json: str | None = None
    """Append one JSON object per step to this file (default: not written)."""
    report_to: str = "none"
    """tensorboard: write each step's scalars (train/loss, train/learning_rate, train/grad_norm,
    train/tokens_per_second, the measured and predicted step, each lane's busy time, eval/loss) as
    TensorBoard events; none: no report."""
    logging_dir: str | None = None
    """Directory of the TensorBoard events (default: the state dir's runs/)."""
    trace: str | None = None
    """Write the measured timeline of the last step (Perfetto JSON) (default: not written)."""
    nproc: int = 1
    """Processes, one per GPU: a multi-GPU plan (mobius, gpipe) needs one per GPU of its hardware, a
    data-parallel plan (--dp N) one per rank (across machines: torchrun)."""
    eval_data: str | None = None
    """Held-out data, in any form --data takes, evaluated every eval_every steps: its mean loss and
    perplexity logged, as `Executor.evaluate` computes them (default: none)."""
    eval_every: int = 0
    """Evaluate eval_data after every N optimizer steps (0: only after the last step)."""
    eval_batches: int | None = None
    """Batches of eval_data per evaluation, in file order (default: all of its examples; a token
    file needs it)."""
    lr: float | None = None
    """Peak learning rate (default: the plan's)."""
    lr_scheduler: str | None = None
    """The learning rate over the run's optimizer steps, transformers' get_scheduler semantics
    (default: the plan's)."""
    warmup_steps: int | None = None
    """Optimizer steps of linear warmup from 0 (default: the plan's)."""
    min_lr_ratio: float | None = None
    """linear and cosine end at this fraction of the peak instead of 0 (default: the plan's)."""

    def __post_init__(self):
        """The ranges a run's types cannot say, however the run is made (flags, a recipe, the API)."""
        if not 0 <= self.seed < 2 ** 63:  # torch.manual_seed and the data's generators take no other
            raise TensorstowError(f"seed {self.seed} is outside [0, 2**63) (--seed, or a recipe's seed =): give an "
                                  f"integer from 0 to 2**63 - 1")
        if self.lr is not None and not 0 <= self.lr < math.inf:  # nan or inf trains to NaN, or fails at an update
            raise TensorstowError(f"--lr must be a finite number >= 0, got {self.lr}")

    def to_json(self) -> dict:
        """The fields that differ from their defaults."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}

    @staticmethod
    def from_json(d: dict, where: str = "run") -> "Run":
        return decode(Run, d, where)


CHOICES = {"mode": MODES, "graphs": GRAPHS, "arena": ARENA, "lr_scheduler": LR_SCHEDULERS, "hw_mismatch": ("refuse", "ok"),
           "device": ("cuda", "cpu"), "io_engine": ("auto", "cpp", "python"), "cpu_adam": ("auto", "cpp", "torch"),
           "malloc": ("tuned", "default"), "loss_on": ("assistant", "all"),
           "report_to": ("none", "tensorboard")}
"""The fields that take one of a few names."""
