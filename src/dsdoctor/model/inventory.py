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
    expert: bool = False  # a routed expert's weight: one expert's module (transformers 4.x) or a fused 3-D tensor


@dataclass(frozen=True)
class MoeLayout:
    """A mixture-of-experts model's routed layers: what every command needs to know beyond the tensors."""
    num_experts: int  # routed experts per MoE layer
    top_k: int  # routed experts each token uses
    moe_layers: tuple[int, ...]  # decoder layers whose MLP is routed (the others are dense)
    expert_intermediate: int  # one routed expert's intermediate size
    shared_experts: int = 0  # always-active experts beside the routed ones
    shared_intermediate: int = 0  # their intermediate size (all of them together)
    fused: bool = True  # all experts of a layer in 3-D tensors (transformers 5); False: one module per expert
    block_class: str = ""  # the sparse MoE block's class (what deepspeed.utils.set_z3_leaf_modules takes)


@dataclass
class Inventory:
    params: list[Param]
    tied: list[tuple[str, str]] = field(default_factory=list)  # (alias module, owner module)
    supports_logits_to_keep: bool = True
    counted_by: str = "formula"
    cache_layout: list | None = None  # per layer: (elements per position, window or None), from transformers
    window_layout: list | None = None  # per layer: (0, window or None) from the config object
    moe: MoeLayout | None = None  # None: a dense model

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: each routed expert weight counts top_k / num_experts of its size."""
        if self.moe is None:
            return self.num_params
        routed = sum(p.numel for p in self.params if p.expert)
        return self.num_params - routed + routed * self.moe.top_k // self.moe.num_experts

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
    spec.active_params = inv.active_params
    spec.moe = inv.moe
    return spec
