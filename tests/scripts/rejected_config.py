"""One rank, no launcher (the environment a launcher would set is set here), a config built in code that
DeepSpeed rejects (a fractional stage3_prefetch_bucket_size, as `0.9 * hidden**2` gives):

    python rejected_config.py PORT          # rejected at deepspeed.initialize
    python rejected_config.py PORT --hf     # rejected inside from_config: HfDeepSpeedConfig turns on zero.Init
"""
import os
import sys

os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", sys.argv[1] if len(sys.argv) > 1 and sys.argv[1].isdigit() else "29731")

import deepspeed  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_models import llama  # noqa: E402

hidden = 64
ds_config = {"train_micro_batch_size_per_gpu": 1,
             "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0.9 * hidden**2}}
if "--hf" in sys.argv:
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(ds_config)
model = llama()
engine, *_ = deepspeed.initialize(model=model, config=ds_config)
print("initialized")
