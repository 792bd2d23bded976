"""``dsdoctor compare`` end to end: real weights, real CLI processes, real DeepSpeed ranks on the CPU."""
import json
import shutil
import sys

import pytest

from dsdoctor.proctree import deepspeed_shm_files
from tests.helpers import TINY_LLAMA, deepspeed_env, run_cli

WEIGHT = "model.layers.0.self_attn.q_proj.weight"  # square (64 x 64): can be transposed in place


def _save_tiny_llama(directory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    keys = {k: v for k, v in TINY_LLAMA.items() if k not in ("architectures", "model_type", "torch_dtype")}
    # a wider init than the default 0.02 gives peaked logits with clear winners, like a trained model
    model = LlamaForCausalLM(LlamaConfig(**keys, initializer_range=0.2))
    model.save_pretrained(directory)  # safetensors
    return directory


def _broken_copy(src, dst, how):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    assert tensors[WEIGHT].shape[0] == tensors[WEIGHT].shape[1]
    tensors[WEIGHT] = torch_zero(tensors[WEIGHT]) if how == "zero" else tensors[WEIGHT].t().contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def torch_zero(t):
    return t.clone().zero_()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    ref = _save_tiny_llama(root / "ref")
    copy = root / "copy"
    shutil.copytree(ref, copy)
    return {"ref": ref, "copy": copy, "zeroed": _broken_copy(ref, root / "zeroed", "zero"),
            "transposed": _broken_copy(ref, root / "transposed", "transpose")}


def _json(proc):
    assert proc.stdout, proc.stderr
    return json.loads(proc.stdout)


# -- two directories, plain load in-process: fast ---------------------------------------------------------
def test_library_call_same_weights_in_two_directories_match(models, tmp_path):
    # dsdoctor.compare (the lazy public name) is shadowed by the subpackage once dsdoctor.compare.* is
    # imported; until dsdoctor/__init__.py handles that, call the module that defines it
    from dsdoctor.compare.api import compare

    out = tmp_path / "report"
    result = compare(models["ref"], models["copy"], paths="plain", prompts=[[5, 6, 7], [40, 41, 42, 43]],
                              max_new_tokens=6, out=out)
    assert result.status == "match" and result.findings == []
    (pair,) = result.pairs
    assert pair.identical and [d.compared for d in pair.diffs] == [6, 6]
    assert [r.label for r in result.runs] == ["A", "B"] and all(r.ok for r in result.runs)
    assert result.runs[0].versions["torch"] and result.runs[0].device in ("cpu", "cuda")
    saved = json.loads((out / "report.json").read_text())
    assert saved["status"] == "match" and saved["prompts"] == [[5, 6, 7], [40, 41, 42, 43]]
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "report.zh.md", "A.json", "B.json",
                                               ".dsdoctor-output"}
    assert len(json.loads((out / "A.json").read_text())["prompts"][1]["steps"]) == 6


@pytest.mark.process
def test_zeroed_tensor_is_reported_as_mismatch(models):
    proc = run_cli("compare", models["ref"], models["zeroed"], "--format", "json", "--quiet")
    assert proc.returncode == 1, proc.stderr
    report = _json(proc)
    assert report["status"] == "mismatch"
    codes = [f["code"] for f in report["findings"]]
    assert codes[0] == "DSD501"
    diffs = report["comparisons"][0]["prompts"]
    assert len(diffs) == 4 and all(d["status"] == "mismatch" for d in diffs)
    # a broken load: the logits move far beyond the tolerance, and on a clear winner
    worst = max(diffs, key=lambda d: d["max_logit_diff"])
    assert worst["max_logit_diff"] > 100 * worst["tolerance"]
    assert all(d["first_divergence"] is not None for d in diffs)
    assert proc.stderr == ""  # --quiet


@pytest.mark.process
def test_transposed_tensor_is_reported_as_mismatch_in_markdown_and_chinese(models):
    proc = run_cli("compare", models["ref"], models["transposed"], "--format", "markdown", "--lang", "zh",
                   "--max-new-tokens", "4")
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith("# dsdoctor compare")
    assert "| DSD501 | error |" in proc.stdout and "不一致" in proc.stdout
    assert "[1/2] A" in proc.stderr and "[2/2] B" in proc.stderr  # progress goes to stderr


@pytest.mark.process
def test_unreadable_weights_are_a_failed_load_path(models, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(models["ref"], broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    proc = run_cli("compare", models["ref"], broken, "--quiet")
    assert proc.returncode == 1, proc.stderr
    assert "DSD504 [error] the B load path failed" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


# -- bad input: exit 2, one line, before any model is loaded ----------------------------------------------
def _bad_inputs(models, tmp_path):
    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    shutil.copy(models["ref"] / "config.json", bin_only)
    (bin_only / "pytorch_model.bin").write_bytes(b"x")
    other_vocab = tmp_path / "other_vocab"
    shutil.copytree(models["ref"], other_vocab)
    cfg = json.loads((other_vocab / "config.json").read_text())
    (other_vocab / "config.json").write_text(json.dumps(dict(cfg, vocab_size=512)))
    exists = tmp_path / "exists"
    exists.mkdir()
    bad_prompts = tmp_path / "prompts.txt"
    bad_prompts.write_text("[1, 9999]\n")
    ref = models["ref"]
    return [
        ((tmp_path / "missing",), "model directory not found"),
        ((bin_only,), "pickle weights"),
        ((ref, "--paths", "plain,zero4"), "unknown load path 'zero4'"),
        ((ref, "--paths", "plain,plain"), "listed twice"),
        ((ref, "--paths", "plain"), "at least two load paths"),
        ((ref, models["copy"], "--paths", "plain,zero3"), "give one load path"),
        ((ref, other_vocab), "vocabulary size 512 differs"),
        ((ref, models["copy"], "--out", exists), "already exists"),
        ((ref, "--paths", "plain,tp", "--gpus", "3"), "divisible by 3"),
        ((ref, "--gpus", "0"), "argument --gpus: value is '0'; it must be between 1 and 512"),
        ((ref, "--max-new-tokens", "0"), "argument --max-new-tokens: value is '0'; it must be between 1"),
        ((ref, "--prompts", bad_prompts), "token id 9999 is outside the vocabulary"),
    ]


@pytest.mark.process
def test_bad_input_exits_2_with_one_line(models, tmp_path):
    for args, problem in _bad_inputs(models, tmp_path):
        proc = run_cli("compare", *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        # a flag's value is refused by argparse ("dsdoctor compare: error: argument ..."), a file by the library
        assert len(lines) == 1 and lines[0].startswith(("dsdoctor: error: ", "dsdoctor compare: error: ")), \
            (args, proc.stderr)
        assert problem in lines[0], (args, lines[0])
        assert proc.stdout == ""


@pytest.mark.process
def test_help_has_examples_and_findings_are_explained():
    proc = run_cli("compare", "--help")
    assert proc.returncode == 0 and "examples:" in proc.stdout and "--paths plain,zero3,tp" in proc.stdout
    for code in ("DSD501", "DSD502", "DSD503", "DSD504", "DSD505", "DSD506"):
        text = run_cli("explain", code, "--lang", "zh")
        assert text.returncode == 0 and "应改为" in text.stdout, code


def test_api_compare_of_two_directories_works_with_its_defaults(models):
    # the two-folder default (one plain load path) is the library's, not only the CLI's
    from dsdoctor import api

    result = api.compare(models["ref"], models["copy"], max_new_tokens=2)
    assert result.status == "match" and [r.label for r in result.runs] == ["A", "B"]
    assert {r.path for r in result.runs} == {"plain"}


@pytest.mark.process
def test_compare_does_not_import_torch_before_it_runs():
    code = ("import sys, dsdoctor.compare.api, dsdoctor.cli.compare, dsdoctor.compare.launch; "
            "print('torch' in sys.modules, 'deepspeed' in sys.modules)")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=deepspeed_env())
    assert out.stdout.strip() == "False False", out.stderr


# -- real DeepSpeed ranks ---------------------------------------------------------------------------------
@pytest.mark.deepspeed
@pytest.mark.serial  # checks what dsdoctor unlinks from /dev/shm: alone (tests/conftest.py says why)
def test_plain_zero3_and_tensor_parallel_loads_match(models, tmp_path):
    out = tmp_path / "cmp"
    proc = run_cli("compare", models["ref"], "--paths", "plain,zero3,tp", "--gpus", "2", "--max-new-tokens", "8",
                   "--out", out, env=deepspeed_env(), timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    runs = {r["label"]: r for r in report["runs"]}
    # the CPU ranks' shared memory is not left behind: this run's launches only, told apart by their ports
    ports = [c[c.index("--master_port") + 1] for c in (runs["zero3"]["command"], runs["tp"]["command"])]
    assert all(deepspeed_shm_files(port) == set() for port in ports)
    assert runs["zero3"]["ok"] and runs["zero3"]["ranks"] == 2 and "--num_gpus" in runs["zero3"]["command"]
    assert runs["tp"]["ok"] and runs["tp"]["ranks"] == 2
    pairs = {p["other"]: p for p in report["comparisons"]}
    assert pairs["zero3"]["status"] == "match" and pairs["tp"]["status"] == "match"
    # the three paths generated the very same tokens
    assert runs["plain"]["tokens"] == runs["zero3"]["tokens"] == runs["tp"]["tokens"]
    assert all(len(t) == 8 for t in runs["plain"]["tokens"])
    codes = {f["code"] for f in report["findings"]}
    assert "DSD506" in codes and not codes & {"DSD501", "DSD504"}
    assert "zero3" in proc.stdout and "reference" in proc.stdout and (out / "zero3.log").exists()


@pytest.mark.deepspeed
def test_launched_ranks_that_crash_are_reported_with_the_error(models, tmp_path, monkeypatch):
    from dsdoctor.compare.launch import run_path

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(models["ref"] / "config.json", no_weights)
    job = {"label": "zero3", "path": "zero3", "model_dir": str(no_weights), "dtype": "fp32",
           "prompts": [[5, 6]], "max_new_tokens": 2, "probe_ids": [1, 2], "quiet": True}
    for key, value in deepspeed_env().items():
        monkeypatch.setenv(key, value)
    outcome = run_path(job, tmp_path, nprocs=1, timeout=300)
    assert not outcome.ok and outcome.record is None
    assert outcome.error.startswith("ranks exited with status"), outcome.error
    assert "Error" in outcome.error and "no_weights" in outcome.log_tail + outcome.error


@pytest.mark.deepspeed
def test_a_timeout_stops_every_rank(models, tmp_path, monkeypatch):
    import psutil

    from dsdoctor.compare.launch import run_path

    for key, value in deepspeed_env().items():
        monkeypatch.setenv(key, value)
    job = {"label": "zero3", "path": "zero3", "model_dir": str(models["ref"]), "dtype": "fp32",
           "prompts": [[5, 6]], "max_new_tokens": 2, "probe_ids": [1, 2], "quiet": True}
    outcome = run_path(job, tmp_path, nprocs=2, timeout=3)
    assert not outcome.ok and outcome.error.startswith("timed out")
    job_file = str(tmp_path / "zero3.job.json")
    left = [p for p in psutil.process_iter(["cmdline"]) if job_file in " ".join(p.info["cmdline"] or [])]
    assert left == []


@pytest.mark.deepspeed
def test_torchrun_fallback_runs_tensor_parallel_ranks(models, monkeypatch):
    """Without the deepspeed launcher (the GPU image has none) ranks start through torchrun; tensor
    parallelism on the CPU then needs the LOCAL_SIZE that DeepSpeed's launcher would have exported."""
    import dsdoctor.compare.launch as launch
    from dsdoctor.compare.api import compare

    for key, value in deepspeed_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setattr(launch, "deepspeed_launcher", lambda: None)
    result = compare(models["ref"], paths="plain,tp", gpus=2, prompts=[[5, 6, 7, 8]], max_new_tokens=4)
    tp = result.runs[1]
    assert tp.ok, tp.error + "\n" + tp.log_tail
    assert tp.command[1:3] == ["-m", "torch.distributed.run"]
    assert result.status == "match" and result.pairs[0].diffs[0].compared == 4
