"""Tiny mixture-of-experts models for the MoE checkpoint maker and its tests, in both layouts of the expert weights.

``fused``: the installed transformers' own classes (5.x: one 3-D tensor per projection, mlp.experts.gate_up_proj
[E, 2I, H] and mlp.experts.down_proj [E, H, I]). ``per-expert``: the same model with each sparse block replaced by the
module layout of transformers 4.x (Qwen3-MoE: mlp.experts.<e>.gate_proj/up_proj/down_proj and mlp.gate, an
nn.Linear; Mixtral: block_sparse_moe.experts.<e>.w1/w3/w2 and block_sparse_moe.gate), computing what 4.x's
blocks compute. Every expert runs on every rank (on no token, if none chose it), so ZeRO-3 ranks gather the same
parameters in the same order. Five experts: the flat partitions of 2 ranks split an expert. Sizes are multiples of 8:
the CPU grouped_mm of transformers 5 needs 16-byte strides in bf16.
"""
import torch
import transformers
from torch import nn

COMMON = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
              vocab_size=97, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
CONFIGS = {
    "qwen3_moe": dict(COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", intermediate_size=40,
                      moe_intermediate_size=24, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(COMMON, architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=24,
                    num_local_experts=5, num_experts_per_tok=2),
    "olmoe": dict(COMMON, architectures=["OlmoeForCausalLM"], model_type="olmoe", intermediate_size=24,
                  num_experts=5, num_experts_per_tok=2, norm_topk_prob=False),
}
# transformers 4.x: (the sparse block's attribute, gate, up, down projection names)
PER_EXPERT = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"), "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"),
              "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def config(family: str):
    cfg = dict(CONFIGS[family])
    cfg.pop("architectures")
    return transformers.AutoConfig.for_model(**cfg)


class Expert(nn.Module):
    def __init__(self, hidden: int, inner: int, names: tuple):
        super().__init__()
        self.names = names
        for name, (o, i) in zip(names, ((inner, hidden), (inner, hidden), (hidden, inner))):
            setattr(self, name, nn.Linear(i, o, bias=False))

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(nn.functional.silu(gate(x)) * up(x))


class PerExpertBlock(nn.Module):
    """transformers 4.x's sparse MoE block (Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock): softmax routing over a
    linear gate, top-k, normalised when the config says so, one module per expert."""

    def __init__(self, cfg, names: tuple):
        super().__init__()
        experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        inner = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        self.top_k, self.norm = cfg.num_experts_per_tok, getattr(cfg, "norm_topk_prob", True)
        self.gate = nn.Linear(cfg.hidden_size, experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, inner, names) for _ in range(experts))

    def forward(self, hidden):
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            y = expert(x[token]) * weights[token, slot, None].to(x.dtype)
            out = out.index_add(0, token, y)
        return out.reshape(shape)


def build(family: str, layout: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(family))
    if layout == "per-expert":
        attr, *names = PER_EXPERT[family]
        torch.manual_seed(seed + 1)
        for layer in model.model.layers:
            block = PerExpertBlock(model.config, tuple(names))
            del layer.mlp
            setattr(layer, attr, block)  # registered under 4.x's name
            object.__setattr__(layer, "mlp", block)  # what the decoder layer's forward calls
    return model
