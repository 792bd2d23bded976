"""A user's inference script that reuses a ZeRO-3 *training* config, as people do. dsdoctor traces it unchanged.

    deepspeed --num_gpus 2 infer_tiny.py --config train_zero3.json [--no-synced-gpus] [--hang [--ready FILE]]
        [--oom-without-offload] [--hf-config]

--hang: ranks ask for different lengths without synced_gpus and then meet at a barrier: the classic ZeRO-3
generate hang (--ready: rank 0 writes FILE as it gets to the barrier). --oom-without-offload: raise a
CUDA-style OOM inside generate when offload_param is off (stands in for a real OOM, which cannot happen on
the CPU).
"""
import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--no-synced-gpus", action="store_true")
    p.add_argument("--hang", action="store_true")
    p.add_argument("--oom-without-offload", action="store_true")
    p.add_argument("--hf-config", action="store_true", help="create HfDeepSpeedConfig before building the model")
    p.add_argument("--ready", help="with --hang: rank 0 writes this file as it reaches the barrier")
    a = p.parse_args()

    torch.manual_seed(0)
    deepspeed.init_distributed()
    rank = dist.get_rank()
    keep = None
    if a.hf_config:
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(a.config)  # noqa: F841 (must stay alive: turns on synced_gpus in generate)
    config = AutoConfig.for_model(**TINY)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = 0
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=a.config)
    engine.module.eval()

    if a.oom_without_offload and engine.zero_offload_param() is None:
        def boom(*_):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
        engine.module.model.layers[0].register_forward_pre_hook(boom)

    ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(rank))
    kwargs = dict(max_new_tokens=a.new_tokens + (8 * rank if a.hang else 0), do_sample=False, eos_token_id=None)
    if not (a.no_synced_gpus or a.hang):
        kwargs["synced_gpus"] = True
    with torch.no_grad():
        out = engine.module.generate(ids, **kwargs)
    if a.hang:
        if a.ready and rank == 0:
            with open(a.ready, "w") as fh:
                fh.write("at the barrier\n")
        dist.barrier()
    if rank == 0:
        print(json.dumps({"generated": int(out.shape[-1] - ids.shape[-1])}), flush=True)


if __name__ == "__main__":
    main()
