"""Write real DeepSpeed AutoTP + ZeRO checkpoints of a tiny Llama (tensor_parallel.autotp_size 2), one launch.

Run under the launcher:  DS_ACCELERATOR=cpu deepspeed --num_gpus W make_autotp_checkpoints.py OUT VARIANT [...]
VARIANT is zero3 (ZeRO-3, every parameter trained), zero3-frozen (ZeRO-3, layer 0's MLP frozen: its shards
are frozen_param_fragments) or zero1 (ZeRO-1). With W=4 the ranks form 2 tensor-parallel x 2 data-parallel.
Sizes split unevenly over 2 ranks (vocab 251, intermediate 99). One AdamW step, in fp32, so the masters are
the model's weights and DeepSpeed's ds_to_universal can convert the result. Rank 0 writes OUT/model/config.json.
"""
import json
import os
import sys

import deepspeed
import torch
import transformers

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 48, "head_dim": 12, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 99, "num_hidden_layers": 2, "vocab_size": 251, "max_position_embeddings": 64,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}


def main():
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out, variants = argv[0], argv[1:] or ["zero3"]
    # no shared-memory all-reduce kernel: its ranks spin while they wait, and 4 ranks on 2 busy cores then take
    # half an hour; gloo's all-reduce blocks instead (the checkpoint files are the same)
    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ.get("RANK", "0"))
    for variant in variants:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
        model = transformers.LlamaForCausalLM(cfg)
        if variant == "zero3-frozen":
            model.model.layers[0].mlp.requires_grad_(False)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 1 if variant == "zero1" else 3},
            "tensor_parallel": {"autotp_size": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        }
        engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        ids = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 8]])
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(os.path.join(out, variant), tag="global_step1")
        del engine, model
    if rank == 0:
        os.makedirs(os.path.join(out, "model"), exist_ok=True)
        with open(os.path.join(out, "model", "config.json"), "w") as fh:
            json.dump(CONFIG, fh, indent=2)
    print("MAKE_AUTOTP_CHECKPOINTS_OK", flush=True)


if __name__ == "__main__":
    main()
