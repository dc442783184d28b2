"""Partial activation swaps (Fuyou Table 2, LoHan Eq. 6 per layer): a swapped block moves only
the outputs of its FLOP-bearing ops and re-forwards the FLOP-free rest before its backward.
That the executor trains with such plans exactly as eager PyTorch does is
tests/test_executor.py's `partial-swap` plan (sync and overlap)."""
import functools

from tensorstow.planner.hardware import load_hardware
from tensorstow.planner.plan import Options, build_problem, schedule
from tensorstow.planner.policies import lohan
from tensorstow.planner.schedule import BlockDecision, Decisions


@functools.lru_cache(maxsize=None)
def problem(model="gpt-tiny", hardware="lohan-rtx4090", batch=2, seq=32, precision="fp32"):
    o = Options(model=model, hardware=hardware, policy="lohan", batch=batch, seq=seq, precision=precision)
    return build_problem(o, load_hardware(hardware))


def test_swaps_the_flop_outputs_and_reforwards_the_rest():
    p = problem()
    ops, tensors = p.graph.ops, {t.name: t for t in p.graph.tensors}
    prof = p.profiles["b1"]
    saved = {n for n, _, _ in prof.saved}
    assert prof.swapped and prof.rest
    assert set(prof.rest) == saved - set(prof.swapped)
    assert all(ops[tensors[n].producer].flops > 0 for n in prof.swapped)   # linear layers, attention
    assert all(ops[tensors[n].producer].flops == 0 for n in prof.rest)     # norms, GELU, sums
    assert prof.swap_bytes < prof.saved_bytes
    assert prof.rest_bytes == sum(tensors[n].nbytes for n in prof.rest)
    assert 0 < prof.refwd_time_s < prof.fwd_time_s


def test_a_block_that_draws_random_numbers_is_swapped_whole():
    p = problem(model="tests.fixtures.real_models:nano_gpt_dropout")
    prof = p.profiles["b1"]
    assert prof.saved_bytes and prof.rest == () and prof.refwd_time_s == 0
    assert set(prof.swapped) == {n for n, _, _ in prof.saved} and prof.swap_bytes == prof.saved_bytes


def _decisions(p, reforward: bool) -> Decisions:
    return Decisions(policy="custom", overlap_optimizer=True, blocks={
        b: BlockDecision(params="dram", states="dram", optimizer="cpu",
                         activations="swap_dram" if b == "b0" else "keep",
                         checkpoint="dram" if b.startswith("b") else "gpu", reforward=reforward)
        for b in p.order})


def test_lowering_loads_the_swapped_part_then_reforwards_before_the_backward():
    p = problem()
    prof = p.profiles["b0"]
    part = schedule(p, _decisions(p, reforward=True))
    whole = schedule(p, _decisions(p, reforward=False))
    assert part.buffers["A:b0"].members == prof.swapped and part.buffers["A:b0"].bytes == prof.swap_bytes
    assert part.buffers["R:b0"].members == prof.rest
    assert "R:b0" not in whole.buffers and whole.buffers["A:b0"].bytes == prof.saved_bytes
    ins = part.instructions
    load = next(i for i in ins if i.kind == "load" and i.tensor == "A:b0" and i.dst == "gpu0")
    refwd = next(i for i in ins if i.segment == "refwd:b0")
    bwd = next(i for i in ins if i.segment == "bwd:b0")
    assert refwd.kind == "recompute" and refwd.allocs == ("R:b0",) and load.id in refwd.deps
    assert refwd.id in bwd.deps
    assert any(i.kind == "free" and i.tensor == "R:b0" and bwd.id in i.deps for i in ins)
    assert part.durations[refwd.id] == prof.refwd_time_s
    # only the swapped part crosses the host link
    assert whole.sim.traffic_bytes["gpu0->dram"] - part.sim.traffic_bytes["gpu0->dram"] == \
        prof.saved_bytes - prof.swap_bytes
    # blocks that do not swap ignore the flag: the same plan either way for them
    assert all(part.buffers[n] == whole.buffers[n] for n in whole.buffers if not n.endswith(":b0"))


def test_lohan_trains_13b_at_batch_48_on_the_rtx4090_with_partial_swaps():
    """LoHan §V-F runs GPT-3 13B at batch 48 on the RTX 4090 (6 SSDs). Whole-block swaps (10.7 GB
    of saved values a block at batch 64) left no room to swap beside a backward's workspace, so
    every layer was recomputed; partial swaps move 57% of that."""
    p = build_problem(Options(model="gpt3-13b", hardware="lohan-rtx4090", policy="lohan", batch=48),
                      load_hardware("lohan-rtx4090").with_overrides(ssds=6))
    dec = lohan.plan(p)
    swapped = [b for b, d in dec.blocks.items() if d.activations in ("swap_dram", "swap_ssd")]
    assert swapped and all(dec.blocks[b].reforward for b in swapped)
    assert schedule(p, dec).over_capacity() == {}


def test_lohan_keeps_the_faster_of_partial_and_whole_swaps():
    """On a CPU device tier a swap is a memcpy and the re-forward can cost more than the bytes it
    saves: lohan searches both ways and keeps the faster plan."""
    p = problem()
    dec = lohan.plan(p)
    best = {}
    for reforward in (True, False):
        s, k, n_dram, prefetch, _ = lohan._search(p, reforward)
        best[reforward] = s.evaluate(k, n_dram, prefetch).step_time_s
    assert schedule(p, dec).sim.step_time_s == min(best.values())
    swapped = [d for d in dec.blocks.values() if d.activations in ("swap_dram", "swap_ssd")]
    assert all(d.reforward == (best[True] <= best[False]) for d in swapped)
