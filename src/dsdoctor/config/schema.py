"""DeepSpeed 0.19.8's config schema: ONE table, the only place that knows a config field.

Rows ``name type default flags -- doc`` (``a,b,c``: rows alike but for the name) under a ``[section] model``
header (the pydantic model reading the section, as messages name it). Read from deepspeed/runtime/config.py,
runtime/zero/config.py, runtime/zero/offload_config.py, runtime/precision_config.py and inference/config.py;
tests/config/test_schema.py compares every row with DeepSpeed's own models (keys, aliases, types, bounds,
defaults, deprecations), so a DeepSpeed upgrade that changes them fails loudly.

types: bool, bool? (null too), int, int>=0, int>0, int! (not true/false), ratio (0..1), float>=0, obj (an
object or null), bool|obj, str|obj (checked by ``check_section``); stage, device, dtype, count (an integer >= 1
DeepSpeed does not convert), number, str, list, any (read by their readers); removed (DeepSpeed raises).
flags: ``alias=a,b`` (other spellings, read before the name), ``new=X`` (deprecated: X replaces it, both given
is an assertion), ``deprecated`` (no replacing key), ``split=drop|keep|resolve`` (what ``split`` does with it),
``train`` (training only: DSD112), ``why=K`` (the split reason shared under K in messages.json, else the row's
own path), ``ii`` (init_inference's own key). Read by ``effective.py`` (deepspeed.initialize),
``inference_config.py`` (init_inference), ``split.py`` and ``check.py`` (DSD104, DSD112, DSD114, DSD116).
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Any

from dsdoctor.errors import InputError
from dsdoctor.i18n import message_table

TABLE = """
[] DeepSpeedConfig  -- top level of deepspeed.initialize's config: unknown keys are ignored
zero_optimization,fp16  obj  None
bf16                 obj    None  alias=bfloat16
optimizer            obj    None  split=drop  -- builds a ZeRO optimizer (DSD101)
scheduler            obj    None  split=drop
train_batch_size     count  None  split=drop  -- required with the micro batch; "auto" crashes
train_micro_batch_size_per_gpu  count  None  split=resolve
gradient_accumulation_steps     count  None  split=drop train
gradient_clipping    number None  split=drop train
gradient_predivide_factor,prescale_gradients,zero_allow_untested_optimizer  any  None  split=drop train
zero_force_ds_cpu_optimizer,activation_checkpointing,data_efficiency,steps_per_print  any  None  split=drop train
tensor_parallel      any    None  -- AutoTP inside deepspeed.initialize (autotp_size)
wall_clock_breakdown,aio,flops_profiler,data_types,torch_autocast,communication_data_type  any  None
checkpoint,pipeline,comms_logger,tensorboard,wandb,csv_monitor,monitor_config  any  None
nebula,compression_training,amp,quantize_training,sparse_gradients,eigenvalue,sparse_attention  removed  None
elasticity,graph_harvesting,curriculum_learning,progressive_layer_drop  removed  None

[zero_optimization] DeepSpeedZeroConfig
stage                 stage  0     split=resolve  -- "auto" is dropped: stage 0
contiguous_gradients,reduce_scatter,use_multi_rank_bucket_allreduce  bool  True  split=drop train why=gradient_buckets
reduce_bucket_size    int>0  500000000  split=drop train why=gradient_buckets  -- a GPU bucket of this many elements
allgather_partitions,load_from_fp32_weights,ignore_unused_parameters  bool  True  split=drop train
allgather_bucket_size int>=0 500000000  split=drop train
overlap_comm          bool?  None
compute_grad_norm,memory_efficient_linear,override_module_apply  bool  True
elastic_checkpoint    bool   False  split=drop train
offload_param         obj    None  split=keep  -- ignored below stage 3
offload_optimizer     obj    None  split=drop
zenflow,leaf_module   obj    None
sub_group_size        int>=0 1000000000  split=drop train
cpu_offload_param     bool?  None  new=offload_param
cpu_offload_use_pin_memory  bool?  None  deprecated split=drop train
cpu_offload           bool?  None  new=offload_optimizer split=drop
prefetch_bucket_size  int>=0 50000000  alias=stage3_prefetch_bucket_size split=resolve  -- HF: 0.9*hidden^2
param_persistence_threshold  int>=0 100000  alias=stage3_param_persistence_threshold split=resolve  -- HF: 10*hidden
model_persistence_threshold  int>=0 9223372036854775807  alias=stage3_model_persistence_threshold split=resolve
max_live_parameters   int>=0 1000000000  alias=stage3_max_live_parameters split=resolve  -- bounds prefetch
max_reuse_distance    int>=0 1000000000  alias=stage3_max_reuse_distance split=resolve
gather_16bit_weights_on_model_save  bool  False  alias=stage3_gather_16bit_weights_on_model_save split=drop train
module_granularity_threshold  int  0  alias=stage3_module_granularity_threshold
use_all_reduce_for_fetch_params  bool  False  alias=stage3_use_all_reduce_for_fetch_params
allgather_sequential  bool   False  alias=stage3_allgather_sequential
stage3_gather_fp16_weights_on_model_save  bool  False  new=gather_16bit_weights_on_model_save split=drop train
round_robin_gradients,zero_quantized_gradients  bool  False  split=drop train why=gradient_buckets
legacy_stage1,parameter_alignment,zero_quantized_weights,zero_quantized_nontrainable_weights  bool  False
pipeline_loading_checkpoint,log_trace_cache_warnings,enable_sanity_checks  bool  False
save_muon_momentum_buffer_in_memory  bool  False
zero_hpz_partition_size  int>=0  1
mics_shard_size,mics_hierarchical_params_gather,zeropp_loco_param  removed  None

[zero_optimization.offload_param] the offload_param config
device       device  "none"
nvme_path    str     None
buffer_count int>=0  5
buffer_size  int>=0  100000000
max_in_cpu   int>=0  1000000000
pin_memory   bool    True  -- pinned host memory (true since 0.19)

[zero_optimization.offload_optimizer] the offload_optimizer config
device       device  "none"
nvme_path    str     None
buffer_count int>=0  4
pin_memory   bool    True
pipeline_read,pipeline_write,fast_init,super_offload  bool  False
ratio        ratio   1.0
cpuadam_cores_perc  ratio  0.8

[fp16] the fp16 config
enabled      bool    False  split=resolve  -- "auto" is off
auto_cast,fp16_master_weights_and_grads  bool  False
loss_scale   float>=0  0  split=drop train why=loss_scaling
initial_scale_power  int  16  split=drop train why=loss_scaling
loss_scale_window    int!  1000  split=drop train why=loss_scaling
hysteresis   int     2  split=drop train why=loss_scaling
consecutive_hysteresis  bool  False  split=drop train why=loss_scaling
min_loss_scale  int!  1  split=drop train why=loss_scaling

[bf16] the bf16 config
enabled      bool    False  split=resolve
immediate_grad_update,bf16_master_weights_and_grads,bf16_optimizer_states  bool  False
check_grad_overflow  bool  True

[weight_quantization] WeightQuantConfig  -- deepspeed.initialize's weight_quantization (DSD129)
enabled      bool    True
num_bits     int     8
q_type       str     "symmetric"
q_groups     int     1
quantized_initialization,post_init_quant  any  {}

[init_inference] the model  -- DeepSpeedInferenceConfig: deepspeed.init_inference(config=...)
replace_with_kernel_inject  bool  False  alias=kernel_inject ii
dtype        dtype   "fp16"  ii  -- a bf16 model is cast to fp16 unless given
tensor_parallel  obj  {}  alias=tp ii
enable_cuda_graph,use_triton,triton_autotune,keep_module_on_host,set_empty_params,transposed_mode  bool  False  ii
zero         obj     {}  -- accepted, used by nothing in the inference engine (DSD122)
triangular_masking  bool  True  alias=tm ii
return_tuple bool    True  ii
moe          bool|obj  {}  ii
quant        obj     {}  ii
checkpoint   str|obj None
base_dir     str     ""  ii
save_mp_checkpoint_path  str  None  ii
checkpoint_config  obj  {}  alias=ckpt_config ii
training_mp_size  int  1  ii
replace_method  str  "auto"  deprecated ii
injection_policy  obj  None  alias=injection_dict ii
injection_policy_tuple  any  None  ii
config       obj     None  alias=args  -- the model's config; a ZeRO config handed here does nothing
max_out_tokens  int>0  1024  alias=max_tokens ii
min_out_tokens  int  1  alias=min_tokens ii
mp_size      int     1  new=tensor_parallel.tp_size ii
mpu          any     None  new=tensor_parallel.mpu
ep_size      int     1  new=moe.ep_size ii
ep_group     any     None  alias=expert_group new=moe.ep_group
ep_mp_group  any     None  alias=expert_mp_group new=moe.ep_mp_group
moe_experts  list    [1]  new=moe.moe_experts ii
moe_type     str     "standard"  new=moe.type

[init_inference.tensor_parallel] the model
enabled      bool    True
tp_size      int     1
tp_grain_size  int   64
mpu,tp_group any     None

[init_inference.moe] the model
enabled      bool    True
ep_size      int     1
moe_experts  list    [1]  alias=num_experts
type         str     "standard"
ep_mp_group  any     None
ep_group     any     None  alias=expert_group

[init_inference.quant] the model
enabled      bool    True
activation,weight,qkv  any  None

[init_inference.checkpoint_config] the model
checkpoint_dir,save_mp_checkpoint_path,base_dir  str  None
"""


@dataclass(frozen=True)
class Field:
    section: str  # "" (top level), "zero_optimization", "zero_optimization.offload_param", "init_inference", ...
    name: str
    type: str
    default: Any
    aliases: tuple[str, ...] = ()
    replaced_by: str | None = None  # deprecated: the key that replaces it
    deprecated: bool = False
    split: str | None = None  # drop | keep | resolve
    training_only: bool = False  # DSD112
    why: str | None = None  # the shared split reason's key
    init_inference_only: bool = False
    doc: str = ""

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def spellings(self) -> tuple[str, ...]:
        return (*self.aliases, self.name)

    @property
    def reason(self) -> dict:
        return REASONS[self.why or self.path]


def _parse(text: str) -> tuple[dict[str, list[Field]], dict[str, str]]:
    sections: dict[str, list[Field]] = {}
    labels: dict[str, str] = {}
    section = ""
    for line in text.strip().splitlines():
        body = line.split("  -- ", 1)[0].split()
        doc = line.split("  -- ", 1)[1] if "  -- " in line else ""
        if not body:
            continue
        if body[0].startswith("["):
            section, labels[body[0][1:-1]] = body[0][1:-1], " ".join(body[1:])
            sections[section] = []
            continue
        names, kind, default, *flags = body
        opts = dict(f.partition("=")[::2] for f in flags)
        sections[section] += [Field(
            section, name, kind, ast.literal_eval(default), tuple(filter(None, opts.get("alias", "").split(","))),
            opts.get("new"), "new" in opts or "deprecated" in opts, opts.get("split"), "train" in opts,
            opts.get("why"), "ii" in opts, doc) for name in names.split(",")]
    return sections, labels


SECTIONS, LABELS = _parse(TABLE)
REASONS = message_table("config.schema.REASONS")  # why split drops or resolves a key, per row or shared reason


def fields(section: str, removed: bool = False) -> list[Field]:
    """The section's rows in table order (the ``removed`` rows only when asked)."""
    return [f for f in SECTIONS[section] if (f.type == "removed") == removed]


def spelling_map(section: str) -> dict[str, Field]:
    """Every accepted spelling of the section's keys -> its row (removed keys excluded)."""
    return {s: f for f in fields(section) for s in f.spellings}


_TOP = spelling_map("")


def lookup(path: str) -> Field | None:
    """The row of a dotted key as written (``zero_optimization.stage3_prefetch_bucket_size``, ``bfloat16.enabled``)."""
    *parents, leaf = path.split(".")
    if parents and parents[0] in _TOP:
        parents[0] = _TOP[parents[0]].name
    section = ".".join(parents)
    return spelling_map(section).get(leaf) if section in SECTIONS else None


def spellings(section: str) -> frozenset[str]:
    return frozenset(spelling_map(section))


# --- one check of values, for every section (the coercions pydantic's lax mode applies) ----------------------

def _bad(key: str, problem: str):
    return InputError(f"{key}: {problem}")


def _as_int(key: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool):
        out = int(value)  # pydantic accepts true/false as 1/0
    elif isinstance(value, int):
        out = value
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")) or not value.is_integer():
            raise _bad(key, f"must be a whole number, not {value!r}")
        if abs(value) >= 2**63:
            raise _bad(key, f"is too large: {value!r}")
        out = int(value)
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        out = int(value.strip())
    else:
        raise _bad(key, f"must be an integer, not {value!r}")
    if out < minimum:
        raise _bad(key, f"must be >= {minimum}, not {out}")
    return out


_TRUE = {"true", "1", "yes", "on", "t", "y"}
_FALSE = {"false", "0", "no", "off", "f", "n"}


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _bad(key, f"must be true or false, not {value!r}")


_OBJECT_KINDS = {"obj": ((dict,), "an object"), "bool|obj": ((bool, dict), "true/false or an object"),
                 "str|obj": ((str, dict), "a path or an object")}


def check_value(f: Field, path: str, value: Any) -> Any:
    """``value`` as DeepSpeed's pydantic model reads row ``f`` (lax mode), or an InputError naming ``path``."""
    kind = f.type
    if kind in ("bool", "bool?"):
        return None if value is None and kind == "bool?" else _as_bool(path, value)
    if kind in ("ratio", "float>=0"):
        return _as_float(path, value, kind)
    if kind.startswith("int"):
        if kind == "int!" and isinstance(value, bool):
            raise _bad(path, "must be an integer, not bool")
        return _as_int(path, value, minimum={"int>=0": 0, "int>0": 1}.get(kind, -(2**63)))
    if kind in _OBJECT_KINDS and value is not None and not isinstance(value, _OBJECT_KINDS[kind][0]):
        raise _bad(path, f"must be {_OBJECT_KINDS[kind][1]}, not {value!r}")
    return value


def _as_float(path: str, value: Any, kind: str) -> float:
    if kind == "ratio":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise _bad(path, f"must be a number between 0 and 1, not {value!r}")
        return float(value)
    if isinstance(value, bool):
        raise _bad(path, "must be a number, not bool")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise _bad(path, f"must be a number, not {value!r}") from None
    if not math.isfinite(out) or out < 0:
        raise _bad(path, f"must be a finite number >= 0, not {value!r}")
    return out


CHECKED = ("bool", "bool?", "int", "int>=0", "int>0", "int!", "ratio", "float>=0", *_OBJECT_KINDS)
INITIALIZE, INFERENCE = (" and raises a ValidationError", " (a ValidationError in DeepSpeed)"), \
    (" (ValidationError)", " (ValidationError)")


def check_section(section: dict | None, name: str, where: str, tails=INITIALIZE, types: tuple = CHECKED):
    """DeepSpeed's pydantic reading of one section (extra keys forbidden; "auto" dropped before validation):
    ``(errors, ok)``: (path, why) in key order for every unknown key ("unknown key: ...") and every value of a
    ``types`` row it rejects, and the values of the rows read."""
    spelled = spelling_map(name)
    errors, ok = [], {}
    for key, value in (section or {}).items():
        f, path = spelled.get(key), f"{where}{key}"
        if value == "auto":
            continue
        if f is None:
            errors.append((path, f"unknown key: {LABELS[name]} forbids extra keys{tails[0]}"))
        elif f.type in types:
            try:
                ok[f.name] = check_value(f, path, value)
            except InputError as exc:
                errors.append((path, exc.problem.split(": ", 1)[-1] + tails[1]))
    return errors, ok


def unknown(errors: list) -> list:
    return [e for e in errors if e[1].startswith("unknown key")]


# --- what the rest of dsdoctor reads (derived; nothing here is written twice) ---------------------------------

ZERO = spelling_map("zero_optimization")
ZERO_FIELDS = frozenset(ZERO)
ZERO_DEFAULTS = {f.name: f.default for f in fields("zero_optimization") if f.type.startswith("int")}
STAGE3_ALIASES = {f.name: f.aliases[0] for f in fields("zero_optimization") if f.aliases}
REMOVED_TOP_LEVEL_KEYS = frozenset(f.name for f in fields("", removed=True))
REMOVED_ZERO_KEYS = frozenset(f.name for f in fields("zero_optimization", removed=True))
# a deprecated key -> the spellings of the key that replaces it (both given: DeepSpeed asserts)
DEPRECATED_REPLACED = {f.name: (ZERO[f.replaced_by].name, *ZERO[f.replaced_by].aliases)
                       for f in fields("zero_optimization") if f.replaced_by}
INIT_INFERENCE_ALL_KEYS = spellings("init_inference")
# keys only deepspeed.init_inference understands (a top-level key of deepspeed.initialize's config is shared)
INIT_INFERENCE_KEYS = frozenset(s for f in fields("init_inference") if f.init_inference_only for s in f.spellings
                                if s not in _TOP)
# top-level keys that make a file a DeepSpeed config (deepspeed.initialize or init_inference); a file with none
# of them is probably not one (DSD116)
DEEPSPEED_TOP_LEVEL_KEYS = spellings("") | REMOVED_TOP_LEVEL_KEYS | INIT_INFERENCE_ALL_KEYS
TRAINING_ONLY = frozenset(f.path for s in SECTIONS for f in fields(s) if f.training_only)
