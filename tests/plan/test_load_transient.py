"""Plain loads of a tied model: built from its config the output layer exists twice until post_init ties it
(measured on an H200: Llama-3.2-1B and Qwen2.5-1.5B shapes, load peak = weights + lm_head to the byte in
GiB/100); from_pretrained builds on the meta device and ties first, so a directory with weights has no such
transient."""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from dsdoctor.plan.api import plan  # noqa: E402
from tests.helpers import TINY_LLAMA  # noqa: E402


def _plain(tmp_path, tied: bool, with_weights: bool):
    d = tmp_path / f"m-{tied}-{with_weights}"
    d.mkdir()
    cfg = dict(TINY_LLAMA, vocab_size=1_000_000, tie_word_embeddings=tied, torch_dtype="bfloat16")  # lm_head > workspace
    (d / "config.json").write_text(json.dumps(cfg))
    if with_weights:  # only its presence and size matter to plan's loading model
        header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
        (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    p = plan(d, batch=1, prompt_len=4, new_tokens=1, dtype="bf16", gpus=1, gpu_memory="80GiB", detect=False)
    return cfg, p.path("plain")


def test_tied_model_built_from_config_holds_a_second_lm_head_while_loading(tmp_path):
    cfg, built = _plain(tmp_path, tied=True, with_weights=False)
    _, loaded = _plain(tmp_path, tied=True, with_weights=True)
    lm_head = cfg["vocab_size"] * cfg["hidden_size"] * 2
    assert built.peak_at == "load", built
    assert built.breakdown["load_transient"] == lm_head
    assert "load_transient" not in loaded.breakdown or loaded.breakdown["load_transient"] == 0
    assert built.gpu_peak_bytes - loaded.gpu_peak_bytes == lm_head or loaded.peak_at != "load"


def test_untied_model_built_from_config_has_no_load_transient(tmp_path):
    _, built = _plain(tmp_path, tied=False, with_weights=False)
    assert built.breakdown.get("load_transient", 0) == 0
