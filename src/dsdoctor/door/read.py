"""Reading: every input is a regular file, checked on the open descriptor, read within its kind's bounds.

Before a byte is read the path must be a regular file: a FIFO blocks a reader forever, ``/dev/zero`` never
ends, a socket or a directory is not a file at all. The file is opened non-blocking (opening a FIFO for
reading blocks until a writer appears) and checked again on the open descriptor, so a path swapped between
the check and the open is caught too. Sizes are bounded before reading, and a file that grows while read is
refused. Parsed trees are bounded in depth and node count before any recursive code walks them.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
from pathlib import Path

from dsdoctor.door.kinds import PROC, Kind
from dsdoctor.errors import InputError, printable

_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)


def file_kind(mode: int) -> str | None:
    """What a file that is not a regular file is, in words; None for a regular file."""
    for test, name in ((stat.S_ISREG, None), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(kind_words: str, kind: Kind, path) -> InputError:
    return InputError(f"is {kind_words}, not a regular file; expected a {kind.what}", path=path)


def _too_large(size: int, kind: Kind, path) -> InputError:
    return InputError(f"is {size} bytes; too large for a {kind.what} (limit {kind.max_bytes})", path=path)


def require_regular(path: str | os.PathLike, kind: Kind) -> Path:
    """``path`` if it (after symbolic links) is an existing regular file within the kind's size bound."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise InputError(f"no such {kind.what}", path=p) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=p) from None
    words = file_kind(st.st_mode)
    if words:
        raise _not_regular(words, kind, p)
    if kind.max_bytes is not None and st.st_size > kind.max_bytes:
        raise _too_large(st.st_size, kind, p)
    return p


def open_fd(path: str | os.PathLike, kind: Kind) -> int:
    """A read-only descriptor of the regular file ``path`` (links followed), checked on the descriptor; the
    caller closes it. Its size is within the kind's bound when the kind has one."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise InputError(f"no such {kind.what}", path=path) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=path) from None
    try:
        st = os.fstat(fd)
        words = file_kind(st.st_mode)
        if words:  # a FIFO, a device, or replaced between a check and the open
            raise _not_regular(words, kind, path)
        if kind.max_bytes is not None and st.st_size > kind.max_bytes:
            raise _too_large(st.st_size, kind, path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_binary(path: str | os.PathLike, kind: Kind):
    """A buffered binary reader over ``open_fd`` (closing it closes the descriptor)."""
    return os.fdopen(open_fd(path, kind), "rb")


def _read_fd(fd: int, limit: int, path, kind: Kind, step: int = 1 << 20) -> bytes:
    chunks, total = [], 0
    while total <= limit:
        try:
            chunk = os.read(fd, min(step, limit + 1 - total))
        except OSError as exc:
            raise InputError(f"cannot read: {exc.strerror or exc}", path=path) from None
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > limit:  # grew while we read it (a file still being written)
        raise InputError(f"is larger than {limit} bytes; too large for a {kind.what}", path=path)
    return b"".join(chunks)


SYSTEM_DIRS = ("/etc", "/proc", "/sys", "/dev", "/boot", "/run", "/var", "/usr", "/lib", "/lib32", "/lib64", "/bin",
               "/sbin", "/srv", "/snap")


def _resolved(path) -> Path:
    try:
        return Path(os.path.realpath(path))
    except (OSError, ValueError):
        return Path(os.path.abspath(path))


def outside_tree(path, named_by=None) -> bool:
    """A file outside the user's tree (links resolved): under a system folder; for a file another file names
    (``named_by``), also inside a hidden folder (``~/.ssh``) or outside both the working directory and the
    naming file's folder."""
    real = _resolved(path)
    if any(str(real) == d or str(real).startswith(d + "/") for d in SYSTEM_DIRS):
        return True
    if named_by is None:
        return False
    if any(part.startswith(".") and part not in (".", "..") for part in real.parent.parts):
        return True
    homes = [_resolved(Path.cwd()), _resolved(named_by).parent]
    return not any(real == h or h in real.parents for h in homes)


def refused_outside(path, what: str, named_by=None) -> InputError:
    """A file outside the user's tree that is not what it should be: named, never quoted."""
    by = f" (named by {printable(named_by)})" if named_by is not None else ""
    return InputError(f"is not a {what}: it holds none of its keys{by}; a file outside your tree (a system folder, "
                      "or one another file names in a hidden folder or away from your working directory) is read "
                      "only when it is one, and its content is not shown", path=path)


def require_words(path, data: bytes | str, words, what: str, named_by=None) -> None:
    """Refuse a file outside the user's tree that holds none of ``words`` (bytes, or a compiled pattern for
    text), before anything parses it (a parser's error could quote it)."""
    if not outside_tree(path, named_by):
        return
    found = words.search(data) if hasattr(words, "search") else any(w in data for w in words)
    if not found:
        raise refused_outside(path, what, named_by)


def read_bytes(path: str | os.PathLike, kind: Kind, named_by=None) -> bytes:
    """The bytes of a regular file of at most ``kind.max_bytes``; anything else is an InputError naming it. A
    file outside the user's tree (``outside_tree``) is read only when it holds one of ``kind.words``."""
    if kind.max_bytes is None:
        raise ValueError(f"{kind.what} files are never read whole")
    if kind.words == () and outside_tree(path, named_by):
        require_regular(path, kind)  # a FIFO or a device is named as such first
        raise refused_outside(path, kind.what, named_by)  # unread
    fd = open_fd(path, kind)
    try:
        blob = _read_fd(fd, kind.max_bytes, path, kind)
    finally:
        os.close(fd)
    if kind.words:
        require_words(path, blob, kind.words, kind.what, named_by)
    return blob


def decode(blob: bytes, path, encoding: str = "utf-8-sig") -> str:
    try:
        return blob.decode(encoding)
    except UnicodeDecodeError as exc:
        raise InputError(f"is not UTF-8 text (bad byte at offset {exc.start})", path=path) from None


def read_text(path: str | os.PathLike, kind: Kind, errors: str = "strict", named_by=None) -> str:
    """The text of a regular file in the kind's encoding (strict: a bad byte is an InputError naming it)."""
    blob = read_bytes(path, kind, named_by)
    if errors != "strict":
        return blob.decode(kind.encoding or "utf-8", errors)
    return decode(blob, path, kind.encoding or "utf-8")


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_JSON_STRING_BYTES = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_bound(text: str | bytes, path, kind: Kind) -> None:
    """Refuse, before ``json.loads`` builds anything, JSON text that holds more values than ``kind.max_nodes``.

    ``json.loads`` costs about 60 bytes of memory per value: 99 MiB of ``[[],[],...]`` would take gigabytes
    before any tree check could run. Outside strings, every comma separates two values and every bracket
    opens one, so either count past the bound proves the tree is past it (never a false refusal); and past
    both counts the parse cannot build more than twice the bound. C-speed passes over the text."""
    limit = kind.max_nodes
    if limit is None:
        return
    bare = (_JSON_STRING_BYTES if isinstance(text, bytes) else _JSON_STRING).sub("" if isinstance(text, str)
                                                                                 else b"", text)
    comma, opens = (",", "[{") if isinstance(text, str) else (b",", b"[{")
    values = max(bare.count(comma) + 1, bare.count(opens[0:1]) + bare.count(opens[1:2]))
    if values > limit:
        raise InputError(f"holds more than {limit} values; too many for a {kind.what}", path=path)


def read_json(path: str | os.PathLike, kind: Kind):
    """A JSON file of the kind: bounded read, UTF-8, parsed, and its tree bounded (when the kind bounds it)."""
    text = read_text(path, kind)
    json_bound(text, path, kind)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", path=path) from None
    except RecursionError:
        raise InputError("is nested too deeply", path=path) from None
    if kind.max_depth is not None or kind.max_nodes is not None:
        check_tree(data, path, kind)
    return data


def read_head(path: str | os.PathLike, count: int, kind: Kind) -> bytes:
    """The first ``count`` bytes of a regular file (a file's magic number)."""
    fd = open_fd(path, Kind(kind.what, None, None))
    try:
        return os.read(fd, count)
    finally:
        os.close(fd)


def read_tail(path: str | os.PathLike, count: int, kind: Kind) -> str:
    """The last ``count`` bytes of a regular file as text (a character cut at the start is replaced)."""
    fd = open_fd(path, Kind(kind.what, None, None))
    try:
        os.lseek(fd, max(os.fstat(fd).st_size - count, 0), os.SEEK_SET)
        chunks, left = [], count
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=path) from None
    finally:
        os.close(fd)
    return b"".join(chunks).decode(kind.encoding or "utf-8", "replace")


def iter_lines(path: str | os.PathLike, kind: Kind):
    """The lines of a regular file, decoded with replacement; a line longer than ``kind.max_line`` is dropped
    whole (as a damaged line), so one endless line cannot fill memory."""
    cap = kind.max_line or 1 << 62
    with open_binary(path, kind) as fh:
        while True:
            line = fh.readline(cap + 1)
            if not line:
                return
            if len(line) > cap and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # skip the rest of the endless line
                    line = fh.readline(1 << 20)
                continue
            yield line.decode(kind.encoding or "utf-8", "replace")


def read_proc(path: str, limit: int | None = None) -> bytes | None:
    """A kernel file (``/proc/...``: size 0 in stat, read to its end, at most ``limit`` bytes); None when it
    cannot be read (the process ended, or is another user's)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read_fd(fd, limit or PROC.max_bytes, path, PROC, step=1 << 16)
    except InputError:
        return None
    finally:
        os.close(fd)


def proc_lines(path: str):
    """The lines of a kernel file, streamed (``/proc/PID/maps`` of a large process); nothing if unreadable."""
    try:
        fh = open(path, encoding="utf-8", errors="replace")  # closed below
    except OSError:
        return
    with fh:
        try:
            yield from fh
        except OSError:
            return


def map_readonly(fd: int, offset: int, length: int):
    """A read-only mapping of ``length`` bytes at ``offset`` of a descriptor from ``open_fd``, and the offset
    of the wanted bytes inside it (mappings start on an allocation boundary)."""
    import mmap

    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    return mmap.mmap(fd, length + offset - start, offset=start, access=mmap.ACCESS_READ), offset - start


def check_tree(data, path: str | os.PathLike | None, kind: Kind):
    """Refuse a parsed JSON/YAML tree that is cyclic, deeper than ``kind.max_depth`` or larger than
    ``kind.max_nodes`` values (shared sub-trees counted every time they appear, as a recursive walk would meet
    them).

    Iterative, so a deep or huge tree is refused rather than overflowing the stack or running for hours."""
    max_depth, max_nodes = kind.max_depth or 1 << 30, kind.max_nodes or 1 << 62
    stack = [(data, 1)]
    on_path: set[int] = set()
    nodes = 0
    while stack:
        node, depth = stack.pop()
        if node is _EXIT:
            on_path.discard(depth)  # depth holds the id here
            continue
        nodes += 1
        if nodes > max_nodes:
            raise InputError(f"has more than {max_nodes} values (after expanding aliases); not a config",
                             path=path)
        if isinstance(node, (dict, list, tuple)):
            if depth > max_depth:
                raise InputError(f"is nested more than {max_depth} levels deep; not a config", path=path)
            if id(node) in on_path:
                raise InputError("contains a structure that includes itself (a recursive alias)", path=path)
            on_path.add(id(node))
            stack.append((_EXIT, id(node)))
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return data


_EXIT = object()


# ---- files a library opens by path: checked here first ------------------------------------------------------

def check_library_files(paths, kind: Kind) -> None:
    """Every file of ``paths`` that exists must be a regular file within the kind's bound: a library that
    opens it by name (transformers, safetensors) would block on a FIFO, never end on a device, or read a
    3 GiB config.json whole."""
    for p in paths:
        if os.path.lexists(p):
            require_regular(p, kind)
            if kind.words is not None and kind.max_bytes is not None and outside_tree(p):
                read_bytes(p, kind)  # what the library would read: refused unless it is one (door.outside_tree)


def load_torch_weights(path: str | os.PathLike, kind: Kind):
    """``torch.load(path, weights_only=True, mmap=True)`` of a regular file (no code runs, nothing is copied
    into memory); a file torch cannot read is an InputError naming it."""
    import torch

    os.close(open_fd(path, kind))  # not a FIFO or a device
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for bad files
        text = str(exc).strip()
        first = printable(text.splitlines()[0] if text else type(exc).__name__)
        raise InputError(f"cannot read with weights_only=True: {first[:300]}", path=path) from None


@contextlib.contextmanager
def safetensors_reader(path: str | os.PathLike, kind: Kind):
    """safetensors' own reader (memory-mapped) of a regular file."""
    from safetensors import safe_open

    os.close(open_fd(path, kind))
    with safe_open(str(path), framework="pt") as fh:
        yield fh
