import json

import pytest

from tests.helpers import run_cli

pytestmark = pytest.mark.process  # every test here runs the CLI as a process


def test_env_json_reports_versions_and_memory():
    proc = run_cli("env", "--format", "json", "--no-ops")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["python"].count(".") == 2
    assert data["packages"]["torch"].startswith("2.")
    assert data["host_memory_bytes"] > 2**30
    assert isinstance(data["gpus"], list)


def test_env_text_and_markdown_with_ops():
    proc = run_cli("env")
    assert proc.returncode == 0, proc.stderr
    assert "deepspeed" in proc.stdout and "host memory" in proc.stdout
    assert "DeepSpeed ops that can build" in proc.stdout
    md = run_cli("env", "--format", "markdown", "--no-ops")
    assert md.stdout.startswith("|") and "| torch |" in md.stdout


def test_env_reports_ram_held_by_leaked_deepspeed_shm(tmp_path):
    """In a shared-memory directory of its own (DSDOCTOR_SHM_DIR): another job's files in /dev/shm, or
    another suite's cleanup of ours, cannot change what this test sees."""
    import os

    shm = tmp_path / "shm"
    shm.mkdir()
    leaked = shm / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_2_0"
    leaked.write_bytes(b"\0" * 3 * 2**20)
    data = json.loads(run_cli("env", "--format", "json", "--no-ops", env={"DSDOCTOR_SHM_DIR": str(shm)}).stdout)
    assert data["leaked_shm_bytes"] == 3 * 2**20
    assert any("DeepSpeed CPU all-reduce workspace" in n and f"rm {shm}/" in n for n in data["notes"])
