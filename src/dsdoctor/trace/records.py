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

    @property
    def engine(self) -> dict | None:
        for p in reversed(self.phases):
            if p.name == "init" and p.info.get("engine"):
                return p.info["engine"]
        return None


def read_rank(path: Path) -> RankRecord | None:
    rec = None
    open_phases: dict[tuple[str, int], PhaseRecord] = {}
    for line in door.iter_lines(path, door.TRACE_RECORD):
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a line cut off by a kill
        kind = ev.get("event")
        if kind == "start":
            rec = RankRecord(file=path.name, rank=int(ev.get("rank") or 0), host=ev.get("host"), pid=ev.get("pid"),
                             world_size=ev.get("world_size"), local_rank=ev.get("local_rank"),
                             host_total=ev.get("host_total"), t0=ev.get("t"),
                             variant=ev.get("variant"))
        if rec is None:
            continue
        rec.t_last = ev.get("t", rec.t_last)
        if kind == "samples":
            rec.samples.extend(ev.get("data") or [])
        elif kind == "phase_start":
            ph = PhaseRecord(name=ev["phase"], index=int(ev.get("index", 0)), t_start=ev["t"],
                             host_rss_start=ev.get("host_rss"))
            ph.info = {k: v for k, v in ev.items() if k not in _START_KEYS}
            open_phases[(ph.name, ph.index)] = ph
            rec.phases.append(ph)
            rec.gap_peaks.append((ev["t"], ev.get("gap_peak_host_rss"),
                                  ev.get("gap_peak_gpu_reserved")))
        elif kind == "phase_end":
            ph = open_phases.pop((ev.get("phase"), int(ev.get("index", 0))), None)
            if ph is None:
                continue
            ph.t_end = ev["t"]
            for key in ("duration_s", "peak_gpu_allocated", "peak_gpu_reserved", "gpu_used_device", "gpu_total",
                        "peak_host_rss", "pinned_host_bytes", "new_tokens", "error"):
                setattr(ph, key, ev.get(key))
            ph.host_rss_end = ev.get("host_rss")
            for key in ("engine", "model", "forwards", "new_tokens_per_seq"):
                if ev.get(key) is not None:
                    ph.info[key] = ev[key]
        elif kind == "config":
            rec.configs.append(ev)
        elif kind == "model":
            rec.models.append(ev)
        elif kind == "zero_shards_to_init_inference":
            rec.shard_loads.extend(ev.get("files") or [])
        elif kind == "train":
            rec.train.append({"t": ev.get("t"), "kind": ev.get("kind"), "duration_s": ev.get("duration_s")})
        elif kind == "uncaught":
            rec.uncaught = ev.get("error")
        elif kind == "exit":
            rec.exited = True
    if rec is None:
        return None
    _mark_repeated(rec.phases)
    stack = path.with_name(path.name[: -len(".jsonl")] + ".stack.txt")
    if stack.is_file():
        rec.stack = door.read_text(stack, door.STACK_DUMP, errors="replace").strip() or None
    return rec


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
