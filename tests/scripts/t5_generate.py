"""Encoder-decoder generate (a tiny T5 built from config), one process, no DeepSpeed: python t5_generate.py

generate returns only the decoder's tokens (its start token + the new ones), not prompt + new tokens."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_models import t5  # noqa: E402

torch.manual_seed(0)
model = t5().eval()
ids = torch.randint(2, 128, (3, 20))
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
print("output shape", tuple(out.shape))
