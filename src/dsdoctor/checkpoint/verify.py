"""``dsdoctor verify``: strict check of merged weights against the model their config describes.

The model is built on the meta device (no memory, no weights), so keys, shapes and ties come from the real
architecture; tensors are then read one at a time for the value checks (zero-size, NaN/Inf, ties) and,
with a reference, compared with the reference's tensors and logits.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from dsdoctor import door
from dsdoctor.checkpoint import lora, moe
from dsdoctor.checkpoint.checks import Values, names, names_and_shapes, tensor_bytes
from dsdoctor.checkpoint.layout import checkpoint_near
from dsdoctor.checkpoint.merge import kv_lines
from dsdoctor.checkpoint.weights import Entry, index_weights, load_tensor
from dsdoctor.dtypes import normalize_dtype
from dsdoctor.errors import InputError, printable
from dsdoctor.findings import Finding, Phrase, sort_findings
from dsdoctor.i18n import message_table, pick
from dsdoctor.report.render import (
    Style,
    findings_markdown,
    findings_text,
    markdown_table,
)
from dsdoctor.units import human_count

LOGITS_MAX_PARAMS = 3_000_000_000  # above this the CPU forward pass is skipped (noted in the result)
EPS = {"float32": 2.0**-23, "float64": 2.0**-52, "bfloat16": 2.0**-8, "float16": 2.0**-11}
# (stored mantissa bits, smallest normal exponent) of each float format: the spacing of representable values
# (one unit in the last place, ULP) at |x| is 2**(max(floor(log2 |x|), emin) - bits), subnormals included
FORMATS = {"float16": (10, -14), "bfloat16": (7, -126), "float32": (23, -126), "float64": (52, -1022)}


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
    # the tolerance of the reference comparison: {"dtypes": [ours, theirs]...} (ULP of the narrower dtype)
    tolerance: dict | None = None
    identical_after_cast: int | None = None  # tensors equal bit for bit once the reference is cast to ours
    logits_tolerance: float | None = None
    adapter: dict | None = None  # a PEFT adapter folder: its config and layers

    def to_dict(self, lang: str = "en") -> dict:
        return {
            "out_dir": self.out_dir, "model": self.model, "reference": self.reference, "tensors": self.tensors,
            "parameters": self.parameters, "expected_tensors": self.expected, "tied_groups": self.tied_groups,
            "compared_with_reference": self.compared_with_reference, "max_abs_diff": self.max_abs_diff,
            "tolerance": self.tolerance, "identical_after_cast": self.identical_after_cast,
            "logits_max_abs_diff": self.logits_max_abs_diff, "logits_top1_agreement": self.logits_top1_agreement,
            "logits_tolerance": self.logits_tolerance, "adapter": self.adapter,
            "notes": self.notes, "ok": not any(f.effective_severity == "error" for f in self.findings),
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)],
        }

    def _rows(self, lang: str):
        def t(key):
            return pick(TEXT[key], lang)

        rows = [(t("weights"), f"{self.out_dir}: {self.tensors} tensors, {human_count(self.parameters)} parameters")]
        if self.adapter:
            rows.append((t("adapter"), t("adapter value").format(**self.adapter)))
        rows += [
            (t("model"), f"{self.model}: {self.expected} tensors expected"),
            (t("tied"), "; ".join(" = ".join(g) for g in self.tied_groups) or "-"),
        ]
        if self.reference:
            rows.append((t("reference"), f"{self.reference}: {self.compared_with_reference} tensors "
                                         f"compared, max |diff| {self.max_abs_diff:.3g}"))
            if self.tolerance:
                rows.append((t("tolerance"), tolerance_text(self.tolerance, lang)))
            if self.identical_after_cast is not None and self.tolerance and self.tolerance.get("narrow"):
                rows.append(("", t("identical after cast").format(
                    count=self.identical_after_cast, of=self.compared_with_reference, dtype=self.tolerance["narrow"])))
            if self.logits_max_abs_diff is not None:
                rows.append(("logits", f"max |diff| {self.logits_max_abs_diff:.3g}"
                                       + (f" (tolerance {self.logits_tolerance:.3g})"
                                          if self.logits_tolerance is not None else "")
                                       + f", top-1 agreement {self.logits_top1_agreement:.0%}"))
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


def tolerance_text(tol: dict, lang: str) -> str:
    if not tol.get("narrow"):
        return pick(TEXT["tolerance exact"], lang)
    bits, emin = FORMATS[tol["narrow"]]
    return pick(TEXT["tolerance ulp"], lang).format(dtype=tol["narrow"], sub=f"2^{emin - bits}",
                                                    value=f"{2.0 ** (emin - bits):.2g}")


def _load_config(model):
    d = Path(model)
    if not (d / "config.json").is_file():
        hint = "--model takes the model directory (config.json)"
        if lora.is_adapter_dir(d):
            hint = "this is a PEFT adapter folder: pass the base model's folder as --model"
        raise InputError("no config.json", path=d, hint=hint)
    door.check_library_files([d / "config.json"], door.MODEL_CONFIG)  # transformers reads it whole
    from dsdoctor.model.custom import custom_code_classes, library_error
    from dsdoctor.model.spec import read_config_json

    _, raw = read_config_json(d)
    custom = custom_code_classes(raw)
    if custom:
        raise InputError(
            f"config.json needs the folder's own code ({', '.join(map(printable, custom))}, model_type "
            f"{printable(repr(raw.get('model_type')))[:60]}), which transformers does not ship; dsdoctor never runs "
            "code from a model folder (trust_remote_code stays off)", path=d / "config.json",
            hint="pass --model a folder whose config.json has an architecture transformers ships (for a fine-tune "
                 "of one, the base model's folder); `dsdoctor merge` itself needs no model code")
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(str(d), trust_remote_code=False, local_files_only=True)
    except Exception as exc:
        raise InputError(f"cannot build the config: {type(exc).__name__}: {library_error(exc)}",
                         path=d / "config.json") from None


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


def expected_tensors(model) -> tuple[dict[str, tuple], list[list[str]]]:
    """state dict name -> shape, and groups of names that are one tensor (ties), from a meta model."""
    sd = model.state_dict(keep_vars=True)
    by_id: dict[int, list[str]] = {}
    for name, t in sd.items():
        by_id.setdefault(id(t), []).append(name)
    groups = [names for names in by_id.values() if len(names) > 1]
    return {name: tuple(t.shape) for name, t in sd.items()}, groups


def verify(out_dir, model, reference=None, logits: bool = True) -> VerifyResult:
    """Check merged weights in ``out_dir`` against the model whose config is in ``model``. A PEFT adapter folder
    (adapter_config.json, no config.json) is checked against the base model in ``model`` instead."""
    if reference is not None and lora.is_adapter_dir(reference):
        raise InputError("the reference is a PEFT adapter folder, which holds no full weights to compare with",
                         path=reference, hint=f"verify the adapter instead: dsdoctor verify {printable(reference)} "
                                              f"--model BASE_MODEL --reference {printable(out_dir)}")
    if lora.is_adapter_dir(out_dir):
        return verify_adapter(out_dir, model, reference, logits)
    weights = index_weights(out_dir)
    config = _load_config(model)
    meta = _meta(config, model)
    expected, tied = expected_tensors(meta)
    parameters = {n for n, _ in meta.named_parameters(remove_duplicate=False)}
    del meta
    expected, parameters = _as_stored(expected, parameters, config, weights)

    findings: list[Finding] = []
    result = VerifyResult(out_dir=str(out_dir), model=str(model), reference=str(reference) if reference else None,
                          tensors=len(weights), parameters=sum(e.numel for e in weights.values()),
                          expected=len(expected), tied_groups=tied)
    tied_of = {n: g for g in tied for n in g}
    peft = [n for n in lora.peft_keys(weights) if n not in expected]
    if peft:
        found = checkpoint_near(out_dir)
        findings.append(Finding("DSD420", {"count": len(peft), "out_dir": str(out_dir), "names": names(peft, 3),
                                           "ckpt": printable(found) if found is not None else "CKPT"}))
    findings += names_and_shapes({n: e.shape for n, e in weights.items()}, expected, out_dir, tied_of, skip=peft,
                                 present_as={_base_name(n) for n in peft}, merge_hint=lambda: _merge_pointer(out_dir))
    _dtype_and_values(findings, config, weights, parameters)

    for group in tied:
        present = [n for n in group if n in weights and weights[n].shape == expected[n]]
        if len(present) > 1:
            first = load_tensor(weights[present[0]]).float()
            for other in present[1:]:
                diff = (first - load_tensor(weights[other]).float()).abs().max().item() if first.numel() else 0.0
                if diff != 0.0:
                    findings.append(Finding("DSD407", {"names": f"{present[0]} / {other}", "max_diff": f"{diff:.3g}"}))

    if reference is not None:
        ref = moe.convert(index_weights(reference), config.model_type, moe.layout_of(weights), moe.Joined)
        _compare_reference(result, findings, weights, ref, tied_of)
        if logits and not any(f.code in ("DSD401", "DSD403", "DSD404", "DSD420") for f in findings):
            _compare_logits(result, findings, config, weights, ref)
    result.findings = findings
    return result


def _meta(config, model):
    try:
        return _build(config, "meta")
    except Exception as exc:
        from dsdoctor.model.custom import library_error

        raise InputError(f"cannot build the model from its config: {type(exc).__name__}: {library_error(exc)}",
                         path=model) from None


def _as_stored(expected: dict, parameters: set, config, weights: dict) -> tuple[dict, set]:
    """The model's tensors and parameters named as the weights store them: a mixture-of-experts model's expert
    weights fused or one per expert (moe.py), whichever the weights hold."""
    plan = moe.conversion(expected, config.model_type, moe.layout_of(weights))
    if plan is None:
        return expected, parameters
    return {n: shape for n, (shape, _) in plan.items()}, {n for n, (_, r) in plan.items() if r[0][0] in parameters}


def _base_name(name: str) -> str:
    """A PEFT key's name in the base model (the key --merge-lora writes)."""
    name = name[len(lora.PEFT_PREFIX):] if name.startswith(lora.PEFT_PREFIX) else name
    name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)
    return name.replace(".base_layer.", ".")


def _merge_pointer(out_dir) -> Phrase:
    """Where the DeepSpeed checkpoint of the run that wrote empty weights is, for DSD404's fix."""
    found = checkpoint_near(out_dir)
    if found is not None:
        return Phrase("beside", {"ckpt": printable(found), "out": printable(str(Path(out_dir)) + "-merged")})
    return Phrase("elsewhere")


def _dtype_and_values(findings, config, weights: dict, parameters: set) -> None:
    """DSD406 (dtype other than the config's), DSD405 (NaN/Inf), DSD413 (implausible values)."""
    want_dtype = _config_dtype(config)
    floats = [e for e in weights.values() if _dtype(e) in EPS]
    if want_dtype in EPS:
        off = sorted({_dtype(e) for e in floats if _dtype(e) != want_dtype})
        if off:
            count = sum(1 for e in floats if _dtype(e) != want_dtype)
            short = normalize_dtype(want_dtype) or want_dtype
            findings.append(Finding("DSD406", {"count": count, "found": "/".join(off), "expected": want_dtype,
                                               "expected_short": short}))
    values = Values()
    for name, e in weights.items():
        look = values.look(name, _dtype(e)) if _numel(e) else None
        if look is not None:
            look(tensor_bytes(_load(e)))
    findings += values.findings(parameters)


# ---- tensors either on disk (Entry) or in memory (a folded adapter) ------------------------------------------
def _load(e):
    return load_tensor(e) if isinstance(e, Entry) else e.load() if isinstance(e, moe.Joined) else e


def _dtype(e) -> str:
    return e.dtype if isinstance(e, Entry) else str(e.dtype).removeprefix("torch.")


def _shape(e) -> tuple:
    return tuple(e.shape)


def _numel(e) -> int:
    return e.numel if isinstance(e, Entry) else e.numel()


def ulp(values, dtype: str):
    """The spacing of ``dtype``'s representable values at each |value| (float32 or float64 tensor): one ULP,
    the subnormal spacing below the smallest normal number."""
    import torch

    bits, emin = FORMATS[dtype]
    mags = values.abs()
    _, exponent = torch.frexp(mags)  # |x| = m * 2**e, m in [0.5, 1): floor(log2 |x|) = e - 1
    exponent = torch.where(mags > 0, exponent - 1, torch.full_like(exponent, emin)).clamp(min=emin)
    return torch.ldexp(torch.ones_like(mags), exponent - bits)


def within_ulp(a, b, dtype_a: str, dtype_b: str):
    """(bool tensor: |a - b| within one ULP of the coarser of the two dtypes at each element, the |diff|)."""
    import torch

    wide = torch.float64 if "float64" in (dtype_a, dtype_b) else torch.float32
    a, b = a.to(wide), b.to(wide)
    delta = (a - b).abs()
    tol = torch.maximum(ulp(a, dtype_a) if dtype_a in FORMATS else torch.zeros_like(a),
                        ulp(b, dtype_b) if dtype_b in FORMATS else torch.zeros_like(b))
    ok = (delta <= tol) | (a == b)  # a == b: equal infinities
    return ok, delta


def _coarser(*dtypes: str) -> str:
    """The dtype with the fewest mantissa bits (the widest spacing between values)."""
    return min(dtypes, key=lambda d: FORMATS.get(d, (99, 0))[0])


def _compare_reference(result, findings, weights: dict, ref: dict, tied_of):
    """Every reference tensor against ours (a tied partner stands in for an alias stored once): bit for bit where
    the dtypes match, within one ULP of the coarser dtype (subnormals included) where they differ."""
    import torch

    worst_name, worst, largest, bad, compared, only_ref, identical = None, 0.0, 0.0, [], 0, [], 0
    narrow = set()
    for name, r in ref.items():
        e = weights.get(name)
        if e is None:
            e = next((weights[m] for m in tied_of.get(name, []) if m in weights), None)
        if e is None:
            only_ref.append(name)
            continue
        compared += 1
        if _shape(e) != _shape(r):
            bad.append(name)
            continue
        a, b = _load(e), _load(r)
        da, db = _dtype(e), _dtype(r)
        if not (a.is_floating_point() and b.is_floating_point()):
            diff = 0.0 if torch.equal(a, b.to(a.dtype)) else float("inf")
            ok = diff == 0.0
        elif da == db:
            delta = (a.to(torch.float64) - b.to(torch.float64)).abs()
            diff = delta.max().item() if delta.numel() else 0.0
            ok = torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())
        else:
            within, delta = within_ulp(a, b, da, db)
            diff = delta.max().item() if delta.numel() else 0.0
            ok = bool(within.all())
            narrow.add(_coarser(da, db))
        if a.is_floating_point() and b.is_floating_point():
            low = getattr(torch, _coarser(da, db))  # both rounded to the coarser dtype: bit-identical?
            identical += torch.equal(a.to(low), b.to(low))
        largest = diff if diff != diff else max(largest, diff)
        if not ok:
            bad.append(name)
            if worst_name is None or diff > worst or diff != diff:
                worst, worst_name = diff, name
    result.compared_with_reference = compared
    result.max_abs_diff = largest
    result.identical_after_cast = identical
    coarse = _coarser(*narrow) if narrow else None
    result.tolerance = {"narrow": coarse, "ulp": 1 if coarse else 0}
    if only_ref:
        result.notes.append(f"{len(only_ref)} reference tensor(s) not in the weights: {names(only_ref, 3)}")
    if bad:
        worst_name = worst_name or bad[0]
        findings.append(Finding("DSD408", {"count": len(bad), "reference": result.reference,
                                           "max_diff": f"{worst:.3g}", "worst": worst_name,
                                           "tolerance": Phrase("ulp", {"dtype": coarse}) if coarse else
                                           Phrase("exact")}))


def _load_into(model, weights: dict):
    import torch

    sd = moe.convert({n: _load(e) for n, e in weights.items()}, model.config.model_type,
                     moe.layout_of(model.state_dict()), moe.cat)
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
    dtypes = {_dtype(e) for e in list(weights.values()) + list(ref.values()) if _dtype(e) in EPS}
    narrow = max((EPS[d] for d in dtypes), default=0.0) if len(dtypes) > 1 else 0.0
    tol = 8 * narrow * max(1.0, theirs.abs().max().item())
    result.logits_max_abs_diff, result.logits_top1_agreement, result.logits_tolerance = diff, agreement, tol
    if diff > tol:
        findings.append(Finding("DSD409", {"max_diff": f"{diff:.3g}", "tolerance": f"{tol:.3g}",
                                           "agreement": f"{agreement:.0%}"}))


# ---- a PEFT adapter folder ----------------------------------------------------------------------------------
def verify_adapter(out_dir, model, reference=None, logits: bool = True) -> VerifyResult:
    """A PEFT adapter (adapter_model.safetensors + adapter_config.json) against the base model in ``model``:
    every LoRA tensor fits a layer of the base (rank, shapes), every saved module is one of its tensors. With a
    reference (merged weights), the adapter is folded into the base weights in ``model`` (as PEFT's
    merge_and_unload does) and compared with it, tensors and logits."""
    out = Path(out_dir)
    cfg = lora.read_config(out / lora.CONFIG_NAME)
    adapter = index_weights(out)
    config = _load_config(model)
    meta = _meta(config, model)
    expected, tied = expected_tensors(meta)
    layers = {name: type(m).__name__ for name, m in meta.named_modules()}
    del meta
    result = VerifyResult(out_dir=str(out_dir), model=str(model), reference=str(reference) if reference else None,
                          tensors=len(adapter), parameters=sum(e.numel for e in adapter.values()),
                          expected=len(expected), tied_groups=tied)
    findings: list[Finding] = []
    unfit, modules = _adapter_fit(adapter, cfg, expected, layers)
    result.adapter = {"config": str(out / lora.CONFIG_NAME), "layers": len(modules), "r": cfg.r, "alpha": cfg.alpha}
    if unfit:
        findings.append(Finding("DSD422", {"count": len(unfit), "model": str(model), "details": names(unfit, 3)}))
    parts: dict[str, set] = {}
    for m in filter(None, map(lora.SAVED_KEY.match, adapter)):
        parts.setdefault(_base_name(m["module"]), set()).add(m["part"] + (".bias" if m["leaf"] == "bias" else ""))
    problems = lora.contradictions(cfg, parts, {n.rsplit(".", 1)[0] for n in expected if n.endswith(".weight")})
    if problems:
        findings.append(Finding("DSD423", {"config": printable(out / lora.CONFIG_NAME), "details": "; ".join(problems)}))
    _dtype_and_values(findings, config, adapter, set())
    if reference is not None and not unfit:
        base = index_weights(model)
        folded, misfit = lora.fold_into({n: load_tensor(e) for n, e in base.items()},
                                        {n: load_tensor(e) for n, e in adapter.items()}, cfg)
        if misfit:
            findings.append(Finding("DSD422", {"count": len(misfit), "model": str(model), "details": names(misfit, 3)}))
        else:
            ours = {n: folded.get(n, e) for n, e in base.items()}
            tied_of = {n: g for g in tied for n in g}
            ref = index_weights(reference)
            _compare_reference(result, findings, ours, ref, tied_of)
            if logits:
                _compare_logits(result, findings, config, ours, ref)
    result.findings = findings
    return result


def _adapter_fit(adapter: dict, cfg, expected: dict, layers: dict) -> tuple[list[str], set]:
    """The adapter tensors that fit no layer of the base model (with the reason), and the LoRA layers found."""
    unfit, modules = [], set()
    for key, e in adapter.items():
        m = lora.SAVED_KEY.match(key)
        if m is None:  # a modules_to_save copy or a bias: a tensor of the base with the same shape
            name = _base_name(key)
            if name not in expected:
                unfit.append(f"{key} (no {name} in the base model)")
            elif expected[name] != e.shape:
                unfit.append(f"{key} {list(e.shape)} != {list(expected[name])}")
            continue
        module = _base_name(m["module"])
        modules.add(module)
        weight = expected.get(module + ".weight")
        if weight is None or module not in layers:
            unfit.append(f"{key} (no layer {module} with a weight in the base model)")
            continue
        part = m["part"]
        r = cfg.rank(module)
        emb = part.startswith("lora_embedding")
        flip = emb or cfg.fan_in_fan_out
        out_dim, in_dim = (weight[1], weight[0]) if flip and len(weight) == 2 else (weight[0], weight[-1])
        want = {"lora_A": (r, in_dim), "lora_embedding_A": (r, in_dim), "lora_B": (out_dim, r),
                "lora_embedding_B": (out_dim, r), "lora_magnitude_vector": (out_dim,)}[part]
        if m["leaf"] == "bias":
            want = (out_dim,)
        if len(weight) != 2 or tuple(e.shape) != want:
            unfit.append(f"{key} {list(e.shape)} != {list(want)} for {module} {list(weight)} at r={r}")
    return unfit, modules
