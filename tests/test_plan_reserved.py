"""plan's reserved-memory model: the caching-allocator replay (block rounding, splitting, merging, streams,
expandable segments) and what plan does with it (fits, DSD220)."""
from __future__ import annotations

from dsdoctor.plan.api import plan
from dsdoctor.plan.reserved import LARGE_SEGMENT, SMALL_SEGMENT, Allocator, round_size, segment_size
from tests.helpers import EXAMPLES

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
