"""Serving engines as load paths (estimates): the KV pool from gpu_memory_utilization in paged blocks, decode as
CUDA graphs (no eager per-layer term), TP groups x replicas, the launch command, what the user gives up, and a
recommendation only for pure batch generation that never displaces a measured path silently."""
from __future__ import annotations

import math

import pytest

from dsdoctor.plan.api import plan
from dsdoctor.plan.memory import CUDA_CONTEXT, NCCL_BUFFERS, allocated
from dsdoctor.plan.paths.plain import plain_layout
from dsdoctor.plan.paths.serving import (
    BLOCK_TOKENS,
    CUDA_GRAPHS,
    MAX_NUM_SEQS,
    VLLM_UTILIZATION,
    engine_step_s,
    serving_splits,
)
from dsdoctor.plan.speed import figures_for
from dsdoctor.plan.workload import Workload
from tests.helpers import EXAMPLES

GiB = 2**30
HW = dict(gpu_memory="80GiB", host_memory="1TiB", detect=False, gpu_name="H100", counts="formula")


def _plan(model="llama-7b", **kw):
    args = dict(batch=8, prompt_len=1024, new_tokens=128, gpus=2, **HW)
    args.update(kw)
    return plan(EXAMPLES / model, **args)


def test_splits_follow_the_gpus_and_heads():
    assert serving_splits(8, 64, 8) == [1, 2, 4, 8]
    assert serving_splits(8, 28, 4) == [1, 2, 4]  # 28 heads: no 8-way split
    assert serving_splits(4, 32, 2) == [1, 2, 4]  # 4 > 2 key/value heads: replicated


def test_vllm_kv_pool_is_what_gpu_memory_utilization_leaves_in_16_token_blocks():
    res = _plan(gpus=1)
    v = res.path("vllm")
    assert v.estimate and v.replicas == 1 and v.ranks == 1 and v.tp is None  # tp: AutoTP's degree only
    gpu = 80 * GiB
    weights = 6738415616 * 2
    profile = Workload(1, 8192, 1, "bf16")  # the profiling forward: min(batch x K x prompt, 8192) tokens
    act = allocated(plain_layout(1), res_shape(), profile, phases=("prefill",)).gpu_breakdown["activations"]
    profile = Workload(1, 1024 * 8, 1, "bf16")  # batch x prompt = 8192 tokens exactly here
    logits = MAX_NUM_SEQS * 32000 * 4
    pool = VLLM_UTILIZATION * gpu - CUDA_CONTEXT - weights - act - logits - CUDA_GRAPHS
    per_token = 32 * 2 * 4096 * 2  # 32 layers, keys and values, 32 heads x 128, bf16
    per_seq = math.ceil((1024 + 128) / BLOCK_TOKENS) * BLOCK_TOKENS * per_token
    assert v.max_batch == int(pool // per_seq)
    assert v.breakdown["weights_resident"] == weights and v.breakdown["cuda_graphs"] == CUDA_GRAPHS
    assert v.breakdown["kv_cache"] == 8 * per_seq  # batch x K sequences served at once, each in whole blocks
    assert v.breakdown["activations"] == act
    # the engine takes its share of the GPU whatever the workload: reserved + outside is the whole GPU
    assert v.gpu_reserved_bytes + v.gpu_outside_allocator_bytes == gpu and v.fits
    s = res.path("sglang")
    assert s.max_batch != v.max_batch  # its own share (mem_fraction_static) and token-granular pool


def res_shape(model="llama-7b"):
    from dsdoctor.model.spec import load_model_spec
    from dsdoctor.plan.api import load_inventory
    from dsdoctor.plan.shape import model_shape

    spec = load_model_spec(EXAMPLES / model)
    return model_shape(spec, load_inventory(spec, "formula"))


def test_decode_is_cuda_graphs_no_eager_per_layer_term():
    res = _plan(gpus=1)
    v, plain = res.path("vllm"), res.path("plain")
    assert "eager" in plain.speed_terms and "eager" not in v.speed_terms
    assert set(v.speed_terms) == {"weights", "kv_cache", "engine_step"}  # one GPU per replica: no all-reduce
    # the engine's host work per step is Python per step: generate's per-token eager work at the batch, no layers
    assert v.speed_terms["engine_step"] == round(engine_step_s(figures_for(res.hardware), 8), 6)
    assert v.speed_terms["engine_step"] < plain.speed_terms["eager"]
    assert v.speed_terms["weights"] == plain.speed_terms["weights"]  # the same bytes read, on one GPU
    assert v.tokens_per_s > plain.tokens_per_s


def test_a_model_larger_than_a_gpu_gets_tp_groups_times_replicas_and_all_reduces():
    res = plan(EXAMPLES / "qwen2-72b", batch=4, prompt_len=1024, new_tokens=128, gpus=8, **HW)
    v = res.path("vllm")
    assert v.ranks >= 2 and v.replicas == 8 // v.ranks and v.fits  # 135 GiB: not on one GPU
    assert v.speed_terms["allreduce"] == pytest.approx(80 * 2 * 15e-6)
    assert v.max_batch >= 4 * v.ranks  # batch x K sequences held at once
    # the split is the one that generates the most on the machine among those whose pool holds a sequence
    from dsdoctor.plan.paths.serving import engine_memory, engine_speed

    shape, fig = res_shape("qwen2-72b"), figures_for(res.hardware)
    machine = {}
    for k in serving_splits(8, 64, 8):
        info = engine_memory("vllm", shape, res.workload, 80 * GiB, k, None)
        if info["seqs"]:
            machine[k] = engine_speed(shape, res.workload, fig, k, min(4 * k, info["seqs"])).tokens_per_s * (8 // k)
    assert 1 not in machine and v.ranks == max(machine, key=machine.get)
    code = res_code(res, "vllm")
    assert f"--tensor-parallel-size {v.ranks}" in code and "--max-model-len 1152" in code
    assert v.replicas == 1 or f"--data-parallel-size {v.replicas}" in code
    assert "what you give up" in code and "equal to transformers' generate" in code


def res_code(res, name):
    from dsdoctor.plan.paths.serving import sglang_code, vllm_code

    p = res.path(name)
    emit = vllm_code if name == "vllm" else sglang_code
    return emit("m", p.ranks, p.replicas, "bf16", res.workload.prompt_len + res.workload.new_tokens, p.max_batch)


def test_never_displaces_a_measured_path_silently():
    res = _plan()
    assert res.recommended.path == "plain"  # measured, fits: the engine does not take its place
    f = next(f for f in res.findings if f.code == "DSD223")
    assert f.values["engine"] in ("vllm", "sglang") and f.values["chosen"] == "plain"
    assert "gives up training-time features" in f.message()
    assert "DSD223" not in {f.code for f in _plan(hf_equality=True).findings}


def test_recommended_only_for_batch_generation_without_hf_equality():
    # 16 GiB GPUs: no measured path fits a 7B at this batch, an engine with TP 2 does
    tight = dict(batch=1, prompt_len=512, new_tokens=64, gpus=2, gpu_memory="16GiB", host_memory="1TiB",
                 detect=False, gpu_name="H100", counts="formula")
    res = plan(EXAMPLES / "llama-7b", **tight)
    measured = [p for p in res.paths if not p.estimate]
    if any(p.fits for p in measured):  # the measured tier wins wherever it fits
        assert res.recommended.path in {p.name for p in measured}
    else:
        assert res.recommended.path in ("vllm", "sglang", "device-map")
    eq = plan(EXAMPLES / "llama-7b", hf_equality=True, **tight)
    assert eq.recommended.path not in ("vllm", "sglang")
    assert "vllm" in {p.name for p in eq.paths}  # shown, never recommended
    loop = plan(EXAMPLES / "llama-7b", loop=True, **tight)
    assert loop.recommended.path not in ("vllm", "sglang")


def test_the_engine_is_recommended_when_nothing_measured_fits():
    # one 24 GiB GPU, a long batch: plain and ZeRO-3 do not fit the KV cache, the engine's paged pool serves fewer
    # sequences at once but runs
    res = plan(EXAMPLES / "llama-7b", batch=64, prompt_len=2048, new_tokens=64, gpus=1, gpu_memory="24GiB",
               host_memory="16GiB", detect=False, gpu_name="H100", counts="formula")
    assert not any(p.fits for p in res.paths if not p.estimate)
    assert res.recommended.path in ("vllm", "sglang")
    assert "DSD213" in {f.code for f in res.findings}  # an estimate chosen, said so
    v = res.path(res.recommended.path)
    assert 1 <= v.max_batch < 64 and "vllm" in res.recommended.code or "sglang" in res.recommended.code


def test_outside_memory_includes_nccl_on_tp_groups():
    v = plan(EXAMPLES / "qwen2-72b", batch=1, prompt_len=512, new_tokens=64, gpus=8, **HW).path("vllm")
    assert v.gpu_outside_allocator_bytes >= CUDA_CONTEXT + NCCL_BUFFERS
