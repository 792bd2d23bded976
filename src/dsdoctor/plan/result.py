"""The result of ``dsdoctor plan``: one serializable type shared by text, JSON, Markdown and the plots."""
from __future__ import annotations

from dataclasses import dataclass, field

from dsdoctor.findings import Finding, sort_findings
from dsdoctor.report.render import findings_markdown, findings_text, markdown_table, text_table
from dsdoctor.units import human_bytes, human_count

LABELS = {
    "weights_resident": ("resident weights", "常驻权重"),
    "persistent_params": ("persistent small params", "常驻小参数"),
    "gathered_params": ("gathered/prefetched params", "收集/预取的参数"),
    "kv_cache": ("KV cache", "KV cache"),
    "activations": ("activations", "激活"),
    "logits": ("logits (+fp32 copy)", "logits（含 fp32 拷贝）"),
    "cublas_workspace": ("cuBLAS workspace", "cuBLAS 工作区"),
    "load_transient": ("load transient", "加载时临时占用"),
    "reduce_bucket": ("reduce bucket (training config)", "reduce bucket（训练配置）"),
    "optimizer_state": ("optimizer fp32 master + gradient partitions (training config)",
                        "优化器 fp32 主参数与梯度分片（训练配置）"),
    "checkpoint_while_loading": ("checkpoint shard while loading", "加载时的检查点分片"),
    "model_copy_while_sharding": ("host copy while sharding", "切分时的主机副本"),
    "offloaded_params_pinned": ("offloaded params (pinned)", "卸载的参数（锁页）"),
    "offloaded_params": ("offloaded params", "卸载的参数"),
    "nvme_swap_buffers_pinned": ("NVMe swap buffers (pinned)", "NVMe 交换缓冲（锁页）"),
    "outside_allocator": ("CUDA context + NCCL", "CUDA context + NCCL"),
}


def label(key: str, lang: str) -> str:
    en, zh = LABELS.get(key, (key, key))
    return zh if lang == "zh" else en


@dataclass
class PathPlan:
    name: str
    ranks: int
    replicas: int
    gpu_peak_bytes: int
    gpu_reserved_bytes: int
    gpu_outside_allocator_bytes: int
    host_peak_bytes: int
    fits: bool
    limits: list  # why it does not fit: gpu, host
    peak_at: str
    tokens_per_s: float
    decode_tokens_per_s: float
    bound: str
    breakdown: dict
    host_breakdown: dict
    max_batch: int | None = None
    max_prompt_len: int | None = None
    notes: list = field(default_factory=list)
    fragmentation_bytes: int = 0  # reserved beyond allocated that the caching allocator cannot reuse
    speed_terms: dict = field(default_factory=dict)  # decode-step seconds by term

    def to_dict(self) -> dict:
        return {
            "name": self.name, "ranks": self.ranks, "replicas": self.replicas,
            "gpu_peak_bytes": self.gpu_peak_bytes, "gpu_reserved_bytes": self.gpu_reserved_bytes,
            "gpu_outside_allocator_bytes": self.gpu_outside_allocator_bytes,
            "host_peak_bytes": self.host_peak_bytes, "fits": self.fits, "limits": self.limits,
            "peak_at": self.peak_at, "tokens_per_s": round(self.tokens_per_s, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3), "bound": self.bound,
            "breakdown": self.breakdown, "host_breakdown": self.host_breakdown,
            "max_batch": self.max_batch, "max_prompt_len": self.max_prompt_len, "notes": self.notes,
            "fragmentation_bytes": self.fragmentation_bytes, "speed_terms": self.speed_terms,
        }


@dataclass
class Recommendation:
    path: str | None
    why: dict  # lang -> text
    ds_config: dict | None
    code: str | None

    def to_dict(self, lang: str) -> dict:
        return {"path": self.path, "why": self.why.get(lang) or self.why.get("en"), "ds_config": self.ds_config,
                "code": self.code}


@dataclass
class PlanResult:
    model: dict
    workload: dict
    hardware: dict
    knobs: dict | None
    paths: list[PathPlan]
    recommended: Recommendation
    findings: list[Finding]
    weights_only_bytes: int

    def path(self, name: str) -> PathPlan | None:
        return next((p for p in self.paths if p.name == name), None)

    def to_dict(self, lang: str = "en") -> dict:
        return {
            "model": self.model, "workload": self.workload, "hardware": self.hardware, "config": self.knobs,
            "weights_only_bytes": self.weights_only_bytes,
            "paths": [p.to_dict() for p in self.paths],
            "recommended": self.recommended.to_dict(lang),
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)],
        }

    def _rows(self, lang: str, ok: str, no: str):
        rows = []
        for p in self.paths:
            star = "*" if p.name == self.recommended.path else ""
            rows.append((
                p.name + star, p.ranks, human_bytes(p.gpu_peak_bytes), human_bytes(p.gpu_reserved_bytes),
                human_bytes(p.host_peak_bytes), ok if p.fits else f"{no} " + ",".join(p.limits),
                f"{p.tokens_per_s:.1f}", p.max_batch if p.max_batch is not None else "-",
                p.max_prompt_len if p.max_prompt_len is not None else "-",
            ))
        head_en = ("path", "ranks", "GPU peak", "GPU reserved", "host peak", "fits", "tok/s/rank", "max batch",
                   "max prompt")
        head_zh = ("方式", "rank 数", "GPU 峰值", "GPU 预留", "主机峰值", "放得下", "token/s/rank", "最大 batch",
                   "最长 prompt")
        return (head_zh if lang == "zh" else head_en), rows

    def _calibration(self, lang: str) -> str:
        prof = self.hardware.get("profile") or {}
        when = prof.get("calibrated_at")
        if when:
            src = f" ({prof['source']})" if prof.get("source") else ""
            rest = prof.get("assumed") or []
            tail = ("; assumed: " + ", ".join(rest)) if rest and lang == "en" else ("；假定：" + ", ".join(rest)) if rest else ""
            return (f"calibrated on {when[:10]}{src}{tail}" if lang == "en" else f"校准于 {when[:10]}{src}{tail}")
        return ("assumed, not measured (run `dsdoctor calibrate` on this machine)" if lang == "en"
                else "假定值，未测量（在本机运行 `dsdoctor calibrate`）")

    def _header(self, lang: str) -> str:
        m, w, h = self.model, self.workload, self.hardware
        if lang == "zh":
            return (f"模型 {m['model_type']}：{human_count(m['num_params'])} 参数（{m['counted_by']}），"
                    f"仅权重 {human_bytes(self.weights_only_bytes)}\n"
                    f"负载：每 rank batch {w['batch']}，prompt {w['prompt_len']}，新 token {w['new_tokens']}，{w['dtype']}\n"
                    f"硬件：{h['gpus']} x {human_bytes(h['gpu_memory'])} GPU，主机 {human_bytes(h['host_memory'])}\n"
                    f"机器指标：{self._calibration('zh')}\n")
        return (f"model {m['model_type']}: {human_count(m['num_params'])} params ({m['counted_by']}), "
                f"weights alone {human_bytes(self.weights_only_bytes)}\n"
                f"workload: batch {w['batch']} per rank, prompt {w['prompt_len']}, {w['new_tokens']} new tokens, {w['dtype']}\n"
                f"hardware: {h['gpus']} x {human_bytes(h['gpu_memory'])} GPU, host {human_bytes(h['host_memory'])}\n"
                f"machine figures: {self._calibration('en')}\n")

    def _breakdown_lines(self, lang: str) -> list[str]:
        lines = []
        for p in self.paths:
            parts = ", ".join(f"{label(k, lang)} {human_bytes(v)}" for k, v in p.breakdown.items())
            at = {"load": "加载", "prefill": "prefill", "decode": "decode"}[p.peak_at] if lang == "zh" else p.peak_at
            lines.append(f"  {p.name} ({'峰值在' if lang == 'zh' else 'peak at'} {at}): {parts}")
        return lines

    def to_text(self, lang: str = "en", style=None) -> str:
        head, rows = self._rows(lang, style.ok if style else "yes", style.error if style else "no")
        out = [self._header(lang), text_table(head, rows)]
        out.append(("每卡峰值构成：" if lang == "zh" else "per-GPU peak breakdown:") + "\n"
                   + "\n".join(self._breakdown_lines(lang)) + "\n")
        rec = self.recommended
        if rec.path:
            out.append(("推荐" if lang == "zh" else "recommended") + f": {rec.path}: {rec.why.get(lang, rec.why['en'])}\n")
            out.append(rec.code.rstrip() + "\n")
        out.append(findings_text(self.findings, lang, style) if style else "")
        return "\n".join(x for x in out if x)

    def to_markdown(self, lang: str = "en") -> str:
        head, rows = self._rows(lang, "yes" if lang == "en" else "是", "no" if lang == "en" else "否")
        title = "# dsdoctor plan\n\n" if lang == "en" else "# dsdoctor 加载方案\n\n"
        out = [title, self._header(lang).replace("\n", "  \n"), "\n", markdown_table(head, rows), "\n"]
        bhead = ("path", "part", "bytes") if lang == "en" else ("方式", "部分", "字节")
        brows = [(p.name, label(k, lang), human_bytes(v)) for p in self.paths for k, v in p.breakdown.items()]
        out += [markdown_table(bhead, brows), "\n"]
        rec = self.recommended
        if rec.path:
            out.append(("**推荐**" if lang == "zh" else "**Recommended**")
                       + f": `{rec.path}`: {rec.why.get(lang, rec.why['en'])}\n\n```python\n{rec.code}```\n\n")
        out.append(findings_markdown(self.findings, lang))
        return "".join(out)
