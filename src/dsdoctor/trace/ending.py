"""How each rank of a run ended, and the evidence for it.

A rank's record says what the rank itself saw (an exception, a CUDA OOM, a normal exit); what it cannot say,
because it was killed, comes from outside: the launcher's report of each rank's exit code (DeepSpeed's
``exits with return code = -9``, torchrun's ``exitcode : -9 (pid: N)``), the command's own exit status (the
DeepSpeed launcher passes a rank's -9 on as 247), the memory cgroup's ``oom_kill`` counter read before and after
the run (cgroup v2 ``memory.events``, v1 ``memory.oom_control``), and, where no counter can be read, host memory
at the rank's last sample against the limit. At the watchdog's timeout, each rank's CPU time (its process tree,
/proc/PID/stat) and two stack dumps a few seconds apart say whether it was still working or standing still: a
hang is a run that makes no progress, not a slow one.

Each rank gets ``ending``: a JSON-able dict (``kind``, ``phase``, ``signal``, ``exit_code``, ``evidence``,
``detail``) that every report renders the same way (``ending_text``), in both languages.
"""
from __future__ import annotations

import re
import signal as _signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsdoctor import door
from dsdoctor.i18n import message_table, pick
from dsdoctor.units import human_bytes

TEXT = message_table("trace.ending.TEXT")  # the texts live in dsdoctor/messages.json
NEAR_LIMIT = 0.90  # host memory at the last sample at or above this share of the limit: most likely the OOM killer
PEER_SAMPLE_S = 2.0  # how far apart two ranks' samples may be to add up as one moment
PROGRESS_WINDOW_S = 2.0  # between the two looks at a rank still running at the timeout
WORKING_CPU_SHARE = 0.2  # CPU time over the window, as a share of one core, that counts as work


# --------------------------------------------------------------------------- evidence read by the launch

def _cgroup_paths() -> list[tuple[str, str]]:
    """(version, cgroup path) of this process's memory cgroup: the v2 path and/or the v1 memory path."""
    out = []
    for line in (door.read_proc("/proc/self/cgroup", 1 << 16) or b"").decode("utf-8", "replace").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            out.append(("v2", parts[2]))
        elif "memory" in parts[1].split(","):
            out.append(("v1", parts[2]))
    return out


def _candidates(name_v2: str, name_v1: str) -> list[str]:
    files = []
    for version, path in _cgroup_paths():
        path = path.rstrip("/")
        if version == "v2":
            files += [f"/sys/fs/cgroup{path}/{name_v2}", f"/sys/fs/cgroup/unified{path}/{name_v2}"]
        else:
            files += [f"/sys/fs/cgroup/memory{path}/{name_v1}", f"/sys/fs/cgroup/memory/{name_v1}"]
    return files


def oom_kill_counter() -> dict | None:
    """{"file", "count"}: how many processes the kernel OOM killer has killed in this process's memory cgroup
    (and below it), from the first readable of cgroup v2 ``memory.events`` or v1 ``memory.oom_control``."""
    for path in _candidates("memory.events", "memory.oom_control"):
        text = (door.read_proc(path, 1 << 16) or b"").decode("ascii", "replace")
        m = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
        if m:
            return {"file": path, "count": int(m.group(1))}
    return None


def memory_limit() -> dict | None:
    """{"bytes", "source"}: the memory the run's processes may use on this host, the smaller of the memory
    cgroup's limit and MemTotal."""
    best = None
    meminfo = (door.read_proc("/proc/meminfo", 1 << 16) or b"").decode("ascii", "replace")
    m = re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.MULTILINE)
    if m:
        best = {"bytes": int(m.group(1)) * 1024, "source": "MemTotal"}
    for path in _candidates("memory.max", "memory.limit_in_bytes"):
        raw = (door.read_proc(path, 4096) or b"").strip()
        if raw.isdigit() and (best is None or int(raw) < best["bytes"]):
            best = {"bytes": int(raw), "source": path}
            break
    return best


def main_frames(stack: str | None) -> list[tuple[str, str, str]]:
    """(file, line, function) of the main thread, innermost first, from a faulthandler dump of all threads;
    of several dumps in one file, the last."""
    if not stack:
        return []
    blocks = re.split(r"\n(?=(?:Current thread|Thread) )", stack.strip())
    current = [b for b in blocks if b.startswith("Current thread")]
    main = current[-1] if current else blocks[-1]
    return re.findall(r'File "([^"]+)", line (\d+) in (\S+)', main)


def _stack_file(trace_dir: Path, pid: int) -> Path | None:
    return next(iter(Path(trace_dir).glob(f"rank-*.{pid}.stack.txt")), None)


def _read_stack(path: Path | None) -> str:
    if path is None:
        return ""
    try:
        return door.read_text(path, door.STACK_DUMP, errors="replace")
    except Exception:  # a rank that ended meanwhile: no stack, no evidence
        return ""


def watch_progress(pids: list[int], trace_dir: Path, window_s: float = PROGRESS_WINDOW_S) -> dict:
    """At the timeout, for each rank still running: CPU seconds of its process tree over ``window_s`` and
    whether its main thread's stack moved between two dumps (SIGUSR1, the observer's faulthandler).

    Returns {pid: {"cpu_s", "window_s", "stack_still" (None: no two stacks to compare)}}."""
    from dsdoctor.proctree import signal_all, tree_cpu_seconds

    if not pids:
        return {}
    start = {p: tree_cpu_seconds(p) for p in pids}
    t0 = time.monotonic()
    signal_all(pids, _signal.SIGUSR1)
    time.sleep(1.0)
    first = {p: _read_stack(_stack_file(trace_dir, p)) for p in pids}
    time.sleep(max(window_s - 1.0, 0.0))
    signal_all(pids, _signal.SIGUSR1)
    time.sleep(1.0)
    window = time.monotonic() - t0
    out = {}
    for p in pids:
        end = tree_cpu_seconds(p)
        text = _read_stack(_stack_file(trace_dir, p))
        a, b = main_frames(first[p]), main_frames(text[len(first[p]):])
        still = (a == b) if a and b else None
        cpu = None if start[p] is None or end is None else round(max(end - start[p], 0.0), 3)
        out[p] = {"cpu_s": cpu, "window_s": round(window, 3), "stack_still": still}
    return out


def progressing(progress: dict | None) -> bool | None:
    """Whether a rank still running at the timeout was doing work: its stack moved, or it used CPU without
    sitting still in a collective (True); standing still (False); no evidence (None)."""
    if not progress:
        return None
    cpu, window, still = progress.get("cpu_s"), progress.get("window_s") or 0, progress.get("stack_still")
    if still is False:
        return True
    if cpu is None:
        return None if still is None else False
    return cpu >= WORKING_CPU_SHARE * window and not progress.get("in_collective")


# --------------------------------------------------------------------------- reading the output

_SIGNALS = {s.value: s.name for s in _signal.Signals}
_DS_RANK_EXIT = re.compile(r"exits with return code = (-?\d+)")
_LOCAL_RANK = re.compile(r"--local_rank[= ](\d+)")
_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*"
                               r"\(pid:\s*(\d+)\)")
_NCCL_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout:.*?OpType=(\w+).*?Timeout\(ms\)=(\d+)\)")
_NCCL_RANK = re.compile(r"\[(?:PG[^\]]*?)?Rank (\d+)\]\s*Watchdog caught collective operation timeout")
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation")
_STORE_TIMEOUT = re.compile(r"(?:DistStoreError|DistBackendError|RuntimeError)[^\n]*?[Tt]imed? ?out[^\n]*")
_CUDA_OOM_NEW = re.compile(
    r"Tried to allocate ([\d.]+ [KMGT]?i?B)\..*?total capacity of ([\d.]+ [KMGT]?i?B) of which ([\d.]+ [KMGT]?i?B) "
    r"is free.*?Of the allocated memory ([\d.]+ [KMGT]?i?B) is allocated by PyTorch, and ([\d.]+ [KMGT]?i?B) is "
    r"reserved by PyTorch but unallocated", re.DOTALL)
_CUDA_OOM_OLD = re.compile(
    r"Tried to allocate ([\d.]+ [KMGT]?i?B) \(GPU \d+; ([\d.]+ [KMGT]?i?B) total capacity; ([\d.]+ [KMGT]?i?B) "
    r"already allocated; ([\d.]+ [KMGT]?i?B) free; ([\d.]+ [KMGT]?i?B) reserved in total by PyTorch")
_HOST_OOM = re.compile(r"DefaultCPUAllocator: can't allocate memory|Cannot allocate memory|std::bad_alloc")


def _bytes(text: str) -> int:
    from dsdoctor.units import parse_bytes

    return parse_bytes(text.replace(" ", ""))


def allocator_figures(text: str | None) -> dict | None:
    """The caching allocator's own figures in a ``torch.cuda.OutOfMemoryError`` text: tried, free, total,
    allocated, reserved but unallocated (bytes)."""
    if not text:
        return None
    m = _CUDA_OOM_NEW.search(text)
    if m:
        tried, total, free, allocated, unallocated = (_bytes(g) for g in m.groups())
    else:
        m = _CUDA_OOM_OLD.search(text)
        if not m:
            return None
        tried, total, allocated, free, reserved = (_bytes(g) for g in m.groups())
        unallocated = max(reserved - allocated, 0)
    return {"tried": tried, "free": free, "total": total, "allocated": allocated, "unallocated": unallocated,
            "fragmentation": unallocated >= tried}


def launcher_exit_codes(output: str) -> dict:
    """{"by_local_rank": {local: code}, "by_pid": {pid: code}, "by_rank": {rank: code}} as the launcher
    reported each failed rank (DeepSpeed's launch.py, torchrun)."""
    out: dict = {"by_local_rank": {}, "by_pid": {}, "by_rank": {}}
    for line in (output or "").splitlines():
        m = _DS_RANK_EXIT.search(line)
        if m:
            local = _LOCAL_RANK.search(line)
            out["by_local_rank"][int(local.group(1)) if local else None] = int(m.group(1))
    for m in _TORCHRUN_FAILURE.finditer(output or ""):
        out["by_rank"][int(m.group(1))] = int(m.group(3))
        out["by_pid"][int(m.group(4))] = int(m.group(3))
    return out


def decode_exit(code: int | None) -> dict:
    """{"exit_code", "signal"}: a negative code is a signal; a launcher that passes a rank's -N on as its own
    exit status gives 256-N (the DeepSpeed launcher's 247 for -9); a shell gives 128+N."""
    if code is None:
        return {"exit_code": None, "signal": None}
    if code < 0:
        return {"exit_code": code, "signal": _SIGNALS.get(-code, f"signal {-code}")}
    if 256 - code in _SIGNALS and code >= 192:
        return {"exit_code": code, "signal": _SIGNALS[256 - code]}
    if 128 < code < 128 + 32 and code - 128 in _SIGNALS:
        return {"exit_code": code, "signal": _SIGNALS[code - 128]}
    return {"exit_code": code, "signal": None}


def collective_timeout(text: str | None) -> str | None:
    """What timed out, from NCCL's watchdog or gloo's text ("ALLGATHER after 600000 ms"), or None."""
    if not text:
        return None
    m = _NCCL_TIMEOUT.search(text)
    if m:
        return f"NCCL {m.group(1)} after {m.group(2)} ms (watchdog)"
    m = _GLOO_TIMEOUT.search(text)
    if m:
        return f"gloo {m.group(2)} after {m.group(1)} ms"
    m = _STORE_TIMEOUT.search(text)
    return m.group(0).strip()[:200] if m else None


def last_exception_line(text: str | None) -> str | None:
    """The last line of the last Python traceback in ``text`` ("TypeError: ..."), or None."""
    if not text or "Traceback (most recent call last)" not in text:
        return None
    tail = text.rsplit("Traceback (most recent call last)", 1)[1]
    for line in tail.splitlines()[1:]:
        stripped = line.strip()
        if stripped and not line.startswith((" ", "\t")) and re.match(r"[\w.]+(Error|Exception|Interrupt|Exit)\b|"
                                                                      r"[\w.]+:", stripped):
            return stripped[:300]
    return None


def _error_line(error: dict) -> str:
    message = str(error.get("message") or "").strip()
    first = next((x.strip() for x in message.splitlines() if x.strip()), "")
    return f"{error.get('type') or 'Error'}: {first}"[:300] if first else str(error.get("type") or "Error")


# --------------------------------------------------------------------------- the reading

@dataclass
class Evidence:
    """What the launch saw beside the ranks' records."""
    returncode: int | None = None
    timed_out: bool = False
    output_tail: str = ""
    root_pid: int | None = None  # the command's own process
    oom_before: dict | None = None  # oom_kill_counter() before the run
    oom_after: dict | None = None
    limit: dict | None = None  # memory_limit()
    progress: dict = field(default_factory=dict)  # pid -> watch_progress()
    host: str = field(default_factory=socket.gethostname)

    @classmethod
    def of(cls, outcome) -> Evidence:
        return cls(outcome.returncode, outcome.timed_out, outcome.output_tail, getattr(outcome, "pid", None),
                   getattr(outcome, "oom_before", None), getattr(outcome, "oom_after", None),
                   getattr(outcome, "limit", None), dict(getattr(outcome, "progress", None) or {}))


def apply_progress(ranks, progress: dict) -> None:
    """Hand each rank still running at the timeout its progress evidence (before the hang is settled)."""
    for r in ranks:
        p = progress.get(r.pid) if r.pid is not None else None
        if p is not None:
            r.progress = dict(p, in_collective=bool(r.in_collective))


def _phase_of(r) -> str:
    for p in r.phases:
        if p.get("error"):
            return p["label"]
    if r.stopped_in:
        return r.stopped_in
    unfinished = [p for p in r.phases if p.get("unfinished")]
    if unfinished:
        return unfinished[-1]["label"]
    return f"after {r.phases[-1]['label']}" if r.phases else "before any observed call"


def _error_time(rec) -> float | None:
    times = [p.t_end for p in rec.phases if p.error and p.t_end is not None]
    if rec.uncaught:
        times.append(rec.t_last)
    return min((t for t in times if t is not None), default=None)


def describe(ranks, records, ev: Evidence) -> None:
    """Set ``r.ending`` on every rank (see the module docstring)."""
    recs = {id(r): rec for r, rec in zip(ranks, records)}
    codes = launcher_exit_codes(ev.output_tail)
    single = len(ranks) == 1 and ranks[0].pid is not None and ranks[0].pid == ev.root_pid
    run_exit = decode_exit(ev.returncode)

    def own_code(r):
        if single:
            return ev.returncode, "returncode"
        if r.pid in codes["by_pid"]:
            return codes["by_pid"][r.pid], "torchrun"
        if r.rank in codes["by_rank"]:
            return codes["by_rank"][r.rank], "torchrun"
        local = getattr(r, "local_rank", None)
        if local is not None and local in codes["by_local_rank"]:
            return codes["by_local_rank"][local], "deepspeed"
        return None, None

    failed = []  # (time, rank) of ranks whose own record says they failed
    for r in ranks:
        rec = recs.get(id(r))
        if r.status in ("oom", "error") and rec is not None:
            failed.append((_error_time(rec) or float("inf"), r.rank))
    killed = [r for r in ranks if r.status == "killed"]
    root = min(failed)[1] if failed else None
    if root is None and killed:
        reported = [r for r in killed if own_code(r)[0] not in (None, 0)]
        pick_from = reported or killed
        root = min(pick_from, key=lambda r: (recs.get(id(r)).t_last or 0) if recs.get(id(r)) else 0).rank
    peers = _peer_rss(ranks, records)
    for r in ranks:
        r.ending = _ending(r, recs.get(id(r)), ev, own_code(r), run_exit, root, peers.get(id(r), 0))


def _ending(r, rec, ev: Evidence, own, run_exit: dict, root, peer_rss: int = 0) -> dict:
    code, source = own
    end = {"kind": "finished", "phase": _phase_of(r), "exit_code": code, "signal": None, "evidence": None,
           "detail": None}
    if code is not None:
        end.update(decode_exit(code))
        end["evidence"] = {"kind": "launcher", "source": source, "code": code}
    text = " ".join(filter(None, [str((r.error or {}).get("message") or ""), ev.output_tail]))
    if r.status == "hang":
        end.update(kind="hang", detail=r.where)
    elif r.status == "timeout":
        end.update(kind="timeout", detail=r.where)
        if r.progress:
            end["evidence"] = {"kind": "progress", **{k: r.progress.get(k) for k in ("cpu_s", "window_s",
                                                                                         "stack_still")},
                               "working": progressing(r.progress)}
    elif r.status in ("oom", "error"):
        err = r.error or {}
        what = collective_timeout(str(err.get("message") or "")) or (
            collective_timeout(ev.output_tail) if err.get("type") in (None, "DistBackendError", "RuntimeError")
            and r.rank == root else None)
        figures = allocator_figures(str(err.get("message") or "")) or (
            allocator_figures(ev.output_tail) if r.status == "oom" else None)
        if what:
            end.update(kind="collective-timeout", detail=what)
        elif r.status == "oom" and (figures or "cuda" in text.lower() or err.get("type") == "OutOfMemoryError"):
            end.update(kind="cuda-oom", detail=_error_line(err) if err else None, figures=figures)
        elif err.get("type") == "MemoryError" or _HOST_OOM.search(str(err.get("message") or "")):
            end.update(kind="host-oom", detail=_error_line(err))
        else:
            end.update(kind="exception", detail=_error_line(err) if err else last_exception_line(ev.output_tail))
    elif r.status == "killed":
        if root is not None and r.rank != root and code in (None, 0):
            end.update(kind="by-launcher", detail=str(root))
        else:
            if end["signal"] is None and code is None:
                end.update(run_exit if run_exit.get("signal") else {})
                if run_exit.get("signal"):
                    end["evidence"] = {"kind": "launcher", "source": "command", "code": ev.returncode}
            kind, evidence = _oom_killer(r, rec, ev, end.get("signal"), peer_rss)
            end["kind"] = kind
            end["oom_evidence"] = evidence
    elif code not in (None, 0):
        end.update(kind="exit-code")
    return end


def _oom_killer(r, rec, ev: Evidence, sig: str | None, peer_rss: int = 0) -> tuple[str, dict]:
    """("oom-killer" or "signal", the evidence either way) for a rank that was killed."""
    counter = None
    if ev.oom_before and ev.oom_after and ev.oom_before.get("file") == ev.oom_after.get("file"):
        counter = {"file": ev.oom_after["file"], "before": ev.oom_before["count"], "after": ev.oom_after["count"]}
    used = _host_use_at_death(r, rec, ev, peer_rss)
    limit = (ev.limit or {}).get("bytes")
    near = bool(used and limit and used >= NEAR_LIMIT * limit)
    evidence = {"counter": counter, "used": used, "limit": limit, "limit_source": (ev.limit or {}).get("source")}
    if sig not in (None, "SIGKILL"):
        return "signal", dict(evidence, kind="not-sigkill")
    if counter and counter["after"] > counter["before"]:
        return "oom-killer", dict(evidence, kind="counter")
    if not counter and near:
        return "oom-killer", dict(evidence, kind="near-limit")
    return "signal", dict(evidence, kind="none")


def _host_use_at_death(r, rec, ev: Evidence, peer_rss: int) -> int | None:
    """Host RSS on the rank's host at the rank's last sample: its own plus the other ranks' there."""
    if rec is None or (r.host and r.host != ev.host):
        return None
    last = rec.samples[-1] if rec.samples else None
    if not last or last[1] is None:
        return None
    return int(last[1]) + int(peer_rss)


def _peer_rss(ranks, records) -> dict:
    """id(rank) -> the RSS of the other ranks on its host at its own last sample (their nearest sample, the
    samplers flush about once a second)."""
    by_host: dict = {}
    for r, rec in zip(ranks, records):
        by_host.setdefault(r.host, []).append((r, rec))
    out = {}
    for items in by_host.values():
        for r, rec in items:
            t = rec.samples[-1][0] if rec.samples else None
            total = 0
            for other, orec in items:
                if other is r or t is None:
                    continue
                near = [s for s in orec.samples if s[1] is not None and abs(s[0] - t) <= PEER_SAMPLE_S]
                total += int(min(near, key=lambda s: abs(s[0] - t))[1]) if near else 0
            out[id(r)] = total
    return out


def refine_status(status: str, ranks) -> str:
    """The run's status once the endings are read: the kernel OOM killer makes it ``oom``; a rank killed by a
    signal (not by the watchdog) with nothing else failing makes it ``killed``."""
    kinds = [(r.ending or {}).get("kind") for r in ranks]
    if status in ("error", "ok") and "oom-killer" in kinds:
        return "oom"
    if status in ("error", "ok") and "signal" in kinds and not any(r.status in ("error", "oom") for r in ranks):
        return "killed"
    return status


# --------------------------------------------------------------------------- rendering

def _t(key: str, lang: str) -> str:
    return pick(TEXT[key], lang)


def _short(path: str) -> str:
    """A cgroup file by its name and version (the whole path is in report.json)."""
    if "/sys/fs/cgroup/" not in path:
        return path
    name = path.rsplit("/", 1)[-1]
    return f"cgroup {'v1' if '/cgroup/memory/' in path else 'v2'} {name}"


def evidence_text(end: dict, lang: str) -> str:
    """The evidence for an ending, in ``lang`` ("" when there is none)."""
    parts = []
    oom = end.get("oom_evidence")
    if oom:
        used, limit = human_bytes(oom.get("used")), human_bytes(oom.get("limit"))
        c = oom.get("counter")
        if oom.get("kind") == "counter":
            parts.append(_t("ev-counter", lang).format(file=_short(c["file"]), before=c["before"], after=c["after"]))
        elif oom.get("kind") == "near-limit":
            pct = round(100 * oom["used"] / oom["limit"])
            parts.append(_t("ev-near", lang).format(used=used, limit=limit, pct=pct,
                                                    source=_short(oom.get("limit_source") or "-")))
        else:
            state = (_t("ev-counter-same", lang).format(file=_short(c["file"]), count=c["after"]) if c
                     else _t("ev-counter-unreadable", lang))
            parts.append(_t("ev-none", lang).format(state=state, used=used, limit=limit))
    ev = end.get("evidence") or {}
    if ev.get("kind") == "launcher":
        who = {"returncode": "src-command", "command": "src-command", "deepspeed": "src-deepspeed"}.get(
            ev.get("source"), "src-torchrun")
        parts.insert(0, _t("ev-launcher", lang).format(source=_t(who, lang), code=ev.get("code")))
    elif ev.get("kind") == "progress":
        key = {True: "ev-working", False: "ev-still"}.get(ev.get("working"), "ev-unknown")
        cpu = "-" if ev.get("cpu_s") is None else f"{ev['cpu_s']:.2f}"
        parts.append(_t(key, lang).format(cpu=cpu, window=f"{ev.get('window_s') or 0:.1f}"))
    figures = end.get("figures")
    if figures:
        parts.append(_t("ev-allocator", lang).format(
            tried=human_bytes(figures["tried"]), free=human_bytes(figures["free"]),
            total=human_bytes(figures["total"]), allocated=human_bytes(figures["allocated"]),
            unallocated=human_bytes(figures["unallocated"])))
    return "; ".join(parts)


def ending_text(end: dict | None, lang: str = "en") -> str:
    """One line: how the rank ended, where ("killed by SIGKILL in init")."""
    if not end:
        return "-"
    kind = end.get("kind") or "finished"
    sig = end.get("signal") or _t("unknown-signal", lang)
    what = _t(kind, lang).format(signal=sig, code=end.get("exit_code"), detail=end.get("detail") or "-",
                                 root=end.get("detail") or "?")
    phase = end.get("phase")
    if kind == "finished" or not phase:
        return what
    key = "where-at" if phase.startswith(("after ", "before ")) else "where"
    return _t(key, lang).format(what=what, phase=phase)
