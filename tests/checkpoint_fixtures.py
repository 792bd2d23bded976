"""Real DeepSpeed checkpoints for the checkpoint tests, made once per session (two launches in all), shared by
the xdist workers."""
from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.helpers import ROOT, deepspeed_launch

MAKER = ROOT / "tests" / "scripts" / "make_zero_checkpoints.py"


@functools.cache
def zero_checkpoints() -> Path:
    """base/w2/{zero3,zero2,zero1,model}, base/w3/{zero3,model}: a tiny tied Llama with odd sizes and a frozen MLP.

    Made once per session: in the folder the session shares (DSDOCTOR_TEST_SHARED_DIR, set by tests/conftest.py
    and seen by every xdist worker) by whichever process asks first, under a lock the others wait on."""
    shared = os.environ.get("DSDOCTOR_TEST_SHARED_DIR")
    if not shared:  # the helper used outside pytest
        shared = tempfile.mkdtemp(prefix="dsdoctor-ckpt-")
        atexit.register(shutil.rmtree, shared, True)
    base = Path(shared) / "zero-checkpoints"
    with open(Path(shared) / "zero-checkpoints.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / "complete").exists():
            shutil.rmtree(base, ignore_errors=True)  # a process that died while making them
            for world, stages in ((2, ("3", "2", "1")), (3, ("3",))):
                res = _launch(MAKER, str(base / f"w{world}"), *stages, nprocs=world)
                assert "MAKE_ZERO_CHECKPOINTS_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
            (base / "complete").write_text("")
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
