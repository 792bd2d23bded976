import json
import sys

import pytest

from tests.helpers import ROOT, run_cli, write_model_config


@pytest.mark.process
def test_diagnose_bundled_example_writes_one_self_contained_report(tmp_path):
    out = tmp_path / "diag"
    # the machine is given, not detected: the recommendation is what the plan computes for it
    proc = run_cli("diagnose", "--out", out, "--format", "json", "--gpus", "1", "--gpu-memory", "80GiB",
                   "--host-memory", "256GiB")
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
    assert "**bundled example**" in (out / "report.md").read_text()  # never mistaken for the user's setup
    assert data["sources"] == {"config": "bundled example", "model": "bundled example",
                               "workload": "batch 1, prompt 512 tokens, 128 new tokens (defaults)",
                               "dtype": "the model's config.json"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diag"]


def test_diagnose_reads_the_config_once(tmp_path, monkeypatch):
    import dsdoctor.config.check
    import dsdoctor.config.load
    import dsdoctor.config.split
    import dsdoctor.plan.ds_knobs
    from dsdoctor.diagnose import diagnose

    calls = []
    real = dsdoctor.config.load.load_config
    for module in (dsdoctor.config.load, dsdoctor.config.check, dsdoctor.config.split, dsdoctor.plan.ds_knobs):
        monkeypatch.setattr(module, "load_config", lambda *a, **k: calls.append(a) or real(*a, **k))
    result = diagnose(out=tmp_path / "d", gpus=1, gpu_memory="80GB", host_memory="256GB")
    assert len(calls) == 1
    assert [s.key for s in result.steps] == ["effective", "need-zero3", "split", "ab", "exit"]


@pytest.mark.process
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


@pytest.mark.process
def test_diagnose_rejects_a_bad_workload_before_running_the_command(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ZERO3))
    # learned absolute positions (GPT-2): nothing runs past the table (a RoPE model is planned with DSD210)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2,
                                                   "n_positions": 128, "vocab_size": 256}))
    marker = tmp_path / "ran"
    proc = run_cli("diagnose", "--config", cfg, "--model", model, "--out", tmp_path / "d", "--prompt-len", "4096",
                   "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert proc.returncode == 2 and "max_position_embeddings" in proc.stderr
    assert not marker.exists() and not (tmp_path / "d").exists()


@pytest.mark.process
def test_diagnose_in_chinese(tmp_path):
    proc = run_cli("diagnose", "--out", tmp_path / "d", "--lang", "zh")
    assert proc.returncode == 1
    assert "推理需要 ZeRO-3 吗" in proc.stdout and "报告" in proc.stdout


ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


@pytest.mark.deepspeed
def test_diagnose_merges_and_verifies_a_real_zero3_checkpoint(tmp_path):
    from tests.checkpoint_fixtures import zero_checkpoints

    base = zero_checkpoints() / "w2"
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ZERO3))
    out = tmp_path / "diag"
    proc = run_cli("diagnose", "--config", cfg, "--model", base / "model", "--checkpoint", base / "zero3",
                   "--gpus", "1", "--gpu-memory", "80GiB", "--host-memory", "64GiB", "--prompt-len", "16",
                   "--new-tokens", "8", "--out", out, "--format", "json",
                   timeout=300)
    assert proc.returncode == 1, proc.stderr  # the optimizer section is an error finding
    data = json.loads(proc.stdout)
    exit_step = next(s for s in data["steps"] if s["step"] == "exit")
    assert data["recommended_path"] == "plain"
    assert exit_step["data"]["merged"]["verify"]["findings"] == []  # the merged weights verify clean
    assert (out / "merged" / "model.safetensors.index.json").is_file()
    assert (out / "merged" / "config.json").is_file()


@pytest.mark.process
def test_diagnose_traces_the_given_command(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ZERO3))
    model = write_model_config(tmp_path / "m")
    out = tmp_path / "diag"
    script = ROOT / "tests" / "scripts" / "generate_plain.py"
    proc = run_cli("diagnose", "--config", cfg, "--model", model, "--out", out, "--format", "json",
                   "--prompt-len", "16", "--new-tokens", "8", "--timeout", "200", "--", sys.executable, script,
                   timeout=300)
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    steps = [s["step"] for s in data["steps"]]
    assert steps == ["effective", "effective", "need-zero3", "split", "ab", "exit"]  # check, then trace
    traced = data["steps"][1]["data"]["trace"]
    assert traced["status"] == "ok" and traced["ranks"][0]["config_passed"]["api"] == "HfDeepSpeedConfig"
    ab = next(s for s in data["steps"] if s["step"] == "ab")
    assert ab["status"] == "skipped" and "GPU" in ab["summary"]  # A/B of GPU peaks needs a GPU
    assert (out / "trace" / "report.json").is_file()


@pytest.mark.process
def test_diagnose_ab_step_runs_the_variants_and_reports_them(tmp_path):
    # diagnose runs this step only where CUDA is available; here it runs on the CPU, host memory standing in
    from dsdoctor.diagnose import _step_ab

    script = ROOT / "tests" / "scripts" / "generate_plain.py"
    step, result = _step_ab([sys.executable, str(script)], tmp_path, 200, "en")  # the step, and ab's result
    assert step.key == "ab" and step.status == "done"
    variants = step.data["ab"]["variants"]
    assert [v["name"] for v in variants] == ["as-is", "no-offload-param", "split"]
    assert all(v["status"] == "ok" for v in variants)
    assert "A/B over 3 variants" in step.summary["en"] and (tmp_path / "ab" / "report.json").is_file()
    assert [v.name for v in result.variants] == [v["name"] for v in variants]  # the summary box reads the same
