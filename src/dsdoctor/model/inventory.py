"""The parameters of a model, one entry per tensor, in the order a forward pass uses them.

The memory model needs more than a total: ZeRO-3 gathers and releases parameters module by module, keeps
small ones whole (``stage3_param_persistence_threshold``), and tensor parallelism shards some tensors and
not others. An inventory lists every parameter tensor once (tied weights once, at first use) with the
module that owns it, in forward order. ``dsdoctor.model.formulas`` builds it from config.json;
``dsdoctor.model.exact`` builds it from the real model on the meta device. Only the types live here, so that
both builders import them and neither imports the other.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


@dataclass(frozen=True)
class Param:
    name: str  # model.layers.0.mlp.up_proj.weight
    module: str  # model.layers.0.mlp.up_proj
    numel: int
    shape: tuple[int, ...]
    kind: str  # embedding | linear | lm_head | norm | other
    layer: int | None  # decoder layer index, None outside the layers


@dataclass
class Inventory:
    params: list[Param]
    tied: list[tuple[str, str]] = field(default_factory=list)  # (alias module, owner module)
    supports_logits_to_keep: bool = True
    counted_by: str = "formula"
    cache_layout: list | None = None  # per layer: (elements per position, window or None), from transformers
    window_layout: list | None = None  # per layer: (0, window or None) from the config object

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    def numel(self, kind: str | None = None) -> int:
        return sum(p.numel for p in self.params if kind is None or p.kind == kind)

    def layer_params(self, layer: int = 0) -> int:
        return sum(p.numel for p in self.params if p.layer == layer)

    @property
    def largest(self) -> int:
        return max((p.numel for p in self.params), default=0)

    def modules(self) -> list[tuple[str, list[Param]]]:
        """Modules that own parameters, in first-use order, each with its direct parameters."""
        order: dict[str, list[Param]] = {}
        for p in self.params:
            order.setdefault(p.module, []).append(p)
        return list(order.items())


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def kind_of(module_name: str, class_name: str, ndim: int) -> str:
    cls = class_name.lower()
    last = module_name.rsplit(".", 1)[-1]
    if "embedding" in cls:
        return "embedding"
    if last in ("lm_head", "embed_out", "output"):
        return "lm_head"
    if "norm" in cls or "norm" in last:
        return "norm"
    if "linear" in cls or ndim == 2:
        return "linear"
    return "other"


def apply_to_spec(spec, inv: Inventory):
    """Replace the spec's formula counts by the inventory's."""
    spec.num_params = inv.num_params
    spec.embedding_params = inv.numel("embedding")
    spec.per_layer_params = inv.layer_params(0)
    spec.largest_param_numel = inv.largest
    spec.counted_by = inv.counted_by
    return spec
