"""Exact parameter counts: build the model on the meta device with transformers (no memory, no weights).

The one owner of counting a live torch model's parameters: ``inventory_of_module`` (every tensor) and
``count_parameters`` (the total, also for a ZeRO-3 partitioned model inside a traced run). This module
imports no torch itself: the functions that build import torch and transformers (heavy) when called. Never
runs remote code: only architectures that transformers itself ships are built; anything else returns None and
the caller keeps the formula.
"""
from __future__ import annotations

import inspect
import math
import re
import warnings

from dsdoctor.model.inventory import Inventory, Param, kind_of, layer_of
from dsdoctor.model.moe import layout

_PER_EXPERT = re.compile(r"(?:^|\.)experts\.\d+\.")


def build_meta_model(raw_config: dict, path=None):
    """The model for ``raw_config`` on the meta device, or None when transformers cannot build it. A config of
    an architecture transformers ships that its own validation refuses (``head_dim`` 127 under RoPE) is bad
    input: one InputError naming ``path`` (the config.json) and transformers' reason."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return None
    cfg_dict = {k: v for k, v in raw_config.items() if k not in ("auto_map", "quantization_config")}
    model_type = cfg_dict.pop("model_type", None)
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.for_model(model_type, **cfg_dict)
    except Exception as exc:  # transformers' own validation (ValueError, huggingface_hub's StrictDataclassError)
        from dsdoctor.errors import InputError
        from dsdoctor.model.custom import library_error

        raise InputError(f"transformers refuses this {model_type} config: {library_error(exc)[:300]}",
                         path=path) from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except (ValueError, KeyError, TypeError, AttributeError, ImportError, RuntimeError):
        return None


def count_parameters(model) -> int:
    """Elements of every parameter tensor of ``model``, tied weights once; a ZeRO-3 partitioned parameter
    counts whole (``ds_numel``), not the rank's shard."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def partitioned_bytes(module) -> int:
    """Bytes of ``module``'s ZeRO-3 partitioned parameters, whole (what a gather of it brings to the GPU)."""
    return sum(int(p.ds_numel) * p.element_size() for p in module.parameters() if hasattr(p, "ds_id"))


def _is_expert(mod_name: str, module) -> bool:
    """A routed expert's weight: a fused experts module (transformers 5, gpt-oss) or one expert of a list (4.x)."""
    return type(module).__name__.endswith("Experts") or _PER_EXPERT.search(mod_name + ".") is not None


def inventory_of_module(model, counted_by: str = "meta") -> Inventory:
    """Every parameter tensor once (tied weights at their first owner), in module registration order; a ZeRO-3
    partitioned parameter by its full shape (``ds_shape``), so a live engine's model counts as the meta one."""
    seen: dict[int, str] = {}
    params: list[Param] = []
    tied: list[tuple[str, str]] = []
    blocks: dict[int, tuple[str, bool]] = {}  # decoder layer -> (sparse block class, fused experts)
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if id(p) in seen:
                if seen[id(p)] != mod_name:
                    tied.append((mod_name, seen[id(p)]))
                continue
            seen[id(p)] = mod_name
            shape = tuple(getattr(p, "ds_shape", p.shape))
            expert = _is_expert(mod_name, module)
            params.append(Param(full, mod_name, math.prod(shape), shape,
                                kind_of(mod_name, type(module).__name__, len(shape)), layer_of(full), expert))
            if expert and layer_of(full) is not None:
                blocks.setdefault(layer_of(full), (_block_class(model, mod_name), len(shape) == 3))
    try:
        keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        keep = True
    inv = Inventory(params, tied=sorted(set(tied)), supports_logits_to_keep=keep, counted_by=counted_by,
                    attention=attention_of(model, params))
    if blocks:
        cfg = getattr(model, "config", None)
        cfg = getattr(cfg, "text_config", None) or cfg
        raw = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
        block, fused = next(iter(blocks.values()))
        inter = int(raw.get("moe_intermediate_size") or raw.get("intermediate_size") or 0)
        inv.moe = layout(raw, str(raw.get("model_type", "")), sorted(blocks), inter, fused, block)
    return inv


def attention_of(model, params: list[Param]) -> str:
    """The attention transformers runs for this class by default: a class without SDPA (``_supports_sdpa``
    False, e.g. gpt-oss: SDPA cannot apply its sinks) runs eager attention, which holds B x heads x S x S scores;
    eager-sinks: gpt-oss's eager function, which concatenates the sinks and keeps its softmax in the dtype."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != "eager":
        return "sdpa"
    return "eager-sinks" if any(p.name.endswith(".sinks") for p in params) else "eager"


def _block_class(model, experts_module: str) -> str:
    """The class of the module that holds the experts (``...mlp`` of ``...mlp.experts[.N]``), as
    ``<module under transformers.models>.<class>``: what ``set_z3_leaf_modules`` is given."""
    parent = experts_module.split(".experts")[0]
    cls = type(model.get_submodule(parent))
    return f"{cls.__module__.removeprefix('transformers.models.')}.{cls.__name__}"


def cache_layout(model, positions: int) -> list[tuple[int, int | None]] | None:
    """Per layer (elements cached per position, positions kept or None for all), read from the
    ``DynamicCache`` a meta-device forward of ``positions`` tokens leaves behind; None when the model
    cannot run on the meta device (data-dependent code such as MoE routing)."""
    import torch

    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ids = torch.zeros((1, positions), dtype=torch.long, device="meta")
            out = model(input_ids=ids, use_cache=True)
        cache = out["cache"] if "cache" in out else out.get("past_key_values")  # key renamed in transformers 5.2x
        layers = getattr(cache, "layers", None)
        if not layers:
            return None
        layout = []
        for layer in layers:
            k, v = layer.keys, layer.values
            kept = k.shape[-2]
            if not kept:
                return None
            layout.append(((k.numel() + v.numel()) // kept, None if kept >= positions else kept + 1))
        return layout
    except Exception:  # any failure here only means: use the config's rules
        return None


def config_layout(model) -> list[tuple[int, int | None]] | None:
    """Window per layer from the transformers config object (``layer_types``), elements per position
    left to the caller (None)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if isinstance(types, (list, tuple)) and window:
        return [(0, window if t == "sliding_attention" else None) for t in types]
    return None


def exact_inventory(raw_config: dict, probe_positions: int = 0, path=None) -> Inventory | None:
    model = build_meta_model(raw_config, path)
    if model is None:
        return None
    inv = inventory_of_module(model)
    if probe_positions:
        inv.cache_layout = cache_layout(model, probe_positions)
        inv.window_layout = None if inv.cache_layout else config_layout(model)
    return inv
