"""Run plan's emitted code samples as a user would paste them, on CPU ranks (tests/plan/test_emitted_code.py).

    deepspeed --num_gpus 2 run_emitted.py CODES.json OUT_DIR

CODES.json: {path name: code}. Each sample runs in a fresh namespace, in this rank, with only what the sample
leaves to the user defined: ``inputs`` (a tokenized batch) and ``N`` (new tokens); its GPU device strings become
"cpu" (these ranks have none). Each rank writes OUT_DIR/rank{r}.json: {path: "ok <shape>" or the error}.
"""
import json
import os
import re
import sys
import traceback

import torch
from transformers import BatchEncoding


def on_cpu(code: str) -> str:
    code = re.sub(r'f"cuda:\{[^}]*\}"', '"cpu"', code)
    return re.sub(r'"cuda(:\d+)?"', '"cpu"', code)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    codes = json.loads(open(args[0]).read())
    out_dir = args[1]
    rank = int(os.environ.get("RANK", "0"))
    results = {}
    for name, code in codes.items():
        ids = torch.randint(3, 200, (2, 5), generator=torch.Generator().manual_seed(0))
        scope = {"inputs": BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)}), "N": 3}
        try:
            exec(compile(on_cpu(code), f"<{name}>", "exec"), scope)  # noqa: S102 (the sample under test)
            out = scope["out"]
            results[name] = f"ok {list(out.shape)}" if out.shape[1] == ids.shape[1] + 3 else f"wrong {list(out.shape)}"
        except Exception:  # noqa: BLE001 (every failure is the result)
            results[name] = traceback.format_exc()[-1500:]
        finally:
            scope.clear()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
