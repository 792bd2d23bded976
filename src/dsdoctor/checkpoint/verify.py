"""``dsdoctor verify``: strict check of merged weights against the model their config describes.

The model is built on the meta device (no memory, no weights), so keys, shapes and ties come from the real
architecture; tensors are then read one at a time for the value checks (zero-size, NaN/Inf, ties) and,
with a reference, compared with the reference's tensors and logits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dsdoctor import door
from dsdoctor.checkpoint.merge import kv_lines
from dsdoctor.checkpoint.weights import Entry, index_weights, load_tensor
from dsdoctor.dtypes import normalize_dtype
from dsdoctor.errors import InputError
from dsdoctor.findings import Finding, sort_findings
from dsdoctor.i18n import message_table, pick
from dsdoctor.report.render import (
    Style,
    findings_markdown,
    findings_text,
    markdown_table,
)
from dsdoctor.units import human_count

LOGITS_MAX_PARAMS = 3_000_000_000  # above this the CPU forward pass is skipped (noted in the result)
# |x| above which a trained parameter is taken as damaged bytes, not a weight (DSD413 explains the choice);
# only parameters are checked, buffers may hold mask constants (-1e4, the dtype's minimum)
IMPLAUSIBLE_ABS = 1e4
SCAN_CHUNK = 1 << 24
EPS = {"float32": 2.0**-23, "float64": 2.0**-52, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


# the words of the rendered verify, per language
TEXT = message_table("checkpoint.verify.TEXT")  # the texts live in dsdoctor/messages.json


@dataclass
class VerifyResult:
    out_dir: str
    model: str
    reference: str | None
    tensors: int
    parameters: int
    expected: int
    tied_groups: list[list[str]]
    compared_with_reference: int = 0
    max_abs_diff: float | None = None
    logits_max_abs_diff: float | None = None
    logits_top1_agreement: float | None = None
    notes: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self, lang: str = "en") -> dict:
        return {
            "out_dir": self.out_dir, "model": self.model, "reference": self.reference, "tensors": self.tensors,
            "parameters": self.parameters, "expected_tensors": self.expected, "tied_groups": self.tied_groups,
            "compared_with_reference": self.compared_with_reference, "max_abs_diff": self.max_abs_diff,
            "logits_max_abs_diff": self.logits_max_abs_diff, "logits_top1_agreement": self.logits_top1_agreement,
            "notes": self.notes, "ok": not any(f.effective_severity == "error" for f in self.findings),
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)],
        }

    def _rows(self, lang: str):
        def t(key):
            return pick(TEXT[key], lang)

        rows = [
            (t("weights"), f"{self.out_dir}: {self.tensors} tensors, {human_count(self.parameters)} parameters"),
            (t("model"), f"{self.model}: {self.expected} tensors expected"),
            (t("tied"), "; ".join(" = ".join(g) for g in self.tied_groups) or "-"),
        ]
        if self.reference:
            rows.append((t("reference"), f"{self.reference}: {self.compared_with_reference} tensors "
                                         f"compared, max |diff| {self.max_abs_diff}"))
            if self.logits_max_abs_diff is not None:
                rows.append(("logits", f"max |diff| {self.logits_max_abs_diff:.3g}, top-1 agreement "
                                       f"{self.logits_top1_agreement:.0%}"))
        rows += [(t("note"), n) for n in self.notes]
        return rows

    def to_text(self, lang: str = "en", style: Style | None = None) -> str:
        style = style or Style()
        ok = not any(f.effective_severity == "error" for f in self.findings)
        head = f"{style.ok} {pick(TEXT['verified'], lang)}" if ok else f"{style.error} {pick(TEXT['failed'], lang)}"
        lines = [head] + kv_lines(self._rows(lang))
        return "\n".join(lines) + "\n" + findings_text(self.findings, lang, style)

    def to_markdown(self, lang: str = "en") -> str:
        head = ("", pick(TEXT["verify"], lang))
        return markdown_table(head, self._rows(lang)) + "\n" + findings_markdown(self.findings, lang)


def _load_config(model):
    d = Path(model)
    if not (d / "config.json").is_file():
        raise InputError("no config.json", path=d, hint="--model takes the model directory (config.json)")
    door.check_library_files([d / "config.json"], door.MODEL_CONFIG)  # transformers reads it whole
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(str(d), trust_remote_code=False, local_files_only=True)
    except Exception as exc:
        raise InputError(f"cannot build the config: {type(exc).__name__}: {exc}", path=d / "config.json") from None


def _build(config, device: str):
    import torch
    import transformers

    auto = transformers.AutoModelForCausalLM
    try:
        with torch.device(device):
            return auto.from_config(config, trust_remote_code=False)
    except ValueError:  # not a causal LM: the base model
        with torch.device(device):
            return transformers.AutoModel.from_config(config, trust_remote_code=False)


def _config_dtype(config) -> str | None:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return str(dt).removeprefix("torch.") if dt is not None else None


def _scan_values(t) -> tuple[bool, float]:
    """(all finite, largest |x|) of a tensor, a bounded chunk at a time (no full-size temporaries)."""
    import torch

    flat = t.reshape(-1)
    peak = 0.0
    for chunk in flat.split(SCAN_CHUNK):
        if not bool(torch.isfinite(chunk).all()):
            return False, float("inf")
        peak = max(peak, chunk.abs().max().item())
    return True, peak


def expected_tensors(model) -> tuple[dict[str, tuple], list[list[str]]]:
    """state dict name -> shape, and groups of names that are one tensor (ties), from a meta model."""
    sd = model.state_dict(keep_vars=True)
    by_id: dict[int, list[str]] = {}
    for name, t in sd.items():
        by_id.setdefault(id(t), []).append(name)
    groups = [names for names in by_id.values() if len(names) > 1]
    return {name: tuple(t.shape) for name, t in sd.items()}, groups


def verify(out_dir, model, reference=None, logits: bool = True) -> VerifyResult:  # noqa: C901,PLR0912,PLR0915
    """Check merged weights in ``out_dir`` against the model whose config is in ``model``."""
    weights = index_weights(out_dir)
    config = _load_config(model)
    try:
        meta = _build(config, "meta")
    except Exception as exc:
        raise InputError(f"cannot build the model from its config: {type(exc).__name__}: {exc}", path=model) from None
    expected, tied = expected_tensors(meta)
    parameters = {n for n, _ in meta.named_parameters(remove_duplicate=False)}
    del meta

    findings: list[Finding] = []
    result = VerifyResult(out_dir=str(out_dir), model=str(model), reference=str(reference) if reference else None,
                          tensors=len(weights), parameters=sum(e.numel for e in weights.values()),
                          expected=len(expected), tied_groups=tied)
    tied_of = {n: g for g in tied for n in g}
    missing = [n for n in expected if n not in weights and not any(m in weights for m in tied_of.get(n, []))]
    unexpected = sorted(n for n in weights if n not in expected)
    if missing:
        findings.append(Finding("DSD401", {"count": len(missing), "out_dir": str(out_dir), "names": _names(missing)}))
    if unexpected:
        findings.append(Finding("DSD402", {"count": len(unexpected), "out_dir": str(out_dir),
                                           "names": _names(unexpected)}))
    empty, mismatched = [], []
    for name, e in weights.items():
        want = expected.get(name)
        if want is None or e.shape == want:
            continue
        if e.numel == 0 and any(d for d in want):
            empty.append(name)
        else:
            mismatched.append(f"{name} {list(e.shape)} != {list(want)}")
    if empty:
        findings.append(Finding("DSD404", {"count": len(empty), "names": _names(empty)}))
    if mismatched:
        findings.append(Finding("DSD403", {"count": len(mismatched), "details": _names(mismatched, 3)}))

    want_dtype = _config_dtype(config)
    floats = [e for e in weights.values() if e.dtype in EPS]
    if want_dtype in EPS:
        off = sorted({e.dtype for e in floats if e.dtype != want_dtype})
        if off:
            count = sum(1 for e in floats if e.dtype != want_dtype)
            short = normalize_dtype(want_dtype) or want_dtype
            findings.append(Finding("DSD406", {"count": count, "found": "/".join(off), "expected": want_dtype,
                                               "expected_short": short}))

    nonfinite, implausible, largest, worst = [], [], 0.0, None
    for e in floats:
        if not e.numel:
            continue
        finite, peak = _scan_values(load_tensor(e))
        if not finite:
            nonfinite.append(e.name)
        elif e.name in parameters and peak > IMPLAUSIBLE_ABS and e.dtype in EPS:
            implausible.append(e.name)
            if peak > largest:
                largest, worst = peak, e.name
    if nonfinite:
        findings.append(Finding("DSD405", {"count": len(nonfinite), "names": _names(nonfinite)}))
    if implausible:
        findings.append(Finding("DSD413", {"count": len(implausible), "largest": f"{largest:.3g}", "worst": worst,
                                           "limit": f"{IMPLAUSIBLE_ABS:g}", "names": _names(implausible)}))

    for group in tied:
        present = [n for n in group if n in weights and weights[n].shape == expected[n]]
        if len(present) > 1:
            first = load_tensor(weights[present[0]]).float()
            for other in present[1:]:
                diff = (first - load_tensor(weights[other]).float()).abs().max().item() if first.numel() else 0.0
                if diff != 0.0:
                    findings.append(Finding("DSD407", {"names": f"{present[0]} / {other}", "max_diff": f"{diff:.3g}"}))

    if reference is not None:
        _compare_reference(result, findings, weights, index_weights(reference), tied_of, expected)
        if logits and not any(f.code in ("DSD401", "DSD403", "DSD404") for f in findings):
            _compare_logits(result, findings, config, weights, index_weights(reference))
    result.findings = findings
    return result


def _tolerance(a: str, b: str) -> float:
    return max(EPS.get(a, 0.0), EPS.get(b, 0.0)) if a != b else 0.0


def _compare_reference(result, findings, weights: dict[str, Entry], ref: dict[str, Entry], tied_of, expected):
    """Every reference tensor against ours (a tied partner stands in for an alias stored once)."""
    import torch

    worst_name, worst, bad, compared, only_ref = None, 0.0, [], 0, []
    for name, r in ref.items():
        e = weights.get(name) or next((weights[m] for m in tied_of.get(name, []) if m in weights), None)
        if e is None:
            only_ref.append(name)
            continue
        compared += 1
        if e.shape != r.shape:
            bad.append(name)
            continue
        a, b = load_tensor(e), load_tensor(r)
        if not (a.is_floating_point() and b.is_floating_point()):
            diff = 0.0 if torch.equal(a, b.to(a.dtype)) else float("inf")
            ok = diff == 0.0
        else:
            a32, b32 = a.float(), b.float()
            delta = (a32 - b32).abs()
            diff = delta.max().item() if delta.numel() else 0.0
            # exact when both have the same dtype, else one rounding of the narrower dtype
            ok = bool((delta <= _tolerance(e.dtype, r.dtype) * b32.abs()).all())
        if not ok:
            bad.append(name)
        if worst_name is None or diff > worst or diff != diff:
            worst, worst_name = diff, name
    result.compared_with_reference = compared
    result.max_abs_diff = worst
    if only_ref:
        result.notes.append(f"{len(only_ref)} reference tensor(s) not in the weights: {_names(only_ref, 3)}")
    if bad:
        findings.append(Finding("DSD408", {"count": len(bad), "reference": result.reference,
                                           "max_diff": f"{worst:.3g}", "worst": worst_name}))


def _load_into(model, weights: dict[str, Entry]):
    import torch

    sd = {n: load_tensor(e) for n, e in weights.items()}
    with torch.no_grad():
        model.load_state_dict(sd, strict=False)
    model.tie_weights()


def _compare_logits(result, findings, config, weights, ref):
    import torch

    if result.parameters > LOGITS_MAX_PARAMS:
        result.notes.append(f"logits not compared: {human_count(result.parameters)} parameters is over the CPU limit")
        return
    torch.manual_seed(0)
    model = _build(config, "cpu").float().eval()
    vocab = getattr(config, "vocab_size", None) or 32
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    outs = []
    for w in (weights, ref):
        _load_into(model, w)
        with torch.no_grad():
            out = model(input_ids=ids)
        outs.append((out.logits if hasattr(out, "logits") else out[0]).float())
    ours, theirs = outs
    diff = (ours - theirs).abs().max().item()
    agreement = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    # identical weights give identical logits (same model, same CPU kernels); weights stored in a narrower
    # dtype than the other side's may move the logits by a few roundings of that dtype
    dtypes = {e.dtype for e in list(weights.values()) + list(ref.values()) if e.dtype in EPS}
    narrow = max((EPS[d] for d in dtypes), default=0.0) if len(dtypes) > 1 else 0.0
    tol = 8 * narrow * max(1.0, theirs.abs().max().item())
    result.logits_max_abs_diff, result.logits_top1_agreement = diff, agreement
    if diff > tol:
        findings.append(Finding("DSD409", {"max_diff": f"{diff:.3g}", "tolerance": f"{tol:.3g}",
                                           "agreement": f"{agreement:.0%}"}))
