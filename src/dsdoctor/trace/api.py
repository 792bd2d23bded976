"""Library entry points: ``trace`` and ``ab`` take plain values and return result objects.

    from dsdoctor.api import trace, ab
    result = trace(["deepspeed", "--num_gpus", "2", "infer.py"], out="trace-out", timeout=900)
    print(result.status, result.ranks[0].peak_gpu_bytes, [f.code for f in result.findings])
"""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from dsdoctor import door
from dsdoctor.errors import InputError
from dsdoctor.report.render import write_report
from dsdoctor.trace import ending, multinode
from dsdoctor.trace.diagnose_ab import AbResult, VariantResult, diagnose, not_applied
from dsdoctor.trace.end_state import end_state_variants
from dsdoctor.trace.launch import run_command
from dsdoctor.trace.loop_rules import follow_measurement
from dsdoctor.trace.records import read_records
from dsdoctor.trace.report import TraceResult, run_status, summarize_rank
from dsdoctor.trace.run_rules import trace_findings
from dsdoctor.trace.variants import parse_variants


def _check(command, timeout) -> list[str]:
    command = [str(c) for c in (command or [])]
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise InputError("no command given", hint="put the command after --, e.g. dsdoctor trace -- python infer.py")
    if shutil.which(command[0]) is None:
        raise InputError(f"command not found: {command[0]}", hint="is it on PATH (an activated environment)?")
    if timeout is not None and not timeout > 0:
        raise InputError(f"--timeout must be a positive number of seconds, not {timeout}")
    return command


def _trace_into(directory: Path, command: list[str], variant: str | None, timeout: float | None, echo,
                lang: str, final_dir: str | None) -> TraceResult:
    outcome = run_command(command, directory / "records", variant=variant, timeout=timeout,
                          log_path=directory / "output.log", echo=echo)
    records = read_records(directory / "records")
    ranks = [summarize_rank(r, outcome.timed_out) for r in records]
    evidence = ending.Evidence.of(outcome)
    ending.apply_progress(ranks, evidence.progress)
    status = run_status(ranks, outcome.returncode, outcome.timed_out, outcome.output_tail)
    ending.describe(ranks, records, evidence)
    status = ending.refine_status(status, ranks)
    log = f"{final_dir}/output.log" if final_dir else None
    findings = trace_findings(ranks, records, status, outcome.returncode, timeout, log, outcome.output_tail,
                              timed_out=outcome.timed_out)
    result = TraceResult(command=command, status=status, returncode=outcome.returncode, wall_s=outcome.wall_s,
                         timeout=timeout, ranks=ranks, findings=findings, variant=variant, out_dir=final_dir, log=log,
                         output_tail=outcome.output_tail)
    if final_dir:
        from dsdoctor.trace.plot import write_timelines

        try:
            write_timelines(result, directory)
        except Exception as exc:  # a picture must not cost the report
            print(f"dsdoctor: timeline picture skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
        write_report(result, directory, lang)
    return result


def trace(command: list[str], out: str | None = None, timeout: float | None = None, force: bool = False,
          echo=None, lang: str = "en") -> TraceResult:
    """Run ``command`` with every rank observed; write ``out``/report.json, report.md and timelines.

    ``echo``: a stream for the command's output (default stderr), or False to keep it only in output.log."""
    command = _check(command, timeout)
    nodes = multinode.nodes_of(command) if out is not None else None
    if nodes:  # one agent of a multi-node torchrun: a shared DIR, node-K/ each, node 0 writes the report
        return multinode.trace_node(command, str(out), nodes[0], nodes[1], timeout, force, echo, lang)
    if out is None:
        with door.scratch_dir("dsdoctor-trace-") as tmp:
            return _trace_into(tmp, command, None, timeout, echo, lang, None)
    with door.atomic_output_dir(out, force=force, command="trace") as tmp:
        return _trace_into(tmp, command, None, timeout, echo, lang, str(out))


def report_only(out: str, lang: str = "en", force: bool = False) -> TraceResult:
    """Rebuild the whole report of a multi-node trace from every ``out/node-K`` there is (``force``: replace
    the report files an earlier run wrote there)."""
    return multinode.report_only(str(out), lang=lang, force=force)


def _dirname(variant: str) -> str:
    return re.sub(r"[^\w.=+-]", "_", variant)


def ab(command: list[str], variants: str | list[str] | None = None, out: str | None = None,
       timeout: float | None = None, force: bool = False, echo=None, lang: str = "en") -> AbResult:
    """Run ``command`` once per variant (config rewritten in-process) and diagnose the differences."""
    command = _check(command, timeout)
    chosen = parse_variants(variants)

    def run_all(directory: Path, final: str | None) -> AbResult:
        results, as_is_findings, stop = [], [], None
        queue = list(chosen)
        n = 0
        while n < len(queue):
            v = queue[n]
            n += 1
            print(f"dsdoctor ab: variant {n}/{len(queue)}: {v.name} ({v.description})", file=sys.stderr, flush=True)
            sub = _dirname(v.name)
            t = _trace_into(directory / sub, command, v.name, timeout, echo, lang,
                            f"{final}/{sub}" if final else None)
            results.append(VariantResult.from_trace(v.name, v.description, t, f"{sub}/report.json" if final else None))
            print(f"dsdoctor ab: variant {v.name}: {t.status}", file=sys.stderr, flush=True)
            if v.name == "as-is":  # the run as the user runs it: its findings are the user's problems
                as_is_findings = t.findings
                if variants is None and any(r.loop for r in t.ranks):
                    # generation inside training: the inference variants do not apply, gather-once does
                    queue[n:] = parse_variants("gather-once")
                    print("dsdoctor ab: the run trains between generates; next variant: gather-once",
                          file=sys.stderr, flush=True)
            following = [w.name for w in queue[n:]]
            stop = not_applied(v.name, t, following, [r.name for r in results])
            if stop is not None:
                print(f"dsdoctor ab: {stop.message('en')}", file=sys.stderr, flush=True)
                break
            if variants is None and n == len(queue):  # the seed's end state, when plan says it fits
                extra = end_state_variants(results, [w.name for w in queue])
                queue += parse_variants(extra) if extra else []
        findings = [stop] if stop is not None else diagnose(results)
        as_is_findings = follow_measurement(findings, as_is_findings)  # trace's advice yields to ab's measurement
        result = AbResult(command=command, variants=results, findings=findings + as_is_findings, out_dir=final)
        if final:
            write_report(result, directory, lang)
        return result

    if out is None:
        with door.scratch_dir("dsdoctor-ab-") as tmp:
            return run_all(tmp, None)
    with door.atomic_output_dir(out, force=force, command="ab") as tmp:
        return run_all(tmp, str(out))
