"""The plan's vocabulary is typed (schema.schedule): a block's tiers, update device and
activation choice are enums, decoded strictly from a plan file; a buffer's kind is what its name
says; streams and GPU names have one parser; what the lowering needs to know of the options
(`Decisions.updates_wait`) is recorded in the plan."""
import copy
import dataclasses

import pytest

from tensorstow import TensorstowError
from tensorstow.planner.plan import make_plan
from tensorstow.planner.presets import load_hardware
from tensorstow.schema.options import Options
from tensorstow.schema.plan import Plan
from tensorstow.schema.schedule import (Activations, BlockDecision, Stream, Tier, UpdateDevice, buffer_kind,
                                        gpu_index, is_gpu, resource_of)
from tests.test_executor import get_plan


def test_a_block_decision_holds_enums_whatever_it_was_given_and_writes_the_same_json():
    d = BlockDecision(params="ssd", states="dram", optimizer="cpu", activations="swap_ssd", checkpoint="dram",
                      accum="dram")
    assert (d.params, d.states, d.optimizer, d.activations, d.checkpoint, d.accum) == (
        Tier.SSD, Tier.DRAM, UpdateDevice.CPU, Activations.SWAP_SSD, Tier.DRAM, Tier.DRAM)
    assert type(d.activations) is Activations and d.activations == "swap_ssd"
    assert BlockDecision(accum="").accum is None
    with pytest.raises(ValueError):
        BlockDecision(params="nvme")
    plan = Plan.from_json(get_plan("zero-infinity"))
    assert Plan.from_json(plan.to_json()).dumps() == plan.dumps()
    assert all(type(b.params) is Tier for b in plan.decisions.blocks.values())


@pytest.mark.parametrize("field, value, says", [
    ("activations", "swap_nvme", "expected one of keep, swap_dram, swap_ssd, recompute, got 'swap_nvme'"),
    ("params", "hbm", "expected one of gpu, dram, ssd, got 'hbm'"),
    ("optimizer", "tpu", "expected one of gpu, cpu, got 'tpu'"),
])
def test_a_plan_file_with_an_unknown_choice_is_one_error_naming_the_field(field, value, says):
    d = copy.deepcopy(get_plan("zero-infinity"))
    block = next(iter(d["decisions"]["blocks"]))
    d["decisions"]["blocks"][block][field] = value
    with pytest.raises(TensorstowError, match=rf"field 'decisions\.blocks\.{block}\.{field}': {says}"):
        Plan.from_json(d)


def test_a_buffer_kind_is_what_its_name_says_and_a_plan_file_that_disagrees_is_refused():
    d = copy.deepcopy(get_plan("zero-infinity"))
    plan = Plan.from_json(d)
    assert {(n.split(":")[0], b.kind) for n, b in plan.buffers.items()} >= {
        ("P", "parameter"), ("G", "gradient"), ("OS", "optimizer_state"), ("A", "saved_activation")}
    assert all(b.buffer_kind == buffer_kind(n) for n, b in plan.buffers.items())
    name = next(n for n in d["buffers"] if n.startswith("P:"))
    d["buffers"][name]["kind"] = "gradient"
    with pytest.raises(TensorstowError, match=rf"field 'buffers\.{name}\.kind': 'gradient', but a P buffer holds "
                                              r"parameter; re-plan it"):
        Plan.from_json(d)
    d = copy.deepcopy(get_plan("zero-infinity"))
    d["buffers"]["Q:b0"] = dict(d["buffers"][name])
    with pytest.raises(TensorstowError, match="buffer 'Q:b0' is not a buffer name"):
        Plan.from_json(d)


def test_streams_and_gpu_names_have_one_parser():
    assert Stream.of("gpu12.compute") == Stream("gpu12", "compute") and Stream.of("gpu12.compute").on_gpu
    assert Stream.of("ssd.first").resource == resource_of("ssd.write") == "ssd"
    assert Stream.of("cpu.opt").resource == "cpu.opt" and not Stream.of("cpu.opt").on_gpu
    assert [is_gpu(n) for n in ("gpu0", "gpu17", "gpu", "gpux", "gpu0.compute", "dram", "cpu")] == [
        True, True, False, False, False, False, False]
    assert gpu_index("gpu17") == 17
    with pytest.raises(ValueError, match="names no GPU"):
        gpu_index("gpu0.compute")


def test_a_plan_records_that_its_updates_wait_for_every_gradient():
    """Clipping (or fp16 loss scaling) makes every update wait for the last gradient: the plan says
    so in its decisions, and the lowering follows them; without it the key is not written."""
    o = Options(model="gpt-tiny", hardware="lohan-rtx4090", policy="lohan", batch=2, seq=32, gpu_mem=1_000_000,
                clip_rate=1.0)
    hw = load_hardware(o.hardware).with_overrides(gpu_mem=o.gpu_mem)
    plain = make_plan(o, hw)
    clipped = make_plan(dataclasses.replace(o, max_grad_norm=1.0), hw)
    assert not plain.decisions.updates_wait and "updates_wait" not in plain.decisions.to_json()
    assert clipped.decisions.updates_wait and clipped.decisions.to_json()["updates_wait"] is True
    updates = [i.id for i in clipped.instructions if i.kind == "optimizer_step"]
    last_backward = max(i.id for i in clipped.instructions if i.kind == "compute" and i.segment.startswith("bwd"))
    assert updates and min(updates) > last_backward  # no update overlaps the backward
    assert any(i.kind == "optimizer_step" and i.id < max(j.id for j in plain.instructions if j.kind == "compute")
               for i in plain.instructions)
