"""A mixture of experts' experts as placement units (`--expert-groups N`): each layer's experts in N
groups, each group's rows of the expert weights, their gradient, master copy and Adam states in
buffers of their own (`P:b3/x1` ...), on tiers of their own, updated on their own. The device holds
a layer's experts whole while it computes (transformers' grouped matmul reads them all): the
groups' rows are views of that whole (`stores.DeviceTier.parts`). Training equals eager Hugging
Face training, bit for bit, as the one-unit plans do (tests/test_moe.py).
"""
import json

import pytest
import torch

pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")

from tensorstow.cli import main  # noqa: E402
from tensorstow.ir.models import resolve_model  # noqa: E402
from tests import test_real_models as real  # noqa: E402
from tests.test_moe import eager, moe_ref  # noqa: E402
from tests.test_real_models import offloaded_plans, one_thread, run_executor  # noqa: E402,F401


def unit_homes(pj: dict) -> dict[str, str]:
    return {n: b["home"] for n, b in pj["buffers"].items() if "/x" in b["block"] and b["home"]}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_experts_in_groups_train_exactly_like_eager_hf(family, tmp_path):
    """Two groups a layer, offloaded under lohan, zero-infinity and ilp (fp32): losses and weights
    bit-identical to eager Hugging Face training."""
    ref = moe_ref(family, tmp_path)
    want = eager(ref)
    for name, pj in offloaded_plans(ref, policies=("lohan", "zero-infinity", "ilp"), expert_groups=2).items():
        homes = unit_homes(pj)
        assert {n.split(":")[1] for n in homes} == {f"b{k}/x{g}" for k in range(3) for g in range(2)}
        assert any(h != "gpu" for h in homes.values())
        updates = [i["segment"] for i in pj["instructions"] if i["kind"] == "optimizer_step"]
        assert {f"b{k}/x{g}" for k in range(3) for g in range(2)} <= set(updates)  # each group updated on its own
        real.assert_equal(run_executor(pj, resolve_model(ref).build, tmp_path / name), want, prefix="model.")
        if name == "lohan":  # the lanes run side by side: loads, frees and updates of a weight's rows
            got = run_executor(pj, resolve_model(ref).build, tmp_path / "overlap", mode="overlap")
            real.assert_equal(got, want, prefix="model.")


def test_experts_in_groups_train_bf16_mixed_like_eager_autocast(tmp_path):
    ref = moe_ref("qwen3_moe", tmp_path)
    pj = offloaded_plans(ref, policies=("ilp",), precision="bf16-mixed", expert_groups=4)["ilp"]
    got, want = run_executor(pj, resolve_model(ref).build, tmp_path / "s"), eager(ref, "bf16-mixed")
    assert got[0] == want[0]
    assert all(torch.equal(got[1]["model." + n], p) for n, p in want[1].items())


def test_the_planner_places_each_group_on_its_own_tier_and_show_reports_them(tmp_path, capsys):
    """With DRAM for only part of the state, ilp fills it group by group (those updated last first:
    a layer's state ends up partly in DRAM, partly on SSD), `show` counts the groups' homes and with
    -v lists each group; the plan trains like eager."""
    ref = moe_ref("qwen3_moe", tmp_path)
    out = tmp_path / "p.json"
    assert main(["plan", ref, "--hw", "lohan-rtx4090", "--policy", "ilp", "--batch", "2", "--seq", "16",
                 "--gpu-mem", "300KB", "--dram", "600KB", "--ssds", "1", "--expert-groups", "4", "--precision", "fp32",
                 "--lr", str(real.LR), "--exact-optimizer", "-o", str(out)]) == 0
    pj = json.loads(out.read_text())
    homes = unit_homes(pj)
    split = [(kind, k) for kind in ("P", "OS") for k in range(3)
             if {pj["buffers"][f"{kind}:b{k}"]["home"], *(homes[f"{kind}:b{k}/x{g}"] for g in range(4))} == {"dram", "ssd"}]
    assert split, homes  # a layer's state partly in DRAM, partly on SSD, group by group
    capsys.readouterr()
    assert main(["show", str(out), "-v"]) == 0
    text = capsys.readouterr().out
    states = sorted(homes[f"OS:b{k}/x{g}"] for k in range(3) for g in range(4))
    counts = ", ".join(f"{t} x{states.count(t)}" for t in sorted(set(states)))
    assert "expert groups: 12 in 3 layers (--expert-groups 4):" in text and f"states {counts}" in text
    assert f"  b2/x1: experts 2..3, params {homes['P:b2/x1']}, states {homes['OS:b2/x1']}, updated on cpu" in text
    more = tmp_path / "more.json"  # all of it in DRAM: `diff` names the groups that moved, in forward order
    assert main(["plan", ref, "--hw", "lohan-rtx4090", "--policy", "ilp", "--batch", "2", "--seq", "16", "--gpu-mem",
                 "300KB", "--dram", "2MB", "--ssds", "1", "--expert-groups", "4", "--precision", "fp32", "--lr",
                 str(real.LR), "--exact-optimizer", "-o", str(more)]) == 0
    capsys.readouterr()
    assert main(["diff", str(out), str(more)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("blocks ") and "states: ssd -> dram" in line for line in lines)
    changed = next(line for line in lines if line.startswith("buffers changed:"))
    assert "/x" in changed, changed  # the groups' buffers are among those that moved
    torch.manual_seed(0)
    real.assert_equal(run_executor(pj, resolve_model(ref).build, tmp_path / "s"), eager(ref), prefix="model.")


def plan_and_train(ref: str, tmp_path, *plan_args: str, accumulate: int = 1, clip: float = 0.0, mode: str = "sync"):
    """`tensorstow plan ref ...plan_args` (fp32, the tests' learning rate, eager's exact AdamW), then 3
    steps through the executor and 3 of eager Hugging Face training (tests/oracle.py: `accumulate`
    microbatches a step, clipped at `clip`): (plan, executor's (losses, params), eager's, the
    executor's DRAM arena overflow)."""
    import transformers
    from tensorstow.executor.data import batches
    from tensorstow.executor.executor import Executor
    from tests.oracle import train_eager
    from tests.test_moe import moe_loss
    out = tmp_path / "p.json"
    args = ["plan", ref, "--hw", "lohan-rtx4090", "--batch", "2", "--seq", "16", "--precision", "fp32", "--lr",
            str(real.LR), "--exact-optimizer", "-o", str(out), *plan_args]
    args += ["--grad-accum", str(accumulate)] if accumulate > 1 else []
    args += ["--max-grad-norm", str(clip)] if clip else []
    assert main(args) == 0
    pj = json.loads(out.read_text())
    steps = list(batches("synthetic", 2 * accumulate, real.T, real.VOCAB, real.STEPS, seed=0))
    torch.manual_seed(0)
    ex = Executor(pj, resolve_model(ref).build(), state_dir=tmp_path / "s", mode=mode)
    got = [ex.step(x, y) for x, y in steps]
    params, overflow = ex.parameters(), ex.pool.overflow_bytes
    ex.close()
    config = transformers.AutoConfig.from_pretrained(ref[3:])
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    norms = []
    want = train_eager(model, steps, lr=real.LR, loss=moe_loss, microbatches=accumulate,
                       max_grad_norm=clip or None, norms=norms)
    if clip:
        assert max(norms) > clip  # the clip fires
    return pj, (got, params), want, overflow


@pytest.mark.parametrize("gpu_mem", ["520KB", "1MB"], ids=["cut-backward", "whole-backward"])
def test_groups_accumulate_their_gradient_rows_exactly(gpu_mem, tmp_path):
    """Two microbatches a step added into each group's gradient rows, also where a cut backward hands
    the expert gradients from its first part to its second (K:<b>): bit-identical to eager's
    accumulation."""
    pj, got, want, _ = plan_and_train(moe_ref("mixtral", tmp_path), tmp_path, "--policy", "lohan", "--gpu-mem", gpu_mem,
                                      "--expert-groups", "2", accumulate=2)
    cuts = [d.get("bwd_cut", 0) for d in pj["decisions"]["blocks"].values()]
    assert any(cuts) if gpu_mem == "520KB" else not any(cuts)
    real.assert_equal(got, want, prefix="model.")


def test_groups_clip_exactly_and_a_block_speculates_only_with_every_group_redoable(tmp_path):
    """Clipping by the global norm (each expert weight's norm taken whole, as eager's): with some of a
    layer's groups homed in DRAM, whose update a redo could not take back, the layer's updates wait for
    the norm instead of speculating; bit-identical to eager, the DRAM arena holding every home."""
    pj, got, want, overflow = plan_and_train(
        moe_ref("qwen3_moe", tmp_path), tmp_path, "--policy", "ilp", "--gpu-mem", "300KB", "--dram", "600KB",
        "--ssds", "1", "--expert-groups", "4", "--clip-rate", "0", clip=0.05)
    homes = unit_homes(pj)
    for b in pj["decisions"].get("speculated", []):
        assert all(h == "ssd" for n, h in homes.items() if n.startswith(("P:", "OS:")) and n.split(":")[1].startswith(b + "/"))
    assert any(h == "dram" for n, h in homes.items() if n.startswith("OS:"))
    real.assert_equal(got, want, prefix="model.")
    assert overflow == 0


def test_expert_groups_the_plan_cannot_honour_are_one_line_each(tmp_path, capsys):
    from tests.test_real_models import hf_ref
    ref = hf_ref("llama", tmp_path)
    for groups, why in (("2", "has no layer whose experts can be grouped"), ("-1", "must be >= 0")):
        assert main(["plan", ref, "--hw", "lohan-rtx4090", "--batch", "2", "--seq", "16", "--expert-groups", groups]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("tensorstow: error: --expert-groups") and why in err
    moe = moe_ref("mixtral", tmp_path)
    for hw, policy in (("lohan-rtx4090", "mobius"), ("mobius-3090ti-topo4", "auto")):  # pipelines
        assert main(["plan", moe, "--hw", hw, "--batch", "2", "--seq", "16", "--policy", policy, "--expert-groups", "2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pipelines place whole layers" in err


def test_more_than_ten_groups_are_placed_in_the_order_the_dram_arena_replays(tmp_path):
    """12 groups a layer (`b0/x10` after `b0/x9`, not after `b0/x1`): the executor places their homes
    in the order the plan's DRAM arena was sized with, so nothing is allocated outside it."""
    from tensorstow.schema.schedule import units_by_block
    assert units_by_block(["b0/x10", "b0/x2", "b0", "b1/x0"]) == {"b0": ["b0/x2", "b0/x10"], "b1": ["b1/x0"]}
    ref = moe_ref("qwen3_moe", tmp_path, num_experts=12)
    pj, got, want, overflow = plan_and_train(ref, tmp_path, "--policy", "ilp", "--gpu-mem", "400KB", "--dram", "900KB",
                                             "--ssds", "1", "--expert-groups", "12")
    assert any(h == "dram" for n, h in unit_homes(pj).items() if n.startswith("OS:"))
    real.assert_equal(got, want, prefix="model.")
    assert overflow == 0


def test_expert_groups_0_keeps_the_fastest_count_it_plans(tmp_path, capsys):
    """`--expert-groups 0`: the planner plans each count a layer has experts for (1, 2, 4; the model
    has 4 experts a layer, so not 8) and keeps the fastest, each count's step the one that count
    gives planned on its own; the plan keeps the 0 asked for, so `check` replans it to the same
    bytes, and `show` says which count it chose."""
    ref = moe_ref("qwen3_moe", tmp_path, num_experts=4)
    args = ["plan", ref, "--hw", "lohan-rtx4090", "--policy", "ilp", "--batch", "2", "--seq", "16", "--gpu-mem",
            "300KB", "--dram", "600KB", "--ssds", "1", "--precision", "fp32"]
    steps = {}
    for n in (1, 2, 4):
        assert main([*args, "--expert-groups", str(n), "-o", str(tmp_path / f"{n}.json")]) == 0
        steps[n] = json.loads((tmp_path / f"{n}.json").read_text())["predicted"]["step_time_s"]
    auto = tmp_path / "auto" / "p.json"
    auto.parent.mkdir()
    assert main([*args, "--expert-groups", "0", "-o", str(auto)]) == 0
    pj = json.loads(auto.read_text())
    chosen = len({n for n in unit_homes(pj) if n.startswith("P:b0/")})
    assert pj["options"]["expert_groups"] == 0 and chosen in steps
    assert pj["predicted"]["step_time_s"] == steps[chosen] == min(steps.values())
    note = next(n for n in pj["decisions"]["notes"] if n.startswith("--expert-groups 0 chose"))
    assert note.startswith(f"--expert-groups 0 chose {chosen} (") and all(f"{n}: " in note for n in steps)
    assert "8: " not in note
    capsys.readouterr()
    assert main(["check", str(auto.parent)]) == 0, capsys.readouterr().out
    assert main(["show", str(auto)]) == 0
    assert f"(--expert-groups 0 chose {chosen}):" in capsys.readouterr().out


def test_a_sweep_with_expert_groups_0_chooses_the_count_at_each_value(tmp_path):
    """`plan --sweep` with `--expert-groups 0` chooses the group count at each value, as `plan` does."""
    from tensorstow.planner.plan import make_plan
    from tensorstow.planner.presets import load_hardware
    from tensorstow.planner.report import sweep
    from tensorstow.schema.options import Options
    ref = moe_ref("qwen3_moe", tmp_path, num_experts=4)
    o = Options(model=ref, hardware="lohan-rtx4090", policy="ilp", batch=2, seq=16, gpu_mem=300_000, dram=600_000,
                ssds=1, precision="fp32", expert_groups=0)
    hw = load_hardware("lohan-rtx4090").with_overrides(gpu_mem=o.gpu_mem, dram=o.dram, ssds=o.ssds)
    (row,) = sweep(o, hw, "batch", [2])
    chosen = make_plan(o, hw)
    assert row["step_time_s"] == chosen.to_plan().predicted.step_time_s
    assert any(n.startswith("--expert-groups 0 chose") for n in chosen.decisions.notes)
