"""Issue 26, half-written files and leaks, with real processes:

- calibrate's probe file: removed on SIGTERM wherever the write is; one left by SIGKILL is removed (and named)
  by the next calibrate in that folder, never one a live calibrate holds;
- a config that names a file outside the user's tree (``deepspeed_config_file: /etc/shadow``): refused
  before a byte of it is parsed, quoted or written into an output."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, ROOT, run_cli

WAIT_S = 120  # a guard against a hung suite, not a timing assertion

PAUSED_PROBE = textwrap.dedent("""
    # a real `dsdoctor calibrate --nvme-path`, the CPU steps stubbed, paused once at the named point of the probe
    import os, sys
    from dsdoctor.calibrate import measure
    from dsdoctor.cli.main import main
    measure.host_memcpy_bandwidth = lambda: 1e10
    measure.cpu_matmul_flops = lambda: 1e11
    real = measure.nvme_read_bandwidth
    measure.nvme_read_bandwidth = lambda path: real(path, size=16 * 2**20)
    where = os.environ["PAUSE_AT"]
    original = getattr(os, where)
    def paused(*args):
        if not getattr(paused, "done", False):
            paused.done = True
            print("PROBING", flush=True)
            sys.stdin.readline()
        return original(*args)
    setattr(os, where, paused)
    sys.exit(main(sys.argv[1:]))
""")


def _paused_calibrate(nvme: Path, where: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="", PAUSE_AT=where)
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_PROBE, "calibrate", "--no-cache", "--budget-s", "600",
                             "--nvme-path", str(nvme)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "PROBING", proc.stderr.read()
    return proc


@pytest.mark.process
@pytest.mark.parametrize("where", ["fsync", "posix_fadvise"])
def test_sigterm_anywhere_in_the_probe_leaves_nothing(tmp_path, where):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    proc = _paused_calibrate(nvme, where)
    try:
        assert len(list(nvme.iterdir())) == 1  # the probe is there
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2 and "interrupted by SIGTERM" in err and "Traceback" not in err, err
    assert list(nvme.iterdir()) == []


@pytest.mark.process
def test_a_probe_left_by_sigkill_is_removed_by_the_next_calibrate_and_a_live_one_is_kept(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    killed = _paused_calibrate(nvme, "posix_fadvise")
    (left,) = nvme.iterdir()
    killed.kill()
    killed.communicate(timeout=WAIT_S)
    assert left.exists() and left.stat().st_size == 16 * 2**20  # SIGKILL cannot be handled
    live = _paused_calibrate(nvme, "posix_fadvise")  # a second calibrate: removes the dead one, keeps its own
    try:
        (own,) = nvme.iterdir()
        assert own != left
        third = run_cli("calibrate", "--no-cache", "--budget-s", "1", "--nvme-path", nvme,
                        env={"CUDA_VISIBLE_DEVICES": ""}, timeout=WAIT_S * 2)
        assert third.returncode == 0, third.stderr[-2000:]
        assert own.exists(), "a live calibrate's probe was removed"
        live.stdin.write("\n")
        live.stdin.flush()
        out, err = live.communicate(timeout=WAIT_S)
    finally:
        if live.poll() is None:
            live.kill()
    assert live.returncode == 0 and f"removed {left}" in err and "killed dsdoctor calibrate" in err, err
    assert list(nvme.iterdir()) == []


# ---- a config naming a file outside the user's tree -----------------------------------------------------------------

SECRET = "root:$6$hashhashhash:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n"


def _refs(tmp_path: Path) -> dict[str, Path]:
    hidden = tmp_path / "home" / ".ssh"
    hidden.mkdir(parents=True)
    (hidden / "id_rsa").write_text(SECRET)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text(SECRET)
    refs = {"hidden folder": hidden / "id_rsa", "outside": elsewhere / "notes.txt", "/etc/passwd": Path("/etc/passwd")}
    if os.access("/etc/shadow", os.R_OK):  # as root, the original report
        refs["/etc/shadow"] = Path("/etc/shadow")
    return refs


def _project(tmp_path: Path, ref: Path, flavour: str) -> Path:
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    if flavour == "accelerate":
        text = f"distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  deepspeed_config_file: {ref}\n"
        path = project / "acc.yaml"
    elif flavour == "trainer":
        text = f"model_name_or_path: m\noutput_dir: out\ndeepspeed: {ref}\n"
        path = project / "train.yaml"
    else:
        text = f"deepspeed train.py --deepspeed_config {ref}\n"
        path = project / "run.sh"
    path.write_text(text)
    return path


@pytest.mark.process
@pytest.mark.parametrize("flavour", ["accelerate", "trainer", "command"])
def test_a_config_naming_a_file_outside_the_users_tree_is_refused_unread(tmp_path, flavour):
    for what, ref in _refs(tmp_path).items():
        config = _project(tmp_path, ref, flavour)
        out = tmp_path / "project" / "split.json"
        for command in (("split", config, "-o", out), ("check", config),
                        ("plan", "--model", EXAMPLES / "llama-7b", "--config", config, "--counts", "formula")):
            r = run_cli(*command, cwd=tmp_path / "project", timeout=WAIT_S)
            assert r.returncode == 2 and str(ref) in r.stderr and "not a DeepSpeed config" in r.stderr, \
                (what, command, r.stderr)
            shown = r.stdout + r.stderr
            assert not any(line[:12] in shown for line in _lines(ref)), (what, command, shown)
            assert not out.exists()


def _lines(path: Path) -> list[str]:
    """The first lines of a file, as an echo of it would show them."""
    return [line for line in path.read_text(errors="replace").splitlines()[:5] if len(line) >= 12]


@pytest.mark.process
def test_a_real_deepspeed_config_outside_the_tree_is_still_read(tmp_path):
    elsewhere = tmp_path / "shared"
    elsewhere.mkdir()
    ds = elsewhere / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}))
    config = _project(tmp_path, ds, "accelerate")
    r = run_cli("split", config, "-o", tmp_path / "project" / "infer.json", cwd=tmp_path / "project", timeout=WAIT_S)
    assert r.returncode in (0, 1), r.stderr
    assert json.loads((tmp_path / "project" / "infer.json").read_text())["zero_optimization"]["stage"] == 3


@pytest.mark.process
def test_a_system_file_named_on_the_command_line_is_refused_unread(tmp_path):
    r = run_cli("split", "/etc/passwd", "-o", tmp_path / "out.json", timeout=WAIT_S)
    assert r.returncode == 2 and "not a DeepSpeed config" in r.stderr, r.stderr
    assert not any(line[:12] in r.stdout + r.stderr for line in _lines(Path("/etc/passwd")))
    assert not (tmp_path / "out.json").exists()
