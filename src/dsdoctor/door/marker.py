"""dsdoctor's marker in its output folders, and the manifest in it of what dsdoctor wrote there.

Every output folder holds ``.dsdoctor-output`` (JSON: version, command, pid, start time). When the folder is
complete, the marker also lists every entry dsdoctor wrote (``files``: relative path -> size, ``dirs``), so
that ``--force`` can tell a file a user added (or changed) inside an earlier output from dsdoctor's own, and
refuse to delete it. A folder of an earlier dsdoctor version has a marker without a list: ``--force`` treats
it as before (the folder is dsdoctor's). Hidden partial folders that a killed run left beside an output are
found here too, to be named (never deleted).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from pathlib import Path

from dsdoctor.errors import printable

MARKER = ".dsdoctor-output"  # written into every output folder (and its hidden partial sibling)
MAX_ENTRIES = 100_000  # entries walked in one output folder (a merge writes tens, a trace a few hundred)
_MARKER_MAX_BYTES = 64 * 2**20


def has_marker(folder: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(folder / MARKER).st_mode)
    except OSError:
        return False


def read_marker(folder: Path) -> dict | None:
    """The marker's content; None when there is none or it cannot be read as a JSON object."""
    from dsdoctor.door.kinds import Kind
    from dsdoctor.door.read import read_json
    from dsdoctor.errors import InputError

    if not has_marker(folder):
        return None
    try:
        info = read_json(folder / MARKER, Kind("dsdoctor marker", _MARKER_MAX_BYTES, "utf-8"))
    except InputError:
        return None
    return info if isinstance(info, dict) else None


def marker_info(target: Path, command: str | None, **extra) -> dict:
    from dsdoctor._version import __version__

    return {"written_by": f"dsdoctor {__version__}", "command": command, "output": target.name,
            "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra}


def write_marker(folder: Path, info: dict) -> None:
    """Write (or replace, through a temporary file and a rename) the marker of ``folder``."""
    text = json.dumps(info) + "\n"
    tmp = folder / f"{MARKER}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, folder / MARKER)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def entries(folder: Path) -> tuple[dict[str, int], list[str]]:
    """Every file (relative path -> size, links as themselves) and folder under ``folder``, its own marker
    left out. Stops at ``MAX_ENTRIES`` (the rest is reported as one entry, so a manifest check fails)."""
    files: dict[str, int] = {}
    dirs: list[str] = []
    count = 0
    for root, dirnames, filenames in os.walk(folder):
        rel_root = os.path.relpath(root, folder)
        for name in sorted(dirnames):
            full = os.path.join(root, name)
            rel = name if rel_root == "." else f"{rel_root}/{name}"
            if os.path.islink(full):  # a link to a folder: an entry, not followed
                dirnames.remove(name)
                files[rel] = _size(full)
            else:
                dirs.append(rel)
        for name in filenames:
            rel = name if rel_root == "." else f"{rel_root}/{name}"
            if rel == MARKER:
                continue
            files[rel] = _size(os.path.join(root, name))
        count += len(dirnames) + len(filenames)
        if count > MAX_ENTRIES:
            files[f"... (more than {MAX_ENTRIES} entries)"] = -1
            break
    return files, sorted(dirs)


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return -1


def record_manifest(folder: Path) -> None:
    """Add to the marker of ``folder`` the list of everything in it now (called when the output is complete)."""
    info = read_marker(folder) or {}
    files, dirs = entries(folder)
    info.update(files=files, dirs=dirs)
    write_marker(folder, info)


def foreign_entries(folder: Path) -> list[str]:
    """Entries of a marked output folder that dsdoctor did not write there, or that changed size since: the
    files a user added. Empty when the marker has no list (an earlier dsdoctor's output). A sub-folder that
    carries a marker of its own and is not in the list is judged by its own list."""
    info = read_marker(folder)
    if not info or not isinstance(info.get("files"), dict):
        return []
    listed, listed_dirs = info["files"], set(info.get("dirs") or ())
    found, dirs = entries(folder)
    own_outputs = [d for d in dirs if d not in listed_dirs and has_marker(folder / d)]
    out = []
    for d in own_outputs:
        out += [f"{d}/{x}" for x in foreign_entries(folder / d)]

    def inside_own(rel: str) -> bool:
        return any(rel == d or rel.startswith(d + "/") for d in own_outputs)

    for rel, size in found.items():
        if inside_own(rel):
            continue
        if rel not in listed:
            out.append(rel)
        elif listed[rel] != size:
            out.append(f"{rel} (changed since dsdoctor wrote it)")
    out += [f"{d}/" for d in dirs if d not in listed_dirs and not inside_own(d)
            and not any(f.startswith(d + "/") for f in found)]
    return sorted(out)


# ---- stale siblings of killed runs --------------------------------------------------------------------------

def stale_siblings(target) -> list[tuple[Path, int]]:
    """Hidden ``.NAME.XXXXXXXX.partial`` / ``.old`` folders dsdoctor left beside ``target`` (with their size).

    Only folders that carry dsdoctor's marker count; they are named, never deleted (the user decides)."""
    t = Path(os.path.abspath(os.fspath(target)))
    pattern = re.compile(rf"^\.{re.escape(t.name)}\.[a-z0-9_]{{8}}\.(partial|old)$")
    found = []
    try:
        listing = list(os.scandir(t.parent))
    except OSError:
        return []
    for entry in listing:
        m = pattern.match(entry.name)
        if not m or not entry.is_dir(follow_symlinks=False):
            continue
        p = Path(entry.path)
        if has_marker(p) or (m.group(1) == "old" and has_marker(p / "x")):
            found.append((p, tree_size(p)))
    return sorted(found)


def tree_size(p: Path) -> int:
    total = 0
    for root, _dirs, names in os.walk(p):
        for f in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def note_stale(stale: list[tuple[Path, int]]) -> None:
    import sys

    from dsdoctor.units import human_bytes

    for p, size in stale:
        print(f"dsdoctor: note: {printable(p)} ({human_bytes(size)}) was left by an interrupted dsdoctor run; "
              f"nothing uses it, delete it with: rm -rf '{printable(p)}'", file=sys.stderr)
