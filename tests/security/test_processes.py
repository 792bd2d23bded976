"""Every process a run starts ends with the run: real processes, real signals.

The traced command double-forks a sleeper (``tests/scripts/double_fork.py``: fork, setsid, fork), the way a
careless script leaves a daemon behind; the sleeper is re-parented away from the command, so only a child
subreaper or the run's tag finds it. dsdoctor is ended with SIGTERM, SIGHUP and SIGINT, and by its own
``--timeout``. Each test checks only the processes its own run started (by the pid the sleeper wrote)."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from dsdoctor import proctree
from tests.helpers import ROOT, deepspeed_env, reached_in_time, run_cli

DOUBLE_FORK = ROOT / "tests" / "scripts" / "double_fork.py"
WAIT_S = 60  # a guard against a hung suite, not a timing assertion


def _gone(pid: int) -> bool:
    return not proctree.alive(pid)


def _wait_for(predicate, what: str, wait_s: float = WAIT_S):
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"never happened: {what}")


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.pop("DSDOCTOR_DEBUG", None)
    return env


def _start(args, **kw):
    # a session of its own, default signal dispositions: as a user's shell would start dsdoctor
    return subprocess.Popen([sys.executable, "-m", "dsdoctor", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True, **kw)


def _cleanup(pids):
    proctree.signal_all([p for p in pids if p and not _gone(p)], signal.SIGKILL)


@pytest.mark.process
def test_trace_ends_a_double_forked_daemon_when_the_command_exits(tmp_path):
    pid_file = tmp_path / "daemon.pid"
    proc = run_cli("trace", "-o", tmp_path / "trace", "--", sys.executable, DOUBLE_FORK, pid_file, timeout=WAIT_S * 2)
    daemon = int(pid_file.read_text())
    try:
        assert proc.returncode in (0, 1), proc.stderr[-2000:]
        assert "daemon started" in proc.stderr
        _wait_for(lambda: _gone(daemon), f"the daemon {daemon} ends")
    finally:
        _cleanup([daemon])


@pytest.mark.process
def test_trace_timeout_ends_the_command_and_its_daemon(tmp_path):
    for limit in (3, 30):  # the daemon must be running when the watchdog fires: longer on a loaded machine
        pid_file = tmp_path / f"daemon-{limit}.pid"
        start = time.time()
        proc = run_cli("trace", "-o", tmp_path / f"trace{limit}", "--timeout", str(limit), "--", sys.executable,
                       DOUBLE_FORK, pid_file, "--hang", timeout=WAIT_S * 2)
        if reached_in_time(pid_file, start, limit, slack_s=1):
            break
    daemon = int(pid_file.read_text())
    try:
        assert f"no end after {limit}s" in proc.stderr, proc.stderr[-2000:]
        _wait_for(lambda: _gone(daemon), f"the daemon {daemon} ends")
    finally:
        _cleanup([daemon])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
@pytest.mark.process
def test_signal_to_trace_ends_every_process_of_the_run(tmp_path, sig):
    pid_file = tmp_path / "daemon.pid"
    dsd = _start(["trace", "-o", tmp_path / "trace", "--", sys.executable, DOUBLE_FORK, pid_file, "--hang"])
    daemon = command = None
    try:
        _wait_for(pid_file.exists, "the daemon starts")
        daemon = int(pid_file.read_text())
        # the command itself: the direct child of dsdoctor running double_fork.py
        _wait_for(lambda: any("double_fork" in _cmdline(p) for p in proctree.process_tree(dsd.pid)[1:]),
                  "the command runs")
        command = next(p for p in proctree.process_tree(dsd.pid)[1:] if "double_fork" in _cmdline(p))
        dsd.send_signal(sig)
        out, err = dsd.communicate(timeout=WAIT_S)
        assert dsd.returncode == 2, err[-2000:]
        assert err.strip().splitlines()[-1].startswith("dsdoctor: interrupted")  # "... by SIGTERM"
        assert "Traceback" not in err
        for pid in (daemon, command):
            _wait_for(lambda pid=pid: _gone(pid), f"process {pid} of the run ends")
    finally:
        _cleanup([daemon, command])
        if dsd.poll() is None:
            dsd.kill()
            dsd.communicate()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.process
def test_compare_launch_ends_the_launcher_tree_on_sigterm(tmp_path):
    """compare's multi-rank launch (``_run_group``) with a stand-in launcher that leaves a daemon and hangs:
    SIGTERM to the process running it ends the launcher and the daemon. Fast; the real DeepSpeed launch is
    below (marked deepspeed)."""
    pid_file = tmp_path / "daemon.pid"
    code = (
        "import sys, subprocess\n"
        "from dsdoctor.compare.launch import _run_group\n"
        "with open(sys.argv[1], 'w') as log:\n"
        "    cmd = [sys.executable, sys.argv[2], sys.argv[3], '--hang']\n"
        "    _run_group(cmd, log, None, dict(__import__('os').environ))\n"
    )
    runner = subprocess.Popen([sys.executable, "-c", code, tmp_path / "launch.log", DOUBLE_FORK, pid_file],
                              env=_env(), start_new_session=True, stderr=subprocess.PIPE, text=True)
    daemon = None
    try:
        _wait_for(pid_file.exists, "the daemon starts")
        daemon = int(pid_file.read_text())
        launcher = next(p for p in proctree.process_tree(runner.pid)[1:] if "double_fork" in _cmdline(p))
        runner.send_signal(signal.SIGTERM)
        runner.communicate(timeout=WAIT_S)
        for pid in (daemon, launcher):
            _wait_for(lambda pid=pid: _gone(pid), f"process {pid} of the launch ends")
    finally:
        _cleanup([daemon])
        if runner.poll() is None:
            runner.kill()
            runner.communicate()


@pytest.mark.process
def test_contained_run_library_ends_tagged_processes_that_escaped_to_init(tmp_path):
    """Without the subreaper (another process could be it), the run's tag in the environment still finds a
    process that double-forked away."""
    pid_file = tmp_path / "daemon.pid"
    with proctree.contained_run() as run:
        proc = run.adopt(subprocess.Popen([sys.executable, DOUBLE_FORK, pid_file], env=run.env(_env()),
                                          stdout=subprocess.DEVNULL))
        proc.wait(timeout=WAIT_S)
        _wait_for(pid_file.exists, "the daemon starts")
        daemon = int(pid_file.read_text())
        assert daemon in proctree.tagged(run.tag) and daemon in run.members()
    try:
        assert _gone(daemon)
    finally:
        _cleanup([daemon])


# ---------------------------------------------------------------------------- a real DeepSpeed compare

@pytest.mark.deepspeed
@pytest.mark.serial  # checks what dsdoctor unlinks from /dev/shm: alone (tests/conftest.py says why)
def test_sigterm_to_a_real_compare_ends_launcher_and_ranks_and_frees_their_shm(tmp_path):
    from tests.compare.test_cli import _save_tiny_llama

    model = _save_tiny_llama(tmp_path / "model")
    env = dict(deepspeed_env(), PYTHONIOENCODING="utf-8")
    env.pop("DSDOCTOR_DEBUG", None)
    # zero3 first: its ranks start at once (the plain path would run in-process before them)
    dsd = subprocess.Popen([sys.executable, "-m", "dsdoctor", "compare", str(model), "--paths", "zero3,plain",
                            "--gpus", "2", "--max-new-tokens", "200", "--out", str(tmp_path / "cmp")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    run_pids: set[int] = set()
    port = None
    try:
        def ranks_running():
            tree = proctree.process_tree(dsd.pid)[1:]
            run_pids.update(tree)
            ranks = [p for p in tree if "dsdoctor.compare.runner" in _cmdline(p) and "--local_rank" in _cmdline(p)]
            return len(ranks) >= 2

        _wait_for(ranks_running, "the launcher starts both ranks", wait_s=600)  # DeepSpeed's imports are slow
        launcher = next(p for p in run_pids if "--master_port" in _cmdline(p))
        port = re.search(r"--master_port[= ](\d+)", _cmdline(launcher)).group(1)
        # let the ranks get into their load: both have mapped their shared memory
        _wait_for(lambda: len(proctree.deepspeed_shm_files(port)) >= 2
                  and not proctree.leaked_deepspeed_shm(proctree.deepspeed_shm_files(port)),
                  "the ranks map their shared memory", wait_s=600)
        run_pids.update(proctree.process_tree(dsd.pid)[1:])
        dsd.send_signal(signal.SIGTERM)
        out, err = dsd.communicate(timeout=WAIT_S * 2)
        assert dsd.returncode == 2 and "dsdoctor: interrupted" in err, err[-3000:]
        for pid in run_pids:
            _wait_for(lambda pid=pid: _gone(pid), f"process {pid} of the compare run ends")
        assert proctree.deepspeed_shm_files(port) == set()  # only this launch's workspaces (its port)
        assert not (tmp_path / "cmp").exists()
    finally:
        _cleanup(list(run_pids))
        if dsd.poll() is None:
            dsd.kill()
            dsd.communicate()
        if port:
            proctree.unlink_leaked_deepspeed_shm(proctree.deepspeed_shm_files(port))


# ---------------------------------------------------------------------------- daemons that drop the run's tag

@pytest.mark.process
@pytest.mark.parametrize("command", [
    ("trace", "-o", "{out}"),
    ("diagnose", "--out", "{out}"),
    ("ab", "--variants", "as-is", "-o", "{out}"),
], ids=["trace", "diagnose", "ab"])
def test_a_daemon_that_clears_its_environment_ends_with_the_run(tmp_path, command):
    """The sleeper execs with an empty environment: the run's tag cannot find it, only the child subreaper
    (dsdoctor) it was re-parented to. It once survived trace, diagnose and ab."""
    pid_file = tmp_path / "daemon.pid"
    args = [a.format(out=tmp_path / "out") for a in command]
    proc = run_cli(*args, "--", sys.executable, DOUBLE_FORK, pid_file, "--untagged", timeout=WAIT_S * 4)
    daemon = int(pid_file.read_text())
    try:
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        _wait_for(lambda: _gone(daemon), f"the untagged daemon {daemon} ends")
    finally:
        _cleanup([daemon])


@pytest.mark.process
def test_contained_run_library_ends_an_untagged_orphan_and_spares_other_children(tmp_path):
    """In the library: an orphan of the run is ended although it carries no tag; a child this process
    started before the run, and the root of another open run, are left alone."""
    pid_file = tmp_path / "daemon.pid"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with proctree.contained_run() as other:
            other_root = other.adopt(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                                      env=other.env(_env())))
            with proctree.contained_run() as run:
                proc = run.adopt(subprocess.Popen([sys.executable, DOUBLE_FORK, pid_file, "--untagged"],
                                                  env=run.env(_env()), stdout=subprocess.DEVNULL))
                proc.wait(timeout=WAIT_S)
                _wait_for(pid_file.exists, "the daemon starts")
                daemon = int(pid_file.read_text())
                assert daemon not in proctree.tagged(run.tag)
                _wait_for(lambda: daemon in run.members(), "the orphan is found")
                assert bystander.pid not in run.members() and other_root.pid not in run.members()
            try:
                _wait_for(lambda: _gone(daemon), "the orphan ends with its run")
            finally:
                _cleanup([daemon])
            assert bystander.poll() is None and other_root.poll() is None  # not theirs to end
        assert other_root.poll() is not None  # ended with its own run
    finally:
        bystander.kill()
        bystander.wait()
