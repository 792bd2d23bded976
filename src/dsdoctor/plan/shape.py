"""The model as plan sees it: its decoder's dimensions, the parameter inventory, and the KV cache's layout
per layer (what transformers' ``DynamicCache`` holds), read from ``config.json`` and the inventory."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dsdoctor.model.inventory import Inventory


@dataclass
class ModelShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    gated_mlp: bool
    kv_elems_per_token: list  # per layer: elements of keys + values for one position
    kv_window: list  # per layer: positions kept (None: all)
    logits_to_keep: bool
    inventory: Inventory
    # Phi-3's fused projections: one ``qkv_proj`` whose output the q/k/v views keep alive for the whole attention
    # forward, one ``gate_up_proj`` whose output the ``gate`` view keeps alive until the MLP returns
    fused_qkv: bool = False
    fused_gate_up: bool = False
    # DeepSpeed 0.19.8 can inject its inference kernels (init_inference's replace_with_kernel_inject=True)
    kernel_inject: bool = False
    experts: str = "grouped_mm"  # how the user's transformers runs routed experts (model/moe.py implementation)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim
    # one forward's gather points per (tp, dtype bytes, gather settings): the schedule does not depend on
    # the workload, so every estimate of this model reuses it (plan/schedule.py gather_points)
    point_cache: dict = field(default_factory=dict, repr=False, compare=False)



def model_shape(spec, inv: Inventory, experts: str = "grouped_mm") -> ModelShape:
    raw = spec.raw.get("text_config") if isinstance(spec.raw.get("text_config"), dict) else spec.raw
    layers = spec.num_layers
    if inv.cache_layout and len(inv.cache_layout) == layers:  # what transformers' DynamicCache really holds
        per_layer = [e for e, _ in inv.cache_layout]
        windows = [w for _, w in inv.cache_layout]
    else:
        if raw.get("kv_lora_rank"):  # MLA: transformers caches the compressed latent and the rope key
            per_token = int(raw["kv_lora_rank"]) + int(raw.get("qk_rope_head_dim", 0))
        else:
            per_token = 2 * spec.num_kv_heads * spec.head_dim
        per_layer = [per_token] * layers
        window = spec.sliding_window
        types = raw.get("layer_types")
        if inv.window_layout and len(inv.window_layout) == layers:
            windows = [w for _, w in inv.window_layout]
        elif isinstance(types, list) and len(types) == layers:
            windows = [window if (t == "sliding_attention" and window) else None for t in types]
        elif window and raw.get("use_sliding_window", True) and spec.model_type in ("mistral", "mixtral", "qwen2",
                                                                                      "starcoder2"):
            windows = [window] * layers
        else:
            windows = [None] * layers
    names = {p.module.rsplit(".", 1)[-1] for p in inv.params}
    gated = bool(names & {"gate_proj", "w1", "gate_up_proj"})
    return ModelShape(spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                      spec.vocab_size, layers, gated, per_layer, windows, inv.supports_logits_to_keep, inv,
                      fused_qkv="qkv_proj" in names, fused_gate_up="gate_up_proj" in names,
                      kernel_inject=kernel_injectable(spec.model_type, spec.num_heads, spec.num_kv_heads, raw),
                      experts=experts)


def kernel_injectable(model_type: str, heads: int, kv_heads: int, raw: dict) -> bool:
    """Whether DeepSpeed 0.19.8's kernel injection serves this model. Of today's decoder families only Llama has
    an injection policy (``module_inject/replace_policy.py``: LLAMALayerPolicy matches LlamaDecoderLayer
    exactly; Qwen2, Mistral, Phi-3, Gemma-2 and the MoE families have none), its kernel sizes one fused qkv of
    three equal head counts (``containers/llama.py`` concatenates q, k and v: grouped-query attention does not
    fit), and it refuses scaled rotary embeddings (``_get_rope_theta``: only rope_type None or "default")."""
    scaling = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else raw.get("rope_scaling")
    rope = (scaling.get("rope_type") or scaling.get("type")) if isinstance(scaling, dict) else None
    return model_type == "llama" and heads == kv_heads and rope in (None, "default")


def kv_bytes(shape: ModelShape, batch: int, positions: int, dtype_bytes: int, tp: int = 1,
             layers: int | None = None) -> int:
    """KV cache of ``layers`` layers (default all) holding ``positions`` positions for ``batch`` sequences."""
    total = 0
    for elems, window in list(zip(shape.kv_elems_per_token, shape.kv_window))[: layers if layers is not None else None]:
        kept = min(positions, window - 1) if window else positions  # DynamicSlidingWindowLayer keeps window-1
        total += batch * kept * math.ceil(elems / tp) * dtype_bytes
    return total

