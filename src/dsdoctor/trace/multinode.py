"""Tracing a run whose nodes are started one agent per node (``torchrun --nnodes N --node-rank K``).

Each node runs its own ``dsdoctor trace -o DIR -- torchrun --nnodes N --node-rank K ...`` with ``DIR`` on a
filesystem every node can write. Nothing one node writes can clobber another's:

    DIR/node-K/records/      the ranks of node K (rank-R.HOST.PID.jsonl)
    DIR/node-K/output.log    node K's launcher output
    DIR/node-K/done.json     written last, atomically: node K's launcher ended (exit code, wall time)
    DIR/report.json, .md     the whole run, written by node 0 only
    DIR/node-K/report.json   node K's own ranks (K > 0)

Node 0 waits (up to ``wait_s``) for every node's ``done.json``, then reads every node's records into one
report. Another node reports only its own ranks, in its own directory. ``report_only(DIR)`` rebuilds the whole report from what
is there (``dsdoctor trace --report-only DIR``), e.g. when node 0 stopped waiting before a slow node ended.

What may be replaced (``dsdoctor.door``): ``DIR`` is never replaced as a whole (it gets dsdoctor's marker
when new or empty); ``DIR/node-K`` only with ``--force`` and only when its marker shows dsdoctor wrote
everything in it; the report files in ``DIR`` only with ``--force`` (also with ``--report-only``) and only
those ``DIR``'s marker lists as dsdoctor's, unchanged since. Both are checked before the run starts.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

from dsdoctor import door
from dsdoctor.errors import InputError
from dsdoctor.report.render import to_json
from dsdoctor.trace import ending
from dsdoctor.trace.launch import run_command
from dsdoctor.trace.records import RankRecord, read_records
from dsdoctor.trace.report import TraceResult, run_status, summarize_rank
from dsdoctor.trace.run_rules import trace_findings

_TORCHRUN = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
DEFAULT_WAIT_S = 600.0
TAIL_CHARS = 20000  # of a node's output.log, for --report-only
REPORT_FILES = re.compile(r"^(report\.(json|md)|timeline\.html|timeline-rank-\d+\.png)$")  # what node 0 writes in DIR


def _flag(command: list[str], names: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(command):
        for name in names:
            if arg == name and i + 1 < len(command):
                return command[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def nodes_of(command: list[str]) -> tuple[int, int] | None:
    """(nnodes, node_rank) of a torchrun command started on one node of several; None otherwise."""
    if not any(any(t in part for t in _TORCHRUN) for part in command[:3]):
        return None
    script = next((i for i, a in enumerate(command) if a.endswith(".py") and "torch" not in a), len(command))
    launcher = command[:script]  # the script's own flags are not the launcher's
    nnodes = _flag(launcher, ("--nnodes",))
    if nnodes is None:
        return None
    try:
        count = max(int(x) for x in nnodes.split(":"))
    except ValueError:
        raise InputError(f"cannot read --nnodes {nnodes!r} of the torchrun command") from None
    if count < 2:
        return None
    rank = _flag(launcher, ("--node-rank", "--node_rank"))
    if rank is None:
        raise InputError("a multi-node torchrun command needs --node-rank K for dsdoctor trace to keep the nodes "
                         "apart", hint="add --node-rank 0 on the first node, --node-rank 1 on the next, ...")
    try:
        node = int(rank)
    except ValueError:
        raise InputError(f"cannot read --node-rank {rank!r} of the torchrun command") from None
    if not 0 <= node < count:
        raise InputError(f"--node-rank {node} is outside 0..{count - 1}")
    return count, node


def _node_dir(out: Path, node: int) -> Path:
    return out / f"node-{node}"


def _existing_reports(root: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(root) if REPORT_FILES.match(n))
    except OSError:
        return []


def trace_node(command: list[str], out: str, nnodes: int, node: int, timeout: float | None, force: bool, echo,
               lang: str, wait_s: float | None = None) -> TraceResult:
    root = door.shared_root(out, command="trace (multi-node)")
    if node == 0:  # the report files it will replace at the end: refused now, not after the run
        door.check_publish(root, _existing_reports(root), force)
    mine = _node_dir(root, node)
    with door.live_output_dir(mine, force=force, command=f"trace (node {node} of {nnodes})"):
        outcome = run_command(command, mine / "records", timeout=timeout, log_path=mine / "output.log", echo=echo)
        door.write_record(mine / "done.json", json.dumps({
            "node_rank": node, "nnodes": nnodes, "host": socket.gethostname(), "returncode": outcome.returncode,
            "timed_out": outcome.timed_out, "wall_s": outcome.wall_s, "command": command}))
        if node != 0:  # its own ranks, in its own directory
            return _result(mine, [mine], lang, tail=outcome.output_tail, timeout=timeout, command=command)
    limit = wait_s if wait_s is not None else (timeout or DEFAULT_WAIT_S)
    waited = _wait_for_nodes(root, nnodes, limit)
    if waited:
        print(f"dsdoctor trace: node(s) {', '.join(map(str, waited))} did not finish within {limit:g}s; reporting "
              f"what is there (later: dsdoctor trace --report-only --force {out})", file=sys.stderr, flush=True)
    return _result(root, [_node_dir(root, k) for k in range(nnodes)], lang, tail=outcome.output_tail,
                   timeout=timeout, command=command, publish=True, force=force)


def _wait_for_nodes(root: Path, nnodes: int, limit: float) -> list[int]:
    deadline = time.time() + limit
    said = False
    while True:
        missing = [k for k in range(nnodes) if not (_node_dir(root, k) / "done.json").is_file()]
        if not missing or time.time() >= deadline:
            return missing
        if not said:
            print(f"dsdoctor trace: waiting for node(s) {', '.join(map(str, missing))} to finish", file=sys.stderr,
                  flush=True)
            said = True
        time.sleep(1.0)


def _read_done(node_dir: Path) -> dict | None:
    try:
        done = door.read_json(node_dir / "done.json", door.NODE_RECORD)
    except InputError:
        return None
    return done if isinstance(done, dict) else None


def _records(dirs: list[Path]) -> list[RankRecord]:
    out: list[RankRecord] = []
    for d in dirs:
        if (d / "records").is_dir():
            out += read_records(d / "records")
    return sorted(out, key=lambda r: (r.rank, r.t0 or 0))


def _result(dest: Path, dirs: list[Path], lang: str, tail: str, timeout: float | None,
            command: list[str] | None, publish: bool = False, force: bool = False) -> TraceResult:
    """The report over the ranks in ``dirs``, written into ``dest`` (report.json, report.md, timelines): a
    node's own folder, or (``publish``) the shared folder, where the files replace an earlier report only
    with ``force`` (``door.publish_into``)."""
    dones = [(d, _read_done(d)) for d in dirs]
    timed_out = any(x and x.get("timed_out") for _, x in dones)
    missing = [d.name for d, x in dones if x is None]
    codes = [x.get("returncode") for _, x in dones if x]
    returncode = next((c for c in codes if c not in (0, None)), codes[0] if codes else None)
    if command is None:
        command = next((x.get("command") for _, x in dones if x and x.get("node_rank") == 0), None) or \
            next((x.get("command") for _, x in dones if x), ["?"])
    records = _records(dirs)
    # a node that never wrote done.json is still running or died: its ranks did not exit, so they read as killed
    ranks = [summarize_rank(r, timed_out) for r in records]
    status = run_status(ranks, returncode, timed_out, tail)
    ending.describe(ranks, records, ending.Evidence(returncode, timed_out, tail))
    status = ending.refine_status(status, ranks)
    if missing and status == "ok":
        status = "error"
    final = str(dest)
    log = str(dirs[0] / "output.log")
    findings = trace_findings(ranks, records, status, returncode, timeout, log, tail)
    wall = max((x.get("wall_s") or 0 for _, x in dones if x), default=0.0)
    result = TraceResult(command=list(command), status=status, returncode=returncode, wall_s=wall, timeout=timeout,
                         ranks=ranks, findings=findings, variant=None, out_dir=final, log=log, output_tail=tail)
    result.nodes = {d.name: (x or {"missing": True}) for d, x in dones}
    if publish:
        with door.publish_into(dest, force, command="trace") as staging:
            _write_report(result, staging, lang)
    else:
        _write_report(result, dest, lang)
    return result


def _write_report(result: TraceResult, directory: Path, lang: str) -> None:
    from dsdoctor.trace.plot import write_timelines

    try:
        write_timelines(result, directory)
    except Exception as exc:  # a picture must not cost the report
        print(f"dsdoctor: timeline picture skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
    data = result.to_dict(lang)
    data["nodes"] = result.nodes
    door.write_new(directory / "report.json", to_json(data))
    door.write_new(directory / "report.md", result.to_markdown(lang))


def report_only(out: str, lang: str = "en", timeout: float | None = None, force: bool = False) -> TraceResult:
    """The whole report again from every ``DIR/node-*`` there is (plus a single-node ``DIR/records``); the
    report files of an earlier run are replaced only with ``force``."""
    root = Path(out)
    if not root.is_dir():
        raise InputError("is not a trace directory", path=root)
    dirs = sorted((p for p in root.glob("node-*") if p.is_dir()), key=lambda p: _node_number(p.name))
    if not dirs:
        raise InputError("holds no node-K directories of a multi-node trace", path=root,
                         hint="run dsdoctor trace -o DIR -- torchrun --nnodes N --node-rank K ... on every node")
    door.check_publish(root, _existing_reports(root), force)
    tail = ""
    log = dirs[0] / "output.log"
    if log.is_file():
        tail = door.read_tail(log, 4 * TAIL_CHARS + 4, door.RUN_LOG)[-TAIL_CHARS:]
    return _result(root, dirs, lang, tail=tail, timeout=timeout, command=None, publish=True, force=force)


def _node_number(name: str) -> int:
    try:
        return int(name.split("-", 1)[1])
    except (IndexError, ValueError):
        return 1 << 30
