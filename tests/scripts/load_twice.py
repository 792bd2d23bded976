"""Loads two models (a small draft model and the model it serves), then generates: python load_twice.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_models import llama  # noqa: E402

torch.manual_seed(0)
draft = llama(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
model = llama().eval()
ids = torch.randint(3, 256, (2, 6))
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
print("generated", out.shape[-1] - ids.shape[-1], "with", sum(p.numel() for p in draft.parameters()), "draft params")
