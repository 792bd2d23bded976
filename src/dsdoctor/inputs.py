"""Reading untrusted input files (configs, prompt files, a model's config.json) without hanging or
exhausting memory.

Every reader here checks, before reading a byte, that the path is a regular file: a FIFO blocks the reader
forever, ``/dev/zero`` never ends, a socket or a directory is not a file at all. The file is opened
non-blocking (opening a FIFO for reading blocks until a writer appears) and checked again on the open
descriptor, so a path swapped between the check and the open is caught too. Sizes are bounded, and parsed
trees are bounded in depth and node count before any recursive code walks them.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from dsdoctor.errors import InputError

MAX_CONFIG_BYTES = 16 * 1024 * 1024  # real configs and config.json files are a few KiB
MAX_PROMPT_BYTES = 64 * 1024 * 1024
MAX_DEPTH = 64  # the deepest real DeepSpeed/accelerate/HF config is about 6 levels
MAX_PURE_PYTHON_BYTES = 64 * 1024  # YAML and HJSON parse in pure Python (~10^4-10^5 nodes/s): real ones are < 10 KiB
MAX_NODES = 100_000  # values in a parsed tree, aliases expanded (real configs hold fewer than 1,000)


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def require_regular(path: str | os.PathLike, what: str = "input file") -> Path:
    """``path`` if it (after symlinks) is an existing regular file, else an InputError naming it."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise InputError(f"no such {what}", path=p) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=p) from None
    kind = _kind(st.st_mode)
    if kind:
        raise InputError(f"is {kind}, not a regular file; expected a {what}", path=p)
    return p


def read_bytes(path: str | os.PathLike, what: str = "input file", limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; anything else is an InputError naming it."""
    p = require_regular(path, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(p, flags)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=p) from None
    try:
        st = os.fstat(fd)
        kind = _kind(st.st_mode)
        if kind:  # replaced between the check and the open
            raise InputError(f"is {kind}, not a regular file; expected a {what}", path=p)
        if st.st_size > limit:
            raise InputError(f"is {st.st_size} bytes; too large for a {what} (limit {limit})", path=p)
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", path=p) from None
    finally:
        os.close(fd)
    if total > limit:  # grew while we read it (a file still being written)
        raise InputError(f"is larger than {limit} bytes; too large for a {what}", path=p)
    return b"".join(chunks)


def read_text(path: str | os.PathLike, what: str = "input file", limit: int = MAX_CONFIG_BYTES) -> str:
    """UTF-8 text (a BOM allowed) of a regular file, via ``read_bytes``."""
    blob = read_bytes(path, what, limit)
    try:
        return blob.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"is not UTF-8 text (bad byte at offset {exc.start})", path=path) from None


def check_tree(data, path: str | os.PathLike | None, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES):
    """Refuse a parsed JSON/YAML tree that is cyclic, deeper than ``max_depth`` or larger than ``max_nodes``
    values (shared sub-trees counted every time they appear, as a recursive walk would meet them).

    Iterative, so a deep or huge tree is refused rather than overflowing the stack or running for hours."""
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
