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

from dsdoctor.errors import InputError
from dsdoctor.findings import Finding, exit_code, sort_findings
from dsdoctor.fsutil import atomic_output_dir
from dsdoctor.i18n import pick
from dsdoctor.report.render import Style, findings_markdown, findings_text, write_report
from dsdoctor.units import human_bytes

STEP_TITLES = {
    "effective": {"en": "1. What takes effect", "zh": "1. 实际生效的设置"},
    "need-zero3": {"en": "2. Does this inference need ZeRO-3?", "zh": "2. 推理需要 ZeRO-3 吗？"},
    "split": {"en": "3. The inference config", "zh": "3. 推理专用配置"},
    "ab": {"en": "4. Peak with and without offload_param", "zh": "4. 有无 offload_param 的峰值对比"},
    "exit": {"en": "5. The way out", "zh": "5. 解决方案"},
}
TEXT = {
    "report": {"en": "report", "zh": "报告"},
    "title": {"en": "dsdoctor diagnosis", "zh": "dsdoctor 诊断报告"},
    "recommended": {"en": "Recommended load path", "zh": "推荐的加载方式"},
}


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
            "config": self.config, "model": self.model, "out": self.out,
            "recommended_path": self.recommended_path,
            "report": {"markdown": str(Path(self.out) / "report.md"), "html": str(Path(self.out) / "report.html")},
            "steps": [s.to_dict(lang) for s in self.steps],
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)],
        }

    def to_text(self, lang: str = "en", style: Style | None = None) -> str:
        style = style or Style()
        glyph = {"done": style.ok, "skipped": "-", "failed": style.error}
        lines = []
        for s in self.steps:
            lines.append(f"{glyph[s.status]} {pick(STEP_TITLES[s.key], lang)}")
            lines.append("    " + (s.summary.get(lang) or s.summary["en"]))
            lines += [f"    $ {c}" for c in s.commands[:3]]
        lines.append("")
        lines.append(findings_text(self.findings, lang, style).rstrip())
        lines.append(f"{pick(TEXT['report'], lang)}: {Path(self.out) / 'report.html'}  ({Path(self.out) / 'report.md'})")
        return "\n".join(lines) + "\n"

    def to_markdown(self, lang: str = "en") -> str:
        parts = [f"# {pick(TEXT['title'], lang)}\n", f"- config: `{self.config}`\n- model: `{self.model}`\n"]
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


def _t(en: str, zh: str) -> dict[str, str]:
    return {"en": en, "zh": zh}


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
    summary = _t(
        f"ZeRO stage {stage}, offload_param {op}, offload_optimizer {oo}, optimizer "
        f"{eff.optimizer_type or 'none'}: {len(result.findings)} finding(s) from the config alone.",
        f"ZeRO 阶段 {stage}，offload_param {op}，offload_optimizer {oo}，优化器 "
        f"{eff.optimizer_type or '无'}：仅从配置就发现 {len(result.findings)} 个问题。",
    )
    step = Step("effective", "done", summary, list(result.findings), result.to_markdown(lang),
                data=result.to_dict(lang).get("effective", {}))
    return step, result


def _step_plan(model, config, gpus, gpu_memory, host_memory, batch, prompt_len, new_tokens, dtype, tmp: Path,
               lang) -> tuple[Step, object]:
    from dsdoctor.plan.api import plan

    result = plan(model, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, dtype=dtype, gpus=gpus,
                  gpu_memory=gpu_memory, host_memory=host_memory, config=config)
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
        summary = _t(f"No load path fits this workload. {why}", f"没有任何加载方式能容纳该负载。{why}")
    else:
        peak = human_bytes(chosen.gpu_peak_bytes)
        summary = _t(
            f"{'Yes' if needs_zero3 else 'No'}: the fastest path that fits is `{rec.path}` "
            f"(predicted peak {peak} per GPU, {chosen.tokens_per_s:.1f} tokens/s per rank). {why}",
            f"{'需要' if needs_zero3 else '不需要'}：能装下的最快方式是 `{rec.path}`"
            f"（预测每卡峰值 {peak}，每个 rank {chosen.tokens_per_s:.1f} tokens/s）。{why}",
        )
    step = Step("need-zero3", "done", summary, list(result.findings), result.to_markdown(lang),
                data={"recommended": rec.to_dict(lang), "needs_zero3": needs_zero3}, artifacts=artifacts)
    return step, result


def _step_split(config, model, tmp: Path, out: Path, lang) -> Step:
    from dsdoctor.config.split import split

    result = split(config, tmp / "ds_inference.json", model=model)
    n = len(result.changes)
    final = out / "ds_inference.json"
    summary = _t(
        f"Wrote `{final}`: {n} change(s) from the training config (optimizer side dropped, stage and "
        f"offload_param kept, \"auto\" resolved). Use it with `deepspeed.initialize` for ZeRO-3 inference.",
        f"已写出 `{final}`：相对训练配置改动 {n} 处（去掉优化器相关项，保留 stage 与 offload_param，"
        f"解析所有 \"auto\"）。ZeRO-3 推理时把它传给 `deepspeed.initialize`。",
    )
    details = result.to_markdown(lang)
    return Step("split", "done", summary, list(result.findings), details,
                data={"changes": n, "config": result.config}, artifacts=["ds_inference.json"])


def _step_trace(command, tmp: Path, timeout, lang) -> Step:
    from dsdoctor.trace.api import trace

    result = trace(command, out=tmp / "trace", timeout=timeout)
    seen = ", ".join(
        f"rank {r.rank}: stage {r.zero_stage}, optimizer {r.optimizer or 'none'}, "
        f"peak GPU {human_bytes(r.peak_gpu_bytes)}, peak host {human_bytes(r.peak_host_bytes)}"
        for r in result.ranks[:4]
    ) or "no rank reported"
    summary = _t(f"Traced `{_shell(command)}`: {seen}.", f"跟踪了 `{_shell(command)}`：{seen}。")
    artifacts = sorted(str(p.relative_to(tmp)) for p in (tmp / "trace").glob("*.png"))
    return Step("effective", "done", summary, list(result.findings), result.to_markdown(lang),
                data={"trace": result.to_dict(lang)}, artifacts=artifacts)


def _step_ab(command, tmp: Path, timeout, lang) -> Step:
    from dsdoctor.trace.api import ab

    result = ab(command, out=tmp / "ab", timeout=timeout)
    n, diag = len(result.variants), result.diagnosis
    summary = _t(f"A/B over {n} variants: {diag.message('en') if diag else 'no diagnosis'}",
                 f"对 {n} 个变体做了 A/B：{diag.message('zh') if diag else '无结论'}")
    return Step("ab", "done", summary, list(result.findings), result.to_markdown(lang),
                data={"ab": result.to_dict(lang)}, commands=[diag.fix(lang)] if diag else [])


def _exit_step(path, plan_result, model, checkpoint, out: Path, gpus, merged: dict | None) -> Step:
    model_arg = shlex.quote(str(model))
    infer_cfg = shlex.quote(str(out / "ds_inference.json"))
    n = gpus or (plan_result.hardware.gpus if plan_result else None) or 1
    compare_cmd = f"dsdoctor compare MERGED_DIR --paths plain,{'tp' if path == 'tp' else 'zero3'} --gpus {max(n, 2)}"
    if path == "plain" or path is None:
        ckpt = shlex.quote(str(checkpoint)) if checkpoint else "CKPT_DIR"
        merged_dir = shlex.quote(str(out / "merged")) if checkpoint else "MERGED_DIR"
        cmds = [] if merged else [f"dsdoctor merge {ckpt} {merged_dir} --dtype bf16 --model {model_arg}"]
        cmds += [f"dsdoctor verify {merged_dir} --model {model_arg}",
                 compare_cmd.replace("MERGED_DIR", merged_dir)]
        summary = _t(
            "Leave ZeRO-3: consolidate the shards into ordinary weights, verify them against the model, then load "
            "with `AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16, device_map=\"cuda\")` "
            "(one replica per GPU for data parallel). Confirm the tokens match with compare.",
            "退出 ZeRO-3：把分片合并为普通权重，对照模型校验，然后用 "
            "`AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16, device_map=\"cuda\")` 加载"
            "（数据并行时每卡一份）。最后用 compare 确认生成的 token 一致。",
        )
        if merged:
            summary["en"] += f" Merged: {merged.get('summary', '')}"
            summary["zh"] += f" 已合并：{merged.get('summary', '')}"
    elif path == "tp":
        cmds = [f"dsdoctor merge CKPT_DIR MERGED_DIR --dtype bf16 --model {model_arg}",
                f"deepspeed --num_gpus {n} your_infer.py   # init_inference(tensor_parallel={{'tp_size': {n}}}, "
                f"dtype=torch.bfloat16), no zero_optimization", compare_cmd]
        summary = _t(
            f"Use tensor parallelism over {n} GPUs with `deepspeed.init_inference(model, "
            f"tensor_parallel={{\"tp_size\": {n}}}, dtype=torch.bfloat16)` on merged weights, and no ZeRO-3: "
            "tensor parallel xor ZeRO-3, never both. Pass dtype explicitly (init_inference defaults to fp16).",
            f"在 {n} 张卡上用张量并行：对合并后的权重调用 `deepspeed.init_inference(model, "
            f"tensor_parallel={{\"tp_size\": {n}}}, dtype=torch.bfloat16)`，不要再开 ZeRO-3（二者只选其一）。"
            "务必显式传 dtype（init_inference 默认 fp16）。",
        )
    else:
        cmds = [f"deepspeed --num_gpus {n} your_infer.py --deepspeed_config {infer_cfg}", compare_cmd]
        summary = _t(
            f"Keep ZeRO-3 ({path}) with the split inference config `{out / 'ds_inference.json'}` in "
            "`deepspeed.initialize(model=model, config=...)`; no optimizer is built. With several ranks call "
            "`generate(..., synced_gpus=True)` or ranks that stop at different lengths hang.",
            f"保留 ZeRO-3（{path}），在 `deepspeed.initialize(model=model, config=...)` 中使用拆分后的推理配置 "
            f"`{out / 'ds_inference.json'}`，不会再构建优化器。多 rank 时调用 "
            "`generate(..., synced_gpus=True)`，否则生成长度不同的 rank 会卡死。",
        )
    return Step("exit", "done", summary, commands=cmds, data={"path": path, "merged": merged})


def _merge(checkpoint, model, tmp: Path, lang) -> tuple[dict, list[Finding]]:
    from dsdoctor.checkpoint.merge import merge
    from dsdoctor.checkpoint.verify import verify

    merged = merge(checkpoint, tmp / "merged", model=model)
    checked = verify(tmp / "merged", model=model)
    summary = f"{merged.tensors} tensors written to merged/; verify: {len(checked.findings)} finding(s)."
    return {"summary": summary, "merge": merged.to_dict(lang), "verify": checked.to_dict(lang)}, list(checked.findings)


def diagnose(config=None, model=None, gpus: int | None = None, gpu_memory=None, host_memory=None, batch: int = 1,
             prompt_len: int = 512, new_tokens: int = 128, dtype: str | None = None, checkpoint=None,
             command: list[str] | None = None, out="dsdoctor-out", force: bool = False,
             timeout: float | None = None, lang: str = "en") -> DiagnoseResult:
    """Run the troubleshooting and write ``out/report.{md,html,json}`` plus the split inference config.

    Without ``config`` and ``model`` it runs on the bundled example (a ZeRO-3 offload training config reused
    for inference, and a 7B Llama-shaped config.json)."""
    if config is None and model is None:
        config, model = bundled_example()
    elif config is None:
        raise InputError("diagnose needs --config (the DeepSpeed config your inference uses)")
    elif model is None:
        raise InputError("diagnose needs --model (a local model directory or its config.json)")
    out = Path(out)
    steps: list[Step] = []
    from dsdoctor.config.load import load_config

    loaded = load_config(config)  # read once: check, plan and split share it (and its effective readings)
    with atomic_output_dir(out, force=force, inputs=[config, model, checkpoint], command="diagnose") as tmp:
        step, _ = _step_effective(loaded, model, gpus, lang)
        steps.append(step)
        # plan before running anything: bad workload flags must fail before the user's command has run
        plan_step, plan_result = _step_plan(model, loaded, gpus, gpu_memory, host_memory, batch, prompt_len,
                                            new_tokens, dtype, tmp, lang)
        if command:
            steps.append(_step_trace(command, tmp, timeout, lang))
        steps.append(plan_step)
        steps.append(_step_split(loaded, model, tmp, out, lang))
        if command and _cuda_available():
            steps.append(_step_ab(command, tmp, timeout, lang))
        else:
            why = _t("no command given (pass `-- python infer.py ...`)", "未给出命令（用 `-- python infer.py ...` 传入）") \
                if not command else _t("no GPU here: the A/B of GPU peaks needs one", "本机没有 GPU：A/B 显存峰值对比需要 GPU")
            run = f"dsdoctor ab --out ab -- {_shell(command) if command else 'python your_infer.py'}"
            steps.append(Step("ab", "skipped", _t(f"Skipped: {why['en']}.", f"已跳过：{why['zh']}。"),
                              commands=[run]))
        path = plan_result.recommended.path
        merged, merge_findings = None, []
        if checkpoint and (path in (None, "plain", "tp")):
            merged, merge_findings = _merge(checkpoint, model, tmp, lang)
        exit_step = _exit_step(path, plan_result, model, checkpoint, out, gpus, merged)
        exit_step.findings += merge_findings
        steps.append(exit_step)
        result = DiagnoseResult(str(config), str(model), str(out), steps, path, lang)
        write_report(result, tmp, lang, html_title="dsdoctor diagnosis")
    return result


def diagnose_exit_code(result: DiagnoseResult, fail_on: str) -> int:
    return exit_code(result.findings, fail_on)


