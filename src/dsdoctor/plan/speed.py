"""Expected generation speed per load path, from the machine's measured figures.

One ``generate`` of ``new_tokens`` = one prefill forward over the prompt + (new_tokens - 1) decode steps.
Every term is a count derived from the model and the path (bytes, FLOPs, modules, calls) times a figure of
the machine: measured by ``dsdoctor calibrate`` when a profile is at hand, else assumed (and then listed,
DSD205). No constant here is fitted to a benchmark case.

decode step = eager per-token work + layers x eager per-layer work (both measured at the batch, on a tiny
              model, so they are launch and Python cost)
            + max(weight bytes / HBM read rate, matmul FLOPs / matmul rate) + KV-cache bytes / HBM read rate
            + ZeRO-3: hooked modules x hook cost; gathers over the other ranks at the all-gather bus bandwidth
              plus its latency per gathered module; with offload, this rank's shard bytes / host-to-device
              (pinned or pageable, as configured)
            + tp: 2 all-reduces per layer at the measured AutoTP all-reduce latency
prefill     = the same overheads once + linear FLOPs (logits of the last position only) / matmul rate,
              bounded below by the weight read + causal attention FLOPs / SDPA rate + the elementwise
              traffic of the layer (norms, rotary, residuals, the gated MLP) / HBM rate.
The terms add: eager PyTorch waits for the host between launches often enough (generate synchronizes every
step) that host and device time do not overlap much; bench/speed measures how true that is.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dsdoctor.model.moe import experts_touched

# Assumed figures, used only where no profile gives a measured one (and then named in DSD205). They are
# the previous release's generic values: datasheet bandwidths x efficiency, and the 2 x H200 host's latencies.
ASSUMED = {
    "eager_layer_s": 0.5e-3,
    "eager_token_s": 3e-3,
    "zero3_module_s": 0.38e-3,
    "zero3_offload_module_s": 0.38e-3,
    "autotp_allreduce_s": 0.4e-3,
    "allgather_latency_s": 50e-6,
    "h2d_latency_s": 10e-6,
    "pageable_factor": 0.35,  # pageable / pinned host-to-device
}
# The first generate of a process pays once for every KV-cache length it creates (per-shape setup of the
# attention kernels and new caching-allocator blocks for the growing cache), cached for every later generate
# of those lengths. Measured on H200s: 1.1 s + 33 ms per new token over 31 cold first generates (7B-class and
# smaller, batch 1-64, bench/speed runs 1-5), 48 ms per new token for a full generate after a short warm-up
# (7B, batch 4: 55 then ~160 tokens/s, shared/FACTS.md); expandable_segments did not change it (3 H200 pairs,
# runs 1-2). A figure of the host and its driver, not of the model: calibrate does not measure it yet.
NEW_LENGTH_S = 0.04
HBM_EFFICIENCY = 0.8
LINK_EFFICIENCY = 0.7
PREFILL_MFU = 0.6
UNPINNED_FACTOR = ASSUMED["pageable_factor"]


@dataclass
class Figures:
    """The machine figures one estimate uses, and which of them were assumed."""
    hbm_read: float
    matmul_flops: float
    attention_flops: float
    h2d_pinned: float
    h2d_pageable: float
    allgather_bus_bw: float
    nvme_read: float
    values: dict = field(default_factory=dict)
    assumed: list = field(default_factory=list)

    def get(self, name: str) -> float:
        return self.values[name]


def figures_for(hw, profile=None) -> Figures:
    """Measured figures from ``profile`` where it has them, the hardware table's (x efficiency) otherwise."""
    prof = profile.measured if profile is not None else {}
    assumed: list = []

    def pick(name, fallback, label=None):
        if name in prof:
            return prof[name]
        assumed.append(label or name)
        return fallback

    multi = hw.gpus > 1
    collective = ("autotp_allreduce_s", "allgather_latency_s")
    values = {k: (pick(k, v) if multi or k not in collective else prof.get(k, v))
              for k, v in ASSUMED.items() if k != "pageable_factor"}
    values["new_length_s"] = prof.get("new_length_s", NEW_LENGTH_S)  # never listed as assumed (DSD205)
    for kind in ("layer", "token"):  # the batch dependence: measured at 16 and 64 when profiled
        for b in (16, 64):
            key = f"eager_{kind}_s_b{b}"
            values[key] = prof.get(key, values[f"eager_{kind}_s"])
    hbm = pick("hbm_weight_read", hw.hbm_bandwidth * HBM_EFFICIENCY)
    mm = pick("matmul_flops", hw.flops * PREFILL_MFU)
    att = pick("attention_flops", hw.flops * PREFILL_MFU * 0.7)
    pinned = prof.get("h2d_pinned") or hw.h2d_bandwidth * LINK_EFFICIENCY
    if "h2d_pinned" not in prof and hw.h2d_assumed:  # neither measured nor given (--h2d-bandwidth)
        assumed.append("h2d_pinned")
    pageable = pick("h2d_pageable", pinned * ASSUMED["pageable_factor"])
    ag = pick("allgather_bus_bw", hw.gpu_gpu_bandwidth * LINK_EFFICIENCY) if hw.gpus > 1 else hw.gpu_gpu_bandwidth
    nvme = pick("nvme_read", hw.nvme_bandwidth, "nvme_read") if profile is not None else hw.nvme_bandwidth
    return Figures(hbm, mm, att, pinned, pageable, ag, nvme, values, assumed)


@dataclass
class Speed:
    decode_step_s: float
    prefill_s: float
    tokens_per_s: float  # per rank: new tokens of its batch per second, prefill included
    decode_tokens_per_s: float
    bound: str  # hbm | gather | host-to-device | nvme | overhead | compute
    terms: dict = field(default_factory=dict)  # decode-step seconds by term

    def to_dict(self) -> dict:
        return asdict(self)


def _by_batch(v: dict, kind: str, batch: int) -> float:
    """The eager figure at ``batch``: linear in log2(batch) between the measured batches 1, 16, 64."""
    import math

    pts = [(1, v[f"eager_{kind}_s"]), (16, v[f"eager_{kind}_s_b16"]), (64, v[f"eager_{kind}_s_b64"])]
    if batch >= 64:
        return pts[-1][1]
    for (b0, y0), (b1, y1) in zip(pts, pts[1:]):
        if batch <= b1:
            w = (math.log2(batch) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return y0 + w * (y1 - y0)
    return pts[-1][1]


def hooked_modules(shape) -> int:
    """Modules whose forward ZeRO-3 hooks (fetch before, release after): those owning parameters plus the
    containers that run a forward: per layer the layer, attention, MLP and activation; the root, the
    decoder and the rotary embedding."""
    return len(shape.inventory.modules()) + shape.layers * 4 + 3


def _linear_params(shape) -> tuple[int, int, int]:
    """(decoder linear elements but the routed experts', lm_head elements, embedding elements)."""
    inv = shape.inventory
    lin = sum(p.numel for p in inv.params if p.kind == "linear" and p.layer is not None and not p.expert)
    emb = sum(p.numel for p in inv.params if p.kind == "embedding")
    head = sum(p.numel for p in inv.params if p.kind == "lm_head")
    if not head and inv.tied:
        head = emb
    return lin, head, emb


def expert_elems(shape, tokens: int) -> tuple[int, float, float]:
    """A MoE's routed expert elements: (all, those ``tokens`` tokens read, those one token multiplies by).
    Plain decode reads only the experts its tokens chose; ZeRO-3 gathers all of them (``StepTerms.moved``)."""
    moe = shape.inventory.moe
    if moe is None or not moe.num_experts:
        return 0, 0.0, 0.0
    routed = sum(p.numel for p in shape.inventory.params if p.expert)
    return routed, routed * experts_touched(moe, tokens) / moe.num_experts, routed * moe.top_k / moe.num_experts


def _elementwise_bytes_per_token(shape, b: int, tp: int) -> float:
    """Bytes the non-matmul ops of one decoder layer move per token (reads + writes), from the Llama layer's
    code: two RMSNorms in float32 (cast, square, mean, scale, cast back, weight: ~12 passes of 2-4 bytes),
    rotary on q and k (4 tensors each), two residual adds, act(gate) * up."""
    h = shape.hidden
    q = shape.q_dim / tp
    k = shape.kv_elems_per_token[0] / 2 / tp
    i = shape.intermediate / tp
    norms = 2 * (h * (b + 4 + 4 + 4 + 4 + b) + h * 2 * b)
    rotary = (q + k) * b * 5
    residual = 2 * 3 * h * b
    mlp = 5 * i * b if shape.gated_mlp else 2 * i * b
    return norms + rotary + residual + mlp


@dataclass(frozen=True)
class StepTerms:
    """What a path's decode step pays beyond the eager work, the weight read and the KV cache: declared by
    the path (``paths/``) from its memory estimate."""
    tp: int = 1  # AutoTP degree: linears and the KV cache split; 2 all-reduces per layer when > 1
    hooks: str | None = None  # the figure of ZeRO-3's per-module hook cost (zero3_module_s / zero3_offload_module_s)
    ranks: int = 1  # ranks the gathered bytes come from (an all-gather when > 1)
    moved: int = 0  # bytes a step brings in (gather or host copy), per rank: PathMemory.gathered_bytes_per_step
    h2d: str | None = None  # this rank's share copied from the host each step: "pinned" or "pageable"
    nvme: bool = False  # this rank's share read from NVMe each step


def _decode_streams(terms: StepTerms, shape, f: Figures) -> dict:
    """The seconds per decode step of what a ZeRO-3 step brings in: gathers, host copies, NVMe reads."""
    v, streams = f.values, {}
    if terms.hooks is None:
        return streams
    if terms.ranks > 1:
        gathered_modules = len(shape.inventory.modules())
        streams["gather"] = terms.moved * (terms.ranks - 1) / terms.ranks / f.allgather_bus_bw \
            + gathered_modules * v["allgather_latency_s"]
    if terms.h2d is not None:
        streams["host-to-device"] = terms.moved / terms.ranks / (f.h2d_pinned if terms.h2d == "pinned"
                                                                 else f.h2d_pageable)
    if terms.nvme:
        streams["nvme"] = terms.moved / terms.ranks / f.nvme_read
    return streams


def _decode_terms(shape, wl, terms: StepTerms, f: Figures) -> tuple[dict, dict]:
    """(every term of a decode step, the streams among them) in seconds."""
    v, b, tp = f.values, wl.dtype_bytes, terms.tp
    B, S, T = wl.batch, wl.prompt_len, wl.new_tokens
    lin, head, emb = _linear_params(shape)
    routed, touched, per_token = expert_elems(shape, B)
    other = shape.inventory.num_params - lin - head - routed - (emb if head != emb or not shape.inventory.tied else 0)
    per_rank_lin = lin / tp
    read = (per_rank_lin + head / tp + max(other, 0) + touched) * b  # the embedding is looked up, not read whole
    avg_ctx = S + T / 2
    kv_read = 0.0
    for elems, window in zip(shape.kv_elems_per_token, shape.kv_window):
        kept = min(avg_ctx, window) if window else avg_ctx
        kv_read += B * kept * elems * b / tp
    overhead = _by_batch(v, "token", B) + shape.layers * _by_batch(v, "layer", B)
    terms_s = {"eager": overhead}
    terms_s["weights"] = max(read / f.hbm_read, 2 * (per_rank_lin + head / tp + per_token) * B / f.matmul_flops)
    terms_s["kv_cache"] = kv_read / f.hbm_read
    if tp > 1:
        terms_s["allreduce"] = shape.layers * 2 * v["autotp_allreduce_s"]
    if terms.hooks is not None:
        terms_s["zero3_hooks"] = hooked_modules(shape) * v[terms.hooks]
    streams = _decode_streams(terms, shape, f)
    terms_s.update(streams)
    return terms_s, streams


def _prefill_s(shape, wl, tp: int, f: Figures) -> float:
    """One forward over batch x prompt tokens, logits for the last position only, without the overheads."""
    b, B, S = wl.dtype_bytes, wl.batch, wl.prompt_len
    lin, head, _emb = _linear_params(shape)
    per_rank_lin = lin / tp
    M = B * S
    _routed, touched, per_token = expert_elems(shape, M)
    mm = 2 * (per_rank_lin + per_token) * M / f.matmul_flops
    mm = max(mm, (per_rank_lin + touched) * b / f.hbm_read) + max(2 * head / tp * B / f.matmul_flops, head / tp * b / f.hbm_read)
    att = 0.0
    for window in shape.kv_window:
        ctx = min(S, window) if window else S
        att += 4 * B * S * ctx * shape.q_dim / tp / (2 if ctx == S else 1) / f.attention_flops
    elementwise = shape.layers * M * _elementwise_bytes_per_token(shape, b, tp) / f.hbm_read
    return mm + att + elementwise


def first_generate_extra_s(wl, figures: Figures) -> float:
    """How much longer the first generate of a process takes than a repeated one of the same size: one setup
    per KV-cache length it creates (the prompt's, then one per new token)."""
    return wl.new_tokens * figures.values.get("new_length_s", NEW_LENGTH_S)


def first_generate_tokens_per_s(tokens_per_s: float, wl, figures: Figures) -> float:
    """tokens/s of the first generate (steady-state ``tokens_per_s`` plus the first call's extra time)."""
    if not tokens_per_s:
        return 0.0
    steady = wl.batch * wl.new_tokens / tokens_per_s
    return wl.batch * wl.new_tokens / (steady + first_generate_extra_s(wl, figures))


def estimate_speed(shape, wl, figures: Figures, terms: StepTerms | None = None) -> Speed:
    """One generate on a path whose step pays ``terms`` (default: whole weights, nothing brought in), on a
    machine of ``figures``."""
    terms = terms or StepTerms()
    step_terms, streams = _decode_terms(shape, wl, terms, figures)
    step = sum(step_terms.values())
    weights, kv = step_terms["weights"], step_terms["kv_cache"]
    bound = max(("hbm", weights + kv), ("overhead", step - weights - kv - sum(streams.values())), *streams.items(),
                key=lambda item: item[1])[0]
    prefill = (_prefill_s(shape, wl, terms.tp, figures) + step_terms["eager"] + step_terms.get("allreduce", 0.0)
               + step_terms.get("zero3_hooks", 0.0) + sum(streams.values()))
    B, T = wl.batch, wl.new_tokens
    total = prefill + max(T - 1, 0) * step
    return Speed(step, prefill, B * T / total, B / step, bound, {k: round(x, 6) for k, x in step_terms.items()})
