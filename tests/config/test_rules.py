"""One fixture per DSD1xx finding: it fires, with its values rendered in English and Chinese, and the
clean inference config does not fire it. Plus the check CLI, its JSON contract and its import weight."""
import json
import subprocess
import sys

import pytest

from dsdoctor.config.check import check
from dsdoctor.findings import all_rules, explain
from tests.helpers import EXAMPLES, ROOT, run_cli, write_model_config

CLEAN = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1}


@pytest.fixture
def bf16_model(tmp_path):
    return write_model_config(tmp_path / "m", torch_dtype="bfloat16", hidden_size=256, intermediate_size=512)


def z3(**zero):
    return {"zero_optimization": {"stage": 3, **zero}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1}


def only(result, code):
    hits = [f for f in result.findings if f.code == code]
    assert len(hits) >= 1, [f.code for f in result.findings]
    return hits[0]


# (code, config, check kwargs, substrings of the English message, substrings of the Chinese message)
CASES = [
    ("DSD101", dict(CLEAN, optimizer={"type": "AdamW", "params": {"lr": 1e-5}}), {"model": True},
     ["optimizer section (AdamW)", "MiB of extra GPU memory per rank", "GPU reduce bucket", "world size 1"],
     ["optimizer 段（AdamW）", "MiB 显存", "reduce bucket"]),
    ("DSD102", dict(z3(offload_optimizer={"device": "cpu"}), optimizer={"type": "Adam"}), {"model": True},
     ["offload_optimizer.device = cpu", "MiB of fp32 master weights per node go to cpu"], ["MiB 的 fp32 主权重"]),
    ("DSD103", dict(z3(), tensor_parallel={"autotp_size": 2}), {},
     ["ZeRO stage 3", "tensor_parallel.autotp_size = 2"], ["张量并行（tensor_parallel.autotp_size = 2）"]),
    ("DSD104", {"mp_size": 2, "replace_with_kernel_inject": True, "zero_optimization": {"stage": 3}}, {},
     ["init_inference keys (mp_size, replace_with_kernel_inject)", "(zero_optimization)"], ["ValidationError"]),
    ("DSD105", dict(z3(stage3_prefetch_bucket_size="auto"), train_batch_size="auto"), {},
     ["2 \"auto\" value(s)", "stage3_prefetch_bucket_size -> 50000000", "train_batch_size -> TypeError"],
     ["2 个 \"auto\" 值"]),
    ("DSD106", {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, {},
     ["offload_param.device = cpu with ZeRO stage 2"], ["ZeRO stage 2 下"]),
    ("DSD107", z3(offload_param={"device": "cpu"}), {"model": True},
     ["offload_param to cpu with pin_memory", "MiB of host memory"], ["锁定", "MiB"]),
    ("DSD108", z3(offload_param={"device": "nvme"}), {},
     ["zero_optimization.offload_param.device = nvme but nvme_path is not set"], ["nvme_path"]),
    ("DSD109", z3(stage3_param_persistence_threshold=int(1e9)), {"model": True},
     ["stage3_param_persistence_threshold = 1.00B (DeepSpeed default 100.00K)", "MiB of weights held on every GPU"],
     ["每张 GPU"]),
    ("DSD110", {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1},
     {"model": True}, ["fp16 is enabled (fp16.enabled = true)", "weights are bf16"], ["启用了 fp16"]),
    ("DSD111", z3(), {"gpus": 1}, ["ZeRO-3 on 1 GPU without offload_param"], ["1 张 GPU"]),
    ("DSD112", dict(z3(reduce_bucket_size=1000), gradient_clipping=1.0), {},
     ["2 training-only key(s)", "gradient_clipping", "zero_optimization.reduce_bucket_size"], ["2 个仅用于训练的键"]),
    ("DSD115", {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}, {},
     ["ZeRO stage 2 at inference", "zero stage 2 requires an optimizer"], ["每张 GPU 仍保存全部权重"]),
    ("DSD114", z3(_offload_param={"device": "cpu"}, stage3_max_reuse_distance=-1), {},
     ["zero_optimization._offload_param", "leading underscore"], ["DeepSpeed 会拒绝此键"]),
]


@pytest.mark.parametrize("code,config,kwargs,en,zh", CASES, ids=[c[0] for c in CASES])
def test_finding_fires_with_values(code, config, kwargs, en, zh, bf16_model):
    if kwargs.get("model"):
        kwargs = dict(kwargs, model=bf16_model)
    finding = only(check(config, **kwargs), code)
    message_en, message_zh = finding.message("en"), finding.message("zh")
    for part in en:
        assert part in message_en, message_en
    for part in zh:
        assert part in message_zh, message_zh
    assert "{" not in message_en + message_zh + finding.fix("en") + finding.fix("zh")  # every placeholder filled
    assert finding.effective_severity in ("info", "warning", "error")


def test_dsd116_not_a_deepspeed_config(tmp_path):
    model = write_model_config(tmp_path / "m")
    f = only(check(model / "config.json"), "DSD116")
    assert "config.json has none of the keys" in f.message("en") and "不含任何 DeepSpeed 配置的键" in f.message("zh")
    assert "DSD116" not in {x.code for x in check(CLEAN).findings}


def test_dsd113_missing_reference(tmp_path):
    p = tmp_path / "acc.yaml"
    p.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: gone.json\n")
    f = only(check(p), "DSD113")
    assert "gone.json" in f.message("en") and "gone.json" in f.message("zh")


def test_clean_inference_config_has_no_findings(bf16_model):
    assert check(CLEAN, model=bf16_model, gpus=2).findings == []


def test_training_mode_turns_off_inference_findings():
    cfg = dict(z3(offload_optimizer={"device": "cpu"}, reduce_bucket_size=1000), optimizer={"type": "AdamW"},
               gradient_clipping="auto")
    codes = {f.code: f.effective_severity for f in check(cfg, mode="training").findings}
    assert "DSD101" not in codes and "DSD102" not in codes and "DSD112" not in codes
    assert codes.get("DSD105") == "info"
    inference = {f.code for f in check(cfg).findings}
    assert {"DSD101", "DSD102", "DSD105", "DSD112"} <= inference


def test_offload_optimizer_without_optimizer_is_a_training_only_key():
    result = check(z3(offload_optimizer={"device": "cpu"}))
    assert "DSD102" not in {f.code for f in result.findings}
    assert "zero_optimization.offload_optimizer" in only(result, "DSD112").message("en")


def test_dsd115_is_an_error_only_without_optimizer():
    assert only(check({"zero_optimization": {"stage": 1}}), "DSD115").effective_severity == "error"
    with_opt = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}
    assert only(check(with_opt), "DSD115").effective_severity == "warning"
    assert "DSD115" not in {f.code for f in check(with_opt, mode="training").findings}


def test_dsd105_is_an_error_when_something_crashes_and_a_warning_otherwise():
    assert only(check(dict(CLEAN, train_batch_size="auto")), "DSD105").effective_severity == "error"
    assert only(check(z3(stage3_prefetch_bucket_size="auto")), "DSD105").effective_severity == "warning"


def test_tp_flag_and_accelerate_num_processes(tmp_path):
    assert only(check(z3(), tp=2), "DSD103").values["source"] == "--tp"
    p = tmp_path / "acc.yaml"
    p.write_text("distributed_type: DEEPSPEED\nnum_processes: 1\nmixed_precision: bf16\n"
                 "deepspeed_config:\n  zero_stage: 3\n")
    assert only(check(p), "DSD111").values["gpus"] == 1


def test_every_rule_explains_in_both_languages():
    rules = {c: r for c, r in all_rules().items() if c.startswith("DSD1")}
    assert {f"DSD1{n:02d}" for n in range(1, 17)} | {f"DSD1{n}" for n in range(20, 32)} <= set(rules)
    for code in rules:
        for lang, heads in (("en", ("What it does", "Why is this bad?", "Example", "Use instead")),
                            ("zh", ("作用", "为什么有问题？", "示例", "应改为"))):
            text = explain(code, lang)
            assert all(h in text for h in heads), (code, lang)


@pytest.mark.process
def test_explain_cli(tmp_path):
    proc = run_cli("explain", "DSD101", "--lang", "zh")
    assert proc.returncode == 0 and "optimizer-in-inference" in proc.stdout and "为什么有问题" in proc.stdout


# --- the CLI on the bundled example --------------------------------------------------------------------

@pytest.mark.process
def test_check_cli_json_contract_on_bundled_example():
    proc = run_cli("check", EXAMPLES / "train_zero3_offload.json", "--model", EXAMPLES / "llama-7b",
                   "--format", "json", "--lang", "en")
    assert proc.returncode == 1, proc.stderr  # errors found
    data = json.loads(proc.stdout)
    eff = data["effective"]
    assert eff["zero_stage"] == 3 and isinstance(eff["zero_stage"], int)
    assert eff["offload_param"]["device"] == "cpu" and eff["offload_optimizer"]["device"] == "cpu"
    codes = {f["code"] for f in data["findings"]}
    assert {"DSD101", "DSD102", "DSD105", "DSD107", "DSD112"} <= codes
    for f in data["findings"]:
        assert set(f) >= {"code", "severity", "message", "fix"}
    dsd101 = next(f for f in data["findings"] if f["code"] == "DSD101")
    # one rank (no --gpus): the whole shard of optimizer state, 17 B per parameter (measured on H200)
    assert dsd101["values"]["host_bytes_per_rank"] == 17 * data["model"]["num_params"]
    assert dsd101["values"]["world_size"] == 1
    assert data["hf_trainer"]["stage3"]["prefetch_bucket_size"] == int(0.9 * 4096 * 4096)
    assert "prefetch_bucket_size" in data["readings_differ"]


@pytest.mark.process
def test_check_cli_text_zh_markdown_and_fail_on(tmp_path):
    cfg = tmp_path / "clean.json"
    cfg.write_text(json.dumps(z3(offload_param={"device": "cpu"})))
    proc = run_cli("check", cfg, "--lang", "zh")
    assert proc.returncode == 0 and "DSD107" in proc.stdout and "锁定" in proc.stdout
    assert run_cli("check", cfg, "--fail-on", "info").returncode == 1
    md = run_cli("check", cfg, "--format", "markdown")
    assert md.returncode == 0 and "| DSD107 |" in md.stdout


@pytest.mark.process
def test_check_cli_gbk_console_gets_ascii_glyphs(tmp_path):
    import os
    env = dict(os.environ, PYTHONIOENCODING="gbk", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "dsdoctor", "check", str(EXAMPLES / "train_zero3_offload.json"),
                           "--lang", "zh"], capture_output=True, env=env)
    out = proc.stdout.decode("gbk")  # a GBK console can print the Chinese text, not the glyphs
    assert proc.returncode == 1 and "x DSD101" in out and "推理配置" in out


@pytest.mark.process
def test_check_never_imports_torch_or_deepspeed():
    code = (
        "import sys, io, contextlib\n"
        "from dsdoctor.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    main(['check', r'{EXAMPLES / 'train_zero3_offload.json'}', '--model', r'{EXAMPLES / 'llama-7b'}'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'transformers', 'accelerate'))\n"
        "print(heavy)\n"
    )
    env = {"PYTHONPATH": str(ROOT / "src")}
    import os
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, **env))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"  # how fast that makes it is a benchmark's business, not a test's
