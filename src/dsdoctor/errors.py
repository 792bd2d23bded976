"""The one error type users see. Anything raised as InputError becomes exit 2 with one line:
``dsdoctor: error: <file>: <problem>`` and never a traceback.

Text from untrusted places (a config value, a path, a checkpoint's ``latest``, torch's multi-line advice)
goes through ``one_line`` before it reaches a terminal: control characters, terminal escape sequences and
line breaks are shown escaped (``\\x1b``, ``\\n``), so a crafted file can neither break the one-line
contract nor drive the terminal."""
from __future__ import annotations

import os
import re

# C0 controls, DEL, C1 controls (0x9b is a one-byte CSI on some terminals), Unicode line and paragraph
# separators, and the bidirectional overrides/isolates that can make shown text differ from the real one.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")
_UNSAFE_IN_BLOCK = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match) -> str:
    ch = match.group()
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def one_line(text, limit: int | None = None) -> str:
    """``text`` as one printable line: control characters and escape sequences escaped; cut at ``limit``
    characters (with "...") when given."""
    text = _UNSAFE.sub(_escape, str(text))
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 3, 0)] + "..."
    return text


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text) -> str:
    """``text`` with C0/C1 control characters (newlines, escape sequences, NUL...) escaped, as Python's
    ``repr`` writes them: for a path or a name inside a one-line message."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


def printable_block(text: str) -> str:
    """Multi-line report text with every control character but newline and tab escaped (a config value
    holding ``\x1b]0;...`` or ``\r`` cannot rewrite the terminal)."""
    return _UNSAFE_IN_BLOCK.sub(_escape, str(text))


class InputError(Exception):
    """Bad input (file, flag, checkpoint). ``path`` names the file at fault, if any; ``hint`` is the next
    thing to try."""

    def __init__(self, problem: str, path: str | os.PathLike | None = None, hint: str | None = None):
        self.problem = problem
        self.path = os.fspath(path) if path is not None else None
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = f"{self.path}: " if self.path else ""
        text = f"{where}{self.problem}"
        if self.hint:
            text += f" ({self.hint})"
        return one_line(text)
