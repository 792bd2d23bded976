"""The allocated peak: per-GPU and host memory of one inference run (load + generate) on a load path, as
``torch.cuda.max_memory_allocated`` reports it.

Derived from how the real code allocates, not fitted:

* transformers' ``generate`` with ``DynamicCache``: the cache grows by ``torch.cat`` (one layer's old and new
  keys live together for a moment); prefill runs the whole prompt through each layer; ``logits_to_keep=1``
  keeps the lm_head output to the last position, which ``generate`` copies to float32.
* the Llama-style layer: the embedding output and each layer's input stay referenced by the caller while
  the layer runs; RMSNorm computes in float32; the gated MLP holds act(gate), up and their product at once.
* DeepSpeed ZeRO-3: shards, persistent parameters and the gathers of one forward (``schedule.py``).
* AutoTP (``deepspeed.init_inference``): linear layers and the lm_head are split N ways; norms and the input
  embedding stay whole; every rank runs the same batch.

A path says how it holds the weights (``Layout``); ``allocated`` turns that into the peak and its parts.
What the caching allocator reserves on top is the reserved model's (``reserved.py``), combined by the path
(``paths/``). What ``max_memory_allocated`` does not count (CUDA context, NCCL buffers) is kept apart: it
decides ``fits``, not ``gpu_peak_bytes``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dsdoctor.model.inventory import Inventory
from dsdoctor.plan import schedule
from dsdoctor.plan.schedule import Gather, Moment, gather_points, peak_moment, prepared, step_kind, trace_steps
from dsdoctor.plan.shape import ModelShape, kv_bytes
from dsdoctor.zero_costs import optimizer_cost

MiB = 1024**2
GiB = 1024**3
CUBLAS_WORKSPACE = 32 * MiB  # torch's cuBLAS workspace on Hopper (":4096:8"), allocated through the caching allocator
CUDA_CONTEXT = 600 * MiB  # per process, outside the caching allocator
NCCL_BUFFERS = 512 * MiB  # per process with a multi-rank communicator, outside the caching allocator
CHECKPOINT_SHARD = 5 * GiB  # transformers' default safetensors shard: held on the host while loading
TRAINING_PARTS = ("reduce_bucket", "optimizer_state")  # what a training config's optimizer adds on the GPU


@dataclass
class PathMemory:
    name: str
    ranks: int
    replicas: int  # independent batches served at once (data parallel)
    gpu_peak_bytes: int
    gpu_outside_allocator_bytes: int  # CUDA context, NCCL: counted for fits only
    host_peak_bytes: int  # the whole host: every rank on it
    peak_at: str
    gpu_breakdown: dict
    host_breakdown: dict
    resident_weight_bytes: int
    gathered_bytes_per_step: int  # weights a decode step must bring in (gather or host copy), per rank
    notes: list = field(default_factory=list)
    gpu_reserved_bytes: int = 0  # what the caching allocator holds: the path's reserved model (with_reserved)
    fragmentation_bytes: int = 0  # reserved beyond allocated
    host_file_bytes: int = 0  # mapped checkpoint pages of the loading method (loading.apply_loading)
    reserved_assumption: dict | None = None  # several ranks: the host-ahead figure and the one without (paths/base.py)

    def with_reserved(self, reserved: int) -> PathMemory:
        """This estimate with the reserved bytes of its reserved model."""
        self.gpu_reserved_bytes = int(reserved)
        self.fragmentation_bytes = max(int(reserved) - self.gpu_peak_bytes, 0)
        return self

    @property
    def training_gpu_bytes(self) -> int:
        return sum(self.gpu_breakdown.get(k, 0) for k in TRAINING_PARTS)


@dataclass(frozen=True)
class Layout:
    """How a path holds the weights on one rank: what the allocated-peak model needs to know of it.

    ``name`` is the memory model that applies ("plain": whole weights, "tp": AutoTP, or a ZeRO-3 path); a
    path built on another (a tp group, a quantized path) renames the result."""
    name: str
    tp: int = 1  # AutoTP degree: linears, KV cache and activations split this many ways
    world: int = 1  # ranks of one model instance
    replicas: int = 1  # independent batches on the machine
    procs: int = 1  # processes on the host
    gather: Gather = Gather()  # ZeRO-3's settings; zero3=False: the weights are resident

    @property
    def gathers(self) -> bool:
        """Parameters are gathered each forward (several ranks, or offloaded on one)."""
        return self.gather.zero3 and (self.world > 1 or bool(self.gather.offload))


def zero3_gather(world: int, offload: str | None, knobs) -> Gather:
    """ZeRO-3's gather settings from the config's stage-3 knobs (DeepSpeed's defaults without a config)."""
    if knobs is None:
        return Gather(world=world, zero3=True, offload=offload)
    return Gather(world=world, zero3=True, offload=offload, persistence_threshold=knobs.param_persistence_threshold,
                  prefetch_bucket=knobs.prefetch_bucket_size, max_live=knobs.max_live_parameters,
                  max_reuse=knobs.max_reuse_distance)


def _pow2(n: int) -> int:
    """torch's pinned host allocator rounds every block up to a power of two."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def params_numel(inv: Inventory) -> list[int]:
    return [p.numel for p in inv.params]


def persistent_params(numel_of: list[int], g: Gather) -> list[int]:
    """Parameters ZeRO-3 keeps whole once fetched (at or under the persistence threshold)."""
    return [i for i, k in enumerate(numel_of) if g.zero3 and k <= g.persistence_threshold]


TP_GRAIN = 64  # deepspeed.inference.config: tensor_parallel.tp_grain_size
_ROW_PARALLEL = {"o_proj", "down_proj"}  # AutoTP's all-reduce linears split their input dimension


def _tp_shard(total: int, tp: int, rank: int, kv_heads: int | None, name: str) -> int:
    """The rows (or columns) ``rank`` gets of a dimension of ``total`` (module_inject/tp_shard.py:
    get_shard_size): attention splits whole key/value heads; MLPs and the lm_head split in grains of 64,
    the last rank taking the tail."""
    mlp = "mlp" in name or step_kind(name) in ("gate_proj", "up_proj", "down_proj")
    if kv_heads and total % kv_heads == 0 and not mlp and not name.endswith(("lm_head", "embed_out")):
        return total * (kv_heads // tp + (1 if rank < kv_heads % tp else 0)) // kv_heads
    if total >= TP_GRAIN:
        grains, tail = divmod(total, TP_GRAIN)
        return (grains // tp + (1 if rank < grains % tp else 0)) * TP_GRAIN + (tail if rank == tp - 1 else 0)
    return total // tp + (1 if rank < total % tp else 0)


def _tp_share(inv: Inventory, tp: int, kv_heads: int | None = None) -> int:
    """Elements the fullest AutoTP rank holds: decoder linears split (column-parallel on their outputs,
    o_proj/down_proj on their inputs) and the lm_head on its input; norms whole; a tied lm_head gets its
    own slice. The input embedding stays whole: AutoTP's default policies slice only modules inside the
    decoder layers, plus the lm_head (``module_inject/auto_tp.py``: ``nn.Embedding`` is sliced only through
    a ``partition_config``), and the embedding lies outside them."""
    def rank_share(rank: int) -> int:
        total = 0
        for p in inv.params:
            split = p.kind == "lm_head" or (p.kind == "linear" and p.layer is not None)
            if not split or not p.shape:
                total += p.numel
                continue
            rows = p.kind == "linear" and step_kind(p.module) not in _ROW_PARALLEL
            if len(p.shape) == 2:
                dim = 0 if rows else 1
                other = p.shape[1 - dim]
                total += _tp_shard(p.shape[dim], tp, rank, kv_heads, p.module) * other
            else:  # a bias: split with its column-parallel weight, whole after a row-parallel one
                total += _tp_shard(p.numel, tp, rank, kv_heads, p.module) if rows else p.numel
        for alias, owner in inv.tied:
            for p in inv.params:
                if p.module == owner and len(p.shape) == 2:
                    total += _tp_shard(p.shape[1], tp, rank, kv_heads, alias) * p.shape[0]
        return total

    return max(rank_share(r) for r in range(tp))


def _training_extras(knobs, numel: int, world: int, b: int) -> tuple[dict, dict, list]:
    """What ``deepspeed.initialize`` with an optimizer section builds (DeepSpeedZeroOptimizer_Stage3)."""
    gpu, host, notes = {}, {}, []
    if knobs is None or not knobs.has_optimizer or knobs.zero_stage != 3:
        return gpu, host, notes
    cost = optimizer_cost(numel, world, knobs.offload_optimizer, b, knobs.reduce_bucket_size)
    gpu["reduce_bucket"] = cost["bucket"]
    if cost["host"]:  # pinned, per rank: the node holds every local rank's
        host["optimizer_state"] = cost["host"] * world
    else:
        gpu["optimizer_state"] = cost["gpu"]
    notes.append("training-config optimizer state counted (Adam moments appear only at step())")
    return gpu, host, notes


def _untied_numel(inv: Inventory) -> list[int]:
    """A tied output layer's own weight, which exists until post_init ties it."""
    return [p.numel for alias, owner in inv.tied for p in inv.params if p.module == owner]


def _weights(layout: Layout, shape: ModelShape, b: int, numel_of: list, persistent_bytes: int,
             built_from_config: bool) -> tuple[int, int]:
    """(resident weight bytes on each GPU, the load's peak). Load: building on the GPU (plain), slicing a host
    copy (tp), or zero.Init: every module is built whole on the GPU, then partitioned (to the host with
    offload). A tied output layer is built too, with its own weight, and partitioned like the rest; only
    post_init's tying drops it, after everything else."""
    inv, g, world = shape.inventory, layout.gather, layout.world
    if g.zero3:
        shards = sum(math.ceil(k / world) for k in numel_of) * b
        resident = (0 if g.offload else shards) + persistent_bytes
        load_peak, done = resident, 0
        for k in numel_of + _untied_numel(inv):
            shard = math.ceil(k / world) * b
            load_peak = max(load_peak, done + k * b + (0 if g.offload else shard))
            done += 0 if g.offload else shard
        return resident, max(load_peak, resident)
    if layout.tp > 1:
        resident = _tp_share(inv, layout.tp, shape.kv_heads) * b
        return resident, resident
    resident = sum(numel_of) * b
    if built_from_config and inv.tied:
        # no weights to load: the model is built from its config on the GPU (``model_cls(config)``), which
        # creates the output layer with its own weight last; post_init's tying frees it only after that
        # (measured on one H200: Llama-3.2-1B and Qwen2.5-1.5B shapes, load peak = weights + lm_head exactly).
        # from_pretrained builds on the meta device and ties before loading: no such transient.
        return resident, max(resident, resident + sum(_untied_numel(inv)) * b)
    return resident, resident


def _forward_points(shape: ModelShape, b: int, tp: int, g: Gather, numel_of: list) -> tuple:
    """One forward's points without and with prefetch (the first generate records the trace, later forwards
    prefetch along it); they do not depend on the workload, so they are kept on the shape."""
    key = (tp, b, g)
    if key not in shape.point_cache:
        steps = trace_steps(shape, b, tp)
        shape.point_cache[key] = tuple(prepared(gather_points(steps, shape.layers, b, g, pf, numel_of))
                                       for pf in (False, True))
    return shape.point_cache[key]


def _generate_peaks(shape: ModelShape, wl, tp: int, g: Gather, numel_of: list, fixed: int) -> list[tuple]:
    """(phase, moment, fixed + its total) at the peak of each forward of both generates: the prefill forwards
    (first, then with prefetch) and a decode step at the longest cache."""
    b, B, S, final = wl.dtype_bytes, wl.batch, wl.prompt_len, wl.final_len
    kv_prompt = kv_bytes(shape, B, S, b, tp)
    kv_final = kv_bytes(shape, B, final, b, tp)
    kv_layer_final = max(kv_bytes(shape, B, final, b, tp, layers=1) // 2, 0)
    vocab = shape.vocab  # tp: LmHeadLinearAllreduce returns whole logits
    logits_prefill_tokens = 1 if shape.logits_to_keep else S
    logits_prefill = B * logits_prefill_tokens * vocab * b + B * vocab * 4
    logits_decode = B * vocab * b + B * vocab * 4
    first_pts, warm_pts = _forward_points(shape, b, tp, g, numel_of)
    lm_prefill = B * logits_prefill_tokens * vocab * b
    scores = schedule.eager_scores(shape, B, S, S, b, tp)
    first = peak_moment(first_pts, B * S, shape.layers, 0, kv_prompt, 0, logits_prefill, lm_prefill, fixed, scores)
    warm = peak_moment(warm_pts, B * S, shape.layers, 0, kv_prompt, 0, logits_prefill, lm_prefill, fixed, scores)
    decode = peak_moment(warm_pts, B, shape.layers, kv_bytes(shape, B, final - 1, b, tp), kv_final, kv_layer_final,
                         logits_decode, B * vocab * b, fixed, schedule.eager_scores(shape, B, 1, final, b, tp))
    return [("prefill", *first), ("prefill", *warm), ("decode", *decode)]


def _gpu_peak(layout: Layout, shape: ModelShape, wl, numel_of: list, resident: int, load_peak: int,
              persistent_bytes: int, phases: tuple | None) -> tuple[str, float, dict]:
    """(phase, peak, parts) of the allocated peak over load and generate; ``phases`` limits the phases read."""
    fixed = resident + CUBLAS_WORKSPACE
    candidates = [("load", Moment("load", 0, 0, 0), load_peak)]
    candidates += _generate_peaks(shape, wl, layout.tp, layout.gather, numel_of, fixed)
    if phases:  # e.g. ab reads a generate-only peak: ("prefill", "decode")
        candidates = [c for c in candidates if c[0] in phases]
    phase, moment, peak = max(candidates, key=lambda c: c[2])
    if phase == "load":
        return phase, load_peak, {"weights_resident": resident, "load_transient": load_peak - resident}
    return phase, peak, {"weights_resident": resident - persistent_bytes, "persistent_params": persistent_bytes,
                         "gathered_params": moment.gathered, "kv_cache": moment.kv, "activations": moment.act,
                         "logits": moment.logits, "cublas_workspace": CUBLAS_WORKSPACE}


def _host_parts(layout: Layout, weights: int, numel_of: list, persistent: list, knobs, b: int) -> dict:
    """Host memory, all ranks of the machine together: the checkpoint while loading (replaced by the loading
    method's figures, ``loading.apply_loading``), and what offload_param pins."""
    g, world, procs = layout.gather, layout.world, layout.procs
    host: dict[str, int] = {}
    if layout.tp > 1:
        host["model_copy_while_sharding"] = weights * procs
    else:
        host["checkpoint_while_loading"] = min(weights, CHECKPOINT_SHARD) * procs
    if g.offload == "cpu":
        pinned = knobs.offload_param_pin_memory if knobs is not None and knobs.offload_param else True
        kept = set(persistent)
        per_rank = sum((_pow2(math.ceil(k / world) * b) if pinned else math.ceil(k / world) * b)
                       for i, k in enumerate(numel_of) if i not in kept)
        host["offloaded_params_pinned" if pinned else "offloaded_params"] = per_rank * procs
    if g.offload == "nvme":
        count = knobs.nvme_buffer_count if knobs is not None else 5
        size = knobs.nvme_buffer_size if knobs is not None else 100_000_000
        host["nvme_swap_buffers_pinned"] = _pow2(size * b) * count * procs
    return host


def allocated(layout: Layout, shape: ModelShape, wl, knobs=None, context_bytes: int | None = None,
              phases: tuple | None = None, built_from_config: bool = False) -> PathMemory:
    """The allocated peak of one path and its parts, on the GPU and the host; ``gpu_reserved_bytes`` is left
    to the path's reserved model. ``knobs``: the config settings that apply to this path (its training state,
    offload_param's pinning and NVMe buffers); ``context_bytes``: the CUDA context (a machine profile's);
    ``built_from_config``: no checkpoint, the model is built from its config on the GPU."""
    inv, b, g = shape.inventory, wl.dtype_bytes, layout.gather
    numel_of = params_numel(inv)
    persistent = persistent_params(numel_of, g)
    persistent_bytes = sum(numel_of[i] for i in persistent) * b
    resident, load_peak = _weights(layout, shape, b, numel_of, persistent_bytes, built_from_config)
    phase, peak, breakdown = _gpu_peak(layout, shape, wl, numel_of, resident, load_peak, persistent_bytes, phases)
    t_gpu, t_host, notes = _training_extras(knobs if g.zero3 else None, sum(numel_of), layout.world, b)
    for key, value in t_gpu.items():
        breakdown[key] = value
        peak += value
    # deepspeed.initialize needs a process group: ZeRO-3 holds NCCL's buffers on one rank too (measured on one
    # H200: 1.25 GiB outside the allocator under ZeRO-3 vs 0.68 GiB plain, bench/speed run 1)
    outside = (context_bytes if context_bytes is not None else CUDA_CONTEXT) + \
        (NCCL_BUFFERS if layout.world > 1 or g.zero3 else 0)
    host = _host_parts(layout, sum(numel_of) * b, numel_of, persistent, knobs, b)
    host.update(t_host)
    kept = set(persistent)
    gathered = sum(k for i, k in enumerate(numel_of) if i not in kept) * b if layout.gathers else 0
    if g.zero3 and layout.world == 1 and not g.offload:
        notes.append("ZeRO-3 on one rank shards nothing: every parameter stays whole on the GPU")
    return PathMemory(layout.name, layout.world, layout.replicas, int(peak), outside, int(sum(host.values())),
                      phase, {k: int(v) for k, v in breakdown.items() if v}, host, int(resident), int(gathered),
                      notes)
