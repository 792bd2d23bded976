"""``dsdoctor diagnose``: the whole troubleshooting, in the order an expert does it.

1. effective   what stage and offloads take effect (check; trace when a command is given)
2. need-zero3  does this inference need ZeRO-3 at all, and which load path fits fastest (plan)
3. split       the inference config, written
4. ab          the peak with and without offload_param (ab; only with a command to run)
5. exit        merge and load plainly, tensor parallel xor ZeRO-3, or ZeRO-3 with offload_param; then compare

Each step is a ``Step``; the report (Markdown, HTML with the plots, JSON) is rendered from them. A step that
cannot run says why and what command would run it, instead of failing the whole diagnosis.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dsdoctor import door
from dsdoctor.diagnose_exit import _current, _measured_exit, _planned_exit, _summary
from dsdoctor.diagnose_inputs import (
    Captured,
    Inputs,
    Run,
    _given_sources,
    _inputs,
    _load,
    _no_config_reason,
    command_flags,
)
from dsdoctor.diagnose_step import SKIPPED, STEP_TITLES, SUMMARY, TEXT, Step, _details, _shell, _skipped, _with_inputs
from dsdoctor.errors import InputError
from dsdoctor.findings import Finding, Phrase, exit_code, sort_findings
from dsdoctor.i18n import LANGS, fill, pick
from dsdoctor.report.render import Style, findings_markdown, findings_text, write_report
from dsdoctor.report.summary import Summary
from dsdoctor.units import human_bytes


@dataclass
class DiagnoseResult:
    config: str
    model: str
    out: str
    steps: list[Step]
    recommended_path: str | None
    lang: str = "en"
    # where each input came from: "bundled example", "given", "captured from <api> ...", or "none"
    sources: dict = field(default_factory=dict)
    summary: Summary | None = None  # the answer the report leads with (report/summary.py)

    @property
    def findings(self) -> list[Finding]:
        seen, out = set(), []
        for step in self.steps:
            for f in step.findings:
                key = (f.code, f.message("en"))
                if key not in seen:
                    seen.add(key)
                    out.append(f)
        return out

    def to_dict(self, lang: str = "en") -> dict:
        return {
            "config": self.config, "model": self.model, "out": self.out, "sources": self.sources,
            "recommended_path": self.recommended_path,
            "summary": self.summary.to_dict(lang) if self.summary else None,
            "report": {"markdown": str(Path(self.out) / "report.md"), "html": str(Path(self.out) / "report.html")},
            "steps": [s.to_dict(lang) for s in self.steps],
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)],
        }

    def to_text(self, lang: str = "en", style: Style | None = None) -> str:
        style = style or Style()
        glyph = {"done": style.ok, "skipped": "-", "failed": style.error}
        lines = [self._inputs_line(lang)]
        if self.sources.get("config") == "bundled example":
            lines.append(pick(TEXT["bundled note"], lang))
        lines.append("")
        if self.summary:
            lines += [self.summary.to_text(lang)]
        for s in self.steps:
            lines.append(f"{glyph[s.status]} {pick(STEP_TITLES[s.key], lang)}")
            lines.append("    " + (s.summary.get(lang) or s.summary["en"]))
            lines += [f"    $ {c}" for c in s.commands[:3]]
            code = (s.data or {}).get("code") if s.key == "exit" else None
            if code:
                lines += ["      " + x for x in code.rstrip().splitlines() if not x.startswith("#")]
        lines.append("")
        lines.append(findings_text(self.findings, lang, style).rstrip())
        lines.append(f"{pick(TEXT['report'], lang)}: {Path(self.out) / 'report.html'}  ({Path(self.out) / 'report.md'})")
        return "\n".join(lines) + "\n"

    def to_markdown(self, lang: str = "en") -> str:
        """The answer first (the summary box), then the steps: each finding once (under the first step that
        found it), each step's full tables folded under <details>."""
        parts = [f"# {pick(TEXT['title'], lang)}\n"]
        if self.summary:
            parts.append(self.summary.to_markdown(lang))
        parts.append(self._inputs_markdown(lang))
        if self.recommended_path and not self.summary:
            parts.append(f"**{pick(TEXT['recommended'], lang)}: `{self.recommended_path}`**\n")
        shown: set = set()
        for s in self.steps:
            parts.append(f"## {pick(STEP_TITLES[s.key], lang)}\n")
            parts.append((s.summary.get(lang) or s.summary["en"]) + "\n")
            if s.commands:
                parts.append("```bash\n" + "\n".join(s.commands) + "\n```\n")
            code = (s.data or {}).get("code") if s.key == "exit" else None
            if code:
                parts.append("```python\n" + code.rstrip() + "\n```\n")
            for a in s.artifacts:
                if a.endswith(".png"):
                    parts.append(f"![{a}]({a})\n")
            new = [f for f in s.findings if (f.code, f.message("en")) not in shown]
            shown.update((f.code, f.message("en")) for f in new)
            if new:
                parts.append(findings_markdown(new, lang))
            if s.details_md:
                title = pick(TEXT["details"], lang).format(step=pick(STEP_TITLES[s.key], lang))
                parts.append(f"<details><summary>{title}</summary>\n\n{s.details_md.rstrip()}\n\n</details>\n")
        return "\n".join(parts)

    def _source(self, key: str, lang: str) -> str:
        src = self.sources.get(key) or "given"
        if src == "bundled example":
            return pick(TEXT["bundled"], lang)
        return src

    def _inputs_line(self, lang: str) -> str:
        cfg, model = self._source("config", lang), self._source("model", lang)
        return pick(TEXT["inputs"], lang).format(config=self.config, cfg=cfg, model=self.model, model_src=model)

    def _inputs_markdown(self, lang: str) -> str:
        rows = [("config", self.config, self._source("config", lang)),
                ("model", self.model, self._source("model", lang))]
        if self.sources.get("workload"):
            rows.append(("workload", self.sources["workload"], ""))
        out = "".join(f"- {k}: `{v}`" + (f" ({src})" if src else "") + "\n" for k, v, src in rows)
        if self.sources.get("config") == "bundled example":
            out += f"\n{pick(TEXT['bundled note markdown'], lang)}\n"
        return out


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _step_effective(config, model, gpus, lang) -> tuple[Step, object]:
    from dsdoctor.config.check import check

    result = check(config, mode="inference", model=model, gpus=gpus)
    eff = result.effective
    stage, op, oo = eff.zero_stage, eff.offload_param.device, eff.offload_optimizer.device
    summary = fill(SUMMARY["effective"], stage=stage, op=op, oo=oo, optimizer=eff.optimizer_type or TEXT["none"],
                   n=len(result.findings))
    step = Step("effective", "done", summary, list(result.findings), _details(result, lang),
                data=result.to_dict(lang).get("effective", {}))
    return step, result


def _step_plan(model, config, gpus, gpu_memory, host_memory, batch, prompt_len, new_tokens, dtype, tmp: Path,
               lang, machine=None) -> tuple[Step, object]:
    from dsdoctor.plan.api import plan

    result = plan(model, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, dtype=dtype, gpus=gpus,
                  gpu_memory=gpu_memory, host_memory=host_memory, config=config, machine=machine)
    rec = result.recommended
    artifacts = []
    try:
        from dsdoctor.plan.plot import write_plots

        write_plots(result, tmp / "plan", lang=lang)
        artifacts = ["plan/plan.png", "plan/plan.html"]
    except ImportError:  # matplotlib missing: the report still has the tables
        pass
    why = rec.why.get(lang) or rec.why.get("en") or ""
    chosen = result.path(rec.path) if rec.path else None
    needs_zero3 = bool(rec.path and rec.path.startswith("zero3"))
    if chosen is None:
        summary = fill(SUMMARY["no path fits"], why=why)
    else:
        # one tokens/s figure everywhere: the machine's (replicas x per rank), as plan's reason says it
        summary = fill(SUMMARY["fastest path edge" if chosen.verdict == "edge" else "fastest path"],
                       answer=TEXT["yes" if needs_zero3 else "no"], path=rec.path, why=rec.why)
    step = Step("need-zero3", "done", summary, list(result.findings), _details(result, lang),
                data={"recommended": rec.to_dict(lang), "needs_zero3": needs_zero3,
                      "verdict": chosen.verdict if chosen else None}, artifacts=artifacts)
    return step, result


def _step_split(config, model, tmp: Path, out: Path, lang, dtype: str | None = None) -> Step:
    from dsdoctor.config.split import split

    result = split(config, tmp / "ds_inference.json", model=model, dtype=dtype)  # plan's dtype: the code's
    n = len(result.changes)
    final = out / "ds_inference.json"
    summary = fill(SUMMARY["split" if n else "split nothing"], final=final, n=n)
    details = _details(result, lang)
    return Step("split", "done", summary, list(result.findings), details,
                data={"changes": n, "config": result.config}, artifacts=["ds_inference.json"])


def _step_trace(command, tmp: Path, timeout, lang, out: Path | None = None) -> tuple[Step, object]:
    from dsdoctor.trace.api import trace

    result = trace(command, out=tmp / "trace", timeout=timeout)
    if out is not None:  # paths in findings name the report directory, not the one being written
        for f in result.findings:
            for key, value in f.values.items():
                if isinstance(value, str) and str(tmp) in value:
                    f.values[key] = value.replace(str(tmp), str(out))
    seen = ", ".join(
        f"rank {r.rank}: stage {r.zero_stage}, optimizer {r.optimizer or 'none'}, "
        f"peak GPU {human_bytes(r.peak_gpu_bytes)}, peak host {human_bytes(r.peak_host_bytes)}"
        for r in result.ranks[:4]
    ) or "no rank reported"
    summary = fill(SUMMARY["trace"], command=_shell(command), status=result.status, seen=seen)
    artifacts = sorted(str(p.relative_to(tmp)) for p in (tmp / "trace").glob("*.png"))
    return Step("effective", "done", summary, list(result.findings), _details(result, lang),
                data={"trace": result.to_dict(lang)}, artifacts=artifacts), result


def _step_ab(command, tmp: Path, timeout, lang) -> tuple[Step, object]:
    from dsdoctor.trace.api import ab

    result = ab(command, out=tmp / "ab", timeout=timeout)
    n, diag = len(result.variants), result.diagnosis
    summary = fill(SUMMARY["ab"], n=n, diagnosis={x: diag.message(x) for x in LANGS} if diag
                   else TEXT["no diagnosis"])
    return Step("ab", "done", summary, list(result.findings), _details(result, lang),
                data={"ab": result.to_dict(lang)}, commands=[diag.fix(lang)] if diag else []), result


def _final_paths(steps: list[Step], tmp: Path, out: Path) -> None:
    """The report names the files where they will be (``out``), never the folder it is being built in."""
    def fix(value):
        if isinstance(value, str):
            return value.replace(str(tmp), str(out))
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, Phrase):
            return Phrase(value.key, fix(value.values))
        return value

    for step in steps:
        step.details_md, step.summary = fix(step.details_md), fix(step.summary)
        step.commands, step.data = fix(step.commands), fix(step.data)
        for f in step.findings:
            f.values = {k: fix(v) for k, v in f.values.items()}


def _run_command(command, tmp: Path, timeout, lang, out: Path) -> Run:
    """Trace the command; run ab when there is a GPU, or when the run failed (a failed run is evidence: ab finds
    the variant that runs, and that variant's trace says the model and workload the failed run never reached)."""
    trace_step, traced = _step_trace(command, tmp, timeout, lang, out)
    run = Run(Captured.from_trace(traced, tmp), trace_step, traced)
    if _cuda_available() or traced.status != "ok":
        run.ab_step, run.ab_result = _step_ab(command, tmp, timeout, lang)
        run.captured.add_variant(run.ab_result, tmp)
    run.captured.flags = command_flags(command)
    return run


def _plan_or_skip(inputs: Inputs, gpu_memory, host_memory, tmp: Path, lang, machine, captured) -> tuple:
    """Step 2: plan for the inputs, or why it cannot."""
    if inputs.model is None:
        if captured is not None and captured.model_dir is not None:  # captured, but not a model plan can take
            return _skipped("need-zero3", fill(SKIPPED["run's model"], model=inputs.sources["model"])), None
        return _skipped("need-zero3", SKIPPED["no model"]), None
    b, p, n, _ = inputs.workload
    try:
        step, result = _step_plan(inputs.model, inputs.loaded, inputs.gpus, gpu_memory, host_memory, b, p, n,
                                  inputs.dtype, tmp, lang, machine)
    except InputError as exc:
        if inputs.sources["model"] == "given":
            raise
        return _skipped("need-zero3", fill(SKIPPED["plan failed"], problem=exc.problem)), None
    step.summary = _with_inputs(step.summary, inputs.sources)
    step.data["inputs"] = {k: inputs.sources.get(k) for k in ("model", "dtype", "workload")}
    return step, result


def diagnose(config=None, model=None, gpus: int | None = None, gpu_memory=None, host_memory=None,
             batch: int | None = None, prompt_len: int | None = None, new_tokens: int | None = None,
             dtype: str | None = None, checkpoint=None, command: list[str] | None = None, out="dsdoctor-out",
             force: bool = False, timeout: float | None = None, lang: str = "en",
             machine=None) -> DiagnoseResult:
    """Run the troubleshooting and write ``out/report.{md,html,json}`` plus the split inference config.

    With a ``command`` it reports on that run: what the run handed to DeepSpeed (the config captured at
    deepspeed.initialize / HfDeepSpeedConfig), the model it built and the batch and lengths it generated with
    stand in for ``config``, ``model`` and the workload wherever those are not given; when the run failed before
    building the model or generating, ab's variant that ran, then the command's own flags (--model, --batch,
    --prompt-len, --new-tokens, --dtype) say them. Without a command, ``config`` and ``model`` are needed; with
    neither (and no command) it runs on the bundled example (a ZeRO-3 offload training config reused for
    inference, and a 7B Llama-shaped config.json), and says so."""
    config, model, sources = _given_sources(command, config, model)
    out = Path(out)
    # read once: check, plan and split share it (and its effective readings); a captured one is read below
    loaded = _load(config) if config is not None else None
    with door.atomic_output_dir(out, force=force, inputs=[config, model, checkpoint], command="diagnose") as tmp:
        if model is not None and command:
            # plan before running anything: bad workload flags must fail before the user's command has run
            from dsdoctor.plan.api import plan

            plan(model, batch=batch or 1, prompt_len=prompt_len or 1, new_tokens=new_tokens or 1, dtype=dtype,
                 gpus=gpus, gpu_memory=gpu_memory, host_memory=host_memory, config=loaded)  # only flags given
        run = _run_command(command, tmp, timeout, lang, out) if command else None
        inputs = _inputs(config, loaded, model, gpus, dtype, (batch, prompt_len, new_tokens), run, sources)
        steps, plan_result, path, current = _steps(inputs, run, command, checkpoint, gpu_memory, host_memory,
                                                   tmp, out, lang, machine)
        _final_paths(steps, tmp, out)
        summary = _summary(steps, plan_result, path, current, run.traced if run else None,
                           run.ab_result if run else None, command, checkpoint)
        result = DiagnoseResult(*_shown(inputs, run, out), str(out), steps, path, lang, inputs.sources, summary)
        write_report(result, tmp, lang, html_title="dsdoctor diagnosis")
    return result


def _shown(inputs: Inputs, run: Run | None, out: Path) -> tuple[str, str]:
    """The config and model the report names: where they will be (``out``) when the run handed them over."""
    captured = run.captured if run is not None else None
    shown_model = out / "model" if captured is not None and captured.model_dir is not None and \
        inputs.model == captured.model_dir else inputs.model
    shown_config = inputs.config if not isinstance(inputs.config, dict) else out / "ds_config_captured.json"
    return (str(shown_config) if shown_config is not None else "none",
            str(shown_model) if shown_model is not None else "none")


def _steps(inputs: Inputs, run: Run | None, command, checkpoint, gpu_memory, host_memory, tmp: Path, out: Path,
           lang, machine) -> tuple:
    """The five steps in order: (steps, plan result, the path of the way out, the path the user's setup is)."""
    captured = run.captured if run is not None else None
    check_result = None
    if inputs.config is not None:
        step, check_result = _step_effective(inputs.loaded, inputs.model, inputs.gpus, lang)
    else:
        step = _skipped("effective", _no_config_reason(captured))
    steps = [step] + ([run.trace_step] if run is not None else [])
    plan_step, plan_result = _plan_or_skip(inputs, gpu_memory, host_memory, tmp, lang, machine, captured)
    steps.append(plan_step)
    split_step = _split_or_skip(inputs, check_result, captured, tmp, out, lang,
                                plan_result.run_dtype if plan_result is not None else None)
    steps.append(split_step)
    if run is not None and run.ab_step is not None:
        steps.append(run.ab_step)
    else:
        shell = f"dsdoctor ab --out ab -- {_shell(command) if command else 'python your_infer.py'}"
        steps.append(_skipped("ab", SKIPPED["no gpu" if command else "no command"], commands=[shell]))
    path = plan_result.recommended.path if plan_result is not None else None
    current = _current(check_result, captured)
    if plan_result is not None:
        steps.append(_planned_exit(inputs, plan_result, path, current, captured, checkpoint, split_step, tmp, out,
                                   lang))
    else:
        steps.append(_measured_exit(run.ab_result if run else None, inputs, tmp, out))
    return steps, plan_result, path, current


def _split_or_skip(inputs: Inputs, check_result, captured, tmp: Path, out: Path, lang, dtype=None) -> Step:
    inference_cfg = check_result.inference_config if check_result is not None else None
    if inputs.config is not None and (inference_cfg is None or inference_cfg.zero):
        return _step_split(inputs.loaded, inputs.model, tmp, out, lang, dtype)  # plan's dtype: the code's
    if inputs.config is not None:  # an init_inference config without a ZeRO section: nothing to split
        return _skipped("split", fill(SKIPPED["init_inference config"], tp=inference_cfg.tp_size))
    return _skipped("split", _no_config_reason(captured))


def diagnose_exit_code(result: DiagnoseResult, fail_on: str) -> int:
    return exit_code(result.findings, fail_on)


