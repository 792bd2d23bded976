"""The decision logic on clear cases, the DeepSpeed knobs, and the findings."""
import json

import pytest

from dsdoctor.errors import InputError
from dsdoctor.findings import exit_code
from dsdoctor.model.formulas import from_formula
from dsdoctor.model.spec import load_model_spec
from dsdoctor.plan.api import plan
from dsdoctor.plan.ds_knobs import knobs_from_dict, load_knobs
from dsdoctor.plan.hardware import make_hardware
from dsdoctor.plan.memory import allocated
from dsdoctor.plan.paths import by_name
from dsdoctor.plan.shape import model_shape
from dsdoctor.plan.workload import make_workload
from tests.helpers import EXAMPLES

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
         "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
LLAMA_7B = EXAMPLES / "llama-7b"
PATHS = ("plain", "tp", "zero3", "zero3-offload", "zero3-offload-nvme")  # measured on GPUs, in the plan's order
LLAMA_70B = dict(LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256)


@pytest.fixture
def llama70(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    return tmp_path


def _plan(model, gpus, **kw):
    kw.setdefault("counts", "formula")
    return plan(model, batch=kw.pop("batch", 1), prompt_len=kw.pop("prompt_len", 1024),
                new_tokens=kw.pop("new_tokens", 128), gpus=gpus, gpu_memory="80GB", host_memory="1TiB",
                detect=False, gpu_name="H100", **kw)


def test_7b_on_one_80gb_gpu_is_plain():
    r = _plan(LLAMA_7B, 1)
    assert r.recommended.path == "plain"
    assert r.path("plain").fits and r.path("tp") is None  # tp needs two GPUs


def test_7b_on_eight_gpus_is_still_plain_one_replica_each():
    r = _plan(LLAMA_7B, 8)
    assert r.recommended.path == "plain"
    assert r.path("plain").replicas == 8 and r.path("tp").fits
    assert "torchrun --nproc_per_node 8" in r.recommended.code


def test_70b_on_one_80gb_gpu_needs_offload(llama70):
    r = _plan(llama70, 1)
    assert not r.path("plain").fits and not r.path("zero3").fits
    assert r.recommended.path == "zero3-offload"
    assert r.recommended.ds_config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "synced_gpus=True" in r.recommended.code


def test_70b_on_four_80gb_gpus_is_tp(llama70):
    r = _plan(llama70, 4)
    assert r.path("tp").fits and r.path("zero3").fits
    # two groups of tp 2 serve two batches at once: more tokens/s for the machine than tp over 4
    chosen = r.path(r.recommended.path)
    assert chosen.tp is not None and chosen.fits
    assert f'tensor_parallel={{"tp_size": {chosen.tp}}}' in r.recommended.code


def test_a_given_h2d_bandwidth_is_not_called_assumed():
    """With --h2d-bandwidth given, DSD205 names neither the bandwidth nor the pinned copy rate taken from it
    (it did: the speed figures read a ``given`` list Hardware never had)."""
    def assumed(**kw):
        r = _plan(LLAMA_7B, 2, **kw)
        return next(f for f in r.findings if f.code == "DSD205").values["assumed"], r.hardware.profile["assumed"]

    text, figures = assumed()
    assert "h2d_bandwidth=" in text and "h2d_pinned" in text and "h2d_pinned" in figures
    text, figures = assumed(h2d_bandwidth="25GB")
    assert "h2d_bandwidth" not in text and "h2d_pinned" not in text and "h2d_pinned" not in figures
    assert "h2d_pageable" in figures  # the pageable rate is still the assumed share of the given one


def test_exact_counts_agree_with_formula_for_llama():
    pytest.importorskip("transformers")
    exact = _plan(LLAMA_7B, 1, counts="meta")
    formula = _plan(LLAMA_7B, 1)
    assert exact.model["counted_by"] == "meta"
    assert exact.model["num_params"] == formula.model["num_params"] == 6738415616


def _estimate(name, gpus, batch=4, prompt=512, knobs=None, model=LLAMA_7B):
    spec = load_model_spec(model)
    shape = model_shape(spec, from_formula(spec))
    wl = make_workload(batch, prompt, 64, "bf16", None)
    hw = make_hardware(gpus=gpus, gpu_memory="80GB", host_memory="1TiB", detect=False)
    return allocated(by_name(name)().layout(hw.gpus, knobs), shape, wl, knobs)


def test_zero3_shards_weights_but_not_cache_or_activations():
    plain, z2 = _estimate("plain", 2), _estimate("zero3", 2)
    assert z2.gpu_breakdown["weights_resident"] == pytest.approx(plain.gpu_breakdown["weights_resident"] / 2, rel=0.01)
    assert z2.gpu_peak_bytes > plain.gpu_peak_bytes / 2  # gathered layers, cache, activations stay whole


def test_zero3_on_one_rank_shards_nothing():
    z1, plain = _estimate("zero3", 1), _estimate("plain", 1)
    assert z1.gpu_peak_bytes >= plain.gpu_peak_bytes
    assert "gathered_params" not in z1.gpu_breakdown


def test_max_live_parameters_bounds_the_gather_working_set():
    wide = _estimate("zero3", 2, knobs=knobs_from_dict({"max_live_parameters": 10**9}))
    tight = _estimate("zero3", 2, knobs=knobs_from_dict({"max_live_parameters": 10**8}))
    largest = 32000 * 4096  # the embedding / lm_head
    assert tight.gpu_breakdown["gathered_params"] < wide.gpu_breakdown["gathered_params"]
    # bounded by max_live plus one overshooting parameter, and a flat buffer copied out on first use
    assert tight.gpu_breakdown["gathered_params"] <= 2 * (10**8 + largest) * 2


def test_offload_moves_weights_to_pinned_host_memory():
    off = _estimate("zero3-offload", 2)
    assert "weights_resident" not in off.gpu_breakdown
    assert off.host_breakdown["offloaded_params_pinned"] >= 6738415616 * 2


def test_memory_grows_with_batch_and_context():
    small, big_b, big_s = _estimate("plain", 1), _estimate("plain", 1, batch=16), _estimate("plain", 1, prompt=4096)
    assert big_b.gpu_peak_bytes > small.gpu_peak_bytes and big_s.gpu_peak_bytes > small.gpu_peak_bytes


def test_training_config_costs_and_zero3_not_needed(tmp_path):
    r = _plan(LLAMA_7B, 2, config=EXAMPLES / "train_zero3_offload.json")
    codes = {f.code for f in r.findings}
    assert {"DSD201", "DSD203"} <= codes
    assert r.recommended.path == "plain"
    cp = r.path("zero3-offload")
    # every local rank pins its shard of optimizer state: 17 B per element (measured), 2 ranks on the node
    assert cp.host_breakdown["optimizer_state"] == 2 * 17 * -(-6738415616 // 2)
    assert exit_code(r.findings, "warning") == 1 and exit_code(r.findings, "error") == 0


def test_nothing_fits_is_an_error(llama70):
    r = plan(llama70, batch=1, prompt_len=512, new_tokens=16, gpus=1, gpu_memory="2GB", host_memory="64GB",
             detect=False, counts="formula")
    assert r.recommended.path is None
    assert [f.code for f in r.findings if f.code == "DSD202"] == ["DSD202"]
    assert exit_code(r.findings) == 1


def test_config_path_that_does_not_fit_is_an_error(llama70):
    cfg = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    r = _plan(llama70, 1, config=cfg)
    f = next(f for f in r.findings if f.code == "DSD204")
    assert f.values["path"] == "zero3" and f.values["recommended"] == "zero3-offload"


def test_unpinned_offload_warns(llama70):
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}},
           "train_micro_batch_size_per_gpu": 1}
    r = _plan(llama70, 1, config=cfg)
    assert "DSD206" in {f.code for f in r.findings}
    pinned = _plan(llama70, 1)
    assert r.path("zero3-offload").tokens_per_s < pinned.path("zero3-offload").tokens_per_s


def test_knobs_follow_deepspeed_semantics(tmp_path):
    k = load_knobs({"zero_optimization": {"stage": "auto", "offload_param": {"device": "cpu"}}})
    assert k.zero_stage == 0 and k.offload_param is None  # "auto" is dropped: stage 0; offload ignored below 3
    k = load_knobs({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                          "max_live_parameters": 3e8}, "optimizer": {"type": "AdamW"}})
    assert k.prefetch_bucket_size == 50_000_000 and k.max_live_parameters == 300_000_000 and k.has_optimizer
    bad = tmp_path / "dup.json"
    bad.write_text('{"zero_optimization": {"stage": 3}, "zero_optimization": {"stage": 2}}')
    with pytest.raises(InputError, match="duplicate"):
        load_knobs(bad)
    with pytest.raises(InputError, match="no such file"):
        load_knobs(tmp_path / "missing.json")
    with pytest.raises(InputError, match="unknown plan knobs"):
        knobs_from_dict({"stage": 3})


def test_plan_config_reads_reuse_distance_and_nvme_buffers(tmp_path, llama70):
    # regression: plan --config used to drop stage3_max_reuse_distance and the NVMe buffer settings
    cfg = {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0,
                                 "offload_param": {"device": "nvme", "nvme_path": "/nvme",
                                                   "buffer_count": 2, "buffer_size": 3e8}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    k = load_knobs(path)
    assert (k.max_reuse_distance, k.nvme_buffer_count, k.nvme_buffer_size) == (0, 2, 300_000_000)
    assert k.offload_param == "nvme" and k.source == str(path)
    r = _plan(llama70, 1, config=path)
    assert r.knobs.max_reuse_distance == 0 and r.knobs.nvme_buffer_count == 2
    default = _plan(llama70, 1, config={"zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": "/nvme"}}})
    buffers = r.path("zero3-offload-nvme").host_breakdown["nvme_swap_buffers_pinned"]
    assert buffers != default.path("zero3-offload-nvme").host_breakdown["nvme_swap_buffers_pinned"]
    # 2 buffers of 3e8 bf16 elements, each rounded up to a power of two bytes, on the one rank
    assert buffers == 2 * 2 ** (600_000_000 - 1).bit_length()


def test_plan_takes_an_already_loaded_config(llama70):
    from dsdoctor.config.load import load_config

    loaded = load_config({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 10**8}})
    eff = loaded.effective("deepspeed")
    r = _plan(llama70, 2, config=loaded)
    assert r.knobs.max_live_parameters == 10**8
    assert loaded.effective("deepspeed") is eff  # read once, shared


# past max_position_embeddings is refused only for learned position tables (plan/test_paths.py)
@pytest.mark.parametrize("kw,match", [({"batch": 0}, "batch"), ({"dtype": "int4"}, "dtype")])
def test_bad_workload_is_input_error(kw, match):
    args = dict(batch=1, prompt_len=512, new_tokens=16)
    args.update(kw)
    with pytest.raises(InputError, match=match):
        plan(LLAMA_7B, gpus=1, gpu_memory="80GB", detect=False, counts="formula", **args)


def test_every_path_reports_what_fits():
    r = _plan(LLAMA_7B, 2)
    measured = [p for p in r.paths if not p.estimate]  # estimate paths (device-map, quantized) search no limits
    assert [p.name for p in measured] == list(PATHS)
    for p in measured:
        assert p.max_batch and p.max_batch >= 1 and p.max_prompt_len and p.max_prompt_len >= 1024
        wider = plan(LLAMA_7B, batch=p.max_batch + 1, prompt_len=1024, new_tokens=128, gpus=2, gpu_memory="80GB",
                     host_memory="1TiB", detect=False, counts="formula").path(p.name)
        if p.max_batch < 4096:  # the largest that fits outright: one more is at the edge or does not fit
            assert wider.verdict != "fits"
        if p.edge_batch and p.edge_batch < 4096:  # the largest that fits by the prediction only
            assert not plan(LLAMA_7B, batch=p.edge_batch + 1, prompt_len=1024, new_tokens=128, gpus=2,
                            gpu_memory="80GB", host_memory="1TiB", detect=False, counts="formula").path(p.name).fits


def test_library_api_plan_works_after_the_package_is_imported():
    import dsdoctor.api
    import dsdoctor.plan.api  # noqa: F401  (binds the attribute dsdoctor.plan to the package)

    r = dsdoctor.api.plan(LLAMA_7B, gpus=1, gpu_memory="80GB", detect=False, counts="formula")
    assert r.recommended.path == "plain"


def test_first_generate_term_beside_the_steady_state_speed():
    """plan's tokens/s is a repeated generate's; the first generate of a process pays once per new KV-cache
    length (FACTS: 7B, batch 4 on an H200, 55 then ~160 tokens/s). A plain term: the steady figures stay."""
    from dsdoctor.plan.speed import NEW_LENGTH_S

    r = _plan(LLAMA_7B, 1, batch=4, prompt_len=512, new_tokens=256)
    for p in r.paths:
        assert p.first_generate_extra_s == pytest.approx(256 * NEW_LENGTH_S, abs=1e-3)
        steady_s = 4 * 256 / p.tokens_per_s
        assert p.first_generate_tokens_per_s == pytest.approx(4 * 256 / (steady_s + p.first_generate_extra_s),
                                                              rel=1e-3)
        assert p.first_generate_tokens_per_s < p.tokens_per_s
    plain = r.path("plain")
    assert 2.0 < plain.tokens_per_s / plain.first_generate_tokens_per_s < 3.5  # the measured 2.2-3x
    assert "the first generate of a process takes about 10.2s longer" in r.to_text("en")
    assert r.to_dict()["paths"][0]["first_generate_extra_s"] == plain.first_generate_extra_s


def test_a_calibrated_per_length_figure_replaces_the_assumed_one():
    from dsdoctor.plan.hardware import make_hardware
    from dsdoctor.plan.speed import figures_for, first_generate_extra_s
    from dsdoctor.plan.workload import make_workload

    class Profile:
        measured = {"new_length_s": 0.01}

    hw = make_hardware(gpus=1, gpu_memory="80GB", host_memory="1TiB", detect=False, gpu_name="H100")
    wl = make_workload(batch=1, prompt_len=16, new_tokens=100, dtype="bf16", model_dtype="bf16")
    assert first_generate_extra_s(wl, figures_for(hw, Profile())) == pytest.approx(1.0)
    assert "new_length_s" not in figures_for(hw, None).assumed  # never listed in DSD205
