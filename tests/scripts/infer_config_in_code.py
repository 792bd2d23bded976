"""A 2-rank ZeRO-3 inference script whose DeepSpeed config is a dict built in code (no file to pass):

    deepspeed --num_gpus 2 infer_config_in_code.py [--stage N] [--optimizer] [--batch B] [--new-tokens N]

The model is a tiny Llama built from config; each rank generates `--batch` sequences of a 6-token prompt.
"""
import argparse
import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_models import llama  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--optimizer", action="store_true", help="a training-style config (AdamW section)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=8)
    a = p.parse_args()

    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": a.stage}}
    if a.optimizer:
        ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}
    torch.manual_seed(0)
    model = llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters() if a.optimizer else None,
                                      config=ds_config)
    engine.module.eval()
    rank = dist.get_rank()
    ids = torch.randint(3, 256, (a.batch, 6), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        out = engine.module.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False,
                                     synced_gpus=a.stage == 3)
    if rank == 0:
        print(json.dumps({"generated": int(out.shape[-1] - ids.shape[-1])}), flush=True)


if __name__ == "__main__":
    main()
