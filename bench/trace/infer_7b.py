"""Inference as users write it: a 7B-shaped Llama (random weights) under deepspeed.initialize with a reused
ZeRO-3 training config, then a fixed-batch generate. dsdoctor traces and A/Bs it unchanged.

    python3 -m torch.distributed.run --standalone --nproc_per_node N bench/trace/infer_7b.py \
        --config bench/trace/train_zero3_offload.json [--result out.json] [--tiny]

Prints one JSON line (rank 0) with tokens/s of the last generate, measured by the script itself (so a traced
and an untraced run compare like for like). --tiny: a 2-layer model on the CPU (DS_ACCELERATOR=cpu) to check
the script without a GPU.
"""
import argparse
import json
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

LLAMA_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY = dict(LLAMA_7B, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="generate calls; the last one is reported")
    p.add_argument("--result", help="write the JSON line here too")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    a = p.parse_args()

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available() and not a.tiny
    if cuda:
        torch.cuda.set_device(a.local_rank)
    device = torch.device("cuda", a.local_rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = AutoConfig.for_model(**(TINY if a.tiny else LLAMA_7B))
    t0 = time.perf_counter()
    torch.set_default_dtype(dtype)
    with torch.device(device):  # random init directly on the GPU: on the CPU a 7B init takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    torch.set_default_dtype(torch.float32)
    model.generation_config.pad_token_id = 0
    t_build = time.perf_counter() - t0

    t0 = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=a.config)
    engine.module.eval()
    t_init = time.perf_counter() - t0

    g = torch.Generator().manual_seed(1234 + rank)
    ids = torch.randint(3, config.vocab_size, (a.batch, a.prompt), generator=g).to(device)
    rates = []
    for _ in range(a.repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = engine.module.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                                         do_sample=False, synced_gpus=world > 1)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rates.append(a.batch * (out.shape[-1] - a.prompt) / dt)
    result = {"rank": rank, "world_size": world, "tokens_per_s": rates[-1], "tokens_per_s_all": rates,
              "build_s": t_build, "init_s": t_init, "batch": a.batch, "prompt": a.prompt, "new_tokens": a.new_tokens,
              "peak_gpu_reserved": torch.cuda.max_memory_reserved() if cuda else None,
              "traced": bool(os.environ.get("PYTHON_DSDOCTOR_TRACE_DIR"))}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
        if a.result:
            with open(a.result, "w") as fh:
                json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
