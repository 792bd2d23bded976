"""The one error type users see. Anything raised as InputError becomes exit 2 with one line:
``dsdoctor: error: <file>: <problem>`` and never a traceback."""
from __future__ import annotations

import os


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
        return text
