"""Gradient accumulation on one GPU (`--grad-accum K`): K microbatches a step, one after the other,
their gradients summed where the planner keeps them between microbatches (GPU, DRAM or SSD), the
step's loss the Hugging Face Trainer's (every token loss over the step's count of labels). Every
policy and tier, fp32 and both mixed precisions, with clipping, against eager PyTorch's
accumulation (tests/oracle.py), with labels left out down to a whole microbatch."""
import json

import pytest
import torch

from tensorstow.cli import main
from tensorstow.executor.data import batches
from tensorstow.executor.executor import Executor
from tensorstow.ir.models import GPT, PRESETS
from tensorstow.planner.plan import make_plan
from tensorstow.planner.presets import load_hardware
from tensorstow.planner import passes
from tensorstow.schema.options import Options
from tests.oracle import train_eager

B, T, K, STEPS = 2, 32, 3, 3
VOCAB = PRESETS["gpt-tiny"].vocab_size


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS batches of K x B rows; some labels -100, and microbatch 1 of every step all -100 (its
    loss is 0 / 0, its weight 0)."""
    out = []
    for x, y in batches("synthetic", B * K, T, VOCAB, STEPS, seed=0):
        y = y.clone()
        y[0, :5] = -100
        y[B:2 * B] = -100
        out.append((x, y))
    return out


def options(policy: str, precision: str = "fp32", gpu_mem: int = 1_000_000, **kw) -> Options:
    return Options(model="gpt-tiny", hardware="lohan-rtx4090", policy=policy, batch=B, seq=T, precision=precision,
                   lr=1e-3, weight_decay=0.1, gpu_mem=gpu_mem, exact_optimizer=True, grad_accum=K, **kw)


def plan_on(tier: str, o: Options, monkeypatch) -> dict:
    """`o.policy`'s plan with every accumulated gradient on `tier` (the planner's other choices
    made for that tier)."""
    every = passes.accumulating
    monkeypatch.setattr(passes, "accumulating", lambda p, d: [
        c for c in every(p, d) if {x.accum for x in c.blocks.values()} == {tier}])
    r = make_plan(o, load_hardware(o.hardware).with_overrides(gpu_mem=o.gpu_mem))
    monkeypatch.undo()
    return json.loads(r.dumps())


def eager(precision: str, **kw):
    torch.manual_seed(0)
    return train_eager(GPT(PRESETS["gpt-tiny"]), data(), lr=1e-3, weight_decay=0.1, precision=precision,
                       microbatches=K, **kw)


def run(plan: dict, tmp_path, mode: str = "sync"):
    torch.manual_seed(0)
    ex = Executor(plan, GPT(PRESETS["gpt-tiny"]), mode=mode, state_dir=tmp_path / "s")
    losses, norms = [], []
    for x, y in data():
        losses.append(ex.step(x, y))
        norms.append(ex.grad_norm)
    params = ex.parameters()
    ex.close()
    return losses, params, norms


CASES = [  # policy, tier, precision, mode, GPU memory
    ("lohan", "dram", "fp32", "sync", 1_000_000),
    ("lohan", "ssd", "fp32", "overlap", 1_000_000),  # cut backwards: their first part hands some gradients on
    ("zero-infinity", "ssd", "fp16-mixed", "sync", 1_000_000),  # gradients also swapped to SSD for the update
    ("zero-infinity", "gpu", "bf16-mixed", "overlap", 3_000_000),
    ("stronghold", "dram", "bf16-mixed", "sync", 8_000_000),
    ("all-gpu", "gpu", "fp32", "sync", 8_000_000),
]


@pytest.mark.parametrize("policy,tier,precision,mode,gpu_mem", CASES)
def test_accumulation_trains_like_eager(policy, tier, precision, mode, gpu_mem, tmp_path, monkeypatch):
    """Each tier the accumulated gradients may wait on, under several policies, precisions (fp16
    with loss scaling) and both modes: losses, gradient norms and weights bit-identical to eager
    accumulation with the Trainer's normalisation (the exact optimizer)."""
    plan = plan_on(tier, options(policy, precision, gpu_mem), monkeypatch)
    assert plan["decisions"]["grad_accum"] == K
    assert {d["accum"] for d in plan["decisions"]["blocks"].values()} == {tier}
    computes = [i for i in plan["instructions"] if i["kind"] == "compute"]
    assert sorted({i.get("micro", 0) for i in computes}) == list(range(K))
    assert sum(1 for i in computes if i.get("accum")) == (K - 1) * sum(1 for n in plan["buffers"] if n.startswith("G:"))
    moved = [i for i in plan["instructions"] if i["kind"] in ("load", "store") and i["tensor"].startswith("G:")
             and tier in (i["src"], i["dst"])]
    assert bool(moved) == (tier != "gpu")
    want_norms = []
    want_losses, want = eager(precision, max_grad_norm=1e9, norms=want_norms)
    losses, params, norms = run(plan, tmp_path, mode)
    assert losses == want_losses
    assert norms == want_norms
    bad = [n for n in want if not torch.equal(params[n], want[n])]
    assert not bad, f"parameters differ from eager: {bad[:4]}"


def test_clipping_clips_the_accumulated_gradients_like_eager(tmp_path):
    """`--max-grad-norm` with accumulation: the norm of the summed gradients, clip_grad_norm_'s
    factor on them, one update (the clip fires: the norm is above 0.5 every step)."""
    o = options("lohan", max_grad_norm=0.5)
    plan = json.loads(make_plan(o, load_hardware(o.hardware).with_overrides(gpu_mem=o.gpu_mem)).dumps())
    want_norms = []
    want_losses, want = eager("fp32", max_grad_norm=0.5, norms=want_norms)
    losses, params, norms = run(plan, tmp_path)
    assert losses == want_losses and norms == want_norms and min(norms) > 0.5
    assert all(torch.equal(params[n], want[n]) for n in want)


def test_the_planner_keeps_accumulated_gradients_on_the_fastest_tier_that_fits():
    """GPU room for every gradient: they stay there (nothing moves); 1 MB: DRAM; DRAM too small as
    well: SSD. Mixed precision accumulates fp32 gradients (G sized 4 bytes a parameter)."""
    def tiers(**kw):
        o = options("lohan", **kw)
        hw = load_hardware(o.hardware).with_overrides(gpu_mem=o.gpu_mem, dram=o.dram)
        pl = make_plan(o, hw)
        return {d.accum for d in pl.decisions.blocks.values()}, pl
    assert tiers(gpu_mem=8_000_000)[0] == {"gpu"}
    assert tiers()[0] == {"dram"}
    (on, pl) = tiers(dram=1_200_000)
    assert on == {"ssd"} and pl.fits
    _, mixed = tiers(precision="bf16-mixed")
    prof = mixed.problem.profiles[mixed.problem.profile_of["b0"]]
    assert mixed.buffers["G:b0"].bytes == prof.grad_fp32_bytes > 1.8 * prof.grad_bytes


def test_cli_plans_accumulation_and_refuses_what_a_policy_cannot_do(tmp_path, capsys):
    """`plan --grad-accum K` under auto: K microbatches, the tier in `show`; a pipeline policy, or
    --microbatches beside it, is one error line."""
    out = tmp_path / "p.json"
    common = ["plan", "gpt-tiny", "--hw", "lohan-rtx4090", "--precision", "fp32", "--batch", str(B), "--seq", str(T)]
    assert main([*common, "--grad-accum", "4", "--gpu-mem", "1MB", "-o", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["options"]["grad_accum"] == 4 and d["decisions"]["grad_accum"] == 4
    assert d["decisions"]["policy"] != "mobius"
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    assert "gradient accumulation: 4 microbatches of batch 2, accumulated gradients on dram" in capsys.readouterr().out
    for extra, says in ((["--policy", "mobius"], "the mobius policy pipelines microbatches"),
                        (["--microbatches", "2"], "a pipeline accumulates over --microbatches instead"),
                        (["--grad-accum", "0"], "--grad-accum 0")):
        args = [*common, *extra] + (["--grad-accum", "2"] if "--grad-accum" not in extra else [])
        assert main([*args, "-o", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tensorstow: error: ") and says in err and err.count("\n") == 1, err
