"""A loop that trains with plain torch (loss.backward(), optimizer.step()) between generates, no DeepSpeed."""
import torch
from transformers import AutoConfig, AutoModelForCausalLM

TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=64, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)

torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
prompt = torch.randint(3, 64, (1, 4))
for _ in range(2):
    with torch.no_grad():
        seq = model.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    model(seq, labels=seq).loss.backward()
    opt.step()
    opt.zero_grad()
print("done")
