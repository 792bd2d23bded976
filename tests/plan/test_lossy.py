"""Quantized and half-precision alternatives (issue 31.5): an fp32 checkpoint gets its half-precision plain row
without --dtype, full precision stays recommended first, and a lossy path that fits and plan rates several
times faster than the recommendation becomes a finding (DSD215) instead of a silent table row."""
from __future__ import annotations

import json

import pytest

from dsdoctor.plan.api import plan
from dsdoctor.plan.findings import LOSSY_FASTER
from tests.helpers import EXAMPLES, ROOT

LLAMA_7B = json.loads((ROOT / "tests" / "data" / "arch_configs" / "llama-2-7b.json").read_text())


def _fp32(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA_7B, torch_dtype="float32")))
    return tmp_path


def _rate(p):
    return p.tokens_per_s * p.replicas


@pytest.mark.parametrize("gpu, half", [("A10", "bf16"), ("V100", "fp16")])
def test_fp32_checkpoint_gets_its_half_precision_plain_row(tmp_path, gpu, half):
    r = plan(_fp32(tmp_path), gpus=1, gpu_memory="24GiB", host_memory="128GiB", gpu_name=gpu, counts="formula")
    rows = {p.name: p for p in r.paths}
    assert r.workload.dtype == "fp32" and not rows["plain"].fits
    row = rows[f"plain-{half}"]
    assert row.fits and abs(row.gpu_peak_bytes - rows["plain"].gpu_peak_bytes / 2) < 2 * 2**30
    assert r.recommended.path == "zero3-offload"  # full precision first: the half row changes the outputs
    found = [f for f in r.findings if f.code == "DSD215"]
    assert len(found) == 1 and found[0].values["path"] == f"plain-{half}"
    assert float(found[0].values["speedup"]) >= LOSSY_FASTER
    torch_name = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[half]
    assert f"dtype={torch_name}" in found[0].fix("en") and f"fp32 检查点以 {half} 加载" in found[0].message("zh")


def test_no_half_row_for_a_half_precision_checkpoint_or_with_dtype(tmp_path):
    r = plan(EXAMPLES / "llama-7b", gpus=1, gpu_memory="24GiB", host_memory="128GiB", gpu_name="A10",
             counts="formula")
    assert not [p for p in r.paths if p.name.startswith("plain-")]
    r = plan(_fp32(tmp_path), gpus=1, gpu_memory="24GiB", host_memory="128GiB", gpu_name="A10", counts="formula",
             dtype="bf16")
    assert not [p for p in r.paths if p.name.startswith("plain-")] and r.recommended.path == "plain"


def test_quantized_paths_that_fit_much_faster_are_named():
    """A 72B on one 80 GiB GPU: only zero3-offload fits in full precision; bnb-nf4 fits many times faster."""
    r = plan(EXAMPLES / "qwen2-72b", gpus=1, gpu_memory="80GiB", host_memory="512GiB", gpu_name="H100",
             counts="formula")
    assert r.recommended.path == "zero3-offload"
    found = [f for f in r.findings if f.code == "DSD215"]
    assert len(found) == 1
    rows = {p.name: p for p in r.paths}
    best = max((p for p in r.paths if p.fits and p.name.startswith(("bnb", "zero3-int4", "zero3-offload-int4"))),
               key=_rate)
    assert found[0].values["path"] == best.name and _rate(best) >= LOSSY_FASTER * _rate(rows["zero3-offload"])
    assert "BitsAndBytesConfig" in found[0].fix("en") or "weight_quantization" in found[0].fix("en")


def test_no_finding_when_the_recommendation_is_already_fast():
    r = plan(EXAMPLES / "llama-7b", gpus=1, gpu_memory="80GiB", host_memory="512GiB", gpu_name="H100",
             counts="formula")
    assert r.recommended.path == "plain" and not [f for f in r.findings if f.code == "DSD215"]
