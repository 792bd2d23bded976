import json

from tests.helpers import run_cli


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
