"""ab's reading of the peak (DSD345 attribution, DSD346 verdict) on variant results as a trace makes them."""
from __future__ import annotations

from dsdoctor.calibrate.profile import MachineProfile
from dsdoctor.trace.ab_verdict import attribution, findings
from dsdoctor.trace.diagnose_ab import VariantResult
from tests.helpers import TINY_LLAMA

GiB = 2**30
# linears above stage3_param_persistence_threshold (1e5 elements), so ZeRO-3 gathers them
MODEL = dict(TINY_LLAMA, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=4096, torch_dtype="bfloat16")
SHAPE = {"model_config": MODEL, "batch": 4, "prompt_len": 64, "new_tokens": 16,
         "world_size": 1, "zero_stage": 3, "offload_param": "cpu", "tp_size": 1, "dtype": "bf16"}


def variant(name, peak, tps, offload="cpu", host=1 * GiB, status="ok"):
    shape = dict(SHAPE, offload_param=offload)
    return VariantResult(name, name, status, peak, host, tps, 10.0, 0, offload, generate_peak_gpu_bytes=peak,
                         generate_peak_host_bytes=host, shape=shape)


def test_attribution_splits_the_measured_peak_and_keeps_the_remainder():
    v = variant("as-is", 50 * 2**20, 5.0)
    a = attribution(v)
    assert a["path"] == "zero3-offload" and a["kind"] == "GPU"
    assert {"gathered_params", "kv_cache", "activations"} <= set(a["parts"])
    assert a["remainder"] == a["measured"] - sum(a["parts"].values())


def test_verdict_host_to_device_with_measured_bandwidth_and_pin_memory():
    prof = MachineProfile("f", {}, "2026-12-01T00:00:00Z", {"h2d_pinned": 55e9, "h2d_pageable": 9.5e9})
    vs = [variant("as-is", 50 * 2**20, 2.0), variant("no-offload-param", 50 * 2**20, 20.0, offload=None),
          variant("pin-memory-off", 50 * 2**20, 0.8)]
    got = {f.code: f for f in findings(vs, prof)}
    msg = got["DSD346"].message()
    assert msg.startswith("host-to-device bottleneck")
    assert "20.0 -> 2.0" in msg and "55 GB/s pinned, 10 GB/s pageable" in msg and "pin_memory off: 0.8" in msg
    assert "as-is (zero3-offload, GPU)" in got["DSD345"].message()


def test_verdict_gathering_dominates_when_peak_falls_without_offload():
    vs = [variant("as-is", 80 * 2**20, 5.0), variant("no-offload-param", 40 * 2**20, 6.0, offload=None)]
    msg = next(f for f in findings(vs) if f.code == "DSD346").message()
    assert msg.startswith("gathering dominates") and "80.0 MiB to 40.0 MiB" in msg


def test_verdict_activations_when_kv_and_activations_make_the_peak():
    big = dict(SHAPE, batch=64, prompt_len=100, new_tokens=20, offload_param=None, zero_stage=0)
    v = VariantResult("as-is", "as-is", "ok", None, None, 9.0, 1.0, 0, None, generate_peak_gpu_bytes=60 * 2**20,
                      shape=big)
    msg = next(f for f in findings([v]) if f.code == "DSD346").message()
    assert msg.startswith("activations and output buffers dominate")


def test_no_shape_no_attribution():
    v = variant("as-is", GiB, 1.0)
    v.shape = None
    assert attribution(v) is None and not [f for f in findings([v]) if f.code == "DSD345"]
