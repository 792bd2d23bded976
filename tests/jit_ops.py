"""DeepSpeed's CPU ranks JIT-compile one C++ op (deepspeed_shm_comm) when they start; the suite builds it once.

Every CPU rank calls ``build_shm_op()`` in ``deepspeed.comm``: torch's ``cpp_extension.load`` takes a lock file
in the build folder, runs ninja (a real compile, about a minute on 2 cores, when nothing is built yet) and lets
go. Two things made the suite hang on a fresh machine:

- a rank killed while it holds that lock (tests kill ranks on purpose: timeouts, signals, OOM stand-ins)
  leaves the lock behind, and every later rank waits for it forever;
- the default folder (~/.cache/torch_extensions) is shared by every virtual environment of the machine, and
  each one's include paths differ, so two checkouts rebuild it in turn.

So the session gets a folder of its own virtual environment (TORCH_EXTENSIONS_DIR, inherited by every process
the tests start), builds the op there once before any test runs (:func:`prepare`), and before each test that
starts processes removes a lock that no build can still hold (:func:`clear_stale_lock`): after the build, a
rank holds it only while ninja finds nothing to do.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

EXT_DIR = Path(sys.prefix) / "torch_extensions"
OP_DIR_NAME = "deepspeed_shm_comm"
BUILD_TIMEOUT_S = 900
STALE_LOCK_S = 60  # a no-op ninja run never holds the lock this long
_BUILD = (
    "from deepspeed.accelerator import get_accelerator\n"
    "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
    "b is None or b.load(verbose=False)\n"
)
BUILT_ENV = "DSDOCTOR_TEST_SHM_OP_BUILT"  # set by the controller, read by the xdist workers it starts
STATE = {"why": ""}  # why the session could not build the op (the terminal summary says it)


def _locks() -> list[Path]:
    return list(EXT_DIR.glob("*/*/lock")) + list(EXT_DIR.glob("*/lock"))


def clear_stale_lock(older_than_s: float = STALE_LOCK_S) -> list[Path]:
    """Remove build locks left by killed ranks (only once the op is built: then no build can hold one)."""
    if os.environ.get(BUILT_ENV) != "1":
        return []
    removed, now = [], time.time()
    for lock in _locks():
        try:
            if now - lock.stat().st_mtime > older_than_s:
                lock.unlink()
                removed.append(lock)
        except OSError:
            continue
    return removed


def use_own_folder() -> None:
    os.environ["TORCH_EXTENSIONS_DIR"] = str(EXT_DIR)


def prepare(build: bool = True) -> None:
    """Build the op once for the session (in the controller, before any test or xdist worker starts)."""
    use_own_folder()
    if not build:
        return
    try:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            STATE["why"] = "deepspeed is not installed"
            return
    except (ImportError, ValueError):
        STATE["why"] = "deepspeed is not importable"
        return
    EXT_DIR.mkdir(parents=True, exist_ok=True)
    # no test has started yet: a lock here is a killed earlier session's (a concurrent session of this same
    # virtual environment would be building it right now: give that one the build's time first)
    for lock in _locks():
        try:
            if time.time() - lock.stat().st_mtime > BUILD_TIMEOUT_S:
                lock.unlink()
        except OSError:
            continue
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    try:
        res = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        STATE["why"] = f"building DeepSpeed's shm op took over {BUILD_TIMEOUT_S} s"
        return
    if res.returncode != 0:
        STATE["why"] = "building DeepSpeed's shm op failed: " + (res.stderr or res.stdout)[-2000:]
        return
    os.environ[BUILT_ENV] = "1"
