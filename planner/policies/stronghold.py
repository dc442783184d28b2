"""`stronghold`: a working window of layers streamed through the GPU (Sun et al., SC'22).

STRONGHOLD §III-C..E, as tensorstow decisions:
- Layer parameters and optimizer states live in DRAM (STRONGHOLD keeps the SSD out of the
  loop, §III-C; its optimizer states are in CPU RAM, footnote 1); only a window of layers is
  on the GPU at a time.
- The first and the last blocks (embedding `pre`, head `post`) stay on the GPU (Fig. 3 caption)
  and are updated there (when memory is short, their states move to DRAM and the CPU updates
  them [OURS]); every layer is updated by the CPU as soon as its gradient leaves the
  window, concurrently with the rest of backward (§III-E1: `overlap_optimizer`).
- Window size m: the smallest m meeting the hard time constraints of P1 (Eq. 1b) and P2
  (Eq. 2b) at every window position, with the cost model's times; the plan's memory is then
  checked by simulation, which plays the role of (1c)/(2c). If the window does not fit,
  STRONGHOLD takes "the largest m the GPU memory allows" (§III-D, last paragraph).

Window and `prefetch`: while layer i computes, the window holds layers i..i+m-1 and layer
j = i+m is being fetched into one more buffer (the s_fp^j term of Eq. 1c), so m layers are
loaded ahead of use: `prefetch = m`, m+1 parameter buffers on the GPU. In `lower()` the load
of a streamed block waits for the block `prefetch + 1` places earlier to be freed, so it
overlaps exactly the m computes that the left side of (1b)/(2b) sums.

Activations [OURS]: STRONGHOLD keeps or checkpoints activations like the training it wraps.
We keep them on the GPU when the plan fits, else keep each block's input checkpoint on the
GPU and recompute the block in backward (t_bp then includes the recomputation, footnote 2,
and a window of m >= 1 layers holds the single layer between two checkpoints, §III-C).

Not modelled: STRONGHOLD keeps the first window resident across the step boundary and
updates those m layers on the GPU (§III-E1); here every layer is streamed and CPU-updated.
t_async = 0: the replay loop has no per-layer hook overhead.
"""
from __future__ import annotations

from dataclasses import dataclass

from tensorstow.ir.graph import lsum
from tensorstow.planner import cost
from tensorstow.planner.passes import schedule
from tensorstow.schema.schedule import BlockDecision, Decisions


@dataclass(frozen=True)
class LayerTimes:
    """STRONGHOLD §III-D notation, per streamed layer in forward order (seconds)."""

    t_fp: tuple[float, ...]
    """GPU forward time of layer i."""
    t_bp: tuple[float, ...]
    """GPU backward time of layer i, recomputation included (footnote 2)."""
    t_c2g: tuple[float, ...]
    """DRAM -> GPU time of layer i's parameters and constants (fetched in FP and again in BP)."""
    t_g2c: tuple[float, ...]
    """GPU -> DRAM time of layer i's gradient in BP. In FP nothing goes back: the DRAM copy
    of the fp16 parameters is still valid, so the window just drops them."""


def layer_times(problem, layers: list[str], activations: str) -> LayerTimes:
    hw = problem.hw
    prof = [problem.profiles[problem.profile_of[b]] for b in layers]
    recompute = activations == "recompute"
    return LayerTimes(
        t_fp=tuple(p.fwd_time_s for p in prof),
        t_bp=tuple(p.bwd_time_s + (p.fwd_time_s if recompute else 0.0) for p in prof),
        t_c2g=tuple(cost.transfer_time(p.param_bytes + p.const_bytes, "dram", "gpu0", hw) for p in prof),
        t_g2c=tuple(cost.transfer_time(p.grad_bytes, "gpu0", "dram", hw) for p in prof))


def p1_holds(t: LayerTimes, m: int) -> bool:
    """STRONGHOLD Eq. 1b at every position: the window's FP time hides the fetch of layer j."""
    # Eq. 1b:  sum_{i in window} t_fp^i >= t_c2g^j
    return all(lsum(t.t_fp[j - m:j]) >= t.t_c2g[j] for j in range(m, len(t.t_fp)))


def p2_holds(t: LayerTimes, m: int) -> bool:
    """STRONGHOLD Eq. 2b at every position, read as the digest's [OURS]: in BP the window's
    time hides both the fetch of layer j and the gradient offload of the last finished layer."""
    bp, c2g, g2c = t.t_bp[::-1], t.t_c2g[::-1], t.t_g2c[::-1]
    # Eq. 2b:  sum_{i in window} t_bp^i >= max(t_c2g^j, t_g2c^{last finished})
    return all(lsum(bp[j - m:j]) >= max(c2g[j], g2c[j - m - 1] if j > m else 0.0)
               for j in range(m, len(bp)))


def soft_holds(t: LayerTimes, m: int) -> tuple[bool, bool]:
    """Eq. 1d and 2d at every position: the link keeps pace, so buffers recycle in time."""
    n = len(t.t_fp)
    # Eq. 1d:  sum t_fp^i >= sum t_c2g^i + sum t_g2c^i   (FP sends nothing back: t_g2c = 0)
    fp = all(lsum(t.t_fp[s:s + m]) >= lsum(t.t_c2g[s:s + m]) for s in range(n - m + 1))
    # Eq. 2d:  sum t_bp^i >= sum t_g2c^i + sum t_c2g^i
    bp = all(lsum(t.t_bp[s:s + m]) >= lsum(t.t_g2c[s:s + m]) + lsum(t.t_c2g[s:s + m])
             for s in range(n - m + 1))
    return fp, bp


def window_size(t: LayerTimes) -> int:
    """P1 + P2: the smallest m meeting Eq. 1b and Eq. 2b at every position.

    m = n (the whole model in the window) leaves no layer j outside it and always qualifies."""
    n = len(t.t_fp)
    return next((m for m in range(1, n) if p1_holds(t, m) and p2_holds(t, m)), max(n, 1))


def decisions(problem, m: int, activations: str, pinned_update: str,
              notes: tuple[str, ...] = ()) -> Decisions:
    """Window of m streamed layers. `pre`/`post` keep their parameters on the GPU; with
    pinned_update "gpu" their optimizer states stay there too and the GPU updates them, with
    "cpu" their states live in DRAM and the CPU updates them like the layers."""
    pinned_states = "gpu" if pinned_update == "gpu" else "dram"
    blocks = {}
    for b in problem.order:
        if problem.graph.block(b).kind == "layer":
            blocks[b] = BlockDecision(params="dram", states="dram", optimizer="cpu",
                                      activations=activations, checkpoint="gpu")
        else:
            blocks[b] = BlockDecision(params="gpu", states=pinned_states, optimizer=pinned_update,
                                      activations="keep", checkpoint="gpu")
    return Decisions(policy="stronghold", blocks=blocks, prefetch=m, overlap_optimizer=True,
                     serialize_optimizer=False, notes=notes)


def plan(problem) -> Decisions:

    layers = [b for b in problem.order if problem.graph.block(b).kind == "layer"]
    times = {a: layer_times(problem, layers, a) for a in ("keep", "recompute")}

    def fits(d: Decisions) -> bool:
        return not schedule(problem, d).over_capacity()

    def explain(m: int, acts: str, pinned: str, why: str) -> tuple[str, ...]:
        t = times[acts]
        soft_fp, soft_bp = soft_holds(t, m)
        return (
            f"window m = {m} layers ({why}); prefetch = m: m+1 parameter buffers on the GPU, "
            f"the window plus the incoming layer j (STRONGHOLD Eq. 1c)",
            f"per layer: t_fp {_ms(t.t_fp)}, t_bp {_ms(t.t_bp)}, t_c2g {_ms(t.t_c2g)}, "
            f"t_g2c {_ms(t.t_g2c)}; hard P1 (1b) {'met' if p1_holds(t, m) else 'violated'}, "
            f"P2 (2b) {'met' if p2_holds(t, m) else 'violated'}",
            f"soft (1d) {'met' if soft_fp else 'violated'}, (2d) {'met' if soft_bp else 'violated'}"
            + ("" if soft_fp and soft_bp else
               ": a layer's transfers outlast its compute, so the host link bounds the step at any m"),
            "activations kept on the GPU" if acts == "keep" else
            "activations recomputed from block-input checkpoints kept on the GPU (memory is short)",
            "layer parameters and optimizer states in DRAM, CPU Adam per layer as its gradient "
            "leaves the window (STRONGHOLD §III-E1)",
            "pre/post pinned on the GPU with their optimizer states, updated on the GPU"
            if pinned == "gpu" else
            "pre/post parameters pinned on the GPU; their optimizer states in DRAM and updated by "
            "the CPU (memory is short, and a CPU update is cheaper than moving 12 B/param both ways)",
            "not modelled: the first window staying resident across steps (§III-E1)")

    # Memory levels from most to least GPU memory; each first tries its analytic window.
    levels = (("keep", "gpu"), ("recompute", "gpu"), ("recompute", "cpu"))
    for acts, pinned in levels:
        m = window_size(times[acts])
        why = ("smallest m meeting P1 and P2" if m < len(layers) else
               "no smaller m meets P1 and P2, so the whole model is the window")
        d = decisions(problem, m, acts, pinned, explain(m, acts, pinned, why))
        if fits(d):
            return d
    # §III-D: no window meeting P1/P2 fits, so take the largest m the GPU memory allows.
    acts, pinned = levels[-1]
    for m in range(window_size(times[acts]) - 1, 0, -1):
        d = decisions(problem, m, acts, pinned,
                      explain(m, acts, pinned, "largest m that fits GPU memory; P1/P2 need more"))
        if fits(d):
            return d
    # Nothing fits: the smallest-memory decisions, so make_plan reports the byte breakdown.
    return decisions(problem, 1, acts, pinned,
                     explain(1, acts, pinned, "does not fit GPU memory even with one layer"))


def _ms(ts: tuple[float, ...]) -> str:
    if not ts:
        return "-"
    lo, hi = min(ts) * 1e3, max(ts) * 1e3
    return f"{lo:.3g} ms" if lo == hi else f"{lo:.3g}..{hi:.3g} ms"
