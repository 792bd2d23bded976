"""Expected generation speed per load path: bandwidth bounds plus the per-module cost of eager PyTorch
and of ZeRO-3's hooks.

A decode step must read every resident weight and the KV cache from HBM; ZeRO-3 must also all-gather
every non-persistent parameter from the other ranks, and with offload copy each rank's shard from host
memory (or NVMe) first. Gathers overlap compute only partly, so the slowest stream bounds the step.
Bandwidths come with stated efficiencies; two per-call latencies are calibrated (below); ``bench/plan``
measures the result.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

HBM_EFFICIENCY = 0.8
LINK_EFFICIENCY = 0.7
UNPINNED_FACTOR = 0.35  # pageable host memory is staged through a pinned bounce buffer
EAGER_LAYER_SECONDS = 0.5e-3  # kernel launches of one decoder layer in eager PyTorch
STEP_SECONDS = 3e-3  # generate's per-token Python work
# Two latencies are calibrated, one H200 case each (bench/plan, 2 x H200 host; they are host-CPU bound, so
# another machine will differ): ZeRO-3's fetch/release hooks per module, from llama-3b ZeRO-3 on one GPU
# (nothing to gather: the hooks are the whole difference to plain), and one AutoTP all-reduce through
# deepspeed.comm, from llama-8b tp on 2 GPUs at batch 1. They were 60 and 40 microseconds (guesses), which
# made ZeRO-3 and tp 1.6-3.7x too fast; BENCHMARKS.md has the other 14 cases against them.
ZERO3_MODULE_SECONDS = 0.38e-3
ALLREDUCE_SECONDS = 0.4e-3
PREFILL_MFU = 0.4


@dataclass
class Speed:
    decode_step_s: float
    prefill_s: float
    tokens_per_s: float  # per rank: new tokens of its batch per second, prefill included
    decode_tokens_per_s: float
    bound: str  # hbm | gather | host-to-device | nvme | overhead

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_speed(mem, shape, wl, hw, knobs=None) -> Speed:
    b = wl.dtype_bytes
    inv = shape.inventory
    weights = inv.num_params * b
    n = mem.ranks if mem.name != "plain" else 1
    avg_len = wl.prompt_len + wl.new_tokens / 2
    kv_read = 0
    for elems in shape.kv_elems_per_token:
        kv_read += wl.batch * avg_len * elems * b / (n if mem.name == "tp" else 1)
    hbm = hw.hbm_bandwidth * HBM_EFFICIENCY
    read = (weights / n if mem.name == "tp" else weights) + kv_read
    t_hbm = read / hbm
    modules = len(inv.modules())
    overhead = STEP_SECONDS + shape.layers * EAGER_LAYER_SECONDS
    streams = {"hbm": t_hbm}
    if mem.name == "tp":
        overhead += shape.layers * 2 * ALLREDUCE_SECONDS
    if mem.name.startswith("zero3"):
        containers = shape.layers * 4 + 3
        overhead += (modules + containers) * ZERO3_MODULE_SECONDS
        moved = mem.gathered_bytes_per_step
        if mem.ranks > 1:
            streams["gather"] = moved * (mem.ranks - 1) / mem.ranks / (hw.gpu_gpu_bandwidth * LINK_EFFICIENCY)
        if mem.name == "zero3-offload":
            pinned = knobs.offload_param_pin_memory if knobs is not None and knobs.offload_param else True
            h2d = hw.h2d_bandwidth * LINK_EFFICIENCY * (1 if pinned else UNPINNED_FACTOR)
            streams["host-to-device"] = moved / mem.ranks / h2d
        if mem.name == "zero3-offload-nvme":
            streams["nvme"] = moved / mem.ranks / hw.nvme_bandwidth
    bound, slowest = max(streams.items(), key=lambda kv: kv[1])
    step = slowest + overhead
    if overhead > slowest:
        bound = "overhead"
    flops = 2 * inv.num_params * wl.batch * wl.prompt_len / (n if mem.name == "tp" else 1)
    prefill = flops / (hw.flops * PREFILL_MFU) + step
    total = prefill + max(wl.new_tokens - 1, 0) * step
    return Speed(step, prefill, wl.batch * wl.new_tokens / total, wl.batch / step, bound)
