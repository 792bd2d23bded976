"""A mixture-of-experts model generating under ZeRO-3 on several ranks, each rank its own prompt.

    deepspeed --num_gpus 2 moe_zero3.py --config ds_zero3_infer.json [--impl per-expert|hf] [--leaf]
        [--model-type mixtral] [--ready FILE]

--impl per-expert (default): a tiny Llama whose MLPs are replaced by a sparse MoE block with one module per
expert that runs only the experts some token chose, as transformers 4.x's Mixtral/Qwen-MoE/OLMoE blocks do
(``for expert_idx in expert_hit``). Each rank routes its own tokens, so the ranks gather different experts'
parameters: ZeRO-3's all-gathers no longer pair up and the ranks wait on each other (the hang).
--impl hf: the installed transformers' own model of --model-type, built from a tiny config.
--leaf: ``deepspeed.utils.set_z3_leaf_modules(model, [the sparse block class])`` before deepspeed.initialize: the
block is gathered whole, every expert, on every rank (the fix).
Rank 0 prints {"generated": N, "transformers": version, "impl": ...} when every rank finished.
"""
import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
HF_MOE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
              num_local_experts=8, num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, decoder_sparse_step=1, shared_expert_intermediate_size=48,
              n_routed_experts=8, first_k_dense_replace=0, n_group=1, topk_group=1)  # DeepSeek's names


class Expert(nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False), \
            nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """One module per expert; experts no token chose are skipped (transformers 4.x's Mixtral block)."""

    def __init__(self, h: int, i: int, experts: int = 8, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(h, experts, bias=False)
        self.experts = nn.ModuleList(Expert(h, i) for _ in range(experts))

    def forward(self, hidden):
        b, s, h = hidden.shape
        x = hidden.view(-1, h)
        weights, chosen = torch.topk(torch.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        mask = nn.functional.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            e = int(e[0])
            k, tok = torch.where(mask[e])
            out.index_add_(0, tok, self.experts[e](x[tok]) * weights[tok, k, None])
        return out.view(b, s, h)


def build(impl: str, model_type: str):
    if impl == "hf":
        config = AutoConfig.for_model(model_type, **HF_MOE)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA), dtype=torch.float32)
    for layer in model.model.layers:
        layer.mlp = SparseMoeBlock(LLAMA["hidden_size"], LLAMA["intermediate_size"])
    return model


def block_class(model):
    """The class of the module that holds the experts."""
    for name, _module in model.named_modules():
        if name.endswith(".experts"):
            return type(model.get_submodule(name.rsplit(".", 1)[0]))
    raise SystemExit("no experts module in this model")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--impl", choices=("per-expert", "hf"), default="per-expert")
    p.add_argument("--model-type", default="mixtral")
    p.add_argument("--leaf", action="store_true")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--ready", help="rank 0 writes this file as it starts to generate")
    a = p.parse_args()

    torch.manual_seed(0)
    deepspeed.init_distributed()
    rank = dist.get_rank()
    model = build(a.impl, a.model_type)
    model.generation_config.pad_token_id = 0
    if a.leaf:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [block_class(model)])
    engine, *_ = deepspeed.initialize(model=model, config=a.config)
    engine.module.eval()
    print(f"rank {rank}: initialized", flush=True)
    # one token on rank 0 (its top-k experts), twelve on the others (most experts): different experts per rank
    length = 1 if rank == 0 else 12
    ids = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(rank))
    if a.ready and rank == 0:
        with open(a.ready, "w") as fh:
            fh.write("generating\n")
    with torch.no_grad():
        out = engine.module.generate(ids, max_new_tokens=a.new_tokens, do_sample=False, eos_token_id=None,
                                     synced_gpus=True)
    print(f"rank {rank}: generated", flush=True)
    dist.barrier()
    if rank == 0:
        print(json.dumps({"generated": int(out.shape[-1] - ids.shape[-1]), "transformers": transformers.__version__,
                          "impl": a.impl, "block": block_class(model).__name__}), flush=True)


if __name__ == "__main__":
    main()
