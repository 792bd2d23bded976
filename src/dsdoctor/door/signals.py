"""Signals while an output is built: SIGINT, SIGTERM, SIGHUP and SIGQUIT take the same cleanup path as an
error (``Interrupted``), and inside ``deferred()`` they wait, so a rename pair or a cleanup is never cut in
half. Handlers are restored afterwards; a signal that is ignored (SIGHUP under ``nohup``) stays ignored."""
from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n))


class Interrupted(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT) turned into the same cleanup path as Ctrl-C."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


class SignalGuard:
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


GUARD = SignalGuard()
