"""Read the ranks' JSON-lines records back into plain data (torch-free, tolerant of a cut-off last line)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dsdoctor import door


@dataclass
class PhaseRecord:
    name: str
    index: int
    t_start: float
    t_end: float | None = None  # None: the rank never finished this phase (killed, hung, crashed hard)
    duration_s: float | None = None
    peak_gpu_allocated: int | None = None
    peak_gpu_reserved: int | None = None
    gpu_used_device: int | None = None
    gpu_total: int | None = None
    peak_host_rss: int | None = None
    host_rss_start: int | None = None
    host_rss_end: int | None = None
    pinned_host_bytes: int | None = None
    new_tokens: int | None = None
    error: dict | None = None
    info: dict = field(default_factory=dict)  # api, synced_gpus, engine, model, ...
    repeated: bool = False  # the rank ran this phase more than once (a script that loads two models)

    @property
    def label(self) -> str:
        """generate#0, generate#1, ...; load and init are numbered the same way only when they repeat."""
        return f"{self.name}#{self.index}" if self.name == "generate" or self.repeated else self.name

    @property
    def tokens_per_s(self) -> float | None:
        if self.new_tokens and self.duration_s:
            return self.new_tokens / self.duration_s
        return None


@dataclass
class RankRecord:
    file: str
    rank: int
    host: str | None = None
    pid: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    host_total: int | None = None
    t0: float | None = None
    t_last: float | None = None
    variant: str | None = None
    phases: list[PhaseRecord] = field(default_factory=list)
    configs: list[dict] = field(default_factory=list)
    models: list[dict] = field(default_factory=list)  # "model" events: class, num_params, config dict
    gap_peaks: list[tuple[float, int | None, int | None]] = field(default_factory=list)  # (t, host, gpu)
    samples: list[list] = field(default_factory=list)  # [t, rss, gpu_allocated, gpu_reserved]
    shard_loads: list[str] = field(default_factory=list)
    uncaught: dict | None = None
    train: list[dict] = field(default_factory=list)  # engine.backward / engine.step: {"t", "kind", "duration_s"}
    exited: bool = False
    stack: str | None = None
    experts: list[tuple[int, int, int]] = field(default_factory=list)  # (forward, layer, expert) entered under ZeRO-3

    @property
    def engine(self) -> dict | None:
        for p in reversed(self.phases):
            if p.name == "init" and p.info.get("engine"):
                return p.info["engine"]
        return None


# ---- a record is written by the user's ranks: every field is checked before anything reads it -------------------

_NUM, _INT, _STR, _BOOL, _DICT, _LIST = "number", "integer", "string", "boolean", "object", "list"
_MAX_MAGNITUDE = 2.0**62  # bytes, seconds since the epoch, counts: anything larger is not a measurement

# the fields the report reads, at the top of an event and inside its known objects; a field of another type is
# dropped (as if the rank had not written it), an event that is not an object, or whose phase is not a
# string, is skipped whole
_EVENT_FIELDS = {
    "event": _STR, "t": _NUM, "rank": _INT, "local_rank": _INT, "pid": _INT, "world_size": _INT, "host": _STR,
    "host_total": _NUM, "variant": _STR, "phase": _STR, "index": _INT, "host_rss": _NUM, "host_peak": _NUM,
    "gap_peak_host_rss": _NUM, "gap_peak_gpu_reserved": _NUM, "gap_peak_gpu_allocated": _NUM,
    "duration_s": _NUM, "peak_gpu_allocated": _NUM, "peak_gpu_reserved": _NUM, "gpu_used_device": _NUM,
    "gpu_total": _NUM, "peak_host_rss": _NUM, "pinned_host_bytes": _NUM, "new_tokens": _INT, "error": _DICT,
    "engine": _DICT, "forwards": _INT, "new_tokens_per_seq": _INT, "data": _LIST, "files": _LIST, "kind": _STR,
    "api": _STR, "source": _STR, "config": _DICT, "summary": _DICT, "summary_before_variant": _DICT,
    "rewritable": _BOOL, "variant_applied": _STR, "variant_changed": _BOOL, "synced_gpus": _BOOL,
    "zero3_partitioned": _BOOL, "batch": _INT, "prompt_len": _INT,
    "max_new_tokens": _INT, "encoder_decoder": _BOOL, "is_encoder_decoder": _BOOL, "model_class": _STR,
    "num_params": _INT, "param_dtype": _STR, "model_config": _DICT, "hf_zero3": _BOOL, "hf_zero3_alive": _BOOL,
    "model_at_initialize": _DICT, "gather_once": _STR, "already_gathered": _BOOL, "param_bytes": _NUM,
    "gather_bytes_per_forward": _NUM, "is_zero3": _BOOL, "forward": _INT, "layer": _INT, "expert": _INT,
    "moe_gathers": _DICT, "moe": _DICT,
}
_NESTED_FIELDS = {
    "engine": {"engine": _STR, "zero_stage": _INT, "offload_param": _STR, "offload_param_pin_memory": _BOOL,
               "offload_optimizer": _STR, "optimizer": _STR, "base_optimizer": _STR, "optimizer_state_bytes": _NUM,
               "dtype": _STR, "tp_size": _INT, "world_size": _INT, "zero3_partitioned": _BOOL},
    "error": {"type": _STR, "message": _STR, "oom": _BOOL},
    "summary": {"optimizer": _STR, "offload_param": _STR, "offload_optimizer": _STR, "tp_size": _INT},
    "summary_before_variant": {"optimizer": _STR, "offload_param": _STR, "offload_optimizer": _STR,
                               "tp_size": _INT},
}


def _fits(value, kind: str) -> bool:
    if value is None:
        return True  # "not measured": every reader handles it
    if kind in (_NUM, _INT):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if not -_MAX_MAGNITUDE <= value <= _MAX_MAGNITUDE:  # NaN and the infinities fail too
            return False
        return kind == _NUM or float(value).is_integer()
    types = {_STR: str, _BOOL: bool, _DICT: dict, _LIST: list}
    return isinstance(value, types[kind])


def _checked(fields: dict, schema: dict) -> dict:
    out = {}
    for key, value in fields.items():
        kind = schema.get(key)
        if kind is None:
            out[key] = value  # carried, never read
        elif value is None:  # a number or text "not measured" (the observer writes it): every reader handles it;
            if kind not in (_DICT, _LIST):  # an object or list that is null is read as missing
                out[key] = None
        elif _fits(value, kind):
            if kind == _INT and isinstance(value, float):
                value = int(value)
            if kind == _DICT and key in _NESTED_FIELDS:
                value = _checked(value, _NESTED_FIELDS[key])
            out[key] = value
    return out


def valid_event(ev) -> dict | None:
    """A record line as the report may read it: an object whose known fields have their types (numbers
    finite and below 2**62), the samples and file lists cleaned; None for a line that is not an event. A
    rank writes these files, and a crafted or damaged one must not end the report in an internal error."""
    if not isinstance(ev, dict) or not isinstance(ev.get("event"), str):
        return None
    ev = _checked(ev, _EVENT_FIELDS)
    if ev["event"] in ("phase_start", "phase_end") and not isinstance(ev.get("phase"), str):
        return None
    if ev["event"] in ("phase_start", "phase_end") and not isinstance(ev.get("t"), (int, float)):
        return None
    if isinstance(ev.get("error"), dict):  # what an error says is read as text: both always there
        ev["error"] = {**ev["error"], "type": ev["error"].get("type") or "Error",
                       "message": ev["error"].get("message") or ""}
    if "data" in ev:
        ev["data"] = [row for row in ev["data"] or () if isinstance(row, list) and len(row) == 4
                      and all(_fits(x, _NUM) for x in row) and isinstance(row[0], (int, float))]
    if "files" in ev:
        ev["files"] = [f for f in ev["files"] or () if isinstance(f, str)]
    return ev


def read_rank(path: Path) -> RankRecord | None:
    rec = None
    open_phases: dict[tuple[str, int], PhaseRecord] = {}
    for line in door.iter_lines(path, door.TRACE_RECORD):
        try:
            ev = valid_event(json.loads(line))
        except (ValueError, RecursionError):
            continue  # a line cut off by a kill
        if ev is None:
            continue
        kind = ev.get("event")
        if kind == "start":
            rec = RankRecord(file=path.name, rank=int(ev.get("rank") or 0), host=ev.get("host"), pid=ev.get("pid"),
                             world_size=ev.get("world_size"), local_rank=ev.get("local_rank"),
                             host_total=ev.get("host_total"), t0=ev.get("t"),
                             variant=ev.get("variant"))
        if rec is None:
            continue
        rec.t_last = ev.get("t", rec.t_last)
        if kind == "phase_start":
            ph = PhaseRecord(name=ev["phase"], index=int(ev.get("index") or 0), t_start=ev["t"],
                             host_rss_start=ev.get("host_rss"))
            ph.info = {k: v for k, v in ev.items() if k not in _START_KEYS}
            open_phases[(ph.name, ph.index)] = ph
            rec.phases.append(ph)
            rec.gap_peaks.append((ev["t"], ev.get("gap_peak_host_rss"),
                                  ev.get("gap_peak_gpu_reserved")))
        elif kind == "phase_end":
            _end_phase(open_phases.pop((ev.get("phase"), int(ev.get("index") or 0)), None), ev)
        else:
            _take_event(rec, kind, ev)
    if rec is None:
        return None
    _mark_repeated(rec.phases)
    stack = path.with_name(path.name[: -len(".jsonl")] + ".stack.txt")
    if stack.is_file():
        rec.stack = door.read_text(stack, door.STACK_DUMP, errors="replace").strip() or None
    return rec


def _end_phase(ph: PhaseRecord | None, ev: dict) -> None:
    """A phase_end event into its phase (none: an end without its start, dropped)."""
    if ph is None:
        return
    ph.t_end = ev["t"]
    for key in ("duration_s", "peak_gpu_allocated", "peak_gpu_reserved", "gpu_used_device", "gpu_total",
                "peak_host_rss", "pinned_host_bytes", "new_tokens", "error"):
        setattr(ph, key, ev.get(key))
    ph.host_rss_end = ev.get("host_rss")
    for key in ("engine", "model", "forwards", "new_tokens_per_seq", "moe_gathers"):
        if ev.get(key) is not None:
            ph.info[key] = ev[key]


def _take_event(rec: RankRecord, kind: str, ev: dict) -> None:
    """Every other event into the rank's record."""
    if kind == "samples":
        rec.samples.extend(ev.get("data") or [])
    elif kind == "config":
        rec.configs.append(ev)
    elif kind == "model":
        rec.models.append(ev)
    elif kind == "zero_shards_to_init_inference":
        rec.shard_loads.extend(ev.get("files") or [])
    elif kind == "train":
        rec.train.append({"t": ev.get("t"), "kind": ev.get("kind"), "duration_s": ev.get("duration_s")})
    elif kind == "expert" and all(isinstance(ev.get(k), int) for k in ("forward", "layer", "expert")):
        rec.experts.append((ev["forward"], ev["layer"], ev["expert"]))
    elif kind == "uncaught":
        rec.uncaught = ev.get("error")
    elif kind == "exit":
        rec.exited = True


def _mark_repeated(phases: list[PhaseRecord]) -> None:
    counts: dict[str, int] = {}
    for p in phases:
        counts[p.name] = counts.get(p.name, 0) + 1
    for p in phases:
        p.repeated = counts[p.name] > 1


_START_KEYS = {"event", "t", "phase", "index", "host_rss", "gap_peak_host_rss", "gap_peak_gpu_reserved",
               "gap_peak_gpu_allocated"}


def read_records(directory: Path) -> list[RankRecord]:
    """Every rank's record in ``directory``, ordered by rank (several processes of one rank all kept)."""
    out = []
    for path in sorted(Path(directory).glob("rank-*.jsonl")):
        rec = read_rank(path)
        if rec is not None:
            out.append(rec)
    # Python helpers a rank starts inherit its RANK and leave empty records: of a rank's records keep those
    # with observed calls, or else the first one (the rank itself)
    out.sort(key=lambda r: (r.rank, r.t0 or 0))
    kept, seen = [], set()
    active = {r.rank for r in out if r.phases or r.configs or r.models or r.train}
    for r in out:
        if r.phases or r.configs or r.models or r.train or (r.rank not in active and r.rank not in seen):
            kept.append(r)
            seen.add(r.rank)
    return kept
