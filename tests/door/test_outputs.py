"""Output-path safety shared by every writing command (dsdoctor.door): what --force may replace, device
nodes and links, the umask, the lock, signals and disk-full. Each test makes its own paths under tmp_path."""
from __future__ import annotations

import errno
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsdoctor import door, errors
from dsdoctor.door import MARKER, atomic_output_dir, atomic_write_text, check_output_path
from dsdoctor.errors import InputError
from tests.helpers import EXAMPLES, ROOT, run_cli

EXAMPLE = EXAMPLES / "train_zero3_offload.json"


def _example_config() -> Path:
    return EXAMPLE


def _write_output(target: Path, force: bool = False, **kw) -> None:
    with atomic_output_dir(target, force=force, **kw) as tmp:
        (tmp / "report.json").write_text("{}")


def _tree(p: Path) -> dict:
    return {str(q.relative_to(p)): q.read_bytes() for q in sorted(p.rglob("*")) if q.is_file()}


# ---- 1. --force replaces only what dsdoctor wrote ------------------------------------------------------------

def test_force_replaces_only_marked_folders(tmp_path):
    out = tmp_path / "out"
    _write_output(out)
    assert (out / MARKER).is_file() and (out / "report.json").is_file()
    _write_output(out, force=True)  # dsdoctor's own output: replaced
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    with pytest.raises(InputError, match="not written by dsdoctor"):
        _write_output(user, force=True)
    assert _tree(user) == {"thesis.tex": b"years of work"}
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        _write_output(tmp_path / "file", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out", "user"]  # no lock or partial left


def test_force_never_replaces_an_input_or_a_folder_holding_one(tmp_path):
    parent = tmp_path / "runs"
    ckpt = parent / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "latest").write_text("global_step1")
    (parent / MARKER).write_text("{}")  # even a folder that looks like dsdoctor's
    with pytest.raises(InputError, match="holds an input"):
        _write_output(parent, force=True, inputs=[ckpt])
    with pytest.raises(InputError, match="is an input"):
        _write_output(ckpt, force=True, inputs=[ckpt])
    assert (ckpt / "latest").read_text() == "global_step1"
    _write_output(ckpt / "merged", inputs=[ckpt])  # a new folder inside the input is fine


def test_force_never_replaces_root_home_or_the_working_directory(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "home" / "work"
    work.mkdir(parents=True)
    for d in (home, work):
        (d / MARKER).write_text("{}")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    for target, words in ((home, "home"), (work, "working directory"), (Path("/"), "root")):
        with pytest.raises(InputError, match=words):
            check_output_path(target, force=True)
    with pytest.raises(InputError, match="working directory"):
        check_output_path(".", force=True)
    assert (work / MARKER).exists() and (home / MARKER).exists()


# ---- 2. device nodes, FIFOs, sockets, links -------------------------------------------------------------------

def _specials(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    sock.close()
    link = tmp_path / "link-to-null"
    link.symlink_to("/dev/null")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    return {"fifo": fifo, "socket": sock_path, "link": link, "dangling": dangling}


def test_outputs_refuse_devices_fifos_sockets_and_links(tmp_path):
    specials = _specials(tmp_path)
    for path in [Path("/dev/null"), Path("/dev/full"), *specials.values()]:
        for force in (False, True):
            with pytest.raises(InputError):
                atomic_write_text(path, "x", force=force)
            with pytest.raises(InputError):
                _write_output(path, force=force)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and stat.S_ISCHR(os.stat("/dev/full").st_mode)
    assert stat.S_ISFIFO(os.lstat(specials["fifo"]).st_mode) and specials["link"].is_symlink()
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("device", ["/dev/null", "/dev/full"])
@pytest.mark.process
def test_split_to_a_device_with_force_leaves_the_device(device):
    proc = run_cli("split", _example_config(), "-o", device, "--force")
    assert proc.returncode == 2 and "character device" in proc.stderr and "Traceback" not in proc.stderr
    assert stat.S_ISCHR(os.stat(device).st_mode)


@pytest.mark.process
def test_split_and_diagnose_refuse_a_fifo_output_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = run_cli("split", _example_config(), "-o", fifo, "--force", timeout=60)
    assert proc.returncode == 2 and "FIFO" in proc.stderr
    proc = run_cli("diagnose", "--out", fifo, "--force", timeout=60)
    assert proc.returncode == 2 and "FIFO" in proc.stderr and "Traceback" not in proc.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# ---- umask ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_outputs_follow_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        _write_output(tmp_path / "out")
        atomic_write_text(tmp_path / "cfg.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o777 & ~mask
    assert stat.S_IMODE(os.stat(tmp_path / "out" / "report.json").st_mode) == 0o666 & ~mask
    assert stat.S_IMODE(os.stat(tmp_path / "cfg.json").st_mode) == 0o666 & ~mask


# ---- disk full -----------------------------------------------------------------------------------------------

def test_disk_full_is_one_line_naming_the_output_and_leaves_nothing(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(InputError, match="no space left on device") as err:
        with atomic_output_dir(target) as tmp:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "model-00001.safetensors"))
    assert "model-00001.safetensors" in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


# ---- signals, stale partials and the lock, with real processes ------------------------------------------------

HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from dsdoctor.door import atomic_output_dir
    try:
        with atomic_output_dir(sys.argv[1], command="test") as tmp:
            (tmp / "half.bin").write_bytes(b"x" * 1000)
            print("WRITING", flush=True)
            sys.stdin.readline()   # the test decides when this run goes on
            (tmp / "done.bin").write_bytes(b"y")
    except KeyboardInterrupt as exc:  # as dsdoctor's main does
        print(f"dsdoctor: {exc}", file=sys.stderr)
        sys.exit(2)
    print("DONE", flush=True)
""")


def _holder(target: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(target)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "WRITING", proc.stderr.read()
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
@pytest.mark.process
def test_each_signal_removes_the_partial_output(tmp_path, sig):
    target = tmp_path / "out"
    proc = _holder(target)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]  # it is mid-write
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert f"interrupted by {sig.name}" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.process
def test_killed_run_leaves_a_partial_that_the_next_run_names_and_keeps(tmp_path):
    target = tmp_path / "out"
    proc = _holder(target)
    proc.kill()  # SIGKILL: nothing can clean up
    proc.communicate(timeout=60)
    partial = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    assert len(partial) == 1 and (partial[0] / MARKER).is_file()
    seen = []
    _write_output(target, on_stale=seen.extend)
    assert [p for p, _ in seen] == partial and partial[0].exists()  # named, never deleted
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", "import sys; from dsdoctor.door import atomic_output_dir\n"
                           "with atomic_output_dir(sys.argv[1]) as t: pass", str(tmp_path / "other")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and "interrupted dsdoctor run" not in proc.stderr  # only siblings of the same name
    proc = subprocess.run([sys.executable, "-c", "import sys; from dsdoctor.door import atomic_output_dir\n"
                           "with atomic_output_dir(sys.argv[1], force=True) as t: pass", str(target)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and str(partial[0]) in proc.stderr and "rm -rf" in proc.stderr


@pytest.mark.process
def test_a_second_writer_of_the_same_output_stops_naming_the_first(tmp_path):
    target = tmp_path / "out"
    first = _holder(target)
    try:
        second = run_cli("diagnose", "--out", target, timeout=60)
        assert second.returncode == 2, second.stderr
        assert f"another dsdoctor (pid {first.pid})" in second.stderr
        with pytest.raises(InputError, match=f"pid {first.pid}"):
            _write_output(target, force=True)
    finally:
        out, err = first.communicate("go\n", timeout=60)
    assert first.returncode == 0 and "DONE" in out, err
    assert sorted(p.name for p in target.iterdir()) == sorted([MARKER, "half.bin", "done.bin"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # lock file removed


def test_signal_handlers_are_restored(tmp_path):
    before = {s: signal.getsignal(s) for s in door.SIGNALS}
    _write_output(tmp_path / "out")
    with pytest.raises(RuntimeError):
        with atomic_output_dir(tmp_path / "o2"):
            raise RuntimeError
    assert {s: signal.getsignal(s) for s in door.SIGNALS} == before


def test_printable_escapes_control_characters():
    assert errors.printable("a\nb\x1b[31mc\x00") == "a\\nb\\x1b[31mc\\x00"
    assert errors.printable("合并") == "合并"


PAUSED_DIAGNOSE = textwrap.dedent("""
    # the real `dsdoctor diagnose`, paused after its first step (before any trace) until stdin has a line
    import sys
    from dsdoctor import diagnose as d
    from dsdoctor.cli.main import main
    real = d._step_effective
    def paused(*args, **kwargs):
        out = real(*args, **kwargs)
        print("PAUSED", flush=True)
        sys.stdin.readline()
        return out
    d._step_effective = paused
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
@pytest.mark.process
def test_diagnose_interrupted_before_its_trace_step_leaves_nothing(tmp_path, sig):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_DIAGNOSE, "diagnose", "--out", str(tmp_path / "diag")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "PAUSED", proc.stderr.read()
    assert any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and f"interrupted by {sig.name}" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []
