"""Tiny random-weight models built from config, shared by the scripts in this folder (never downloaded)."""
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
T5 = dict(model_type="t5", d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
          vocab_size=128, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def llama(**overrides):
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**dict(LLAMA, **overrides)))


def t5():
    return AutoModelForSeq2SeqLM.from_config(AutoConfig.for_model(**T5))
