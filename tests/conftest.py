"""The suite's tiers and guards.

Markers (pyproject.toml): ``process`` for a test that starts any process (the CLI as a subprocess, a script,
a launcher), ``deepspeed`` for one that runs real DeepSpeed ranks (it starts processes too, so it counts as
``process``), ``serial`` for one that must not run beside other tests (make test runs those alone, after
the parallel part), ``slow`` for one that starts no process but runs a real model on the CPU for its figures
(real generate, timed forwards). ``make test-fast`` runs ``-m "not process and not deepspeed and not slow"``:
nothing in it may start a process, and the guard below holds every test to its markers: a test without
``process`` (or ``deepspeed``) that starts one fails, naming the marker to add. ``make test`` runs every test.
"""
import os
import platform
import shutil
import subprocess
import tempfile
import time

import pytest

from dsdoctor import proctree
from dsdoctor.proctree import deepspeed_shm_files, unlink_leaked_deepspeed_shm
from tests import helpers, jit_ops

PROCESS_MARKERS = ("process", "deepspeed")


def _xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")  # not PYTEST_XDIST_WORKER: a pytest a test starts inherits that


@pytest.hookimpl(tryfirst=True)  # before -m selects: a deepspeed test is a process test too
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("deepspeed") and not item.get_closest_marker("process"):
            item.add_marker(pytest.mark.process)
    if _xdist_worker(config):
        # in parallel, the slow tests first (DeepSpeed ranks, other processes, real models): the quick in-process
        # ones fill the end, instead of one worker finishing a long launch while the other waits idle
        items.sort(key=lambda item: 0 if item.get_closest_marker("deepspeed") else
                   1 if item.get_closest_marker("process") else 2 if item.get_closest_marker("slow") else 3)


# ---------------------------------------------------------------- no process without the marker

class ProcessWithoutMarker(BaseException):
    """Raised where an unmarked test starts a process. A BaseException, so that code under test that turns
    errors into findings cannot swallow it; the test fails at teardown even if something does."""


class _Guard:
    item = None  # the test running now; None outside tests (collection, xdist starting its workers)
    allowed = True
    started: list[str] = []  # what this test tried to start
    reported = False  # a phase of this test has failed for it

    def check(self, what: str) -> None:
        if self.item is None:
            return
        self.started.append(what)
        if not self.allowed:
            raise ProcessWithoutMarker(_message(self.item, what))


_GUARD = _Guard()


def _message(item, what: str) -> str:
    return (f"{item.nodeid} started a process ({what}) but has no `process` marker: add "
            "@pytest.mark.process (or @pytest.mark.deepspeed when it runs DeepSpeed ranks). "
            "make test-fast runs -m 'not process' and starts no process.")


def _describe(args) -> str:
    try:
        words = [os.fsdecode(a) if isinstance(a, bytes | str) else str(a) for a in args]
    except TypeError:
        words = [str(args)]
    text = " ".join(" ".join(words).split())
    return text if len(text) <= 120 else text[:117] + "..."


def _install_guard(mp: pytest.MonkeyPatch) -> None:
    import _posixsubprocess

    def guarded(name, real, describe, module=os, attr=None):
        def call(*args, **kwargs):
            _GUARD.check(f"{name} {describe(args)}")
            return real(*args, **kwargs)
        # pickled by reference as what it stands in for (a test pickles os.system as an attacker would)
        call.__module__, call.__name__ = module.__name__, attr or real.__name__
        call.__qualname__ = call.__name__
        return call

    # fork_exec starts every subprocess.Popen (through subprocess's own alias of it) and multiprocessing's
    # spawn and forkserver children
    fork_exec = _posixsubprocess.fork_exec
    mp.setattr(subprocess, "_fork_exec", guarded("subprocess", fork_exec, lambda a: _describe(a[0] or ()),
                                                  subprocess, "_fork_exec"))
    mp.setattr(_posixsubprocess, "fork_exec", guarded("multiprocessing", fork_exec, lambda a: _describe(a[0] or ()),
                                                      _posixsubprocess))
    for name in ("fork", "forkpty"):  # multiprocessing's fork children, pty.fork, os.spawn*
        mp.setattr(os, name, guarded(f"os.{name}", getattr(os, name), lambda a: ""))
    for name in ("posix_spawn", "posix_spawnp"):  # subprocess uses these for some commands
        mp.setattr(os, name, guarded(f"os.{name}", getattr(os, name), lambda a: _describe(a[1] if len(a) > 1 else a)))
    mp.setattr(os, "system", guarded("os.system", os.system, lambda a: _describe(a)))


_PATCHES = pytest.MonkeyPatch()


def pytest_configure(config):
    # a machine profile someone calibrated on this machine (~/.cache/dsdoctor) would change what plan says:
    # each test process gets an empty cache of its own (a test that needs one sets DSDOCTOR_CACHE_DIR itself)
    os.environ["DSDOCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dsdoctor-test-cache-")
    if not _xdist_worker(config):  # the session's shared folder; xdist workers inherit it
        os.environ["DSDOCTOR_TEST_SHARED_DIR"] = tempfile.mkdtemp(prefix="dsdoctor-test-session-")
        # DeepSpeed's CPU op, built once before any rank starts (tests/jit_ops.py says why); not for the fast tier
        jit_ops.prepare(build="not process" not in (config.getoption("markexpr", "") or ""))
    else:
        jit_ops.use_own_folder()
    # platform.processor() runs `uname -p` once per interpreter and caches it; dsdoctor's machine fingerprint
    # (calibrate/profile.py, read by every plan) asks for it. Asked here, before any test, it is not a
    # process the first in-process plan test starts.
    platform.processor()
    _install_guard(_PATCHES)


def pytest_unconfigure(config):
    _PATCHES.undo()
    shutil.rmtree(os.environ.pop("DSDOCTOR_CACHE_DIR", ""), ignore_errors=True)
    if not _xdist_worker(config):  # after every worker has ended
        shutil.rmtree(os.environ.pop("DSDOCTOR_TEST_SHARED_DIR", ""), ignore_errors=True)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _GUARD.item, _GUARD.started, _GUARD.reported = item, [], False
    _GUARD.allowed = any(item.get_closest_marker(m) for m in PROCESS_MARKERS)
    try:
        return (yield)
    finally:
        _GUARD.item, _GUARD.allowed = None, True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if _GUARD.started and not _GUARD.allowed and not _GUARD.reported:
        _GUARD.reported = True
        if report.passed:  # the ProcessWithoutMarker was caught and swallowed: fail this phase all the same
            report.outcome = "failed"
            report.longrepr = _message(item, _GUARD.started[0])
    elif call.when == "teardown" and _GUARD.allowed and not _GUARD.started and os.environ.get("DSDOCTOR_MARKER_AUDIT"):
        report.user_properties.append(("marked_process_started_none", True))
    return report


# DSDOCTOR_MARKER_AUDIT=1: list the tests marked process or deepspeed that passed without starting a process
# (an audit, not a rule: a module-scoped fixture may have started it for an earlier test)
_AUDIT: list[str] = []


def pytest_runtest_logreport(report):
    if dict(report.user_properties).get("marked_process_started_none"):
        _AUDIT.append(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    if jit_ops.STATE["why"]:  # the DeepSpeed tests that fail or hang next are then explained here
        terminalreporter.section("DeepSpeed's CPU op was not built before the tests")
        terminalreporter.write_line(jit_ops.STATE["why"])
    if _AUDIT:
        terminalreporter.section("marked process, started none")
        for nodeid in sorted(_AUDIT):
            terminalreporter.write_line(nodeid)


# ---------------------------------------------------------------- DeepSpeed's /dev/shm workspaces
# Every CPU DeepSpeed rank maps a 66 MB workspace in /dev/shm that DeepSpeed never unlinks (dsdoctor.proctree).
# Its rank creates it, writes 66 MB into it and only then maps it; its peers then open it by name and, while
# it is missing, retry forever. dsdoctor's own launches unlink, on the way out, the workspaces that appeared
# during the run and that no process maps: with another launch starting at that moment, that can take a
# workspace still being written and hang the other launch's ranks (seen here with two xdist workers). So:
# - beside other tests, the dsdoctor a test runs (as a process or in-process) cleans a folder of this
#   process's own (DSDOCTOR_SHM_DIR, proctree.SHM_DIR), never /dev/shm;
# - the tests that check dsdoctor's own clean-up of /dev/shm are marked serial: they run alone, after the
#   parallel part (make test), and their dsdoctor cleans /dev/shm;
# - after each test, this process unlinks the workspaces of the launches on ports it handed out
#   (helpers.free_port), and those that appeared during the session, that no live process maps and that
#   were last written over STALE_S ago (a rank maps its own within moments): what dsdoctor's launches left,
#   a little later.
STALE_S = 120


def _leaked_and_stale(names: set[str]) -> set[str]:
    now, out = time.time(), set()
    for name in names:
        try:
            if now - os.stat(os.path.join(proctree.SHM_DIR, name)).st_mtime > STALE_S:
                out.add(name)
        except OSError:
            continue
    return out


_BEFORE_SESSION: set[str] = set()  # another job's workspaces, there before the session: not this suite's to touch


@pytest.fixture(autouse=True, scope="session")
def _no_leaked_deepspeed_shm_at_end():
    _BEFORE_SESSION.update(deepspeed_shm_files())
    yield
    unlink_leaked_deepspeed_shm(_leaked_and_stale(deepspeed_shm_files() - _BEFORE_SESSION))


@pytest.fixture(autouse=True)
def _deepspeed_workspaces(request, tmp_path_factory):
    alone = request.node.get_closest_marker("serial") is not None
    if alone and _xdist_worker(request.config):
        pytest.skip("must run alone (serial): make test runs it after the parallel part, as does pytest without -n")
    redirect = pytest.MonkeyPatch()
    if not alone:
        private = str(tmp_path_factory.getbasetemp() / "dsdoctor-shm")  # never holds a workspace
        os.makedirs(private, exist_ok=True)
        redirect.setenv("DSDOCTOR_SHM_DIR", private)
        redirect.setattr(proctree, "SHM_DIR", private)
    ports_before = set(helpers.PORTS_HANDED_OUT)
    if request.node.get_closest_marker("process") or request.node.get_closest_marker("deepspeed"):
        jit_ops.clear_stale_lock()  # a rank killed by an earlier test must not hang this one's ranks
    try:
        yield
    finally:
        redirect.undo()
        for port in helpers.PORTS_HANDED_OUT - ports_before:
            unlink_leaked_deepspeed_shm(deepspeed_shm_files(port))
        if request.node.get_closest_marker("process"):  # an in-process test leaves no workspace behind
            unlink_leaked_deepspeed_shm(_leaked_and_stale(deepspeed_shm_files() - _BEFORE_SESSION))
