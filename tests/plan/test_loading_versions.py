"""Host memory by the user's transformers: ``--transformers-version`` (else the installed release) decides how
``from_pretrained`` loads, every host row says which behaviour it assumes, and 1 TiB and 2 TiB hosts plan a
72B on 8 GPUs differently under transformers 4."""
from __future__ import annotations

import pytest

from dsdoctor.config import versions
from dsdoctor.errors import InputError
from dsdoctor.plan.api import plan
from dsdoctor.plan.loading import Checkpoint, loader_for, plain_methods, tp_methods, zero3_methods
from dsdoctor.plan.paths.base import for_transformers
from tests.helpers import EXAMPLES, run_cli

GiB = 2**30
Q72 = EXAMPLES / "qwen2-72b"


@pytest.mark.parametrize("version, loader", [
    ((5, 17, 0), "tf5"), ((5, 0, 0), "tf5"), ((4, 57, 1), "tf4-meta"), ((4, 51, 0), "tf4-meta"),
    ((4, 50, 0), "tf4-eager"), ((4, 44, 2), "tf4-eager"), (None, "tf5")])
def test_releases_map_to_loading_behaviours(version, loader):
    assert loader_for(version) == loader


def _ck(loader):
    return Checkpoint("safetensors", 10 * GiB, 4 * GiB, 3, "bf16", True, loader)


def test_transformers_4_before_4_51_builds_a_full_cpu_copy_per_process():
    weights = 10 * GiB
    new = {m.method: m for m in plain_methods(_ck("tf5"), "bf16", 8, weights)}
    old = {m.method: m for m in plain_methods(_ck("tf4-eager"), "bf16", 8, weights)}
    assert old["cpu-then-to"].anon_bytes - new["cpu-then-to"].anon_bytes == 8 * weights
    assert old["cpu-then-to"].assumes == "tf4-eager" and new["cpu-then-to"].assumes == "tf5"
    # a device_map loads on meta in every 4.x, one shard at a time: about one shard mapped, not the checkpoint
    assert old["to-gpu"].anon_bytes == new["to-gpu"].anon_bytes
    assert old["to-gpu"].file_bytes == min(10 * GiB, 8 * 4 * GiB) and new["to-gpu"].file_bytes == 10 * GiB
    meta = {m.method: m for m in plain_methods(_ck("tf4-meta"), "bf16", 8, weights)}
    assert meta["cpu-then-to"].anon_bytes == new["cpu-then-to"].anon_bytes  # 4.51+: views of the mapping
    cpu_model = {m.method: m for m in tp_methods(_ck("tf4-eager"), "bf16", 2, 4, weights, GiB)}
    assert cpu_model["cpu-model"].anon_bytes >= 8 * weights
    assert cpu_model["meta-checkpoint"].assumes == "deepspeed" and cpu_model["pre-sharded"].assumes == "deepspeed"
    assert "torch_dtype=DTYPE" in old["cpu-then-to"].code and "torch_dtype" not in new["cpu-then-to"].code


def test_zero3_under_transformers_4_reads_one_shard_at_a_time():
    (new,) = zero3_methods(_ck("tf5"), "bf16", 8, 10 * GiB)
    (old,) = zero3_methods(_ck("tf4-meta"), "bf16", 8, 10 * GiB)
    assert new.file_bytes == 10 * GiB and old.file_bytes == 4 * GiB and old.anon_bytes == new.anon_bytes
    assert old.assumes == "tf4-meta" and "every rank opens every shard" in old.notes[0]


def _q72(host, version=None):
    return plan(Q72, batch=1, prompt_len=512, new_tokens=128, gpus=8, gpu_memory="80GiB", host_memory=host,
                detect=False, gpu_name="A100", counts="formula", transformers_version=version)


def test_the_version_switch_changes_the_host_rows_and_1_and_2_tib_hosts_differ():
    new1, old1, old2 = _q72("1TiB"), _q72("1TiB", "4.44.2"), _q72("2TiB", "4.44.2")
    # transformers 5: every rank's CPU model is views of the mapped checkpoint; 4.44: a full copy per rank
    tp_new = next(m for m in new1.path("tp").loading_options if m["method"] == "cpu-model")
    tp_old = next(m for m in old1.path("tp").loading_options if m["method"] == "cpu-model")
    assert tp_old["anon_bytes"] - tp_new["anon_bytes"] >= 8 * 135 * GiB
    assert tp_old["assumes"] == "tf4-eager" and tp_new["assumes"] == "tf5"
    assert new1.path("tp").loading == "cpu-model"  # fits 1 TiB under transformers 5
    # 8 x 135 GiB does not fit 1 TiB, and DeepSpeed's kernel-injection loader has no policy for Qwen2 (issue 31.4)
    assert old1.path("tp").loading == "cpu-model" and not old1.path("tp").fits
    assert [m["method"] for m in old1.path("tp").loading_options] == ["cpu-model"]
    assert old2.path("tp").loading == "cpu-model"  # but fits 2 TiB
    assert old1.loading == {"version": "4.44.2", "source": "--transformers-version", "loader": "tf4-eager"}
    for res in (new1, old1):
        for p in res.paths:
            assert all(m["assumes"] for m in p.loading_options), p.name
    text = old1.to_text()
    assert "host loading: transformers 4.44.2 (--transformers-version)" in text
    assert "[transformers < 4.51]" in text or "[DeepSpeed's own loader]" in text
    assert "host loading: transformers 4.44.2" in old1.to_markdown()  # the header is shared by text and markdown
    assert "主机加载：transformers 4.44.2" in old1.to_text("zh")


def test_the_default_is_the_installed_release_read_from_its_dist_info(monkeypatch):
    monkeypatch.setattr(versions, "installed", lambda name: "4.46.3" if name == "transformers" else None)
    res = _q72("1TiB")
    assert res.loading == {"version": "4.46.3", "source": "installed", "loader": "tf4-eager"}
    monkeypatch.setattr(versions, "installed", lambda name: None)
    res = _q72("1TiB")
    assert res.loading["loader"] == "tf5" and res.loading["source"] == "assumed"
    assert "--transformers-version" in res.to_text()


def test_emitted_code_spells_the_dtype_for_the_release():
    code = ("model = AutoModelForCausalLM.from_pretrained('m', dtype=torch.bfloat16, device_map=device)\n"
            "with deepspeed.OnDevice(dtype=torch.bfloat16, device=\"meta\"):\n"
            "    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)\n"
            "engine = deepspeed.init_inference(model, dtype=torch.bfloat16)\n")
    old = for_transformers(code, "4.44.2")
    assert old.count("torch_dtype=") == 2  # from_pretrained and from_config, not OnDevice or init_inference
    assert "OnDevice(dtype=" in old and "init_inference(model, dtype=" in old
    assert for_transformers(code, "4.56.0") == code == for_transformers(code, None)
    res = plan(EXAMPLES / "llama-7b", gpus=1, gpu_memory="80GiB", host_memory="512GiB", detect=False,
               counts="formula", transformers_version="4.40.0")
    assert "torch_dtype=torch.bfloat16" in res.recommended.code


def test_a_bad_version_is_one_input_error():
    with pytest.raises(InputError, match="--transformers-version"):
        _q72("1TiB", "latest")


@pytest.mark.process
def test_cli_flag_and_bad_version(tmp_path):
    ok = run_cli("plan", "--model", EXAMPLES / "llama-7b", "--gpus", "1", "--gpu-memory", "80GiB", "--host-memory",
                 "512GiB", "--counts", "formula", "--transformers-version", "4.44.2", "--format", "json")
    assert ok.returncode == 0, ok.stderr
    assert '"loader": "tf4-eager"' in ok.stdout
    bad = run_cli("plan", "--model", EXAMPLES / "llama-7b", "--gpus", "1", "--transformers-version", "x")
    assert bad.returncode == 2 and "--transformers-version" in bad.stderr and "Traceback" not in bad.stderr
