"""What ``dsdoctor split`` does with each key of a training config, and why. One row per key path.

``action``: ``drop`` (remove the key), ``keep`` (copy it), ``resolve`` (copy it with "auto" replaced).
Keys not listed are kept. ``training_only`` rows are also what check reports as DSD112.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    key: str  # dotted path; "zero_optimization.X" matches the stage-3 alias and the plain spelling alike
    action: str  # drop | keep | resolve
    reason: dict  # {"en": ..., "zh": ...}
    training_only: bool = False  # reported by DSD112 (optimizer/scheduler/offload_optimizer have own codes)


def _r(key, action, en, zh, training_only=False):
    return Row(key, action, {"en": en, "zh": zh}, training_only)


_GRAD = ("gradient buckets are only used when gradients are reduced (training)", "梯度 bucket 只在训练规约梯度时使用")
_LOSS = ("loss scaling protects fp16 gradients; inference has no gradients", "loss scaling 保护 fp16 梯度；推理没有梯度")

TABLE: tuple[Row, ...] = (
    _r("optimizer", "drop", "builds a ZeRO optimizer: fp32 master weights, gradient partitions, reduce bucket (DSD101)",
       "会构建 ZeRO 优化器：fp32 主权重、梯度分区、reduce bucket（DSD101）"),
    _r("scheduler", "drop", "schedules the optimizer's learning rate; no optimizer at inference",
       "调度优化器学习率；推理没有优化器"),
    _r("zero_optimization.offload_optimizer", "drop", "offloads optimizer state; no optimizer at inference (DSD102)",
       "卸载优化器状态；推理没有优化器（DSD102）"),
    _r("zero_optimization.cpu_offload", "drop", "legacy spelling of offload_optimizer; no optimizer at inference",
       "offload_optimizer 的旧写法；推理没有优化器"),
    _r("zero_optimization.cpu_offload_use_pin_memory", "drop", "legacy optimizer-offload flag", "旧的优化器卸载开关", True),
    _r("train_batch_size", "drop",
       "global training batch; must equal micro batch x accumulation x world size, which changes with the GPU count "
       "(train_micro_batch_size_per_gpu is kept instead)",
       "全局训练批大小；须等于 micro batch × 累积步数 × world size，会随 GPU 数变化（改为保留 train_micro_batch_size_per_gpu）"),
    _r("train_micro_batch_size_per_gpu", "resolve",
       "deepspeed.initialize requires it (runtime/config.py); 1 when it was \"auto\" or unset",
       "deepspeed.initialize 要求必须有它（runtime/config.py）；原为 \"auto\" 或未设置时取 1"),
    _r("gradient_accumulation_steps", "drop", "accumulates gradients across steps; training only",
       "跨步累积梯度；仅用于训练", True),
    _r("gradient_clipping", "drop", "clips gradients; training only", "裁剪梯度；仅用于训练", True),
    _r("gradient_predivide_factor", "drop", "scales gradients before reduction; training only",
       "规约前缩放梯度；仅用于训练", True),
    _r("prescale_gradients", "drop", "scales gradients before reduction; training only", "规约前缩放梯度；仅用于训练", True),
    _r("zero_allow_untested_optimizer", "drop", "allows a client optimizer with ZeRO; no optimizer at inference",
       "允许 ZeRO 使用未测试的优化器；推理没有优化器", True),
    _r("zero_force_ds_cpu_optimizer", "drop", "optimizer choice; no optimizer at inference", "优化器选择；推理没有优化器", True),
    _r("activation_checkpointing", "drop", "recomputes activations for the backward pass; no backward at inference",
       "为反向传播重算激活；推理没有反向传播", True),
    _r("data_efficiency", "drop", "training data sampling and routing", "训练数据采样与路由", True),
    _r("steps_per_print", "drop", "logs every N optimizer steps; no optimizer steps at inference",
       "每 N 个优化器步打印日志；推理没有优化器步", True),
    _r("fp16.loss_scale", "drop", *_LOSS, True),
    _r("fp16.initial_scale_power", "drop", *_LOSS, True),
    _r("fp16.loss_scale_window", "drop", *_LOSS, True),
    _r("fp16.hysteresis", "drop", *_LOSS, True),
    _r("fp16.consecutive_hysteresis", "drop", *_LOSS, True),
    _r("fp16.min_loss_scale", "drop", *_LOSS, True),
    _r("fp16.enabled", "resolve", "\"auto\" is off in DeepSpeed; resolved from the model's dtype when --model is given",
       "DeepSpeed 中 \"auto\" 即关闭；给出 --model 时按模型 dtype 填写"),
    _r("bf16.enabled", "resolve", "\"auto\" is off in DeepSpeed; resolved from the model's dtype when --model is given",
       "DeepSpeed 中 \"auto\" 即关闭；给出 --model 时按模型 dtype 填写"),
    _r("zero_optimization.stage", "resolve",
       "stage 3 is kept (ZeRO-Inference); stage 1/2 shard only optimizer state and gradients and assert without an "
       "optimizer, so they become 0; \"auto\" is 0 in DeepSpeed",
       "stage 3 保留（ZeRO-Inference）；stage 1/2 只对优化器状态和梯度分片，没有优化器时会断言失败，故改为 0；"
       "\"auto\" 在 DeepSpeed 中即 0"),
    _r("zero_optimization.offload_param", "keep", "offloads weights at stage 3 (kept; dropped below stage 3, DSD106)",
       "stage 3 时卸载权重（保留；stage 3 以下删除，DSD106）"),
    _r("zero_optimization.reduce_bucket_size", "drop", *_GRAD, True),
    _r("zero_optimization.reduce_scatter", "drop", *_GRAD, True),
    _r("zero_optimization.contiguous_gradients", "drop", *_GRAD, True),
    _r("zero_optimization.allgather_bucket_size", "drop",
       "stage 1/2 all-gather of updated weights after the optimizer step", "stage 1/2 在优化器更新后 all-gather 权重", True),
    _r("zero_optimization.allgather_partitions", "drop",
       "stage 1/2 all-gather of updated weights after the optimizer step", "stage 1/2 在优化器更新后 all-gather 权重", True),
    _r("zero_optimization.round_robin_gradients", "drop", *_GRAD, True),
    _r("zero_optimization.sub_group_size", "drop", "tiles the optimizer step; no optimizer at inference",
       "优化器更新的分块大小；推理没有优化器", True),
    _r("zero_optimization.elastic_checkpoint", "drop", "optimizer checkpoint layout", "优化器检查点格式", True),
    _r("zero_optimization.load_from_fp32_weights", "drop", "initializes fp32 master weights; no optimizer",
       "初始化 fp32 主权重；推理没有优化器", True),
    _r("zero_optimization.ignore_unused_parameters", "drop", "gradient hooks; training only", "梯度钩子；仅用于训练", True),
    _r("zero_optimization.zero_quantized_gradients", "drop", *_GRAD, True),
    _r("zero_optimization.use_multi_rank_bucket_allreduce", "drop", *_GRAD, True),
    _r("zero_optimization.gather_16bit_weights_on_model_save", "drop", "gathers weights when saving a training checkpoint",
       "保存训练检查点时 gather 权重", True),
    _r("zero_optimization.stage3_gather_fp16_weights_on_model_save", "drop",
       "gathers weights when saving a training checkpoint", "保存训练检查点时 gather 权重", True),
    _r("zero_optimization.prefetch_bucket_size", "resolve",
       "ZeRO-3 prefetch; \"auto\" becomes 0.9*hidden^2 with --model (as the HF Trainer fills it), else DeepSpeed's default",
       "ZeRO-3 预取；\"auto\" 在给出 --model 时取 0.9*hidden^2（与 HF Trainer 相同），否则取 DeepSpeed 默认值"),
    _r("zero_optimization.param_persistence_threshold", "resolve",
       "ZeRO-3 persistence; \"auto\" becomes 10*hidden with --model (as the HF Trainer fills it), else DeepSpeed's default",
       "ZeRO-3 常驻阈值；\"auto\" 在给出 --model 时取 10*hidden（与 HF Trainer 相同），否则取 DeepSpeed 默认值"),
    _r("zero_optimization.max_live_parameters", "resolve", "ZeRO-3 gather bound; \"auto\" becomes DeepSpeed's default",
       "ZeRO-3 gather 上限；\"auto\" 取 DeepSpeed 默认值"),
    _r("zero_optimization.max_reuse_distance", "resolve", "ZeRO-3 release policy; \"auto\" becomes DeepSpeed's default",
       "ZeRO-3 释放策略；\"auto\" 取 DeepSpeed 默认值"),
    _r("zero_optimization.model_persistence_threshold", "resolve",
       "ZeRO-3 persistence bound; \"auto\" becomes DeepSpeed's default", "ZeRO-3 常驻上限；\"auto\" 取 DeepSpeed 默认值"),
)

BY_KEY = {row.key: row for row in TABLE}
TRAINING_ONLY = tuple(row.key for row in TABLE if row.training_only)
