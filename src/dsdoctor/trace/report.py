"""Rank records + how the command ended -> ``TraceResult`` (per-rank summary, phases, findings).

On a machine without CUDA the GPU figures are None and host RSS stands in for the memory that matters.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from dsdoctor.findings import Finding, Phrase, sort_findings
from dsdoctor.i18n import pick
from dsdoctor.report.render import Style, findings_markdown, findings_text, markdown_table, text_table
from dsdoctor.trace import loop as gen_loop
from dsdoctor.trace import rules_init  # noqa: F401  (registers DSD340)
from dsdoctor.trace.records import PhaseRecord, RankRecord
from dsdoctor.units import human_bytes

OOM_TEXT = re.compile(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED", re.IGNORECASE)
STATUSES = ("ok", "oom", "hang", "error")

_T = {
    "rank": {"en": "rank", "zh": "rank"}, "stage": {"en": "stage", "zh": "stage"},
    "optimizer": {"en": "optimizer", "zh": "优化器"}, "offload": {"en": "offload param/opt", "zh": "卸载 参数/优化器"},
    "dtype": {"en": "dtype", "zh": "精度"}, "tp": {"en": "tp", "zh": "tp"}, "synced": {"en": "synced_gpus", "zh": "synced_gpus"},
    "gpu": {"en": "peak GPU", "zh": "GPU 峰值"}, "host": {"en": "peak host", "zh": "主机峰值"},
    "peak_in": {"en": "peak in", "zh": "峰值阶段"}, "tps": {"en": "tokens/s", "zh": "tokens/s"},
    "status": {"en": "status", "zh": "状态"}, "phase": {"en": "phase", "zh": "阶段"}, "time": {"en": "time", "zh": "耗时"},
    "pinned": {"en": "pinned", "zh": "锁页"}, "phases": {"en": "Phases", "zh": "阶段"}, "ranks": {"en": "Ranks", "zh": "各 rank"},
    "findings": {"en": "Findings", "zh": "发现"}, "files": {"en": "files", "zh": "文件"},
}


def _t(key, lang):
    return pick(_T[key], lang)


@dataclass
class RankSummary:
    rank: int
    host: str | None
    pid: int | None
    status: str  # ok, oom, hang, error, killed
    t0: float | None = None  # wall-clock time of the rank's first observed call; timeline times count from it
    zero_stage: int | None = None
    configured_stage: object = None
    optimizer: str | None = None
    base_optimizer: str | None = None
    optimizer_state_bytes: int | None = None
    offload_param: str | None = None
    offload_optimizer: str | None = None
    dtype: str | None = None
    tp_size: int | None = None
    world_size: int | None = None
    synced_gpus: bool | None = None
    peak_gpu_bytes: int | None = None  # reserved by the caching allocator: what an OOM is measured against
    peak_gpu_allocated_bytes: int | None = None
    peak_host_bytes: int | None = None
    pinned_host_bytes: int | None = None
    host_total_bytes: int | None = None
    peak_phase: str | None = None
    tokens_per_s: float | None = None
    stopped_in: str | None = None
    where: str | None = None
    error: dict | None = None
    config_passed: dict | None = None  # what the script handed to DeepSpeed (api, source, stage, offloads, ...)
    effective: dict | None = None  # what DeepSpeed built, read from the engine
    phases: list[dict] = field(default_factory=list)
    timeline: list[list] = field(default_factory=list)  # [seconds since start, host rss, gpu allocated, gpu reserved]
    stack: str | None = None
    timeline_png: str | None = None
    loop: dict | None = None  # generation inside training (trace/loop.py): per-generate cost; None otherwise

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TraceResult:
    command: list[str]
    status: str
    returncode: int | None
    wall_s: float
    timeout: float | None
    ranks: list[RankSummary]
    findings: list[Finding]
    variant: str | None = None
    out_dir: str | None = None
    log: str | None = None
    output_tail: str = ""

    @property
    def peak_gpu_bytes(self):
        return _max(r.peak_gpu_bytes for r in self.ranks)

    @property
    def peak_host_bytes(self):
        return _max(r.peak_host_bytes for r in self.ranks)

    @property
    def tokens_per_s(self):
        """Tokens per second of rank 0 (each rank's own output; under data parallel ranks add up)."""
        return self.ranks[0].tokens_per_s if self.ranks else None

    def to_dict(self, lang: str = "en") -> dict:
        return {
            "command": self.command, "variant": self.variant, "status": self.status, "returncode": self.returncode,
            "wall_s": round(self.wall_s, 3), "timeout_s": self.timeout, "peak_gpu_bytes": self.peak_gpu_bytes,
            "peak_host_bytes": self.peak_host_bytes, "tokens_per_s": self.tokens_per_s,
            "ranks": [r.to_dict() for r in self.ranks],
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)],
            "out_dir": self.out_dir, "log": self.log,
        }

    def _rank_rows(self):
        for r in self.ranks:
            off = f"{r.offload_param or '-'}/{r.offload_optimizer or '-'}"
            yield (r.rank, _fmt(r.zero_stage), r.optimizer or "-", off, r.dtype or "-", _fmt(r.tp_size),
                   _fmt(r.synced_gpus), human_bytes(r.peak_gpu_bytes), human_bytes(r.peak_host_bytes),
                   r.peak_phase or "-", _rate(r.tokens_per_s), r.status)

    def _phase_rows(self):
        for r in self.ranks:
            for p in r.phases:
                yield (r.rank, p["label"], _secs(p["duration_s"]), human_bytes(p["peak_gpu_bytes"]),
                       human_bytes(p["peak_host_bytes"]), human_bytes(p["pinned_host_bytes"]), _rate(p["tokens_per_s"]),
                       "error: " + p["error"]["type"] if p.get("error") else ("unfinished" if p["unfinished"] else "ok"))

    def _heads(self, lang):
        ranks = [_t(k, lang) for k in ("rank", "stage", "optimizer", "offload", "dtype", "tp", "synced", "gpu", "host",
                                       "peak_in", "tps", "status")]
        phases = [_t(k, lang) for k in ("rank", "phase", "time", "gpu", "host", "pinned", "tps", "status")]
        return ranks, phases

    def headline(self, lang: str) -> str:
        what = " ".join(self.command)
        v = f" [{self.variant}]" if self.variant else ""
        if lang == "zh":
            return f"dsdoctor trace{v}: {what}\n  状态 {self.status}，返回码 {_fmt(self.returncode)}，" \
                   f"{self.wall_s:.1f} 秒，{len(self.ranks)} 个 rank\n"
        return f"dsdoctor trace{v}: {what}\n  status {self.status}, exit {_fmt(self.returncode)}, {self.wall_s:.1f}s, " \
               f"{len(self.ranks)} rank(s)\n"

    def to_text(self, lang: str = "en", style=None) -> str:
        rh, ph = self._heads(lang)
        out = [self.headline(lang), "\n", text_table(rh, list(self._rank_rows()))]
        rows = list(self._phase_rows())
        if rows:
            out += ["\n", text_table(ph, rows)]
        if any(r.loop for r in self.ranks):
            out += ["\n", text_table(gen_loop.HEAD[lang if lang in gen_loop.HEAD else "en"], gen_loop.rows(self.ranks))]
        out += ["\n", findings_text(self.findings, lang, style or Style())]
        if self.out_dir:
            out.append(f"{_t('files', lang)}: {self.out_dir}/report.json, report.md, timeline.html\n")
        return "".join(out)

    def to_markdown(self, lang: str = "en") -> str:
        rh, ph = self._heads(lang)
        cmd = " ".join(self.command)
        v = f" — variant `{self.variant}`" if self.variant else ""
        out = [f"# dsdoctor trace{v}\n\n`{cmd}`\n\nstatus **{self.status}**, exit {_fmt(self.returncode)}, "
               f"{self.wall_s:.1f} s\n\n## {_t('ranks', lang)}\n\n", markdown_table(rh, list(self._rank_rows())),
               f"\n## {_t('phases', lang)}\n\n", markdown_table(ph, list(self._phase_rows())),
               f"\n## {_t('findings', lang)}\n\n", findings_markdown(self.findings, lang)]
        if any(r.loop for r in self.ranks):
            out[-2:-2] = ["\n## " + ("训练循环内的 generate" if lang == "zh" else "generate inside training") + "\n\n",
                          markdown_table(gen_loop.HEAD[lang if lang in gen_loop.HEAD else "en"], gen_loop.rows(self.ranks))]
        for r in self.ranks:
            if r.timeline_png:
                out.append(f"\n![rank {r.rank} memory timeline]({r.timeline_png})\n")
        return "".join(out)


def _fmt(v):
    return "-" if v is None else str(v)


def _rate(v):
    return "-" if v is None else f"{v:.1f}"


def _secs(v):
    return "-" if v is None else f"{v:.2f}s"


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


# ------------------------------------------------------------------ building the summary

def _phase_dict(p: PhaseRecord) -> dict:
    return {
        "name": p.name, "index": p.index, "label": p.label, "api": p.info.get("api"), "t_start": p.t_start,
        "t_end": p.t_end, "duration_s": p.duration_s, "unfinished": p.t_end is None,
        "peak_gpu_bytes": p.peak_gpu_reserved, "peak_gpu_allocated_bytes": p.peak_gpu_allocated,
        "gpu_used_device_bytes": p.gpu_used_device, "peak_host_bytes": p.peak_host_rss,
        "host_rss_start": p.host_rss_start, "host_rss_end": p.host_rss_end, "pinned_host_bytes": p.pinned_host_bytes,
        "new_tokens": p.new_tokens, "tokens_per_s": p.tokens_per_s, "error": p.error,
        "synced_gpus": p.info.get("synced_gpus"),
    }


def _peak_and_phase(rec: RankRecord, gpu: bool):
    """(peak bytes, phase label) over phases, the gaps between them and the samples."""
    best, where = None, None

    def consider(value, label):
        nonlocal best, where
        if value is not None and (best is None or value > best):
            best, where = value, label

    if gpu and any(p.peak_gpu_allocated is not None for p in rec.phases):
        # where the peak happened is a question about live tensors: the caching allocator's reserved bytes
        # never shrink, so after a load-time peak every later phase would "peak" as high
        for p in rec.phases:
            consider(p.peak_gpu_allocated, p.label)
        return best, where
    for i, p in enumerate(rec.phases):
        consider(p.peak_gpu_reserved if gpu else p.peak_host_rss, p.label)
        t, host, gpu_gap = rec.gap_peaks[i] if i < len(rec.gap_peaks) else (None, None, None)
        consider(gpu_gap if gpu else host, f"before {p.label}")
    for s in rec.samples:
        value = s[3] if gpu else s[1]
        if value is not None and (best is None or value > best):
            consider(value, _label_at(rec, s[0]))
    return best, where


def _label_at(rec: RankRecord, t: float) -> str:
    previous = None
    for p in rec.phases:
        end = p.t_end if p.t_end is not None else float("inf")
        if p.t_start <= t <= end:
            return p.label
        if p.t_start > t:
            return f"before {p.label}" if previous is None else f"after {previous.label}"
        previous = p
    return f"after {previous.label}" if previous else "start"


def _where_in_stack(stack: str | None) -> str | None:
    """'infer.py:63 in main, waiting in barrier' from a faulthandler dump of all threads."""
    if not stack:
        return None
    blocks = re.split(r"\n(?=(?:Current thread|Thread) )", stack.strip())
    main = next((b for b in blocks if b.startswith("Current thread")), blocks[-1])
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', main)
    if not frames:
        return None
    innermost = frames[0]
    user = next((f for f in frames if not re.search(r"site-packages|dist-packages|/lib/python\d|dsdoctor/trace/", f[0])),
                None)
    inner = f"{innermost[2]}"
    if user:
        short = user[0].rsplit("/", 1)[-1]
        return f"{short}:{user[1]} in {user[2]}, waiting in {inner}"
    return f"waiting in {inner} ({innermost[0].rsplit('/', 1)[-1]}:{innermost[1]})"


def summarize_rank(rec: RankRecord, timed_out: bool) -> RankSummary:
    engine = rec.engine or {}
    init_cfg = next((c for c in reversed(rec.configs) if c.get("api") == "deepspeed.initialize"), None) or \
        next((c for c in reversed(rec.configs)), None)
    gens = [p for p in rec.phases if p.name == "generate"]
    peak_gpu, phase_gpu = _peak_and_phase(rec, gpu=True)
    peak_host, phase_host = _peak_and_phase(rec, gpu=False)
    errors = [p.error for p in rec.phases if p.error] + ([rec.uncaught] if rec.uncaught else [])
    unfinished = [p for p in rec.phases if p.t_end is None]
    if any(e.get("oom") for e in errors):
        status = "oom"
    elif errors:
        status = "error"
    elif not rec.exited:
        status = "hang" if timed_out else "killed"
    else:
        status = "ok"
    tokens = sum(p.new_tokens or 0 for p in gens if p.t_end)
    gen_time = sum(p.duration_s or 0 for p in gens if p.t_end and p.new_tokens)
    synced = [p.info.get("synced_gpus") for p in gens if p.info.get("synced_gpus") is not None]
    s = RankSummary(
        rank=rec.rank, host=rec.host, pid=rec.pid, status=status, t0=rec.t0,
        zero_stage=engine.get("zero_stage"),
        configured_stage=(init_cfg or {}).get("summary", {}).get("stage"),
        optimizer=engine.get("optimizer"), base_optimizer=engine.get("base_optimizer"),
        optimizer_state_bytes=engine.get("optimizer_state_bytes"),
        offload_param=engine.get("offload_param"), offload_optimizer=engine.get("offload_optimizer"),
        dtype=engine.get("dtype"), tp_size=engine.get("tp_size"),
        world_size=engine.get("world_size") or rec.world_size,
        synced_gpus=all(synced) if synced else None,
        peak_gpu_bytes=peak_gpu, peak_gpu_allocated_bytes=_max(p.peak_gpu_allocated for p in rec.phases),
        peak_host_bytes=peak_host, pinned_host_bytes=_max(p.pinned_host_bytes for p in rec.phases),
        host_total_bytes=rec.host_total,
        peak_phase=phase_gpu if peak_gpu is not None else phase_host,
        tokens_per_s=tokens / gen_time if gen_time else None,
        error=errors[0] if errors else None,
        phases=[_phase_dict(p) for p in rec.phases], stack=rec.stack,
        config_passed=dict((init_cfg or {}).get("summary") or {}, api=(init_cfg or {}).get("api"),
                           source=(init_cfg or {}).get("source"),
                           variant_applied=(init_cfg or {}).get("variant_applied")) if init_cfg else None,
        effective=engine or None,
    )
    if status in ("hang", "killed"):
        s.stopped_in = unfinished[-1].label if unfinished else (
            f"after {rec.phases[-1].label}" if rec.phases else "before any observed call")
        s.where = _where_in_stack(rec.stack)
    s.loop = gen_loop.summarize(rec, engine)
    t0 = rec.t0 or 0
    step = max(1, len(rec.samples) // 600)
    s.timeline = [[round(x[0] - t0, 3), x[1], x[2], x[3]] for x in rec.samples[::step]]
    return s


# ------------------------------------------------------------------ findings

def trace_findings(ranks: list[RankSummary], records: list[RankRecord], status: str, returncode, timeout,
                   log: str | None, output_tail: str) -> list[Finding]:
    out: list[Finding] = []
    if not records:
        out.append(Finding("DSD309", {}))

    built = [r for r in ranks if r.optimizer and not r.loop]  # a training loop needs its optimizer
    if built:
        r0 = built[0]
        name = r0.optimizer + (f" ({r0.base_optimizer})" if r0.base_optimizer else "")
        if r0.optimizer_state_bytes:
            cost = Phrase("measured", {"amount": human_bytes(r0.optimizer_state_bytes)})
        else:
            cost = Phrase("partitions")
        source = (r0.config_passed or {}).get("source")
        config = source if isinstance(source, str) and source.endswith((".json", ".hjson", ".yaml", ".yml")) \
            else "YOUR_DS_CONFIG.json"
        out.append(Finding("DSD101", {"optimizer": name, "cost": cost, "config": config,
                                      "ranks": [r.rank for r in built]}))

    tp = [r for r in ranks if r.zero_stage == 3 and (r.tp_size or 1) > 1]
    if tp:
        rec = next(x for x in records if x.rank == tp[0].rank)
        api = next((p.info.get("api") for p in rec.phases if p.name == "init"), "deepspeed")
        out.append(Finding("DSD103", {"stage": 3, "tp_size": tp[0].tp_size, "source": f"observed in {api}",
                                      "version_note": Phrase("none")}))

    unsynced = sorted({rec.rank for rec in records for p in rec.phases
                       if p.name == "generate" and p.info.get("zero3_partitioned")
                       and (p.info.get("world_size") or 1) > 1 and p.info.get("synced_gpus") is False})
    if unsynced:
        world = next(p.info.get("world_size") for rec in records for p in rec.phases if p.name == "generate")
        out.append(Finding("DSD301", {"ranks": ", ".join(map(str, unsynced)), "world_size": world}))

    for r in ranks:
        if r.zero_stage is None or r.configured_stage is None:
            continue
        if not _same_stage(r.configured_stage, r.zero_stage):
            rec = next(x for x in records if x.rank == r.rank)
            src = next((c.get("source") for c in rec.configs if c.get("api") == "deepspeed.initialize"), "dict")
            out.append(Finding("DSD302", {"configured": _quote(r.configured_stage), "effective": r.zero_stage,
                                          "source": src or "dict"}))
            break

    for rec in records:
        if rec.shard_loads:
            files = ", ".join(sorted({f.rsplit("/", 1)[-1] for f in rec.shard_loads}))
            out.append(Finding("DSD303", {"rank": rec.rank, "files": files}))
            break

    out += gen_loop.loop_findings(ranks)
    ignored = _ignored_zero_at_init_inference(records)
    if ignored:
        out.append(ignored)

    unpartitioned = _unpartitioned_finding(ranks, records)
    if unpartitioned:
        out.append(unpartitioned)
    peak = _peak_finding(ranks, unpartitioned_at_init=unpartitioned is not None)
    if peak:
        out.append(peak)

    hosts: dict[str, list[RankSummary]] = {}
    for r in ranks:
        hosts.setdefault(r.host or "?", []).append(r)
    for host, rs in hosts.items():
        pinned = sum(r.pinned_host_bytes or 0 for r in rs)
        total = next((r.host_total_bytes for r in rs if r.host_total_bytes), None)
        if total and pinned > 0.5 * total:
            out.append(Finding("DSD305", {"host": host, "pinned": human_bytes(pinned), "total": human_bytes(total),
                                          "percent": round(100 * pinned / total)}))

    for r in ranks:
        if r.status == "hang":
            where = f" ({r.where})" if r.where else ""
            phase = r.stopped_in if r.stopped_in.startswith(("after", "before")) else f"in {r.stopped_in}"
            out.append(Finding("DSD306", {"rank": r.rank, "phase": phase, "timeout": _num(timeout),
                                          "where": where, "advice": _hang_advice(unsynced)}))
        elif r.status == "oom":
            phase = next((p["label"] for p in r.phases if p.get("error")), "after the last phase")
            out.append(Finding("DSD307", {"rank": r.rank, "phase": phase,
                                          "error": (r.error or {}).get("message", "")[:160]}))
    if status == "hang" and not any(f.code == "DSD306" for f in out):
        out.append(Finding("DSD306", {"rank": "?", "phase": "before any observed call", "timeout": _num(timeout),
                                      "where": "", "advice": _hang_advice(unsynced)}))
    if status == "oom" and not any(f.code == "DSD307" for f in out):
        out.append(Finding("DSD307", {"rank": "?", "phase": "an unobserved step",
                                      "error": _oom_line(output_tail)}))
    if status == "error":
        err = next((r.error for r in ranks if r.error), None)
        detail = f": {err['type']}: {err['message'][:160]}" if err else ""
        out.append(Finding("DSD308", {"returncode": returncode, "detail": detail, "log": log or "the output above"}))
    return sort_findings(out)


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
            if c.get("api") == "deepspeed.init_inference" and isinstance(cfg, dict) and isinstance(cfg.get("zero"), dict):
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


def _peak_finding(ranks: list[RankSummary], unpartitioned_at_init: bool = False) -> Finding | None:
    gpu = any(r.peak_gpu_bytes is not None for r in ranks)
    key = "peak_host_bytes"
    if gpu:
        key = "peak_gpu_allocated_bytes" if any(r.peak_gpu_allocated_bytes for r in ranks) else "peak_gpu_bytes"
    cands = [r for r in ranks if getattr(r, key) is not None and r.peak_phase]
    if not cands:
        return None
    top = max(cands, key=lambda r: getattr(r, key))
    phase = top.peak_phase
    base = phase.split("#")[0]
    if top.loop and base == "init":  # a training loop needs what initialize builds
        base = "init-training"
    elif top.loop and base not in _PHASE_ADVICE:  # between generates a loop runs its training step
        base = "training-step"
    part = Phrase("init-unpartitioned" if base == "init" and unpartitioned_at_init
                  else base if base in _PHASE_ADVICE else "other")
    return Finding("DSD304", {"kind": Phrase("gpu" if gpu else "host"), "peak": human_bytes(getattr(top, key)),
                              "rank": top.rank, "phase": phase, "advice": Phrase("peak-is", {"part": part})})


def run_status(ranks: list[RankSummary], returncode, timed_out: bool, output_tail: str) -> str:
    if timed_out:
        return "hang"
    if any(r.status == "oom" for r in ranks) or (returncode not in (0, None) and OOM_TEXT.search(output_tail or "")):
        return "oom"
    if returncode not in (0, None) or any(r.status == "error" for r in ranks):
        return "error"
    return "ok"
