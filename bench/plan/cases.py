"""The models and cases measured by bench/plan: Llama-shaped, 1B to 8B, every path on 1 and 2 GPUs."""
from __future__ import annotations

LLAMA_COMMON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
}

MODELS = {
    # Llama-3.2-1B shape (tied embeddings), Llama-3.2-3B shape (tied), Llama-3.1-8B shape (untied)
    "llama-1b": dict(LLAMA_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                     tie_word_embeddings=True),
    "llama-3b": dict(LLAMA_COMMON, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                     num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                     tie_word_embeddings=True),
    "llama-8b": dict(LLAMA_COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                     tie_word_embeddings=False),
}

TINY_MODELS = {
    "tiny-tied": dict(LLAMA_COMMON, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                      max_position_embeddings=256, tie_word_embeddings=True),
    "tiny": dict(LLAMA_COMMON, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=16, vocab_size=320,
                 max_position_embeddings=256, tie_word_embeddings=False),
}


def case(model, path, gpus, batch, prompt, new):
    return {"model": model, "path": path, "gpus": gpus, "batch": batch, "prompt_len": prompt, "new_tokens": new,
            "id": f"{model}-{path}-g{gpus}-b{batch}-p{prompt}-n{new}"}


# Ordered cheap-first inside each launch so that a time-out loses the expensive tail, not the whole set.
CASES = [
    # one GPU
    case("llama-8b", "plain", 1, 1, 128, 32),
    case("llama-1b", "plain", 1, 16, 4096, 16),
    case("llama-3b", "plain", 1, 4, 4096, 16),
    case("llama-8b", "plain", 1, 16, 1024, 16),
    case("llama-3b", "zero3", 1, 4, 512, 16),
    case("llama-1b", "zero3-offload", 1, 1, 128, 8),
    case("llama-3b", "zero3-offload", 1, 2, 1024, 4),
    # two GPUs
    case("llama-8b", "plain", 2, 4, 512, 16),
    case("llama-8b", "tp", 2, 1, 128, 32),
    case("llama-3b", "tp", 2, 16, 1024, 16),
    case("llama-8b", "tp", 2, 8, 2048, 16),
    case("llama-8b", "zero3", 2, 1, 128, 16),
    case("llama-1b", "zero3", 2, 16, 4096, 8),
    case("llama-8b", "zero3", 2, 8, 2048, 8),
    case("llama-3b", "zero3-offload", 2, 2, 512, 8),
    case("llama-8b", "zero3-offload", 2, 1, 256, 4),
]

TINY_CASES = [
    case("tiny", "plain", 1, 2, 16, 4),
    case("tiny-tied", "zero3", 1, 2, 16, 4),
    case("tiny", "zero3-offload", 1, 1, 8, 3),
    case("tiny", "plain", 2, 2, 16, 4),
    case("tiny", "zero3", 2, 2, 16, 4),
    case("tiny-tied", "zero3-offload", 2, 1, 8, 3),
    case("tiny", "tp", 2, 1, 8, 3),
]
