"""Create a Llama with random weights and save it (safetensors) for ``dsdoctor compare``'s benchmark.

Built directly on the GPU in bf16 (random init of a 7B model on the CPU takes minutes). Reuses OUT_DIR
when it already holds a model of the same shape. Prints one JSON line with what it did and how long.

    python bench/compare/make_model.py /tmp/dsdoctor-compare-7b                # 7B-shaped, 32 layers
    python bench/compare/make_model.py /tmp/tiny --hidden 64 --intermediate 160 --heads 4 --kv-heads 2 \
        --layers 2 --vocab 256 --dtype fp32                                   # CPU smoke test
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

LLAMA_7B = Path(__file__).resolve().parents[2] / "src" / "dsdoctor" / "examples" / "llama-7b" / "config.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads(LLAMA_7B.read_text())
    for key, value in (("num_hidden_layers", args.layers), ("hidden_size", args.hidden),
                       ("intermediate_size", args.intermediate), ("num_attention_heads", args.heads),
                       ("num_key_value_heads", args.kv_heads), ("vocab_size", args.vocab)):
        if value is not None:
            cfg[key] = value
    if args.heads is not None and args.kv_heads is None:
        cfg["num_key_value_heads"] = args.heads
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    cfg["torch_dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[args.dtype]
    shape = {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                 "num_key_value_heads", "vocab_size", "torch_dtype")}
    out = Path(args.out_dir)
    stamp = out / "dsdoctor-bench-shape.json"
    if stamp.exists() and json.loads(stamp.read_text()) == shape and any(out.glob("*.safetensors")):
        print(json.dumps({"model_dir": str(out), "reused": True, **shape}), flush=True)
        return 0
    shutil.rmtree(out, ignore_errors=True)

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    print(f"building a {args.layers}-layer Llama (hidden {cfg['hidden_size']}) on {device} in {args.dtype}",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    print(f"built {params / 1e9:.2f}B parameters in {t1 - t0:.1f}s; saving to {out}", file=sys.stderr, flush=True)
    model.save_pretrained(out, safe_serialization=True)
    t2 = time.perf_counter()
    stamp.write_text(json.dumps(shape))
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(json.dumps({"model_dir": str(out), "reused": False, "params": params, "bytes": size,
                      "build_s": round(t1 - t0, 1), "save_s": round(t2 - t1, 1), **shape}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
