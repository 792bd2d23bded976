"""The parameters of a model, one entry per tensor, in the order a forward pass uses them.

The memory model needs more than a total: ZeRO-3 gathers and releases parameters module by module, keeps
small ones whole (``stage3_param_persistence_threshold``), and tensor parallelism shards some tensors and
not others. An inventory lists every parameter tensor once (tied weights once, at first use) with the
module that owns it, in forward order. ``from_formula`` builds it from config.json for Llama-style
decoders; ``dsdoctor.model.exact`` builds it from the real model on the meta device.
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


def from_formula(spec) -> Inventory:
    """From config.json alone: the architecture's own builder (``formulas.py``), else a Llama-style decoder
    (gated MLP, RMSNorm, optional q/k/v bias, optional experts), exact for the Llama family and marked
    ``formula-approx`` for anything else."""
    from dsdoctor.model.formulas import EXACT_TYPES, TIE_DEFAULT_TRUE, formula_inventory

    exact = formula_inventory(spec)
    if exact is not None:
        return exact
    h, hd, nh, kv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
    inter = spec.intermediate_size
    raw = spec.raw.get("text_config") if isinstance(spec.raw.get("text_config"), dict) else spec.raw
    qkv_bias = bool(raw.get("attention_bias")) or spec.model_type in ("qwen2", "qwen2_moe")
    params: list[Param] = []

    def add(module, suffix, shape, kind, layer):
        n = 1
        for s in shape:
            n *= s
        params.append(Param(f"{module}.{suffix}", module, n, tuple(shape), kind, layer))

    add("model.embed_tokens", "weight", (spec.vocab_size, h), "embedding", None)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        add(f"{p}.input_layernorm", "weight", (h,), "norm", i)
        for name, out in (("q_proj", nh * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            add(f"{p}.self_attn.{name}", "weight", (out, h), "linear", i)
            if qkv_bias:
                add(f"{p}.self_attn.{name}", "bias", (out,), "linear", i)
        add(f"{p}.self_attn.o_proj", "weight", (h, nh * hd), "linear", i)
        add(f"{p}.post_attention_layernorm", "weight", (h,), "norm", i)
        if spec.num_experts:
            add(f"{p}.mlp.gate", "weight", (spec.num_experts, h), "linear", i)
            for e in range(spec.num_experts):
                for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                    add(f"{p}.mlp.experts.{e}.{name}", "weight", shape, "linear", i)
        else:
            for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                add(f"{p}.mlp.{name}", "weight", shape, "linear", i)
    add("model.norm", "weight", (h,), "norm", None)
    tied = []
    if spec.tie_word_embeddings or (spec.model_type not in EXACT_TYPES and "tie_word_embeddings" not in spec.raw
                                    and spec.model_type in TIE_DEFAULT_TRUE):
        tied.append(("lm_head", "model.embed_tokens"))
    else:
        add("lm_head", "weight", (spec.vocab_size, h), "lm_head", None)
    return Inventory(params, tied=tied, counted_by="formula" if spec.model_type in EXACT_TYPES else "formula-approx")


def apply_to_spec(spec, inv: Inventory):
    """Replace the spec's formula counts by the inventory's."""
    spec.num_params = inv.num_params
    spec.embedding_params = inv.numel("embedding")
    spec.per_layer_params = inv.layer_params(0)
    spec.largest_param_numel = inv.largest
    spec.counted_by = inv.counted_by
    return spec
