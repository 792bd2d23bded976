"""Exact parameter counts: build the model on the meta device with transformers (no memory, no weights).

Imported lazily (torch and transformers are heavy). Never runs remote code: only architectures that
transformers itself ships are built; anything else returns None and the caller keeps the formula.
"""
from __future__ import annotations

import inspect
import warnings

from dsdoctor.model.inventory import Inventory, Param, kind_of, layer_of


def build_meta_model(raw_config: dict):
    """The model for ``raw_config`` on the meta device, or None when transformers cannot build it."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    cfg_dict = {k: v for k, v in raw_config.items() if k not in ("auto_map", "quantization_config")}
    model_type = cfg_dict.pop("model_type", None)
    if not model_type:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.for_model(model_type, **cfg_dict)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except (ValueError, KeyError, TypeError, AttributeError, ImportError, RuntimeError):
        return None


def inventory_of_module(model, counted_by: str = "meta") -> Inventory:
    """Every parameter tensor once (tied weights at their first owner), in module registration order."""
    seen: dict[int, str] = {}
    params: list[Param] = []
    tied: list[tuple[str, str]] = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if id(p) in seen:
                if seen[id(p)] != mod_name:
                    tied.append((mod_name, seen[id(p)]))
                continue
            seen[id(p)] = mod_name
            params.append(Param(full, mod_name, p.numel(), tuple(p.shape),
                                kind_of(mod_name, type(module).__name__, p.dim()), layer_of(full)))
    try:
        keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        keep = True
    return Inventory(params, tied=sorted(set(tied)), supports_logits_to_keep=keep, counted_by=counted_by)


def exact_inventory(raw_config: dict) -> Inventory | None:
    model = build_meta_model(raw_config)
    if model is None:
        return None
    return inventory_of_module(model)
