"""Files nobody keeps or that belong to dsdoctor alone: scratch folders, calibrate's probe file, the machine
profile cache, the records the user's ranks write into a folder the parent dsdoctor created, and odds and
ends of the process (stdout onto /dev/null, a leaked shared-memory file)."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path

from dsdoctor.door.read import file_kind
from dsdoctor.door.signals import GUARD
from dsdoctor.door.write import absolute, make_dir, write_via_temp
from dsdoctor.errors import InputError, printable

# ---- scratch, probes, the cache ----------------------------------------------------------------------------------

@contextlib.contextmanager
def scratch_dir(prefix: str):
    """A new private folder (0700) for work nobody keeps; removed at the end, on an error and on a signal."""
    with GUARD.active():
        path = None
        try:
            with GUARD.deferred():
                path = Path(tempfile.mkdtemp(prefix=prefix))
            yield path
        finally:
            if path is not None:
                with GUARD.deferred(raise_pending=False):
                    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def probe_file(directory, prefix: str):
    """A new private file in the user's ``directory`` (0600), as (descriptor, path); removed at the end, on an
    error and on a signal (a 512 MiB bandwidth probe must not stay on the user's drive).

    While it exists a lock on it says its run is alive. SIGKILL (or a power cut) cannot be handled: the next
    probe in the same folder finds the ones whose lock is free (their run died), removes them and says so."""
    with GUARD.active():
        made = lock = None
        try:
            with GUARD.deferred():
                _remove_dead_probes(directory, prefix)
                made = tempfile.mkstemp(prefix=prefix, dir=directory)
                lock = os.open(made[1], os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            yield made
        finally:
            if made is not None:
                with GUARD.deferred(raise_pending=False), contextlib.suppress(OSError):
                    os.unlink(made[1])
            if lock is not None:
                os.close(lock)


def _remove_dead_probes(directory, prefix: str) -> None:
    """Remove this user's probe files (``prefix*``, regular, 0600) that no live run holds locked."""
    import sys

    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a live run's probe
                continue
            os.unlink(entry.path)
            print(f"dsdoctor: note: removed {printable(entry.path)} ({st.st_size} bytes), a probe file left by a "
                  "killed dsdoctor calibrate", file=sys.stderr)
        except OSError:
            pass
        finally:
            os.close(fd)


def check_cache_file(path) -> Path:
    """Raise InputError unless ``path`` may be (re)written as dsdoctor's cache file: missing, or a regular
    file; never a link, a folder or a device."""
    p = absolute(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return p
    except OSError as exc:
        raise InputError(f"cannot check the cache file: {exc.strerror}", path=p) from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"is {file_kind(st.st_mode)}, not dsdoctor's cache file; not replacing it", path=p,
                         hint="remove it, or set DSDOCTOR_CACHE_DIR to another folder")
    return p


def write_cache_file(path, text: str) -> Path:
    """Replace dsdoctor's own cache file ``path`` atomically (a reader never sees half of it): a regular
    file or nothing is replaced (``check_cache_file``)."""
    p = check_cache_file(path)
    parent = make_dir(p.parent, "the cache folder")
    with GUARD.active():
        write_via_temp(p, parent, text, os.replace)
    return p


# ---- records the user's ranks write into a folder the parent created ------------------------------------------

def record_file(path, mode: str = "a"):
    """A text file a rank appends its records to (``mode`` "a") or rewrites ("w"), in a folder the parent
    dsdoctor created (made here if it is missing); never through a link. Light: no signal handlers, no lock
    (the user's program owns its signals)."""
    p = Path(path)
    os.makedirs(p.parent, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    fd = os.open(p, flags, 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(p))
    return os.fdopen(fd, mode, encoding="utf-8")


def write_record(path, text: str) -> Path:
    """Write a whole record (a rank's result) atomically: a temporary sibling renamed over ``path``."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        with record_file(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p


# ---- odds and ends of the process ----------------------------------------------------------------------------

def devnull_onto(fd: int) -> None:
    """Point descriptor ``fd`` at /dev/null (stdout after it failed: Python flushes it again at exit)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass


def remove_shm_file(shm_dir: str, name: str) -> bool:
    """Unlink a shared-memory file another process left (the caller checked nothing maps it)."""
    if "/" in name or name in (".", ".."):
        return False
    try:
        os.unlink(os.path.join(shm_dir, name))
    except OSError:
        return False
    return True
