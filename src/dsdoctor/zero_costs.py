"""What a reused *training* config makes ``deepspeed.initialize`` allocate at inference, in one place so that
``check`` (DSD101/102), ``plan`` (DSD203) and ``trace`` say the same numbers. Torch-free.

With an ``optimizer`` section and stage 3, DeepSpeed 0.19.8 builds ``DeepSpeedZeroOptimizer_Stage3``
(runtime/zero/stage3.py): per element of the rank's parameter shard, an fp32 master copy
(``_create_fp32_partitions``), an fp32 gradient buffer per sub-group (``initialize_optimizer_states``) and a
flat gradient partition (``grad_partitions_flat_buffer``). With ``offload_optimizer`` they live in pinned host
memory, which the pinned allocator rounds up; without it they sit on the GPU. Adam's moments would come at
the first ``step()``, which inference never calls. Plus the IPG reduce bucket (``reduce_bucket_size``
elements) on the GPU.

Measured on 2 x H200 (bench/config, 1.35B-parameter Llama in bf16, the bundled training config with
offload_optimizer cpu, pinned): 8.49 bytes of host memory per model parameter per rank with 2 ranks, i.e.
about 17 bytes per element of the rank's 1/2 shard; initialize took 14.1 s instead of 3.8 s.
"""
from __future__ import annotations

import math

HOST_BYTES_PER_SHARD_ELEMENT = 17  # measured (above): 4 master + 4 grad + flat partition, pinned rounding
GPU_BYTES_PER_SHARD_ELEMENT_FP32 = 4  # fp32 master on the GPU without offload_optimizer


def shard_numel(num_params: int, world: int) -> int:
    return math.ceil(num_params / max(world, 1))


def optimizer_cost(num_params: int, world: int, offload_optimizer: str, param_bytes: int,
                   reduce_bucket_size: int) -> dict:
    """Bytes per rank that the ZeRO-3 optimizer of a training config adds: ``host``, ``gpu``, ``bucket``."""
    shard = shard_numel(num_params, world)
    if offload_optimizer in ("cpu", "nvme"):
        host, gpu = HOST_BYTES_PER_SHARD_ELEMENT * shard, 0
    else:  # fp32 master plus the flat gradient partition in the parameter dtype, on the GPU
        host, gpu = 0, (GPU_BYTES_PER_SHARD_ELEMENT_FP32 + param_bytes) * shard
    return {"host": host, "gpu": gpu, "bucket": int(reduce_bucket_size) * param_bytes, "shard": shard}


def allgather_s(nbytes: float, ranks: int, bus_bandwidth: float) -> float:
    """Seconds to all-gather ``nbytes`` (the whole tensor) over ``ranks`` at ``bus_bandwidth`` bytes/s: each rank
    receives the (ranks - 1) / ranks it does not hold; nothing on one rank."""
    return nbytes * (ranks - 1) / ranks / bus_bandwidth if ranks > 1 else 0.0
