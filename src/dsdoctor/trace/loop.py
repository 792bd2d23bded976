"""Generation inside training (RLHF/GRPO rollouts, evaluation with generate), read from the rank records.

A rank is in such a loop when DeepSpeed built an optimizer, the engine ran ``backward``/``step`` and the
model generated. Then the optimizer is what training needs, not a leftover (no DSD101); what matters is
what each generate costs inside the step: its time, tokens/s, the parameter bytes ZeRO-3 gathered for it
(partitioned, non-persistent parameter bytes x forwards, or one whole gather with ``gather-once``), and its
share of the iteration (from its start to the next generate's start, or to the last train event).
Torch-free.
"""
from __future__ import annotations

from dsdoctor.i18n import message_table
from dsdoctor.trace.records import RankRecord
from dsdoctor.units import human_bytes, human_seconds


def per_generate(rec: RankRecord) -> list[dict]:
    gens = [p for p in rec.phases if p.name == "generate"]
    train_ts = [e["t"] for e in rec.train if e.get("t") is not None]
    out = []
    for i, p in enumerate(gens):
        if p.t_end is None:
            continue
        nxt = gens[i + 1].t_start if i + 1 < len(gens) else max((t for t in train_ts if t > p.t_end), default=None)
        window = (nxt - p.t_start) if nxt is not None else None
        forwards = p.info.get("forwards")
        per_forward = p.info.get("gather_bytes_per_forward")
        applied = p.info.get("gather_once") == "applied"
        if applied or p.info.get("already_gathered"):
            gathered = p.info.get("param_bytes") if applied else 0
        elif per_forward is not None and forwards is not None:
            gathered = per_forward * forwards
        else:
            gathered = None
        trained = sum(1 for t in train_ts if p.t_end <= t <= (nxt if nxt is not None else float("inf")))
        out.append({
            "label": p.label, "duration_s": p.duration_s, "tokens_per_s": p.tokens_per_s,
            "new_tokens": p.new_tokens, "forwards": forwards, "gathered_bytes": gathered,
            "iteration_s": window, "share": (p.duration_s / window) if window and p.duration_s else None,
            "train_events_after": trained, "gather_once": p.info.get("gather_once"),
            "already_gathered": bool(p.info.get("already_gathered")),
            "peak_host_bytes": p.peak_host_rss, "peak_gpu_allocated_bytes": p.peak_gpu_allocated,
        })
    return out


def summarize(rec: RankRecord, engine: dict | None) -> dict | None:
    """The rank's loop summary, or None when the rank does not train between generates."""
    engine = engine or {}
    gens = [p for p in rec.phases if p.name == "generate"]
    # RLHF builds several engines (actor, critic, reference, reward); the loop trains if any has an optimizer
    engines = [p.info.get("engine") or {} for p in rec.phases if p.name == "init"] + [engine]
    if not any(e.get("optimizer") for e in engines) or not rec.train or not gens:
        return None
    steps = sum(1 for e in rec.train if e.get("kind") == "step")
    backwards = sum(1 for e in rec.train if e.get("kind") == "backward")
    rows = per_generate(rec)
    gen_s = sum(r["duration_s"] or 0 for r in rows)
    loop_s = sum(r["iteration_s"] or 0 for r in rows if r["iteration_s"])
    tokens = sum(r["new_tokens"] or 0 for r in rows)
    first = gens[0].info
    return {
        "generates": len(rows), "backwards": backwards, "steps": steps, "generate_s": gen_s, "loop_s": loop_s,
        "share": gen_s / loop_s if loop_s else None, "tokens_per_s": tokens / gen_s if gen_s else None,
        "zero3": bool(first.get("zero3_partitioned")), "param_bytes": first.get("param_bytes"),
        "gather_bytes_per_forward": first.get("gather_bytes_per_forward"),
        "world_size": first.get("world_size") or rec.world_size, "model_shape": first.get("model_shape") or {},
        "batch": first.get("batch"), "prompt_len": first.get("prompt_len"),
        "element_size": first.get("param_element_size"),
        "per_generate": rows,
    }


def kv_bytes(loop: dict) -> int | None:
    """The KV cache of one generate: 2 x layers x kv heads x head dim x batch x positions x element size."""
    shape = loop.get("model_shape") or {}
    rows = loop.get("per_generate") or []
    try:
        positions = loop["prompt_len"] + max((r["new_tokens"] or 0) for r in rows) // max(loop["batch"], 1)
        return 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * loop["batch"] * positions * \
            (loop.get("element_size") or 2)
    except (KeyError, TypeError, ValueError):
        return None


# ------------------------------------------------------------------ rendering

HEAD = message_table("trace.loop.TEXT")["head"]  # in dsdoctor/messages.json


def rows(ranks) -> list[tuple]:
    out = []
    for r in ranks:
        for g in (r.loop or {}).get("per_generate", []):
            out.append((r.rank, g["label"] + (" (gather-once)" if g["gather_once"] == "applied" else ""),
                        human_seconds(g["duration_s"]),
                        "-" if g["tokens_per_s"] is None else f"{g['tokens_per_s']:.1f}",
                        "-" if g["forwards"] is None else g["forwards"], human_bytes(g["gathered_bytes"]),
                        human_seconds(g["iteration_s"]), "-" if g["share"] is None else f"{100 * g['share']:.0f}%"))
    return out
