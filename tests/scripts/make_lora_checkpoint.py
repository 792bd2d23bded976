"""Write real DeepSpeed ZeRO-3 checkpoints of PEFT-wrapped tiny Llamas, one per variant, in one launch.

Run under the launcher:  DS_ACCELERATOR=cpu deepspeed --num_gpus 2 make_lora_checkpoint.py OUT [VARIANT ...]
  lora       LoRA on q_proj and v_proj, r=4 (the default; written straight into OUT)
  dora       DoRA on q_proj and v_proj, lm_head in modules_to_save, untied embeddings (into OUT/dora)
  embedding  LoRA on embed_tokens and q_proj, a bias trained with bias="lora_only" (into OUT/embedding)
Each writes, as a Trainer run with PEFT would leave it:
  base/                 the base model before LoRA (save_pretrained: config.json + model.safetensors)
  ckpt/                 engine.save_checkpoint (latest, global_step3/) + the run's adapter_config.json
  expected_adapter.safetensors  PEFT's own adapter state dict of the trained model (get_peft_model_state_dict)
  in_memory.json        greedy tokens and per-step logits of the trained model, generated under ZeRO-3
fp32 throughout (no bf16), so the in-memory model is the fp32 masters the checkpoint holds. Three AdamW steps
with lr 1e-2 move lora_B away from its zero init. Hidden 45 and vocab 251: ZeRO-3 partitions do not divide
evenly over 2 ranks; the lora variant ties its embeddings (the base shares them).
"""
import json
import os
import sys

import deepspeed
import peft
import torch
import transformers

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 45, "head_dim": 16, "num_attention_heads": 3, "num_key_value_heads": 1, "attention_bias": True,
    "intermediate_size": 99, "num_hidden_layers": 2, "vocab_size": 251, "max_position_embeddings": 64,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}
PROMPTS = [[1, 17, 42, 99, 7], [1, 200, 3, 55, 120, 9], [1, 250, 4]]
NEW_TOKENS = 8


VARIANTS = {
    "lora": dict(target_modules=["q_proj", "v_proj"]),
    "dora": dict(target_modules=["q_proj", "v_proj"], use_dora=True, modules_to_save=["lm_head"]),
    "embedding": dict(target_modules=["embed_tokens", "q_proj"], bias="lora_only"),
}


def main():
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out, variants = argv[0], argv[1:] or ["lora"]
    # no shared-memory all-reduce kernel: its ranks spin while they wait, which on busy cores takes many minutes;
    # gloo's all-reduce blocks instead (the checkpoint files are the same)
    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    deepspeed.init_distributed(dist_backend="gloo")
    for variant in variants:
        run(out if variant == "lora" else os.path.join(out, variant), variant)
    print("MAKE_LORA_CHECKPOINT_OK", flush=True)


def run(out: str, variant: str):
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    config = dict(CONFIG, tie_word_embeddings=variant == "lora")
    cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    base = transformers.LlamaForCausalLM(cfg)
    if rank == 0:
        base.save_pretrained(os.path.join(out, "base"), safe_serialization=True)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **VARIANTS[variant])
    model = peft.get_peft_model(base, lora)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    for step in range(3):
        ids = torch.tensor([[1, 5 + step, 42, 99, 7, 250, 3, 8]])
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    ckpt = os.path.join(out, "ckpt")
    engine.save_checkpoint(ckpt, tag="global_step3")
    if rank == 0:
        model.peft_config["default"].save_pretrained(ckpt)  # adapter_config.json, as the Trainer leaves it

    engine.module.eval()
    records = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            res = engine.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                         min_new_tokens=NEW_TOKENS, do_sample=False, synced_gpus=True,
                                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
            records.append({"prompt": prompt, "tokens": res.sequences[0, len(prompt):].tolist(),
                            "logits": [step[0].tolist() for step in res.logits]})
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if rank == 0:
        from safetensors.torch import save_file

        expected = peft.get_peft_model_state_dict(engine.module, state_dict=state)
        save_file({k: v.contiguous() for k, v in expected.items()}, os.path.join(out, "expected_adapter.safetensors"))
        with open(os.path.join(out, "in_memory.json"), "w") as fh:
            json.dump(records, fh)
    del engine, model


if __name__ == "__main__":
    main()
