"""ab weighs the way out as an expert does (issue 31.2): a variant that removes the cause of the failure beats one
that only survives it, whatever their speeds; each variant's host and GPU headroom is part of its result and of
the verdict; the seed's end state (the inference config without offload_param, or no ZeRO-3) is measured too
when plan says it fits. The host-OOM case is the one measured on an H200 (an 8B whose training config builds
optimizer state the 125 GiB host cannot hold), its endings as trace records them (tests/trace/test_endings.py
builds the same rows)."""
from __future__ import annotations

import json
from types import SimpleNamespace

from dsdoctor.trace import api, diagnose_ab
from dsdoctor.trace.diagnose_ab import AbResult, VariantResult, diagnose
from dsdoctor.trace.end_state import end_state_variants
from dsdoctor.trace.variants import apply_variant, parse_variants
from tests.helpers import SCRIPTS

GiB = 1024**3
HOST = 125 * GiB
H200 = 140 * GiB
LLAMA = json.loads((SCRIPTS.parent.parent / "src" / "dsdoctor" / "examples" / "llama-7b" / "config.json").read_text())


def _killed(name: str) -> VariantResult:
    v = VariantResult(name, name, "oom", None, int(119.7 * GiB), None, 30.0, 247, "cpu",
                      optimizer="DeepSpeedZeroOptimizer_Stage3", config_source="train.json", host_total_bytes=HOST)
    v.endings = [{"kind": "oom-killer", "phase": "init", "signal": "SIGKILL", "exit_code": -9, "rank": 0,
                  "evidence": None, "detail": None, "oom_evidence": {"kind": "cgroup"}}]
    return v


def _ran(name, host, gpu, tps, optimizer=None, offload="cpu") -> VariantResult:
    return VariantResult(name, name, "ok", gpu, host, tps, 20.0, 0, offload, optimizer=optimizer,
                         tokens_per_s_kind="first", host_total_bytes=HOST, gpu_total_bytes=H200)


def test_the_variant_that_removes_the_cause_beats_a_faster_one_that_only_survives():
    rows = [_killed("as-is"),
            _ran("no-offload-param", int(99.2 * GiB), 18 * GiB, 10.0, optimizer="DeepSpeedZeroOptimizer_Stage3",
                 offload=None),
            _ran("split", int(22.4 * GiB), 4 * GiB, 7.4)]
    d = AbResult(["deepspeed", "infer.py"], rows, diagnose(rows)).diagnosis
    assert d.code == "DSD316" and d.message().startswith("split runs where as-is was killed by the kernel OOM killer")
    assert "host 22.4 GiB of 125.0 GiB (82% free)" in d.message()
    assert "no-offload-param only survives: it still builds the optimizer DeepSpeedZeroOptimizer_Stage3" \
        in d.message()
    assert "also runs" not in d.message() and "dsdoctor split train.json" in d.fix()
    assert "只是勉强运行" in d.message("zh")


def test_a_variant_left_with_under_a_quarter_of_the_memory_that_failed_only_survives():
    rows = [_killed("as-is"), _ran("no-offload-param", int(99.2 * GiB), 18 * GiB, 10.0, offload=None),
            _ran("split", int(22.4 * GiB), 4 * GiB, 7.4)]
    d = AbResult(["x"], rows, diagnose(rows)).diagnosis
    assert d.code == "DSD316" and d.message().startswith("split runs")
    assert "no-offload-param only survives: host 99.2 GiB of 125.0 GiB, under a quarter free" in d.message()
    # the same two with room to spare: the faster is the fix, the other said to run too
    roomy = [_killed("as-is"), _ran("no-offload-param", 40 * GiB, 18 * GiB, 10.0, offload=None),
             _ran("split", int(22.4 * GiB), 4 * GiB, 7.4)]
    d = AbResult(["x"], roomy, diagnose(roomy)).diagnosis
    assert d.message().startswith("no-offload-param runs") and "also runs: split" in d.message()


def test_headroom_is_in_every_variants_row():
    rows = [_killed("as-is"), _ran("split", int(22.4 * GiB), 14 * GiB, 7.4)]
    text = AbResult(["x"], rows, diagnose(rows)).to_text()
    assert "headroom (free at peak)" in text and "host 82%, GPU 90%" in text
    assert rows[1].to_dict()["host_total_bytes"] == HOST


def test_the_seeds_end_state_is_measured_when_plan_says_it_fits():
    shape = {"model_config": LLAMA, "batch": 1, "prompt_len": 512, "new_tokens": 32, "world_size": 1,
             "dtype": "bf16"}
    ran = _ran("split", 22 * GiB, 4 * GiB, 7.4)
    ran.shape = shape
    assert end_state_variants([_killed("as-is"), ran], ["as-is", "split"]) == ["plain"]  # 7B bf16 on 140 GiB
    ran.gpu_total_bytes = 8 * GiB  # 13 GiB of weights: no plain load; ZeRO-3 over 4 ranks without offload fits
    ran.shape = dict(shape, world_size=4)
    assert end_state_variants([ran], ["split"]) == ["split-no-offload"]
    ran.gpu_total_bytes = 2 * GiB
    assert end_state_variants([ran], ["split"]) == []  # neither fits: only the rewrites of the config
    ran.gpu_total_bytes = H200
    ran.shape = shape
    assert end_state_variants([ran], ["split", "plain"]) == []  # already measured
    ran.gpu_total_bytes = None
    assert end_state_variants([ran], ["split"]) == []  # no GPU seen: plan's GPU figures say nothing here


def test_end_state_configs():
    train = json.loads((SCRIPTS / "train_zero3_offload.json").read_text())
    z3 = apply_variant("split-no-offload", train)
    assert z3["zero_optimization"]["stage"] == 3 and "offload_param" not in z3["zero_optimization"]
    assert "optimizer" not in z3 and "offload_optimizer" not in z3["zero_optimization"]
    plain = apply_variant("plain", train)
    assert plain["zero_optimization"] == {"stage": 0} or plain["zero_optimization"]["stage"] == 0
    assert not any(k.startswith("stage3_") or k == "offload_param" for k in plain["zero_optimization"])
    assert "optimizer" not in plain and train["zero_optimization"]["stage"] == 3  # the input is untouched


def test_ab_runs_the_end_state_after_the_default_variants(monkeypatch, tmp_path):
    """The queue, with each variant's trace stood in: after as-is, no-offload-param and split, plan says a plain
    load fits, so plain is run and measured, and named as the fix since it runs fastest with room to spare."""
    shape = {"model_config": LLAMA, "batch": 1, "prompt_len": 512, "new_tokens": 32, "world_size": 1,
             "dtype": "bf16"}
    made = {"as-is": _killed("as-is"),
            "no-offload-param": _ran("no-offload-param", int(99.2 * GiB), 18 * GiB, 10.0,
                                     optimizer="DeepSpeedZeroOptimizer_Stage3", offload=None),
            "split": _ran("split", int(22.4 * GiB), 4 * GiB, 7.4), "plain": _ran("plain", 20 * GiB, 16 * GiB, 95.0,
                                                                                 offload=None)}
    made["split"].shape = made["plain"].shape = shape
    ran = []

    def fake_trace(directory, command, variant, *a):
        ran.append(variant)
        return SimpleNamespace(findings=[], ranks=[], status=made[variant].status)

    monkeypatch.setattr(api, "_trace_into", fake_trace)
    monkeypatch.setattr(api.VariantResult, "from_trace", classmethod(lambda cls, name, *a: made[name]))
    monkeypatch.setattr(api, "not_applied", lambda *a: None)
    monkeypatch.setattr(diagnose_ab, "_machine_profile", lambda: None)  # no calibrate profile: no nvidia-smi
    monkeypatch.setattr(api.shutil, "which", lambda c: c)
    result = api.ab(["python", "infer.py"], echo=False)
    assert ran == ["as-is", "no-offload-param", "split", "plain"]
    d = result.diagnosis
    assert d.code == "DSD316" and d.message().startswith("plain runs") and "leave ZeRO-3" in d.fix()
    assert [v.name for v in parse_variants("as-is,plain,split-no-offload")] == ["as-is", "plain", "split-no-offload"]
