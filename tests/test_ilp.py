"""The joint ILP: exact on its own model (exhaustive check), never worse than a heuristic."""
import itertools

import pytest

from tensorstow.planner.hardware import load_hardware
from tensorstow.planner.plan import Options, build_problem, heuristic_plans, plan_problem
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
    cs = ilp.combos(p.hw, choices=SMALL)
    assert len(cs) == 16
    full = {t: v / ilp.MiB for t, v in p.capacity().items()}
    # capacities from roomy to tight, so the memory rows bind differently
    footprints = sorted({sum(ilp.coefficients(p.profiles[p.profile_of[b]], c, p, b == p.order[-1])["mem_gpu"]
                             for b, c in zip(p.order, combo)) for combo in [(cs[0],) * len(p.order), (cs[-1],) * len(p.order)]})
    for gpu_cap in (full["gpu"], ilp.transient(p)["gpu"] + footprints[-1] / 2, ilp.transient(p)["gpu"] * 0.5):
        caps = dict(full, gpu=gpu_cap)
        best = None
        for combo in itertools.product(cs, repeat=len(p.order)):
            v = ilp.analytic(p, dict(zip(p.order, combo)), caps_mib=caps)
            if v is not None and (best is None or v < best):
                best = v
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
    ("gpt3-13b", "lohan-rtx4090", 4, None),
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
