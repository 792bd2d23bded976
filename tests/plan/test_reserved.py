"""plan's reserved-memory model: the caching-allocator replay (block rounding, splitting, merging, streams,
expandable segments) and what plan does with it (fits, DSD220)."""
from __future__ import annotations

import gzip
import json

import pytest

from dsdoctor.plan.allocator import LARGE_SEGMENT, SMALL_SEGMENT, Allocator, round_size, segment_size
from dsdoctor.plan.api import plan
from tests.helpers import DATA, EXAMPLES

MiB = 2**20


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(513) == 1024
    assert segment_size(100) == SMALL_SEGMENT  # <= 1 MiB: a 2 MiB small-pool segment
    assert segment_size(3 * MiB) == LARGE_SEGMENT  # < 10 MiB: 20 MiB segments, split between requests
    assert segment_size(11 * MiB + 1) == 12 * MiB  # larger: rounded to 2 MiB


def test_small_requests_share_a_segment_and_large_ones_split_one():
    a = Allocator()
    for t in range(4):
        a.malloc(t, 100 * 1024)
    assert a.reserved == SMALL_SEGMENT
    a.malloc(10, 3 * MiB)
    a.malloc(11, 3 * MiB)  # the 20 MiB segment's remainder serves the second request
    assert a.reserved == SMALL_SEGMENT + LARGE_SEGMENT


def test_freed_neighbours_merge_and_are_reused():
    a = Allocator()
    a.malloc(1, 40 * MiB)
    a.release(1)
    a.malloc(2, 16 * MiB)
    a.malloc(3, 16 * MiB)  # both carved out of the freed 40 MiB segment
    assert a.reserved == 40 * MiB
    a.release(2)
    a.release(3)
    a.malloc(4, 40 * MiB)  # the two halves merged back into one block
    assert a.reserved == 40 * MiB


def test_interleaved_lifetimes_fragment_and_expandable_segments_help():
    def churn(expandable):
        a = Allocator(expandable)
        cache, live_peak = None, 0
        for step in range(6):  # a big gather per step; the cache grows by torch.cat while the gather lives
            a.malloc(("big", step), 400 * MiB)
            a.malloc(("cache", step), 64 * MiB * (step + 1))
            live_peak = max(live_peak, 400 * MiB + 64 * MiB * (2 * step + 1))
            if cache is not None:
                a.release(cache)
            cache = ("cache", step)
            a.release(("big", step))
        return a, live_peak

    (plain, live), (expandable, _) = churn(False), churn(True)
    assert plain.peak_reserved > 1.3 * live  # the outgrown cache blocks cannot serve the next, larger one
    assert expandable.peak_reserved < plain.peak_reserved


def test_gathers_on_their_own_stream_do_not_share_blocks():
    a = Allocator()
    a.malloc(1, 100 * MiB, stream=1)
    a.release(1)
    a.malloc(2, 100 * MiB, stream=0)  # the freed block belongs to the other stream's pool
    assert a.reserved == 200 * MiB


def _plan(batch, alloc_conf=""):
    return plan(EXAMPLES / "llama-7b", batch=batch, prompt_len=1024, new_tokens=16, gpus=1, gpu_memory="141GB",
                host_memory="1TiB", detect=False, alloc_conf=alloc_conf)


def test_plan_reserved_and_the_expandable_segments_finding():
    res = _plan(2)
    plain, offload = res.path("plain"), res.path("zero3-offload")
    assert plain.gpu_reserved_bytes >= plain.gpu_peak_bytes
    assert plain.gpu_reserved_bytes < 1.15 * plain.gpu_peak_bytes  # plain loads: little churn
    assert offload.gpu_reserved_bytes > 1.15 * offload.gpu_peak_bytes  # ZeRO-3 gather/release churn
    exp = _plan(2, "expandable_segments:True").path("zero3-offload")
    assert exp.gpu_peak_bytes == offload.gpu_peak_bytes  # allocated is what it is
    assert exp.gpu_reserved_bytes < offload.gpu_reserved_bytes


def test_dsd220_names_expandable_segments_for_the_config_path(tmp_path):
    import json

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}}}))
    res = plan(EXAMPLES / "llama-7b", batch=2, prompt_len=1024, new_tokens=16, gpus=1, gpu_memory="141GB",
               host_memory="1TiB", detect=False, config=str(cfg), alloc_conf="")
    f = next(f for f in res.findings if f.code == "DSD220")
    assert f.values["path"] == "zero3-offload" and "expandable_segments:True" in f.fix()
    res = plan(EXAMPLES / "llama-7b", batch=2, prompt_len=1024, new_tokens=16, gpus=1, gpu_memory="141GB",
               host_memory="1TiB", detect=False, config=str(cfg), alloc_conf="expandable_segments:True")
    assert "DSD220" not in {f.code for f in res.findings}


def test_fits_is_decided_on_reserved_plus_context():
    res = _plan(2)
    p = res.path("zero3-offload")
    need = p.gpu_reserved_bytes + p.gpu_outside_allocator_bytes
    tight = plan(EXAMPLES / "llama-7b", batch=2, prompt_len=1024, new_tokens=16, gpus=1,
                 gpu_memory=str(need - 1), host_memory="1TiB", detect=False, alloc_conf="")
    assert tight.path("zero3-offload").fits is False and "gpu" in tight.path("zero3-offload").limits
    assert p.gpu_peak_bytes < need - 1  # the allocated peak alone would have said it fits


# --- against a recorded allocator history (tests/data/alloc_history: one H200, ZeRO-3 offload, 8B shape) ---

HISTORY = DATA / "alloc_history"
ARCH = DATA / "arch_configs"


def _recorded():
    with gzip.open(HISTORY / "llama-8b-zero3-offload-b4-p1024-n8.jsonl.gz", "rt") as fh:
        return [json.loads(line) for line in fh]


def test_the_allocator_model_reproduces_the_recorded_reserved_peak_from_the_recorded_events():
    events = _recorded()
    reserved = peak = 0
    for action, _addr, size, _stream in events:
        if action == "segment_alloc":
            reserved += size
            peak = max(peak, reserved)
    a, ids = Allocator(), {}
    for n, (action, addr, size, stream) in enumerate(events):
        if action == "alloc":
            ids[addr] = n
            a.malloc(n, size, 0 if stream == 0 else 1)
        elif action == "free_completed" and addr in ids:
            a.release(ids.pop(addr))
    assert abs(peak - 5.127 * 2**30) < 0.01 * 2**30
    assert a.peak_reserved == peak


def test_the_replayed_gather_sequence_is_the_recorded_one_and_so_is_the_reserved_peak(tmp_path, monkeypatch):
    """ZeRO-3's gather stream: every allocation and free of 1 MiB or more, in order, as plan replays it
    (the forwards it replays) equals what the H200 run recorded; plan's reserved peak is the recorded one."""
    from dsdoctor.plan import reserved as R

    model = tmp_path / "llama-8b"
    model.mkdir()
    (model / "config.json").write_text((HISTORY / "llama-8b-config.json").read_text())
    log = []
    original = R.simulate

    def spy(name, *args, **kw):
        if name != "zero3-offload" or kw.get("expandable") or (len(args) > 4 and args[4]):
            return original(name, *args, **kw)
        a = original(name, *args, **kw)
        log.append(a)
        return a

    sizes = {}
    malloc, release = R.Allocator.malloc, R.Allocator.release

    def rec_malloc(self, tid, nbytes, stream=0):
        sizes[(id(self), tid)] = (round_size(int(nbytes)), stream)
        self.__dict__.setdefault("_ops", []).append(("a", tid))
        return malloc(self, tid, nbytes, stream)

    def rec_release(self, tid):
        self.__dict__.setdefault("_ops", []).append(("f", tid))
        return release(self, tid)

    monkeypatch.setattr(R, "simulate", spy)
    monkeypatch.setattr(R.Allocator, "malloc", rec_malloc)
    monkeypatch.setattr(R.Allocator, "release", rec_release)
    R._CACHE.clear()
    res = plan(model, batch=4, prompt_len=1024, new_tokens=8, dtype="bf16", gpus=1, gpu_memory=141 * 10**9,
               host_memory=2**40, detect=False, gpu_name="H200")
    R._CACHE.clear()
    (sim,) = log
    replayed = []
    for op, tid in sim._ops:
        size, stream = sizes.get((id(sim), tid), (0, 0))
        if stream == 1 and size >= MiB:
            replayed.append((op, size // MiB))
    recorded = [("a" if action == "alloc" else "f", size // MiB) for action, _a, size, stream in _recorded()
                if stream != 0 and action in ("alloc", "free_requested") and size >= MiB]
    assert len(replayed) > 4000
    assert replayed == recorded[:len(replayed)]
    assert abs(res.path("zero3-offload").gpu_reserved_bytes - 5.127 * 2**30) < 0.02 * 5.127 * 2**30


def test_the_replay_cache_never_hands_one_models_result_to_another(monkeypatch):
    """Plans of several models in one process (bench re-estimates, ab, library users): each model's reserved
    bytes must be its own replay's. CPython reuses a freed object's address, so a cache keyed by ``id()``
    handed one model's replay to the next; here every shape is made to live at one address."""
    from dsdoctor.plan import api as plan_api
    from dsdoctor.plan import reserved as R

    def one(model):
        res = plan(ARCH / model, batch=2, prompt_len=64, new_tokens=4, gpus=2, gpu_memory="141GB",
                   host_memory="1TB", detect=False, gpu_name="H200")
        return {p.name: p.gpu_reserved_bytes for p in res.paths}

    models = ["qwen2-0.5b.json", "opt-350m.json", "pythia-1b.json"]
    alone = {}
    for m in models:
        R._CACHE.clear()
        alone[m] = one(m)
    assert len({tuple(v.items()) for v in alone.values()}) == len(models)
    reused = None
    build = plan_api.model_shape

    def at_one_address(spec, inv, *rest):
        nonlocal reused
        fresh = build(spec, inv, *rest)
        if reused is None:
            reused = fresh
        else:
            reused.__dict__.clear()
            reused.__dict__.update(fresh.__dict__)
        return reused

    monkeypatch.setattr(plan_api, "model_shape", at_one_address)
    R._CACHE.clear()
    for m in models + models:
        assert one(m) == alone[m], m


@pytest.mark.parametrize("model, batch, prompt, new, measured_gib", [
    # 2 x H200, ZeRO-3, bench/plan/runs/gpu-run3.tar.gz: reserved peak of rank 0 (allocated 13.8 GiB in the first)
    ("llama-8b", 8, 2048, 8, 21.67),
    ("llama-1b", 16, 4096, 8, 11.07),
    ("llama-8b", 1, 128, 16, 12.00),
])
def test_two_rank_zero3_reserved_follows_the_releases_the_compute_stream_holds(tmp_path, model, batch, prompt, new,
                                                                                 measured_gib):
    """On several ranks the host runs ahead of the compute stream while a long prefill computes, and every
    gathered parameter it releases waits (``record_stream``) for the GPU: 8 GiB more reserved than allocated
    in the first record. Plan's clocks reproduce the three records within 10% (without them: -29%)."""
    d = tmp_path / model
    d.mkdir()
    (d / "config.json").write_text((HISTORY / f"{model}-config.json").read_text())
    res = plan(d, batch=batch, prompt_len=prompt, new_tokens=new, dtype="bf16", gpus=2, gpu_memory=141 * 10**9,
               host_memory=2**40, detect=False, gpu_name="H200")
    got = res.path("zero3").gpu_reserved_bytes / 2**30
    assert abs(got - measured_gib) <= 0.10 * measured_gib, (got, measured_gib)
