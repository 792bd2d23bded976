"""Real DeepSpeed checkpoints for the checkpoint tests, made once per session (two launches in all)."""
from __future__ import annotations

import atexit
import functools
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.helpers import ROOT, deepspeed_launch

MAKER = ROOT / "tests" / "scripts" / "make_zero_checkpoints.py"


@functools.cache
def zero_checkpoints() -> Path:
    """base/w2/{zero3,zero2,zero1,model}, base/w3/{zero3,model}: a tiny tied Llama with odd sizes and a frozen MLP."""
    base = Path(tempfile.mkdtemp(prefix="dsdoctor-ckpt-"))
    atexit.register(shutil.rmtree, base, True)
    for world, stages in ((2, ("3", "2", "1")), (3, ("3",))):
        res = _launch(MAKER, str(base / f"w{world}"), *stages, nprocs=world)
        assert "MAKE_ZERO_CHECKPOINTS_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    return base


def _launch(script: Path, *args: str, nprocs: int) -> subprocess.CompletedProcess:
    """helpers.deepspeed_launch with a retry: a free port can still be taken between the check and the bind."""
    for _ in range(3):
        res = deepspeed_launch(script, *args, nprocs=nprocs, timeout=600)
        if "EADDRINUSE" not in res.stdout + res.stderr:
            return res
    return res


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def read_merged(out: Path) -> dict:
    """Every tensor of a merged directory, read with the safetensors package."""
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for name, shard in index["weight_map"].items():
        with safe_open(str(out / shard), framework="pt") as fh:
            tensors[name] = fh.get_tensor(name)
    return tensors
