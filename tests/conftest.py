import importlib.util
import os
from pathlib import Path

import pytest

SHM = Path("/dev/shm")
# DeepSpeed's CPU accelerator maps one 66 MB all-reduce workspace per rank here and never unlinks it
# (ops/csrc/cpu/comm/shm.cpp: shared_close is not called at exit). The name carries the master port, and
# every launch uses a fresh port, so each launch leaks 2 x 66 MB of RAM-backed tmpfs: a few suite runs
# fill the machine's memory and everything after that thrashes (this is what once ran CI past its limit).
DS_SHM_PREFIX = f"deepspeed_allreduce_buffer_{os.getuid()}_"


def _mapped_shm_names() -> set[str]:
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        names.update(line.rsplit("/", 1)[-1] for line in text.splitlines() if "/dev/shm/" + DS_SHM_PREFIX in line)
    return names


def unlink_leaked_deepspeed_shm() -> int:
    """Unlink DeepSpeed CPU all-reduce workspaces that no live process maps; return the bytes freed."""
    try:
        files = [p for p in SHM.iterdir() if p.name.startswith(DS_SHM_PREFIX)]
    except OSError:
        return 0
    if not files:
        return 0
    in_use = _mapped_shm_names()
    freed = 0
    for path in files:
        if path.name in in_use:
            continue
        try:
            size = path.stat().st_size
            path.unlink()
            freed += size
        except OSError:
            pass
    return freed


@pytest.fixture(autouse=True, scope="session")
def _no_leaked_deepspeed_shm_at_start_or_end():
    unlink_leaked_deepspeed_shm()
    yield
    unlink_leaked_deepspeed_shm()


@pytest.fixture(autouse=True)
def _no_leaked_deepspeed_shm_after_each_test():
    yield
    unlink_leaked_deepspeed_shm()


def pytest_collection_modifyitems(config, items):
    have_cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        have_cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not have_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
