"""Errors that point one step further: a model folder with custom code (no DeepSpeed needed)."""
from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli, write_model_config

pytestmark = pytest.mark.process


def test_custom_code_model_says_why_and_what_to_pass(tmp_path):
    model = write_model_config(tmp_path / "custom", model_type="my-llama", architectures=["MyLlamaForCausalLM"],
                               auto_map={"AutoConfig": "configuration_my.MyConfig",
                                         "AutoModelForCausalLM": "modeling_my.MyLlamaForCausalLM"})
    (model / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    proc = run_cli("verify", model, "--model", model)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = proc.stderr.strip()
    assert "\n" not in err and "\\n" not in err and "hf.co" not in err  # one line, no hub URL for a local folder
    assert "modeling_my.MyLlamaForCausalLM" in err and "never runs code from a model folder" in err
    assert "--model" in err and "transformers ships" in err
    shipped = write_model_config(tmp_path / "shipped", auto_map={"AutoModelForCausalLM": "modeling_x.X"})
    (shipped / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    proc = run_cli("verify", shipped, "--model", shipped, "--format", "json")
    assert "never runs code" not in proc.stderr  # llama is transformers' own: the auto_map is not needed
    assert proc.returncode == 1 and json.loads(proc.stdout)["findings"][0]["code"] == "DSD401"
