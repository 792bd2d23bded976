"""Is a machine profile still true of this host, now? ``plan`` asks before it uses one.

A profile's host-bound figures (the eager decoder layer, generate's per-token work, ZeRO-3's hooks: Python
launching kernels) move with the host: the same H200 kind measured 906 and 548 us per eager layer on two hosts
hours apart, and plan's plain tokens/s for a 7B moved from 114 to 165 with the profile alone. So, when plan
runs where a GPU is visible, it times an eager decoder layer again in a few seconds (``quick_eager_layer_s``:
calibrate's own stack of real-size layers, at batch 1, fewer rounds) and, when the host has drifted by more
than ``TOLERANCE``, scales the host-bound figures by the ratio (``rechecked``). Where it cannot measure (no GPU
here: a plan for another machine) it says how old the profile is and on which host it was taken.

The profile records where and when: ``calibrated_at`` and ``machine.host`` (a hash of the host name, which
the hardware fingerprint leaves out: two hosts of one kind share a fingerprint, not their speed).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import socket
import statistics
import time

# calibrate's own rounds agree within 10% on a quiet host; a drift beyond this is the host, not the noise
TOLERANCE = 0.15
# the figures that are host time (Python and the CUDA launch path), scaled together
HOST_BOUND = ("eager_layer_s", "eager_token_s", "eager_layer_s_b16", "eager_layer_s_b64", "eager_token_s_b16",
              "eager_token_s_b64", "zero3_module_s", "zero3_offload_module_s")
STALE_AFTER_S = 24 * 3600  # a profile not re-measured and older than this is called stale


def host_id() -> str:
    """This host, as a profile records it: a hash of its name (not the name itself)."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12]


def age_s(profile, now: float | None = None) -> float | None:
    """Seconds since the profile was calibrated (None: no parseable time)."""
    try:
        when = _dt.datetime.strptime(profile.calibrated_at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc)
    except (TypeError, ValueError):
        return None
    return max((now if now is not None else _now()) - when.timestamp(), 0.0)


def _now() -> float:
    return time.time()


def whose(profile) -> str:
    """"this host", "another host" (same hardware kind or not) or "unknown host" (a profile without it)."""
    recorded = (profile.machine or {}).get("host")
    if not recorded:
        return "unknown host"
    return "this host" if recorded == host_id() else "another host"


def quick_eager_layer_s(hbm_read: float | None = None, budget_s: float = 6.0) -> float | None:
    """Seconds of host time per eager decoder layer at batch 1, now, on this host's first GPU (None when torch
    or a GPU is missing): calibrate's measurement (``measure.eager_overheads``) with fewer rounds."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from transformers import LlamaForCausalLM

    from dsdoctor.calibrate import measure as m

    device = torch.device("cuda", 0)
    lo, hi = 2, 8
    models = {}
    for n in (lo, hi):
        with torch.device(device):
            models[n] = LlamaForCausalLM(m.stack_config(n)).to(torch.bfloat16).eval()
    weight_s = m._layer_weight_bytes(models[lo].config) / hbm_read if hbm_read else 0.0
    m._decode_step_seconds(models[hi], 1, device, new=8, reps=1)  # warm up
    start, samples = time.perf_counter(), []
    while len(samples) < 3 or (len(samples) < 7 and time.perf_counter() - start < budget_s):
        steps = {n: m._decode_step_seconds(models[n], 1, device, new=16, reps=1, warm=False) for n in (lo, hi)}
        samples.append(max((steps[hi] - steps[lo]) / (hi - lo) - weight_s, 0.0))
    del models
    torch.cuda.empty_cache()
    return statistics.median(samples[-3:])


def rechecked(profile, measure=None, now: float | None = None) -> tuple:
    """(the profile to plan with, what was found): the host-bound figures scaled to what ``measure()`` (default
    ``quick_eager_layer_s``; a test passes a fake) reads on this host now, when it drifted beyond ``TOLERANCE``.
    ``measure`` False: do not measure, only date the profile."""
    info = {"age_s": age_s(profile, now), "host": whose(profile), "then_s": profile.get("eager_layer_s"),
            "now_s": None, "ratio": None, "rescaled": False}
    then = info["then_s"]
    if measure is False or not then:
        return profile, info
    try:
        now_s = (measure or quick_eager_layer_s)(profile.get("hbm_weight_read"))
    except Exception as exc:  # a failed re-check must not fail the plan; it is reported
        info["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        return profile, info
    if not now_s:
        return profile, info
    ratio = now_s / then
    info.update(now_s=now_s, ratio=ratio)
    if abs(ratio - 1) <= TOLERANCE:
        return profile, info
    measured = dict(profile.measured)
    for name in HOST_BOUND:
        if name in measured:
            measured[name] = measured[name] * ratio
    info["rescaled"] = True
    return dataclasses.replace(profile, measured=measured), info
