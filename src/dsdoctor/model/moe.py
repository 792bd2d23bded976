"""What makes a model a mixture of experts, read from its config.json: which decoder layers are routed, how
many experts each has, how many a token uses, and the sparse block's class. Both counters (``formulas`` from
config.json, ``exact`` from the meta-device model) ask this module, so they agree on the layout; no torch.
"""
from __future__ import annotations

from dsdoctor.model.inventory import MoeLayout
from dsdoctor.units import human_bytes

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk", "moe_k")
# The sparse MoE block per model_type, as transformers names it in the 4.x releases that keep one module per
# expert: the class ``deepspeed.utils.set_z3_leaf_modules`` takes (read in each release's modeling file).
BLOCK_CLASS = {
    "mixtral": "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "qwen2_moe": "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "qwen3_moe": "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
    "olmoe": "olmoe.modeling_olmoe.OlmoeSparseMoeBlock",
    "deepseek_v2": "deepseek_v2.modeling_deepseek_v2.DeepseekV2MoE",
    "deepseek_v3": "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
    "gpt_oss": "gpt_oss.modeling_gpt_oss.GptOssMLP",
}
# transformers' config defaults where a config.json leaves the key out (configuration_<model_type>.py)
_DEFAULT_EXPERTS = {"mixtral": (8, 2), "qwen2_moe": (60, 4), "qwen3_moe": (128, 8), "olmoe": (64, 8),
                    "deepseek_v2": (64, 6), "deepseek_v3": (256, 8), "gpt_oss": (128, 4)}


def _first(c: dict, keys: tuple, default=0) -> int:
    for k in keys:
        v = c.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


def routed_experts(c: dict, model_type: str = "") -> int:
    """Routed experts per MoE layer (0: a dense model)."""
    return _first(c, EXPERT_KEYS, _DEFAULT_EXPERTS.get(model_type, (0, 0))[0])


def top_k(c: dict, model_type: str = "") -> int:
    return _first(c, TOP_K_KEYS, _DEFAULT_EXPERTS.get(model_type, (0, 0))[1]) or 1


def is_moe_layer(c: dict, model_type: str, i: int) -> bool:
    """Whether decoder layer ``i`` is routed, by each family's rule (its decoder layer's __init__)."""
    if routed_experts(c, model_type) <= 0:
        return False
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step = int(c.get("decoder_sparse_step") or 1)
        return i not in (c.get("mlp_only_layers") or []) and (i + 1) % step == 0
    if isinstance(c.get("moe_layers"), list):  # Llama 4 (its default: every interleave_moe_layer_step-th layer)
        return i in c["moe_layers"]
    if c.get("interleave_moe_layer_step"):
        return (i + 1) % int(c["interleave_moe_layer_step"]) == 0
    return i >= int(c.get("first_k_dense_replace") or 0)  # DeepSeek, GLM-4.5, Kimi: the first k layers dense


def shared_intermediate(c: dict) -> tuple[int, int]:
    """(always-active experts, their intermediate size together) beside the routed ones."""
    if c.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one shared expert of its own size
        return 1, int(c["shared_expert_intermediate_size"])
    if c.get("intermediate_size_mlp"):  # Llama 4: one shared expert of intermediate_size, dense MLPs of _mlp
        return 1, int(c.get("intermediate_size") or 0)
    shared = _first(c, ("n_shared_experts", "num_shared_experts"))
    return shared, shared * int(c.get("moe_intermediate_size") or 0)


def layout(c: dict, model_type: str, moe_layers, expert_intermediate: int, fused: bool = True,
           block_class: str = "") -> MoeLayout | None:
    """The layout of a model whose routed layers are ``moe_layers`` (None when there are none)."""
    moe_layers = tuple(moe_layers)
    if not moe_layers:
        return None
    shared, shared_inter = shared_intermediate(c)
    block = block_class or BLOCK_CLASS.get(model_type, "")
    return MoeLayout(routed_experts(c, model_type), top_k(c, model_type), moe_layers, expert_intermediate,
                     shared, shared_inter, fused, block)


# transformers 4.x blocks with one module per expert that run only the experts some token chose (read in 4.57.6's
# modeling files: Mixtral, Qwen2-MoE and Qwen3-MoE loop over ``expert_hit``, DeepSeek-V2 skips ``num_tokens == 0``,
# DeepSeek-V3 ``token_indices.numel() > 0``; the first 4.x Mixtral had ``if top_x.shape[0] == 0: continue``).
# OLMoE 4.x runs every expert and gpt-oss indexes 3-D tensors: no skip. transformers 5 fuses every family's
# experts into 3-D tensors gathered whole.
SKIPS_UNCHOSEN_4X = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
FUSED_FROM = (5, 0, 0)
# deepspeed.initialize makes these blocks ZeRO-3 leaves by itself (zero_optimization.leaf_module.classes, default
# DEFAULT_LEAF_MODULE_CLASSES in runtime/zero/leaf_module_config.py, read in 0.19.8; added by PR #7604, October
# 2025, in the releases from 0.18.1 at the latest). Measured on 2 CPU ranks with 0.19.8 and 4.57.6
# (tests/scripts/moe_zero3.py): Mixtral, Qwen3-MoE and OLMoE finish; DeepSeek-V3, and Mixtral with the list emptied,
# abort on gloo's size check (a hang on NCCL); transformers 5.24's fused Mixtral finishes.
DEEPSPEED_LEAVES = ("mixtral", "qwen2_moe", "qwen3_moe")
DEEPSPEED_LEAVES_FROM = (0, 18, 1)


def hang_risk(moe: MoeLayout | None, model_type: str, transformers: tuple | None, deepspeed: tuple | None = None,
              leaf_classes: list | None = None) -> bool:
    """Whether ZeRO-3 ranks can gather different experts and wait on each other: a MoE whose block in the user's
    transformers (a version tuple; None: not known) runs only the chosen experts' modules, and that DeepSpeed does
    not make a leaf by itself (``deepspeed``: its version; ``leaf_classes``: the config's leaf_module.classes)."""
    if moe is None or model_type not in SKIPS_UNCHOSEN_4X:
        return False
    if transformers is not None and transformers >= FUSED_FROM:
        return False
    return not _deepspeed_leaf(model_type, deepspeed, leaf_classes)


# How transformers runs the routed experts (what plan's allocated peak counts, plan/schedule.py): 5.x's
# experts_implementation (from_pretrained's argument, or config.json's key), grouped_mm by default; 4.x one module
# per expert behind a one-hot mask in these families (read in 4.57.6; OLMoE runs them all), the others as 5.x.
IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")
PER_EXPERT_4X = (*SKIPS_UNCHOSEN_4X, "olmoe")


def implementation(raw: dict, model_type: str, transformers: tuple | None) -> str:
    """grouped_mm, batched_mm, eager or per-expert (4.x) under the user's transformers (None: the newest)."""
    if transformers is not None and transformers < FUSED_FROM:
        return "per-expert" if model_type in PER_EXPERT_4X else "grouped_mm"
    chosen = raw.get("experts_implementation")
    return chosen if chosen in IMPLEMENTATIONS else "grouped_mm"


def _deepspeed_leaf(model_type: str, deepspeed: tuple | None, leaf_classes: list | None) -> bool:
    """DeepSpeed makes the block a leaf by itself: a release with the default list, the class in it."""
    if model_type not in DEEPSPEED_LEAVES or deepspeed is None or deepspeed < DEEPSPEED_LEAVES_FROM:
        return False
    cls = BLOCK_CLASS[model_type].rsplit(".", 1)[-1]
    return leaf_classes is None or any(str(c).rsplit(".", 1)[-1] == cls for c in leaf_classes)


def leaf_class(model_type: str) -> str:
    """The sparse block class to give ``set_z3_leaf_modules``, importable: ``transformers.models.<...>.<Class>``."""
    return f"transformers.models.{BLOCK_CLASS[model_type]}" if model_type in BLOCK_CLASS else "<the sparse MoE block>"


def experts_touched(moe: MoeLayout, tokens: int) -> float:
    """Routed experts per MoE layer that ``tokens`` tokens use, expected under uniform routing:
    N (1 - (1 - k/N)^tokens); k for one token, all N for many."""
    n, k = moe.num_experts, min(moe.top_k, moe.num_experts)
    return n * (1 - (1 - k / n) ** max(tokens, 0)) if n else 0.0


def gather_values(model_type: str, moe: MoeLayout, total: int, active: int, elem_bytes: int) -> dict:
    """The figures of DSD117/DSD226: what a ZeRO-3 forward gathers (every parameter) against what one token uses."""
    return {"model_type": model_type, "experts": moe.num_experts, "top_k": moe.top_k, "layers": len(moe.moe_layers),
            "gathered": human_bytes(total * elem_bytes), "active": human_bytes(active * elem_bytes),
            "ratio": f"{total / max(active, 1):.1f}"}


def hang_values(model_type: str, transformers: str) -> dict:
    """The values of DSD118: the model, the user's transformers, the block class to make a ZeRO-3 leaf."""
    module, cls = leaf_class(model_type).rsplit(".", 1)
    return {"model_type": model_type, "transformers": transformers, "block": cls, "module": module, "cls": cls}
