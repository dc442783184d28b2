"""`zero-infinity`: the serialized offload baseline described in Fuyou §3 and Fig. 2a.

fp16 parameters and fp32 master + Adam states live on SSD (DRAM when there is no SSD);
parameters are streamed in block by block, each fetched when its block runs (Fuyou Fig. 2a
measured DeepSpeed's fetches and compute almost serialized); each transformer block's input is
checkpointed to DRAM and the rest of its activations recomputed in backward, the checkpoint's
copies and each gradient's copy to DRAM blocking the compute as DeepSpeed's do
(`Decisions.blocking_copies`); gradients go to
DRAM and on to SSD in fp32, as DeepSpeed swaps them (stage3.py `swap_out_gradients`); the CPU
optimizer runs after the whole backward, subgroup after subgroup (read states and gradient,
update, write), so GPU, CPU and SSD work mostly one after another.

Host memory as DeepSpeed really holds it (it bounds the baseline's largest trainable model): besides
what the schedule moves through DRAM, DeepSpeed's ZeRO-3 with parameters and optimizer on NVMe
keeps pinned swap buffers and a host copy of every gradient (`deepspeed_host_bytes`), counted as
`Decisions.host_reserved` in the plan's DRAM peak.
"""
import math

from tensorstow.schema.schedule import BlockDecision, Decisions

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py, offload_config.py; the same in 0.9.3,
# Fuyou's version, and 0.19.8)
SUB_GROUP = 10 ** 9
"""zero_optimization.sub_group_size: a sub-group closes once it holds this many elements."""
OPTIMIZER_BUFFERS = 4
"""offload_optimizer.buffer_count: pinned fp32 swap buffers of one sub-group each."""
PARAM_BUFFERS, PARAM_BUFFER_ELEMS = 5, 10 ** 8
"""offload_param.buffer_count x buffer_size: pinned buffers parameters are swapped in through."""
MAX_IN_CPU = 10 ** 9
"""offload_param.max_in_cpu: elements of the pinned flat parameter buffer."""


def _pinned(nbytes: int) -> int:
    """What a pinned host allocation of `nbytes` takes: PyTorch's caching host allocator rounds it
    up to a power of two (and keeps the block cached)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def deepspeed_host_bytes(params: int, param_bytes: int, largest_param: int, pin_memory: bool = True) -> dict[str, int]:
    """Host memory DeepSpeed's ZeRO-3 holds, with parameters and optimizer states offloaded to NVMe,
    besides what this policy's schedule itself keeps in DRAM, for `params` trainable parameters of
    `param_bytes` each (2: an fp16/bf16 model, 4: fp32), by its allocations (DeepSpeed 0.9.3 and
    0.19.8: runtime/zero/stage3.py, runtime/swap_tensor/) with its default configuration.

    The host copy of every gradient in the model's dtype (stage3.py `grad_partitions_flat_buffer`)
    is held all step besides the fp32 gradients the schedule moves through DRAM to SSD; while it is
    made, so is its unpinned source (`torch.zeros(...)`, then `pin_memory()` copies it).
    `pin_memory`: the offload configs' flag, on in DeepSpeed's NVMe examples (the swap buffers are
    pinned either way). The optimizer's initialisation holds one
    sub-group's fp32 master, gradient and two Adam moments at once (stage3.py
    `_create_fp32_partitions`, `initialize_optimizer_states`; cpu_adam.py). The largest sub-group
    holds at most SUB_GROUP + the largest parameter's elements."""
    pin = _pinned if pin_memory else (lambda n: n)
    sub = min(params, SUB_GROUP + largest_param)
    grads = params * param_bytes
    return {
        "gradient buffer (pinned)": pin(grads),  # stage3.py grad_partitions_flat_buffer, model dtype
        "gradient buffer: unpinned source while pinned": grads if pin_memory else 0,
        "optimizer swap buffers": OPTIMIZER_BUFFERS * _pinned(sub * 4),  # optimizer_utils.py SwapBufferManager
        "parameter swap buffers": _pinned(PARAM_BUFFERS * PARAM_BUFFER_ELEMS * param_bytes),  # partitioned_param_swapper.py
        "partitioned swap buffer": _pinned(sub * param_bytes),  # partitioned_param_swapper.py, from stage3.py
        "flat parameter buffer": _pinned(min(MAX_IN_CPU, params) * param_bytes),  # param_groups_fp16_flat_cpu_memory
        "optimizer initialisation (fp32 master, gradient, moments)": 16 * sub,
    }


def plan(problem) -> Decisions:
    home, params_home = problem.home("optimizer"), problem.home("params")
    blocks = {}
    for b in problem.order:
        layer = problem.graph.block(b).kind == "layer"
        blocks[b] = BlockDecision(params=params_home, states=home, optimizer="cpu",
                                  activations="recompute" if layer else "keep",
                                  checkpoint="dram" if layer else "gpu")
    params = sum(problem.profiles[problem.profile_of[b]].param_count for b in problem.order)
    largest = max((math.prod(t.shape) for t in problem.graph.tensors if t.kind == "parameter"), default=0)
    host = deepspeed_host_bytes(params, 2 if problem.mixed else 4, largest)
    gb = ", ".join(f"{k} {v / 1e9:.3g} GB" for k, v in host.items())
    return Decisions(policy="zero-infinity", blocks=blocks, prefetch=0, overlap_optimizer=False,
                     serialize_optimizer=True, swap_grads=home == "ssd", blocking_copies=True, host_reserved=sum(host.values()),
                     notes=(f"parameters and optimizer states on {home}" if home == params_home else
                            f"parameters on {params_home}, optimizer states on {home}",
                            "each block's parameters fetched when it runs, not ahead (Fuyou Fig. 2a: "
                            "GPU compute and PCIe transfers almost serialized)",
                            *(("fp32 gradients to SSD and back for the update (DeepSpeed "
                               "swap_out_gradients)",) if home == "ssd" else ()),
                            "inter-block checkpoints in DRAM, intra-block activations recomputed",
                            "checkpoint and gradient copies block the compute, as DeepSpeed makes them "
                            "(checkpointing.py CPU_CHECKPOINT `.to()`, swap_tensor/utils.py `insert_tensor`)",
                            "CPU Adam after backward, one subgroup at a time (Fuyou Fig. 2a)",
                            f"DeepSpeed's host memory besides the schedule's buffers: {gb}"))
