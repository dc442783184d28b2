"""Partial activation swaps (Fuyou Table 2, LoHan Eq. 6 per layer): a swapped block moves only
the outputs of its FLOP-bearing ops and re-forwards the FLOP-free rest before its backward.
That the executor trains with such plans exactly as eager PyTorch does is
tests/test_executor.py's `partial-swap` plan (sync and overlap)."""
import dataclasses
import functools

import pytest

from tensorstow.planner.presets import load_hardware
from tensorstow.schema.options import Options
from tensorstow.planner.plan import plan_problem
from tensorstow.planner.passes import schedule
from tensorstow.planner.problem import build_problem
from tensorstow.planner.policies import lohan
from tensorstow.schema.schedule import BlockDecision, Decisions


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
        s, k, n_dram, kept, prefetch, _ = lohan._search(p, reforward, keep=True)
        best[reforward] = s.evaluate(k, n_dram, prefetch, kept).step_time_s
    assert schedule(p, dec).sim.step_time_s == min(best.values())
    swapped = [d for d in dec.blocks.values() if d.activations in ("swap_dram", "swap_ssd")]
    assert all(d.reforward == (best[True] <= best[False]) for d in swapped)


def _cut_decisions(p) -> Decisions:
    """b0 swapped partially to DRAM, b1 recomputed; every layer's backward cut in two."""
    return Decisions(policy="custom", overlap_optimizer=True, blocks={
        b: BlockDecision(params="dram", states="dram", optimizer="cpu",
                         activations={"b0": "swap_dram", "b1": "recompute"}.get(b, "keep"),
                         checkpoint="dram" if b.startswith("b") else "gpu", reforward=b == "b0",
                         bwd_cut=p.profiles[p.profile_of[b]].bwd_cut if b.startswith("b") else 0)
        for b in p.order})


def test_a_cut_backward_releases_what_only_its_first_part_reads_and_the_next_swap_loads_into_it():
    """LoHan swaps layer by layer (§IV-D): the backward runs as bwd1:<b> then bwd2:<b>, the saved
    values only bwd1 reads (AE:/RE:<b>) are released between them, what bwd1 makes for later
    crosses in K:<b>, and the swapped block before it brings its activations back to the device
    only once that room is free."""
    p = problem()
    prof = p.profiles["b1"]
    tensors = {t.name: t for t in p.graph.tensors}
    assert 0 < prof.bwd_cut and prof.early and prof.handoff
    assert sum(tensors[n].nbytes for n in prof.early) > prof.handoff_bytes
    assert prof.bwd1_time_s + prof.bwd2_time_s == pytest.approx(prof.bwd_time_s)
    cut = schedule(p, _cut_decisions(p))
    whole = schedule(p, dataclasses.replace(_cut_decisions(p), blocks={
        b: dataclasses.replace(d, bwd_cut=0) for b, d in _cut_decisions(p).blocks.items()}))
    bufs, ins = cut.buffers, cut.instructions
    # the saved buffers split by the cut, bytes and members preserved
    assert bufs["A:b1"].bytes + bufs["AE:b1"].bytes == prof.saved_bytes
    assert set(bufs["AE:b1"].members) == set(prof.early)
    assert bufs["A:b0"].bytes + bufs["AE:b0"].bytes == prof.swap_bytes
    assert bufs["R:b0"].bytes + bufs["RE:b0"].bytes == prof.rest_bytes
    assert bufs["K:b1"].members == prof.handoff and bufs["K:b1"].bytes == prof.handoff_bytes
    seg = {i.segment: i for i in ins if i.segment}
    one, two = seg["bwd1:b1"], seg["bwd2:b1"]
    assert "bwd:b1" not in seg and one.allocs == ("K:b1",) and one.id in two.deps
    assert set(two.allocs) == {a for a in whole.instructions[
        next(i.id for i in whole.instructions if i.segment == "bwd:b1")].allocs}
    early_free = next(i for i in ins if i.kind == "free" and i.tensor == "AE:b1" and i.dst == "gpu0")
    assert one.id in early_free.deps and early_free.id < two.id
    assert any(i.kind == "free" and i.tensor == "K:b1" and two.id in i.deps for i in ins)
    # b0's swapped activations come back to the device only into the room bwd1:b1 left
    loads = [i for i in ins if i.kind == "load" and i.tensor in ("A:b0", "AE:b0") and i.dst == "gpu0"]
    assert len(loads) == 2 and all(early_free.id in i.deps for i in loads)
    assert cut.durations[one.id] == prof.bwd1_time_s and cut.durations[two.id] == prof.bwd2_time_s
    assert not cut.over_capacity()
    # the same bytes cross the host link; the whole backward's plan differs only by the cut
    assert cut.sim.traffic_bytes == whole.sim.traffic_bytes


def test_lohan_cuts_backwards_to_swap_13b_at_batch_64_on_the_rtx4090():
    """LoHan §V-F trains GPT-3 13B at batch 64 on the RTX 4090 with 3 SSDs. A recomputed block's
    backward peaks at 24.0 of the GPU's 24.96 GB, so the next block's 6 GB of swapped activations
    fit only where its backward is cut and its first part (the MLP's) has released 7.4 GB: the same
    swaps with whole backwards overflow the GPU."""
    p = build_problem(Options(model="gpt3-13b", hardware="lohan-rtx4090", policy="lohan", batch=64),
                      load_hardware("lohan-rtx4090").with_overrides(ssds=3))
    dec = lohan.plan(p)
    layers = [b for b in p.order if p.graph.block(b).kind == "layer"]
    assert any(dec.blocks[b].activations in ("swap_dram", "swap_ssd") for b in layers)
    assert all(dec.blocks[b].bwd_cut == p.profiles[p.profile_of[b]].bwd_cut > 0 for b in layers)
    assert schedule(p, dec).over_capacity() == {}
    whole = dataclasses.replace(dec, blocks={b: dataclasses.replace(d, bwd_cut=0) for b, d in dec.blocks.items()})
    assert "gpu" in schedule(p, whole).over_capacity()


def test_fuyou_is_lohans_search_without_cut_backwards():
    """Fuyou keeps a layer's intermediate values on the GPU (§5.2): the `fuyou` policy is the lohan
    search with whole backwards and every layer block's activations offloaded, under its own name."""
    p = problem()
    fy = lohan.fuyou(p)
    assert fy.policy == "fuyou" and not any(d.bwd_cut for d in fy.blocks.values())
    assert dataclasses.replace(fy, policy="lohan") == lohan.plan(p, split=False, keep=False)
    # auto leaves it out: lohan's search includes its plans (on a tie it would win by name)
    assert "fuyou" not in plan_problem(p, "auto").decisions.notes[-1]
