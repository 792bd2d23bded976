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

import shlex
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dsdoctor import door
from dsdoctor.dtypes import normalize_dtype
from dsdoctor.errors import InputError
from dsdoctor.findings import Finding, exit_code, sort_findings
from dsdoctor.i18n import LANGS, fill, message_table, pick
from dsdoctor.report.render import Style, findings_markdown, findings_text, to_json, write_report
from dsdoctor.units import human_bytes

# the texts live in dsdoctor/messages.json
STEP_TITLES = message_table("diagnose.STEP_TITLES")
TEXT = message_table("diagnose.TEXT")
SUMMARY = message_table("diagnose.SUMMARY")  # what each step found, per situation
SKIPPED = message_table("diagnose.SKIPPED")  # why a step was skipped


def bundled_example() -> tuple[Path, Path]:
    """The bundled training ZeRO-3 offload config and 7B Llama-shaped config.json."""
    root = Path(str(resources.files("dsdoctor") / "examples"))
    return root / "train_zero3_offload.json", root / "llama-7b"


@dataclass
class Step:
    key: str
    status: str  # done, skipped, failed
    summary: dict[str, str]  # lang -> one paragraph
    findings: list[Finding] = field(default_factory=list)
    details_md: str = ""  # Markdown of the underlying result
    data: dict = field(default_factory=dict)
    artifacts: list[str] = field(default_factory=list)  # files written, relative to the report directory
    commands: list[str] = field(default_factory=list)  # what to run next

    def to_dict(self, lang: str) -> dict:
        return {
            "step": self.key, "status": self.status, "summary": self.summary.get(lang) or self.summary["en"],
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)], "data": self.data,
            "artifacts": self.artifacts, "commands": self.commands,
        }


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
        for s in self.steps:
            lines.append(f"{glyph[s.status]} {pick(STEP_TITLES[s.key], lang)}")
            lines.append("    " + (s.summary.get(lang) or s.summary["en"]))
            lines += [f"    $ {c}" for c in s.commands[:3]]
        lines.append("")
        lines.append(findings_text(self.findings, lang, style).rstrip())
        lines.append(f"{pick(TEXT['report'], lang)}: {Path(self.out) / 'report.html'}  ({Path(self.out) / 'report.md'})")
        return "\n".join(lines) + "\n"

    def to_markdown(self, lang: str = "en") -> str:
        parts = [f"# {pick(TEXT['title'], lang)}\n", self._inputs_markdown(lang)]
        if self.recommended_path:
            parts.append(f"**{pick(TEXT['recommended'], lang)}: `{self.recommended_path}`**\n")
        for s in self.steps:
            parts.append(f"## {pick(STEP_TITLES[s.key], lang)}\n")
            parts.append((s.summary.get(lang) or s.summary["en"]) + "\n")
            if s.commands:
                parts.append("```bash\n" + "\n".join(s.commands) + "\n```\n")
            for a in s.artifacts:
                if a.endswith(".png"):
                    parts.append(f"![{a}]({a})\n")
            if s.findings:
                parts.append(findings_markdown(s.findings, lang))
            if s.details_md:
                parts.append(s.details_md.rstrip() + "\n")
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


def _shell(args) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)


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
    step = Step("effective", "done", summary, list(result.findings), result.to_markdown(lang),
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
        peak = human_bytes(chosen.gpu_peak_bytes)
        summary = fill(SUMMARY["fastest path"], answer=TEXT["yes" if needs_zero3 else "no"], path=rec.path,
                       peak=peak, tps=f"{chosen.tokens_per_s:.1f}", why=why)
    step = Step("need-zero3", "done", summary, list(result.findings), result.to_markdown(lang),
                data={"recommended": rec.to_dict(lang), "needs_zero3": needs_zero3}, artifacts=artifacts)
    return step, result


def _step_split(config, model, tmp: Path, out: Path, lang) -> Step:
    from dsdoctor.config.split import split

    result = split(config, tmp / "ds_inference.json", model=model)
    n = len(result.changes)
    final = out / "ds_inference.json"
    summary = fill(SUMMARY["split" if n else "split nothing"], final=final, n=n)
    details = result.to_markdown(lang)
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
    return Step("effective", "done", summary, list(result.findings), result.to_markdown(lang),
                data={"trace": result.to_dict(lang)}, artifacts=artifacts), result


def _step_ab(command, tmp: Path, timeout, lang) -> Step:
    from dsdoctor.trace.api import ab

    result = ab(command, out=tmp / "ab", timeout=timeout)
    n, diag = len(result.variants), result.diagnosis
    summary = fill(SUMMARY["ab"], n=n, diagnosis={x: diag.message(x) for x in LANGS} if diag
                   else TEXT["no diagnosis"])
    return Step("ab", "done", summary, list(result.findings), result.to_markdown(lang),
                data={"ab": result.to_dict(lang)}, commands=[diag.fix(lang)] if diag else [])


def _exit_step(path, plan_result, model, checkpoint, out: Path, gpus, merged: dict | None,
               split_written: bool = True, traced_stage: int | None = None) -> Step:
    model_arg = shlex.quote(str(model))
    if path == "plain" and not checkpoint and traced_stage is not None and traced_stage != 3:
        # the traced run already loads the whole model on each rank: there is no ZeRO-3 to leave
        return Step("exit", "done", fill(SUMMARY["keep plain"], stage=traced_stage), data={"path": path, "merged": None})
    infer_cfg = shlex.quote(str(out / "ds_inference.json"))
    n = gpus or (plan_result.hardware.gpus if plan_result else None) or 1
    compare_cmd = f"dsdoctor compare MERGED_DIR --paths plain,{'tp' if path == 'tp' else 'zero3'} --gpus {max(n, 2)}"
    if path == "plain" or path is None:
        ckpt = shlex.quote(str(checkpoint)) if checkpoint else "CKPT_DIR"
        merged_dir = shlex.quote(str(out / "merged")) if checkpoint else "MERGED_DIR"
        cmds = [] if merged else [f"dsdoctor merge {ckpt} {merged_dir} --dtype bf16 --model {model_arg}"]
        cmds += [f"dsdoctor verify {merged_dir} --model {model_arg}",
                 compare_cmd.replace("MERGED_DIR", merged_dir)]
        summary = fill(SUMMARY["leave zero3"])
        if merged:
            more = fill(SUMMARY["merged"], summary=merged.get("summary", ""))
            summary = {lang: text + more[lang] for lang, text in summary.items()}
    elif path == "tp":
        cmds = [f"dsdoctor merge CKPT_DIR MERGED_DIR --dtype bf16 --model {model_arg}",
                f"deepspeed --num_gpus {n} your_infer.py   # init_inference(tensor_parallel={{'tp_size': {n}}}, "
                f"dtype=torch.bfloat16), no zero_optimization", compare_cmd]
        summary = fill(SUMMARY["tp"], n=n)
    else:
        cmds = [f"deepspeed --num_gpus {n} your_infer.py --deepspeed_config {infer_cfg}", compare_cmd]
        config = fill(SUMMARY["split config"], file=out / "ds_inference.json")
        if not split_written:  # no ZeRO config was given or captured: nothing was split
            cmds[0] = f"deepspeed --num_gpus {n} your_infer.py   # config: {{\"zero_optimization\": {{\"stage\": 3}}, " \
                      "\"train_micro_batch_size_per_gpu\": 1}"
            config = SUMMARY["any config"]
        summary = fill(SUMMARY["keep zero3"], path=path, config=config)
    return Step("exit", "done", summary, commands=cmds, data={"path": path, "merged": merged})


def _merge(checkpoint, model, tmp: Path, lang) -> tuple[dict, list[Finding]]:
    from dsdoctor.checkpoint.merge import merge
    from dsdoctor.checkpoint.verify import verify

    merged = merge(checkpoint, tmp / "merged", model=model)
    checked = verify(tmp / "merged", model=model)
    summary = f"{merged.tensors} tensors written to merged/; verify: {len(checked.findings)} finding(s)."
    return {"summary": summary, "merge": merged.to_dict(lang), "verify": checked.to_dict(lang)}, list(checked.findings)


DEFAULT_WORKLOAD = {"batch": 1, "prompt_len": 512, "new_tokens": 128}
ZERO_CONFIG_APIS = ("deepspeed.initialize", "HfDeepSpeedConfig")


@dataclass
class Captured:
    """What a traced run handed over: its DeepSpeed config, its model, its generate workload (each may be None)."""
    config: dict | None = None
    config_api: str | None = None
    config_source: str | None = None
    model_dir: Path | None = None  # a directory holding the captured config.json, for plan and check
    model_class: str | None = None
    num_params: int | None = None
    dtype: str | None = None
    workload: dict | None = None
    world_size: int | None = None
    init_inference: dict | None = None  # the summary of an init_inference call (tp_size, ...)
    stage: int | None = None  # the ZeRO stage DeepSpeed ran (None: no DeepSpeed engine was built)
    encoder_decoder: bool = False
    unreadable: str | None = None  # why the captured config could not be read, when it could not

    @classmethod
    def from_trace(cls, traced, tmp: Path) -> Captured:
        ranks = sorted(traced.ranks, key=lambda r: r.rank)
        c = cls()
        for r in ranks:
            passed = r.config_passed or {}
            if c.config is None and passed.get("api") in ZERO_CONFIG_APIS and isinstance(r.config_captured, dict):
                c.config, c.config_api, c.config_source = r.config_captured, passed["api"], passed.get("source")
            if c.init_inference is None and passed.get("api") == "deepspeed.init_inference":
                c.init_inference = dict(passed)
            if c.model_dir is None and r.model_captured and isinstance(r.model_captured.get("config"), dict):
                m = r.model_captured
                directory = door.make_dir(tmp / "model")
                saved = dict(m["config"])
                if not saved.get("architectures") and m.get("model_class"):
                    saved["architectures"] = [m["model_class"]]
                if not (saved.get("torch_dtype") or saved.get("dtype")) and m.get("param_dtype"):
                    saved["torch_dtype"] = m["param_dtype"]  # the dtype the run's weights really had
                door.write_new(directory / "config.json", to_json(saved))
                c.model_dir, c.model_class, c.num_params = directory, m.get("model_class"), m.get("num_params")
                c.encoder_decoder = bool(m.get("is_encoder_decoder"))
                c.dtype = normalize_dtype(str(m.get("param_dtype")))
            if c.workload is None and r.workload:
                c.workload = r.workload
            c.world_size = c.world_size or r.world_size
            if c.stage is None:
                configured = (r.config_passed or {}).get("stage")
                c.stage = r.zero_stage if r.zero_stage is not None else configured if isinstance(configured, int) \
                    else None
        if c.stage is None and ranks:
            c.stage = 0  # the run built no DeepSpeed engine and passed no stage: nothing is partitioned
            if c.dtype is None or r.dtype:
                c.dtype = r.dtype or c.dtype
        if c.config is not None:
            door.write_new(tmp / "ds_config_captured.json", to_json(c.config))
        return c

    def config_file(self) -> str | None:
        """The file the run read its config from, when it still says what the run passed (checks then name it)."""
        src = self.config_source
        if not src or src == "dict" or not Path(src).is_file():
            return None
        try:
            from dsdoctor.config.load import load_config

            return src if load_config(src).raw == self.config else None
        except Exception:
            return None

    def config_text(self) -> str:
        src = self.config_source if self.config_source not in (None, "dict") else "a dict built in the script"
        return f"captured from {self.config_api}: {src}"

    def model_text(self) -> str:
        n = f"{self.num_params / 1e6:.2f}M parameters" if self.num_params else "parameters unknown"
        return f"captured from the run: {self.model_class or 'model'}, {n}"


def _unreadable_model(directory: Path) -> str | None:
    """None when dsdoctor can read the captured config.json as a model spec, else the problem."""
    from dsdoctor.model.spec import load_model_spec

    try:
        load_model_spec(directory)
    except InputError as exc:
        return exc.problem
    return None


def _workload_value(given, captured: dict | None, key: str) -> tuple[int, str]:
    """A workload number and where it came from: the flag, the traced generate, or the default."""
    if given is not None:
        return given, "given"
    value = (captured or {}).get(key)
    if isinstance(value, int) and value > 0:
        return value, "captured"
    return DEFAULT_WORKLOAD[key], "default"


def _skipped(key: str, why: dict[str, str], commands: list[str] | None = None) -> Step:
    return Step(key, "skipped", fill(SUMMARY["skipped"], why=why), commands=commands or [])


def _no_config_reason(captured: Captured | None) -> dict[str, str]:
    if captured is not None and captured.init_inference is not None:
        return fill(SKIPPED["init_inference"], tp=captured.init_inference.get("tp_size") or 1)
    if captured is not None and captured.unreadable:
        return fill(SKIPPED["unreadable config"], problem=captured.unreadable)
    if captured is not None:
        return SKIPPED["no config passed"]
    return SKIPPED["no config"]


def diagnose(config=None, model=None, gpus: int | None = None, gpu_memory=None, host_memory=None,  # noqa: C901,PLR0912,PLR0915
             batch: int | None = None, prompt_len: int | None = None, new_tokens: int | None = None,
             dtype: str | None = None, checkpoint=None, command: list[str] | None = None, out="dsdoctor-out",
             force: bool = False, timeout: float | None = None, lang: str = "en",
             machine=None) -> DiagnoseResult:
    """Run the troubleshooting and write ``out/report.{md,html,json}`` plus the split inference config.

    With a ``command`` it reports on that run: what the run handed to DeepSpeed (the config captured at
    deepspeed.initialize / HfDeepSpeedConfig), the model it built and the batch and lengths it generated with
    stand in for ``config``, ``model`` and the workload wherever those are not given. Without a command,
    ``config`` and ``model`` are needed; with neither (and no command) it runs on the bundled example (a ZeRO-3
    offload training config reused for inference, and a 7B Llama-shaped config.json), and says so."""
    sources: dict = {}
    if command is None and config is None and model is None:
        config, model = bundled_example()
        sources = {"config": "bundled example", "model": "bundled example"}
    elif command is None and config is None:
        raise InputError("diagnose needs --config (the DeepSpeed config your inference uses), or your command "
                         "after -- to capture it from the run")
    elif command is None and model is None:
        raise InputError("diagnose needs --model (a local model directory or its config.json), or your command "
                         "after -- to capture it from the run")
    out = Path(out)
    steps: list[Step] = []
    from dsdoctor.config.load import load_config

    # read once: check, plan and split share it (and its effective readings); a captured one is read below
    loaded = load_config(config) if config is not None else None
    with door.atomic_output_dir(out, force=force, inputs=[config, model, checkpoint], command="diagnose") as tmp:
        if model is not None and command:
            # plan before running anything: bad workload flags must fail before the user's command has run
            from dsdoctor.plan.api import plan

            plan(model, batch=batch or 1, prompt_len=prompt_len or 1, new_tokens=new_tokens or 1, dtype=dtype,
                 gpus=gpus, gpu_memory=gpu_memory, host_memory=host_memory, config=loaded)  # only flags given
        captured, trace_step = None, None
        if command:
            trace_step, traced = _step_trace(command, tmp, timeout, lang, out)
            captured = Captured.from_trace(traced, tmp)
            if config is None and captured.config is not None:
                try:
                    loaded = load_config(captured.config_file() or captured.config)
                    config, sources["config"] = captured.config_file() or captured.config, captured.config_text()
                except InputError as exc:  # the run's config is beyond reading: report the run without it
                    captured.unreadable = exc.problem
            if model is None and captured.model_dir is not None:
                problem = _unreadable_model(captured.model_dir)
                if problem is None and captured.encoder_decoder:
                    problem = "an encoder-decoder model; plan models decoder-only LLMs"
                if problem is None:
                    model, sources["model"] = captured.model_dir, captured.model_text()
                else:
                    sources["model"] = f"{captured.model_text()}; plan cannot take it: {problem}"
        if config is None:
            sources["config"] = _no_config_reason(captured)["en"]
        sources.setdefault("config", "given")
        sources.setdefault("model", "given" if model is not None else "the run built no model dsdoctor could read")
        wl = _workload(batch, prompt_len, new_tokens, captured.workload if captured else None,
                       _max_positions(model) if sources["model"].startswith("captured") else None)
        sources["workload"] = f"batch {wl[0]}, prompt {wl[1]} tokens, {wl[2]} new tokens ({wl[3]})"
        if gpus is None and captured is not None and captured.world_size and sources["model"] != "given":
            gpus = captured.world_size
        if dtype is None and captured is not None and sources["model"].startswith("captured"):
            dtype = captured.dtype

        config_is_zero = config is not None
        if config_is_zero:
            step, _ = _step_effective(loaded, model, gpus, lang)
        else:
            step = _skipped("effective", _no_config_reason(captured))
        steps.append(step)
        if trace_step is not None:
            steps.append(trace_step)
        plan_result = None
        if model is not None:
            try:
                plan_step, plan_result = _step_plan(model, loaded, gpus, gpu_memory, host_memory, wl[0], wl[1], wl[2],
                                                    dtype, tmp, lang, machine)
            except InputError as exc:
                if sources["model"] == "given":
                    raise
                plan_step = _skipped("need-zero3", fill(SKIPPED["plan failed"], problem=exc.problem))
        elif captured is not None and captured.model_dir is not None:  # captured, but not a model plan can take
            plan_step = _skipped("need-zero3", fill(SKIPPED["run's model"], model=sources["model"]))
        else:
            plan_step = _skipped("need-zero3", SKIPPED["no model"])
        steps.append(plan_step)
        if config_is_zero:
            steps.append(_step_split(loaded, model, tmp, out, lang))
        else:
            steps.append(_skipped("split", _no_config_reason(captured)))
        if command and _cuda_available():
            steps.append(_step_ab(command, tmp, timeout, lang))
        else:
            run = f"dsdoctor ab --out ab -- {_shell(command) if command else 'python your_infer.py'}"
            steps.append(_skipped("ab", SKIPPED["no gpu" if command else "no command"], commands=[run]))
        path = plan_result.recommended.path if plan_result is not None else None
        shown_model = out / "model" if captured is not None and captured.model_dir is not None and \
            model == captured.model_dir else model
        if plan_result is not None:
            merged, merge_findings = None, []
            if checkpoint and (path in (None, "plain", "tp")):
                merged, merge_findings = _merge(checkpoint, model, tmp, lang)
            exit_step = _exit_step(path, plan_result, shown_model, checkpoint, out, gpus, merged,
                                   split_written=config_is_zero, traced_stage=captured.stage if captured else None)
            exit_step.findings += merge_findings
        else:
            exit_step = _skipped("exit", SKIPPED["no plan"])
        steps.append(exit_step)
        shown_config = config if not isinstance(config, dict) else out / "ds_config_captured.json"
        result = DiagnoseResult(str(shown_config) if shown_config is not None else "none",
                                str(shown_model) if shown_model is not None else "none", str(out), steps, path, lang,
                                sources)
        write_report(result, tmp, lang, html_title="dsdoctor diagnosis")
    return result


def _max_positions(model) -> int | None:
    try:
        from dsdoctor.model.spec import load_model_spec

        value = load_model_spec(model).max_position_embeddings
    except Exception:
        return None
    return value if isinstance(value, int) and value > 1 else None


def _workload(batch, prompt_len, new_tokens, captured: dict | None,
              max_positions: int | None = None) -> tuple[int, int, int, str]:
    """(batch, prompt, new tokens, where they came from). Defaults that do not fit a captured model's context
    (a run that never called generate, with a small model) shrink to fit: 3/4 prompt, 1/4 new tokens."""
    b, bs = _workload_value(batch, captured, "batch")
    p, ps = _workload_value(prompt_len, captured, "prompt_len")
    n, ns = _workload_value(new_tokens, captured, "new_tokens")
    if max_positions and p + n > max_positions:
        if ps == "default":
            p = max(1, min(p, (max_positions * 3) // 4 - (0 if ns == "default" else n)))
        if ns == "default":
            n = max(1, min(n, max_positions - p))
    kinds = {bs, ps, ns}
    how = "from the run" if kinds == {"captured"} else "defaults" if kinds == {"default"} else \
        "given" if kinds == {"given"} else ", ".join(f"{k} {v}" for k, v in
                                                        (("batch", bs), ("prompt", ps), ("new tokens", ns)))
    return b, p, n, how


def diagnose_exit_code(result: DiagnoseResult, fail_on: str) -> int:
    return exit_code(result.findings, fail_on)


