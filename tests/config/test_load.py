"""The loader and effective settings: every spelling real configs use, and every way input can be bad."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsdoctor.config.effective import effective_settings
from dsdoctor.config.load import MAX_BYTES, load_config
from dsdoctor.errors import InputError
from tests.helpers import run_cli


def write(tmp_path, name, content):
    p = tmp_path / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content, encoding="utf-8")
    return p


# --- spellings -----------------------------------------------------------------------------------------

def test_hjson_with_comments_and_trailing_commas(tmp_path):
    p = write(tmp_path, "ds.json", '{\n  // ZeRO-3\n  "zero_optimization": {"stage": 3,},  # offload\n}\n')
    loaded = load_config(p)
    assert loaded.kind == "hjson" and effective_settings(loaded.raw).zero_stage == 3


def test_plain_json_kind_and_dict_input_is_deep_copied():
    src = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    loaded = load_config(src)
    loaded.raw["zero_optimization"]["stage"] = 0
    assert src["zero_optimization"]["stage"] == 3 and loaded.kind == "dict"


def test_bfloat16_spelling_and_unprefixed_stage3_keys():
    eff = effective_settings({"bfloat16": {"enabled": True},
                              "zero_optimization": {"stage": 3, "max_live_parameters": 5, "prefetch_bucket_size": 7}})
    assert eff.dtype == "bf16" and eff.max_live_parameters == 5 and eff.prefetch_bucket_size == 7


def test_auto_inside_sections_takes_deepspeed_default_and_hf_fills_hidden_keys():
    raw = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto", "reduce_bucket_size": "auto"},
           "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto"}
    ds = effective_settings(raw)
    assert (ds.prefetch_bucket_size, ds.param_persistence_threshold, ds.reduce_bucket_size) == (50_000_000, 100_000, 500_000_000)
    assert ds.dtype == "fp32" and ds.values["train_micro_batch_size_per_gpu"].state == "auto"
    hf = effective_settings(raw, "hf-trainer", hidden_size=4096)
    assert hf.prefetch_bucket_size == int(0.9 * 4096 * 4096) and hf.param_persistence_threshold == 40960
    assert hf.reduce_bucket_size == 4096 * 4096 and hf.values["bf16.enabled"].value is None


def test_stage_auto_is_zero_and_device_auto_is_none():
    eff = effective_settings({"zero_optimization": {"stage": "auto", "offload_param": {"device": "auto"}}})
    assert eff.zero_stage == 0 and eff.offload_param.device == "none"
    assert eff.values["zero_stage"].state == "auto"


def test_legacy_spellings_cpu_offload_and_bool_zero():
    eff = effective_settings({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True}})
    assert eff.offload_optimizer.device == "cpu" and eff.offload_param.device == "cpu"
    assert effective_settings({"zero_optimization": True}).zero_stage == 1


def test_underscore_key_is_ignored_top_level_but_rejected_inside_zero():
    eff = effective_settings({"_optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 3, "_offload_param": {}}})
    assert not eff.has_optimizer and eff.disabled_keys == ["_optimizer"]
    assert [k for k, _ in eff.invalid_keys] == ["zero_optimization._offload_param"]


def test_tensor_parallel_spellings():
    assert effective_settings({"mp_size": 2}).tp_source == "mp_size"
    assert effective_settings({"tensor_parallel": {"tp_size": 4}}).tp_size == 4
    assert effective_settings({"tensor_parallel": {"autotp_size": 2}}).tp_source == "tensor_parallel.autotp_size"


def test_accelerate_yaml_without_file_builds_the_plugin_dict(tmp_path):
    p = write(tmp_path, "acc.yaml", "distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 2\n"
              "deepspeed_config:\n  zero_stage: 3\n  offload_param_device: cpu\n  offload_optimizer_device: none\n")
    loaded = load_config(p)
    eff = effective_settings(loaded.raw)
    assert loaded.kind == "accelerate-yaml" and loaded.num_processes == 2
    assert (eff.zero_stage, eff.offload_param.device, eff.dtype) == (3, "cpu", "bf16")


def test_accelerate_yaml_following_config_file(tmp_path):
    write(tmp_path, "z3.json", json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}))
    p = write(tmp_path, "acc.yaml", "mixed_precision: bf16\ndeepspeed_config:\n  deepspeed_config_file: z3.json\n")
    loaded = load_config(p)
    assert loaded.ref_path.endswith("z3.json") and not loaded.ref_missing
    assert effective_settings(loaded.raw).dtype == "bf16"  # accelerate fills "auto" from mixed_precision


def test_accelerate_fills_auto_stage_from_its_plugin_default(tmp_path):
    # accelerate's DeepSpeedPlugin fills "auto" from its own defaults: ZeRO stage 2, no offload
    write(tmp_path, "z.json", json.dumps({"zero_optimization": {"stage": "auto", "offload_param": {"device": "auto"}}}))
    p = write(tmp_path, "acc.yaml", "deepspeed_config:\n  deepspeed_config_file: z.json\n")
    eff = effective_settings(load_config(p).raw)
    assert eff.zero_stage == 2 and eff.offload_param.device == "none"
    assert effective_settings(load_config(tmp_path / "z.json").raw).zero_stage == 0  # raw DeepSpeed: default 0


def test_trainer_yaml_missing_reference_is_reported_not_fatal(tmp_path):
    p = write(tmp_path, "sft.yaml", "model_name_or_path: x\ndeepspeed: nowhere/ds_z3.json\nbf16: true\n")
    loaded = load_config(p)
    assert loaded.kind == "trainer-yaml" and loaded.ref_missing and loaded.notes


# --- bad input -----------------------------------------------------------------------------------------

BAD = [
    ("missing", None, "no such file"),
    ("empty.json", "   \n", "is empty"),
    ("binary.json", b"\x7fELF\x00\x01", "binary"),
    ("latin1.json", b'{"a": "\xe9"}', "not UTF-8"),
    ("bad.json", '{"zero_optimization": {"stage": 3', "invalid JSON"),
    ("dup.json", '{"zero_optimization": {"stage": 3, "stage": 2}}', "duplicate key 'stage'"),
    ("dup.yaml", "a: 1\na: 2\n", "duplicate key 'a'"),
    ("bad.yaml", "a: [1, 2\n", "invalid YAML"),
    ("list.json", "[1, 2, 3]", "top level is a list"),
    ("str.json", '"zero"', "top level is a str"),
]


@pytest.mark.parametrize("name,content,problem", BAD, ids=[b[0] for b in BAD])
def test_bad_files_raise_input_error_naming_file(tmp_path, name, content, problem):
    p = tmp_path / name if content is None else write(tmp_path, name, content)
    with pytest.raises(InputError) as exc:
        load_config(p)
    assert problem in str(exc.value) and str(p) in exc.value.one_line()


def test_directory_and_huge_file(tmp_path):
    with pytest.raises(InputError, match="is a directory"):
        load_config(tmp_path)
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.truncate(MAX_BYTES + 1)
    with pytest.raises(InputError, match="limit"):
        load_config(big)


@pytest.mark.parametrize("raw,problem", [
    ({"zero_optimization": {"stage": "three"}}, "ZeRO stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 9}}, "ZeRO stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, "offload device must be"),
    ({"zero_optimization": [3]}, "must be an object"),
    ({"fp16": {"enabled": "maybe"}}, "must be true or false"),
    ({"train_micro_batch_size_per_gpu": "two"}, "must be an integer"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true"),
])
def test_wrong_types_raise(raw, problem):
    with pytest.raises(InputError, match=problem):
        effective_settings(raw)


@pytest.mark.parametrize("content,problem", [
    ('{"zero_optimization": {"stage": "three"}}', "zero_optimization.stage: ZeRO stage must be 0, 1, 2 or 3"),
    ('{"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}', "offload device"),
    ("[1]", "top level is a list"),
    ('{"a": 1, "a": 2}', "duplicate key"),
])
@pytest.mark.process
def test_cli_bad_input_exit_2_one_line(tmp_path, content, problem):
    p = write(tmp_path, "ds.json", content)
    for cmd in (("check", p), ("split", p, "-o", tmp_path / "out.json")):
        proc = run_cli(*cmd)
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == "" and "Traceback" not in proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"dsdoctor: error: {p}: ") and problem in lines[0]
    assert not (tmp_path / "out.json").exists()


@pytest.mark.process
def test_cli_missing_file_and_directory(tmp_path):
    proc = run_cli("check", tmp_path / "nope.json")
    assert proc.returncode == 2 and "nope.json: no such file" in proc.stderr
    proc = run_cli("check", tmp_path)
    assert proc.returncode == 2 and "is a directory" in proc.stderr and "Traceback" not in proc.stderr


# --- fuzz ----------------------------------------------------------------------------------------------

_fuzz_settings = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _load_or_input_error(path):
    try:
        loaded = load_config(path)
    except InputError:
        return
    try:
        effective_settings(loaded.raw)
    except InputError:
        pass


@_fuzz_settings
@given(data=st.binary(max_size=400), suffix=st.sampled_from([".json", ".yaml", ".txt"]))
def test_fuzz_bytes_load_or_input_error(tmp_path, data, suffix):
    p = tmp_path / f"fuzz{suffix}"
    p.write_bytes(data)
    _load_or_input_error(p)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**10) | st.floats(allow_nan=True) | st.sampled_from(
        ["auto", "cpu", "nvme", "gpu", "3", "true", ""]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["stage", "offload_param", "device", "enabled", "pin_memory", "zero_optimization", "bf16",
                         "fp16", "optimizer", "tensor_parallel", "autotp_size", "stage3_prefetch_bucket_size",
                         "train_micro_batch_size_per_gpu", "nvme_path", "x"]), children, max_size=4),
    max_leaves=12,
)


@_fuzz_settings
@given(doc=st.dictionaries(st.sampled_from(["zero_optimization", "fp16", "bf16", "optimizer", "mp_size",
                                            "tensor_parallel", "train_batch_size", "scheduler"]), _json_values,
                           max_size=5))
def test_fuzz_structured_configs_check_and_split(tmp_path, doc):
    from dsdoctor.config.check import check
    from dsdoctor.config.split import inference_config

    p = tmp_path / "ds.json"
    p.write_text(json.dumps(doc))
    try:
        result = check(p)
    except InputError:
        return
    result.to_dict("zh")
    result.to_text("en")
    if result.runner.name == "init_inference":  # already an inference config; a ZeRO section in it becomes
        new, changes = inference_config(load_config(p))  # the deepspeed.initialize config it asked for (issue 21)
        assert new == doc if not changes else new["zero_optimization"]["stage"] == 3
        return
    new, _changes = inference_config(load_config(p))
    json.dumps(new)
