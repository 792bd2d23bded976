"""Writing: every output dsdoctor makes, by kind (``door.kinds.OUTPUTS``).

Output folders (``atomic_output_dir``) and output files (``atomic_write_text``):
- go to a new path, or replace (with ``force``) only what dsdoctor itself wrote: a folder holding the
  ``.dsdoctor-output`` marker and nothing a user added there, or a regular file; never a device, FIFO, socket
  or symbolic link, never ``/``, the home or working directory (or a folder above them), never an input of
  the command or a folder holding one;
- are built in a hidden sibling (``.NAME.XXXXXXXX.partial``) and renamed into place, so an interrupted run
  never leaves a ``NAME`` that looks complete; SIGINT, SIGTERM, SIGHUP and SIGQUIT remove the sibling as an
  error does, and the sibling a killed run left is named on the next run into the same path;
- are locked: a second dsdoctor writing the same path at the same time stops with exit 2 naming the first;
- follow the umask (``tempfile`` would make them 0700/0600 whatever it says).

Files inside a folder being built (``write_new``, ``open_new``, ``create_fd``, ``copy_file``) are new files,
never written through a link. The multi-node trace's folders are in ``door.shared``; scratch folders, probe
files, the cache file and the ranks' records in ``door.scratch``.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

from dsdoctor.door.kinds import Kind
from dsdoctor.door.marker import (
    MARKER,
    foreign_entries,
    has_marker,
    marker_info,
    note_stale,
    record_manifest,
    stale_siblings,
    write_marker,
)
from dsdoctor.door.read import file_kind, open_fd, read_proc
from dsdoctor.door.signals import GUARD
from dsdoctor.errors import InputError, printable

LOCK_SUFFIX = ".dsdoctor-lock"
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def umask() -> int:
    status = read_proc("/proc/self/status") or b""
    for line in status.decode("ascii", "replace").splitlines():
        if line.startswith("Umask:"):
            with contextlib.suppress(ValueError, IndexError):
                return int(line.split()[1], 8)
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


_UMASK_LOCK = threading.Lock()


def absolute(path) -> Path:
    return Path(os.path.abspath(os.fspath(path)))


def _resolved(path) -> Path | None:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):
        return None


def _is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def special_kind(mode: int) -> str | None:
    """What a file that is neither a regular file nor a folder is, in words (None for those two)."""
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else file_kind(mode)


def _protected() -> list[tuple[Path, str]]:
    places = [(Path("/"), "the root folder")]
    for getter, name in ((Path.home, "your home folder"), (Path.cwd, "the working directory")):
        try:
            places.append((getter().resolve(), name))
        except (OSError, RuntimeError, KeyError):
            pass
    return places


def _named(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(printable(x) for x in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def check_output_path(path, force: bool, inputs=(), kind: str = "dir") -> Path:
    """Raise InputError unless ``path`` may be written: a new path, or with ``force`` one dsdoctor may replace.

    ``kind`` is "dir" (replace only a folder holding dsdoctor's marker and nothing a user added) or "file"
    (replace only a regular file). ``inputs``: paths the command reads; the output may be none of them and
    hold none of them."""
    p = absolute(path)
    st = stat_or_none(p, os.lstat)
    if st is not None and stat.S_ISLNK(st.st_mode):
        target = printable(os.readlink(p))
        raise InputError(f"is a symbolic link (to {target}); dsdoctor writes to a new path or replaces its own "
                         "output, never through a link", path=p, hint="give the real path, or another one")
    if st is not None and special_kind(st.st_mode):
        raise InputError(f"is {special_kind(st.st_mode)}; dsdoctor writes only new paths or regular files and "
                         "folders, even with --force", path=p)
    real = _resolved(p) or p
    _check_no_input(p, real, inputs)
    if st is None:
        return p
    if not force:
        raise InputError("already exists; not overwriting", path=p, hint="pass --force to replace it")
    for place, name in _protected():
        if _is_within(place, real):
            raise InputError(f"is {name}" if place == real else f"holds {name} ({place})", path=p,
                             hint="--force replaces a folder dsdoctor wrote; give a new path")
    if kind == "dir":
        _check_own_dir(p, st)
    elif not stat.S_ISREG(st.st_mode):
        raise InputError("is a folder, expected a file path" if stat.S_ISDIR(st.st_mode) else
                         "is not a regular file; not replacing it", path=p)
    return p


def stat_or_none(p: Path, how=os.stat) -> os.stat_result | None:
    """``how(p)`` (os.stat or os.lstat), None when nothing is there; any other failure is the user's error."""
    try:
        return how(p)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"cannot check the output path: {exc.strerror}", path=p) from None


def _check_no_input(p: Path, real: Path, inputs) -> None:
    """The output may be none of the command's inputs and hold none of them."""
    for inp in inputs:
        r = _resolved(inp) if inp is not None else None
        if r == real:
            raise InputError("is an input of this command; write the output somewhere else", path=p)
        if r is not None and real in r.parents:
            raise InputError(f"holds an input of this command ({printable(inp)}); write the output somewhere else",
                             path=p)


def _check_own_dir(p: Path, st: os.stat_result) -> None:
    """--force replaces a folder only when dsdoctor wrote it: its marker, and nothing a user added."""
    if not stat.S_ISDIR(st.st_mode):
        raise InputError("is a file, not a folder dsdoctor wrote; not replacing it", path=p,
                         hint="give a new path, or move the file yourself")
    if not has_marker(p):
        raise InputError(f"was not written by dsdoctor (it has no {MARKER} marker); --force replaces only "
                         "dsdoctor's own output folders", path=p,
                         hint="give a new path, or delete the folder yourself if you are sure")
    foreign = foreign_entries(p)
    if foreign:
        raise InputError(f"holds what dsdoctor did not write there: {_named(foreign)}; --force replaces only "
                         "dsdoctor's own files", path=p,
                         hint="move those out first, or delete the folder yourself if you are sure")


def output_parent(target: Path, create: bool) -> Path:
    parent = target.parent
    if parent.exists() and not parent.is_dir():
        raise InputError("the folder to write into is not a folder", path=parent)
    if not parent.exists():
        if not create:
            raise InputError("parent directory does not exist", path=target)
        make_dir(parent, "the output's folder")
    return parent


def make_dir(path, what: str = "the folder") -> Path:
    """``path`` and its missing parents as folders (mode 0777 less the umask); an existing folder is kept."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InputError(f"cannot create {what}: a file is in the way", path=p) from None
    except OSError as exc:
        raise InputError(f"cannot create {what}: {exc.strerror}", path=p) from None
    return p


def free_bytes(path) -> int:
    """Free bytes on the filesystem holding ``path``."""
    return shutil.disk_usage(path).free


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
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            raise as_input_error(exc, lock) from None
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


# ---- output files and folders ----------------------------------------------------------------------------------

def as_input_error(exc: OSError, target: Path) -> InputError:
    what = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "read-only file system",
            errno.EFBIG: "file too large for this process's file-size limit (ulimit -f)"}.get(
        exc.errno, exc.strerror or str(exc))
    return InputError(f"cannot write the output: {what}", path=exc.filename or target,
                      hint="nothing was left behind" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else None)


def atomic_write_text(path, text: str, force: bool = False, inputs=(), create_parent: bool = False) -> Path:
    """Write ``text`` to ``path`` via a temporary file in the same directory and an atomic rename."""
    p = check_output_path(path, force, inputs, kind="file")
    parent = output_parent(p, create=create_parent)
    with GUARD.active(), output_lock(p):
        check_output_path(p, force, inputs, kind="file")  # again, under the lock
        write_via_temp(p, parent, text, os.replace if force else _rename_no_replace)
    return p


def write_via_temp(p: Path, parent: Path, text: str, put) -> None:
    """``text`` into a temporary file in ``parent`` (synced), then ``put(tmp, p)`` (a rename), each step safe from
    signals; on any failure the temporary file is removed and an OSError is said as a user's error. Called
    inside ``GUARD.active()``."""
    tmp = None
    try:
        with GUARD.deferred():
            fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
            os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        with GUARD.deferred():
            put(tmp, p)
    except BaseException as exc:
        if tmp is not None:
            with GUARD.deferred(raise_pending=False), contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if isinstance(exc, OSError):
            raise as_input_error(exc, p) from None
        raise


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


def _new_marked_dir(parent: Path, target: Path, command: str | None, suffix: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=suffix, dir=parent))
    os.chmod(tmp, 0o777 & ~umask())
    write_marker(tmp, marker_info(target, command))
    return tmp


def move_aside_and_remove(target: Path, parent: Path) -> None:
    """Remove an old output: renamed into a hidden ``.old`` folder first, so a crash never leaves half of it."""
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=parent))
    os.replace(target, old / "x")
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(path, force: bool = False, inputs=(), command: str | None = None, on_stale=None):
    """Yield a temporary sibling directory; on success it replaces ``path``, on any error or signal it is removed.

    An interrupted run therefore never leaves a ``path`` that looks complete. ``on_stale`` receives the
    partial siblings earlier killed runs left (default: a note on stderr). The marker of the finished folder
    lists what it holds, so a later ``--force`` can tell what a user added to it."""
    target = check_output_path(path, force, inputs, kind="dir")
    parent = output_parent(target, create=True)
    with GUARD.active(), output_lock(target):
        check_output_path(target, force, inputs, kind="dir")  # again, under the lock
        stale = stale_siblings(target)
        if stale:
            (on_stale or note_stale)(stale)
        tmp = None
        try:
            with GUARD.deferred():  # a signal here must not leave a folder nobody removes
                tmp = _new_marked_dir(parent, target, command, ".partial")
            yield tmp
            with GUARD.deferred():
                record_manifest(tmp)
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
                with GUARD.deferred(raise_pending=False):
                    shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError):
                raise as_input_error(exc, target) from None
            raise


# ---- files inside a folder dsdoctor is building ----------------------------------------------------------------

def create_fd(path) -> int:
    """A new file (never an existing one, never through a link), mode 0666 less the umask: its descriptor."""
    return os.open(path, NEW_FILE, 0o666)


def write_new(path, data: str | bytes) -> Path:
    """Write a new file inside a folder dsdoctor is building (report files, figures, captured configs)."""
    fd = create_fd(path)
    with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w", **({} if isinstance(data, bytes)
                                                                     else {"encoding": "utf-8"})) as fh:
        fh.write(data)
    return Path(path)


def open_new(path, mode: str = "w"):
    """A new file opened for writing (a run's log), text in UTF-8 unless ``mode`` has "b"."""
    fd = create_fd(path)
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))


def data_bytes(fd: int, size: int, max_extents: int = 100_000) -> int:
    """Bytes of a file that hold data, not holes (``SEEK_DATA``/``SEEK_HOLE``; a file system without them
    reports no holes). Past ``max_extents`` runs of data the rest counts as holes: a file cut into that many
    pieces is crafted, not a tokenizer."""
    if not hasattr(os, "SEEK_DATA"):
        return size
    total, at = 0, 0
    try:
        for _ in range(max_extents):
            if at >= size:
                break
            try:
                start = os.lseek(fd, at, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole is left
                    break
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            total += end - start
            at = end
        else:
            return total
    except OSError:
        return size
    finally:
        os.lseek(fd, 0, os.SEEK_SET)
    return total


def _refuse_sparse(fd: int, src, kind: Kind) -> int:
    size = os.fstat(fd).st_size
    data = data_bytes(fd, size) if size > 1 << 20 else size
    if data * 2 < size:
        raise InputError(f"is a sparse file ({size} bytes, {data} of them data); copying it would write "
                         f"{size} bytes; not a {kind.what}", path=src)
    return size


def copy_size(src, kind: Kind) -> int:
    """The bytes ``copy_file`` will write for ``src``, checked before anything is written: a regular file
    within the kind's bound, not sparse."""
    fd = open_fd(src, kind)
    try:
        return _refuse_sparse(fd, src, kind)
    finally:
        os.close(fd)


def copy_file(src, dst, kind: Kind) -> None:
    """Copy the regular file ``src`` (within the kind's size bound, also if it grows meanwhile) to a new ``dst``.
    A sparse file (less than half of it data: a 40 GiB file of holes takes no disk, its copy 40 GiB) is
    refused: no model file is written that way."""
    fd = open_fd(src, kind)
    try:
        _refuse_sparse(fd, src, kind)
        limit = kind.max_bytes if kind.max_bytes is not None else 1 << 62
        with os.fdopen(fd, "rb", closefd=False) as fin, os.fdopen(create_fd(dst), "wb") as fout:
            copied = 0
            while True:
                chunk = fin.read(16 * 2**20)
                if not chunk:
                    break
                copied += len(chunk)
                if copied > limit:
                    raise InputError(f"is larger than {limit} bytes; too large for a {kind.what}", path=src)
                fout.write(chunk)
    finally:
        os.close(fd)


def remove_own(path) -> None:
    """Remove a file dsdoctor wrote into an output folder it is building (one that carries the marker)."""
    p = Path(path)
    if not any(has_marker(d) for d in list(p.parents)[:4]):
        raise ValueError(f"{p} is not inside a folder dsdoctor is writing")
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISREG(os.lstat(p).st_mode):
            os.unlink(p)
