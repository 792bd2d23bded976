"""An unchanged user inference script, its model and workload on its own command line, that passes the DeepSpeed
config it is given to deepspeed.initialize (with --hf also to HfDeepSpeedConfig first, as transformers' ZeRO-3
inference recipe does, so the model is built under zero.Init):

    python infer_flags.py --config CONFIG --model DIR --batch 4 --prompt-len 24 --new-tokens 8 [--hf]

DIR holds a config.json (random weights from it: nothing is downloaded). With a training config whose top-level
numbers are "auto" (ms-swift's, the HF Trainer's), the run dies at load: in deepspeed.initialize, or with --hf
inside the model's construction, before any model exists.
"""
import argparse
import os

if "RANK" not in os.environ:  # one rank without a launcher: the environment a launcher would set
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29733")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--hf", action="store_true")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()

    torch.manual_seed(0)
    deepspeed.init_distributed()
    keep = None
    if a.hf:
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(a.config)  # noqa: F841 -- kept alive: zero.Init while the model is built
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.model))
    model.generation_config.pad_token_id = 0
    engine, *_ = deepspeed.initialize(model=model, config=a.config)
    engine.module.eval()
    ids = torch.randint(3, 256, (a.batch, a.prompt_len))
    with torch.no_grad():
        out = engine.module.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                                     do_sample=False, eos_token_id=None)
    print(f"generated {int(out.shape[-1] - ids.shape[-1])}", flush=True)


if __name__ == "__main__":
    main()
