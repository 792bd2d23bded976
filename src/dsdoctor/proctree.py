"""Ending a launched run completely: the launcher and every process it started, including ranks that
torchrun or DeepSpeed's launcher put in sessions of their own (a process-group kill does not reach those),
and the shared memory DeepSpeed's CPU ranks leave behind."""
from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import time


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children[ppid].append(int(entry))
    return children


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants, parents first."""
    children = _children_map()
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def terminate_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM ``proc`` and every descendant, wait up to ``grace_s`` for all of them, then SIGKILL the rest."""
    tree = process_tree(proc.pid)
    signal_all(tree, signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(alive(p) for p in tree):
        time.sleep(0.1)
    tree = list(dict.fromkeys(tree + process_tree(proc.pid)))
    signal_all([p for p in tree if alive(p)], signal.SIGKILL)
    deadline = time.time() + 5
    while time.time() < deadline and any(alive(p) for p in tree):
        time.sleep(0.05)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


# DeepSpeed's CPU accelerator maps one 66 MB all-reduce workspace per rank in /dev/shm and never unlinks it
# (ops/csrc/cpu/comm/shm.cpp). The name carries the master port, so every CPU launch leaks 66 MB of
# RAM-backed tmpfs per rank until the machine reboots.
SHM_DIR = "/dev/shm"


def deepspeed_shm_files() -> set[str]:
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_"
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(prefix)}
    except OSError:
        return set()


def _mapped(names: set[str]) -> set[str]:
    """Which of ``names`` some live process still maps (they are in use: never unlink those)."""
    found: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if SHM_DIR in line:
                        name = line.rstrip("\n").rsplit("/", 1)[-1]
                        if name in names:
                            found.add(name)
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found


def leaked_deepspeed_shm(names: set[str] | None = None) -> dict[str, int]:
    """DeepSpeed CPU workspaces (all of this user's, or ``names``) that no live process maps: name -> bytes."""
    candidates = deepspeed_shm_files() if names is None else names & deepspeed_shm_files()
    if not candidates:
        return {}
    out = {}
    for name in candidates - _mapped(candidates):
        try:
            out[name] = os.stat(os.path.join(SHM_DIR, name)).st_size
        except OSError:
            pass
    return out


def unlink_leaked_deepspeed_shm(names: set[str] | None = None) -> int:
    """Unlink DeepSpeed CPU workspaces (all of this user's, or ``names``) that no live process maps;
    return the bytes freed."""
    freed = 0
    for name, size in leaked_deepspeed_shm(names).items():
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            freed += size
        except OSError:
            pass
    return freed


@contextlib.contextmanager
def no_leaked_deepspeed_shm():
    """Around a launch: afterwards, unlink the DeepSpeed CPU workspaces it created and left unmapped."""
    before = deepspeed_shm_files()
    try:
        yield
    finally:
        unlink_leaked_deepspeed_shm(deepspeed_shm_files() - before)
