"""Launched by tests/config/test_split_deepspeed.py through the deepspeed launcher (CPU accelerator, 2 ranks).

Usage: config_split_rank.py DS_CONFIG MODEL_DIR OUT_DIR
Builds a random-weight Llama from MODEL_DIR/config.json, runs deepspeed.initialize with DS_CONFIG, records
what DeepSpeed built and the RSS delta across initialize, generates a few tokens when there is no
optimizer, and writes OUT_DIR/rank{r}.json.
"""
import gc
import json
import os
import resource
import sys

import deepspeed
import psutil
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def rss() -> int:
    return psutil.Process().memory_info().rss


def main():
    cfg_path, model_dir, out_dir = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][:3]
    rank = int(os.environ.get("RANK", "0"))
    with open(cfg_path) as fh:
        ds_config = json.load(fh)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(model_dir))
    n_params = sum(p.numel() for p in model.parameters())
    has_optimizer = "optimizer" in ds_config
    gc.collect()
    before = rss()
    kwargs = {"model_parameters": model.parameters()} if has_optimizer else {}
    engine, _opt, _, _ = deepspeed.initialize(model=model, config=ds_config, **kwargs)
    gc.collect()
    after = rss()
    zc = engine._config.zero_config
    result = {
        "rank": rank,
        "n_params": n_params,
        "optimizer_class": type(engine.optimizer).__name__,
        "zero_stage": int(engine.zero_optimization_stage()),
        "offload_param": zc.offload_param.device if zc.offload_param else "none",
        "rss_before": before,
        "rss_after": after,
        "rss_delta": after - before,
        "generated": None,
    }
    if not has_optimizer:
        engine.module.eval()
        ids = torch.tensor([[1, 5, 7, 9]])
        with torch.no_grad():
            out = engine.module.generate(ids, max_new_tokens=4, do_sample=False, synced_gpus=True,
                                         pad_token_id=0)
        result["generated"] = out[0].tolist()
    result["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
