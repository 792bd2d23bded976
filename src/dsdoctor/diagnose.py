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

import copy
import shlex
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dsdoctor import door
from dsdoctor.dtypes import TORCH_NAMES, normalize_dtype
from dsdoctor.errors import InputError
from dsdoctor.findings import Finding, Phrase, exit_code, sort_findings
from dsdoctor.i18n import LANGS, fill, message_table, pick
from dsdoctor.report.render import Style, findings_markdown, findings_text, to_json, without_findings, write_report
from dsdoctor.report.summary import TEXT as SUMMARY_TEXT
from dsdoctor.report.summary import Action, Summary, before_after
from dsdoctor.report.summary import verdict as summary_verdict
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


def _shell(args) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)


def _details(result, lang: str) -> str:
    """A step's full result in Markdown, its findings left out (the step lists them, once)."""
    with without_findings():
        return result.to_markdown(lang)


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
        summary = fill(SUMMARY["fastest path"], answer=TEXT["yes" if needs_zero3 else "no"], path=rec.path,
                       why=rec.why)
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


def current_path(stage, offload_param, tp_size=None) -> str:
    """The plan path a config amounts to: ZeRO-3 (with its offload), tensor parallel, else plain."""
    if stage == 3:
        return {"cpu": "zero3-offload", "nvme": "zero3-offload-nvme"}.get(offload_param or "", "zero3")
    return "tp" if (tp_size or 1) > 1 else "plain"


def _compare_path(path: str) -> str | None:
    """compare's name for a plan path (compare runs plain, zero3, zero3-offload and tp)."""
    if path.startswith("tp"):
        return "tp"
    return path if path in ("plain", "zero3", "zero3-offload") else None


def _launches(code: str | None) -> list[str]:
    """The launch lines plan's emitted code names in its comments (``# deepspeed --num_gpus 1 run.py``)."""
    out = []
    for line in (code or "").splitlines():
        text = line.lstrip("#").strip().rstrip("&").strip()
        if line.startswith("#") and text.split(" ", 1)[0] in ("deepspeed", "torchrun", "python"):
            out.append(text.replace("run.py", "your_infer.py"))
    return out


def _path_config(path: str, split_config: dict | None, recommended: dict | None) -> dict:
    """The deepspeed.initialize config of a ZeRO-3 path: the split inference config where there is one (its
    knobs kept), with offload_param as the path needs it (offload only when the path offloads)."""
    cfg = copy.deepcopy(split_config) if split_config else copy.deepcopy(recommended or {})
    cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = 3
    want = ((recommended or {}).get("zero_optimization") or {}).get("offload_param")
    have = zero.get("offload_param") if isinstance(zero.get("offload_param"), dict) else None
    if path == "zero3":
        zero.pop("offload_param", None)
    elif want and (have is None or have.get("device") != want.get("device")):
        zero["offload_param"] = copy.deepcopy(want)
    return cfg


def _exit_step(path, plan_result, model, checkpoint, out: Path, gpus, merged: dict | None, tmp: Path,
               split_config: dict | None = None, traced_stage: int | None = None,
               current: str | None = None) -> Step:
    """Step 5: the path step 2 recommends, with its code and commands: leave ZeRO-3 for a plain load or for
    tensor parallelism (TP is not ZeRO-3), or keep ZeRO-3 with the config of that path (offload_param kept
    only where the path offloads). merge and verify only when there are shards (``checkpoint``); compare the
    tokens only then, against the path the config ran."""
    model_arg = shlex.quote(str(model))
    rec = plan_result.recommended if plan_result is not None else None
    code = rec.code if rec is not None else None
    if path == "plain" and not checkpoint and traced_stage is not None and traced_stage != 3:
        # the traced run already loads the whole model on each rank: there is no ZeRO-3 to leave
        return Step("exit", "done", fill(SUMMARY["keep plain"], stage=traced_stage), data={"path": path, "merged": None})
    n = gpus or (plan_result.hardware.gpus if plan_result else None) or 1
    chosen = plan_result.path(path) if plan_result is not None and path else None
    cmds: list[str] = []
    shards = bool(checkpoint)
    merged_dir = shlex.quote(str(out / "merged")) if shards else "MERGED_DIR"
    if shards:  # the weights are ZeRO shards: ordinary weights first, checked against the model
        if not merged:
            cmds.append(f"dsdoctor merge {shlex.quote(str(checkpoint))} {merged_dir} --dtype bf16 --model {model_arg}")
        cmds.append(f"dsdoctor verify {merged_dir} --model {model_arg}")
    data = {"path": path, "merged": merged, "code": code, "config": None}
    artifacts: list[str] = []
    if path is None or path == "plain":
        cmds += _launches(code)
        summary = fill(SUMMARY["leave zero3 shards" if shards else "leave zero3"])
        if merged:
            more = fill(SUMMARY["merged"], summary=merged.get("summary", ""))
            summary = {lang: text + more[lang] for lang, text in summary.items()}
    elif path.startswith("tp"):
        k = (chosen.tp if chosen is not None and chosen.tp else None) or n
        replicas = chosen.replicas if chosen is not None else 1
        cmds += _launches(code)
        summary = fill(SUMMARY["tp groups" if replicas > 1 else "tp"], n=k, groups=replicas, total=k * replicas)
    else:
        cfg = _path_config(path, split_config, rec.ds_config if rec is not None else None)
        if split_config is not None and cfg == split_config:
            name, where = "ds_inference.json", fill(SUMMARY["split config"], file=out / "ds_inference.json")
        else:
            name = f"ds_{path}.json"
            door.write_new(tmp / name, to_json(cfg))
            artifacts.append(name)
            where = fill(SUMMARY["path config"], file=out / name, path=path)
        data["config"] = cfg
        cmds.append(f"deepspeed --num_gpus {n} your_infer.py --deepspeed_config {shlex.quote(str(out / name))}")
        summary = fill(SUMMARY["keep zero3"], path=path, config=where)
    new, old = _compare_path(path or "plain"), _compare_path(current or "")
    if shards and new and old and new != old:
        k = (chosen.tp if chosen is not None and chosen.tp else n) if new == "tp" else n
        cmds.append(f"dsdoctor compare {merged_dir} --paths {new},{old} --gpus {max(k, 2)}")
    return Step("exit", "done", summary, commands=cmds, data=data, artifacts=artifacts)


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


def _current(check_result, captured) -> str | None:
    """The plan path the user's config (or traced run) amounts to: what "before" is."""
    if check_result is not None and check_result.inference_config is not None:
        return current_path(None, None, check_result.inference_config.tp_size)
    if check_result is not None:
        eff = check_result.effective
        return current_path(eff.zero_stage, eff.offload_param.device)
    if captured is not None and captured.stage is not None:
        tp = (captured.init_inference or {}).get("tp_size")
        return current_path(captured.stage, captured.offload_param, tp if isinstance(tp, int) else None)
    return None


def _summary(steps: list[Step], plan_result, path, current, traced, ab_result, command, checkpoint) -> Summary:
    """The answer the report leads with (report/summary.py): verdict, actions, predicted before -> after."""
    config_errors = [f for s in steps if s.key == "effective" and "trace" not in s.data for f in s.findings
                     if f.effective_severity == "error"]
    decisive = ab_result.diagnosis if ab_result is not None and ab_result.diagnosis is not None and \
        ab_result.diagnosis.code in ("DSD316", "DSD317") else None
    text = summary_verdict(failed_run=_failed_run(traced), ab=decisive, config_errors=config_errors,
                           plan_result=plan_result, path=path, current=current)
    exit_step = next((s for s in steps if s.key == "exit"), None)
    return Summary(text, _actions(exit_step, plan_result, path, command, ab_result, checkpoint),
                   *before_after(plan_result, path, current, ab_result))


def _failed_run(run) -> tuple | None:
    """(rank, {lang: how it ended}) of the rank that ended a failed traced run, from trace's endings."""
    if run is None or run.status == "ok":
        return None
    from dsdoctor.trace.ending import ending_text

    root = next((r for r in run.ranks if (r.ending or {}).get("kind") not in (None, "finished", "by-launcher")), None)
    if root is None:
        return "?", {lang: run.status for lang in LANGS}
    return root.rank, {lang: ending_text(root.ending, lang) for lang in LANGS}

def _actions(exit_step: Step | None, plan_result, path, command, ab_result, checkpoint) -> list[Action]:
    """Up to three things to do, in order: the shards into weights (when there are shards), the way out of
    step 5, then what confirms it (ab on the user's run, compare on the merged weights) or what DSD220 asks."""
    if exit_step is None or exit_step.status != "done":
        return []
    cmds = exit_step.commands
    shard_cmds = [c for c in cmds if c.startswith(("dsdoctor merge", "dsdoctor verify"))]
    compare = [c for c in cmds if c.startswith("dsdoctor compare")]
    launch = [c for c in cmds if c not in shard_cmds and c not in compare]
    out = []
    if shard_cmds:
        out.append(Action(SUMMARY_TEXT["act-shards"], shard_cmds))
    if exit_step.data.get("measured"):
        out.append(Action(fill(SUMMARY_TEXT["act-measured"], variant=exit_step.data["measured"]), launch))
    elif path is None or path == "plain":
        out.append(Action(SUMMARY_TEXT["act-plain"], launch))
    elif path.startswith("tp"):
        chosen = plan_result.path(path) if plan_result is not None else None
        out.append(Action(fill(SUMMARY_TEXT["act-tp"], n=(chosen.tp if chosen is not None and chosen.tp else 1)),
                          launch))
    else:
        config = launch[0].rsplit(" ", 1)[-1] if launch else "-"
        out.append(Action(fill(SUMMARY_TEXT["act-zero3"], path=path, file=f"`{config}`"), launch))
    if compare:
        out.append(Action(SUMMARY_TEXT["act-compare"], compare))
    elif command and ab_result is None:
        out.append(Action(SUMMARY_TEXT["act-ab"], [f"dsdoctor ab --out ab -- {_shell(command)}"]))
    elif not command:
        out.append(Action(SUMMARY_TEXT["act-trace"], ["dsdoctor diagnose --out diag -- python your_infer.py"]))
    fragmented = plan_result is not None and any(
        f.code == "DSD220" and str(f.values.get("path")) == str(path) for f in plan_result.findings)
    if fragmented:
        out.append(Action(SUMMARY_TEXT["act-expandable"], ["export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]))
    return out[:3]


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
    init_inference_config: dict | None = None  # the config init_inference received (with its keyword arguments)
    offload_param: str | None = None  # what DeepSpeed ran: cpu, nvme or None
    stage: int | None = None  # the ZeRO stage DeepSpeed ran (None: no DeepSpeed engine was built)
    encoder_decoder: bool = False
    unreadable: str | None = None  # why the captured config could not be read, when it could not
    model_from: str = "from the run"  # or "from ab's variant NAME": the trace that recorded model and workload
    variant_workload: dict | None = None  # the workload of ab's variant that ran, when the run never generated
    variant: str | None = None
    flags: dict = field(default_factory=dict)  # what the command's own flags say (``command_flags``)

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
                c.init_inference_config = r.config_captured if isinstance(r.config_captured, dict) else None
            c.offload_param = c.offload_param or r.offload_param or passed.get("offload_param")
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

    def add_variant(self, ab_result, tmp: Path) -> None:
        """What the run never reached, from the variant of ab that ran (the fix ab names first): the model it
        built (its config.json), its dtype and the workload it generated with."""
        ran = [v for v in (ab_result.variants if ab_result is not None else []) if v.status == "ok" and v.shape]
        fix = ab_result.diagnosis if ab_result is not None else None
        named = str(fix.values.get("variant")) if fix is not None and fix.code == "DSD316" else None
        v = next((v for v in ran if v.name == named), ran[0] if ran else None)
        if v is None:
            return
        self.variant, shape = v.name, v.shape
        self.variant_workload = {k: shape.get(k) for k in ("batch", "prompt_len", "new_tokens")}
        if self.model_dir is None and isinstance(shape.get("model_config"), dict):
            saved = dict(shape["model_config"])
            short = normalize_dtype(str(shape.get("dtype")))
            if not (saved.get("torch_dtype") or saved.get("dtype")) and short in TORCH_NAMES:
                saved["torch_dtype"] = TORCH_NAMES[short]  # transformers reads torch's name, not bf16/fp32
            directory = door.make_dir(tmp / "model")
            door.write_new(directory / "config.json", to_json(saved))
            self.model_dir, self.model_from = directory, f"from ab's variant {v.name}"
            self.model_class = (saved.get("architectures") or [None])[0]
            self.dtype = self.dtype or short
        self.world_size = self.world_size or shape.get("world_size")

    def workloads(self) -> list[tuple]:
        """The workloads the run says, in order: (dict, where it came from)."""
        return [(self.workload, "the run"), (self.variant_workload, f"ab's variant {self.variant}"),
                (self.flags, "the command line")]

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
        return f"captured {self.model_from}: {self.model_class or 'model'}, {n}"


FLAGS = {  # what a command's own flags say, as inference scripts spell them
    "model": ("--model", "--model_name_or_path", "--model-name-or-path", "--model_path", "--model-path"),
    "batch": ("--batch", "--batch-size", "--batch_size"), "dtype": ("--dtype", "--torch-dtype", "--torch_dtype"),
    "prompt_len": ("--prompt-len", "--prompt_len", "--input-len", "--input_len"),
    "new_tokens": ("--new-tokens", "--new_tokens", "--max-new-tokens", "--max_new_tokens"),
}


def command_flags(command: list[str]) -> dict:
    """{"model", "batch", "prompt_len", "new_tokens", "dtype"} as the command's flags give them (``--batch 4`` or
    ``--batch=4``); numbers as ints, the model's flag kept to say where it came from."""
    out: dict = {}
    args = [str(a) for a in command]
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        key = next((k for k, names in FLAGS.items() if flag in names), None)
        if key is None or not value or key in out:
            continue
        if key in ("model", "dtype"):
            out[key] = value
            if key == "model":
                out["model flag"] = flag
        elif value.isdigit() and int(value) > 0:
            out[key] = int(value)
    return out


def _handed_zero(cfg: dict | None) -> bool:
    """An init_inference config that carries a ZeRO section (``zero``, or a ZeRO config as ``args``)."""
    if not isinstance(cfg, dict):
        return False
    from dsdoctor.config.inference_config import read_inference_config

    try:
        return bool(read_inference_config(cfg).zero)
    except Exception:  # a config beyond reading is reported as the run's, not checked here
        return False


def _unreadable_model(directory: Path) -> str | None:
    """None when dsdoctor can read the captured config.json as a model spec, else the problem."""
    from dsdoctor.model.spec import load_model_spec

    try:
        load_model_spec(directory)
    except InputError as exc:
        return exc.problem
    return None


def _workload_value(given, found: list[tuple], key: str) -> tuple[int, str]:
    """A workload number and where it came from: the flag, what the run says (``found``: (dict, where) in order:
    the traced generate, ab's variant that ran, the command's flags), or the default."""
    if given is not None:
        return given, "given"
    for values, where in found:
        value = (values or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value, where
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


def _load(config):
    from dsdoctor.config.load import load_config

    return load_config(config)


def _given_sources(command, config, model) -> tuple:
    """(config, model, sources) before anything runs: the bundled example when nothing is given; bad input ends."""
    if command is None and config is None and model is None:
        config, model = bundled_example()
        return config, model, {"config": "bundled example", "model": "bundled example"}
    if command is None and config is None:
        raise InputError("diagnose needs --config (the DeepSpeed config your inference uses), or your command "
                         "after -- to capture it from the run")
    if command is None and model is None:
        raise InputError("diagnose needs --model (a local model directory or its config.json), or your command "
                         "after -- to capture it from the run")
    return config, model, {}


@dataclass
class Inputs:
    """What the steps plan and check with, each with where it came from (``sources``)."""
    config: object
    loaded: object
    model: object
    gpus: int | None
    dtype: str | None
    workload: tuple
    sources: dict


@dataclass
class Run:
    """What running the user's command gave: its trace and what it handed over, and ab when it ran."""
    captured: Captured
    trace_step: Step
    traced: object
    ab_step: Step | None = None
    ab_result: object = None


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


def _captured_config(config, loaded, captured: Captured, sources: dict) -> tuple:
    """The config to check: the one given, else what the run handed to DeepSpeed."""
    if config is None and captured.config is None and _handed_zero(captured.init_inference_config):
        config = captured.init_inference_config  # a ZeRO section init_inference ignores: check and split it
        sources["config"] = "captured from deepspeed.init_inference: a zero section it ignores"
        return config, _load(config)
    if config is None and captured.config is not None:
        try:
            loaded = _load(captured.config_file() or captured.config)
            config, sources["config"] = captured.config_file() or captured.config, captured.config_text()
        except InputError as exc:  # the run's config is beyond reading: report the run without it
            captured.unreadable = exc.problem
    return config, loaded


def _captured_model(captured: Captured, sources: dict):
    """The model the run built (or the variant that ran, or the command line names), when plan can take it."""
    if captured.model_dir is not None:
        problem = _unreadable_model(captured.model_dir)
        if problem is None and captured.encoder_decoder:
            problem = "an encoder-decoder model; plan models decoder-only LLMs"
        if problem is None:
            sources["model"] = captured.model_text()
            return captured.model_dir
        sources["model"] = f"{captured.model_text()}; plan cannot take it: {problem}"
    named = captured.flags.get("model")
    if named is not None:
        problem = _unreadable_model(Path(named)) if Path(named).exists() else "not a local directory here"
        if problem is None:
            sources["model"] = f"from the command line: {captured.flags['model flag']} {named}"
            return named
        sources.setdefault("model", f"the command line names {named} ({problem}; pass --model DIR)")
    return None


def _inputs(config, loaded, model, gpus, dtype, given: tuple, run: Run | None, sources: dict) -> Inputs:
    """Every input of the steps, from the flags, else from the run (its trace, the variant of ab that ran, its
    command line), else the defaults; ``sources`` says which for each."""
    captured = run.captured if run is not None else None
    if captured is not None:
        config, loaded = _captured_config(config, loaded, captured, sources)
        if model is None:
            model = _captured_model(captured, sources)
    if config is None:
        sources["config"] = _no_config_reason(captured)["en"]
    sources.setdefault("config", "given")
    sources.setdefault("model", "given" if model is not None else "the run built no model dsdoctor could read")
    from_run = sources["model"] != "given"
    wl = _workload(*given, captured.workloads() if captured else None,
                   _max_positions(model) if from_run and model is not None else None)
    sources["workload"] = f"batch {wl[0]}, prompt {wl[1]} tokens, {wl[2]} new tokens ({wl[3]})"
    if gpus is None and captured is not None and captured.world_size and from_run:
        gpus = captured.world_size
    dtype, sources["dtype"] = _dtype(dtype, captured, from_run)
    return Inputs(config, loaded, model, gpus, dtype, wl, sources)


def _dtype(dtype, captured: Captured | None, from_run: bool) -> tuple:
    """The dtype and where it came from: the flag, the run's weights, the command's --dtype, else config.json."""
    flagged = normalize_dtype(captured.flags["dtype"]) if captured is not None and captured.flags.get("dtype") else None
    if dtype is not None:
        return dtype, "given"
    if captured is not None and from_run and captured.dtype:
        return captured.dtype, f"{captured.dtype}, {captured.model_from}"
    return flagged, (f"{flagged}, from the command line" if flagged else "the model's config.json")


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


def _with_inputs(summary: dict, sources: dict) -> dict:
    """A step's summary followed by where its inputs came from."""
    more = fill(SUMMARY["inputs"], model=sources.get("model"), dtype=sources.get("dtype"),
                workload=sources.get("workload"))
    return {lang: f"{text} {more[lang]}" for lang, text in summary.items()}


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
        captured = run.captured if run is not None else None
        shown_model = out / "model" if captured is not None and captured.model_dir is not None and \
            inputs.model == captured.model_dir else inputs.model
        shown_config = inputs.config if not isinstance(inputs.config, dict) else out / "ds_config_captured.json"
        summary = _summary(steps, plan_result, path, current, run.traced if run else None,
                           run.ab_result if run else None, command, checkpoint)
        result = DiagnoseResult(str(shown_config) if shown_config is not None else "none",
                                str(shown_model) if shown_model is not None else "none", str(out), steps, path, lang,
                                inputs.sources, summary)
        write_report(result, tmp, lang, html_title="dsdoctor diagnosis")
    return result


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
        merged, merge_findings = None, []
        if checkpoint and (path is None or not path.startswith("zero3")):
            merged, merge_findings = _merge(checkpoint, inputs.model, tmp, lang)
        shown = out / "model" if captured is not None and inputs.model == captured.model_dir else inputs.model
        exit_step = _exit_step(path, plan_result, shown, checkpoint, out, inputs.gpus, merged, tmp,
                               split_config=split_step.data.get("config"), traced_stage=captured.stage if captured else None,
                               current=current)
        exit_step.findings += merge_findings
        exit_step.summary = _with_inputs(exit_step.summary, inputs.sources)
    else:
        exit_step = _measured_exit(run.ab_result if run else None, inputs, tmp, out)
    steps.append(exit_step)
    return steps, plan_result, path, current


def _split_or_skip(inputs: Inputs, check_result, captured, tmp: Path, out: Path, lang, dtype=None) -> Step:
    inference_cfg = check_result.inference_config if check_result is not None else None
    if inputs.config is not None and (inference_cfg is None or inference_cfg.zero):
        return _step_split(inputs.loaded, inputs.model, tmp, out, lang, dtype)  # plan's dtype: the code's
    if inputs.config is not None:  # an init_inference config without a ZeRO section: nothing to split
        return _skipped("split", fill(SKIPPED["init_inference config"], tp=inference_cfg.tp_size))
    return _skipped("split", _no_config_reason(captured))


def _measured_exit(ab_result, inputs: Inputs, tmp: Path, out: Path) -> Step:
    """Step 5 without a plan: the variant ab measured as the fix (DSD316), its config written beside the report."""
    fix = ab_result.diagnosis if ab_result is not None else None
    if fix is None or fix.code != "DSD316":
        return _skipped("exit", SKIPPED["no plan"])
    from dsdoctor.trace.variants import apply_variant

    name = str(fix.values["variant"])
    variant = next(v for v in ab_result.variants if v.name == name)
    n = inputs.gpus or (variant.shape or {}).get("world_size") or 1
    cfg = apply_variant(name, inputs.loaded.raw) if inputs.loaded is not None else None
    if cfg is not None:
        door.write_new(tmp / f"ds_{name}.json", to_json(cfg))
    cmds = [f"deepspeed --num_gpus {n} your_infer.py --deepspeed_config {shlex.quote(str(out / f'ds_{name}.json'))}"]
    summary = fill(SUMMARY["measured way out"], variant=name, fix={x: fix.fix(x) for x in LANGS},
                   tps=f"{variant.tokens_per_s:.1f}" if variant.tokens_per_s else "-")
    return Step("exit", "done", _with_inputs(summary, inputs.sources), commands=cmds if cfg else [],
                artifacts=[f"ds_{name}.json"] if cfg else [], data={"path": None, "measured": name, "config": cfg})


def _max_positions(model) -> int | None:
    try:
        from dsdoctor.model.spec import load_model_spec

        value = load_model_spec(model).max_position_embeddings
    except Exception:
        return None
    return value if isinstance(value, int) and value > 1 else None


def _workload(batch, prompt_len, new_tokens, found: dict | list | None,
              max_positions: int | None = None) -> tuple[int, int, int, str]:
    """(batch, prompt, new tokens, where they came from). ``found``: what the run says, a dict (the traced
    generate) or (dict, where) pairs in order. Defaults that do not fit a captured model's context (a run that
    never called generate, with a small model) shrink to fit: 3/4 prompt, 1/4 new tokens."""
    found = [(found, "the run")] if isinstance(found, dict) else (found or [])
    b, bs = _workload_value(batch, found, "batch")
    p, ps = _workload_value(prompt_len, found, "prompt_len")
    n, ns = _workload_value(new_tokens, found, "new_tokens")
    if max_positions and p + n > max_positions:
        if ps == "default":
            p = max(1, min(p, (max_positions * 3) // 4 - (0 if ns == "default" else n)))
        if ns == "default":
            n = max(1, min(n, max_positions - p))
    kinds = {bs, ps, ns}
    if len(kinds) == 1:
        how = {"default": "defaults", "given": "given"}.get(bs, f"from {bs}")
    else:
        how = ", ".join(f"{k} {'from ' + v if v not in ('given', 'default') else v}"
                        for k, v in (("batch", bs), ("prompt", ps), ("new tokens", ns)))
    return b, p, n, how


def diagnose_exit_code(result: DiagnoseResult, fail_on: str) -> int:
    return exit_code(result.findings, fail_on)


