"""Issue 33.2: every number and version from flags, job files and launch lines goes through one bounded reader
(``dsdoctor.units.number`` and ``units.version``): finite, in range, named on error, one line, exit 2."""
from __future__ import annotations

import argparse

import pytest

from dsdoctor.cli.main import build_parser, main
from dsdoctor.errors import InputError
from dsdoctor.units import number, version
from tests.helpers import EXAMPLES, run_cli

WAIT_S = 180  # a guard against a hung suite, not a timing assertion
LLAMA = EXAMPLES / "llama-7b"
FORMULA = ("--counts", "formula")


def _numeric_flags():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        for action in command._actions:
            if action.option_strings and action.type is not None:
                yield name, action


def test_no_flag_parses_a_number_by_itself():
    """Every numeric flag's type is the bounded reader's (``cli.common.bounded``): none is a bare int or float."""
    bare = [(n, a.dest) for n, a in _numeric_flags() if a.type in (int, float)]
    assert bare == []
    assert len([a for _, a in _numeric_flags() if hasattr(a.type, "bounds")]) >= 15


@pytest.mark.parametrize("value", ["nan", "inf", "1e400", "-1", "0.5e-9", "9" * 5000, "12abc", "1" * 100_000])
def test_every_numeric_flag_refuses_what_no_run_has_in_one_line(value, capsys):
    for name, action in _numeric_flags():
        if not hasattr(action.type, "bounds"):
            continue
        assert main([name, action.option_strings[-1], value]) == 2, (name, action.dest, value)
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and action.option_strings[-1] in err, (name, err)
        assert len(err) < 400 and "Traceback" not in err


def test_the_reader_itself():
    assert number("8", "x", high=10) == 8 and number(8.0, "x", high=10) == 8 and number(" 1e3 ", "x", high=1e4) == 1000
    assert number("0.5", "x", high=1, whole=False) == 0.5
    for bad in ("nan", float("nan"), float("inf"), "1e400", True, None, [1], "0.5", 11, -1, "x" * 100_000):
        with pytest.raises(InputError) as exc:
            number(bad, "the flag", high=10, path="f.yaml")
        assert str(exc.value).startswith("f.yaml: the flag ") and len(str(exc.value)) < 200
    assert version("4.44.2") == "4.44.2" and version("0.15.0rc1") and version("2.5.1+cu121") and version("5.0.0.dev0")
    for bad in ("1e400", "4.44.2\nfake line", "4" * 100_000, "x", "", 4.4, "4.44.2; rm"):
        with pytest.raises(InputError, match="must look like 4.44.2"):
            version(bad, "--transformers-version")


@pytest.mark.process
@pytest.mark.parametrize("text,problem", [
    ("models:\n  actor: 7B\nrollout:\n  batch: .nan\n", "rollout.batch must be a finite number"),
    ("models:\n  actor: 7B\nrollout:\n  new_tokens: 1e400\n", "rollout.new_tokens"),
    ("models:\n  actor: 7B\ngpus: 100000\n", "gpus is 100000; it must be between 1 and 512"),
    ("models:\n  actor: 7B\nengine: {kind: vllm, gpu_memory_utilization: .inf}\n", "engine.gpu_memory_utilization"),
    ("models:\n  actor: {model: 7B, stage: .nan}\n", "models.actor.stage"),
    ("models:\n  actor: 7B\nrollout: [1, 2]\n", "'rollout' and 'train' must be mappings"),
    ("python -m openrlhf.cli.train_ppo_ray --pretrain 7B --micro_rollout_batch_size 1e400\n",
     "--micro_rollout_batch_size must be a finite number"),
    ("python -m openrlhf.cli.train_ppo_ray --pretrain 7B --zero_stage 7\n", "--zero_stage is 7"),
    ("python -m openrlhf.cli.train_ppo_ray --pretrain 7B --vllm_num_engines 1 --vllm_gpu_memory_utilization nan\n",
     "--vllm_gpu_memory_utilization"),
    ("python3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=7B data.max_prompt_length=1e400\n",
     "data.max_prompt_length"),
])
def test_numbers_in_job_files_and_launch_lines_are_bounded_and_named(tmp_path, text, problem):
    job = tmp_path / ("run.sh" if text.startswith("python") else "job.yaml")
    job.write_text(text)
    r = run_cli("plan", "--loop", "--job", job, *FORMULA, timeout=WAIT_S)
    assert r.returncode == 2 and problem in r.stderr and str(job) in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "internal error" not in r.stderr


@pytest.mark.process
@pytest.mark.parametrize("flags,problem", [
    (("--loop", "--model", "7B", "--ref", "0B"), "the reference model's size '0B' is"),
    (("--loop", "--model", "7B", "--critic", "1e400B"), "the critic model '1e400B' is neither"),
    (("--loop", "--model", "7B", "--reward", "99999999B:frozen"), "the reward model's size"),
    (("--loop", "--model", "7B", "--ref", "7B", "--train-batch", "0"), "argument --train-batch: value is '0'"),
    (("--loop", "--model", "7B", "--ref", "7B", "--train-batch", "1e9"), "argument --train-batch"),
    (("--model", str(LLAMA), "--transformers-version", "1e400"), "--transformers-version must look like 4.44.2"),
    (("--model", str(LLAMA), "--transformers-version", "4.44.2\nrecommended: plain"), "must look like 4.44.2"),
    (("--model", str(LLAMA), "--transformers-version", "4" * 100_000), "must look like 4.44.2"),
    (("--model", str(LLAMA), "--gpus", "nan"), "argument --gpus: value must be a finite number"),
])
def test_plan_flags_are_bounded_and_named(flags, problem):
    r = run_cli("plan", *flags, *FORMULA, timeout=WAIT_S)
    assert r.returncode == 2 and problem in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and len(r.stderr) < 600 and "internal error" not in r.stderr
    assert not any(line.startswith("recommended") for line in (r.stdout + r.stderr).splitlines())  # no forged line


@pytest.mark.process
def test_check_versions_are_bounded(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"stage": 3}}')
    for flag in ("--deepspeed-version", "--transformers-version", "--accelerate-version"):
        r = run_cli("check", cfg, flag, "0.15.0\nDSD999 forged", timeout=WAIT_S)
        assert r.returncode == 2 and "must look like 4.44.2" in r.stderr and flag in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "DSD999" not in r.stdout


@pytest.mark.process
def test_plan_loop_with_a_size_works_as_its_help_says():
    help_text = run_cli("plan", "--help", timeout=WAIT_S).stdout
    assert "a size such as 7B also works there" in " ".join(help_text.split())
    r = run_cli("plan", "--loop", "--model", "7B", "--gpus", "1", "--gpu-memory", "80GiB", *FORMULA, timeout=WAIT_S)
    assert r.returncode in (0, 1), r.stderr
    assert "actor: 6.74B params (7B, Llama-style shape of that size)" in r.stdout, r.stdout
    r = run_cli("plan", "--loop", "--model", "no-such-dir", *FORMULA, timeout=WAIT_S)
    assert r.returncode == 2 and "neither a local directory or config.json nor a size" in r.stderr, r.stderr
