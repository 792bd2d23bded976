"""Writing outputs so that nothing half-written is ever left behind."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from dsdoctor.errors import InputError


def refuse_overwrite(path: str | os.PathLike, force: bool) -> None:
    p = Path(path)
    if p.exists() and not force:
        raise InputError("already exists; not overwriting", path=p, hint="pass --force to replace it")


def atomic_write_text(path: str | os.PathLike, text: str, force: bool = False) -> Path:
    """Write ``text`` to ``path`` via a temporary file in the same directory and an atomic rename."""
    p = Path(path)
    refuse_overwrite(p, force)
    if p.is_dir():
        raise InputError("is a directory, expected a file path", path=p)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError("parent directory does not exist", path=p)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return p


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, force: bool = False):
    """Yield a temporary sibling directory; on success it replaces ``path``, on any error it is removed.

    An interrupted run therefore never leaves a ``path`` that looks complete."""
    target = Path(path)
    refuse_overwrite(target, force)
    parent = target.parent if str(target.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=parent))
    try:
        yield tmp
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=parent))
            os.replace(target, old / "x")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
