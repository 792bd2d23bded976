"""The runner and mode of a config (LLaMA-Factory, axolotl, ms-swift, TrainingArguments, launch commands,
accelerate, raw DeepSpeed) and the verdict for that mode (issue 13, item 1)."""
import json

import pytest

from dsdoctor.config.check import check
from dsdoctor.config.load import load_config, parse_command
from dsdoctor.config.runner import size_from_name
from tests.helpers import DATA as HELPERS_DATA
from tests.helpers import EXAMPLES, corpus_file, run_cli, write_model_config

DATA = HELPERS_DATA / "configs"


def codes(result):
    return {f.code: f.effective_severity for f in result.findings}


def test_llamafactory_predict_with_generate_on_zero3_is_the_blocker_not_auto():
    r = check(DATA / "llamafactory_predict_z3.yaml")
    assert (r.runner.name, r.mode) == ("llamafactory", "predict-with-generate")
    c = codes(r)
    assert c["DSD120"] == "error"
    assert "DSD105" not in c  # the HF Trainer fills every "auto"
    assert "DSD101" not in c and "DSD102" not in c  # deepspeed_init(inference=True) deletes the optimizer
    fix = next(f for f in r.findings if f.code == "DSD120").fix("en")
    assert "8B" in fix and "replica per GPU" in fix and "serving engine" in fix


def test_model_size_from_model_dir_wins_over_the_name(tmp_path):
    model = write_model_config(tmp_path / "m", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                               torch_dtype="bfloat16")
    r = check(DATA / "llamafactory_predict_z3.yaml", model=model)
    fix = next(f for f in r.findings if f.code == "DSD120").fix("en")
    assert "params, " in fix and "in bf16) fits one GPU" in fix and "by its name" not in fix


def test_do_train_yaml_gets_training_findings_only():
    r = check(DATA / "llamafactory_train_z3.yaml")
    assert (r.runner.name, r.mode, r.runner.mode_source) == ("llamafactory", "train", "do_train")
    assert not {"DSD101", "DSD102", "DSD105", "DSD109", "DSD111", "DSD112", "DSD115"} & set(codes(r))


def test_mode_flag_overrides_and_old_spelling_still_works():
    r = check(DATA / "llamafactory_train_z3.yaml", mode="inference")
    assert (r.mode, r.runner.mode_source) == ("inference", "--mode")
    assert check(EXAMPLES / "train_zero3_offload.json", mode="training").mode == "train"


def test_trainer_predict_below_stage3_is_refused_by_the_trainer():
    r = check(DATA / "llamafactory_predict_z2.yaml")
    assert r.mode == "predict" and codes(r)["DSD121"] == "error"
    assert "DSD115" not in codes(r)


def test_hf_example_command_line_predict_with_generate():
    r = check(DATA / "hf_seq2seq_predict.sh")
    assert (r.kind, r.runner.name, r.mode) == ("command", "hf-trainer", "predict-with-generate")
    assert r.runner.command == "deepspeed run_translation.py"
    assert codes(r)["DSD120"] == "warning"  # Seq2SeqTrainer accepts it (synced_gpus), slowly
    assert r.effective.zero_stage == 3 and r.hf_trainer.dtype == "bf16"


def test_ms_swift_builtin_configs_and_subcommands():
    sft = check(DATA / "swift_sft.sh")
    assert (sft.runner.name, sft.mode) == ("ms-swift", "train")
    assert (sft.effective.zero_stage, sft.effective.offload_param.device) == (3, "cpu")
    assert sft.hf_trainer.dtype == "bf16"  # --torch_dtype bfloat16
    infer = check(DATA / "swift_infer.sh")
    assert (infer.runner.name, infer.mode, infer.effective.zero_stage) == ("ms-swift", "inference", 3)


@pytest.mark.parametrize("name", ["zero0", "zero2", "zero3"])  # the ms-swift files the corpus holds
def test_ms_swift_builtin_names_match_the_files_ms_swift_ships(name):
    """Our reading of `--deepspeed zeroN` equals the reading of ms-swift's own file (in the corpus)."""
    shipped = corpus_file(f"modelscope__ms-swift__swift__config__{name}.json")
    from dsdoctor.config.effective import effective_settings

    ours = effective_settings(_swift(name), "hf-trainer")
    theirs = effective_settings(load_config(shipped).raw, "hf-trainer")
    assert (ours.zero_stage, ours.offload_param.device, ours.offload_optimizer.device) == \
        (theirs.zero_stage, theirs.offload_param.device, theirs.offload_optimizer.device)


def _swift(name):
    from dsdoctor.config.load import _swift_builtin

    return _swift_builtin(name)


def test_axolotl_and_training_arguments_json():
    ax = check(DATA / "axolotl_z3.yml")
    assert (ax.runner.name, ax.mode) == ("axolotl", "train")
    ta = check(DATA / "training_args_eval.json")
    assert (ta.kind, ta.runner.name, ta.mode) == ("trainer-args", "hf-trainer", "eval")
    assert ta.effective.zero_stage == 3 and "DSD105" not in codes(ta) and "DSD101" not in codes(ta)


def test_raw_deepspeed_config_keeps_its_auto_error():
    r = check(EXAMPLES / "train_zero3_offload.json")
    assert (r.runner.name, r.mode) == ("deepspeed", "inference")
    assert codes(r)["DSD105"] == "error" and codes(r)["DSD101"] == "error"


def test_accelerate_yaml_fills_auto(tmp_path):
    (tmp_path / "ds.json").write_text((DATA / "ds_z3_auto.json").read_text())
    y = tmp_path / "acc.yaml"
    y.write_text(f"distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 2\n"
                 f"deepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n")
    r = check(y)
    assert r.runner.name == "accelerate" and "DSD105" not in codes(r)


def test_llamafactory_pure_bf16_with_zero3(tmp_path):
    (tmp_path / "ds.json").write_text((DATA / "ds_z3_auto.json").read_text())
    y = tmp_path / "lf.yaml"
    y.write_text("stage: sft\ndo_train: true\npure_bf16: true\ndeepspeed: ds.json\n")
    assert codes(check(y))["DSD131"] == "error"


def test_corpus_trainer_yaml_is_read_as_llamafactory_training():
    path = corpus_file("hiyouga__LLaMA-Factory__examples__extras__fp8__llama3_fp8_deepspeed_sft.yaml")
    assert load_config(path).kind == "trainer-yaml"  # LLaMA-Factory's own YAML, not an accelerate config
    r = check(path)
    assert (r.runner.name, r.mode) == ("llamafactory", "train")


def test_command_line_parsing():
    args = parse_command("CUDA_VISIBLE_DEVICES=0 swift sft --model m --deepspeed=zero2 --lazy_tokenize "
                         "--num_train_epochs 2 # trailing comment")
    assert args["_command"] == "swift sft" and args["deepspeed"] == "zero2"
    assert args["lazy_tokenize"] is True and args["num_train_epochs"] == 2


@pytest.mark.process
def test_a_command_without_deepspeed_is_bad_input(tmp_path):
    p = tmp_path / "cmd.sh"
    p.write_text("python infer.py --model m\n")
    proc = run_cli("check", p)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert str(p) in proc.stderr and "--deepspeed" in proc.stderr


def test_size_from_name():
    assert size_from_name("meta-llama/Meta-Llama-3-8B-Instruct") == "8B"
    assert size_from_name("Qwen/Qwen2.5-0.5B") == "0.5B"
    assert size_from_name("gpt2") is None


@pytest.mark.process
def test_cli_shows_runner_and_mode_in_text_and_json():
    proc = run_cli("check", DATA / "llamafactory_predict_z3.yaml", "--lang", "en")
    assert proc.returncode == 1, proc.stderr
    assert "runner: LLaMA-Factory (HF Trainer)" in proc.stdout and "predict-with-generate" in proc.stdout
    proc = run_cli("check", DATA / "llamafactory_predict_z3.yaml", "--format", "json", "--mode", "train")
    data = json.loads(proc.stdout)
    assert data["runner"]["name"] == "llamafactory" and data["mode"] == "train"
    assert data["runner"]["mode_source"] == "--mode" and data["versions"]["deepspeed"]["source"]
    zh = run_cli("check", DATA / "llamafactory_predict_z3.yaml", "--lang", "zh")
    assert "运行方" in zh.stdout and "DSD120" in zh.stdout


def test_missing_referenced_config_still_gets_the_mode_verdict_from_its_name(tmp_path):
    y = tmp_path / "lf.yaml"
    y.write_text("model_name_or_path: Qwen/Qwen2-72B-Instruct\nstage: sft\ndo_predict: true\n"
                 "predict_with_generate: true\ndeepspeed: examples/deepspeed/ds_z3_offload_config.json\n")
    r = check(y)
    assert {"DSD113", "DSD120"} <= set(codes(r)) and r.stage_from_name == 3
    assert "the name says 3" in r.to_text("en")
    y.write_text("stage: sft\ndo_predict: true\ndeepspeed: missing/ds_z2_config.json\n")
    assert "DSD121" in codes(check(y))


def test_script_reading_deepspeed_config_itself_is_raw_deepspeed(tmp_path):
    (tmp_path / "ds.json").write_text((DATA / "ds_z3_auto.json").read_text())
    cmd = tmp_path / "run.sh"
    cmd.write_text(f"deepspeed --num_gpus 2 infer.py --deepspeed --deepspeed_config {tmp_path / 'ds.json'}\n")
    r = check(cmd)
    assert (r.kind, r.runner.name, r.mode) == ("command", "deepspeed", "inference")
    assert codes(r)["DSD105"] == "error"  # nothing fills "auto" for a script that calls deepspeed.initialize


@pytest.mark.process
def test_runner_flag_for_a_bare_deepspeed_json():
    r = check(DATA / "ds_z3_auto.json", runner="llamafactory", mode="predict")
    assert (r.runner.name, r.mode) == ("llamafactory", "predict") and "DSD105" not in codes(r)
    assert codes(check(DATA / "ds_z3_auto.json"))["DSD105"] == "error"
    proc = run_cli("check", DATA / "ds_z3_auto.json", "--runner", "nope")
    assert proc.returncode == 2


@pytest.mark.process
def test_command_naming_a_trainer_yaml_or_accelerate_config(tmp_path):
    (tmp_path / "ds.json").write_text((DATA / "ds_z3_auto.json").read_text())
    (tmp_path / "lf.yaml").write_text("stage: sft\ndo_train: true\ntemplate: qwen\ndeepspeed: ds.json\n")
    cmd = tmp_path / "run.sh"
    cmd.write_text(f"FORCE_TORCHRUN=1 llamafactory-cli train {tmp_path / 'lf.yaml'}\n")
    r = check(cmd)
    assert (r.runner.name, r.mode, r.runner.command) == ("llamafactory", "train", "llamafactory-cli train")
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n")
    cmd.write_text(f"accelerate launch --config_file {tmp_path / 'acc.yaml'} train.py\n")
    assert check(cmd).runner.name == "accelerate"
    cmd.write_text("llamafactory-cli train missing.yaml\n")
    proc = run_cli("check", cmd)
    assert proc.returncode == 2 and "missing.yaml" in proc.stderr


def test_a_model_too_big_for_one_gpu_gets_a_tensor_parallel_way_out(tmp_path):
    y = tmp_path / "lf.yaml"
    y.write_text("model_name_or_path: Qwen/Qwen2-72B-Instruct\nstage: sft\ndo_predict: true\n"
                 "predict_with_generate: true\ndeepspeed: ds_z3_config.json\n")
    fix = next(f for f in check(y).findings if f.code == "DSD120").fix("en")
    assert "needs about 2 GPUs" in fix and "tensor parallel" in fix and "fits one GPU" not in fix


def test_shell_script_with_exports_and_continuations(tmp_path):
    (tmp_path / "ds.json").write_text((DATA / "ds_z3_auto.json").read_text())
    sh = tmp_path / "predict.sh"
    sh.write_text("#!/bin/bash\nset -e\nexport CUDA_VISIBLE_DEVICES=0,1\ncd /tmp  # somewhere\n"
                  "deepspeed --num_gpus 2 run_summarization.py \\\n  --model_name_or_path t5-small \\\n"
                  f"  --deepspeed {tmp_path / 'ds.json'} \\\n  --do_predict --predict_with_generate\n")
    r = check(sh)
    assert (r.runner.name, r.mode) == ("hf-trainer", "predict-with-generate")
    assert codes(r)["DSD120"] == "warning"
