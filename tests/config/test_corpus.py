"""Every real config in the corpus: it loads, and dsdoctor's effective stage and offload devices equal what
DeepSpeed's own config models (and accelerate's plugin, for accelerate YAMLs) compute for it."""
import os

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dsdoctor.config.check import check
from dsdoctor.config.effective import effective_settings
from dsdoctor.config.load import load_config
from tests.helpers import CORPUS, corpus_required

if not CORPUS.is_dir():
    if corpus_required():  # told these must run: a missing corpus is a failure
        pytest.fail(f"config corpus not found at {CORPUS} (DSDOCTOR_REQUIRE_CORPUS is set: the corpus tests must "
                    "run)", pytrace=False)
    pytest.skip(f"config corpus not found at {CORPUS}", allow_module_level=True)
FILES = sorted(p for p in CORPUS.iterdir() if p.name != "INDEX.tsv")


def _deepspeed_reading(raw):
    """(stage, offload_param device, offload_optimizer device, dtype) per DeepSpeed 0.19.8, or the error."""
    from deepspeed.runtime.config import _reject_removed_config_keys
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
    from deepspeed.runtime.zero.config import get_zero_config

    _reject_removed_config_keys(raw)
    z = get_zero_config(raw)
    bf16 = get_bfloat16_config(raw).enabled
    fp16 = get_float16_config(raw).enabled
    return (int(z.stage), z.offload_param.device if z.offload_param else "none",
            z.offload_optimizer.device if z.offload_optimizer else "none",
            "bf16" if bf16 else "fp16" if fp16 else "fp32")


@pytest.mark.parametrize("path", FILES, ids=[p.name[:70] for p in FILES])
def test_corpus_effective_matches_deepspeed(path):
    loaded = load_config(path)
    eff = effective_settings(loaded.raw)
    ours = (eff.zero_stage, eff.offload_param.device, eff.offload_optimizer.device, eff.dtype)
    try:
        theirs = _deepspeed_reading(loaded.raw)
    except Exception as exc:  # DeepSpeed rejects the config: we must say so (DSD114), with the same key
        assert eff.invalid_keys, f"DeepSpeed rejects {path.name} ({exc}) but dsdoctor found nothing"
        first_key = eff.invalid_keys[0][0].split(".")[-1]
        assert first_key in str(exc) or "removed" in str(exc)
        codes = {f.code for f in check(loaded).findings}
        assert "DSD114" in codes
        return
    assert ours == theirs
    assert not eff.invalid_keys, eff.invalid_keys
    check(loaded).to_dict("zh")  # every corpus file renders


ACCELERATE = [p for p in FILES if "accelerate_configs" in p.name or "accelerate_ds_zero3" in p.name]


@pytest.mark.parametrize("path", ACCELERATE, ids=[p.name[:70] for p in ACCELERATE])
def test_accelerate_yaml_matches_accelerate_plugin(path, monkeypatch):
    import yaml
    from accelerate.utils import DeepSpeedPlugin

    data = yaml.safe_load(path.read_text())
    ds = data["deepspeed_config"]
    for var in [v for v in os.environ if v.startswith("ACCELERATE_")]:
        monkeypatch.delenv(var)
    plugin = DeepSpeedPlugin(
        zero_stage=ds.get("zero_stage"), offload_param_device=ds.get("offload_param_device"),
        offload_optimizer_device=ds.get("offload_optimizer_device"),
        gradient_accumulation_steps=ds.get("gradient_accumulation_steps"),
        gradient_clipping=ds.get("gradient_clipping"), zero3_save_16bit_model=ds.get("zero3_save_16bit_model"),
    )
    theirs = plugin.deepspeed_config
    ours = load_config(path).raw
    assert ours["zero_optimization"] == theirs["zero_optimization"]
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert ours[key] == theirs[key]
    eff = effective_settings(ours)
    assert (eff.zero_stage, eff.offload_param.device) == _deepspeed_reading(theirs)[:2]


SPLITTABLE = [p for p in FILES if not load_config(p).ref_missing]


@pytest.mark.parametrize("path", SPLITTABLE, ids=[p.name[:70] for p in SPLITTABLE])
def test_split_of_every_corpus_config_is_accepted_by_deepspeed(path, tmp_path):
    """DeepSpeedConfig (the parser deepspeed.initialize runs) accepts every split config, with the stage and
    offload_param kept and no optimizer."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from dsdoctor.config.split import split

    loaded = load_config(path)
    before = effective_settings(loaded.raw)
    result = split(loaded, tmp_path / "infer.json")
    if result.config.get("aio", {}).get("use_gds"):
        pytest.skip("GPUDirect Storage config: DeepSpeed asserts a CUDA accelerator when parsing it")
    parsed = DeepSpeedConfig(result.config)
    assert parsed.optimizer_name is None and parsed.scheduler_name is None
    assert parsed.train_micro_batch_size_per_gpu >= 1
    assert int(parsed.zero_optimization_stage) == (3 if before.zero_stage == 3 else 0)
    if before.zero_stage == 3:
        want = before.offload_param.device
        got = parsed.zero_config.offload_param.device if parsed.zero_config.offload_param else "none"
        assert got == want


# what split's output may still be told, and why split cannot settle it: the host's free RAM decides pin_memory
# (DSD107); an fp16 section for a bf16 model is the decision itself on a GPU without bf16, or the user's own
# explicit choice when no GPU is known (DSD110)
NOT_SPLITS_TO_FIX = {"DSD107", "DSD110"}


@pytest.mark.parametrize("path", SPLITTABLE, ids=[p.name[:70] for p in SPLITTABLE])
def test_split_output_passes_its_own_check(path, tmp_path):
    """Issue 31.3: what split writes, checked again from the file, has no finding a deletion fixes (DSD322's
    prefetch of 0, DSD109's knob above DeepSpeed's default), with and without a model and with the dtype diagnose
    passes; what is left is advice split cannot decide; the precision sections say the dtype asked for."""
    from dsdoctor.config.split import split
    from tests.helpers import EXAMPLES

    for i, (model, dtype) in enumerate([(None, None), (EXAMPLES / "llama-7b", None), (EXAMPLES / "llama-7b", "fp16"),
                                        (None, "bf16")]):
        out = tmp_path / f"infer{i}.json"
        result = split(path, out, model=model, dtype=dtype)
        again = check(out, mode="inference", model=model).findings
        assert [f.code for f in again] == [f.code for f in result.findings]
        assert not [f.code for f in again if f.deletes], (model, dtype)
        assert {f.code for f in again} <= NOT_SPLITS_TO_FIX, (model, dtype)
        if dtype is not None:
            assert effective_settings(result.config).dtype == dtype


def test_unfilled_auto_really_crashes_deepspeed():
    """DSD105's claim: raw DeepSpeed does not fill "auto" in top-level numbers; it fails with a TypeError."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from tests.helpers import EXAMPLES

    raw = load_config(EXAMPLES / "train_zero3_offload.json").raw
    with pytest.raises(TypeError):
        DeepSpeedConfig(raw)


_leaf = (st.none() | st.booleans() | st.integers(-3, 10**10) | st.floats(allow_nan=False, allow_infinity=False)
         | st.sampled_from(["auto", "cpu", "nvme", "none", "gpu", "3", "true", "", "/tmp/nvme"]))
_zero_keys = st.sampled_from(["stage", "offload_param", "offload_optimizer", "stage3_prefetch_bucket_size",
                              "prefetch_bucket_size", "reduce_bucket_size", "overlap_comm", "sub_group_size",
                              "stage3_max_live_parameters", "_comment", "cpu_offload", "bogus"])
_offload = st.dictionaries(st.sampled_from(["device", "pin_memory", "nvme_path", "buffer_count", "ratio", "x"]),
                           _leaf, max_size=3)
_zero = st.dictionaries(_zero_keys, _leaf | _offload, max_size=5)
_prec = st.dictionaries(st.sampled_from(["enabled", "loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis",
                                        "fp16", "auto_cast", "immediate_grad_update"]), _leaf,
                        max_size=3)


@settings(max_examples=300, deadline=None)
@given(doc=st.fixed_dictionaries({}, optional={
    "zero_optimization": _zero, "fp16": _prec, "bf16": _prec, "optimizer": st.just({"type": "Adam"}),
    "train_batch_size": _leaf, "train_micro_batch_size_per_gpu": _leaf, "gradient_clipping": _leaf,
    "amp": st.just({"enabled": True}), "tensor_parallel": st.dictionaries(st.just("autotp_size"), _leaf),
}))
def test_fuzz_what_dsdoctor_accepts_splits_into_a_config_deepspeed_accepts(doc):
    """Property: whenever dsdoctor reads a config without an InputError, its split is a config that
    DeepSpeedConfig parses, with stage 3 kept and everything else at stage 0."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from dsdoctor.config.split import inference_config
    from dsdoctor.errors import InputError

    try:
        eff = effective_settings(doc)
        new, _ = inference_config(load_config(doc))
    except InputError:
        return
    parsed = DeepSpeedConfig(new)
    assert int(parsed.zero_optimization_stage) == (3 if eff.zero_stage == 3 else 0)
    assert parsed.optimizer_name is None


@settings(max_examples=300, deadline=None)
@given(doc=st.fixed_dictionaries({}, optional={"zero_optimization": _zero, "fp16": _prec, "bf16": _prec,
                                               "amp": st.just({"enabled": True})}))
# found by this property once: a deprecated key together with the key that replaces it, even as null
@example(doc={"zero_optimization": {"cpu_offload": None, "offload_optimizer": None}})
@example(doc={"zero_optimization": {"cpu_offload_param": False, "offload_param": {"device": "cpu"}}})
@example(doc={"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True,
                                    "stage3_gather_16bit_weights_on_model_save": True}})
@example(doc={"zero_optimization": {"cpu_offload": "auto", "offload_optimizer": None}})
def test_fuzz_dsdoctor_rejects_exactly_what_deepspeed_rejects(doc):
    """Property, both ways: DeepSpeed's parsers reject a section iff dsdoctor reports a rejected key (DSD114)
    or refuses the value outright (InputError); when both accept, they agree on stage, offload and dtype."""
    from dsdoctor.errors import InputError

    try:
        theirs = _deepspeed_reading(doc)
    except Exception:
        theirs = None
    try:
        eff = effective_settings(doc)
    except InputError:
        assert theirs is None, f"dsdoctor refused a config DeepSpeed accepts: {doc}"
        return
    if theirs is None:
        assert eff.invalid_keys, f"DeepSpeed rejects {doc}, dsdoctor found nothing"
    else:
        assert not eff.invalid_keys, f"false DSD114 on a config DeepSpeed accepts: {eff.invalid_keys}"
        assert (eff.zero_stage, eff.offload_param.device, eff.offload_optimizer.device, eff.dtype) == theirs


@pytest.mark.parametrize("name", [
    "huggingface__accelerate__examples__deepspeed_config_templates__zero_stage3_offload_config.json",
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z3_config.json"])
def test_accelerate_yaml_with_config_file_matches_accelerate_plugin(name, tmp_path, monkeypatch):
    """An accelerate YAML naming a real corpus config (with "auto" stage/offload added): dsdoctor's dict
    equals the one accelerate's DeepSpeedPlugin builds from the same file."""
    import json as _json

    from accelerate.utils import DeepSpeedPlugin

    for var in [v for v in os.environ if v.startswith("ACCELERATE_")]:
        monkeypatch.delenv(var)
    cfg = _json.loads((CORPUS / name).read_text())
    cfg["zero_optimization"]["stage"] = "auto"
    cfg["zero_optimization"]["offload_param"] = {"device": "auto"}
    ds = tmp_path / "ds.json"
    ds.write_text(_json.dumps(cfg))
    y = tmp_path / "acc.yaml"
    y.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {ds}\n")
    theirs = DeepSpeedPlugin(hf_ds_config=str(ds)).deepspeed_config
    ours = load_config(y).raw
    assert ours["zero_optimization"] == theirs["zero_optimization"]
    assert ours["gradient_accumulation_steps"] == theirs["gradient_accumulation_steps"]
    assert effective_settings(ours).zero_stage == 2
