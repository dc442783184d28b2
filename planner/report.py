"""Capacity questions: sweeps over a hardware/option knob, the largest model that fits, and
a small dependency-free SVG line plot (LoHan Fig. 10 style)."""
from __future__ import annotations

import dataclasses
import functools
from html import escape

from tensorstow.errors import TensorstowError
from tensorstow.ir.models import PRESETS, gpt_param_count
from tensorstow.planner.plan import plan_problem
from tensorstow.planner.problem import build_problem
from tensorstow.schema.options import Options

SWEEP_KEYS = {"ssd_count": "ssds", "ssds": "ssds", "dram": "dram", "batch": "batch"}


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """`ssd_count=1..12`, `batch=1,2,4,8`, `dram=128GB..512GB` is not allowed: dram in GB."""
    key, _, rng = text.partition("=")
    if key not in SWEEP_KEYS or not rng:
        raise TensorstowError(f"--sweep '{text}': write KEY=A..B or KEY=a,b,c with KEY one of "
                              f"{sorted(SWEEP_KEYS)} (dram in GB)")
    try:
        if ".." in rng:
            a, b = (int(v) for v in rng.split(".."))
            values = list(range(a, b + 1))
        else:
            values = [int(v) for v in rng.split(",")]
    except ValueError:
        raise TensorstowError(f"--sweep '{text}': values must be integers") from None
    if not values or min(values) < (1 if key == "batch" else 0):
        raise TensorstowError(f"--sweep '{text}': empty range or negative value")
    return SWEEP_KEYS[key], values


def sweep(options: Options, hw, key: str, values: list[int]) -> list[dict]:
    rows = []
    for v in values:
        field = {"ssds": "ssds", "dram": "dram", "batch": "batch"}[key]
        val = v * 10**9 if key == "dram" else v
        o = dataclasses.replace(options, **{field: val})
        h = hw.with_overrides(ssds=o.ssds, dram=o.dram)
        plan = plan_problem(build_problem(o, h), o.policy)
        pred = plan.to_plan().predicted
        rows.append({"value": v, "fits": plan.fits, "step_time_s": pred.step_time_s,
                     "tokens_per_s": pred.tokens_per_s if plan.fits else 0.0,
                     "model_tflops": pred.model_tflops if plan.fits else 0.0,
                     "bottleneck": pred.bottleneck, "policy": plan.decisions.policy})
    return rows


LLAMA_LADDER = {
    "llama-1b": (2048, 16, 8192, 32, 8), "llama-3b": (3072, 28, 8192, 24, 8), "llama-7b": (4096, 32, 11008, 32, 32),
    "llama-13b": (5120, 40, 13824, 40, 40), "llama-34b": (8192, 48, 22016, 64, 8),
    "llama-70b": (8192, 80, 28672, 64, 8), "llama-405b": (16384, 126, 53248, 128, 8)}
"""LLaMA-shaped models `fit --lora` tries, smallest first: (hidden size, layers, MLP width,
attention heads, key/value heads) of Llama 3.2 1B and 3B, LLaMA-2 7B and 13B, Code Llama 34B,
LLaMA-2 70B and Llama 3.1 405B (vocabulary 32000)."""


def llama_config(name: str, seq: int) -> dict:
    """The Hugging Face config of a LLAMA_LADDER model, for `seq` tokens."""
    h, layers, inter, heads, kv = LLAMA_LADDER[name]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
            "num_hidden_layers": layers, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": 32000, "max_position_embeddings": max(seq, 4096),
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}


def llama_params(name: str) -> int:
    h, layers, inter, heads, kv = LLAMA_LADDER[name]
    attn = h * h * 2 + 2 * h * (h // heads) * kv
    return layers * (attn + 3 * h * inter + 2 * h) + 2 * 32000 * h + h


def largest_fitting(options: Options, hw, *, batches=(1, 2, 4, 8, 16, 32, 64), seq: int = 2048) -> dict:
    """Largest GPT-3 preset that fits (batch 1), then the batch with the best throughput. With
    `options.lora` (and `quantize`: QLoRA), the largest LLaMA-shaped model of LLAMA_LADDER instead,
    adapters trained on its frozen base, at `seq` tokens a row."""
    if options.lora:
        import json
        import tempfile
        from pathlib import Path
        seq = options.seq or seq
        scratch = tempfile.TemporaryDirectory(prefix="tensorstow-fit-")  # removed when the search ends
        root = Path(scratch.name)
        refs = {}
        for name in LLAMA_LADDER:
            (root / name).mkdir()
            (root / name / "config.json").write_text(json.dumps(llama_config(name, seq)))
            refs[name] = f"hf:{root / name}"
        names, params = list(LLAMA_LADDER), llama_params
        options = dataclasses.replace(options, seq=seq)
    else:
        names = sorted((n for n in PRESETS if n.startswith("gpt3-")), key=lambda n: gpt_param_count(PRESETS[n]))
        refs, params = {n: n for n in names}, lambda n: gpt_param_count(PRESETS[n])

    @functools.lru_cache(maxsize=None)  # the sweep begins at batch 1, which the search planned
    def fits(name, batch):
        o = dataclasses.replace(options, model=refs[name], batch=batch)
        p = plan_problem(build_problem(o, hw), o.policy)
        return p if p.fits else None

    lo, hi, best = 0, len(names) - 1, None
    while lo <= hi:  # fitting is monotone in model size for a fixed policy and machine
        mid = (lo + hi) // 2
        if fits(names[mid], 1):
            best, lo = names[mid], mid + 1
        else:
            hi = mid - 1
    if best is None:
        return {"policy": options.policy, "model": None}
    rows = []
    for b in batches:
        p = fits(best, b)
        if p is None:
            break
        rows.append((p.to_plan().predicted.tokens_per_s, b, p))
    tps, batch, plan = max(rows, key=lambda r: (r[0], -r[1]))
    return {"policy": options.policy, "model": best, "params": params(best), "batch": batch,
            "tokens_per_s": tps, "step_time_s": plan.sim.step_time_s, "chosen": plan.decisions.policy}


def svg_plot(path: str, xs: list[float], ys: list[float], *, xlabel: str, ylabel: str, title: str) -> None:
    W, H, L, B = 560, 360, 70, 50
    xmin, xmax = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    ymax = max(ys) * 1.1 if max(ys) > 0 else 1.0
    sx = lambda x: L + (x - xmin) / (xmax - xmin) * (W - L - 20)
    sy = lambda y: H - B - y / ymax * (H - B - 40)
    pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - 20}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{H - B}" x2="{L}" y2="30" stroke="black"/>',
           f'<text x="{(W + L) / 2}" y="{H - 12}" text-anchor="middle">{escape(xlabel)}</text>',
           f'<text x="16" y="{H / 2}" text-anchor="middle" transform="rotate(-90 16 {H / 2})">{escape(ylabel)}</text>']
    for x in xs:
        out.append(f'<text x="{sx(x):.1f}" y="{H - B + 16}" text-anchor="middle">{x:g}</text>')
    for k in range(5):
        y = ymax * k / 4
        out.append(f'<text x="{L - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.3g}</text>')
    out.append(f'<polyline points="{pts}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="#1f77b4"/>' for x, y in zip(xs, ys)]
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
