"""RL jobs read from what users run (config/rl.py) and what check says about them (config/rl_checks.py,
DSD140-DSD144): DeepSpeed-Chat, OpenRLHF, verl and trl launch lines, a trl YAML, a DeepSpeed-Chat actor config.
The fixtures in tests/data/rl were written for these tests."""
import pytest

from dsdoctor.config import rl
from dsdoctor.config.check import check
from dsdoctor.errors import InputError
from tests.helpers import DATA, run_cli

RL = DATA / "rl"


def codes(result):
    return {f.code: f for f in result.findings}


def test_deepspeed_chat_launch_line():
    job = rl.read_job(RL / "dschat_step3_7b.sh")
    assert job.framework == "deepspeed-chat" and job.gpus == 8 and job.dtype == "fp16"
    by = {m.role: m for m in job.models}
    # ACTOR_ZERO_STAGE=$3 with a default of 2 set in the script's if-block
    assert by["actor"].stage == 2 and by["critic"].stage == 2 and by["actor"].trainable
    # the reference follows the actor (stage 0 unless the actor is at 3), the reward the critic
    assert by["reference"].stage == 0 and by["reward"].stage == 0 and not by["reference"].trainable
    assert by["reference"].offload_param and by["reference"].source == "/data/ckpt/llama-2-7b-sft"
    assert (job.batch, job.prompt_len, job.new_tokens, job.train_batch) == (4, 256, 256, 4)
    assert job.engine.kind == "generate"

    r = check(RL / "dschat_step3_7b.sh")
    f = codes(r)
    assert r.mode == "train" and r.effective.zero_stage == 2 and r.effective.dtype == "fp16"
    assert "DSD142" in f and "--offload_reference_model has no effect" in f["DSD142"].message()
    assert "the whole reference stays on every GPU" in f["DSD142"].message()
    assert "--actor_zero_stage 3" in f["DSD142"].fix()
    assert "DSD140" in f and "reference (frozen, ZeRO-0)" in f["DSD140"].message()
    assert "DSD141" not in f  # stage 2: the actor's weights are whole, nothing gathered per token
    assert "ZeRO-0" in f["DSD140"].message("zh")


def test_deepspeed_chat_zero3_without_the_hybrid_engine(tmp_path):
    line = (RL / "dschat_step3_7b.sh").read_text().replace("ACTOR_ZERO_STAGE=2", "ACTOR_ZERO_STAGE=3")
    (tmp_path / "run.sh").write_text(line)
    f = codes(check(tmp_path / "run.sh"))
    assert "DSD141" in f and "without --enable_hybrid_engine" in f["DSD141"].message()
    assert "--enable_hybrid_engine" in f["DSD141"].fix()
    assert "DSD142" not in f  # at stage 3 the reference is sharded and offloaded as asked
    (tmp_path / "he.sh").write_text(line.replace("--dtype fp16", "--dtype fp16 --enable_hybrid_engine"))
    f = codes(check(tmp_path / "he.sh"))
    assert "DSD141" not in f and "DSD143" in f
    assert "kept allocated through training" in f["DSD143"].message()


def test_a_deepspeed_chat_actor_config_is_read_as_training_with_generation():
    """The issue: DSD112 alone in inference mode, nothing in train mode."""
    r = check(RL / "dschat_actor_ds_config.json")
    f = codes(r)
    assert r.mode == "train" and r.runner.mode_source == "hybrid_engine block (RLHF actor)"
    assert "DSD144" in f and "DSD141" in f and "DSD112" not in f
    assert "with hybrid_engine disabled" in f["DSD141"].message()
    forced = check(RL / "dschat_actor_ds_config.json", mode="inference")  # --mode still wins
    assert forced.mode == "inference" and "DSD112" in codes(forced)


def test_openrlhf_launch_line():
    job = rl.read_job(RL / "openrlhf_ppo.sh")
    by = {m.role: m for m in job.models}
    assert job.framework == "openrlhf" and job.gpus == 8 and job.dtype == "bf16"
    assert by["actor"].stage == by["critic"].stage == 2 and by["reference"].stage == by["reward"].stage == 0
    assert by["critic"].source == "OpenRLHF/Llama-3-8b-rm-mixture"  # defaults to the reward model
    assert {m.group for m in job.models} == {"all"}  # --colocate_all_models
    e = job.engine
    assert (e.kind, e.colocate, e.gpu_memory_utilization, e.tp, e.sleep) == ("vllm", True, 0.6, 2, False)
    assert (job.batch, job.experience_batch, job.train_batch) == (16, 16, 8)
    f = codes(check(RL / "openrlhf_ppo.sh"))
    assert "DSD142" in f and "--ref_reward_offload" in f["DSD142"].message()
    assert "DSD143" in f and "held through the training step too" in f["DSD143"].message()


def test_openrlhf_without_colocation_places_groups_apart(tmp_path):
    text = (RL / "openrlhf_ppo.sh").read_text().replace("--colocate_all_models", "--colocate_actor_ref")
    (tmp_path / "run.sh").write_text(text)
    job = rl.read_job(tmp_path / "run.sh")
    groups = {m.role: m.group for m in job.models}
    assert groups == {"actor": "actor", "reference": "actor", "critic": "critic", "reward": "reward"}
    assert job.engine.kind == "vllm" and not job.engine.colocate and job.engine.gpus == 8


def test_verl_overrides():
    job = rl.read_job(RL / "verl_grpo.sh")
    assert job.framework == "verl" and job.gpus == 8
    assert [m.role for m in job.models] == ["actor", "reference"]  # grpo: no critic; use_kl_loss: a reference
    assert job.model("actor").stage == 3 and job.model("reference").offload_param
    assert job.model("actor").gradient_checkpointing
    e = job.engine
    assert (e.kind, e.tp, e.gpu_memory_utilization, e.sleep) == ("vllm", 2, 0.6, True)
    assert job.batch == 256 * 4 // 8 and job.new_tokens == 1024 and job.train_batch == 4
    r = check(RL / "verl_grpo.sh")
    assert any("FSDP" in n for n in r.notes) and "DSD140" in codes(r)


def test_trl_yaml_and_launch_line():
    r = check(RL / "trl_grpo.yaml")
    f = codes(r)
    assert r.mode == "train" and "DSD140" in f and "DSD143" in f
    assert "gpu_memory_utilization 0.3" in f["DSD143"].message()
    job = rl.read_job(RL / "trl_grpo.yaml")
    assert job.framework == "trl" and [m.stage for m in job.models] == [3, 3]  # zero3.json, beta 0.04 > 0
    assert job.engine.kind == "vllm" and job.engine.colocate
    f = codes(check(RL / "trl_launch.sh"))
    assert "DSD141" in f and "ds3_gather_for_generation: false" in f["DSD141"].message()
    assert "ds3_gather_for_generation: true" in f["DSD141"].fix()
    job = rl.read_job(RL / "trl_launch.sh")
    assert job.gpus == 8 and job.model("actor").stage == 3 and job.engine.kind == "generate"
    assert job.model("reference") is None and any("beta" in n for n in job.notes)


@pytest.mark.parametrize("spec, want", [
    ("./llama-7b:frozen,zero3,offload", ("./llama-7b", False, 3, True, False)),
    ("7B", ("7B", False, None, False, False)),
    ("./m:trainable,zero2,offload-optimizer,ckpt", ("./m", True, 2, False, True)),
])
def test_model_specs(spec, want):
    m = rl.parse_model_spec("reference", spec)
    assert (m.source, m.trainable, m.stage, m.offload_param, m.offload_optimizer) == want


def test_a_job_file_with_a_bad_field_names_it(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("models: {actor: {model: 7B}, critic: 3}\n")
    with pytest.raises(InputError, match="models.critic needs 'model'"):
        rl.read_job(p)
    p.write_text("{\"rollout\": {\"batch\": 2}}")
    with pytest.raises(InputError, match="neither an RL job file"):
        rl.read_job(p)


@pytest.mark.process
def test_cli_check_of_a_launch_line():
    r = run_cli("check", str(RL / "dschat_step3_7b.sh"), "--fail-on", "warning")
    assert r.returncode == 1 and "DSD142" in r.stdout and "DeepSpeed-Chat launch line" in r.stdout
