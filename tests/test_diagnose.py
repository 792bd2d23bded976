import json

from tests.helpers import run_cli, write_model_config


def test_diagnose_bundled_example_writes_one_self_contained_report(tmp_path):
    out = tmp_path / "diag"
    proc = run_cli("diagnose", "--out", out, "--format", "json")
    assert proc.returncode == 1, proc.stderr  # the example reuses a training config: error findings
    data = json.loads(proc.stdout)
    steps = {s["step"]: s for s in data["steps"]}
    assert list(steps) == ["effective", "need-zero3", "split", "ab", "exit"]
    assert steps["ab"]["status"] == "skipped"  # no command was given
    assert data["recommended_path"] == "plain"  # 7B on one 80 GB GPU
    codes = {f["code"] for f in data["findings"]}
    assert {"DSD101", "DSD102"} <= codes
    written = json.loads((out / "ds_inference.json").read_text())
    assert "optimizer" not in written and written["zero_optimization"]["stage"] == 3
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html  # the plan chart is embedded
    assert (out / "report.md").read_text().startswith("# dsdoctor diagnosis")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diag"]


def test_diagnose_refuses_to_overwrite_and_leaves_nothing_on_bad_input(tmp_path):
    out = tmp_path / "diag"
    out.mkdir()
    proc = run_cli("diagnose", "--out", out)
    assert proc.returncode == 2 and "--force" in proc.stderr and "Traceback" not in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": "three"}}')
    model = write_model_config(tmp_path / "m")
    proc = run_cli("diagnose", "--config", bad, "--model", model, "--out", tmp_path / "d2")
    assert proc.returncode == 2, proc.stdout
    assert str(bad) in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "d2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".d2")]


def test_diagnose_in_chinese(tmp_path):
    proc = run_cli("diagnose", "--out", tmp_path / "d", "--lang", "zh")
    assert proc.returncode == 1
    assert "推理需要 ZeRO-3 吗" in proc.stdout and "报告" in proc.stdout
