"""What trace and ab say about generation inside training (DSD330-DSD332), and advice that follows what ab
measured.

* DSD330: a rank generates under ZeRO-3 inside training and every generate gathers layer by layer; its advice
  is to gather once per generate, unless ab measured that variant slower or no faster on this very run
  (``follow_measurement``), when it says so and points elsewhere (ZeRO-2, a vLLM engine).
* DSD331: the rank already generates on the gathered model.
* DSD332 (ab): as-is against gather-once, rollout speed and generate peak side by side; the advice is the
  measured winner: wrap the rollout only when gathering once was clearly faster (by more than ab's 10% noise),
  keep the run as it is otherwise.

The loop summaries come from ``trace/loop.py``. Torch-free.
"""
from __future__ import annotations

from dsdoctor.findings import Finding, Phrase
from dsdoctor.units import human_bytes

NOISE = 0.10  # differences under 10% are noise, as everywhere in ab


def loop_findings(summaries: list) -> list[Finding]:
    """DSD330 (ZeRO-3 gathers every layer for every token inside the training step) or DSD331 (already
    gathered once per generate)."""
    from dsdoctor.trace.loop import kv_bytes

    looped = [r for r in summaries if r.loop]
    if not looped:
        return []
    r0 = looped[0]
    lp = r0.loop
    ranks = ", ".join(str(r.rank) for r in looped)
    share = f"{100 * lp['share']:.0f}%" if lp.get("share") is not None else "?"
    rate = f"{lp['tokens_per_s']:.1f}" if lp.get("tokens_per_s") else "?"
    common = {"ranks": ranks, "generates": lp["generates"], "generate_s": f"{lp['generate_s']:.2f}",
              "loop_s": f"{lp['loop_s']:.2f}", "share": share, "tokens_per_s": rate, "steps": lp["steps"]}
    rows = lp["per_generate"]
    if not lp.get("zero3"):
        return []
    if all(row["gather_once"] == "applied" or row["already_gathered"] for row in rows):
        return [Finding("DSD331", common)]
    world = lp.get("world_size") or 1
    full = lp.get("param_bytes") or 0
    shard = full // world if world else full
    gathered = [row["gathered_bytes"] for row in rows if row["gathered_bytes"] is not None]
    forwards = [row["forwards"] for row in rows if row["forwards"] is not None]
    kv = kv_bytes(lp)
    costs = {"full": human_bytes(full), "shard": human_bytes(shard), "world": world,
             "extra": human_bytes(max(full - shard, 0)), "kv": human_bytes(kv) if kv else "?"}
    values = dict(common, gathered=human_bytes(max(gathered)) if gathered else "?",
                  forwards=max(forwards) if forwards else "?",
                  per_forward=human_bytes(lp.get("gather_bytes_per_forward")), advice=Phrase("gather", costs),
                  **costs)
    return [Finding("DSD330", values)]


def gather_once_verdict(variants) -> tuple[str, object, object] | None:
    """("faster" | "slower" | "even", as-is, gather-once) when both ran to the end with a rate, else None."""
    by = {v.name: v for v in variants}
    base, once = by.get("as-is"), by.get("gather-once")
    if not base or not once or base.status != "ok" or once.status != "ok":
        return None
    if not base.tokens_per_s or not once.tokens_per_s:
        return None
    if once.tokens_per_s > base.tokens_per_s * (1 + NOISE):
        return "faster", base, once
    if once.tokens_per_s < base.tokens_per_s * (1 - NOISE):
        return "slower", base, once
    return "even", base, once


def gather_once_diagnosis(variants, gpu: bool) -> list[Finding]:
    """DSD332 when both as-is and gather-once ran: rollout speed and generate peak side by side, and the advice
    of the measured winner."""
    found = gather_once_verdict(variants)
    if found is None:
        return []
    verdict, base, once = found

    def peak(v):
        if gpu:
            return v.generate_peak_gpu_bytes or v.peak_gpu_bytes
        return v.generate_peak_host_bytes or v.peak_host_bytes

    rates = {"after": f"{once.tokens_per_s:.1f}", "before": f"{base.tokens_per_s:.1f}"}
    advice = {"faster": Phrase("advice-wrap"), "slower": Phrase("advice-keep", rates),
              "even": Phrase("advice-even", rates)}[verdict]
    # a warning only when gathering once is clearly faster: then the run as-is leaves speed on the table
    severity = None if verdict == "faster" else "info"
    return [Finding("DSD332", severity=severity, values={
        "after": rates["after"], "before": rates["before"],
        "speedup": f"{once.tokens_per_s / base.tokens_per_s:.2f}", "kind": Phrase("gpu" if gpu else "host"),
        "peak_after": human_bytes(peak(once)), "peak_before": human_bytes(peak(base)), "advice": advice,
        "verdict": verdict})]


def follow_measurement(diagnosis: list[Finding], as_is: list[Finding]) -> list[Finding]:
    """The as-is run's findings with DSD330's advice replaced by what ab measured: when gather-once ran slower
    or no faster, the trace's own advice (gather once) would contradict the measurement."""
    measured = next((f for f in diagnosis if f.code == "DSD332"), None)
    if measured is None or measured.values.get("verdict") == "faster":
        return as_is
    rates = {"after": measured.values["after"], "before": measured.values["before"]}
    key = "measured-slower" if measured.values.get("verdict") == "slower" else "measured-even"
    out = []
    for f in as_is:
        if f.code == "DSD330":
            f = Finding("DSD330", dict(f.values, advice=Phrase(key, rates)), f.severity)
        out.append(f)
    return out
