"""DeepSpeed 0.19.8's config schema, as data: the keys each pydantic section accepts, their value types and
defaults, and the keys DeepSpeed rejects outright. Read from deepspeed/runtime/config.py, runtime/zero/config.py,
runtime/zero/offload_config.py, runtime/precision_config.py and inference/config.py; tests/config/test_corpus.py
compares every table here with DeepSpeed's own models, so a DeepSpeed upgrade that changes them fails loudly.
"""
from __future__ import annotations

# DeepSpeed 0.19.8 defaults (runtime/zero/config.py, runtime/zero/offload_config.py)
ZERO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "prefetch_bucket_size": 50_000_000,
    "param_persistence_threshold": 100_000,
    "model_persistence_threshold": 2**63 - 1,
    "max_live_parameters": 1_000_000_000,
    "max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
# stage-3 knobs: canonical field -> the spellings DeepSpeed accepts (alias first, then the field name)
STAGE3_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
# every key DeepSpeedZeroConfig accepts (fields and aliases; tests compare this with DeepSpeed's model)
ZERO_FIELDS = frozenset({
    "allgather_bucket_size", "allgather_partitions", "allgather_sequential", "compute_grad_norm",
    "contiguous_gradients", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory", "elastic_checkpoint",
    "enable_sanity_checks", "gather_16bit_weights_on_model_save", "ignore_unused_parameters", "leaf_module",
    "legacy_stage1", "load_from_fp32_weights", "log_trace_cache_warnings", "max_live_parameters",
    "max_reuse_distance", "memory_efficient_linear", "model_persistence_threshold", "module_granularity_threshold",
    "offload_optimizer", "offload_param", "overlap_comm", "override_module_apply", "param_persistence_threshold",
    "parameter_alignment", "pipeline_loading_checkpoint", "prefetch_bucket_size", "reduce_bucket_size",
    "reduce_scatter", "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage",
    "stage3_gather_fp16_weights_on_model_save", "sub_group_size", "use_all_reduce_for_fetch_params",
    "use_multi_rank_bucket_allreduce", "zenflow", "zero_hpz_partition_size", "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights", "zero_quantized_weights",
}) | frozenset(STAGE3_ALIASES.values())
OFFLOAD_PARAM_FIELDS = frozenset({"buffer_count", "buffer_size", "device", "max_in_cpu", "nvme_path", "pin_memory"})
OFFLOAD_OPTIMIZER_FIELDS = frozenset({
    "buffer_count", "cpuadam_cores_perc", "device", "fast_init", "nvme_path", "pin_memory", "pipeline_read",
    "pipeline_write", "ratio", "super_offload",
})
FP16_FIELDS = frozenset({
    "auto_cast", "consecutive_hysteresis", "enabled", "fp16_master_weights_and_grads", "hysteresis",
    "initial_scale_power", "loss_scale", "loss_scale_window", "min_loss_scale",
})
BF16_FIELDS = frozenset({
    "bf16_master_weights_and_grads", "bf16_optimizer_states", "check_grad_overflow", "enabled", "immediate_grad_update",
})
# value types of the scalar fields (pydantic annotations in DeepSpeed 0.19.8; tests compare with the models).
# ("int", minimum) | "bool" | "optbool" (null allowed) | "ratio" (float in [0, 1]); sections are not listed.
_INT0, _INT1 = ("int", 0), ("int", 1)
ZERO_TYPES = {
    "contiguous_gradients": "bool", "reduce_scatter": "bool", "reduce_bucket_size": _INT1,
    "use_multi_rank_bucket_allreduce": "bool", "allgather_partitions": "bool", "allgather_bucket_size": _INT0,
    "overlap_comm": "optbool", "compute_grad_norm": "bool", "load_from_fp32_weights": "bool",
    "elastic_checkpoint": "bool", "sub_group_size": _INT0, "cpu_offload_param": "optbool",
    "cpu_offload_use_pin_memory": "optbool", "cpu_offload": "optbool", "prefetch_bucket_size": _INT0,
    "param_persistence_threshold": _INT0, "model_persistence_threshold": _INT0, "max_live_parameters": _INT0,
    "max_reuse_distance": _INT0, "gather_16bit_weights_on_model_save": "bool",
    "module_granularity_threshold": ("int", None), "use_all_reduce_for_fetch_params": "bool",
    "allgather_sequential": "bool", "stage3_gather_fp16_weights_on_model_save": "bool",
    "ignore_unused_parameters": "bool", "legacy_stage1": "bool", "round_robin_gradients": "bool",
    "parameter_alignment": "bool", "zero_hpz_partition_size": _INT0, "zero_quantized_weights": "bool",
    "zero_quantized_nontrainable_weights": "bool", "zero_quantized_gradients": "bool",
    "memory_efficient_linear": "bool", "pipeline_loading_checkpoint": "bool", "override_module_apply": "bool",
    "log_trace_cache_warnings": "bool", "enable_sanity_checks": "bool", "save_muon_momentum_buffer_in_memory": "bool",
}
OFFLOAD_PARAM_TYPES = {"buffer_count": _INT0, "buffer_size": _INT0, "max_in_cpu": _INT0, "pin_memory": "bool"}
OFFLOAD_OPTIMIZER_TYPES = {
    "buffer_count": _INT0, "pin_memory": "bool", "pipeline_read": "bool", "pipeline_write": "bool",
    "fast_init": "bool", "ratio": "ratio", "super_offload": "bool", "cpuadam_cores_perc": "ratio",
}


# top-level keys that DeepSpeed 0.19.8 rejects outright (runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS)
REMOVED_TOP_LEVEL_KEYS = frozenset({
    "nebula", "compression_training", "amp", "quantize_training", "sparse_gradients", "eigenvalue",
    "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning", "progressive_layer_drop",
})
REMOVED_ZERO_KEYS = frozenset({"mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"})

# keys only deepspeed.init_inference (DeepSpeedInferenceConfig) understands
INIT_INFERENCE_KEYS = frozenset({
    "mp_size", "replace_with_kernel_inject", "kernel_inject", "injection_policy", "injection_dict",
    "enable_cuda_graph", "replace_method", "max_out_tokens", "max_tokens", "min_out_tokens", "min_tokens",
    "use_triton", "triton_autotune", "triangular_masking", "return_tuple", "save_mp_checkpoint_path",
    "keep_module_on_host", "set_empty_params", "training_mp_size", "transposed_mode", "dtype", "tp", "moe",
    "quant", "injection_policy_tuple", "base_dir", "checkpoint_config", "ckpt_config", "ep_size", "moe_experts",
})
# every key DeepSpeedInferenceConfig accepts (fields and aliases); anything else makes it raise
INIT_INFERENCE_ALL_KEYS = INIT_INFERENCE_KEYS | {
    "checkpoint", "config", "ep_group", "ep_mp_group", "expert_group", "expert_mp_group", "moe_type", "mpu",
    "tensor_parallel", "zero", "args", "tm",
}

# top-level keys that make a file a DeepSpeed config (deepspeed.initialize or init_inference); a file with none
# of them is probably not one (DSD116)
DEEPSPEED_TOP_LEVEL_KEYS = frozenset({
    "zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "scheduler", "train_batch_size",
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "tensor_parallel",
    "activation_checkpointing", "zero_allow_untested_optimizer", "steps_per_print", "wall_clock_breakdown",
    "aio", "flops_profiler", "data_types", "torch_autocast", "communication_data_type", "checkpoint",
    "pipeline", "comms_logger", "tensorboard", "wandb", "csv_monitor", "monitor_config",
}) | REMOVED_TOP_LEVEL_KEYS | INIT_INFERENCE_ALL_KEYS
