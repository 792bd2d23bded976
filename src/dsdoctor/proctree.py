"""Ending a launched run completely: the launcher and every process it started, including ranks that
torchrun or DeepSpeed's launcher put in sessions of their own (a process-group kill does not reach those),
processes that double-forked away from the tree, and the shared memory DeepSpeed's CPU ranks leave behind.

``contained_run`` is the one way a command launches: for its duration dsdoctor is a child subreaper
(``PR_SET_CHILD_SUBREAPER``: an orphaned descendant is re-parented to dsdoctor, not to init), every process
of the run carries a tag in its environment, SIGTERM/SIGHUP/SIGQUIT end dsdoctor the way Ctrl-C does, and on
any exit every process of the run is ended and reaped.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

from dsdoctor import door


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        raw = door.read_proc(f"/proc/{entry}/stat", 1 << 16)
        try:
            ppid = int((raw or b"").decode(errors="replace").rsplit(")", 1)[1].split()[1])
        except (ValueError, IndexError):
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
        return (door.read_proc(f"/proc/{pid}/stat", 1 << 16) or b"").rsplit(b")", 1)[1].split()[0] != b"Z"
    except IndexError:
        return False


def tree_cpu_seconds(root: int) -> float | None:
    """CPU seconds ``root`` and its live descendants have used, reaped children included (utime + stime +
    cutime + cstime of /proc/PID/stat): a rank that compiles in a child process still shows its work. None
    when ``root`` has ended or cannot be read."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total, found = 0, False
    for pid in process_tree(root):
        raw = door.read_proc(f"/proc/{pid}/stat", 1 << 16)
        try:
            fields = (raw or b"").rsplit(b")", 1)[1].split()
            total += sum(int(fields[i]) for i in (11, 12, 13, 14))  # fields 14-17 of stat(5)
            found = found or pid == root
        except (IndexError, ValueError):
            continue
    return total / ticks if found else None


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
SHM_DIR = os.environ.get("DSDOCTOR_SHM_DIR") or "/dev/shm"  # another directory only for tests


def deepspeed_shm_prefix() -> str:
    return f"deepspeed_allreduce_buffer_{os.getuid()}_"


def deepspeed_shm_files(port: int | str | None = None) -> set[str]:
    """This user's DeepSpeed CPU workspaces; with ``port``, only those of the launch that used that master
    port (the name is ``deepspeed_allreduce_buffer_UID_ADDR_PORT_RANK``)."""
    prefix = deepspeed_shm_prefix()
    try:
        names = {name for name in os.listdir(SHM_DIR) if name.startswith(prefix)}
    except OSError:
        return set()
    if port is not None:
        names = {n for n in names if n.rsplit("_", 2)[-2:-1] == [str(port)]}
    return names


def _mapped(names: set[str]) -> set[str]:
    """Which of ``names`` some live process still maps (they are in use: never unlink those)."""
    found: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        for line in door.proc_lines(f"/proc/{entry}/maps"):  # nothing when it ended or is not ours to read
            if SHM_DIR in line:
                name = line.rstrip("\n").rsplit("/", 1)[-1]
                if name in names:
                    found.add(name)
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
        if door.remove_shm_file(SHM_DIR, name):
            freed += size
    return freed


@contextlib.contextmanager
def no_leaked_deepspeed_shm():
    """Around a launch: afterwards, unlink the DeepSpeed CPU workspaces it created and left unmapped."""
    before = deepspeed_shm_files()
    try:
        yield
    finally:
        unlink_leaked_deepspeed_shm(deepspeed_shm_files() - before)


# --------------------------------------------------------------------------- containing a whole run

RUN_TAG_VAR = "DSDOCTOR_RUN_TAG"  # in the environment of every process of a contained run
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _prctl(option: int, arg: int) -> int | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)
    except (OSError, AttributeError):
        return None


def _is_subreaper() -> bool:
    value = ctypes.c_int(0)
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return bool(value.value)


def tagged(tag: str) -> list[int]:
    """Processes (other than this one) whose environment carries ``RUN_TAG_VAR=tag``: every process of a
    contained run, wherever it was re-parented, unless it cleared its environment."""
    needle = f"{RUN_TAG_VAR}={tag}".encode()
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        environ = door.read_proc(f"/proc/{entry}/environ")  # None: ended meanwhile, or another user's
        if environ and needle in environ.split(b"\0"):
            out.append(int(entry))
    return out


class _Stop(KeyboardInterrupt):
    """SIGTERM, SIGHUP or SIGQUIT during a contained run: unwinds like Ctrl-C, so the run is ended."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")  # as dsdoctor.door.Interrupted
        self.signum = signum


def _raise_stop(signum, frame):
    raise _Stop(signum)


_ACTIVE: list[ContainedRun] = []  # the runs now open in this process (their roots are never another run's orphans)
_ACTIVE_LOCK = threading.Lock()


class ContainedRun:
    """See ``contained_run``. ``env(base)`` is the environment to launch with; ``adopt(proc)`` names the
    launched root (its tree is ended first, parents before children)."""

    STOP_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT")

    def __init__(self):
        self.tag = uuid.uuid4().hex
        self.roots: list[subprocess.Popen] = []
        self._previous_handlers: dict[int, object] = {}
        self._was_subreaper = False
        self._shm_before: set[str] = set()
        self._known: set[int] = set()  # every pid seen as a member (a zombie no longer shows its tag)
        self._children_before: set[int] = set()  # this process's children when the run began: not the run's

    def _orphans(self, children: dict[int, list[int]]) -> list[int]:
        """Children of this process that it did not start itself: while it is the child subreaper, those are
        processes of the run re-parented to it (a double-forked daemon that cleared its environment too).
        Children it had before the run and the roots of other open runs are not the run's."""
        with _ACTIVE_LOCK:
            others = {p.pid for run in _ACTIVE if run is not self for p in run.roots}
            others |= {pid for run in _ACTIVE if run is not self for pid in run._known}
        mine = {p.pid for p in self.roots}
        return [c for c in children.get(os.getpid(), [])
                if c not in mine and c not in others and c not in self._children_before]

    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        env[RUN_TAG_VAR] = self.tag
        return env

    def adopt(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.roots.append(proc)
        return proc

    def members(self) -> list[int]:
        """Every live process of the run: the roots' trees, tagged processes, and their trees."""
        children = _children_map()
        seeds = [p.pid for p in self.roots] + tagged(self.tag)
        me = os.getpid()
        if _is_subreaper():  # orphans of the run were re-parented to us, tagged or not
            seeds += [c for c in self._orphans(children) if c not in seeds]
        out, todo = [], list(dict.fromkeys(seeds))
        seen = set()
        while todo:
            pid = todo.pop(0)
            if pid in seen or pid == me:
                continue
            seen.add(pid)
            out.append(pid)
            todo.extend(children.get(pid, []))
        self._known.update(out)
        return [p for p in out if alive(p)]

    def end_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process of the run, SIGKILL what is left after ``grace_s``, reap the orphans."""
        members = self.members()
        if members:
            signal_all(members, signal.SIGTERM)
            deadline = time.time() + grace_s
            while time.time() < deadline and any(alive(p) for p in members):
                time.sleep(0.05)
                self._reap()
            for _ in range(3):  # a process may fork while it is being ended
                rest = [p for p in dict.fromkeys(members + self.members()) if alive(p)]
                if not rest:
                    break
                signal_all(rest, signal.SIGKILL)
                deadline = time.time() + 5
                while time.time() < deadline and any(alive(p) for p in rest):
                    time.sleep(0.05)
                    self._reap()
                members = rest
        for proc in self.roots:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._reap()

    def _reap(self) -> None:
        """Collect the exit status of orphans re-parented to us (never of a Popen we manage)."""
        for pid in self._orphans(_children_map()):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            except OSError as exc:
                if exc.errno != errno.ECHILD:
                    raise

    def __enter__(self):
        self._shm_before = deepspeed_shm_files()
        self._children_before = set(_children_map().get(os.getpid(), []))
        with _ACTIVE_LOCK:
            _ACTIVE.append(self)
        self._was_subreaper = _is_subreaper()
        if not self._was_subreaper:
            _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        if threading.current_thread() is threading.main_thread():
            for name in self.STOP_SIGNALS:
                sig = getattr(signal, name, None)
                if sig is None:
                    continue
                try:
                    self._previous_handlers[sig] = signal.signal(sig, _raise_stop)
                except (ValueError, OSError):
                    pass
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self.end_all(grace_s=2.0 if exc_type is not None else 5.0)
        finally:
            for sig, handler in self._previous_handlers.items():
                try:
                    signal.signal(sig, handler)
                except (ValueError, OSError, TypeError):
                    pass
            if not self._was_subreaper:
                _prctl(_PR_SET_CHILD_SUBREAPER, 0)
                self._reap()
            with _ACTIVE_LOCK:
                if self in _ACTIVE:
                    _ACTIVE.remove(self)
            unlink_leaked_deepspeed_shm(deepspeed_shm_files() - self._shm_before)
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a launched run's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def contained_run() -> ContainedRun:
    """Context for launching a run whose every descendant must end with it::

        with contained_run() as run:
            proc = run.adopt(subprocess.Popen(cmd, env=run.env(env), start_new_session=True))
            proc.wait(timeout)

    On leaving (normally, on an exception, on Ctrl-C, SIGTERM, SIGHUP or SIGQUIT, which raise
    KeyboardInterrupt inside the block) every process of the run is ended and reaped, and the DeepSpeed
    CPU workspaces that appeared meanwhile and that no live process maps are unlinked."""
    return ContainedRun()
