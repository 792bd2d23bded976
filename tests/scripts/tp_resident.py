"""Rank script: what AutoTP (deepspeed.init_inference, tensor_parallel tp_size=2) leaves on each rank.

argv: OUT_JSON MODEL_DIR. Counts the elements of every distinct parameter of the rank's module after
init_inference (a tied weight once per tensor) and writes every rank's count. fp32: bf16 AutoTP crashes on
the CPU accelerator (shared/FACTS.md).
"""
import json
import sys

import torch

argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
out_path, model_dir = argv[0], argv[1]

import deepspeed  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")
cfg = AutoConfig.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32,
                                  replace_with_kernel_inject=False)
seen, numel = set(), 0
for p in list(engine.module.parameters()) + [m.weight for m in engine.module.modules()
                                             if isinstance(getattr(m, "weight", None), torch.Tensor)]:
    if p.data_ptr() not in seen:
        seen.add(p.data_ptr())
        numel += p.numel()
counts = [None, None]
torch.distributed.all_gather_object(counts, numel)
if torch.distributed.get_rank() == 0:
    json.dump({"numel": counts}, open(out_path, "w"))
