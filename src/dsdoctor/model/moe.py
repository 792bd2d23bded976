"""What makes a model a mixture of experts, read from its config.json: which decoder layers are routed, how
many experts each has, how many a token uses, and the sparse block's class. Both counters (``formulas`` from
config.json, ``exact`` from the meta-device model) ask this module, so they agree on the layout; no torch.
"""
from __future__ import annotations

from dsdoctor.model.inventory import MoeLayout

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
    if model_type.startswith("deepseek"):
        return i >= int(c.get("first_k_dense_replace") or 0)
    return True


def shared_intermediate(c: dict) -> tuple[int, int]:
    """(always-active experts, their intermediate size together) beside the routed ones."""
    if c.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one shared expert of its own size
        return 1, int(c["shared_expert_intermediate_size"])
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
