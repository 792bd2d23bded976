"""Ending a launched run completely: the launcher and every process it started, including ranks that
torchrun or DeepSpeed's launcher put in sessions of their own (a process-group kill does not reach those)."""
from __future__ import annotations

import collections
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
