"""Reading untrusted inputs and writing outputs safely, in one place for every command.

Outputs (``atomic_output_dir`` for folders, ``atomic_write_text`` for files):
- go to a new path, or replace (with ``force``) only what dsdoctor itself wrote: a folder holding the
  ``.dsdoctor-output`` marker, or a regular file; never a device, FIFO, socket or symbolic link, never ``/``,
  the home or working directory (or a folder above them), never an input of the command or a folder holding one;
- are built in a hidden sibling (``.NAME.XXXXXXXX.partial``) and renamed into place, so an interrupted run
  never leaves a ``NAME`` that looks complete; SIGINT, SIGTERM, SIGHUP and SIGQUIT remove the sibling as an
  error does, and the sibling a killed run left is named on the next run into the same path;
- are locked: a second dsdoctor writing the same path at the same time stops with exit 2 naming the first;
- follow the umask (``tempfile`` would make them 0700/0600 whatever it says).

Inputs (``open_regular``, ``read_regular_bytes``): regular files only, checked on the open descriptor, so a
FIFO cannot block and ``/dev/zero`` cannot fill memory.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path

from dsdoctor.errors import InputError

MARKER = ".dsdoctor-output"  # written into every output folder (and its hidden partial sibling)
LOCK_SUFFIX = ".dsdoctor-lock"
SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n))
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text) -> str:
    """``text`` with control characters (newlines, escape sequences, NUL...) escaped, for a one-line message."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


# ---- inputs -------------------------------------------------------------------------------------------------

def _kind(mode: int) -> str | None:
    """What a non-regular, non-directory file is, in words (None for regular files and directories)."""
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return None


def open_regular(path, what: str = "file") -> int:
    """A read-only descriptor of ``path`` (symbolic links followed), refused unless it is a regular file.

    Opened non-blocking so that a FIFO returns at once instead of waiting for a writer; the check is made on
    the descriptor itself, so the file cannot be swapped between the check and the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError(f"{what} not found", path=path) from None
    except PermissionError:
        raise InputError(f"{what} is not readable (permission denied)", path=path) from None
    except OSError as exc:
        raise InputError(f"cannot open the {what}: {exc.strerror}", path=path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else _kind(st.st_mode) or "not a regular file"
        raise InputError(f"the {what} is {kind}, not a regular file; refusing to read it", path=path)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def read_regular_bytes(path, limit: int, what: str = "file") -> bytes:
    """The bytes of a regular file no larger than ``limit`` (refused before reading when it is larger)."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise InputError(f"the {what} is {size} bytes, more than any real {what} ({limit} at most); "
                             "refusing to read it", path=path)
        chunks, left = [], size
        while left > 0:
            data = os.read(fd, left)
            if not data:
                break
            chunks.append(data)
            left -= len(data)
        return b"".join(chunks)
    finally:
        os.close(fd)


# ---- output paths -------------------------------------------------------------------------------------------

def umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


_UMASK_LOCK = threading.Lock()


def _abs(path) -> Path:
    return Path(os.path.abspath(os.fspath(path)))


def _resolved(path) -> Path | None:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):
        return None


def _is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _protected() -> list[tuple[Path, str]]:
    places = [(Path("/"), "the root folder")]
    for getter, name in ((Path.home, "your home folder"), (Path.cwd, "the working directory")):
        try:
            places.append((getter().resolve(), name))
        except (OSError, RuntimeError, KeyError):
            pass
    return places


def check_output_path(path, force: bool, inputs=(), kind: str = "dir") -> Path:
    """Raise InputError unless ``path`` may be written: a new path, or with ``force`` one dsdoctor may replace.

    ``kind`` is "dir" (replace only a folder holding dsdoctor's marker) or "file" (replace only a regular file).
    ``inputs``: paths the command reads; the output may be none of them and hold none of them."""
    p = _abs(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise InputError(f"cannot check the output path: {exc.strerror}", path=p) from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        target = printable(os.readlink(p))
        raise InputError(f"is a symbolic link (to {target}); dsdoctor writes to a new path or replaces its own "
                         "output, never through a link", path=p, hint="give the real path, or another one")
    if st is not None and _kind(st.st_mode):
        raise InputError(f"is {_kind(st.st_mode)}; dsdoctor writes only new paths or regular files and "
                         "folders, even with --force", path=p)
    real = _resolved(p) or p
    for inp in inputs:
        if inp is None:
            continue
        r = _resolved(inp)
        if r is None:
            continue
        if r == real:
            raise InputError("is an input of this command; write the output somewhere else", path=p)
        if real in r.parents:
            raise InputError(f"holds an input of this command ({printable(inp)}); write the output somewhere else",
                             path=p)
    if st is None:
        return p
    if not force:
        raise InputError("already exists; not overwriting", path=p, hint="pass --force to replace it")
    for place, name in _protected():
        if _is_within(place, real):
            raise InputError(f"is {name}" if place == real else f"holds {name} ({place})", path=p,
                             hint="--force replaces a folder dsdoctor wrote; give a new path")
    if kind == "dir":
        if not stat.S_ISDIR(st.st_mode):
            raise InputError("is a file, not a folder dsdoctor wrote; not replacing it", path=p,
                             hint="give a new path, or move the file yourself")
        if not _has_marker(p):
            raise InputError(f"was not written by dsdoctor (it has no {MARKER} marker); --force replaces only "
                             "dsdoctor's own output folders", path=p,
                             hint="give a new path, or delete the folder yourself if you are sure")
    elif not stat.S_ISREG(st.st_mode):
        raise InputError("is a folder, expected a file path" if stat.S_ISDIR(st.st_mode) else
                         "is not a regular file; not replacing it", path=p)
    return p


def refuse_overwrite(path, force: bool, inputs=(), kind: str = "dir") -> None:
    """Kept for callers that check early: the same checks as ``check_output_path``."""
    check_output_path(path, force, inputs, kind)


def _has_marker(folder: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(folder / MARKER).st_mode)
    except OSError:
        return False


def _write_marker(folder: Path, target: Path, command: str | None) -> None:
    from dsdoctor._version import __version__

    info = {"written_by": f"dsdoctor {__version__}", "command": command, "output": target.name,
            "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (folder / MARKER).write_text(json.dumps(info) + "\n", encoding="utf-8")


def _parent(target: Path, create: bool) -> Path:
    parent = target.parent
    if parent.exists() and not parent.is_dir():
        raise InputError("the folder to write into is not a folder", path=parent)
    if not parent.exists():
        if not create:
            raise InputError("parent directory does not exist", path=target)
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create the output's folder: {exc.strerror}", path=parent) from None
    return parent


# ---- stale siblings of killed runs --------------------------------------------------------------------------

def stale_siblings(target) -> list[tuple[Path, int]]:
    """Hidden ``.NAME.XXXXXXXX.partial`` / ``.old`` folders dsdoctor left beside ``target`` (with their size).

    Only folders that carry dsdoctor's marker count; they are named, never deleted (the user decides)."""
    t = _abs(target)
    pattern = re.compile(rf"^\.{re.escape(t.name)}\.[a-z0-9_]{{8}}\.(partial|old)$")
    found = []
    try:
        entries = list(os.scandir(t.parent))
    except OSError:
        return []
    for entry in entries:
        m = pattern.match(entry.name)
        if not m or not entry.is_dir(follow_symlinks=False):
            continue
        p = Path(entry.path)
        if _has_marker(p) or (m.group(1) == "old" and _has_marker(p / "x")):
            found.append((p, _tree_size(p)))
    return sorted(found)


def _tree_size(p: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(p):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def note_stale(stale: list[tuple[Path, int]]) -> None:
    from dsdoctor.units import human_bytes

    for p, size in stale:
        print(f"dsdoctor: note: {printable(p)} ({human_bytes(size)}) was left by an interrupted dsdoctor run; "
              f"nothing uses it, delete it with: rm -rf '{printable(p)}'", file=sys.stderr)


# ---- signals -------------------------------------------------------------------------------------------------

class Interrupted(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT) turned into the same cleanup path as Ctrl-C."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


class _SignalGuard:
    """While active, the four signals raise ``Interrupted``; inside ``deferred()`` they wait until its end."""

    def __init__(self):
        self.depth = 0
        self.previous: dict[int, object] = {}
        self.deferring = 0
        self.pending: int | None = None

    def _handler(self, signum, frame):
        if self.deferring:
            self.pending = self.pending or signum
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def active(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        if self.depth == 0:
            self.previous = {}
            for sig in SIGNALS:
                current = signal.getsignal(sig)
                if current is signal.SIG_IGN:  # e.g. SIGHUP under nohup: stay ignored
                    continue
                if sig == signal.SIGINT and current is not signal.default_int_handler:
                    continue  # someone else handles Ctrl-C
                self.previous[sig] = signal.signal(sig, self._handler)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                for sig, prev in self.previous.items():
                    signal.signal(sig, prev)
                self.previous = {}

    @contextlib.contextmanager
    def deferred(self, raise_pending: bool = True):
        """Signals that arrive inside wait until its end (a rename pair or a cleanup is never cut in half)."""
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
        if self.deferring == 0 and self.pending is not None:
            sig, self.pending = self.pending, None
            if raise_pending:
                raise Interrupted(sig)


_SIGNALS = _SignalGuard()


# ---- the lock ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def output_lock(target: Path):
    """An exclusive lock on ``target`` for this process: ``.NAME.dsdoctor-lock`` beside it, holding the pid.

    flock is released by the kernel when a process dies, so a killed run never blocks the next one; the file
    is removed while held, and a lock taken on a file that was meanwhile removed is taken again."""
    lock = target.parent / f".{target.name}{LOCK_SUFFIX}"
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise InputError(f"cannot create the lock file {lock.name} beside the output: {exc.strerror}",
                             path=target.parent) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise InputError("is not a regular file; it is where dsdoctor locks the output", path=lock)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            who = f"pid {holder}" if holder.isdigit() else "another process"
            raise InputError(f"is being written by another dsdoctor ({who}); wait for it to end or write "
                             "elsewhere", path=target) from None
        try:
            now = os.stat(lock, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            os.close(fd)  # the holder removed it between our open and our lock: take the new one
            continue
        break
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


# ---- atomic writers ------------------------------------------------------------------------------------------

def _as_input_error(exc: OSError, target: Path) -> InputError:
    what = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "read-only file system"}.get(exc.errno, exc.strerror or str(exc))
    return InputError(f"cannot write the output: {what}", path=exc.filename or target,
                      hint="nothing was left behind" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else None)


def atomic_write_text(path, text: str, force: bool = False, inputs=()) -> Path:
    """Write ``text`` to ``path`` via a temporary file in the same directory and an atomic rename."""
    p = check_output_path(path, force, inputs, kind="file")
    parent = _parent(p, create=False)
    with _SIGNALS.active(), output_lock(p):
        check_output_path(p, force, inputs, kind="file")  # again, under the lock
        tmp = None
        try:
            with _SIGNALS.deferred():
                fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
                os.fchmod(fd, 0o666 & ~umask())
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            with _SIGNALS.deferred():
                if force:
                    os.replace(tmp, p)
                else:
                    _rename_no_replace(tmp, p)
        except BaseException as exc:
            if tmp is not None:
                with _SIGNALS.deferred(raise_pending=False), contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            if isinstance(exc, OSError):
                raise _as_input_error(exc, p) from None
            raise
    return p


def _rename_no_replace(src, dst: Path) -> None:
    """Rename a file unless ``dst`` exists (a link is atomic where the filesystem has them)."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise InputError("already exists; not overwriting (it appeared while dsdoctor was writing)", path=dst,
                         hint="pass --force to replace it") from None
    except OSError:  # no hard links here: check, then rename
        if os.path.lexists(dst):
            raise InputError("already exists; not overwriting", path=dst, hint="pass --force to replace it") from None
        os.replace(src, dst)
        return
    os.unlink(src)


@contextlib.contextmanager
def atomic_output_dir(path, force: bool = False, inputs=(), command: str | None = None, on_stale=None):
    """Yield a temporary sibling directory; on success it replaces ``path``, on any error or signal it is removed.

    An interrupted run therefore never leaves a ``path`` that looks complete. ``on_stale`` receives the
    partial siblings earlier killed runs left (default: a note on stderr)."""
    target = check_output_path(path, force, inputs, kind="dir")
    parent = _parent(target, create=True)
    with _SIGNALS.active(), output_lock(target):
        check_output_path(target, force, inputs, kind="dir")  # again, under the lock
        stale = stale_siblings(target)
        if stale:
            (on_stale or note_stale)(stale)
        tmp = None
        try:
            with _SIGNALS.deferred():  # a signal here must not leave a folder nobody removes
                tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=parent))
                os.chmod(tmp, 0o777 & ~umask())
                _write_marker(tmp, target, command)
            yield tmp
            with _SIGNALS.deferred():
                if os.path.lexists(target):
                    check_output_path(target, force, inputs, kind="dir")  # appeared meanwhile without --force?
                    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=parent))
                    os.replace(target, old / "x")
                    os.replace(tmp, target)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.rename(tmp, target)
        except BaseException as exc:
            if tmp is not None:
                with _SIGNALS.deferred(raise_pending=False):
                    shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError):
                raise _as_input_error(exc, target) from None
            raise
