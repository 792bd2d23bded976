"""Plan for generation inside training (``dsdoctor plan --loop``): the policy trains, so its optimizer state
is there while it generates its rollouts.

Two paths are added to the inference ones (their types: ``paths/loop.py``):

* ``zero3-gather-once``: ZeRO-3 for training; for each generate the whole model is all-gathered once and
  ZeRO-3's per-module hooks are lifted (DeepSpeed's ``unwrap_model_for_generation``). Memory while
  generating: the ZeRO-3 partitions + the whole weights + KV cache, activations and logits (plain's generate
  transient) + the training state. Speed: plain speed plus one all-gather of all parameters per generate.
* ``zero2``: parameters whole on every GPU, gradients and optimizer state partitioned. Memory: the weights +
  the 16-bit gradient partition, fp32 master and Adam partitions + plain's generate transient. Speed: plain.

Every ZeRO-3 path also carries the training state in loop mode (fp32 master and gradient partitions, the
reduce bucket; Adam moments come at the first step and are added here, because a loop steps). A loop path's
peak is the larger of its generate and its training step on one micro-batch of the rollouts
(``train_step_bytes``: activations without recomputation, logits): ZeRO-2 trains with the whole weights,
ZeRO-3 with its shards and the layers it gathers, so ZeRO-2 is not always the smaller. Torch-free.
"""
from __future__ import annotations

import dataclasses

from dsdoctor.plan.ds_knobs import DsKnobs
from dsdoctor.plan.memory import CUDA_CONTEXT, NCCL_BUFFERS, TRAINING_PARTS, PathMemory
from dsdoctor.plan.speed import Figures, Speed
from dsdoctor.zero_costs import optimizer_cost

ADAM_MOMENTS_BYTES = 8  # two fp32 moments per parameter, partitioned, from the first step on


ACTIVATION_BYTES_PER_ELEMENT = 34  # per token, hidden element and layer at 16 bits, no recomputation


def train_step_bytes(shape, wl) -> dict:
    """What the training step adds on a rank: the activations kept for backward of one micro-batch of the
    rollouts (batch x (prompt + new tokens)), 34 bytes per token, hidden element and layer at 16 bits
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", without the
    attention-score term that SDPA/flash attention does not keep), and the logits with their fp32 copy for
    the loss. No activation checkpointing."""
    tokens = wl.batch * (wl.prompt_len + wl.new_tokens)
    act = shape.layers * tokens * shape.hidden * ACTIVATION_BYTES_PER_ELEMENT * wl.dtype_bytes // 2
    return {"training_activations": int(act), "training_logits": int(tokens * shape.vocab * (wl.dtype_bytes + 4))}


def _two_phases(generate: dict, train: dict, generate_at: str) -> tuple[int, dict, str]:
    """The peak of a loop is the larger of its generate and its training step."""
    g, t = sum(generate.values()), sum(train.values())
    if t > g:
        return int(t), train, "train-step"
    return int(g), generate, generate_at


def _generate_transient(plain: PathMemory) -> dict:
    keys = ("kv_cache", "activations", "logits", "cublas_workspace")
    return {k: v for k, v in plain.gpu_breakdown.items() if k in keys}


def training_state(numel: int, world: int, b: int, knobs) -> tuple[dict, dict]:
    """GPU and host bytes per rank (host: all ranks) of ZeRO-2/3 training state, Adam moments included; the
    config's offload_optimizer and reduce bucket where it has them, DeepSpeed's defaults otherwise."""
    knobs = knobs or DsKnobs()
    cost = optimizer_cost(numel, world, knobs.offload_optimizer, b, knobs.reduce_bucket_size)
    gpu, host = {"reduce_bucket": cost["bucket"]}, {}
    moments = ADAM_MOMENTS_BYTES * cost["shard"]
    if cost["host"]:
        host["optimizer_state"] = (cost["host"] + moments) * world
    else:
        gpu["optimizer_state"] = cost["gpu"] + moments
    return gpu, host


def with_training_state(mem: PathMemory, numel: int, b: int, knobs, train: dict | None = None) -> PathMemory:
    """A ZeRO-3 inference path's memory with the loop's training state in place of a config's,
    and its training step (``train``: ``train_step_bytes``) as a second phase that may set the peak."""
    gpu_extra, host_extra = training_state(numel, mem.ranks, b, knobs)
    breakdown = {k: v for k, v in mem.gpu_breakdown.items() if k not in TRAINING_PARTS}
    host = {k: v for k, v in mem.host_breakdown.items() if k != "optimizer_state"}
    base = sum(v for k, v in mem.gpu_breakdown.items() if k not in TRAINING_PARTS)
    if mem.peak_at == "load":
        base = mem.gpu_peak_bytes - sum(v for k, v in mem.gpu_breakdown.items() if k in TRAINING_PARTS)
    breakdown.update(gpu_extra)
    host.update(host_extra)
    peak, peak_at = int(base + sum(gpu_extra.values())), mem.peak_at
    if train:  # the step: resident shards, the layers gathered for forward/backward, state, activations
        keep = ("weights_resident", "persistent_params", "gathered_params", "cublas_workspace")
        step = {k: v for k, v in mem.gpu_breakdown.items() if k in keep}
        step.update(gpu_extra)
        step.update(train)
        if peak_at == "load":
            breakdown = {k: v for k, v in breakdown.items() if k not in ("load_transient",)}
        peak, breakdown, peak_at = _two_phases(breakdown if peak_at != "load" else {"_": peak}, step, peak_at)
        breakdown = {k: v for k, v in breakdown.items() if k != "_"} or mem.gpu_breakdown
    return dataclasses.replace(mem, gpu_peak_bytes=peak, gpu_reserved_bytes=peak + (mem.gpu_reserved_bytes -
                               mem.gpu_peak_bytes), gpu_breakdown={k: int(v) for k, v in breakdown.items() if v},
                               host_breakdown=host, host_peak_bytes=int(sum(host.values())), peak_at=peak_at,
                               notes=list(mem.notes) + ["loop: training state counted (Adam moments included)"])


def loop_path(name: str, zero3: PathMemory, plain: PathMemory, numel: int, weights: int, b: int, gpus: int,
              knobs, train: dict | None = None) -> PathMemory:
    """The allocated peak of ``zero2`` or ``zero3-gather-once`` from the ZeRO-3 and plain estimates of the same
    workload: the generate (plain's transient beside the path's weights) or the training step, whichever is
    larger, with the training state."""
    transient = _generate_transient(plain)
    gpu_extra, host_extra = training_state(numel, gpus, b, knobs)
    if name == "zero3-gather-once":  # training runs on the shards, with ZeRO-3's gathered layers
        shards = zero3.gpu_breakdown.get("weights_resident", 0)
        persistent = zero3.gpu_breakdown.get("persistent_params", 0)
        breakdown = {"weights_resident": shards, "persistent_params": persistent,
                     "gathered_whole_model": max(weights - persistent, 0)}
        notes = ["whole weights on every GPU while generating, ZeRO-3 partitions as well",
                 "speed: plain plus one all-gather of every parameter per generate"]
        step = {"weights_resident": shards, "persistent_params": persistent,
                "gathered_params": zero3.gpu_breakdown.get("gathered_params", 0)}
    else:  # zero2
        breakdown = {"weights_resident": weights}  # the gradient partition is in optimizer_state
        notes = ["ZeRO-2: whole weights resident, gradients and optimizer state partitioned"]
        step = {"weights_resident": weights}
    breakdown.update(transient)
    breakdown.update(gpu_extra)
    step.update(gpu_extra)
    step.update(train or {})
    peak, breakdown, peak_at = _two_phases(breakdown, step if train else {}, "decode")
    host = dict(zero3.host_breakdown) if name == "zero3-gather-once" else dict(plain.host_breakdown)
    host = {k: v for k, v in host.items() if k != "optimizer_state"}
    host.update(host_extra)
    outside = CUDA_CONTEXT + (NCCL_BUFFERS if gpus > 1 else 0)
    return PathMemory(name, gpus, gpus, peak, outside, int(sum(host.values())), peak_at,
                      {k: int(v) for k, v in breakdown.items() if v}, host, weights, 0, notes)


def loop_speed(name: str, plain_speed: Speed, weights: int, gpus: int, wl, figures: Figures) -> Speed:
    """Plain speed; gather-once adds one all-gather of every parameter per generate (at the machine's
    all-gather bus bandwidth)."""
    gather = 0.0
    if name == "zero3-gather-once" and gpus > 1:
        gather = weights * (gpus - 1) / gpus / figures.allgather_bus_bw
    tokens = wl.batch * wl.new_tokens
    total = tokens / plain_speed.tokens_per_s + gather
    return Speed(plain_speed.decode_step_s, plain_speed.prefill_s + gather, tokens / total,
                 plain_speed.decode_tokens_per_s, plain_speed.bound)


TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}
FP16_SCALING = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                "hysteresis": 2, "min_loss_scale": 1}


def training_dtype_section(dtype: str) -> dict:
    """The precision section of a training config: bf16, or fp16 with dynamic loss scaling (DeepSpeed's defaults:
    ``loss_scale`` 0, ``initial_scale_power`` 16, ``loss_scale_window`` 1000, ``hysteresis`` 2,
    ``min_loss_scale`` 1), fp32 none. Without an fp16 section an fp16 user would train in fp32."""
    if dtype == "bf16":
        return {"bf16": {"enabled": True}}
    if dtype == "fp16":
        return {"fp16": dict(FP16_SCALING)}
    return {}


def training_code(path: str, model: str, gpus: int, dtype: str) -> str:
    """The training script of a loop whose actor trains on ``path`` and generates its rollouts, in the run's
    dtype (its precision section and ``from_pretrained(..., dtype=...)``)."""
    stage = 2 if path == "zero2" else 3
    cfg = {**training_dtype_section(dtype), "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-6}}, "train_micro_batch_size_per_gpu": 1}
    lines = [f"# deepspeed --num_gpus {gpus} train_rl.py",
             "import deepspeed, torch",
             "from transformers import AutoModelForCausalLM",
             f"ds_config = {cfg!r}",
             f"policy = AutoModelForCausalLM.from_pretrained({model!r}, dtype={TORCH_DTYPE.get(dtype, 'torch.bfloat16')})",
             "engine, *_ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=ds_config)"]
    if path == "zero3-gather-once":
        lines += ["from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation",
                  "with unwrap_model_for_generation(engine):  # one all-gather, ZeRO-3's module hooks lifted",
                  "    rollouts = engine.module.generate(**prompts, max_new_tokens=N)"]
    else:
        lines += ["rollouts = engine.module.generate(**prompts, max_new_tokens=N"
                  + (", synced_gpus=True)" if stage == 3 else ")")]
    lines += ["engine.backward(loss_of(rollouts)); engine.step()"]
    return "\n".join(lines) + "\n"


def in_loop(mem: PathMemory | None, shape, wl, knobs) -> PathMemory | None:
    """A ZeRO-3 inference path's memory in a loop: it carries the training state and step."""
    if mem is None:
        return None
    return with_training_state(mem, shape.inventory.num_params, wl.dtype_bytes, knobs, train_step_bytes(shape, wl))
