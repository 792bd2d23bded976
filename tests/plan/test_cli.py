"""``dsdoctor plan`` as a real process: formats, languages, plots, exit codes, errors."""
import json

import pytest

from tests.helpers import EXAMPLES, run_cli, write_model_config

pytestmark = pytest.mark.process  # every test here runs the CLI as a process

HW = ("--gpus", "1", "--gpu-memory", "80GiB", "--host-memory", "256GiB", "--gpu-name", "H100", "--counts", "formula")


def test_json_output_has_paths_and_recommendation():
    r = run_cli("plan", "--model", EXAMPLES / "llama-7b", "--batch", "4", "--prompt-len", "1024", *HW,
                "--format", "json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    names = [p["name"] for p in d["paths"]]
    assert names == ["plain", "zero3", "zero3-offload", "zero3-offload-nvme", "device-map", "vllm", "sglang",
                     "bnb-int8", "bnb-nf4", "zero3-int4", "zero3-offload-int4"]
    for p in d["paths"]:
        assert {"gpu_peak_bytes", "gpu_reserved_bytes", "host_peak_bytes", "fits", "tokens_per_s", "breakdown"} <= set(p)
        assert p["gpu_peak_bytes"] == sum(p["breakdown"].values())
        assert p["estimate"] == (p["name"] not in ("plain", "zero3", "zero3-offload", "zero3-offload-nvme"))
    assert d["recommended"]["path"] == "plain" and "from_pretrained" in d["recommended"]["code"]
    assert d["model"]["num_params"] == 6738415616


def test_text_and_chinese_and_markdown():
    en = run_cli("plan", "--model", EXAMPLES / "llama-7b", *HW)
    assert en.returncode == 0 and "recommended: plain" in en.stdout and "GPU peak" in en.stdout
    zh = run_cli("plan", "--model", EXAMPLES / "llama-7b", *HW, "--lang", "zh")
    assert "推荐" in zh.stdout and "每卡峰值构成" in zh.stdout
    md = run_cli("plan", "--model", EXAMPLES / "llama-7b", *HW, "--format", "markdown")
    assert md.stdout.startswith("# dsdoctor plan") and "| plain* |" in md.stdout


def test_training_config_gives_warnings_and_fail_on(tmp_path):
    args = ("plan", "--model", EXAMPLES / "llama-7b", *HW, "--config", EXAMPLES / "train_zero3_offload.json")
    assert run_cli(*args).returncode == 0
    r = run_cli(*args, "--fail-on", "warning")
    assert r.returncode == 1 and "DSD201" in r.stdout and "DSD203" in r.stdout


def test_plot_writes_png_and_self_contained_html(tmp_path):
    out = tmp_path / "plots"
    r = run_cli("plan", "--model", EXAMPLES / "llama-7b", *HW, "--plot", out)
    assert r.returncode == 0, r.stderr
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "plan.html").read_text()
    assert "<svg" in page and "src=" not in page and "<script" not in page
    again = run_cli("plan", "--model", EXAMPLES / "llama-7b", *HW, "--plot", out)
    assert again.returncode == 2 and "--force" in again.stderr and "Traceback" not in again.stderr
    assert run_cli("plan", "--model", EXAMPLES / "llama-7b", *HW, "--plot", out, "--force").returncode == 0


def test_bad_inputs_are_one_line_exit_2(tmp_path):
    missing = run_cli("plan", "--model", tmp_path / "nope", *HW)
    assert missing.returncode == 2 and "no config.json" in missing.stderr and "Traceback" not in missing.stderr
    bad = write_model_config(tmp_path / "m", num_hidden_layers="two")
    r = run_cli("plan", "--model", bad, *HW)
    assert r.returncode == 2 and "num_hidden_layers" in r.stderr
    r = run_cli("plan", "--model", EXAMPLES / "llama-7b", *HW, "--gpu-memory", "lots")
    assert r.returncode == 2 and "lots" in r.stderr
    cfg = tmp_path / "ds.json"
    cfg.write_text("{not json")
    r = run_cli("plan", "--model", EXAMPLES / "llama-7b", *HW, "--config", cfg)
    assert r.returncode == 2 and "ds.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_explain_knows_plan_codes_without_torch():
    r = run_cli("explain", "DSD201", "--lang", "zh")
    assert r.returncode == 0 and "ZeRO-3" in r.stdout and "应改为" in r.stdout
    code = ("import sys, dsdoctor.findings, dsdoctor.cli.plan; "
            "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules")
    import subprocess
    import sys

    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
