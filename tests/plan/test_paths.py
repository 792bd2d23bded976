"""Load paths beyond the first five: tensor-parallel groups with replicas, loading methods and host memory,
the run dtype on GPUs without bf16, and runs past max_position_embeddings."""
import functools
import json
import os
import subprocess
import sys

import pytest

from dsdoctor.errors import InputError
from dsdoctor.plan.api import plan
from dsdoctor.plan.loading import (
    PROCESS_BASE,
    PROCESS_FILE,
    ZERO3_RUNTIME,
    find_checkpoint,
    plain_methods,
    tp_methods,
    zero3_methods,
)
from dsdoctor.plan.paths.tp import tp_splits
from tests.helpers import EXAMPLES, ROOT, run_cli

QWEN72 = EXAMPLES / "qwen2-72b"


@functools.cache
def _qwen(gpus, **kw):  # a 72B plan takes seconds: tests that read the same plan share it
    return _plan(QWEN72, gpus, **kw)


def _plan(model, gpus, **kw):
    kw.setdefault("counts", "formula")
    kw.setdefault("gpu_name", "H100")
    return plan(model, batch=kw.pop("batch", 8), prompt_len=kw.pop("prompt_len", 512),
                new_tokens=kw.pop("new_tokens", 128), gpus=gpus, gpu_memory=kw.pop("gpu_memory", "80GiB"),
                host_memory=kw.pop("host_memory", "1TiB"), detect=False, **kw)


def codes(r):
    return {f.code for f in r.findings}


def test_splits_divide_gpus_and_heads():
    assert tp_splits(8, 64, 8) == [(4, 2), (2, 4)]
    assert tp_splits(8, 12, 4) == [(4, 2), (2, 4)]
    assert tp_splits(8, 12, 6) == [(2, 4)]  # 6 key/value heads do not split 4 ways
    assert tp_splits(2, 32, 8) == []  # tp over both GPUs is the plain "tp" path
    assert tp_splits(6, 40, 8) == [(2, 3)]


def test_qwen2_72b_on_8x80_with_1tib_is_tensor_parallel_not_zero3():
    r = _qwen(8)
    names = [p.name for p in r.paths]
    assert {"tp", "tp4x2", "tp2x4", "zero3"} <= set(names)
    chosen = r.path(r.recommended.path)
    assert chosen.tp is not None and chosen.fits, r.recommended.why["en"]
    assert chosen.host_peak_bytes <= 1024**4
    # the machine serves replicas x (a batch per group): faster than ZeRO-3 over all 8 GPUs
    zero3 = r.path("zero3")
    assert chosen.tokens_per_s * chosen.replicas > zero3.tokens_per_s * zero3.replicas
    assert "deepspeed.init_inference" in r.recommended.code


def test_a_group_of_k_gpus_has_the_per_gpu_peak_of_tp_over_k():
    eight = _qwen(8)
    four = _plan(QWEN72, 4)
    g, t = eight.path("tp4x2"), four.path("tp")
    assert g.gpu_peak_bytes == t.gpu_peak_bytes and g.ranks == 4 and g.replicas == 2
    assert g.breakdown == t.breakdown


def test_fp16_from_a_bf16_checkpoint_needs_a_loading_method_that_avoids_per_rank_copies():
    """Every rank converts its own CPU copy (8 x 135 GiB does not fit 1 TiB); the methods that avoid it load
    through kernel injection, which DeepSpeed 0.19.8 has no policy for on Qwen2 (issue 31.4): no tp row fits,
    and no init_inference code is emitted (tests/plan/test_emitted_code.py: a Llama it can inject)."""
    r = _qwen(8, dtype="fp16")
    tp = r.path("tp")
    cpu = next(m for m in tp.loading_options if m["method"] == "cpu-model")
    weights = r.weights_only_bytes
    assert cpu["anon_bytes"] >= 8 * weights > 1024**4
    assert [m["method"] for m in tp.loading_options] == ["cpu-model"] and not tp.fits and "host" in tp.limits
    assert r.path(r.recommended.path).tp is None and "init_inference" not in r.recommended.code


def test_host_memory_too_small_for_any_tp_loading_drops_tp():
    r = _plan(QWEN72, 8, dtype="fp16", host_memory="40GiB")
    for p in r.paths:
        if p.tp:
            assert not p.fits and "host" in p.limits


def test_loading_methods_tell_anonymous_from_file_backed(tmp_path):
    (tmp_path / "config.json").write_text((EXAMPLES / "llama-7b" / "config.json").read_text())
    for i in range(3):
        (tmp_path / f"model-0000{i + 1}-of-00003.safetensors").write_bytes(b"\0" * (1000 + i))
    ck = find_checkpoint(str(tmp_path / "config.json"), 10**9, "bf16")
    assert (ck.format, ck.files, ck.total_bytes, ck.largest_file_bytes, ck.seen) == ("safetensors", 3, 3003, 1002, True)
    to_gpu, cpu = plain_methods(ck, "bf16", 2, 10**9)
    # straight to the GPU: every page read while every file is mapped; each process's RSS shows them
    assert to_gpu.anon_bytes == 2 * PROCESS_BASE and to_gpu.file_bytes == 3003
    assert to_gpu.file_rss_bytes == 2 * (3003 + PROCESS_FILE)
    # on the CPU, no conversion: views, then .to() reads one file at a time: the largest file per process
    assert cpu.anon_bytes == 2 * PROCESS_BASE and cpu.file_rss_bytes == 2 * (1002 + PROCESS_FILE)
    assert cpu.file_bytes == 2004  # two processes, each on one file: at most two files in the page cache
    assert cpu.rss_bytes == cpu.anon_bytes + cpu.file_rss_bytes
    _, converted = plain_methods(ck, "fp16", 2, 10**9)
    assert converted.anon_bytes == 2 * PROCESS_BASE + 2 * 10**9  # conversion on the CPU copies
    assert converted.file_rss_bytes == 2 * (3003 + PROCESS_FILE)  # ... and reads every page while all are mapped
    (zero,) = zero3_methods(ck, "bf16", 4, 10**9)
    assert zero.anon_bytes == 4 * (PROCESS_BASE + ZERO3_RUNTIME) and zero.base_bytes == zero.anon_bytes
    assert zero.file_rss_bytes == 3003 + 4 * PROCESS_FILE  # rank 0 reads the checkpoint, the others keys
    cpu_model = next(m for m in tp_methods(ck, "bf16", 1, 2, 10**9, 10**6) if m.method == "cpu-model")
    assert cpu_model.anon_bytes == 2 * PROCESS_BASE and cpu_model.file_rss_bytes == cpu.file_rss_bytes
    sliced = next(m for m in tp_methods(ck, "bf16", 2, 1, 10**9, 10**6) if m.method == "cpu-model")
    assert sliced.anon_bytes == 2 * (PROCESS_BASE + 10**6)  # tp > 1: one weight sliced on the CPU at a time
    meta = next(m for m in tp_methods(ck, "bf16", 4, 2, 10**9, 10**6) if m.method == "meta-checkpoint")
    assert meta.anon_bytes == 8 * (PROCESS_BASE + 1002) and meta.file_bytes == 0


def test_one_file_checkpoint_is_whole_either_way(tmp_path):
    (tmp_path / "config.json").write_text((EXAMPLES / "llama-7b" / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 5000)
    ck = find_checkpoint(str(tmp_path / "config.json"), 10**9, "bf16")
    to_gpu, cpu = plain_methods(ck, "bf16", 1, 10**9)
    assert to_gpu.file_rss_bytes == cpu.file_rss_bytes == 5000 + PROCESS_FILE


def test_legacy_bin_is_read_whole(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02legacy pickle")
    ck = find_checkpoint(str(tmp_path / "config.json"), 10**9, "bf16")
    assert ck.format == "bin-legacy"
    to_gpu, _ = plain_methods(ck, "bf16", 1, 10**9)
    assert to_gpu.anon_bytes == PROCESS_BASE + ck.total_bytes and to_gpu.file_bytes == 0
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04zip")
    assert find_checkpoint(str(tmp_path / "config.json"), 10**9, "bf16").format == "bin"


def test_v100_gets_fp16_config_and_code(tmp_path):
    r = _plan(QWEN72, 4, gpu_name="Tesla V100-SXM2-32GB", gpu_memory="32GiB", batch=1)
    assert "DSD211" in codes(r)
    assert r.recommended.path is not None
    if r.recommended.ds_config:
        assert "bf16" not in r.recommended.ds_config and r.recommended.ds_config["fp16"]["enabled"] is True
    assert "torch.bfloat16" not in r.recommended.code and "torch.float16" in r.recommended.code
    a100 = _plan(QWEN72, 4, gpu_name="A100-SXM4-80GB", batch=1)
    assert "DSD211" not in codes(a100)


def test_zero3_config_follows_fp16(tmp_path):
    r = _plan(QWEN72, 1, dtype="fp16", batch=1)
    assert r.recommended.path.startswith("zero3")
    assert r.recommended.ds_config["fp16"] == {"enabled": True} and "bf16" not in r.recommended.ds_config
    assert "'fp16': {'enabled': True}" in r.recommended.code  # a Python dict in the code (JSON's true is no name)


def _write(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_rope_model_past_its_limit_is_planned_with_a_warning(tmp_path):
    cfg = json.loads((EXAMPLES / "llama-7b" / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    r = _plan(_write(tmp_path, cfg), 1, prompt_len=4096, new_tokens=64, batch=1)
    assert "DSD210" in codes(r) and r.recommended.path == "plain"
    assert r.path("plain").max_prompt_len >= 4096
    ok = _plan(tmp_path, 1, prompt_len=4000, new_tokens=64, batch=1)
    assert "DSD210" not in codes(ok)


GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12,
        "n_positions": 1024, "vocab_size": 50257}


@pytest.mark.process
def test_learned_positions_cannot_run_past_the_table(tmp_path):
    _write(tmp_path, GPT2)
    with pytest.raises(InputError, match="1088 exceeds"):
        _plan(tmp_path, 1, prompt_len=1024, new_tokens=64, batch=1)
    r = run_cli("plan", "--model", tmp_path, "--prompt-len", "1024", "--new-tokens", "64", "--gpus", "1",
                "--gpu-memory", "80GiB", "--host-memory", "64GiB", "--counts", "formula")
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.process
def test_json_has_loading_and_options():
    r = run_cli("plan", "--model", QWEN72, "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "1TiB",
                "--gpu-name", "H100", "--counts", "formula", "--format", "json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    tp = next(p for p in d["paths"] if p["name"] == "tp4x2")
    assert tp["tp"] == 4 and tp["replicas"] == 2 and tp["loading"] in {m["method"] for m in tp["loading_options"]}
    for m in tp["loading_options"]:
        assert m["peak_bytes"] == m["anon_bytes"]  # mapped file pages are reported, not counted
    assert tp["host_file_bytes"] >= 0
    zh = run_cli("plan", "--model", QWEN72, "--gpus", "8", "--gpu-memory", "80GiB", "--host-memory", "1TiB",
                 "--gpu-name", "H100", "--counts", "formula", "--lang", "zh")
    assert "加载方法" in zh.stdout


# --------------------------------------------------------------------------- estimates: device_map, quantized

def test_device_map_spreads_layers_like_accelerate_and_offloads_the_rest():
    from dsdoctor.plan.paths.device_map import place

    GiB = 1024**3
    units = [("embed", 2 * GiB, None)] + [(f"layer{i}", GiB, i) for i in range(10)] + [("lm_head", 2 * GiB, None)]
    where, limits = place(units, 2, 10 * GiB, 100 * GiB)
    # balanced: GPU 0 gets at most 14/2 + 1.25 x 2 = 9.5 GiB, minus room for the largest unit still to place
    assert limits[0] == int(7 * GiB + 1.25 * 2 * GiB) and limits[1] == 10 * GiB
    on0 = sum(s for n, s, _ in units if where[n] == 0)
    assert on0 <= limits[0] - 2 * GiB + GiB and where["lm_head"] == 1
    assert set(where.values()) == {0, 1}
    where1, _ = place(units, 1, 10 * GiB, 100 * GiB)  # one GPU: 90% of it, the rest on the CPU
    assert "cpu" in where1.values() and sum(s for n, s, _ in units if where1[n] == 0) <= 9 * GiB


def test_device_map_path_is_an_estimate_and_never_beats_a_measured_path_that_fits():
    r = _qwen(2, batch=1)
    dm = r.path("device-map")
    assert dm is not None and dm.estimate and dm.ranks == 1 and dm.replicas == 1
    assert dm.gpu_peak_bytes < r.path("plain").gpu_peak_bytes  # the weights are split over two GPUs
    assert r.recommended.path in ("tp", "zero3", "zero3-offload") or not r.path("tp").fits


def test_quantized_weights_shrink_the_peak_and_are_chosen_only_when_nothing_else_fits():
    r = _qwen(1, batch=1, host_memory="256GiB")
    plain, int8, nf4 = r.path("plain"), r.path("bnb-int8"), r.path("bnb-nf4")
    assert int8.estimate and nf4.estimate
    assert nf4.gpu_peak_bytes < int8.gpu_peak_bytes < plain.gpu_peak_bytes
    assert nf4.breakdown["dequant_workspace"] > 0
    z, zq = r.path("zero3-offload"), r.path("zero3-offload-int4")
    assert zq.host_peak_bytes < z.host_peak_bytes and zq.tokens_per_s > z.tokens_per_s
    assert r.recommended.path not in ("bnb-int8", "bnb-nf4", "zero3-int4", "zero3-offload-int4")
    assert nf4.fits and nf4.tokens_per_s > r.path(r.recommended.path).tokens_per_s  # faster, but changes outputs
    assert "DSD213" not in codes(r)


def test_choose_falls_back_to_estimates_then_quantized_only_when_nothing_else_fits():
    from dsdoctor.plan.paths import quantized_names
    from dsdoctor.plan.recommend import choose_tiered
    from dsdoctor.plan.result import PathPlan

    def _choose_tiered(plans):
        return choose_tiered(plans, quantized_names())

    def p(name, fits, tps, estimate=False):
        return PathPlan(name, 1, 1, 0, 0, 0, 0, fits, [], "decode", tps, tps, "hbm", {}, {}, estimate=estimate)

    measured, dm, nf4 = p("zero3-offload", True, 1.0), p("device-map", True, 5.0, True), p("bnb-nf4", True, 9.0, True)
    assert _choose_tiered([measured, dm, nf4])[0].name == "zero3-offload"
    measured.fits = False
    assert _choose_tiered([measured, dm, nf4])[0].name == "device-map"
    dm.fits = False
    assert _choose_tiered([measured, dm, nf4])[0].name == "bnb-nf4"
    nf4.fits = False
    assert _choose_tiered([measured, dm, nf4])[0] is None


def test_zero_inference_int4_config_carries_weight_quantization():
    from dsdoctor.plan.paths.quantized import zero_int4_code

    cfg, code = zero_int4_code("cpu", "m", 2, "fp16", None)  # zero3-offload-int4
    assert cfg["weight_quantization"]["quantized_initialization"]["num_bits"] == 4
    assert cfg["fp16"] == {"enabled": True} and "'weight_quantization'" in code


@pytest.mark.process
def test_loading_bench_reestimates_a_recorded_run(tmp_path):
    """bench/plan/loading_gpu.py --reestimate: today's predictions beside recorded measurements, no GPU."""
    root = ROOT
    rows = [{"size": "7b", "format": "safetensors", "case": c, "peak_anon": 5 * 2**29, "peak_file": f,
             "peak_rss": 5 * 2**29 + f, "error_rss_pct": 1.0} for c, f in (("to-gpu", 13 * 2**30),
                                                                             ("cpu-then-to", 5 * 2**30))]
    run = tmp_path / "loading.jsonl"
    run.write_text("\n".join(json.dumps(r) for r in rows) + "\n" + json.dumps({"summary": True}) + "\n")
    out = subprocess.run([sys.executable, str(root / "bench/plan/loading_gpu.py"), "--reestimate", str(run)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    summary = json.loads(lines[-1])
    assert summary["cases"] == 2 and summary["recorded_max_abs_rss_error_pct"] == 1.0
    table = {ln.split("|")[3].strip(): [c.strip() for c in ln.split("|")[4:7]] for ln in lines if "| 7b |" in ln}
    assert table["to-gpu"][1].startswith("13.00 / ") and table["cpu-then-to"][1].startswith("5.00 / ")
    file_to_gpu = float(table["to-gpu"][1].split("/")[1])
    file_cpu = float(table["cpu-then-to"][1].split("/")[1])
    assert file_cpu < file_to_gpu / 2  # one 5 GB shard of three resident at a time vs the whole checkpoint
