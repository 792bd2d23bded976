"""Real DeepSpeed checkpoints for the checkpoint tests, made once per session (one launch per kind), shared by
the xdist workers.

Each maker runs at most once per session, within a bounded time (BUDGET_S for all its launches), in the folder
the session shares (DSDOCTOR_TEST_SHARED_DIR, set by tests/conftest.py and seen by every xdist worker), by
whichever process asks first, under a lock the others wait on. If it fails or times out, the reason is kept (in
this process and in the shared folder) and every later test that needs it, in any worker, fails at once with
that reason: no relaunch.
"""
from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, deepspeed_env, deepspeed_launch, run_process

MAKER = ROOT / "tests" / "scripts" / "make_zero_checkpoints.py"
AUTOTP_MAKER = ROOT / "tests" / "scripts" / "make_autotp_checkpoints.py"
LORA_MAKER = ROOT / "tests" / "scripts" / "make_lora_checkpoint.py"
MOE_MAKER = ROOT / "tests" / "scripts" / "make_moe_checkpoints.py"
MOE_NAMES = ("qwen3_moe-fused", "mixtral-fused", "olmoe-fused", "qwen3_moe-per-expert", "mixtral-per-expert", "dsmoe")
BUDGET_S = 900  # all launches of one maker together; below pytest-timeout's limit per test (pyproject.toml)


def once(make):
    """Memoise ``make(*args)``, its failure included: a maker that failed is not run again, later callers fail
    with the first failure's reason. Any exception counts (a timeout of pytest-timeout too, which is then
    raised on)."""
    done: dict = {}

    @functools.wraps(make)
    def wrapper(*args):
        if args not in done:
            try:
                done[args] = (True, make(*args))
            except BaseException as exc:  # noqa: BLE001 - remembered, then raised on
                done[args] = (False, f"{make.__name__}{args or ''} failed once in this session, not retried: "
                                     f"{_reason(exc)}")
                raise
        ok, value = done[args]
        if not ok:
            pytest.fail(value, pytrace=False)
        return value

    return wrapper


def shared(name: str):
    """Make ``make(base)`` write into ``<session folder>/<name>`` once for the whole session: the first process to
    ask makes it under a lock, the others wait and take it; a failure is written there too, and every later
    caller fails at once with its reason."""
    def wrap(make):
        @functools.wraps(make)
        def wrapper() -> Path:
            folder = os.environ.get("DSDOCTOR_TEST_SHARED_DIR")
            if not folder:  # the helper used outside pytest
                folder = tempfile.mkdtemp(prefix="dsdoctor-ckpt-")
                atexit.register(shutil.rmtree, folder, True)
            base, failed = Path(folder) / name, Path(folder) / f"{name}.failed"
            with open(Path(folder) / f"{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if failed.exists():
                    pytest.fail(failed.read_text(), pytrace=False)
                if not (base / "complete").exists():
                    shutil.rmtree(base, ignore_errors=True)  # a process that died while making them
                    base.mkdir(parents=True)
                    try:
                        make(base)
                    except BaseException as exc:  # noqa: BLE001 - kept for the other workers, then raised on
                        failed.write_text(f"{name} failed once in this session, not retried: {_reason(exc)}")
                        raise
                    (base / "complete").write_text("")
            return base
        return wrapper
    return wrap


def _reason(exc: BaseException) -> str:
    if isinstance(exc, subprocess.TimeoutExpired):
        tail = (exc.output or b"")[-2000:], (exc.stderr or b"")[-2000:]
        tail = [t.decode(errors="replace") if isinstance(t, bytes) else t for t in tail]
        return f"timed out after {exc.timeout:.0f} s: {exc.cmd}\n{tail[0]}\n{tail[1]}"
    return f"{type(exc).__name__}: {exc}"


@once
@shared("zero-checkpoints")
def zero_checkpoints(base: Path) -> None:
    """base/w2/{zero3,zero2,zero1,model}, base/w3/{zero3,model}: a tiny tied Llama with odd sizes and a frozen MLP."""
    deadline = time.monotonic() + BUDGET_S
    for world, stages in ((2, ("3", "2", "1")), (3, ("3",))):
        res = _launch(MAKER, str(base / f"w{world}"), *stages, nprocs=world, deadline=deadline)
        assert "MAKE_ZERO_CHECKPOINTS_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@once
@shared("autotp-checkpoints")
def autotp_checkpoints(base: Path) -> None:
    """base/{zero3,zero3-frozen,zero1,model}: AutoTP (tensor_parallel.autotp_size 2) + ZeRO on 4 ranks (2 x 2)."""
    res = _launch(AUTOTP_MAKER, str(base), "zero3", "zero3-frozen", "zero1", nprocs=4,
                  deadline=time.monotonic() + BUDGET_S)
    assert "MAKE_AUTOTP_CHECKPOINTS_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@once
@shared("lora-checkpoint")
def lora_checkpoint(base: Path) -> None:
    """base/{base,ckpt,expected_adapter.safetensors,in_memory.json}: a PEFT LoRA model trained under ZeRO-3;
    base/dora/ and base/embedding/ the same for DoRA (+ modules_to_save) and LoRA on the embedding (one launch)."""
    res = _launch(LORA_MAKER, str(base), "lora", "dora", "embedding", nprocs=2, deadline=time.monotonic() + BUDGET_S)
    assert "MAKE_LORA_CHECKPOINT_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@once
@shared("moe-checkpoints")
def moe_checkpoints(base: Path) -> None:
    """base/<family>-<layout>/{ckpt,model} for each of MOE_NAMES but the last: tiny Qwen3-MoE, Mixtral and OLMoE
    trained under ZeRO-3 on 2 ranks, with transformers 5's fused experts and 4.x's per-expert modules
    (tests/scripts/moe_models.py); base/dsmoe/ckpt: a DeepSpeed-MoE layer (expert files per rank) under ZeRO-2."""
    res = _launch(MOE_MAKER, str(base), *MOE_NAMES, nprocs=2, deadline=time.monotonic() + BUDGET_S)
    assert "MAKE_MOE_CHECKPOINTS_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@once
def universal(ckpt: Path) -> Path:
    """A copy of checkpoint folder ``ckpt`` to which DeepSpeed's own ds_to_universal added <tag>_universal and
    ``latest_universal`` (once per session; the shared checkpoint is left as it is)."""
    base = Path(tempfile.mkdtemp(prefix="dsdoctor-universal-"))
    atexit.register(shutil.rmtree, base, True)
    root = copy_checkpoint(ckpt, base / ckpt.name)
    tag_dir = root / (root / "latest").read_text().strip()
    out = tag_dir.parent / f"{tag_dir.name}_universal"
    res = run_process([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir,
                       "--output_folder", out, "--num_extract_workers", "1", "--num_merge_workers", "1",
                       "--inject_missing_state"], env=deepspeed_env(), timeout=300)
    assert res.returncode == 0 and (out / "zero").is_dir(), res.stdout[-3000:] + res.stderr[-3000:]
    return root


def _launch(script: Path, *args: str, nprocs: int, deadline: float) -> subprocess.CompletedProcess:
    """helpers.deepspeed_launch with a retry: a free port can still be taken between the check and the bind. The
    launches end by ``deadline`` (time.monotonic) or raise subprocess.TimeoutExpired."""
    for _ in range(3):
        res = deepspeed_launch(script, *args, nprocs=nprocs, timeout=max(1.0, deadline - time.monotonic()))
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
