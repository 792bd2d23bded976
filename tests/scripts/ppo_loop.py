"""A small PPO-style loop: the policy trains under ZeRO-3 and generates its own rollouts. Traced unchanged.

    deepspeed --num_gpus 2 ppo_loop.py --config ppo_zero3.json [--iters 3] [--unwrap]

Each iteration: generate (greedy, synced_gpus) -> a REINFORCE-style loss on the generated tokens' log-probs
with a made-up reward -> engine.backward -> engine.step. At the end every rank prints one JSON line with
every iteration's generated tokens (the weights change every step, so equal tokens across two runs mean
equal generation all along). --unwrap generates inside DeepSpeed's own unwrap_model_for_generation (the
model gathered once, the module hooks off), as a script that already took the first way out does.
"""
import argparse
import contextlib
import json

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
from transformers import AutoConfig, AutoModelForCausalLM

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--unwrap", action="store_true")
    a = p.parse_args()

    torch.manual_seed(0)
    deepspeed.init_distributed()
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY), dtype=torch.float32)
    model.generation_config.pad_token_id = 0
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=a.config)
    policy = engine.module
    prompts = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(rank))
    generated = []
    for _ in range(a.iters):
        policy.eval()
        gathered = unwrap_model_for_generation(engine) if a.unwrap else contextlib.nullcontext()
        with torch.no_grad(), gathered:
            seq = policy.generate(prompts, max_new_tokens=a.new_tokens, do_sample=False, eos_token_id=None,
                                  synced_gpus=True)
        generated.append(seq[:, prompts.shape[1]:].tolist())
        policy.train()
        logits = engine(seq).logits[:, prompts.shape[1] - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, seq[:, prompts.shape[1]:, None]).squeeze(-1)
        reward = (seq[:, prompts.shape[1]:] % 7 == 0).float().mean(-1, keepdim=True) - 0.1
        loss = -(reward * logp).mean()
        engine.backward(loss)
        engine.step()
    print(json.dumps({"rank": rank, "loss": float(loss), "tokens": generated}), flush=True)


if __name__ == "__main__":
    main()
