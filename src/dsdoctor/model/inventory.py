"""The parameters of a model, one entry per tensor, in the order a forward pass uses them.

The memory model needs more than a total: ZeRO-3 gathers and releases parameters module by module, keeps
small ones whole (``stage3_param_persistence_threshold``), and tensor parallelism shards some tensors and
not others. An inventory lists every parameter tensor once (tied weights once, at first use) with the
module that owns it, in forward order. ``dsdoctor.model.formulas`` builds it from config.json;
``dsdoctor.model.exact`` builds it from the real model on the meta device. Only the types live here, so that
both builders import them and neither imports the other.
"""
from __future__ import annotations

import dataclasses
import math
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


ATTENTION = ("sdpa", "eager", "eager-sinks")


@dataclass
class Inventory:
    params: list[Param]
    tied: list[tuple[str, str]] = field(default_factory=list)  # (alias module, owner module)
    supports_logits_to_keep: bool = True
    counted_by: str = "formula"
    cache_layout: list | None = None  # per layer: (elements per position, window or None), from transformers
    window_layout: list | None = None  # per layer: (0, window or None) from the config object
    moe: MoeLayout | None = None  # None: a dense model
    attention: str = "sdpa"  # what transformers runs by default: sdpa, eager (a class without SDPA), eager-sinks

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


# ---- an inventory as plain JSON values, and back from an untrusted copy (plan's cache file) -----------------------
KINDS = ("embedding", "linear", "lm_head", "norm", "other")
_BIG = 1 << 50  # elements of one tensor or one dimension; a model holds at most 10**14 parameters (spec.MAX_PARAMS)


def inventory_to_dict(inv: Inventory) -> dict:
    """``inv`` as JSON values (``numel`` and ``layer`` follow from the shape and the name)."""
    return {"params": [[p.name, p.module, list(p.shape), p.kind, p.expert] for p in inv.params],
            "tied": [list(t) for t in inv.tied], "supports_logits_to_keep": inv.supports_logits_to_keep,
            "counted_by": inv.counted_by, "cache_layout": inv.cache_layout, "window_layout": inv.window_layout,
            "moe": dataclasses.asdict(inv.moe) if inv.moe is not None else None, "attention": inv.attention}


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _count(v, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= _BIG


def _param(item) -> Param:
    _need(isinstance(item, list) and len(item) == 5, "a parameter is not [name, module, shape, kind, expert]")
    name, module, shape, kind, expert = item
    _need(isinstance(name, str) and isinstance(module, str) and len(name) <= 1024 and name.startswith(module),
          f"parameter name {str(name)[:80]!r}")
    _need(isinstance(shape, list) and len(shape) <= 8 and all(_count(s) for s in shape) and math.prod(shape) <= _BIG,
          f"the shape of {name}")
    _need(kind in KINDS and isinstance(expert, bool), f"the kind of {name}")
    layer = layer_of(name)
    _need(layer is None or layer < 1 << 16, f"the layer of {name}")
    return Param(name, module, math.prod(shape), tuple(shape), kind, layer, expert)


def _pairs(value, first, second) -> list | None:
    """A list of two-value pairs, each value checked by ``first`` and ``second`` (None stays None)."""
    if value is None:
        return None
    _need(isinstance(value, list) and all(isinstance(v, list) and len(v) == 2 for v in value), "a pair list")
    _need(all(first(a) and second(b) for a, b in value), "a pair's values")
    return [tuple(v) for v in value]


def _moe(d) -> MoeLayout | None:
    if d is None:
        return None
    _need(isinstance(d, dict) and sorted(d) == sorted(f.name for f in dataclasses.fields(MoeLayout)),
          "the MoE layout's fields")
    sizes = ("num_experts", "top_k", "expert_intermediate", "shared_experts", "shared_intermediate")
    _need(all(_count(d[k]) for k in sizes), "the MoE layout's sizes")
    _need(isinstance(d["moe_layers"], list) and all(_count(i) and i < 1 << 16 for i in d["moe_layers"]), "MoE layers")
    _need(isinstance(d["fused"], bool) and isinstance(d["block_class"], str), "the MoE block")
    _need(d["num_experts"] >= 1 and d["top_k"] >= 1, "the experts")
    return MoeLayout(**dict(d, moe_layers=tuple(d["moe_layers"])))


def inventory_from_dict(d) -> Inventory:
    """The inverse of ``inventory_to_dict`` for an untrusted copy: ValueError on any value out of its type or
    bounds (a forged cache file must not reach plan)."""
    _need(isinstance(d, dict) and isinstance(d.get("params"), list), "no parameter list")
    params = [_param(item) for item in d["params"]]
    _need(sum(p.numel for p in params) <= 10**14, "more than 10**14 parameters")
    tied = _pairs(d.get("tied"), lambda v: isinstance(v, str), lambda v: isinstance(v, str))
    _need(tied is not None and isinstance(d.get("supports_logits_to_keep"), bool), "tied weights")
    _need(d.get("counted_by") in ("meta", "formula", "formula-approx"), "counted_by")
    cache = _pairs(d.get("cache_layout"), _count, lambda v: v is None or _count(v, 1))
    window = _pairs(d.get("window_layout"), _count, lambda v: v is None or _count(v, 1))
    _need(d.get("attention", "sdpa") in ATTENTION, "attention")
    return Inventory(params, tied, d["supports_logits_to_keep"], d["counted_by"], cache, window,
                     _moe(d.get("moe")), d.get("attention", "sdpa"))
