"""plan --loop: generation inside training adds the paths zero2 and zero3-gather-once (plan/paths/loop.py)."""
import json

import pytest

from dsdoctor.plan.api import plan
from tests.helpers import EXAMPLES, run_cli

LLAMA_7B = EXAMPLES / "llama-7b"
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
             "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
             "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256}


def _plan(model, gpus, gpu_memory="141GiB", loop=True):
    return plan(model, batch=4, prompt_len=512, new_tokens=32, gpus=gpus, gpu_memory=gpu_memory,
                host_memory="1TiB", detect=False, gpu_name="H200", counts="formula", loop=loop)


def test_loop_paths_only_in_loop_mode():
    names = [p.name for p in _plan(LLAMA_7B, 2, loop=False).paths]
    assert "zero3-gather-once" not in names and "zero2" not in names
    names = [p.name for p in _plan(LLAMA_7B, 2).paths]
    assert "zero3-gather-once" in names and "zero2" in names


def test_gather_once_holds_the_whole_model_and_runs_near_plain_speed():
    r = _plan(LLAMA_7B, 2)
    once, z3, plain = r.path("zero3-gather-once"), r.path("zero3"), r.path("plain")
    weights = r.model["num_params"] * 2
    assert once.breakdown["gathered_whole_model"] + once.breakdown.get("persistent_params", 0) == weights
    # the loop's training state is on both ZeRO-3 paths; gather-once adds the whole weights on top
    assert once.breakdown["optimizer_state"] == z3.breakdown["optimizer_state"] > 0
    assert once.gpu_peak_bytes > z3.gpu_peak_bytes
    assert z3.tokens_per_s < once.tokens_per_s < plain.tokens_per_s  # plus one all-gather per generate
    assert r.recommended.path in ("zero2", "zero3-gather-once")
    codes = [f.code for f in r.findings]
    assert "DSD207" in codes and "DSD208" not in codes


def test_gather_once_that_does_not_fit_is_said(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    r = _plan(tmp_path, 8, gpu_memory="80GiB")
    assert not r.path("zero3-gather-once").fits and not r.path("zero2").fits
    codes = [f.code for f in r.findings]
    assert "DSD208" in codes and "DSD207" not in codes and "DSD209" not in codes
    assert r.recommended.path is None or r.recommended.path.startswith("zero3")


@pytest.mark.process
def test_cli_loop_flag_and_json():
    r = run_cli("plan", "--model", str(LLAMA_7B), "--gpus", "2", "--gpu-memory", "141GiB", "--host-memory",
                "1TiB", "--gpu-name", "H200", "--counts", "formula", "--batch", "4", "--new-tokens", "32", "--loop",
                "--format", "json")
    assert r.returncode in (0, 1), r.stderr
    data = json.loads(r.stdout)
    once = next(p for p in data["paths"] if p["name"] == "zero3-gather-once")
    assert once["fits"] and "gathered_whole_model" in once["breakdown"]
    assert "unwrap_model_for_generation" in json.dumps(data) or data["recommendation"]["path"] == "zero2"


def test_gather_once_where_zero2_does_not_fit_is_at_the_edge_and_zero3_fits_outright():
    """ZeRO-2 trains with the whole weights beside the activations; ZeRO-3 with its shards. On a GPU 1 GiB above
    ZeRO-3's upper figure (its measured band) gather-once's prediction fits, its upper figure (no loop run is
    archived: the widest band) does not: ZeRO-3, which fits outright, is recommended, and DSD234 says what settles
    gather-once."""
    zero3_upper = _plan(LLAMA_7B, 2, gpu_memory="80GiB").path("zero3").upper_bytes
    r = _plan(LLAMA_7B, 2, gpu_memory=f"{zero3_upper + 2**30}")
    z2, once = r.path("zero2"), r.path("zero3-gather-once")
    assert z2.peak_at == "train-step" and "training_activations" in z2.breakdown
    assert once.fits and once.verdict == "edge" and not z2.fits
    assert r.recommended.path == "zero3" and r.path("zero3").verdict == "fits"
    edge = next(f for f in r.findings if f.code == "DSD234")
    assert "zero3-gather-once" in edge.values["paths"] and "set_per_process_memory_fraction" in edge.fix("en")
    assert "--measure`" not in edge.fix("en")  # plan --measure runs no training loop
    z2_line = z2.gpu_reserved_bytes + z2.gpu_outside_allocator_bytes
    roomy = _plan(LLAMA_7B, 2, gpu_memory=f"{max(once.upper_bytes, z2_line) + 2**30}")  # gather-once fits, zero2 edge
    assert roomy.path("zero3-gather-once").verdict == "fits" and roomy.path("zero2").verdict == "edge"
    assert roomy.recommended.path == "zero3-gather-once"
    assert "unwrap_model_for_generation" in roomy.recommended.code
