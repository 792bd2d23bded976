"""deepspeed.init_inference on a tiny Llama, one process, no ZeRO config at all: python init_inference_tiny.py

init_inference takes an inference config (dtype, tensor parallel size), not a ZeRO config: ab cannot vary it."""
import os
import sys

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_models import llama  # noqa: E402

torch.manual_seed(0)
model = llama().eval()
engine = deepspeed.init_inference(model, dtype=torch.float32)
ids = torch.randint(3, 256, (2, 6))
with torch.no_grad():
    out = engine.module.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
print("generated", out.shape[-1] - ids.shape[-1])
