"""The write- and read-side failures of issue 26 that are door semantics, one test per class, each with real
files and real ``dsdoctor`` processes: multi-node trace outputs and ``--report-only``, ``calibrate --out``,
``--force`` over files a user added to an earlier output, ``plan --machine`` and the cached profile, and the
calibrate probe file on a signal."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsdoctor import door
from tests.helpers import EXAMPLES, ROOT, run_cli

CPU = {"CUDA_VISIBLE_DEVICES": ""}


def _tree(p: Path) -> dict:
    return {str(q.relative_to(p)): q.read_bytes() for q in sorted(p.rglob("*")) if q.is_file()}


# ---- multi-node trace: DIR/node-K and the report files in DIR ----------------------------------------------------

def _fake_torchrun(tmp_path: Path) -> dict:
    """A ``torchrun`` on PATH that runs nothing: trace's multi-node handling is what is under test."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "torchrun"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _node(out: Path, node: int, env: dict, *extra: str):
    return run_cli("trace", "-q", "--format", "json", "--timeout", "30", "-o", out, *extra, "--", "torchrun",
                   "--nnodes", "2", "--node-rank", str(node), "infer.py", env=env, timeout=120)


def _two_nodes(out: Path, env: dict, *extra: str) -> None:
    for node in (1, 0):  # node 1 first: node 0 then finds its done.json and does not wait
        r = _node(out, node, env, *extra)
        assert r.returncode in (0, 1), r.stderr[-2000:]


@pytest.mark.process
def test_multinode_trace_replaces_only_what_dsdoctor_wrote(tmp_path):
    env = _fake_torchrun(tmp_path)
    out = tmp_path / "t"
    _two_nodes(out, env)
    assert (out / "report.json").is_file() and (out / door.MARKER).is_file()
    assert (out / "node-0" / door.MARKER).is_file() and (out / "node-1" / "done.json").is_file()
    # again without --force: node 0 refuses before it runs anything (its folder and the report are there)
    before = _tree(out)
    r = _node(out, 0, env)
    assert r.returncode == 2 and "already exists" in r.stderr and "Traceback" not in r.stderr
    assert _tree(out) == before
    # with --force both are replaced: they are dsdoctor's own
    _two_nodes(out, env, "--force")
    assert json.loads((out / "report.json").read_text())["nodes"]["node-1"]["returncode"] == 0
    # a node folder holding a file the user added is not deleted, even with --force; it is named
    (out / "node-1" / "my-notes.txt").write_text("keep me")
    r = _node(out, 1, env, "--force")
    assert r.returncode == 2 and "my-notes.txt" in r.stderr and (out / "node-1" / "my-notes.txt").is_file()


@pytest.mark.process
def test_multinode_trace_never_replaces_a_node_folder_or_report_it_did_not_write(tmp_path):
    env = _fake_torchrun(tmp_path)
    out = tmp_path / "t"
    mine = out / "node-0"
    mine.mkdir(parents=True)
    (mine / "results.csv").write_text("a user's own folder that happens to be called node-0")
    (out / "report.md").write_text("# the user's own report")
    before = _tree(out)
    for extra in ((), ("--force",)):
        r = _node(out, 0, env, *extra)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert _tree(out) == before
    assert "report.md" in r.stderr and "not written by dsdoctor" in r.stderr
    (out / "report.md").unlink()  # only the folder is in the way now
    r = _node(out, 0, env, "--force")
    assert r.returncode == 2 and "node-0" in r.stderr and "not written by dsdoctor" in r.stderr
    assert _tree(out) == {"node-0/results.csv": before["node-0/results.csv"]}


@pytest.mark.process
def test_report_only_needs_force_and_never_replaces_a_changed_report(tmp_path):
    env = _fake_torchrun(tmp_path)
    out = tmp_path / "t"
    _two_nodes(out, env)
    before = _tree(out)
    r = run_cli("trace", "--report-only", out, "--format", "json")
    assert r.returncode == 2 and "already exists" in r.stderr and "--force" in r.stderr
    assert _tree(out) == before
    r = run_cli("trace", "--report-only", out, "--format", "json", "--force")
    assert r.returncode in (0, 1), r.stderr[-2000:]
    assert sorted(json.loads((out / "report.json").read_text())["nodes"]) == ["node-0", "node-1"]
    with open(out / "report.md", "a") as fh:  # the user added notes to the report
        fh.write("\nmy notes\n")
    changed = _tree(out)
    r = run_cli("trace", "--report-only", out, "--force")
    assert r.returncode == 2 and "changed since dsdoctor wrote it" in r.stderr
    assert _tree(out) == changed


# ---- calibrate --out ------------------------------------------------------------------------------------------------

@pytest.mark.process
def test_calibrate_out_follows_the_output_rules(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    link = tmp_path / "link.json"
    link.symlink_to(victim)
    existing = tmp_path / "h200.json"
    existing.write_text("an earlier profile")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    cases = [((existing,), "already exists"), ((link,), "symbolic link"), ((link, "--force"), "symbolic link"),
             ((fifo, "--force"), "FIFO"), ((fifo,), "FIFO")]
    if os.geteuid() == 0:  # only root may write /dev/null's entry; it must stay a device all the same
        cases.append((("/dev/null", "--force"), "character device"))
    for args, why in cases:  # refused before any measuring: --budget-s would not even be reached
        r = run_cli("calibrate", "--no-cache", "--budget-s", "1", "--out", *args, env=CPU, timeout=60)
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert victim.read_text() == "precious" and link.is_symlink() and existing.read_text() == "an earlier profile"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and stat.S_ISCHR(os.lstat("/dev/null").st_mode)
    r = run_cli("calibrate", "--no-cache", "--budget-s", "1", "--out", existing, "--force", env=CPU, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(existing.read_text())["schema"] == "dsdoctor-machine-profile/1"


PAUSED_PROBE = textwrap.dedent("""
    # a real `dsdoctor calibrate --nvme-path`, the CPU steps stubbed and the probe paused once written
    import os, sys
    from dsdoctor.calibrate import measure
    from dsdoctor.cli.main import main
    measure.host_memcpy_bandwidth = lambda: 1e10
    measure.cpu_matmul_flops = lambda: 1e11
    real = measure.nvme_read_bandwidth
    measure.nvme_read_bandwidth = lambda path: real(path, size=8 * 2**20)
    def paused(*args):
        print("PROBING", flush=True)
        sys.stdin.readline()
    os.posix_fadvise = paused
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.process
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_calibrate_probe_file_is_removed_on_a_signal(tmp_path, sig):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_PROBE, "calibrate", "--no-cache", "--budget-s", "600",
                             "--nvme-path", str(nvme)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "PROBING", proc.stderr.read()
        assert [p.stat().st_size for p in nvme.iterdir()] == [8 * 2**20]  # the probe is there, written
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2 and f"interrupted by {sig.name}" in err and "Traceback" not in err, err
    assert list(nvme.iterdir()) == []


# ---- --force and what a user added inside an earlier output ----------------------------------------------------------

@pytest.mark.process
def test_force_refuses_to_delete_files_a_user_added_to_an_earlier_output(tmp_path):
    out = tmp_path / "diag"
    r = run_cli("diagnose", "--out", out, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    assert json.loads((out / door.MARKER).read_text())["files"]["report.md"] > 0  # what dsdoctor wrote, listed
    (out / "notes.txt").write_text("my notes")
    (out / "plan" / "mine").mkdir()
    before = _tree(out)
    r = run_cli("diagnose", "--out", out, "--force", timeout=300)
    assert r.returncode == 2 and "notes.txt" in r.stderr and "plan/mine/" in r.stderr, r.stderr
    assert _tree(out) == before and (out / "plan" / "mine").is_dir()
    (out / "notes.txt").unlink()
    (out / "plan" / "mine").rmdir()
    with open(out / "report.md", "a") as fh:
        fh.write("my edit")
    r = run_cli("diagnose", "--out", out, "--force", timeout=300)
    assert r.returncode == 2 and "report.md (changed since dsdoctor wrote it)" in r.stderr
    (out / "report.md").write_bytes(before["report.md"])  # as dsdoctor wrote it: replaced
    r = run_cli("diagnose", "--out", out, "--force", timeout=300)
    assert r.returncode in (0, 1), r.stderr[-2000:]


# ---- plan --machine and the cached profile --------------------------------------------------------------------------

PLAN = ("plan", "--model", EXAMPLES / "llama-7b", "--gpus", "1", "--gpu-memory", "80GiB", "--host-memory", "1TiB")


@pytest.mark.process
def test_plan_machine_profile_is_a_bounded_regular_file(tmp_path):
    fifo = tmp_path / "h200.json"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as fh:
        fh.truncate(door.MACHINE_PROFILE.max_bytes + 1)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    for bad, why in ((fifo, "FIFO"), (zero, "character device"), (huge, "too large"), (deep, "nested")):
        r = run_cli(*PLAN, "--machine", bad, timeout=60)  # a FIFO or /dev/zero once hung or filled memory here
        assert r.returncode == 2 and why in r.stderr and str(bad) in r.stderr and "Traceback" not in r.stderr, \
            (bad, r.stderr)


@pytest.mark.process
def test_a_damaged_cached_profile_is_ignored_with_a_warning(tmp_path, monkeypatch):
    from dsdoctor.calibrate.profile import cache_path, fingerprint, machine_description

    good = run_cli(*PLAN, "--format", "json", env={"DSDOCTOR_CACHE_DIR": str(tmp_path / "empty")})
    assert good.returncode in (0, 1), good.stderr[-2000:]
    env = {"DSDOCTOR_CACHE_DIR": str(tmp_path / "cache")}
    monkeypatch.setenv("DSDOCTOR_CACHE_DIR", env["DSDOCTOR_CACHE_DIR"])
    cached = cache_path(fingerprint(machine_description()))  # this machine's, as the plan process finds it
    cached.parent.mkdir(parents=True)
    damaged = {"not UTF-8": lambda p: p.write_bytes(b"\xff\xfe{garbage"),
               "nested": lambda p: p.write_text("[" * 100_000 + "]" * 100_000),
               "FIFO": os.mkfifo,
               "not a profile": lambda p: p.write_text(json.dumps({"schema": "dsdoctor-machine-profile/1",
                                                                   "measured": {"h2d_pinned": "fast"}}))}
    for what, make in damaged.items():
        if cached.exists() or cached.is_symlink():
            cached.unlink()
        make(cached)
        r = run_cli(*PLAN, "--format", "json", env=env, timeout=60)
        assert r.returncode == good.returncode, (what, r.stderr[-2000:])
        assert "ignoring the cached machine profile" in r.stderr and "Traceback" not in r.stderr, (what, r.stderr)
        assert json.loads(r.stdout) == json.loads(good.stdout), what  # the plan of a machine with no profile


# ---- a sparse file beside a checkpoint is not copied as its apparent size --------------------------------------

@pytest.mark.process
def test_merge_refuses_an_oversized_model_file_before_writing(tmp_path):
    from tests.checkpoint.test_hostile import _synthetic
    from tests.helpers import write_model_config

    ckpt, _ = _synthetic(tmp_path)
    model = write_model_config(tmp_path / "model")
    with open(model / "tokenizer.json", "wb") as fh:  # sparse: no disk used, 1 GiB + 1 to whoever copies it
        fh.truncate(door.MODEL_FILE.max_bytes + 1)
    out = tmp_path / "out"
    r = run_cli("merge", ckpt, out, "--model", model, "--quiet", timeout=120)
    assert r.returncode == 2 and "tokenizer.json" in r.stderr and "too large" in r.stderr, r.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model"]
