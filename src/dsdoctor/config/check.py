"""``dsdoctor check``: the effective settings of a DeepSpeed config and what is wrong with them.

config -> ``load_config`` -> ``effective_settings`` (raw DeepSpeed and HF Trainer readings) -> detectors ->
``CheckResult``. Detectors only append ``Finding``s; nothing is raised for a finding. Torch-free.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from dsdoctor.config import checks_configs
from dsdoctor.config.effective import AUTO, Effective, effective_settings
from dsdoctor.config.inference_config import InferenceSettings, read_inference_config
from dsdoctor.config.load import LoadedConfig, load_config
from dsdoctor.config.runner import MODES as RUNNER_MODES
from dsdoctor.config.runner import Runner, detect_runner
from dsdoctor.config.schema import DEEPSPEED_TOP_LEVEL_KEYS, INIT_INFERENCE_ALL_KEYS, INIT_INFERENCE_KEYS, lookup
from dsdoctor.config.versions import Versions, resolve_versions
from dsdoctor.dtypes import DTYPE_BYTES
from dsdoctor.errors import InputError
from dsdoctor.findings import Finding, Phrase, sort_findings
from dsdoctor.i18n import message_table, pick
from dsdoctor.model.formulas import from_formula
from dsdoctor.model.spec import ModelSpec, load_model_spec
from dsdoctor.report.render import Style, findings_markdown, findings_text, markdown_table, text_table
from dsdoctor.units import human_bytes, human_count
from dsdoctor.zero_costs import HOST_BYTES_PER_SHARD_ELEMENT, optimizer_cost

MODES = ("inference", "training") + RUNNER_MODES  # "training" is the old spelling of "train"

TEXT = message_table("config.check.TEXT")  # every word of the rendered settings table and header

@dataclass
class CheckResult:
    config: str
    kind: str
    mode: str
    effective: Effective  # raw deepspeed.initialize
    hf_trainer: Effective  # as the HF Trainer / accelerate fill it
    findings: list[Finding]
    model: dict | None = None
    gpus: int | None = None
    tp: int | None = None
    notes: list[str] = field(default_factory=list)
    ref_path: str | None = None  # the DeepSpeed JSON a YAML names
    runner: Runner | None = None  # what runs the config, and its mode
    versions: Versions | None = None  # DeepSpeed / transformers / accelerate versions checked against
    inference_config: InferenceSettings | None = None  # an init_inference config, as DeepSpeed reads it
    ref_missing: bool = False  # the DeepSpeed config a trainer names was not found
    stage_from_name: int | None = None  # its stage, as its file name says
    sections: dict = field(default_factory=dict)  # hybrid_engine / weight_quantization, as read

    def to_dict(self, lang: str = "en") -> dict:
        eff = self.effective.to_dict()
        eff.pop("values")
        hf = self.hf_trainer.to_dict()
        differs = {k: {"deepspeed": v.value, "hf_trainer": self.hf_trainer.values[k].value, "key": v.key,
                       "state": v.state, "note": self.hf_trainer.values[k].note}
                   for k, v in self.effective.values.items()
                   if k in self.hf_trainer.values and v.value != self.hf_trainer.values[k].value}
        hf.pop("values")
        return {
            "config": self.config, "kind": self.kind, "ref_path": self.ref_path, "mode": self.mode,
            "model": self.model,
            "gpus": self.gpus, "tp": self.tp,
            "effective": eff, "hf_trainer": hf, "readings_differ": differs,
            "values": {k: v.to_dict() for k, v in self.effective.values.items()},
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)],
            "notes": self.notes,
            "runner": self.runner.to_dict() if self.runner else None,
            "versions": self.versions.to_dict() if self.versions else None,
            "inference_config": self.inference_config.to_dict() if self.inference_config else None,
            "sections": self.sections,
        }

    def _inference_rows(self, lang: str):
        c = self.inference_config
        dtype = c.dtype + ("" if c.dtype_set else pick(TEXT["default"], lang))
        return [
            ("dtype", dtype, ""),
            ("tensor parallel", f"{c.tp_size}" + (f" ({c.tp_source})" if c.tp_source else ""), ""),
            ("replace_with_kernel_inject", str(c.kernel_inject).lower(), ""),
            ("enable_cuda_graph", str(c.enable_cuda_graph).lower(), ""),
            ("max_out_tokens", str(c.max_out_tokens), ""),
            ("checkpoint", c.checkpoint or "none", ""),
            ("ZeRO", pick(TEXT["zero ignored"] if c.zero else TEXT["no zero"], lang), ""),
        ]

    def _inference_section_rows(self, lang: str):
        """hybrid_engine and weight_quantization: what takes effect at inference."""
        rows = []
        he = self.sections.get("hybrid_engine")
        if he is not None:
            rows.append(("hybrid_engine", pick(TEXT["hybrid on"], lang) +
                         f" (pin_parameters={str(he['pin_parameters']).lower()}, "
                         f"inference_tp_size={he['inference_tp_size']})" if he["enabled"] else
                         pick(TEXT["disabled"], lang), ""))
        wq = self.sections.get("weight_quantization")
        if wq is not None:
            parts = []
            if wq.get("quantized_initialization"):
                parts.append(f"int{wq['num_bits']} quantized_initialization " + (
                    pick(TEXT["only zero.Init"] if self.effective.zero_stage == 3 else TEXT["needs stage 3"], lang)))
            if wq.get("post_init_quant"):
                parts.append("post_init_quant " + pick(TEXT["only if called"], lang))
            rows.append(("weight_quantization", "; ".join(parts) or pick(TEXT["none"], lang), ""))
        return rows

    def _rows(self, lang: str):
        if self.inference_config is not None:
            return self._inference_rows(lang)
        e, h = self.effective, self.hf_trainer
        fills = bool(self.runner and self.runner.fills_auto)
        if fills:  # the runner's reading first, raw deepspeed.initialize where it differs
            e, h = h, e

        def off(o):
            if o.device == "none":
                return "none"
            extra = f"pin_memory={str(o.pin_memory).lower()}"
            if o.device == "nvme":
                extra += f", nvme_path={o.nvme_path}"
            return f"{o.device} ({extra})"

        def show(v):
            if v is None:
                return pick(TEXT["from hidden_size"], lang)
            return human_count(v) if isinstance(v, int) and v >= 10_000 else str(v)

        def hfv(key, fmt=show):
            dv, hv = e.values.get(key), h.values.get(key)
            if dv is None or hv is None or dv.value == hv.value:
                return ""
            return fmt(hv.value) if hv.value is not None else hv.note

        rows = [
            ("ZeRO stage", e.zero_stage if not self.ref_missing else (
                "?" + (f" ({pick(TEXT['name says'], lang)} {self.stage_from_name})"
                       if self.stage_from_name is not None else "")), hfv("zero_stage")),
            ("offload_param", off(e.offload_param), ""),
            ("offload_optimizer", off(e.offload_optimizer), ""),
            ("dtype", e.dtype if e.dtype != "fp32" else pick(TEXT["fp32 no cast"], lang),
             _dtype_hf(h) if not fills else ""),
            ("tensor parallel", f"{e.tp_size}" + (f" ({e.tp_source})" if e.tp_source else ""), ""),
            ("optimizer", (e.optimizer_type or ("yes" if e.has_optimizer else "none")) + (
                pick(TEXT["trainer deletes"], lang)
                if e.has_optimizer and self.runner and self.runner.hf_trainer and self.runner.inference else ""), ""),
            ("scheduler", e.scheduler_type or ("yes" if e.has_scheduler else "none"), ""),
        ]
        if e.zero_stage == 3:
            rows += [
                ("stage3_prefetch_bucket_size", show(e.prefetch_bucket_size), hfv("prefetch_bucket_size")),
                ("stage3_param_persistence_threshold", show(e.param_persistence_threshold),
                 hfv("param_persistence_threshold")),
                ("stage3_max_live_parameters", show(e.max_live_parameters), hfv("max_live_parameters")),
            ]
        rows += self._inference_section_rows(lang)
        if e.has_optimizer or e.zero_stage in (1, 2):
            rows.append(("reduce_bucket_size", show(e.reduce_bucket_size), hfv("reduce_bucket_size")))
        mb = e.values.get("train_micro_batch_size_per_gpu")
        if mb is not None and fills:
            rows.append(("train_micro_batch_size_per_gpu",
                         "auto (TrainingArguments)" if mb.state == AUTO else (mb.value if mb.value is not None else "unset"),
                         "auto -> TypeError" if mb.state == AUTO else ""))
        elif mb is not None:
            rows.append(("train_micro_batch_size_per_gpu",
                         "auto -> TypeError" if mb.state == AUTO else (mb.value if mb.value is not None else "unset"),
                         "TrainingArguments" if mb.state == AUTO else ""))
        return rows

    def _head(self, lang: str) -> list[str]:
        def t(key):
            return pick(TEXT[key], lang)

        lines = [f"{t('config')}: {self.config} ({self.kind}), {t('mode')}: {self.mode}"]
        if self.runner:
            r = self.runner
            lines.append(f"{t('runner')}: {r.label}" + (f" [{r.command}]" if r.command else "")
                         + f", {t('mode')} {r.mode} ({r.mode_source})"
                         + (f", {t('model')} {r.model}" if r.model else ""))
        if self.versions:
            v = self.versions
            lines.append(t("versions") + ": " + ", ".join(
                f"{n} {v.get(n) or '-'}" + ("" if v.sources.get(n) in ("installed", None) else f" ({v.sources[n]})")
                for n in ("deepspeed", "transformers", "accelerate")))
        if self.ref_path:
            lines.append(f"{t('ds config')}: {self.ref_path}")
        if self.model:
            m = self.model
            active = m.get("active_params") or m["num_params"]
            moe = "" if active == m["num_params"] else t("active").format(active=human_count(active))
            lines.append(f"{t('model')}: {m['path']} ({human_count(m['num_params'])} params{moe}, "
                         f"{m['dtype'] or '?'})")
        return lines

    def to_text(self, lang: str = "en", style: Style | None = None) -> str:
        style = style or Style()
        out = "\n".join(self._head(lang)) + "\n\n"
        head = pick(TEXT["head"], lang)
        if self.inference_config is not None:
            head = pick(TEXT["head inference"], lang)
        elif self.runner and self.runner.fills_auto:
            head = tuple(h.format(runner=self.runner.label) for h in pick(TEXT["head runner"], lang))
        out += text_table(head, self._rows(lang)) + "\n"
        for note in self.notes:
            out += f"{style.info} {note}\n"
        return out + findings_text(self.findings, lang, style)

    def to_markdown(self, lang: str = "en") -> str:
        out = "### dsdoctor check\n\n" + "".join(f"- {line}\n" for line in self._head(lang)) + "\n"
        head = pick(TEXT["head markdown"], lang)
        out += markdown_table(head, self._rows(lang)) + "\n"
        return out + findings_markdown(self.findings, lang)


def _dtype_hf(h: Effective) -> str:
    f, b = h.values["fp16.enabled"], h.values["bf16.enabled"]
    if f.value is None or b.value is None:
        return "--bf16/--fp16 (auto)"
    return ""


def check(config, mode: str | None = None, model: str | os.PathLike | None = None, gpus: int | None = None,
          tp: int | None = None, versions: dict | None = None, gpu_name: str | None = None,
          runner: str | None = None) -> CheckResult:
    """Check a DeepSpeed config (path, dict or LoadedConfig) for what runs it and its mode.

    ``mode`` (train, eval, predict, predict-with-generate, inference; "training" = train) overrides the mode
    read from the file; by default a trainer's arguments say it and a bare DeepSpeed config is checked for
    inference. ``versions`` ({"deepspeed": "0.15.0", ...}) replaces the installed versions; ``gpu_name`` the GPU
    of this machine (for the dtype of a suggested config); ``runner`` ("hf-trainer", "llamafactory", ...) says what
    runs a bare DeepSpeed JSON.
    """
    if mode is not None and mode not in MODES:
        raise InputError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    for name, v in (("--gpus", gpus), ("--tp", tp)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise InputError(f"{name} must be a positive integer, not {v!r}")
    loaded, rl_job, found_rl = _load_with_rl_job(config)
    spec = load_model_spec(model) if model is not None else None
    runner_name = runner
    runner = detect_runner(loaded, mode, runner_name)
    if rl_job is not None and mode is None:  # generation inside training: read for training
        _read_for_training(runner, rl_job, found_rl)
    vers = resolve_versions(versions)
    if runner.name == "init_inference":  # read as DeepSpeedInferenceConfig (below); initialize's reading is moot
        eff, hf = effective_settings({}, "deepspeed"), effective_settings({}, "hf-trainer")
    else:
        eff, hf = read_both(loaded, spec)
    if gpus is None:
        gpus = loaded.num_processes
    inference_cfg = None
    if runner.name == "init_inference":
        inference_cfg = read_inference_config(loaded.raw)
        findings = checks_configs.init_inference_findings(inference_cfg, spec, gpu_name)
        if spec and spec.dtype == "bf16" and inference_cfg.dtype_set and inference_cfg.dtype == "fp16":
            findings.append(Finding("DSD110", {"model_dtype": spec.dtype, "source": f"dtype = {loaded.raw['dtype']}"}))
    else:
        primary = hf if runner.fills_auto else eff
        findings = detect(loaded, primary, hf, mode="inference" if runner.inference else "training", spec=spec,
                          gpus=gpus, tp=tp)
        dropped = set()
        if runner.fills_auto:
            dropped.add("DSD105")  # the runner fills every "auto"
        if runner.hf_trainer and runner.inference:
            dropped |= {"DSD101", "DSD102", "DSD115"}  # deepspeed_init(inference=True) deletes the optimizer
        findings = [f for f in findings if f.code not in dropped]
        for f in findings:
            if f.code == "DSD103" and "autotp" in str(f.values.get("source")):
                f.values["version_note"] = checks_configs.autotp_zero3_note(vers)
        findings += checks_configs.runner_findings(loaded, primary, runner, spec)
        zf = checks_configs.top_level_zero_finding(loaded.raw, eff, gpu_name, spec)
        if zf:
            findings.append(zf)
        findings += checks_configs.version_findings(loaded.raw, primary, runner, vers, spec, tp)
        findings += checks_configs.moe_findings(loaded.raw, primary, spec, vers, runner.inference, _elem_bytes(primary, spec))
        findings += _rl_findings(loaded, primary, runner, rl_job, found_rl, gpus)
        findings += checks_configs.weight_quantization_findings(loaded.raw, primary, runner)
    return CheckResult(
        config=loaded.name, kind=loaded.kind, mode=runner.mode, effective=eff, hf_trainer=hf,
        findings=sort_findings(findings), model=_model_summary(spec), gpus=gpus, tp=tp, notes=list(loaded.notes),
        ref_path=loaded.ref_path, runner=runner, versions=vers, inference_config=inference_cfg,
        ref_missing=loaded.ref_missing, stage_from_name=loaded.stage_from_name,
        sections=checks_configs.inference_sections(loaded.raw),
    )


def _load_with_rl_job(config) -> tuple[LoadedConfig, object, bool]:
    """The config, the RL job around it (an RL framework's launch line names its config) and whether a launch
    line was read."""
    from dsdoctor.config import rl, rl_checks

    found_rl = rl_checks.launch_config(config) if isinstance(config, (str, os.PathLike)) else None
    if found_rl:
        loaded, rl_job = found_rl
        return loaded, rl_job, True
    loaded = config if isinstance(config, LoadedConfig) else load_config(config)
    return loaded, rl.job_of_config(loaded.raw, loaded.source, loaded.path), False


def _read_for_training(runner, rl_job, found_rl: bool) -> None:
    """Generation inside training: the config is read for training, and the runner says what told it so."""
    from dsdoctor.config import rl_checks

    runner.mode = "train"
    if found_rl:
        runner.mode_source = f"{rl_checks.FRAMEWORK_LABELS[rl_job.framework]} launch line"
    else:
        runner.mode_source = "trl arguments" if rl_job.framework == "trl" else "hybrid_engine block (RLHF actor)"


def _rl_findings(loaded: LoadedConfig, primary: Effective, runner, rl_job, found_rl: bool, gpus) -> list:
    """The RL job's findings, and hybrid_engine's (a launch line's hybrid_engine is the framework's own:
    DSD141/DSD143 say what it does)."""
    from dsdoctor.config import rl_checks

    findings = []
    if rl_job is not None and not runner.inference:
        findings += rl_checks.findings(rl_job, primary.zero_stage, gpus)
        if not found_rl and rl_job.framework == "deepspeed-chat":
            findings.append(rl_checks.actor_config_finding(loaded))
    if not found_rl:
        findings += checks_configs.hybrid_engine_findings(loaded.raw, primary, gpus)
    return findings


def read_both(loaded: LoadedConfig, spec: ModelSpec | None) -> tuple[Effective, Effective]:
    """Both readings (cached on ``loaded``), with the file named in any error."""
    return loaded.effective("deepspeed"), loaded.effective("hf-trainer", spec.hidden_size if spec else None)


def _model_summary(spec: ModelSpec | None) -> dict | None:
    if spec is None:
        return None
    return {"path": spec.path, "model_type": spec.model_type, "num_params": spec.num_params, "dtype": spec.dtype,
            "hidden_size": spec.hidden_size, "counted_by": spec.counted_by, "active_params": spec.active_params}


def _elem_bytes(eff: Effective, spec: ModelSpec | None) -> int:
    if eff.dtype in ("bf16", "fp16"):
        return DTYPE_BYTES[eff.dtype]
    if spec and spec.dtype in DTYPE_BYTES:
        return DTYPE_BYTES[spec.dtype]
    return 2


@dataclass
class Context:
    """What every DSD1xx detector reads: one config, both readings, the mode and the optional model."""

    loaded: LoadedConfig
    eff: Effective  # raw deepspeed.initialize
    hf: Effective  # as the HF Trainer fills it
    infer: bool
    spec: ModelSpec | None
    gpus: int | None
    tp: int | None

    @property
    def raw(self) -> dict:
        return self.loaded.raw

    @property
    def name(self) -> str:
        return self.loaded.path or "ds_config.json"

    @property
    def elem_bytes(self) -> int:
        return _elem_bytes(self.eff, self.spec)


def detect(loaded: LoadedConfig, eff: Effective, hf: Effective, *, mode: str = "inference",
           spec: ModelSpec | None = None, gpus: int | None = None, tp: int | None = None) -> list[Finding]:
    """All DSD1xx findings for one config. Other packages call this with a LoadedConfig they already have."""
    ctx = Context(loaded, eff, hf, mode == "inference", spec, gpus, tp)
    return sort_findings([f for detector in DETECTORS for f in detector(ctx)])


def ref_missing(c: Context):  # DSD113
    if c.loaded.ref_missing:
        yield Finding("DSD113", {"ref": c.loaded.ref_path, "yaml": c.loaded.path})


def not_a_deepspeed_config(c: Context):  # DSD116
    if not c.loaded.ref_missing and not any(k in DEEPSPEED_TOP_LEVEL_KEYS for k in c.raw):
        yield Finding("DSD116", {"config": c.name})


def rejected_keys(c: Context):  # DSD114
    for key, why in c.eff.invalid_keys:
        yield Finding("DSD114", {"key": key, "why": why})


def optimizer_in_inference(c: Context):  # DSD101
    eff, spec = c.eff, c.spec
    if not (c.infer and eff.has_optimizer):
        return
    world = c.gpus or c.loaded.num_processes or 1
    cost = optimizer_cost(spec.num_params if spec else 0, world, eff.offload_optimizer.device, c.elem_bytes,
                          eff.reduce_bucket_size)
    if spec and cost["host"]:
        what = Phrase("host", {"amount": human_bytes(cost["host"])})
    elif spec:
        what = Phrase("gpu", {"amount": human_bytes(cost["gpu"])})
    elif eff.offload_optimizer.enabled:
        what = Phrase("per-shard-param", {"bytes": HOST_BYTES_PER_SHARD_ELEMENT})
    else:
        what = Phrase("master-on-gpu")
    yield Finding("DSD101", {
        "optimizer": eff.optimizer_type or "optimizer", "config": c.name, "world_size": world,
        "cost": Phrase("with-bucket", {"cost": what, "bucket": human_bytes(cost["bucket"]), "world": world}),
        "host_bytes_per_rank": cost["host"] if spec else None, "gpu_bytes_per_rank": cost["gpu"] if spec else None,
        "gpu_bucket_bytes": cost["bucket"],
    })


def offload_optimizer_in_inference(c: Context):  # DSD102 (without an optimizer: DSD112)
    eff = c.eff
    if c.infer and eff.offload_optimizer.enabled and eff.has_optimizer:
        master = human_bytes(4 * c.spec.num_params) if c.spec else "4 B/param"
        yield Finding("DSD102", {"device": eff.offload_optimizer.device, "master": master})


def zero3_with_tensor_parallel(c: Context):  # DSD103
    tp_size, tp_source = c.eff.tp_size, c.eff.tp_source
    if c.tp and c.tp > tp_size:
        tp_size, tp_source = c.tp, "--tp"
    if c.infer and c.eff.zero_stage == 3 and tp_size > 1:
        yield Finding("DSD103", {"stage": c.eff.zero_stage, "tp_size": tp_size, "source": tp_source,
                                 "version_note": Phrase("none")})


def init_inference_keys_mixed(c: Context):  # DSD104
    raw = c.raw
    inference_keys = sorted(k for k in raw if k in INIT_INFERENCE_KEYS)
    tpc = raw.get("tensor_parallel")
    if isinstance(tpc, dict) and ("tp_size" in tpc or "tp" in tpc) and "autotp_size" not in tpc:
        inference_keys.append("tensor_parallel.tp_size")
    if inference_keys:
        other = sorted(k for k in raw if k not in INIT_INFERENCE_ALL_KEYS and not k.startswith("_"))
        if other:
            yield Finding("DSD104", {"inference_keys": ", ".join(inference_keys), "other_keys": ", ".join(other)})


_CRASH_ON_AUTO = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "gradient_clipping", "optimizer", "scheduler")


def unfilled_auto(c: Context):  # DSD105
    autos = c.eff.autos
    if not autos:
        return
    crash = [v for v in autos if v.value is None and v.key.split(".")[0] in _CRASH_ON_AUTO]
    summary = ", ".join(f"{v.key} -> TypeError" if v in crash else f"{v.key} -> {_show(v.value)}" for v in autos)
    f = Finding("DSD105", {"count": len(autos), "summary": summary, "config": c.name,
                           "keys": [v.key for v in autos], "crash_keys": [v.key for v in crash]})
    if not c.infer:
        f.severity = "info"  # training goes through the Trainer/accelerate, which fill them
    elif crash:
        f.severity = "error"
    yield f


def offload_param_below_stage3(c: Context):  # DSD106
    if c.eff.offload_param.enabled and c.eff.zero_stage < 3:
        yield Finding("DSD106", {"device": c.eff.offload_param.device, "stage": c.eff.zero_stage})


def pinned_host_memory(c: Context):  # DSD107
    op, eb = c.eff.offload_param, c.elem_bytes
    if op.enabled and op.pin_memory and c.eff.zero_stage == 3:
        if op.device == "cpu":
            pinned = human_bytes(c.spec.num_params * eb) if c.spec else f"{eb} B/param"
        else:
            pinned = f"{human_bytes(op.buffer_count * op.buffer_size * eb)}/rank"
        yield Finding("DSD107", {"device": op.device, "pinned": pinned})


def nvme_without_path(c: Context):  # DSD108
    eff = c.eff
    for section, o in (("offload_param", eff.offload_param), ("offload_optimizer", eff.offload_optimizer)):
        if o.device == "nvme" and not o.nvme_path and (section == "offload_param" or not c.infer or eff.has_optimizer):
            yield Finding("DSD108", {"section": section})


def stage3_knobs_raise_peak(c: Context):  # DSD109
    if not (c.infer and c.eff.zero_stage == 3):
        return
    spec, eb = c.spec, c.elem_bytes
    for canonical in ("prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold"):
        v = c.eff.values[canonical]
        if v.value is None or v.value <= v.default:
            continue
        if canonical == "param_persistence_threshold":
            small = sum(p.numel for p in from_formula(spec).params if p.numel < v.value) if spec else 0
            nbytes = human_bytes(small * eb) if spec else "? (--model)"
        else:
            nbytes = human_bytes((v.value if not spec else min(v.value, spec.num_params)) * eb)
        yield Finding("DSD109", {"knob": v.key.split(".", 1)[1], "value": human_count(v.value),
                                 "default": human_count(v.default), "bytes": nbytes}, deletes=(v.key,))


def fp16_for_bf16_model(c: Context):  # DSD110
    if c.spec and c.spec.dtype == "bf16" and c.eff.dtype == "fp16":
        src = c.eff.values["fp16.enabled"]
        source = "accelerate mixed_precision: fp16" if c.loaded.mixed_precision == "fp16" and src.state != "set" \
            else f"{src.key} = {str(src.raw).lower()}"
        yield Finding("DSD110", {"model_dtype": c.spec.dtype, "source": source})


def zero3_on_one_gpu(c: Context):  # DSD111
    if c.infer and c.gpus == 1 and c.eff.zero_stage == 3 and not c.eff.offload_param.enabled:
        yield Finding("DSD111", {"gpus": c.gpus})


def zero12_at_inference(c: Context):  # DSD115: no weight sharding; asserts without an optimizer
    if c.infer and c.eff.zero_stage in (1, 2):
        f = Finding("DSD115", {"stage": c.eff.zero_stage, "has_optimizer": c.eff.has_optimizer})
        if not c.eff.has_optimizer:
            f.severity = "error"
        yield f


def training_only(c: Context):  # DSD112
    if not c.infer:
        return
    present = training_only_keys(c.raw)
    if c.eff.offload_optimizer.present and not c.eff.has_optimizer:
        present.append("zero_optimization.offload_optimizer")
    if present:
        yield Finding("DSD112", {"count": len(present), "keys": ", ".join(present), "config": c.name})


# one small detector per code; each yields its findings (never raises one)
def prefetch_disabled(c: Context):  # DSD322
    """A ZeRO-3 prefetch bucket or live-parameter budget of 0 switches prefetching off."""
    eff = c.eff
    if eff.zero_stage != 3:
        return
    zeros = [eff.values[k] for k in ("prefetch_bucket_size", "max_live_parameters")
             if eff.values[k].value is not None and eff.values[k].value == 0]
    if not zeros:
        return
    keys = [v.key for v in zeros]
    yield Finding("DSD322", {
        "knobs": ", ".join(f"{k} = 0" for k in keys), "keys": " and ".join(keys),
        "default_prefetch": human_count(eff.values["prefetch_bucket_size"].default),
        "default_live": human_count(eff.values["max_live_parameters"].default)}, deletes=tuple(keys))


DETECTORS = (
    ref_missing, not_a_deepspeed_config, rejected_keys, optimizer_in_inference, offload_optimizer_in_inference,
    zero3_with_tensor_parallel, init_inference_keys_mixed, unfilled_auto, offload_param_below_stage3,
    pinned_host_memory, nvme_without_path, stage3_knobs_raise_peak, fp16_for_bf16_model, zero3_on_one_gpu,
    zero12_at_inference, training_only, prefetch_disabled,
)




def training_only_keys(raw: dict) -> list[str]:
    """Keys of ``raw`` (as written) that the schema marks training-only."""
    def wanted(path):
        f = lookup(path)
        return f is not None and f.training_only

    out = []
    for k, v in raw.items():
        if wanted(k):
            out.append(k)
        if isinstance(v, dict) and k in ("zero_optimization", "fp16", "bf16", "bfloat16"):
            out += [f"{k}.{sub}" for sub in v if wanted(f"{k}.{sub}")]
    return out


def _show(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return str(value)
