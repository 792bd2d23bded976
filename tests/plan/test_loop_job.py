"""plan --loop for a whole RL job (plan/loop_job.py): several models on the same GPUs, the rollout engine, the
fastest arrangement that fits, in the framework's own settings."""
import json
import math

import pytest

from dsdoctor.config import rl
from dsdoctor.errors import InputError
from dsdoctor.plan.api import plan
from dsdoctor.plan.loop_job import evaluate_arrangement, plan_job
from tests.helpers import EXAMPLES, run_cli

DATA = EXAMPLES.parent.parent.parent / "tests" / "data" / "rl"
LLAMA_7B = EXAMPLES / "llama-7b"
A100_40G = dict(gpu_memory="40GiB", gpu_name="A100", host_memory="1TiB", detect=False, counts="formula")
GiB = 2**30


def _dschat():
    return plan_job(DATA / "dschat_step3_7b.sh", **A100_40G)


def test_dschat_job_per_gpu_sum_matches_its_parts():
    """Four 7B models (DeepSpeed-Chat step 3, actor and critic at ZeRO-2, reference and reward at stage 0):
    every row's peak is the sum of its parts, and the parts are what each model holds."""
    r = _dschat()
    g = r.given
    assert g is not None and [m["role"] for m in r.models] == ["actor", "reference", "critic", "reward"]
    for row in r.rows:
        assert sum(row.peak.parts.values()) == row.gpu_peak_bytes
        assert row.peak.total == row.gpu_peak_bytes == max(p.total for p in row.phases)
    n = r.models[0]["params"]
    shard = math.ceil(n / 8)
    parts = g.peak.parts
    for role in ("actor", "reference", "critic", "reward"):
        # ZeRO-2 and stage 0 keep the whole model on every GPU (plan's plain layout)
        assert parts[f"{role}:weights_resident"] == n * 2 and f"{role}:persistent_params" not in parts
    # ZeRO-2 keeps the fp32 master and two fp32 moments per element of the 1/8 partition all along
    assert parts["actor:optimizer_state"] == parts["critic:optimizer_state"] == (4 + 8) * shard
    assert "reference:optimizer_state" not in parts and "reward:optimizer_state" not in parts
    # the training step (the peak here) adds the gradients: the fp16 partition and its fp32 copy, and with
    # overlap_comm (DeepSpeed-Chat sets it) two reduce_bucket_size buffers of fp16
    assert g.peak.name == "train"
    step = {k.split(":", 2)[2]: v for k, v in parts.items() if k.startswith("train:")}
    assert step["gradients"] == (2 + 4) * shard and step["reduce_bucket"] == 2 * 500_000_000 * 2
    # the JSON carries the same numbers
    d = r.to_dict()
    assert d["given"]["gpu_peak_bytes"] == sum(d["given"]["breakdown"].values())


def test_zero2_for_the_actor_no_longer_fits_and_an_arrangement_that_does_is_recommended():
    """The issue: plan --loop on the actor alone says zero2 fits (8 x A100-40G, 7B); with the reference,
    critic and reward on the same GPUs it does not, and plan recommends what does."""
    alone = plan(LLAMA_7B, batch=4, prompt_len=256, new_tokens=256, dtype="fp16", gpus=8, loop=True, **A100_40G)
    # the actor alone fits zero2 by its prediction only (no loop run is archived: the widest band): edge, so a
    # path that fits outright is recommended (issue 29)
    assert alone.path("zero2").fits and alone.path("zero2").verdict == "edge" and alone.recommended.path != "zero2"
    assert "DSD231" in [f.code for f in alone.findings]  # only the actor was counted, and it says so
    r = _dschat()
    assert not r.given.fits and r.given.gpu_need_bytes > 40 * GiB
    codes = {f.code: f for f in r.findings}
    assert "DSD230" in codes and "DSD232" in codes
    rec = next(row for row in r.rows if row.arrangement == r.recommended.arrangement)
    assert rec.fits and rec.gpu_need_bytes <= 40 * GiB
    assert rec.holds["actor"] != "zero2"  # the actor alone's recommendation is not what fits the job
    assert r.recommended.changes and all(s.startswith("--") for s, _a, _b in r.recommended.changes)
    for flag, _before, after in r.recommended.changes:  # in DeepSpeed-Chat's own flags
        assert (flag if after is True else f"{flag} {after}") in r.recommended.code
    assert "DSD230" in codes and codes["DSD230"].message().startswith("the RL job as given does not fit")


def test_reference_offload_below_stage3_is_counted_whole():
    """--offload_reference_model at --actor_zero_stage 2: DeepSpeed-Chat builds the reference at stage 0 and
    DeepSpeed ignores offload_param there; the plan counts the whole reference on every GPU."""
    r = _dschat()
    assert r.models[1]["given"] == "zero0"
    assert r.given.peak.parts["reference:weights_resident"] == r.models[1]["params"] * 2


def _two_models(**kw):
    job = rl.job_from_dict({"gpus": 2, "dtype": "bf16", "models": {"actor": {"model": str(LLAMA_7B), "stage": 3},
                                                                    "reference": {"model": str(LLAMA_7B), "stage": 3,
                                                                                  "trainable": False}},
                            "rollout": {"batch": 4, "prompt_len": 512, "new_tokens": 64}, "train": {"micro_batch": 2},
                            "engine": "generate"})
    for k, v in kw.items():
        setattr(job, k, v)
    return job


def test_gather_once_adds_the_whole_weights_to_the_rollout_only():
    base = evaluate_arrangement(_two_models(), gpu_memory="141GiB", gpu_name="H200", host_memory="1TiB",
                                detect=False, counts="formula")
    once = evaluate_arrangement(_two_models(engine=rl.Engine("gather-once")), gpu_memory="141GiB", gpu_name="H200",
                                host_memory="1TiB", detect=False, counts="formula")
    b, o = ({p.name: p for p in x.phases} for x in (base, once))
    rollout = o["rollout"].parts  # on each of the 2 GPUs, beside the shards and the whole persistent parameters
    assert rollout["rollout:gathered_whole_model"] + rollout["actor:persistent_params"] == 6738415616 * 2
    assert o["train"].total == b["train"].total and o["experience"].total == b["experience"].total
    assert once.seconds["rollout"] < base.seconds["rollout"]  # ZeRO-3's hooks on every token cost more


def test_gathering_on_one_gpu_copies_nothing():
    """Measured on one H200 (bench/rlloop/job_gpu.py): ZeRO-3's partition on one rank is the whole model."""
    one = evaluate_arrangement(_two_models(engine=rl.Engine("gather-once"), gpus=1), gpu_memory="141GiB",
                               gpu_name="H200", host_memory="1TiB", detect=False, counts="formula")
    assert "rollout:gathered_whole_model" not in {p.name: p for p in one.phases}["rollout"].parts


def test_flags_give_the_job_and_the_dtype_is_kept():
    r = plan_job(actor=str(LLAMA_7B), ref=f"{LLAMA_7B}:frozen,zero3", critic="1.3B", reward="1.3B:frozen",
                 batch=4, prompt_len=256, new_tokens=128, dtype="fp16", gpus=8, **A100_40G)
    assert [m["role"] for m in r.models] == ["actor", "reference", "critic", "reward"]
    assert r.models[2]["how"] == "size" and r.given is None  # stages not all given: nothing "as given"
    code = r.recommended.code
    assert "'fp16': {'enabled': True, 'loss_scale': 0" in code and "dtype=torch.float16" in code
    assert "bf16" not in code
    cfgs = r.recommended.ds_configs
    assert cfgs["actor"]["fp16"]["loss_scale"] == 0 and "optimizer" in cfgs["actor"]
    assert "optimizer" not in cfgs["reference"]


def test_single_model_loop_code_keeps_fp16():
    r = plan(LLAMA_7B, batch=4, prompt_len=512, new_tokens=32, dtype="fp16", gpus=2, gpu_memory="141GiB",
             host_memory="1TiB", detect=False, gpu_name="H200", counts="formula", loop=True)
    code = r.recommended.code
    assert "'fp16': {'enabled': True, 'loss_scale': 0" in code and "dtype=torch.float16" in code
    assert "'bf16'" not in code


def test_trl_zero3_without_gathering_gets_a_faster_arrangement():
    r = plan_job(DATA / "trl_launch.sh", gpu_memory="80GiB", gpu_name="H100", host_memory="1TiB", detect=False)
    assert r.job["framework"] == "trl" and r.given.holds == {"actor": "zero3"} and r.given.engine == "generate"
    rec = next(row for row in r.rows if row.arrangement == r.recommended.arrangement)
    assert rec.samples_per_s > 2 * r.given.samples_per_s
    assert r.recommended.code.startswith("# trl")


@pytest.mark.parametrize("spec, problem", [("./m:zero4", "unknown option"), ("", "needs a model")])
def test_bad_model_specs_are_bad_input(spec, problem):
    with pytest.raises(InputError, match=problem):
        rl.parse_model_spec("reference", spec)


def test_a_model_that_is_neither_a_path_nor_a_size_is_bad_input():
    with pytest.raises(InputError, match="neither a local directory"):
        plan_job(actor="./no-such-model", **A100_40G)


@pytest.mark.process
def test_cli_job_json_and_bad_input(tmp_path):
    r = run_cli("plan", "--loop", "--job", str(DATA / "dschat_step3_7b.sh"), "--gpu-memory", "40GiB", "--gpu-name",
                "A100", "--host-memory", "1TiB", "--format", "json")
    assert r.returncode == 1, r.stderr  # DSD230: the job as given does not fit
    data = json.loads(r.stdout)
    assert data["given"]["fits"] is False and data["recommended"]["arrangement"]
    r = run_cli("plan", "--job", str(DATA / "dschat_step3_7b.sh"))
    assert r.returncode == 2 and "--loop" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "job.yaml"
    bad.write_text("models: {actor: {model: 7B, stage: 5}}\n")
    r = run_cli("plan", "--loop", "--job", str(bad))
    assert r.returncode == 2 and "models.actor.stage is 5; it must be between 0 and 3" in r.stderr and "Traceback" not in r.stderr
