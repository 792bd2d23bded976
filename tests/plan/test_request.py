"""Typed requests (plan/request.py): every flag of ``dsdoctor plan`` is one field's declaration, and the library
functions take the same fields as plain values. One planner: plan --loop's actor alone and a one-model RL job
are the same memory model."""
import argparse

import pytest

from dsdoctor.cli import plan as cli_plan
from dsdoctor.config import rl
from dsdoctor.errors import InputError
from dsdoctor.plan.api import plan
from dsdoctor.plan.loop_job import evaluate_arrangement, plan_job
from dsdoctor.plan.request import JobRequest, PlanRequest
from tests.helpers import EXAMPLES

LLAMA_7B = EXAMPLES / "llama-7b"
H200 = dict(gpu_memory="141GiB", gpu_name="H200", host_memory="1TiB", detect=False, counts="formula")
OWN_FLAGS = {"help", "plot", "force", "format", "lang", "fail_on", "measure"}  # the command's (--measure: run it here)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    cli_plan.register(p.add_subparsers())
    return p._subparsers._group_actions[0].choices["plan"]


def test_every_plan_flag_is_declared_once_by_a_request_field():
    actions = {a.dest: a for a in _parser()._actions}
    declared = {}
    for cls in (PlanRequest, JobRequest):
        for name, f in cls.__dataclass_fields__.items():
            if f.metadata["flag"] != "":
                declared.setdefault(name, f)
    assert set(actions) - OWN_FLAGS == set(declared)
    for name, f in declared.items():
        assert actions[name].help.startswith(f.metadata["doc"]), name
    assert actions["engine"].option_strings == ["--rollout"] and actions["recheck"].option_strings == ["--no-recheck"]


def test_command_line_values_become_the_request_and_the_rest_its_defaults():
    args = _parser().parse_args(["--model", "m", "--batch", "4", "--no-recheck", "--loop", "--dtype", "half"])
    values = cli_plan.request_values(args, PlanRequest)
    assert values == {"model": "m", "batch": 4, "recheck": False, "loop": True, "dtype": "fp16"}
    req = PlanRequest(**values)
    assert (req.prompt_len, req.new_tokens, req.counts, req.detect, req.hf_equality) == (512, 128, "auto", True, False)
    job = cli_plan.request_values(_parser().parse_args(["--ref", "7B", "--train-batch", "2"]), JobRequest, actor="a")
    assert job == {"ref": "7B", "train_batch": 2, "actor": "a"}


def test_the_library_takes_the_fields_and_nothing_else():
    with pytest.raises(TypeError):
        plan(LLAMA_7B, batchsize=4)
    with pytest.raises(TypeError):
        plan_job(actor="7B", gpu="H200")
    with pytest.raises(InputError, match="needs a model"):
        plan(None, **H200)


def _one_model_job(stage: int, engine: str, gpus: int) -> rl.RlJob:
    return rl.job_from_dict({"gpus": gpus, "dtype": "bf16", "engine": engine,
                             "models": {"actor": {"model": str(LLAMA_7B), "stage": stage}},
                             "rollout": {"batch": 4, "prompt_len": 512, "new_tokens": 32}, "train": {"micro_batch": 4}})


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("path, stage, engine", [("zero2", 2, "generate"), ("zero3-gather-once", 3, "gather-once")])
def test_the_actor_alone_is_a_one_model_job(path, stage, engine, gpus):
    """plan --loop's zero2 and zero3-gather-once rows and the RL planner's arrangement of the same actor hold the
    same bytes: one memory model, not two that drift."""
    row = plan(LLAMA_7B, batch=4, prompt_len=512, new_tokens=32, gpus=gpus, loop=True, **H200).path(path)
    job = evaluate_arrangement(_one_model_job(stage, engine, gpus), gpus=gpus, **H200)
    assert row.gpu_peak_bytes == job.gpu_peak_bytes
    assert sorted(row.breakdown.values()) == sorted(job.peak.parts.values())
    assert row.peak_at == {"rollout": "decode", "train": "train-step"}[job.peak.name]
    # gathering the whole model on one GPU copies nothing (bench/rlloop job run 1)
    assert ("gathered_whole_model" in row.breakdown) == (stage == 3 and gpus > 1 and row.peak_at == "decode")


def test_a_vllm_server_that_takes_every_gpu_is_bad_input():
    job = _one_model_job(3, "generate", 1)
    job.engine, job.framework = rl.Engine("vllm", colocate=False, gpus=1), "trl"
    with pytest.raises(InputError, match="leave none of the 1 for training"):
        evaluate_arrangement(job, gpus=1, **H200)
