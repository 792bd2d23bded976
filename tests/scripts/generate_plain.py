"""Single-process generate with transformers only (no DeepSpeed ranks): python generate_plain.py

An HfDeepSpeedConfig (ZeRO-3 with offload_param) is created after the model is built, as scripts that share one
config between training and inference do; it is observed like any DeepSpeed config."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

config = AutoConfig.for_model(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                              max_position_embeddings=64, pad_token_id=0, eos_token_id=2)
model = AutoModelForCausalLM.from_config(config)
keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1,
                          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
ids = torch.randint(3, 128, (3, 5))
out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
print("generated", out.shape[-1] - ids.shape[-1], "zero3", keep.is_zero3())
