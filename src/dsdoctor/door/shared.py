"""Multi-node trace: a folder several dsdoctor processes write into (``DIR``), each node's own folder in it
(``DIR/node-K``, written in place since the other nodes watch it), and the report files node 0 (or
``trace --report-only``) publishes into ``DIR``."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from dsdoctor.door.marker import (
    MARKER,
    has_marker,
    marker_info,
    note_stale,
    read_marker,
    record_manifest,
    tree_size,
    write_marker,
)
from dsdoctor.door.read import file_kind
from dsdoctor.door.signals import GUARD
from dsdoctor.door.write import (
    NEW_FILE,
    absolute,
    as_input_error,
    check_output_path,
    make_dir,
    move_aside_and_remove,
    output_lock,
    output_parent,
    special_kind,
    stat_or_none,
    umask,
)
from dsdoctor.errors import InputError


@contextlib.contextmanager
def live_output_dir(path, force: bool = False, inputs=(), command: str | None = None):
    """An output folder written in place (other processes watch it: a multi-node trace's ``DIR/node-K``).

    The same rules as ``atomic_output_dir`` for what may be replaced, and the same lock; the folder gets its
    marker at once and, however the run ends, the list of what it holds. It is not built aside: what marks
    it complete is the caller's last file (``done.json``)."""
    target = check_output_path(path, force, inputs, kind="dir")
    parent = output_parent(target, create=True)
    with GUARD.active(), output_lock(target):
        check_output_path(target, force, inputs, kind="dir")
        try:
            with GUARD.deferred():
                if os.path.lexists(target):
                    move_aside_and_remove(target, parent)
                os.mkdir(target, 0o777)
                write_marker(target, marker_info(target, command))
        except OSError as exc:
            raise as_input_error(exc, target) from None
        try:
            yield target
        finally:
            with GUARD.deferred(raise_pending=False), contextlib.suppress(OSError):
                record_manifest(target)


# ---- a folder several processes write into: multi-node trace's DIR --------------------------------------------

_STAGING = re.compile(r"^\.dsdoctor-report\.[a-z0-9_]{8}\.partial$")


def shared_root(path, command: str | None = None) -> Path:
    """The folder several dsdoctor processes write into (each node of a multi-node trace): created when
    missing, marked when new or empty (a folder with a user's files in it stays unmarked: nothing in it is
    ever replaced then). Never replaced as a whole, so a link to a folder (shared storage) is followed."""
    p = absolute(path)
    st = stat_or_none(p)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise InputError(f"is {special_kind(st.st_mode) or 'a file'}, not a folder; a multi-node trace writes "
                         "into a folder", path=p)
    make_dir(p, "the output folder")
    try:
        with os.scandir(p) as listing:
            empty = not any(listing)
    except OSError as exc:
        raise InputError(f"cannot read the folder: {exc.strerror}", path=p) from None
    if empty:
        try:
            fd = os.open(p / MARKER, NEW_FILE, 0o666)  # another node may be first: then it is marked already
        except FileExistsError:
            return p
        except OSError as exc:
            raise as_input_error(exc, p) from None
        os.close(fd)
        write_marker(p, marker_info(p, command, shared=True, files={}))
    return p


def check_publish(root, names, force: bool) -> None:
    """Raise InputError unless every file of ``names`` may be written into the shared folder ``root``: new,
    or with ``force`` a regular file its marker lists as dsdoctor's, unchanged since."""
    root = absolute(root)
    info = read_marker(root) or {}
    listed = info.get("files") if isinstance(info.get("files"), dict) else {}
    for name in names:
        p = root / name
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise InputError(f"cannot check the output path: {exc.strerror}", path=p) from None
        if not stat.S_ISREG(st.st_mode):
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else file_kind(st.st_mode)
            raise InputError(f"is {what}; dsdoctor replaces only its own report files, even with --force", path=p)
        if name not in listed or listed[name] != st.st_size:
            why = "changed since dsdoctor wrote it" if name in listed else \
                f"was not written by dsdoctor (the folder's {MARKER} does not list it)"
            raise InputError(f"{why}; not replacing it, even with --force", path=p,
                             hint="move it away, or write the report into another folder")
        if not force:
            raise InputError("already exists; not overwriting", path=p, hint="pass --force to replace it")


@contextlib.contextmanager
def publish_into(root, force: bool, command: str | None = None):
    """Yield a hidden staging folder inside the shared folder ``root``; on success every file in it replaces
    (``check_publish``) or joins the files of ``root``, and the marker of ``root`` lists them; on any error
    or signal the staging folder is removed and ``root`` is left as it was."""
    root = absolute(root)
    with GUARD.active(), output_lock(root):
        with os.scandir(root) as listing:
            stale = [Path(e.path) for e in listing if _STAGING.match(e.name) and has_marker(Path(e.path))]
        note_stale([(p, tree_size(p)) for p in stale])
        staging = None
        try:
            with GUARD.deferred():
                staging = Path(tempfile.mkdtemp(prefix=".dsdoctor-report.", suffix=".partial", dir=root))
                os.chmod(staging, 0o777 & ~umask())
                write_marker(staging, marker_info(root, command))
            yield staging
            names = sorted(n for n in os.listdir(staging) if n != MARKER)
            check_publish(root, names, force)
            with GUARD.deferred():
                sizes = {n: os.lstat(staging / n).st_size for n in names}
                for n in names:
                    os.replace(staging / n, root / n)
                info = read_marker(root)
                if info is not None and isinstance(info.get("files"), dict):
                    info["files"].update(sizes)
                    write_marker(root, info)
                shutil.rmtree(staging, ignore_errors=True)
        except BaseException as exc:
            if staging is not None:
                with GUARD.deferred(raise_pending=False):
                    shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, OSError):
                raise as_input_error(exc, root) from None
            raise
