"""Rank records + how the command ended -> ``TraceResult`` (per-rank summary, phases, findings).

On a machine without CUDA the GPU figures are None and host RSS stands in for the memory that matters.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from dsdoctor.findings import Finding, sort_findings
from dsdoctor.i18n import message_table, pick
from dsdoctor.report.render import (
    Style,
    findings_markdown,
    findings_omitted,
    findings_text,
    markdown_table,
    text_table,
)
from dsdoctor.trace import loop as gen_loop
from dsdoctor.trace.ending import ending_text, main_frames, progressing
from dsdoctor.trace.records import PhaseRecord, RankRecord
from dsdoctor.units import human_bytes, human_seconds

OOM_TEXT = re.compile(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED", re.IGNORECASE)
# run: ok, oom, hang (ranks wait on each other), timeout (stopped by --timeout, no sign of waiting), error
STATUSES = ("ok", "oom", "hang", "timeout", "error")

_T = message_table("trace.report._T")  # the texts live in dsdoctor/messages.json
_ENDING = message_table("trace.ending.TEXT")


def _t(key, lang):
    return pick(_T[key], lang)


@dataclass
class RankSummary:
    rank: int
    host: str | None
    pid: int | None
    status: str  # ok (finished), oom, error, hang, timeout (still running at the timeout), killed
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
    peak_gpu_allocated_bytes: int | None = None  # live tensors (max_memory_allocated); peak_phase is where
    peak_host_bytes: int | None = None
    pinned_host_bytes: int | None = None
    host_total_bytes: int | None = None
    peak_phase: str | None = None
    tokens_per_s: float | None = None  # steady state (the generates after the first) when there are several
    tokens_per_s_kind: str | None = None  # "steady" or "first": which generate(s) tokens_per_s measures
    first_tokens_per_s: float | None = None  # the first generate alone (allocator and per-length warm-up)
    first_extra_s: float | None = None  # how much longer the first generate took than a steady one of its size
    stopped_in: str | None = None
    where: str | None = None
    in_collective: bool | None = None  # the stack at the timeout waits in torch.distributed / deepspeed.comm
    user_frame: str | None = None  # the script's own innermost frame at the timeout: "infer.py:40 in main"
    error: dict | None = None
    config_passed: dict | None = None  # what the script handed to DeepSpeed (api, source, stage, offloads, ...)
    effective: dict | None = None  # what DeepSpeed built, read from the engine
    config_captured: dict | None = None  # the whole config dict that config_passed summarises
    configs_seen: list[dict] = field(default_factory=list)  # every config handed over: api, rewritable, variant
    model_captured: dict | None = None  # the model the run built: api, model_class, num_params, config (a dict)
    workload: dict | None = None  # of the first generate: batch, prompt_len, new_tokens (per sequence), ...
    phases: list[dict] = field(default_factory=list)
    timeline: list[list] = field(default_factory=list)  # [seconds since start, host rss, gpu allocated, gpu reserved]
    stack: str | None = None
    timeline_png: str | None = None
    loop: dict | None = None  # generation inside training (trace/loop.py): per-generate cost; None otherwise
    local_rank: int | None = None
    progress: dict | None = None  # at the timeout: CPU seconds and stack movement over a window (trace/ending.py)
    ending: dict | None = None  # how the rank ended, with the evidence (trace/ending.py)

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
                yield (r.rank, p["label"], human_seconds(p["duration_s"]), human_bytes(p["peak_gpu_bytes"]),
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
        return _t("headline", lang).format(v=v, what=what, status=self.status, rc=_fmt(self.returncode),
                                           wall=self.wall_s, n=len(self.ranks))

    def _ending_rows(self, lang):
        from dsdoctor.trace.ending import evidence_text

        return [(r.rank, ending_text(r.ending, lang), evidence_text(r.ending, lang) or "-") for r in self.ranks
                if r.ending and r.ending.get("kind") not in ("finished", None)]

    def speed_note(self, lang: str) -> str:
        """Which generate(s) the tokens/s column measures: the steady state, or one first generate."""
        r = next((x for x in self.ranks if x.tokens_per_s_kind), None)
        if r is None:
            return ""
        if r.tokens_per_s_kind == "steady":
            return _t("tps-steady", lang).format(first=r.first_tokens_per_s or 0, extra=r.first_extra_s or 0)
        return _t("tps-first", lang)

    def to_text(self, lang: str = "en", style=None) -> str:
        rh, ph = self._heads(lang)
        out = [self.headline(lang), "\n", text_table(rh, list(self._rank_rows()))]
        rows = list(self._phase_rows())
        if rows:
            out += ["\n", text_table(ph, rows)]
        if self.speed_note(lang):
            out.append(self.speed_note(lang) + "\n")
        ended = self._ending_rows(lang)
        if ended:
            out += ["\n", text_table(pick(_ENDING["head"], lang), ended)]
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
               (f"\n{self.speed_note(lang)}\n" if self.speed_note(lang) else ""),
               "" if findings_omitted() else f"\n## {_t('findings', lang)}\n\n", findings_markdown(self.findings, lang)]
        ended = self._ending_rows(lang)
        if ended:
            out[-2:-2] = [f"\n## {pick(_ENDING['title'], lang)}\n\n", markdown_table(pick(_ENDING["head"], lang), ended)]
        if any(r.loop for r in self.ranks):
            out[-2:-2] = ["\n## " + _t("loop", lang) + "\n\n",
                          markdown_table(gen_loop.HEAD[lang if lang in gen_loop.HEAD else "en"], gen_loop.rows(self.ranks))]
        for r in self.ranks:
            if r.timeline_png:
                out.append(f"\n![rank {r.rank} memory timeline]({r.timeline_png})\n")
        return "".join(out)


def _fmt(v):
    return "-" if v is None else str(v)


def _rate(v):
    return "-" if v is None else f"{v:.1f}"


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


# ------------------------------------------------------------------ building the summary

def _phase_dict(p: PhaseRecord) -> dict:
    return {
        "name": p.name, "index": p.index, "label": p.label, "api": p.info.get("api"), "t_start": p.t_start,
        "t_end": p.t_end, "duration_s": p.duration_s, "unfinished": p.t_end is None, "gpu_total_bytes": p.gpu_total,
        "peak_gpu_bytes": p.peak_gpu_reserved, "peak_gpu_allocated_bytes": p.peak_gpu_allocated,
        "gpu_used_device_bytes": p.gpu_used_device, "peak_host_bytes": p.peak_host_rss,
        "host_rss_start": p.host_rss_start, "host_rss_end": p.host_rss_end, "pinned_host_bytes": p.pinned_host_bytes,
        "new_tokens": p.new_tokens, "tokens_per_s": p.tokens_per_s, "error": p.error,
        "synced_gpus": p.info.get("synced_gpus"), "batch": p.info.get("batch"),
        "prompt_len": p.info.get("prompt_len"), "model_config": p.info.get("model_config"),
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


def _reserved_peak(rec: RankRecord) -> int | None:
    """The caching allocator's reserved peak over the phases, the gaps between them and the samples."""
    values = [p.peak_gpu_reserved for p in rec.phases] + [g[2] for g in rec.gap_peaks] + \
        [s[3] for s in rec.samples if len(s) > 3]
    return _max(values)


def _generate_speed(gens: list[PhaseRecord]) -> dict:
    """tokens/s as users see it: the steady state (every generate after the first) when the rank generated
    more than once, else the one generate, which carries the first call's warm-up; and the first alone."""
    timed = [(p.new_tokens, p.duration_s) for p in gens if p.t_end and p.new_tokens and p.duration_s]
    out = {"tokens_per_s": None, "kind": None, "first": None, "first_extra_s": None}
    if not timed:
        return out
    out["first"] = timed[0][0] / timed[0][1]
    if len(timed) == 1:
        out.update(tokens_per_s=out["first"], kind="first")
        return out
    steady = sum(n for n, _ in timed[1:]) / sum(d for _, d in timed[1:])
    out.update(tokens_per_s=steady, kind="steady", first_extra_s=round(timed[0][1] - timed[0][0] / steady, 3))
    return out


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


def _main_frames(stack: str | None) -> list[tuple[str, str, str]]:
    """(file, line, function) of the main thread, innermost first (of several dumps, the last)."""
    return main_frames(stack)


_LIBRARY = re.compile(r"site-packages|dist-packages|/lib/python\d|dsdoctor/trace/")
_COLLECTIVE = re.compile(r"torch/distributed/|deepspeed/comm/")


def _user_frame(stack: str | None) -> str | None:
    user = next((f for f in _main_frames(stack) if not _LIBRARY.search(f[0])), None)
    return f"{user[0].rsplit('/', 1)[-1]}:{user[1]} in {user[2]}" if user else None


def _in_collective(stack: str | None) -> bool | None:
    """Whether the main thread waits in a collective: one of its innermost frames is torch.distributed's or
    deepspeed.comm's, or ZeRO's wait on an all-gather handle (a rank that compiles an op while initializing
    deepspeed.comm has those frames much further out, under the compiler's subprocess)."""
    frames = _main_frames(stack)
    if not frames:
        return None
    inner = [(f[0].replace("\\", "/"), f[2]) for f in frames[:_INNER_FRAMES]]
    return any(_COLLECTIVE.search(path) or ("deepspeed/runtime/zero/" in path and "wait" in func)
               for path, func in inner)


_INNER_FRAMES = 3


def _where_in_stack(stack: str | None) -> str | None:
    """'infer.py:63 in main, waiting in barrier' from a faulthandler dump of all threads."""
    frames = _main_frames(stack)
    if not frames:
        return None
    innermost = frames[0]
    user = _user_frame(stack)
    if user:
        return f"{user}, waiting in {innermost[2]}"
    return f"waiting in {innermost[2]} ({innermost[0].rsplit('/', 1)[-1]}:{innermost[1]})"


def summarize_rank(rec: RankRecord, timed_out: bool) -> RankSummary:
    engine = rec.engine or {}
    init_cfg = next((c for c in reversed(rec.configs) if c.get("api") == "deepspeed.initialize"), None) or \
        next((c for c in reversed(rec.configs)), None)
    gens = [p for p in rec.phases if p.name == "generate"]
    peak_gpu, phase_gpu = _peak_and_phase(rec, gpu=True)  # where live tensors peaked
    reserved = _reserved_peak(rec)
    if reserved is not None:  # the OOM line is the caching allocator's reserved bytes, not the allocated ones
        peak_gpu = max(reserved, peak_gpu or 0)
    peak_host, phase_host = _peak_and_phase(rec, gpu=False)
    errors = [p.error for p in rec.phases if p.error] + ([rec.uncaught] if rec.uncaught else [])
    unfinished = [p for p in rec.phases if p.t_end is None]
    if any(e.get("oom") for e in errors):
        status = "oom"
    elif errors:
        status = "error"
    elif not rec.exited:
        status = "timeout" if timed_out else "killed"  # settle_timeout decides which timeouts are hangs
    else:
        status = "ok"
    speed = _generate_speed(gens)
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
        tokens_per_s=speed["tokens_per_s"], tokens_per_s_kind=speed["kind"],
        first_tokens_per_s=speed["first"], first_extra_s=speed["first_extra_s"], local_rank=rec.local_rank,
        error=errors[0] if errors else None,
        phases=[_phase_dict(p) for p in rec.phases], stack=rec.stack,
        config_passed=dict((init_cfg or {}).get("summary") or {}, api=(init_cfg or {}).get("api"),
                           source=(init_cfg or {}).get("source"),
                           variant_applied=(init_cfg or {}).get("variant_applied")) if init_cfg else None,
        configs_seen=[{k: c.get(k) for k in ("api", "source", "rewritable", "variant_applied", "variant_changed")}
                      for c in rec.configs],
        effective=engine or None,
        config_captured=(init_cfg or {}).get("config"),
        model_captured=_captured_model(rec), workload=_workload(gens),
    )
    if status in ("timeout", "killed"):
        s.stopped_in = unfinished[-1].label if unfinished else (
            f"after {rec.phases[-1].label}" if rec.phases else "before any observed call")
        s.where = _where_in_stack(rec.stack)
        s.user_frame = _user_frame(rec.stack)
        s.in_collective = _in_collective(rec.stack)
    s.loop = gen_loop.summarize(rec, engine)
    t0 = rec.t0 or 0
    step = max(1, len(rec.samples) // 600)
    s.timeline = [[round(x[0] - t0, 3), x[1], x[2], x[3]] for x in rec.samples[::step]]
    return s


def _captured_model(rec: RankRecord) -> dict | None:
    """The model the run used: the one handed to DeepSpeed when there is one, else the largest one loaded."""
    models = [m for m in rec.models if m.get("num_params")]
    if not models:
        return None
    handed = [m for m in models if str(m.get("api", "")).startswith("deepspeed.")]
    m = handed[-1] if handed else max(models, key=lambda m: m["num_params"])
    return {k: m.get(k) for k in ("api", "model_class", "num_params", "param_dtype", "is_encoder_decoder", "config")}


def _workload(gens: list[PhaseRecord]) -> dict | None:
    """What the first generate ran: batch, prompt length, new tokens per sequence (as generated)."""
    for p in gens:
        if p.info.get("batch") is None:
            continue
        out = {"batch": p.info.get("batch"), "prompt_len": p.info.get("prompt_len"),
               "max_new_tokens": p.info.get("max_new_tokens"), "encoder_decoder": p.info.get("encoder_decoder")}
        per_seq = p.info.get("new_tokens_per_seq")
        if per_seq is None and p.new_tokens is not None and p.info.get("batch"):
            per_seq = p.new_tokens // p.info["batch"]
        out["new_tokens"] = per_seq if per_seq is not None else out["max_new_tokens"]
        return out
    return None


def settle_timeout(ranks: list[RankSummary]) -> None:
    """Of the ranks still running at the timeout, call them hung only when they wait on each other: one waits
    in a collective while the ranks are at different points (another phase or line, or already finished), or
    while fewer ranks were observed than the world size, and no rank makes progress (when the watchdog could
    look: CPU time and stack over a few seconds, trace/ending.py). Otherwise they were stopped mid-work, or
    were slow: "timeout"."""
    running = [r for r in ranks if r.status == "timeout"]
    if not running or any(progressing(r.progress) for r in running):
        return
    points = {(r.stopped_in, r.user_frame) if r.status == "timeout" else ("finished", None) for r in ranks}
    world = max((r.world_size or 0 for r in ranks), default=0)
    waiting = any(r.in_collective for r in running)
    if waiting and (len(points) > 1 or world > len(ranks)):
        for r in running:
            r.status = "hang"


def run_status(ranks: list[RankSummary], returncode, timed_out: bool, output_tail: str) -> str:
    """The run's status. With ``timed_out`` it first settles which still-running ranks are hung."""
    if timed_out:
        settle_timeout(ranks)
        if any(r.status == "hang" for r in ranks):
            return "hang"
        if any(r.status == "oom" for r in ranks):
            return "oom"
        if any(r.status == "error" for r in ranks):
            return "error"
        if ranks and all(r.status == "ok" for r in ranks):
            return "ok"  # every rank had finished; only the command itself was still running (DSD319)
        return "timeout"
    if any(r.status == "oom" for r in ranks) or (returncode not in (0, None) and OOM_TEXT.search(output_tail or "")):
        return "oom"
    if returncode not in (0, None) or any(r.status == "error" for r in ranks):
        return "error"
    return "ok"
