"""Run the user's command with the observer on PYTHONPATH, tee its output, and end it on a timeout.

The watchdog first watches every local rank for a few seconds: its CPU time and two Python stacks (SIGUSR1;
the observer dumps them next to its record), so a slow run is told from a stuck one. Then it sends SIGTERM to
the whole process tree (the DeepSpeed runner forwards that to remote nodes through its kill command), and
SIGKILL to whatever is left. The tree is found through /proc parent links, because torchrun starts each rank in
a session of its own where a process-group kill does not reach.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsdoctor import door
from dsdoctor.errors import InputError
from dsdoctor.proctree import contained_run, process_tree, terminate_tree
from dsdoctor.trace.ending import memory_limit, oom_kill_counter, watch_progress
from dsdoctor.trace.observer import recorder

OBSERVER_DIR = Path(__file__).resolve().parent / "observer"
SRC_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the dsdoctor package


@dataclass
class RunOutcome:
    returncode: int | None
    timed_out: bool
    wall_s: float
    output_tail: str
    log_path: str | None
    pid: int | None = None  # the command's own process
    oom_before: dict | None = None  # the memory cgroup's oom_kill counter before and after (trace/ending.py)
    oom_after: dict | None = None
    limit: dict | None = None  # the host memory the run may use
    progress: dict = field(default_factory=dict)  # at the timeout: pid -> CPU time and stack movement


def observed_env(trace_dir: Path, variant: str | None = None, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env[recorder.ENV_DIR] = str(trace_dir)
    if variant:
        env[recorder.ENV_VARIANT] = json.dumps({"name": variant})
    else:
        env.pop(recorder.ENV_VARIANT, None)
    paths = [str(OBSERVER_DIR), str(SRC_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def end_tree(proc: subprocess.Popen, trace_dir: Path | None, grace_s: float = 5.0) -> dict:
    """Stack dumps of the observed ranks, then SIGTERM, then SIGKILL, to ``proc`` and every descendant.

    With ``trace_dir`` (the watchdog's timeout) the ranks are watched for a few seconds first: CPU time and two
    stack dumps (trace/ending.py), so that a slow run is not called a hang. Returns that evidence by pid."""
    tree = process_tree(proc.pid)
    progress = {}
    if trace_dir is not None:
        ranks = sorted(set(_record_pids(trace_dir)) & set(tree))
        if ranks:
            progress = watch_progress(ranks, trace_dir)
    terminate_tree(proc, grace_s)
    return progress


def _record_pids(trace_dir: Path) -> list[int]:
    pids = []
    for path in Path(trace_dir).glob("rank-*.jsonl"):
        try:
            pids.append(int(path.name.rsplit(".", 2)[-2]))
        except (ValueError, IndexError):
            pass
    return pids


def run_command(command: list[str], trace_dir: Path, variant: str | None = None, timeout: float | None = None,
                log_path: Path | None = None, echo=None) -> RunOutcome:
    """Run ``command`` observed; its output goes to ``echo`` (stderr by default) and ``log_path``."""
    if not command:
        raise InputError("no command given", hint="put the command after --, e.g. dsdoctor trace -- python infer.py")
    return _run_observed(command, trace_dir, variant, timeout, log_path, echo)


TAIL_LINE_CAP = 16 * 1024  # characters of one output line kept in memory for the report; the log gets all


def _pump(fd: int, tail: collections.deque, log, echo, chunk: int = 1 << 16) -> None:
    """Copy the command's output to ``log`` and ``echo`` as it comes, a bounded chunk at a time, and keep its
    last lines in ``tail``, each cut to ``TAIL_LINE_CAP`` characters: a program that prints gigabytes
    without a newline costs a chunk of memory, not gigabytes (``readline`` would hold the whole line)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    partial, cut = "", 0  # the line being read (its first TAIL_LINE_CAP characters) and how many were cut
    while True:
        try:
            raw = os.read(fd, chunk)
        except OSError:
            raw = b""
        text = decoder.decode(raw, final=not raw)
        if text:
            try:  # the log and echo may be closed under us when the run is interrupted
                if log:
                    log.write(text)
                if echo is not False:
                    echo.write(text)
                    echo.flush()
            except (OSError, ValueError):
                pass
            *done, rest = text.split("\n")
            for piece in done:
                tail.append(_capped(partial + piece, cut) + "\n")
                partial, cut = "", 0
            room = TAIL_LINE_CAP - len(partial)
            partial, cut = partial + rest[:room], cut + max(len(rest) - room, 0)
        if not raw:
            if partial or cut:
                tail.append(_capped(partial, cut))
            return


def _capped(line: str, cut: int) -> str:
    cut += max(len(line) - TAIL_LINE_CAP, 0)
    return line[:TAIL_LINE_CAP] + (f" [... {cut} more characters]" if cut else "")


def _run_observed(command, trace_dir: Path, variant, timeout, log_path, echo) -> RunOutcome:
    door.make_dir(trace_dir)
    echo = sys.stderr if echo is None else echo
    tail: collections.deque[str] = collections.deque(maxlen=200)
    log = door.open_new(log_path) if log_path else None
    start = time.time()
    oom_before, limit, progress = oom_kill_counter(), memory_limit(), {}
    run = contained_run()  # every process of the run ends with it, double-forked ones included
    with run:
        try:
            proc = run.adopt(subprocess.Popen(
                command, env=run.env(observed_env(trace_dir, variant)), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
        except FileNotFoundError:
            raise InputError(f"command not found: {command[0]}") from None
        except PermissionError:
            raise InputError(f"command is not executable: {command[0]}") from None

        def pump():
            _pump(proc.stdout.fileno(), tail, log, echo)

        reader = threading.Thread(target=pump, name="dsdoctor-output", daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            if echo is not False:
                echo.write(f"dsdoctor: no end after {timeout:g}s; dumping rank stacks and ending every process\n")
            progress = end_tree(proc, trace_dir)
        except BaseException:  # Ctrl-C, SIGTERM, SIGHUP: leave no rank behind
            end_tree(proc, None, grace_s=2.0)
            if log:
                log.close()
            raise
    # leaving ``run`` ended whatever the command left running (a daemonized child keeps the pipe open)
    reader.join(timeout=5)
    if log:
        log.close()
    return RunOutcome(proc.returncode, timed_out, time.time() - start, "".join(tail),
                      str(log_path) if log_path else None, pid=proc.pid, oom_before=oom_before,
                      oom_after=oom_kill_counter(), limit=limit, progress=progress)
