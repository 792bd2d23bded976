"""The memory model against real allocations: transformers' generate, and real ZeRO-3 ranks, on the CPU.

torch's profiler records every CPU allocation and free; replaying them gives the peak of live tensor bytes,
the quantity ``torch.cuda.max_memory_allocated`` reports on a GPU. GPU numbers: bench/plan.
"""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dsdoctor.plan.api import plan  # noqa: E402
from dsdoctor.plan.memory import CUBLAS_WORKSPACE  # noqa: E402
from tests.helpers import ROOT, deepspeed_launch  # noqa: E402

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 688, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 32, "vocab_size": 4000, "max_position_embeddings": 2048, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("acc")
    (d / "config.json").write_text(json.dumps(MODEL))
    return d


def _cpu_peak(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return peak


@pytest.mark.slow  # real generate under torch's profiler
@pytest.mark.parametrize("batch,prompt,new", [(1, 64, 40), (8, 256, 8), (4, 1024, 4), (2, 512, 120)])
def test_plain_peak_matches_real_generate(model_dir, batch, prompt, new):
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        def run():
            model = LlamaForCausalLM(cfg).eval()  # load: built in place, as on the GPU
            ids = torch.randint(3, cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0)

        measured = _cpu_peak(run)
    finally:
        torch.set_default_dtype(old)
    r = plan(model_dir, batch=batch, prompt_len=prompt, new_tokens=new, dtype="bf16", gpus=1, gpu_memory="80GiB",
             detect=False)
    predicted = r.path("plain").gpu_peak_bytes - CUBLAS_WORKSPACE  # the CPU has no cuBLAS workspace
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured, r.path("plain").breakdown)
    weights_only = r.weights_only_bytes
    assert abs(weights_only - measured) > abs(predicted - measured)


@pytest.mark.deepspeed
def test_zero3_two_ranks_load_and_generate(model_dir, tmp_path):
    out = tmp_path / "z3.json"
    proc = deepspeed_launch(ROOT / "tests" / "scripts" / "zero3_cpu_peak.py", out, model_dir, nprocs=2,
                            timeout=400)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    # On the CPU accelerator the profiler's byte counts are not repeatable on the shared 2-core machine: above
    # what the plan predicts, runs add from nothing up to one more vocab x hidden matrix and ~10-30% more
    # (host-side leftovers of initialize and of the gloo/shm collectives, freed at varying times; open point
    # in bench/plan/RESULTS.md). So this test pins what is deterministic: the shards remain after load, the
    # whole module being built sits on top of them during load, and the generate prediction is never above
    # the measurement nor grossly below it. The accuracy itself is measured on GPUs (BENCHMARKS.md).
    shards = d["predicted_shards"] - d["breakdown"].get("persistent_params", 0)
    extra = 2 * MODEL["vocab_size"] * MODEL["hidden_size"]  # lm_head, the largest module, built whole
    assert shards * 0.97 <= d["after_load"] <= d["load_peak"], d
    assert (shards + extra) * 0.97 <= d["load_peak"] <= (shards + extra) * 1.5, d
    measured = max(d["load_peak"], d["gen_peak"])
    assert d["predicted_peak"] * 0.97 <= measured <= d["predicted_peak"] * 1.5, d


@pytest.mark.deepspeed
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tp_resident_weights_equal_what_autotp_leaves_on_a_rank(tmp_path, tied):
    """AutoTP splits the decoder layers' linears and the lm_head; the input embedding stays whole (the
    2×H200 bench measured exactly that gap before the model knew it). The MLP width 688 is not a multiple
    of 2 x 64, so the two ranks differ: the plan holds the fuller one."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(MODEL, tie_word_embeddings=tied, torch_dtype="float32")))
    out = tmp_path / "tp.json"
    proc = deepspeed_launch(ROOT / "tests" / "scripts" / "tp_resident.py", out, d, nprocs=2, timeout=400)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = json.loads(out.read_text())["numel"]
    assert counts[0] != counts[1]
    p = plan(d, batch=1, prompt_len=8, new_tokens=1, dtype="float32", gpus=2, gpu_memory="80GiB", detect=False)
    assert p.path("tp").breakdown["weights_resident"] == max(counts) * 4
