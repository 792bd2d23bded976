"""Plan for generation inside training (``dsdoctor plan --loop``): the policy trains, so its optimizer state
is there while it generates its rollouts.

Two paths are added to the inference ones:

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

from dsdoctor.plan.memory import CUDA_CONTEXT, NCCL_BUFFERS, PathMemory
from dsdoctor.plan.speed import LINK_EFFICIENCY, Speed
from dsdoctor.zero_costs import optimizer_cost

LOOP_PATHS = ("zero2", "zero3-gather-once")
# where the actor trains: the inference-only paths are shown for reference, not recommended
TRAINING_PATHS = ("zero2", "zero3-gather-once", "zero3", "zero3-offload", "zero3-offload-nvme")
PREFERENCE = ("zero2", "zero3-gather-once", "zero3", "zero3-offload", "zero3-offload-nvme")
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
    """GPU and host bytes per rank (host: all ranks) of ZeRO-2/3 training state, Adam moments included."""
    offload = getattr(knobs, "offload_optimizer", None)
    bucket = getattr(knobs, "reduce_bucket_size", 500_000_000)
    cost = optimizer_cost(numel, world, offload, b, bucket)
    gpu, host = {"reduce_bucket": cost["bucket"]}, {}
    moments = ADAM_MOMENTS_BYTES * cost["shard"]
    if cost["host"]:
        host["optimizer_state"] = (cost["host"] + moments) * world
    else:
        gpu["optimizer_state"] = cost["gpu"] + moments
    return gpu, host


def with_training_state(mem: PathMemory, numel: int, b: int, knobs, train: dict | None = None) -> PathMemory:
    """A ZeRO-3 inference path of ``estimate_path`` with the loop's training state in place of a config's,
    and its training step (``train``: ``train_step_bytes``) as a second phase that may set the peak."""
    gpu_extra, host_extra = training_state(numel, mem.ranks, b, knobs)
    breakdown = {k: v for k, v in mem.gpu_breakdown.items() if k not in ("reduce_bucket", "optimizer_state")}
    host = {k: v for k, v in mem.host_breakdown.items() if k != "optimizer_state"}
    base = sum(v for k, v in mem.gpu_breakdown.items() if k not in ("reduce_bucket", "optimizer_state"))
    if mem.peak_at == "load":
        base = mem.gpu_peak_bytes - sum(v for k, v in mem.gpu_breakdown.items() if k in ("reduce_bucket",
                                                                                           "optimizer_state"))
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
    transient = _generate_transient(plain)
    gpu_extra, host_extra = training_state(numel, gpus, b, knobs)
    if name == "zero3-gather-once":
        shards = zero3.gpu_breakdown.get("weights_resident", 0)
        persistent = zero3.gpu_breakdown.get("persistent_params", 0)
        breakdown = {"weights_resident": shards, "persistent_params": persistent,
                     "gathered_whole_model": max(weights - persistent, 0)}
        notes = ["whole weights on every GPU while generating, ZeRO-3 partitions as well",
                 "speed: plain plus one all-gather of every parameter per generate"]
    else:  # zero2
        breakdown = {"weights_resident": weights}  # the gradient partition is in optimizer_state
        notes = ["ZeRO-2: whole weights resident, gradients and optimizer state partitioned"]
    if name == "zero3-gather-once":  # training runs on the shards, with ZeRO-3's gathered layers
        step = {"weights_resident": shards, "persistent_params": persistent,
                "gathered_params": zero3.gpu_breakdown.get("gathered_params", 0)}
    else:
        step = {"weights_resident": weights}
    breakdown.update(transient)
    breakdown.update(gpu_extra)
    step.update(gpu_extra)
    step.update(train or {})
    peak, breakdown, peak_at = _two_phases(breakdown, step if train else {}, "decode")
    reserved = peak + max(plain.gpu_reserved_bytes - plain.gpu_peak_bytes, 0)
    host = dict(zero3.host_breakdown) if name == "zero3-gather-once" else dict(plain.host_breakdown)
    host = {k: v for k, v in host.items() if k != "optimizer_state"}
    host.update(host_extra)
    outside = CUDA_CONTEXT + (NCCL_BUFFERS if gpus > 1 else 0)
    return PathMemory(name, gpus, gpus, peak, int(reserved), outside, int(sum(host.values())), peak_at,
                      {k: int(v) for k, v in breakdown.items() if v}, host, weights, 0, notes)


def loop_speed(name: str, plain_speed: Speed, weights: int, gpus: int, hw, wl, figures=None) -> Speed:
    """Plain speed; gather-once adds one all-gather of every parameter per generate (at the measured
    all-gather bus bandwidth when a profile has one)."""
    gather = 0.0
    if name == "zero3-gather-once" and gpus > 1:
        bus = figures.allgather_bus_bw if figures is not None else hw.gpu_gpu_bandwidth * LINK_EFFICIENCY
        gather = weights * (gpus - 1) / gpus / bus
    tokens = wl.batch * wl.new_tokens
    total = tokens / plain_speed.tokens_per_s + gather
    return Speed(plain_speed.decode_step_s, plain_speed.prefill_s + gather, tokens / total,
                 plain_speed.decode_tokens_per_s, plain_speed.bound)


def choose(paths: list):
    """The fastest fitting path the actor can train on; on a tie the simpler one."""
    fitting = [p for p in paths if p.fits and p.name in TRAINING_PATHS]
    if not fitting:
        return None
    best = max(p.tokens_per_s * p.replicas for p in fitting)
    close = [p for p in fitting if p.tokens_per_s * p.replicas >= 0.95 * best]
    return min(close, key=lambda p: PREFERENCE.index(p.name))


def code_for(path: str, model: str, gpus: int, dtype: str) -> str:
    stage = 2 if path == "zero2" else 3
    lines = [f"# deepspeed --num_gpus {gpus} train_rl.py",
             "import deepspeed, torch",
             "from transformers import AutoModelForCausalLM",
             f"ds_config = {{\"bf16\": {{\"enabled\": {dtype == 'bf16'}}}, \"zero_optimization\": {{\"stage\": {stage}}}, "
             "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-6}}, \"train_micro_batch_size_per_gpu\": 1}",
             f"policy = AutoModelForCausalLM.from_pretrained({model!r})",
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


# ------------------------------------------------------------------ what plan() calls in loop mode

def estimate(name: str, shape, wl, hw, knobs) -> PathMemory | None:
    """Memory of ``zero2`` / ``zero3-gather-once`` (or, for another name, ``in_loop`` of its inference path)."""
    from dsdoctor.plan.memory import estimate_path

    numel = shape.inventory.num_params
    b = wl.dtype_bytes
    train = train_step_bytes(shape, wl)
    if name in LOOP_PATHS:
        plain = estimate_path("plain", shape, wl, hw, None)
        zero3 = estimate_path("zero3", shape, wl, hw, dataclasses.replace(knobs, has_optimizer=False)
                              if knobs is not None else None)
        return loop_path(name, zero3, plain, numel, numel * b, b, hw.gpus, knobs, train)
    mem = estimate_path(name, shape, wl, hw, knobs)
    if mem is not None and name.startswith("zero3"):
        mem = with_training_state(mem, numel, b, knobs, train)
    return mem


def speed(name: str, mem: PathMemory, shape, wl, hw, knobs, figures=None) -> Speed:
    from dsdoctor.plan.memory import estimate_path
    from dsdoctor.plan.speed import estimate_speed

    if name not in LOOP_PATHS:
        return estimate_speed(mem, shape, wl, hw, knobs, figures)
    plain = estimate_path("plain", shape, wl, hw, None)
    return loop_speed(name, estimate_speed(plain, shape, wl, hw, None, figures),
                      shape.inventory.num_params * wl.dtype_bytes, hw.gpus, hw, wl, figures)


def findings(plans: list, chosen) -> list:
    """DSD207 (gather-once against ZeRO-3 generate), DSD208 (gather-once does not fit), DSD209 (ZeRO-2 fits)."""
    from dsdoctor.findings import Finding
    from dsdoctor.units import human_bytes

    by = {p.name: p for p in plans}
    once, z3, z2 = by.get("zero3-gather-once"), by.get("zero3"), by.get("zero2")
    out = []
    if once is not None and z3 is not None:
        need = human_bytes(once.gpu_reserved_bytes + once.gpu_outside_allocator_bytes)
        if once.fits:
            out.append(Finding("DSD207", {
                "once_tps": f"{once.tokens_per_s:.0f}", "z3_tps": f"{z3.tokens_per_s:.0f}",
                "speedup": f"{once.tokens_per_s / z3.tokens_per_s:.1f}" if z3.tokens_per_s else "?",
                "once_peak": human_bytes(once.gpu_peak_bytes), "z3_peak": human_bytes(z3.gpu_peak_bytes),
                "extra": human_bytes(max(once.gpu_peak_bytes - z3.gpu_peak_bytes, 0))}))
        else:
            out.append(Finding("DSD208", {"need": need, "limits": ", ".join(once.limits) or "gpu",
                                          "z3_peak": human_bytes(z3.gpu_peak_bytes)}))
    if z2 is not None and z2.fits:
        out.append(Finding("DSD209", {"peak": human_bytes(z2.gpu_peak_bytes), "tps": f"{z2.tokens_per_s:.0f}",
                                      "gpus": z2.ranks}))
    return out


def in_loop(name: str, mem: PathMemory | None, shape, wl, knobs) -> PathMemory | None:
    """An inference path's memory in a loop: the ZeRO-3 ones carry the training state and step."""
    if mem is None or not name.startswith("zero3"):
        return mem
    return with_training_state(mem, shape.inventory.num_params, wl.dtype_bytes, knobs, train_step_bytes(shape, wl))


def loop_plans(shape, wl, hw, knobs, fits, largest, pos_limit, hard, max_batch_search: int, figures=None) -> list:
    """PathPlan rows of ``zero2`` and ``zero3-gather-once``, with the largest batch and prompt that fit;
    speed from the machine's figures (``speed.figures_for``)."""
    from dsdoctor.plan.result import PathPlan

    out = []
    for name in LOOP_PATHS:
        mem = estimate(name, shape, wl, hw, knobs)
        spd = speed(name, mem, shape, wl, hw, knobs, figures)
        ok, limits = fits(mem, hw)

        def fits_with(name=name, **change):  # bound now: called within this iteration only
            return fits(estimate(name, shape, dataclasses.replace(wl, **change), hw, knobs), hw)[0]

        max_ctx = (pos_limit or 131072) - wl.new_tokens
        max_ctx = max(max_ctx, wl.prompt_len) if hard is None else max_ctx
        out.append(PathPlan(
            name=name, ranks=mem.ranks, replicas=mem.replicas, gpu_peak_bytes=mem.gpu_peak_bytes,
            gpu_reserved_bytes=mem.gpu_reserved_bytes, gpu_outside_allocator_bytes=mem.gpu_outside_allocator_bytes,
            host_peak_bytes=mem.host_peak_bytes, fits=ok, limits=limits, peak_at=mem.peak_at,
            tokens_per_s=spd.tokens_per_s, decode_tokens_per_s=spd.decode_tokens_per_s, bound=spd.bound,
            breakdown=mem.gpu_breakdown, host_breakdown=mem.host_breakdown,
            max_batch=largest(lambda v: fits_with(batch=v), 1, max_batch_search),
            max_prompt_len=largest(lambda v: fits_with(prompt_len=v), 1, max(max_ctx, 1)), notes=mem.notes))
    return out
