"""Guards against what once ran CI past its limit: leaked DeepSpeed shared memory, orphaned ranks."""
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsdoctor import proctree
from dsdoctor.proctree import alive
from tests.helpers import run_process


def test_leaked_deepspeed_shm_is_unlinked_and_a_mapped_one_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(proctree, "SHM_DIR", str(tmp_path))  # a directory of its own: no other job's files
    prefix = tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_1"
    live, dead = Path(f"{prefix}_0"), Path(f"{prefix}_1")
    for path in (live, dead):
        path.write_bytes(b"\0" * 8192)
    fd = os.open(live, os.O_RDWR)
    mapping = mmap.mmap(fd, 8192)
    try:
        assert proctree.unlink_leaked_deepspeed_shm() == 8192
        assert live.exists() and not dead.exists()
    finally:
        mapping.close()
        os.close(fd)
    assert proctree.unlink_leaked_deepspeed_shm() == 8192 and not live.exists()


def test_shm_files_of_one_launch_are_told_apart_by_port(tmp_path, monkeypatch):
    monkeypatch.setattr(proctree, "SHM_DIR", str(tmp_path))
    for name in ("127.0.0.1_29500_0", "127.0.0.1_29500_1", "127.0.0.1_2950_0", "localhost_129500_0"):
        (tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_{name}").write_bytes(b"x")
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_"
    assert proctree.deepspeed_shm_files(29500) == {prefix + "127.0.0.1_29500_0", prefix + "127.0.0.1_29500_1"}
    assert len(proctree.deepspeed_shm_files()) == 4


def test_another_workers_fresh_workspace_is_never_taken_for_a_leak(tmp_path, monkeypatch):
    """A rank writes 66 MB into its new workspace before it maps it: unmapped but live. At the end of a session
    only workspaces last written long ago count as leaked (after each test: only this process's ports)."""
    from tests import conftest

    monkeypatch.setattr(proctree, "SHM_DIR", str(tmp_path))
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_"
    fresh, stale = tmp_path / f"{prefix}1111_0", tmp_path / f"{prefix}2222_0"
    for path in (fresh, stale):
        path.write_bytes(b"\0" * 4096)
    long_ago = time.time() - conftest.STALE_S - 10
    os.utime(stale, (long_ago, long_ago))
    assert conftest._leaked_and_stale({fresh.name, stale.name}) == {stale.name}


@pytest.mark.process
def test_timeout_ends_the_grandchildren_too():
    """subprocess.run kills only its child on a timeout: a launcher's ranks (grandchildren) would live on,
    holding memory and CPU for the rest of the suite."""
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
            "print(p.pid, flush=True); time.sleep(300)")
    for limit in (3, 30):  # the child must have started the grandchild by then: longer on a loaded machine
        with pytest.raises(subprocess.TimeoutExpired) as err:
            run_process([sys.executable, "-c", code], timeout=limit)
        if err.value.output.strip():
            break
    grandchild = int(err.value.output.split()[0])
    for _ in range(50):
        if not alive(grandchild):
            break
        time.sleep(0.1)
    assert not alive(grandchild)


@pytest.mark.process
@pytest.mark.parametrize("required", ["1", ""])
def test_corpus_tests_fail_when_required_and_skip_otherwise_when_the_corpus_is_missing(tmp_path, required):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, CI="true", DSDOCTOR_REQUIRE_CORPUS=required, DSDOCTOR_CORPUS=str(tmp_path / "no-corpus"),
               PYTHONPATH=str(root / "src"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                           "--continue-on-collection-errors", str(root / "tests" / "config/test_corpus.py"),
                           str(root / "tests" / "config/test_runner.py"),
                           "-k", "test_corpus or corpus_trainer_yaml or ms_swift_builtin_names"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    runner = ("test_corpus_trainer_yaml_is_read_as_llamafactory_training",
              "test_ms_swift_builtin_names_match_the_files_ms_swift_ships[zero3]")
    if required:
        assert proc.returncode not in (0, 5) and "config corpus not found" in proc.stdout, proc.stdout[-2000:]
        assert all(f"FAILED tests/config/test_runner.py::{name}" in proc.stdout for name in runner), proc.stdout[-2000:]
    else:
        assert proc.returncode in (0, 5) and "skipped" in proc.stdout, proc.stdout[-2000:]  # 5: nothing collected
        assert "failed" not in proc.stdout and "error" not in proc.stdout.lower(), proc.stdout[-2000:]

GUARDED = '''
import multiprocessing, os, subprocess, sys
import pytest

def test_unmarked_subprocess():
    subprocess.run([sys.executable, "-c", "pass"])

def test_unmarked_and_swallowed():
    try:
        subprocess.run([sys.executable, "-c", "pass"])
    except BaseException:
        pass

def test_unmarked_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)

def test_unmarked_os_system():
    os.system("true")

def test_unmarked_multiprocessing_spawn():
    child = multiprocessing.get_context("spawn").Process(target=print)
    child.start()
    child.join()

def test_in_process():
    assert sum([1, 2]) == 3

@pytest.mark.process
def test_marked():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0

@pytest.mark.deepspeed
def test_marked_deepspeed():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
'''


@pytest.mark.process
def test_a_test_that_starts_a_process_without_the_marker_fails_naming_the_marker(tmp_path):
    """tests/conftest.py holds every test to its markers: make test-fast (-m "not process") starts no process."""
    (tmp_path / "test_guarded.py").write_text(GUARDED)
    root = Path(__file__).resolve().parents[1]
    base = [sys.executable, "-m", "pytest", "-c", str(root / "pyproject.toml"), "--rootdir", str(tmp_path),
            "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", "-rfEp", str(tmp_path / "test_guarded.py")]
    proc = run_process(base, cwd=root, env=dict(os.environ, PYTHONPATH=str(root / "src")), timeout=300)
    lines = proc.stdout.splitlines()
    failed = {line.split("::")[1].split()[0] for line in lines if line.startswith("FAILED")}
    passed = {line.split("::")[1].split()[0] for line in lines if line.startswith("PASSED")}
    assert failed == {"test_unmarked_subprocess", "test_unmarked_and_swallowed", "test_unmarked_fork",
                      "test_unmarked_os_system", "test_unmarked_multiprocessing_spawn"}, proc.stdout[-3000:]
    assert passed == {"test_in_process", "test_marked", "test_marked_deepspeed"}, proc.stdout[-3000:]
    assert "has no `process` marker: add @pytest.mark.process" in proc.stdout
    fast = run_process(base + ["-m", "not process"], cwd=root, env=dict(os.environ, PYTHONPATH=str(root / "src")),
                       timeout=300)
    assert "2 deselected" in fast.stdout, fast.stdout[-3000:]  # deepspeed counts as process
