"""The findings of a traced run: what the ranks' records and the way the command ended show (DSD101-DSD340 of
trace/rules.json; the loop's in ``loop_rules``, the experts' in ``moe_rules``)."""
from __future__ import annotations

import re

from dsdoctor.findings import Finding, Phrase, sort_findings
from dsdoctor.i18n import LANGS
from dsdoctor.trace import moe_rules
from dsdoctor.trace.ending import ending_text, progressing
from dsdoctor.trace.loop_rules import loop_findings
from dsdoctor.trace.records import RankRecord
from dsdoctor.trace.report import OOM_TEXT, RankSummary
from dsdoctor.units import human_bytes

MPI_MISSING = re.compile(r"No module named '?mpi4py'?")

def trace_findings(ranks: list[RankSummary], records: list[RankRecord], status: str, returncode, timeout,
                   log: str | None, output_tail: str, timed_out: bool = False) -> list[Finding]:
    unsynced = _unsynced(records)
    unpartitioned = _unpartitioned_finding(ranks, records)
    out = [Finding("DSD309", {})] if not records else []
    out += [f for f in (_optimizer_finding(ranks), _tp_finding(ranks, records), _unsynced_finding(records, unsynced),
                        _stage_finding(ranks, records), _shard_finding(records)) if f]
    out += loop_findings(ranks)
    out += [f for f in (_ignored_zero_at_init_inference(records), unpartitioned,
                        _peak_finding(ranks, records, unpartitioned_at_init=unpartitioned is not None)) if f]
    out += _pinned_findings(ranks) + _rank_findings(ranks, timeout, unsynced)
    out += moe_rules.different_experts(ranks, records) + moe_rules.gathers_per_layer(records)
    out += _ending_findings(ranks)
    out += _timeout_findings(ranks, status, timeout, timed_out)
    if status == "oom" and not any(f.code in ("DSD307", "DSD325") for f in out):
        out.append(Finding("DSD307", {"rank": "?", "phase": "an unobserved step",
                                      "error": _oom_line(output_tail)}))
    if status == "error" and not any(f.code == "DSD327" for f in out):
        out += _error_findings(ranks, records, returncode, log, output_tail)
    return sort_findings(out)


def _optimizer_finding(ranks: list[RankSummary]) -> Finding | None:
    """DSD101: an optimizer built at inference (a training loop needs its optimizer)."""
    built = [r for r in ranks if r.optimizer and not r.loop]
    if not built:
        return None
    r0 = built[0]
    name = r0.optimizer + (f" ({r0.base_optimizer})" if r0.base_optimizer else "")
    if r0.optimizer_state_bytes:
        cost = Phrase("measured", {"amount": human_bytes(r0.optimizer_state_bytes)})
    else:
        cost = Phrase("partitions")
    source = (r0.config_passed or {}).get("source")
    config = source if isinstance(source, str) and source.endswith((".json", ".hjson", ".yaml", ".yml")) \
        else "YOUR_DS_CONFIG.json"
    return Finding("DSD101", {"optimizer": name, "cost": cost, "config": config, "ranks": [r.rank for r in built]})


def _tp_finding(ranks: list[RankSummary], records: list[RankRecord]) -> Finding | None:
    """DSD103: ZeRO-3 with tensor parallelism, as observed."""
    tp = [r for r in ranks if r.zero_stage == 3 and (r.tp_size or 1) > 1]
    if not tp:
        return None
    rec = next(x for x in records if x.rank == tp[0].rank)
    api = next((p.info.get("api") for p in rec.phases if p.name == "init"), "deepspeed")
    return Finding("DSD103", {"stage": 3, "tp_size": tp[0].tp_size, "source": f"observed in {api}",
                              "version_note": Phrase("none")})


def _unsynced(records: list[RankRecord]) -> list[int]:
    """The ranks that generated from a partitioned ZeRO-3 model over several ranks without synced_gpus."""
    return sorted({rec.rank for rec in records for p in rec.phases
                   if p.name == "generate" and p.info.get("zero3_partitioned")
                   and (p.info.get("world_size") or 1) > 1 and p.info.get("synced_gpus") is False})


def _unsynced_finding(records: list[RankRecord], unsynced: list[int]) -> Finding | None:
    if not unsynced:
        return None
    world = next(p.info.get("world_size") for rec in records for p in rec.phases if p.name == "generate")
    return Finding("DSD301", {"ranks": ", ".join(map(str, unsynced)), "world_size": world})


def _stage_finding(ranks: list[RankSummary], records: list[RankRecord]) -> Finding | None:
    """DSD302: the first rank whose effective ZeRO stage is not the configured one."""
    for r in ranks:
        if r.zero_stage is None or r.configured_stage is None or _same_stage(r.configured_stage, r.zero_stage):
            continue
        rec = next(x for x in records if x.rank == r.rank)
        src = next((c.get("source") for c in rec.configs if c.get("api") == "deepspeed.initialize"), "dict")
        return Finding("DSD302", {"configured": _quote(r.configured_stage), "effective": r.zero_stage,
                                  "source": src or "dict"})
    return None


def _shard_finding(records: list[RankRecord]) -> Finding | None:
    """DSD303: the first rank that loaded checkpoint shards itself."""
    for rec in records:
        if rec.shard_loads:
            files = ", ".join(sorted({f.rsplit("/", 1)[-1] for f in rec.shard_loads}))
            return Finding("DSD303", {"rank": rec.rank, "files": files})
    return None


def _pinned_findings(ranks: list[RankSummary]) -> list[Finding]:
    """DSD305: a host whose ranks pinned more than half its memory."""
    hosts: dict[str, list[RankSummary]] = {}
    for r in ranks:
        hosts.setdefault(r.host or "?", []).append(r)
    out = []
    for host, rs in hosts.items():
        pinned = sum(r.pinned_host_bytes or 0 for r in rs)
        total = next((r.host_total_bytes for r in rs if r.host_total_bytes), None)
        if total and pinned > 0.5 * total:
            out.append(Finding("DSD305", {"host": host, "pinned": human_bytes(pinned), "total": human_bytes(total),
                                          "percent": round(100 * pinned / total)}))
    return out


def _rank_findings(ranks: list[RankSummary], timeout, unsynced: list[int]) -> list[Finding]:
    """DSD306 for each hung rank, DSD307 for each rank a CUDA OOM stopped (the OOM killer's are DSD325)."""
    out = []
    for r in ranks:
        if r.status == "hang":
            where = f" ({r.where})" if r.where else ""
            out.append(Finding("DSD306", {"rank": r.rank, "phase": _at(r.stopped_in), "timeout": _num(timeout),
                                          "where": where, "advice": _hang_advice(unsynced),
                                          "progress": _progress_phrase(r, hung=True)}))
        elif r.status == "oom" and (r.ending or {}).get("kind") not in ("oom-killer",):
            phase = next((p["label"] for p in r.phases if p.get("error")), "after the last phase")
            out.append(Finding("DSD307", {"rank": r.rank, "phase": phase,
                                          "error": clip((r.error or {}).get("message", ""), 160)}))
    return out


def _progress_phrase(r: RankSummary, hung: bool = False):
    """What the watchdog saw a still-running rank do over its window (a DSD306/DSD318 phrase), or ""."""
    p = r.progress or {}
    if p.get("cpu_s") is None and p.get("stack_still") is None:
        return ""
    values = {"cpu": "-" if p.get("cpu_s") is None else f"{p['cpu_s']:.2f}", "window": f"{p.get('window_s') or 0:.1f}"}
    working = progressing(p)
    if working:
        return Phrase("working", values)
    return Phrase("still", values) if working is False or hung else ""


def _ending_findings(ranks: list[RankSummary]) -> list[Finding]:
    """From how the ranks ended: a rank killed by a signal (DSD325: the kernel OOM killer or not, and the
    evidence either way), a CUDA OOM the allocator's own figures show to be fragmentation (DSD326), a
    collective that timed out (DSD327)."""
    import os

    out: list[Finding] = []
    for r in ranks:
        end = r.ending or {}
        kind = end.get("kind")
        if kind in ("oom-killer", "signal"):
            evidence = {lang: _evidence(end, lang) for lang in LANGS}
            out.append(Finding("DSD325", {
                "rank": r.rank, "how": {lang: ending_text(end, lang) for lang in LANGS},
                "evidence": evidence, "advice": Phrase("advice-oom" if kind == "oom-killer" else "advice-signal",
                                                       {"signal": end.get("signal") or "a signal"})}))
        elif kind == "cuda-oom" and (end.get("figures") or {}).get("fragmentation"):
            f = end["figures"]
            expandable = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower()
            out.append(Finding("DSD326", {
                "rank": r.rank, "phase": end.get("phase"), "tried": human_bytes(f["tried"]),
                "free": human_bytes(f["free"]), "unallocated": human_bytes(f["unallocated"]),
                "allocated": human_bytes(f["allocated"]),
                "advice": Phrase("already" if expandable else "expandable")}))
        elif kind == "collective-timeout":
            out.append(Finding("DSD327", {"rank": r.rank, "phase": end.get("phase"), "what": end.get("detail")}))
    return out


def _evidence(end: dict, lang: str) -> str:
    from dsdoctor.trace.ending import evidence_text

    return evidence_text(end, lang) or "-"


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, with "..." when cut."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 3]
    if " " in cut[limit // 2:]:
        cut = cut[: cut.rfind(" ")]
    return cut.rstrip(" ,;:") + "..."


def _at(stopped_in: str | None) -> str:
    stopped_in = stopped_in or "before any observed call"
    return stopped_in if stopped_in.startswith(("after", "before")) else f"in {stopped_in}"


def _timeout_findings(ranks: list[RankSummary], status: str, timeout, timed_out: bool) -> list[Finding]:
    """DSD318: stopped by the watchdog with no sign of ranks waiting on each other, where each rank was;
    DSD319: every rank had finished and only the command itself (a launcher, a helper) was still running."""
    if status == "timeout":
        parts = []
        for r in ranks:
            if r.status == "timeout":
                parts.append(Phrase("rank-at", {"rank": r.rank, "at": _at(r.stopped_in),
                                                "where": f" ({r.where})" if r.where else "",
                                                "progress": _progress_phrase(r)}))
            elif r.status == "ok":
                parts.append(Phrase("rank-done", {"rank": r.rank}))
            else:
                parts.append(Phrase("rank-other", {"rank": r.rank, "status": r.status}))
        where = Phrase.join("sep", parts) or Phrase("nobody")
        return [Finding("DSD318", {"timeout": _num(timeout), "where": where})]
    if timed_out and status == "ok" and ranks:
        return [Finding("DSD319", {"timeout": _num(timeout), "ranks": ", ".join(str(r.rank) for r in ranks)})]
    return []


def _error_findings(ranks, records, returncode, log, output_tail) -> list[Finding]:
    """Why the command failed: a launcher it needs (DSD321), the config doctor's own finding on the config
    DeepSpeed rejected (e.g. DSD114), or else the error itself (DSD308)."""
    err = next((r.error for r in ranks if r.error), None)
    text = " ".join(filter(None, [(err or {}).get("message"), output_tail]))
    if MPI_MISSING.search(text):
        return [Finding("DSD321", {"error": "No module named 'mpi4py'"})]
    rejected = _config_doctor_on_rejected(ranks, records)
    if rejected:
        return rejected
    detail = f": {err['type']}: {clip(err['message'], 200)}" if err else ""
    if not err:
        from dsdoctor.trace.ending import last_exception_line

        line = last_exception_line(output_tail)
        detail = f": {clip(line, 200)}" if line else ""
    return [Finding("DSD308", {"returncode": returncode, "detail": detail, "log": log or "the output above"})]


def _config_doctor_on_rejected(ranks, records) -> list[Finding]:
    """When deepspeed.initialize raised, the config doctor's findings on the config it was given that make
    DeepSpeed raise (empty when none explains the failure: then the error itself is reported)."""
    for r in ranks:
        # the config DeepSpeed parsed: at initialize, or at HfDeepSpeedConfig, whose zero.Init validates it
        # inside from_pretrained/from_config (a rejection then fails the load, not the init)
        if r.error is None or not isinstance(r.config_captured, dict) or \
                (r.config_passed or {}).get("api") not in ("deepspeed.initialize", "HfDeepSpeedConfig"):
            continue
        try:
            from dsdoctor.config.check import check

            found = check(r.config_captured, mode="inference").findings
        except Exception:  # the doctor cannot read it either: the error itself is the best we have
            return []
        return [f for f in found if f.code in REJECTING and f.effective_severity == "error"]
    return []


# the config doctor's findings that make DeepSpeed raise at initialize (a rejected key or value, an "auto" it
# cannot use, stage 1/2 without an optimizer); other errors (an optimizer at inference) do not explain a failure
REJECTING = ("DSD114", "DSD105", "DSD115")


def _same_stage(configured, effective) -> bool:
    if isinstance(configured, (int, float)) and not isinstance(configured, bool):
        return int(configured) == effective
    return str(configured).strip() == str(effective)


def _quote(v):
    return f'"{v}"' if isinstance(v, str) else v


def _num(v):
    return "-" if v is None else f"{v:g}"


def _oom_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        if OOM_TEXT.search(line):
            return line.strip()[:160]
    return "out of memory"


def _hang_advice(unsynced: list[int]) -> Phrase:
    return Phrase("synced" if unsynced else "collectives")


# phases with their own advice (DSD304's phrases); the last two only in a training loop
_PHASE_ADVICE = ("load", "init", "generate", "init-training", "training-step")


def _phase_advice(base: str, rec: RankRecord | None) -> Phrase:
    """What to do about a peak in phase ``base``, fitted to what this run did (a DSD304 phrase)."""
    configs = rec.configs if rec else []
    phases = rec.phases if rec else []
    zero3 = any(c.get("summary", {}).get("stage") == 3 for c in configs)
    if base == "load":
        return _load_advice(configs, phases, zero3)
    if base == "init":
        return _init_advice(phases)
    if base == "generate" and not zero3:
        return Phrase("generate-plain")
    return Phrase(base if base in _PHASE_ADVICE else "other")


def _load_advice(configs: list[dict], phases: list, zero3: bool) -> Phrase:
    first_load = next((p.t_start for p in phases if p.name == "load"), None)
    hf_first = any(c.get("api") == "HfDeepSpeedConfig" and c.get("is_zero3") and first_load is not None
                   and c.get("t", 0) <= first_load for c in configs)
    if hf_first:
        api = next((p.info.get("api") or "" for p in phases if p.name == "load"), "")
        return Phrase("load-partitioned", {"loader": "from_config" if api.endswith("_from_config")
                                           else "from_pretrained"})
    if any(p.name == "init" and p.info.get("api") == "deepspeed.init_inference" for p in phases):
        return Phrase("load-before-init-inference")
    return Phrase("load" if zero3 else "load-whole")


def _init_advice(phases: list) -> Phrase:
    init = next((p for p in phases if p.name == "init"), None)
    if init is not None and init.info.get("api") == "deepspeed.init_inference":
        return Phrase("init-inference")
    engine = (init.info.get("engine") if init else None) or {}
    if init is not None and not engine.get("optimizer") and not init.error:
        return Phrase("init-no-optimizer")
    return Phrase("init")


def _why_unpartitioned(rec: RankRecord) -> Phrase:
    """Why the model was not built under zero.Init, from the order of HfDeepSpeedConfig and the model's build."""
    loads = [p for p in rec.phases if p.name == "load"]
    hf = [c for c in rec.configs if c.get("api") == "HfDeepSpeedConfig"]
    if not hf:
        return Phrase("no-hf-config")
    api = (loads[0].info.get("api") or "from_pretrained") if loads else "from_pretrained"
    if loads and all((c.get("t") or 0) > loads[0].t_start for c in hf):
        return Phrase("created-after", {"api": api})
    if loads and not any(p.info.get("hf_zero3") for p in loads):
        return Phrase("not-alive", {"api": api})
    return Phrase("outside-zero-init")


def _ignored_zero_at_init_inference(records: list[RankRecord]) -> Finding | None:
    """DSD122 at run time: the script handed init_inference a config with a zero section, which it ignores."""
    from dsdoctor.config.checks_configs import init_inference_findings
    from dsdoctor.config.inference_config import read_inference_config

    for rec in records:
        for c in rec.configs:
            cfg = c.get("config")
            if c.get("api") == "deepspeed.init_inference" and isinstance(cfg, dict):  # a zero section, or args=
                found = [f for f in init_inference_findings(read_inference_config(cfg), None, None) if f.code == "DSD122"]
                if found:
                    found[0].values["rank"] = rec.rank
                    return found[0]
    return None


def _unpartitioned_finding(ranks: list[RankSummary], records: list[RankRecord]) -> Finding | None:
    for rec in records:
        init = next((p for p in rec.phases if p.name == "init" and p.info.get("api") == "deepspeed.initialize"
                     and p.info.get("model_at_initialize")), None)
        if init is None:
            continue
        state = init.info["model_at_initialize"]
        summary = next((r for r in ranks if r.rank == rec.rank), None)
        stage = summary.zero_stage if summary and summary.zero_stage is not None else (
            summary.configured_stage if summary else None)
        if str(stage) != "3" or not state.get("unpartitioned"):
            continue
        f = Finding("DSD340", {"rank": rec.rank, "unpartitioned": state["unpartitioned"], "params": state["params"],
                               "bytes": human_bytes(state.get("unpartitioned_bytes")), "why": _why_unpartitioned(rec),
                               "unpartitioned_bytes": state.get("unpartitioned_bytes")})
        if (init.error and init.error.get("oom")) or (summary and (summary.peak_phase or "").startswith("init")):
            f.severity = "error"
        return f
    return None


def _peak_base(phase: str, loop) -> str:
    """The phase a peak's advice is for: "before load#1" -> load; in a training loop, its init and its step."""
    raw = phase.split("#")[0]
    if loop and raw == "init":  # a training loop needs what initialize builds
        return "init-training"
    if loop and raw not in _PHASE_ADVICE:  # between generates a loop runs its training step
        return "training-step"
    return raw.split()[-1] if raw.split() else raw


def _peak_finding(ranks: list[RankSummary], records: list[RankRecord] | None = None,
                  unpartitioned_at_init: bool = False) -> Finding | None:
    gpu = any(r.peak_gpu_bytes is not None for r in ranks)
    key = "peak_host_bytes"
    if gpu:
        key = "peak_gpu_allocated_bytes" if any(r.peak_gpu_allocated_bytes for r in ranks) else "peak_gpu_bytes"
    cands = [r for r in ranks if getattr(r, key) is not None and r.peak_phase]
    if not cands:
        return None
    top = max(cands, key=lambda r: getattr(r, key))
    phase = top.peak_phase
    base = _peak_base(phase, top.loop)
    rec = next((x for x in records or [] if x.rank == top.rank), None)
    if base == "init" and unpartitioned_at_init:
        part = Phrase("init-unpartitioned")
    elif base in ("load", "init", "generate"):
        part = _phase_advice(base, rec)
    else:
        part = Phrase(base if base in _PHASE_ADVICE else "other")
    return Finding("DSD304", {"kind": Phrase("gpu" if gpu else "host"), "peak": human_bytes(getattr(top, key)),
                              "rank": top.rank, "phase": phase, "advice": Phrase("peak-is", {"part": part})})
