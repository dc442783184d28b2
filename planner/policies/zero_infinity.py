"""`zero-infinity`: the serialized offload baseline described in Fuyou §3 and Fig. 2a.

fp16 parameters and fp32 master + Adam states live on SSD (DRAM when there is no SSD);
parameters are streamed in block by block; each transformer block's input is checkpointed
to DRAM and the rest of its activations recomputed in backward; the CPU optimizer runs
after the whole backward, subgroup after subgroup (read, update, write), so GPU, CPU and
SSD work mostly one after another.
"""
from tensorstow.planner.schedule import BlockDecision, Decisions


def plan(problem) -> Decisions:
    home = "ssd" if problem.hw.ssd.count > 0 else "dram"
    blocks = {}
    for b in problem.order:
        layer = problem.graph.block(b).kind == "layer"
        blocks[b] = BlockDecision(params=home, states=home, optimizer="cpu",
                                  activations="recompute" if layer else "keep",
                                  checkpoint="dram" if layer else "gpu")
    return Decisions(policy="zero-infinity", blocks=blocks, prefetch=1, overlap_optimizer=False,
                     serialize_optimizer=True,
                     notes=(f"parameters and optimizer states on {home}",
                            "inter-block checkpoints in DRAM, intra-block activations recomputed",
                            "CPU Adam after backward, one subgroup at a time (Fuyou Fig. 2a)"))
