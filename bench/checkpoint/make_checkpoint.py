"""Write a real DeepSpeed 0.19.8 ZeRO-3 checkpoint of a ~1.1B-parameter Llama (TinyLlama shape), cheaply.

  DS_ACCELERATOR=cpu deepspeed --num_gpus 2 bench/checkpoint/make_checkpoint.py OUT_DIR [--size 1.5b|550m]

``--size 1.5b``: the same shape with 32 layers, 1.54B parameters (6.2 GB of fp32 partitions; about 20 GB of RAM
while it is made). ``--size 550m``: 10 layers, 0.57B parameters (2.3 GB of fp32 partitions), the size issue 33's
speed goal is stated at.

bf16 model (2.2 GB per rank before ZeRO-3 partitions it), AdamW so param_shapes and the fp32
flat groups are written, and save_checkpoint without any step so no Adam moments exist. The checkpoint holds
4.4 GB of fp32 partitions (2 files) plus small model-states files.
"""
import json
import os
import sys
import time

import deepspeed
import torch
import transformers

CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False,
              rms_norm_eps=1e-5)
SIZES = {"1.1b": CONFIG, "1.5b": dict(CONFIG, num_hidden_layers=32), "550m": dict(CONFIG, num_hidden_layers=10)}


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    size = args[args.index("--size") + 1] if "--size" in args else "1.1b"
    out = next(a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or args[i - 1] != "--size"))
    # no shared-memory all-reduce kernel (a JIT build, and its ranks spin while they wait); gloo blocks
    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ.get("RANK", "0"))
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    t0 = time.time()
    cfg = transformers.LlamaConfig(**SIZES[size])
    # zero.Init would build it partitioned, but its tensor patch fails on torch 2.13; build whole in bf16
    torch.manual_seed(rank)
    torch.set_default_dtype(torch.bfloat16)
    model = transformers.LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    print(f"rank {rank}: built {n / 1e9:.2f}B params in {time.time() - t0:.0f}s", flush=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    engine.save_checkpoint(out, tag="global_step0")
    if rank == 0:
        os.makedirs(os.path.join(out, "model"), exist_ok=True)
        cfg.save_pretrained(os.path.join(out, "model"))
        with open(os.path.join(out, "model", "params.json"), "w") as fh:
            json.dump({"parameters": n}, fh)
    print(f"rank {rank}: saved in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
