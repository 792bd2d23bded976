"""A ZeRO-3 inference script whose model may reach deepspeed.initialize unpartitioned. dsdoctor traces it.

    deepspeed --num_gpus 2 unpartitioned_init.py --config ds.json --order after|dropped|before

after:   the model is built first, HfDeepSpeedConfig created afterwards (the common mistake)
dropped: HfDeepSpeedConfig(config) created before the model but not kept (transformers holds a weak reference)
before:  dschf = HfDeepSpeedConfig(config) kept alive before building the model (right: built under zero.Init)
"""
import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--order", choices=("after", "dropped", "before"), required=True)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    with open(a.config) as fh:
        ds_config = json.load(fh)

    torch.manual_seed(0)
    deepspeed.init_distributed()
    keep = None
    if a.order == "before":
        keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 (kept alive: from_config builds under zero.Init)
    elif a.order == "dropped":
        HfDeepSpeedConfig(ds_config)  # not kept: garbage right away
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY), dtype=torch.float32)
    if a.order == "after":
        keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 (too late)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    engine.module.eval()
    ids = torch.randint(3, 256, (1, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = engine.module.generate(ids, max_new_tokens=2, do_sample=False, eos_token_id=None, synced_gpus=True)
    if dist.get_rank() == 0:
        partitioned = all(hasattr(q, "ds_id") for q in engine.module.parameters())
        print(json.dumps({"order": a.order, "generated": int(out.shape[-1] - ids.shape[-1]),
                          "partitioned_after_init": partitioned}), flush=True)


if __name__ == "__main__":
    main()
