"""Reads its own memory counters the way guides tell users to, around observed calls (a model built from a
config, generate). Prints one JSON line: VmHWM, the RSS before a big buffer, the buffer's size, and (on a
GPU) torch.cuda.max_memory_allocated/reserved. Traced or not, the numbers must be the same."""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def vm(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise SystemExit(f"no {key}")


BUFFER = int(sys.argv[1]) if len(sys.argv) > 1 else 400 * 2**20
cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=256)
model = AutoModelForCausalLM.from_config(cfg).to(device).eval()  # an observed phase
rss_before = vm("VmRSS")
blob = bytearray(BUFFER)  # zero-filled: every page touched
for i in range(0, BUFFER, 4096):
    blob[i] = 1
if cuda:
    big = torch.empty(BUFFER, dtype=torch.uint8, device=device)
    del big
del blob
with torch.no_grad():
    model.generate(torch.tensor([[1, 2, 3]], device=device), max_new_tokens=2, do_sample=False,
                   pad_token_id=0)  # another observed phase: the observer closes an interval here
out = {"vm_hwm": vm("VmHWM"), "rss_before_buffer": rss_before, "buffer": BUFFER}
if cuda:
    out["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    out["max_memory_reserved"] = torch.cuda.max_memory_reserved()
print("RESULT " + json.dumps(out), flush=True)
