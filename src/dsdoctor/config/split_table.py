"""What ``dsdoctor split`` does with each key of a training config, and why. One row per key path.

``action``: ``drop`` (remove the key), ``keep`` (copy it), ``resolve`` (copy it with "auto" replaced).
Keys not listed are kept. ``training_only`` rows are also what check reports as DSD112.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsdoctor.i18n import message_table

# why, per key (or per shared reason), in dsdoctor/messages.json
REASONS = message_table("config.split_table.REASONS")


@dataclass(frozen=True)
class Row:
    key: str  # dotted path; "zero_optimization.X" matches the stage-3 alias and the plain spelling alike
    action: str  # drop | keep | resolve
    reason: dict  # {"en": ..., "zh": ...}
    training_only: bool = False  # reported by DSD112 (optimizer/scheduler/offload_optimizer have own codes)


def _r(key, action, training_only=False, reason=None):
    """A row; its reason is REASONS[key], or the shared REASONS[reason]."""
    return Row(key, action, REASONS[reason or key], training_only)


TABLE: tuple[Row, ...] = (
    _r("optimizer", "drop"),
    _r("scheduler", "drop"),
    _r("zero_optimization.offload_optimizer", "drop"),
    _r("zero_optimization.cpu_offload", "drop"),
    _r("zero_optimization.cpu_offload_use_pin_memory", "drop", training_only=True),
    _r("train_batch_size", "drop"),
    _r("train_micro_batch_size_per_gpu", "resolve"),
    _r("gradient_accumulation_steps", "drop", training_only=True),
    _r("gradient_clipping", "drop", training_only=True),
    _r("gradient_predivide_factor", "drop", training_only=True),
    _r("prescale_gradients", "drop", training_only=True),
    _r("zero_allow_untested_optimizer", "drop", training_only=True),
    _r("zero_force_ds_cpu_optimizer", "drop", training_only=True),
    _r("activation_checkpointing", "drop", training_only=True),
    _r("data_efficiency", "drop", training_only=True),
    _r("steps_per_print", "drop", training_only=True),
    _r("fp16.loss_scale", "drop", training_only=True, reason="loss scaling"),
    _r("fp16.initial_scale_power", "drop", training_only=True, reason="loss scaling"),
    _r("fp16.loss_scale_window", "drop", training_only=True, reason="loss scaling"),
    _r("fp16.hysteresis", "drop", training_only=True, reason="loss scaling"),
    _r("fp16.consecutive_hysteresis", "drop", training_only=True, reason="loss scaling"),
    _r("fp16.min_loss_scale", "drop", training_only=True, reason="loss scaling"),
    _r("fp16.enabled", "resolve"),
    _r("bf16.enabled", "resolve"),
    _r("zero_optimization.stage", "resolve"),
    _r("zero_optimization.offload_param", "keep"),
    _r("zero_optimization.reduce_bucket_size", "drop", training_only=True, reason="gradient buckets"),
    _r("zero_optimization.reduce_scatter", "drop", training_only=True, reason="gradient buckets"),
    _r("zero_optimization.contiguous_gradients", "drop", training_only=True, reason="gradient buckets"),
    _r("zero_optimization.allgather_bucket_size", "drop", training_only=True),
    _r("zero_optimization.allgather_partitions", "drop", training_only=True),
    _r("zero_optimization.round_robin_gradients", "drop", training_only=True, reason="gradient buckets"),
    _r("zero_optimization.sub_group_size", "drop", training_only=True),
    _r("zero_optimization.elastic_checkpoint", "drop", training_only=True),
    _r("zero_optimization.load_from_fp32_weights", "drop", training_only=True),
    _r("zero_optimization.ignore_unused_parameters", "drop", training_only=True),
    _r("zero_optimization.zero_quantized_gradients", "drop", training_only=True, reason="gradient buckets"),
    _r("zero_optimization.use_multi_rank_bucket_allreduce", "drop", training_only=True, reason="gradient buckets"),
    _r("zero_optimization.gather_16bit_weights_on_model_save", "drop", training_only=True),
    _r("zero_optimization.stage3_gather_fp16_weights_on_model_save", "drop", training_only=True),
    _r("zero_optimization.prefetch_bucket_size", "resolve"),
    _r("zero_optimization.param_persistence_threshold", "resolve"),
    _r("zero_optimization.max_live_parameters", "resolve"),
    _r("zero_optimization.max_reuse_distance", "resolve"),
    _r("zero_optimization.model_persistence_threshold", "resolve"),
)

BY_KEY = {row.key: row for row in TABLE}
TRAINING_ONLY = tuple(row.key for row in TABLE if row.training_only)
