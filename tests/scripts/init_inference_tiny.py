"""deepspeed.init_inference on a tiny Llama, one process, no ZeRO config at all: python init_inference_tiny.py

init_inference takes an inference config (dtype, tensor parallel size), not a ZeRO config: ab cannot vary it.

    python init_inference_tiny.py --zero-in zero   # a legacy zero section in the config dict (ignored by DeepSpeed)
    python init_inference_tiny.py --zero-in args   # a ZeRO training config handed as args= (read as the model config)
"""
import os
import sys

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_models import llama  # noqa: E402

ZERO = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
torch.manual_seed(0)
model = llama().eval()
where = sys.argv[sys.argv.index("--zero-in") + 1] if "--zero-in" in sys.argv else None
if where == "zero":
    engine = deepspeed.init_inference(model, config={"dtype": torch.float32, "zero": ZERO})
elif where == "args":
    engine = deepspeed.init_inference(model, dtype=torch.float32,
                                      args={"train_micro_batch_size_per_gpu": 1, "zero_optimization": ZERO})
else:
    engine = deepspeed.init_inference(model, dtype=torch.float32)
ids = torch.randint(3, 256, (2, 6))
with torch.no_grad():
    out = engine.module.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
print("generated", out.shape[-1] - ids.shape[-1])
