"""The joint ILP: exact on its own model (exhaustive check), never worse than a heuristic."""
import itertools

import numpy as np
import pytest

from tensorstow.planner.presets import load_hardware
from tensorstow.schema.options import Options
from tensorstow.planner.plan import plan_problem
from tensorstow.planner.problem import build_problem
from tensorstow.planner.policies import heuristic_plans
from tensorstow.planner.policies import ilp

SMALL = {"act": ("keep", "recompute"), "ck": ("gpu", "dram"), "ph": ("gpu", "dram"), "sh": ("dram",),
         "opt": ("cpu", "gpu")}


@pytest.fixture(scope="module")
def small_problem():
    hw = load_hardware("lohan-rtx4090")
    return build_problem(Options(model="tests.fixtures.user_models:gpt_two_layers", hardware="x", batch=4,
                                 precision="fp32"), hw)


def test_mip_optimum_equals_exhaustive_search(small_problem):
    p = small_problem
    cs = ilp.combos(p, choices=SMALL)
    assert len(cs) == 16
    full = {t: v / ilp.MiB for t, v in p.capacity().items()}
    # capacities from roomy to tight, so the memory rows bind differently
    footprints = sorted({sum(ilp.coefficients(p.profiles[p.profile_of[b]], c, p, b == p.order[-1])["mem_gpu"]
                             for b, c in zip(p.order, combo)) for combo in [(cs[0],) * len(p.order), (cs[-1],) * len(p.order)]})
    coef = [[ilp.coefficients(p.profiles[p.profile_of[b]], c, p, b == p.order[-1]) for c in cs] for b in p.order]
    terms = sorted(coef[0][0])
    M = np.array([[[k[t] for t in terms] for k in row] for row in coef])  # block x combo x term
    tr = ilp.transient(p)
    for gpu_cap in (full["gpu"], tr["gpu"] + footprints[-1] / 2, tr["gpu"] * 0.5):
        caps = dict(full, gpu=gpu_cap)
        # every assignment of a combo to each block, vectorized: sum the blocks' term vectors
        idx = np.array(list(itertools.product(range(len(cs)), repeat=len(p.order))))
        tot = sum(M[j][idx[:, j]] for j in range(len(p.order)))
        col = {t: tot[:, terms.index(t)] for t in terms}
        stream_any = np.array([[cs[i].ph != "gpu" for i in row] for row in idx]).any(1)
        states_any = np.array([[cs[i].opt == "gpu" and cs[i].sh != "gpu" for i in row] for row in idx]).any(1)
        ok = (col["mem_gpu"] + tr["gpu"] + tr["gpu_stream"] * stream_any + tr["gpu_states"] * states_any
              <= caps["gpu"] + 1e-6) & (col["mem_dram"] + tr["dram"] <= caps["dram"] + 1e-6) & (col["mem_ssd"] <= caps["ssd"] + 1e-6)
        obj = np.max([col[t] for t in ilp.PHASE_TERMS["f"]], 0) + np.max([col[t] for t in ilp.PHASE_TERMS["b"]], 0)
        best = float(obj[ok].min()) if ok.any() else None
        if best is not None:  # spot-check the vectorized sums against the reference evaluator
            arg = int(np.flatnonzero(ok)[np.argmin(obj[ok])])
            assert ilp.analytic(p, {b: cs[i] for b, i in zip(p.order, idx[arg])}, caps_mib=caps) == pytest.approx(best)
        res = ilp.solve(p, choices=SMALL, caps_mib=caps)
        if best is None:
            assert not res.feasible
            continue
        assert res.feasible and res.status == "optimal"
        assert res.objective == pytest.approx(best, rel=1e-6, abs=1e-12)
        # the solution itself evaluates to that objective under the same model
        assert ilp.analytic(p, ilp.assign(p, res.counts), caps_mib=caps) == pytest.approx(best, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("model,hw,batch,dram", [
    ("gpt-tiny", "lohan-rtx4090", 8, None),
    ("gpt3-13b", "lohan-rtx4090", 8, None),
    ("gpt3-175b", "lohan-rtx4090", 8, 256 * 10**9),
])
def test_ilp_never_worse_than_the_best_heuristic(model, hw, batch, dram):
    h = load_hardware(hw).with_overrides(dram=dram)
    p = build_problem(Options(model=model, hardware=hw, batch=batch), h)
    heur = [pl for pl in heuristic_plans(p).values() if pl.fits]
    plan = plan_problem(p, "ilp")
    assert plan.fits
    assert plan.decisions.policy == "ilp"
    for pl in heur:
        assert plan.sim.step_time_s <= pl.sim.step_time_s + 1e-12
    assert any("MIP round" in n for n in plan.decisions.notes)


def test_solver_status_is_reported_honestly(small_problem):
    res = ilp.solve(small_problem, choices=SMALL, caps_mib={"gpu": 1e-3, "dram": 1e-3, "ssd": 0.0})
    assert not res.feasible and "Infeasible" in res.status


def test_the_block_updated_last_takes_a_dram_home_when_the_replay_shows_its_tail():
    """The MIP's analytic model has no pipeline drain, so it does not see that the block the
    backward ends with writes its P and states back to SSD after everything else. `refine_tail`
    replays exchanges of that block's SSD homes with DRAM homes of other blocks and keeps the
    fastest plan that fits: never slower, the exchange named in the notes, a no-op when the
    block already lives in DRAM."""
    import dataclasses

    from tensorstow.planner.passes import schedule
    from tensorstow.planner.policies import lohan
    hw = load_hardware("lohan-rtx4090")  # a slow device (compute-bound) and a sync per write: a tail
    hw = dataclasses.replace(hw, ssd=dataclasses.replace(hw.ssd, flush_bw=2e9),
                             gpus=[dataclasses.replace(hw.gpus[0], flops=1e11, flops_fp32=1e11)])
    p = build_problem(Options(model="gpt-tiny", hardware="x", batch=4, precision="fp32"), hw)
    dec = lohan.plan(p)
    assert all(d.params == "ssd" and d.states == "ssd" for d in dec.blocks.values())
    middle = p.order[len(p.order) // 2]
    blocks = dict(dec.blocks)
    blocks[middle] = dataclasses.replace(blocks[middle], params="dram", states="dram")
    before = schedule(p, dataclasses.replace(dec, blocks=blocks))
    last = next(i.segment for i in reversed(before.instructions) if i.kind == "optimizer_step")
    assert last != middle
    after, notes = ilp.refine_tail(p, before, schedule)
    assert after.fits and after.sim.step_time_s < before.sim.step_time_s
    got = after.decisions.blocks
    assert (got[last].params, got[last].states) == ("dram", "dram")
    assert (got[middle].params, got[middle].states) == ("ssd", "ssd")
    assert len(notes) == 2 and all(f"{last}'s" in n and f"{middle}'s SSD" in n for n in notes)
    again, notes = ilp.refine_tail(p, after, schedule)
    assert again is after and notes == ()


def test_ssd_homes_move_into_the_dram_the_plan_leaves_free_where_the_replay_is_no_slower():
    """The simulator sees hidden SSD traffic as free, so `lohan`'s all-SSD homes tie with DRAM
    homes; `refine_homes` moves P (then states) of the blocks the backward reaches first into the
    DRAM the plan leaves free: never slower, less SSD traffic, within capacity; nothing moves where
    DRAM has no room; with room for everything every home is DRAM."""
    import dataclasses

    from tensorstow.planner.passes import schedule
    from tensorstow.planner.policies import lohan
    base_hw = load_hardware("lohan-rtx4090")

    def problem(dram: int | None):
        hw = base_hw.with_overrides(dram=dram)
        return build_problem(Options(model="gpt-tiny", hardware="x", batch=4, precision="fp32"), hw)

    p = problem(None)
    before = schedule(p, lohan.plan(p))
    assert all(d.params == "ssd" and d.states == "ssd" for d in before.decisions.blocks.values())
    peak = before.sim.peak_bytes["dram"]
    p_bytes = {b: before.buffers[f"P:{b}"].bytes for b in p.order}

    roomy, notes = ilp.refine_homes(p, before, schedule)
    assert all(d.params == "dram" and d.states == "dram" for d in roomy.decisions.blocks.values())
    assert ilp._ssd_traffic(roomy) == 0 < ilp._ssd_traffic(before)
    assert roomy.sim.step_time_s <= schedule(p, dataclasses.replace(before.decisions, deferred_writes=())).sim.step_time_s
    assert len(notes) == 2 and notes[0].startswith("homes: params of") and notes[1].startswith("homes: states of")

    room = sum(sorted(p_bytes.values())[:2]) + 1  # about two blocks' P
    tight = problem(peak + room)
    start = schedule(tight, lohan.plan(tight))
    some, notes = ilp.refine_homes(tight, start, schedule)
    moved = [b for b, d in some.decisions.blocks.items() if d.params == "dram"]
    assert moved and len(moved) < len(p.order) and some.fits
    assert moved == sorted(moved, key=list(reversed(p.order)).index)
    assert set(moved) == set(list(reversed(p.order))[:len(moved)])  # the blocks the backward reaches first
    assert ilp._ssd_traffic(some) < ilp._ssd_traffic(start)
    assert some.sim.peak_bytes["dram"] <= peak + room
    assert some.sim.step_time_s <= schedule(tight, dataclasses.replace(start.decisions, deferred_writes=())).sim.step_time_s

    none = problem(peak)
    start = schedule(none, lohan.plan(none))
    same, notes = ilp.refine_homes(none, start, schedule)
    assert notes == () and all(d.params == "ssd" and d.states == "ssd" for d in same.decisions.blocks.values())


def test_the_mip_streams_a_run_of_consecutive_blocks_not_the_largest_one_times_the_depth():
    """gpt3-125m's embedding (154 MB in fp32, with its positions 160 MB) is 5x a layer: two blocks
    in flight are the embedding and one layer, not two embeddings."""
    p = build_problem(Options(model="gpt3-125m", hardware="lohan-rtx4090", batch=1, seq=128, precision="fp32"),
                      load_hardware("lohan-rtx4090"))
    profs = [p.profiles[p.profile_of[b]] for b in p.order]
    params = [q.param_bytes + q.const_bytes for q in profs]
    assert max(params) > 4 * sorted(params)[len(params) // 2]  # the embedding dwarfs a layer
    for prefetch in (1, 2):
        want = max(sum(params[i:i + prefetch + 1]) for i in range(len(params) - prefetch))
        assert ilp.transient(p, prefetch)["gpu_stream"] == pytest.approx(want / ilp.MiB)
        assert want < (prefetch + 1) * max(params)
    own = max(q.saved_bytes + q.input_bytes + q.output_bytes + max(q.fwd_workspace, q.bwd_workspace + 2 * q.handed_bytes)
              + n for q, n in zip(profs, params))
    assert ilp.transient(p)["gpu"] == pytest.approx(own / ilp.MiB)


def test_a_mip_that_finds_nothing_says_what_its_capacity_rows_ask_for(small_problem):
    res = ilp.solve(small_problem, choices=SMALL, caps_mib={"gpu": 1e-3, "dram": 1e-3, "ssd": 0.0})
    note = ilp._why_not(small_problem, res, 1, {"gpu": 1e-3, "dram": 1e-3}, None)
    assert note.startswith("no assignment fits the MIP's capacity rows (the blocks in flight need ")
    assert "incumbent" in ilp._why_not(small_problem, res, 1, {"gpu": 1e-3, "dram": 1e-3}, 1.5)
