"""Write real DeepSpeed checkpoints of a tiny Llama, one per requested ZeRO stage, in one launch.

Run under the launcher:  DS_ACCELERATOR=cpu deepspeed --num_gpus W make_zero_checkpoints.py OUT 3 [2 ...]
Each stage S writes OUT/zero{S}/ (``latest`` + tag dir) and, from rank 0, OUT/model/config.json.
The model has tied embeddings, sizes that do not divide by 2 or 3 (hidden 45, vocab 251, k_proj bias 16) and a frozen
MLP (so frozen_param_fragments are written); the ZeRO-2 model also has two persistent buffers. One Adam step is
taken so the fp32 masters differ from the initial bf16 weights.
"""
import json
import os
import sys

import deepspeed
import torch
import transformers

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 45, "head_dim": 16, "num_attention_heads": 3, "num_key_value_heads": 1, "attention_bias": True,
    "intermediate_size": 99, "num_hidden_layers": 2, "vocab_size": 251, "max_position_embeddings": 64,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}


def build_model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    model = transformers.LlamaForCausalLM(cfg)
    model.model.layers[0].mlp.requires_grad_(False)  # a frozen layer
    return model


def main():
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out = argv[0]
    stages = [int(s) for s in argv[1:]] or [3]
    # no shared-memory all-reduce kernel: its ranks spin while they wait (minutes on busy cores); gloo blocks
    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ.get("RANK", "0"))
    for stage in stages:
        model = build_model()
        if stage == 2:  # persistent buffers (Llama has none): an integer one keeps its dtype, a float one is cast
            model.model.register_buffer("probe_steps", torch.arange(7, dtype=torch.int64) * 3)
            model.model.register_buffer("probe_scale", torch.linspace(0, 1, 5))
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                          config=ds_config)
        ids = torch.randint(0, CONFIG["vocab_size"], (1, 8))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(os.path.join(out, f"zero{stage}"), tag="global_step1")
        del engine, model
    if rank == 0:
        os.makedirs(os.path.join(out, "model"), exist_ok=True)
        with open(os.path.join(out, "model", "config.json"), "w") as fh:
            json.dump(CONFIG, fh, indent=2)
    print("MAKE_ZERO_CHECKPOINTS_OK", flush=True)


if __name__ == "__main__":
    main()
