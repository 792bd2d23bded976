"""``compare()``: the library call behind ``dsdoctor compare``; plain values in, ``CompareResult`` out."""
from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dsdoctor import door
from dsdoctor.compare.diff import STATUSES, PromptDiff, diff_runs
from dsdoctor.compare.launch import run_path
from dsdoctor.compare.prompts import default_prompts, load_prompts
from dsdoctor.compare.runner import MULTI_RANK, PATHS, TORCH_DTYPES
from dsdoctor.dtypes import normalize_dtype
from dsdoctor.errors import InputError
from dsdoctor.findings import Finding, sort_findings
from dsdoctor.i18n import message_table, pick
from dsdoctor.model.spec import load_model_spec
from dsdoctor.report.render import Style, findings_markdown, findings_text, markdown_table, text_table, write_report

PROBE_COUNT = 64
PROBE_SEED = 7
TOP_K = 8


TEXT = message_table("compare.api.TEXT")  # the texts live in dsdoctor/messages.json


@dataclass
class PathRun:
    """One load path that ran (or failed)."""

    label: str  # plain, zero3, ... or A / B in two-directory mode
    path: str
    model_dir: str
    ok: bool
    ranks: int
    device: str | None = None
    load_seconds: float | None = None
    generate_seconds: float | None = None
    command: list[str] = field(default_factory=list)
    error: str = ""
    log: str = ""
    log_tail: str = ""
    tokens: list[list[int]] = field(default_factory=list)  # generated tokens per prompt
    versions: dict = field(default_factory=dict)  # torch, transformers, deepspeed in the worker

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PairResult:
    """One path compared with the reference, per prompt."""

    reference: str
    other: str
    diffs: list[PromptDiff]

    @property
    def status(self) -> str:  # the worst prompt's status
        return max((d.status for d in self.diffs), key=STATUSES.index, default="match")

    @property
    def identical(self) -> bool:  # same tokens and the same recorded logits (rounded to 1e-6)
        return all(d.status == "match" and d.max_logit_diff == 0 for d in self.diffs)

    def to_dict(self) -> dict:
        return {"reference": self.reference, "other": self.other, "status": self.status,
                "identical": self.identical, "prompts": [d.to_dict() for d in self.diffs]}


@dataclass
class CompareResult:
    model_dir: str
    model_dir_b: str | None
    paths: list[str]
    ranks: int
    dtype: str
    max_new_tokens: int
    prompts: list[list[int]]
    runs: list[PathRun]
    pairs: list[PairResult]
    findings: list[Finding]
    out: str | None = None

    @property
    def status(self) -> str:
        if any(not r.ok for r in self.runs):
            return "failed"
        return max((p.status for p in self.pairs), key=STATUSES.index, default="match")

    def to_dict(self, lang: str = "en") -> dict:
        return {
            "command": "compare",
            "status": self.status,
            "model_dir": self.model_dir,
            "model_dir_b": self.model_dir_b,
            "paths": self.paths,
            "ranks": self.ranks,
            "dtype": self.dtype,
            "max_new_tokens": self.max_new_tokens,
            "prompts": self.prompts,
            "runs": [r.to_dict() for r in self.runs],
            "comparisons": [p.to_dict() for p in self.pairs],
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)],
            "out": self.out,
        }

    # -- rendering ---------------------------------------------------------------------------------------
    def _header(self, lang: str) -> str:
        what = self.model_dir if not self.model_dir_b else f"A={self.model_dir}  B={self.model_dir_b}"
        multi = any(p in MULTI_RANK for p in self.paths)
        ranks = pick(TEXT["ranks"], lang).format(ranks=self.ranks) if multi else ""
        return pick(TEXT["header"], lang).format(what=what, dtype=self.dtype, prompts=len(self.prompts),
                                                 new=self.max_new_tokens, ranks=ranks)

    def _run_rows(self, lang: str, style: Style | None):
        pair_of = {p.other: p for p in self.pairs}
        rows = []
        for r in self.runs:
            if not r.ok:
                verdict = ((style.error + " ") if style else "") + pick(TEXT["failed"], lang)
            elif r.label not in pair_of:
                verdict = pick(TEXT["reference"], lang)
            else:
                verdict = _verdict(pair_of[r.label], lang, style)
            secs = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            rows.append((r.label, r.path, r.ranks, secs(r.load_seconds), secs(r.generate_seconds), verdict))
        return pick(TEXT["run head"], lang), rows

    def _prompt_rows(self, lang: str):
        head = pick(TEXT["prompt head"], lang)
        rows = []
        for p in self.pairs:
            for d in p.diffs:
                div = "-" if d.first_divergence is None else d.first_divergence
                toks = "-" if d.token_ref is None else f"{d.token_ref}/{d.token_other}"
                margin = "-" if d.margin_ref is None else _num(d.margin_ref)
                rows.append((f"{p.other} vs {p.reference}", d.prompt, d.status, div, toks, margin,
                             _num(d.max_logit_diff), _num(d.tolerance)))
        return head, rows

    def to_text(self, lang: str = "en", style: Style | None = None) -> str:
        style = style or Style()
        out = [self._header(lang), ""]
        head, rows = self._run_rows(lang, style)
        out.append(text_table(head, rows))
        head, rows = self._prompt_rows(lang)
        if rows:
            out.append(text_table(head, rows))
        for r in self.runs:
            if not r.ok and r.log_tail:
                title = pick(TEXT["log tail"], lang).format(label=r.label)
                out.append(title + (f" ({r.log})" if r.log else "") + "\n"
                           + "\n".join("    " + ln for ln in r.log_tail.splitlines()[-10:]) + "\n")
        out.append(findings_text(self.findings, lang, style))
        if self.out:
            out.append(pick(TEXT["written"], lang) + self.out + "\n")
        return "\n".join(out)

    def to_markdown(self, lang: str = "en") -> str:
        title = pick(TEXT["title markdown"], lang)
        header = self._header(lang).split("\n", 1)
        out = [title, "", f"`{header[0].split(': ', 1)[1]}`", "", header[1], ""]
        head, rows = self._run_rows(lang, None)
        out += [markdown_table(head, rows)]
        head, rows = self._prompt_rows(lang)
        if rows:
            out += ["## " + pick(TEXT["per prompt"], lang), "", markdown_table(head, rows)]
        out += ["## " + pick(TEXT["findings"], lang), "", findings_markdown(self.findings, lang)]
        for r in self.runs:
            if not r.ok and r.log_tail:
                title = pick(TEXT["log tail"], lang).format(label=r.label)
                out += [f"### {title}", "", "```", r.log_tail.rstrip(), "```", ""]
        return "\n".join(out)


def _num(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x:.3g}" if abs(x) >= 1e-3 else f"{x:.1e}"


def _verdict(pair: PairResult, lang: str, style: Style | None) -> str:
    n = len(pair.diffs)
    counts = {s: sum(d.status == s for d in pair.diffs) for s in STATUSES}
    worst = pair.status
    glyph = ""
    if style:
        glyph = {"match": style.ok, "near-tie": style.info, "drift": style.error, "mismatch": style.error}[worst] + " "
    max_diff = _num(max((d.max_logit_diff for d in pair.diffs), default=0))
    if pair.identical:
        return glyph + pick(TEXT["identical"], lang).format(n=n)
    names = {s: pick(TEXT["status_" + s], lang) for s in STATUSES}
    parts = pick(TEXT["sep"], lang).join(f"{names[s]} {c}/{n}" for s, c in counts.items() if c)
    return glyph + pick(TEXT["counts"], lang).format(parts=parts, max_diff=max_diff)


# -- validation -------------------------------------------------------------------------------------------
def _check_adapter_dir(adapter_dir, base) -> Path:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) and its base model folder."""
    import importlib.util

    from dsdoctor.checkpoint import lora

    p = Path(adapter_dir)
    if base is None:
        raise InputError("is a PEFT adapter folder (adapter_config.json, no config.json)", path=p,
                         hint="pass --base DIR, the base model the adapter was trained on")
    lora.read_config(p / lora.CONFIG_NAME)
    if not (p / lora.ADAPTER_WEIGHTS).is_file():
        raise InputError(f"a PEFT adapter folder without {lora.ADAPTER_WEIGHTS}", path=p)
    door.check_library_files([p / lora.ADAPTER_WEIGHTS], door.SAFETENSORS)
    door.check_library_files([p / lora.CONFIG_NAME], door.ADAPTER_CONFIG)
    if importlib.util.find_spec("peft") is None:
        raise InputError("comparing a PEFT adapter needs the peft package in this environment", path=p,
                         hint="pip install peft, or merge it first: dsdoctor merge CKPT OUT --merge-lora")
    return _check_model_dir(base)


def _check_model_dir(model_dir) -> Path:
    p = Path(model_dir)
    if not p.exists():
        raise InputError("model directory not found", path=p)
    if not p.is_dir():
        raise InputError("is not a directory", path=p, hint="pass the directory that holds config.json and the weights")
    from dsdoctor.model.custom import custom_code_classes
    from dsdoctor.model.spec import read_config_json

    if (p / "config.json").is_file():
        custom = custom_code_classes(read_config_json(p)[1])
        if custom:
            raise InputError(f"config.json needs the folder's own code ({', '.join(custom)}), which transformers does "
                             "not ship; dsdoctor never runs code from a model folder (trust_remote_code stays off)",
                             path=p / "config.json",
                             hint="compare a model whose architecture transformers ships (model_type in config.json)")
    if not any(p.glob("*.safetensors")):
        hint = "convert the weights to safetensors (save_pretrained(..., safe_serialization=True))"
        if any(p.glob("*.bin")) or any(p.glob("*.pt")):
            raise InputError("has only pickle weights (.bin/.pt), which dsdoctor does not load", path=p, hint=hint)
        raise InputError("has no *.safetensors weights", path=p, hint=hint)
    # what the loaders will open: a FIFO or a device among them would block or never end inside transformers
    names = ("generation_config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer.model",
             "tokenizer_config.json", "special_tokens_map.json")
    door.check_library_files(sorted(p.glob("*.safetensors")), door.SAFETENSORS)
    door.check_library_files([p / "config.json"], door.MODEL_CONFIG)
    door.check_library_files([p / n for n in names], door.MODEL_FILE)
    return p


def _parse_paths(paths) -> list[str]:
    if isinstance(paths, str):
        paths = [x.strip() for x in paths.split(",")]
    paths = [x for x in (paths or []) if x]
    for x in paths:
        if x not in PATHS:
            raise InputError(f"unknown load path {x!r}", hint=f"choose from {', '.join(PATHS)}")
    if len(set(paths)) != len(paths):
        raise InputError(f"a load path is listed twice: {','.join(paths)}")
    return paths


def visible_gpus() -> int:
    """CUDA devices the ranks would use; 0 on the CPU accelerator (DS_ACCELERATOR=cpu) or without CUDA."""
    if os.environ.get("DS_ACCELERATOR", "") == "cpu":
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


MAX_NEW_TOKENS = 1 << 16  # every step's logits are recorded: past this a compare only fills the disk
MAX_RANKS = 256  # one host: even with --oversubscribe, past this the launch only exhausts the machine


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, as taskset or a cgroup cpuset set it)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_ranks(gpus_visible: int) -> int:
    """Every visible GPU; 2 on the CPU accelerator, which runs any number of ranks."""
    return gpus_visible or 2


def probe_ids(vocab_size: int) -> list[int]:
    return sorted(random.Random(PROBE_SEED).sample(range(vocab_size), min(PROBE_COUNT, vocab_size)))


# -- the call ---------------------------------------------------------------------------------------------
def compare(
    model_dir,
    model_dir_b=None,
    paths=None,
    gpus: int | None = None,
    prompts=None,
    max_new_tokens: int = 16,
    dtype: str | None = None,
    out=None,
    force: bool = False,
    timeout: float | None = None,
    progress: Callable[[str], None] | None = None,
    oversubscribe: bool = False,
    base=None,
) -> CompareResult:
    """Greedy-generate the same prompts through each load path and compare every path with the first.

    ``paths``: the load paths, the first the reference (default: plain and zero3; with ``model_dir_b``: plain).
    With ``model_dir_b``: one load path, run on both directories, B compared with A. ``prompts``: a prompt
    file (see ``dsdoctor.compare.prompts``) or a list of token-id lists; None draws deterministic ones.
    ``gpus``: ranks for multi-rank paths (default: visible GPUs, else 2); more ranks than visible GPUs, or
    on the CPU accelerator than usable cores, is refused (the latter unless ``oversubscribe``). ``out``: a directory for the
    report and the raw run records (refused if it exists unless ``force``). A model directory that is a PEFT
    adapter folder runs as the adapter on its base model ``base`` (not merged), on the plain path: compare it
    with the merged weights to check a merge token for token."""
    from dsdoctor.checkpoint.lora import is_adapter_dir

    say = progress or (lambda msg: None)
    adapters = {d: is_adapter_dir(d) for d in (model_dir, model_dir_b) if d is not None}

    def checked(d) -> Path:
        return _check_adapter_dir(d, base) if adapters[d] else _check_model_dir(d)

    spec_a = load_model_spec(checked(model_dir))
    paths = _checked_paths(paths, model_dir, model_dir_b, spec_a, any(adapters.values()), checked)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be a positive integer, not {max_new_tokens!r}")
    if max_new_tokens > MAX_NEW_TOKENS:
        raise InputError(f"--max-new-tokens {max_new_tokens} is more than a comparison needs (limit {MAX_NEW_TOKENS})")
    dtype_name = normalize_dtype(dtype) if dtype else (spec_a.dtype or "fp32")
    if dtype_name not in TORCH_DTYPES:
        raise InputError(f"--dtype {dtype!r} is not one of fp32, bf16, fp16")
    ranks = _ranks(paths, gpus, spec_a, oversubscribe)
    prompt_ids = _prompt_ids(prompts, spec_a, model_dir)

    if model_dir_b is None:
        jobs = [(p, p, model_dir) for p in paths]
    else:
        jobs = [("A", paths[0], model_dir), ("B", paths[0], model_dir_b)]
    job_base = {"prompts": prompt_ids, "max_new_tokens": max_new_tokens, "dtype": dtype_name,
            "probe_ids": probe_ids(spec_a.vocab_size), "top_k": TOP_K, "quiet": progress is None}

    def run_all(workdir: Path) -> CompareResult:
        runs, records = [], {}
        for n, (label, path, mdir) in enumerate(jobs, 1):
            nprocs = ranks if path in MULTI_RANK else 1
            say(f"[{n}/{len(jobs)}] {label}: {PATHS[path]} ({nprocs} rank{'s' * (nprocs > 1)}) ...")
            t0 = time.perf_counter()
            job = dict(job_base, label=label, path=path, model_dir=str(Path(mdir).resolve()))
            if adapters.get(mdir):
                job.update(model_dir=str(Path(base).resolve()), adapter_dir=str(Path(mdir).resolve()))
            outcome = run_path(job, workdir, nprocs, timeout=timeout)
            run = PathRun(label, path, str(mdir), outcome.ok, nprocs, command=outcome.command,
                          error=outcome.error, log=outcome.log, log_tail=outcome.log_tail)
            if outcome.ok:
                rec = outcome.record
                records[label] = rec
                run.device, run.load_seconds, run.generate_seconds = rec["device"], rec["load_seconds"], rec["generate_seconds"]
                run.tokens = [p["tokens"] for p in rec["prompts"]]
                run.versions = rec.get("versions", {})
            say(f"[{n}/{len(jobs)}] {label}: {'done' if outcome.ok else 'FAILED: ' + outcome.error} "
                f"in {time.perf_counter() - t0:.0f}s")
            runs.append(run)
        pairs = []
        ref = jobs[0][0]
        if ref in records:
            pairs = [PairResult(ref, label, diff_runs(records[ref], records[label], dtype_name))
                     for label, _, _ in jobs[1:] if label in records]
        findings = _findings(runs, pairs, dtype_name, ranks, len(prompt_ids))
        return CompareResult(str(model_dir), None if model_dir_b is None else str(model_dir_b), paths, ranks,
                             dtype_name, max_new_tokens, prompt_ids, runs, pairs, findings)

    if out is None:
        with door.scratch_dir("dsdoctor-compare-") as tmp:
            result = run_all(tmp)
            for r in result.runs:
                r.log = ""  # gone with the temporary directory; the tail stays in the result
        return result
    inputs = [model_dir, model_dir_b, base, prompts if isinstance(prompts, (str, os.PathLike)) else None]
    with door.atomic_output_dir(out, force=force, inputs=inputs, command="compare") as tmp:
        result = run_all(Path(tmp))
        result.out = str(out)
        for r in result.runs:
            if r.log:
                r.log = str(Path(out) / Path(r.log).name)
        _write_reports(result, Path(tmp))
    return result


def _checked_paths(paths, model_dir, model_dir_b, spec_a, adapter: bool, checked) -> list[str]:
    """The load paths to run (default: plain and zero3; with a second directory: plain), as the inputs allow."""
    if paths is None:
        paths = ("plain",) if model_dir_b is not None else ("plain", "zero3")
    paths = _parse_paths(paths)
    if adapter and paths != ["plain"]:
        raise InputError("a PEFT adapter runs on the plain load path only", hint="pass --paths plain")
    if model_dir_b is not None:
        spec_b = load_model_spec(checked(model_dir_b))
        if spec_b.vocab_size != spec_a.vocab_size:
            raise InputError(f"vocabulary size {spec_b.vocab_size} differs from {spec_a.vocab_size} in "
                             f"{model_dir}: not the same model", path=model_dir_b)
        if len(paths) != 1:
            raise InputError("with two model directories give one load path (--paths plain, for example)")
    elif len(paths) < 2:
        raise InputError("give at least two load paths (--paths plain,zero3), or a second model directory")
    return paths


def _ranks(paths: list[str], gpus, spec_a, oversubscribe: bool) -> int:
    """Ranks for the multi-rank paths: the model's heads divide among them, and this machine runs them."""
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise InputError(f"--gpus must be a positive integer, not {gpus!r}")
    multi = any(p in MULTI_RANK for p in paths)
    have = visible_gpus() if multi else 0
    ranks = (default_ranks(have) if gpus is None else gpus) if multi else (1 if gpus is None else gpus)
    if "tp" in paths:  # a property of the inputs: checked before what this machine can run
        for what, n in (("attention heads", spec_a.num_heads), ("key/value heads", spec_a.num_kv_heads)):
            if n % ranks:
                raise InputError(f"tensor parallelism over {ranks} ranks needs {what} ({n}) divisible by {ranks}",
                                 path=spec_a.path, hint="choose --gpus that divides them")
    if multi:
        _check_machine(ranks, have, oversubscribe)
    return ranks


def _check_machine(ranks: int, have: int, oversubscribe: bool) -> None:
    """This machine runs ``ranks`` ranks: enough visible GPUs, or CPU cores (unless ``oversubscribe``)."""
    if have and ranks > have:
        raise InputError(f"--gpus {ranks} but only {have} GPU(s) visible",
                         hint="lower --gpus, or set DS_ACCELERATOR=cpu to run the ranks on the CPU")
    cores = usable_cpus()
    if not have and ranks > cores and not oversubscribe:
        raise InputError(f"--gpus {ranks} CPU ranks but only {cores} CPU core(s) usable: each rank loads the "
                         "whole model and they would thrash", hint="lower --gpus, or pass --oversubscribe")
    if ranks > MAX_RANKS:
        raise InputError(f"--gpus {ranks} is more ranks than one host runs (limit {MAX_RANKS})")


def _prompt_ids(prompts, spec_a, model_dir) -> list[list[int]]:
    """The prompts as token ids: drawn (none given), from a prompt file, or the lists given, checked."""
    if prompts is None:
        special = [spec_a.raw.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
        return default_prompts(spec_a.vocab_size, special)
    if isinstance(prompts, (str, os.PathLike)):
        return load_prompts(prompts, spec_a.vocab_size, model_dir)
    try:
        prompt_ids = [[int(t) for t in p] for p in prompts]
    except (TypeError, ValueError):
        raise InputError("prompts must be a prompt file or lists of token ids") from None
    if not prompt_ids or not all(prompt_ids) or any(not 0 <= t < spec_a.vocab_size for p in prompt_ids for t in p):
        raise InputError(f"prompts must be non-empty token-id lists within the vocabulary ({spec_a.vocab_size})")
    return prompt_ids


def _write_reports(result: CompareResult, directory: Path) -> None:
    write_report(result, directory, "en", also_markdown=("zh",))
    for job in directory.glob("*.job.json"):
        door.remove_own(job)


# -- findings ---------------------------------------------------------------------------------------------
def _findings(runs: list[PathRun], pairs: list[PairResult], dtype: str, ranks: int, total: int) -> list[Finding]:
    found = []
    for r in runs:
        if not r.ok:
            found.append(Finding("DSD504", {"path": r.label, "error": r.error, "log": r.log or "shown above"}))
    path_of = {r.label: r.path for r in runs}
    for p in pairs:
        base = {"ref": p.reference, "other": p.other, "total": total}
        by_status = {s: [d for d in p.diffs if d.status == s] for s in STATUSES}
        max_diff = max((d.max_logit_diff for d in p.diffs), default=0.0)
        if by_status["mismatch"]:
            d = by_status["mismatch"][0]
            found.append(Finding("DSD501", dict(
                base, count=len(by_status["mismatch"]), prompt=d.prompt,
                position="-" if d.first_divergence is None else d.first_divergence,
                token_ref=_or_dash(d.token_ref), token_other=_or_dash(d.token_other),
                margin="-" if d.margin_ref is None else _num(d.margin_ref),
                max_diff=_num(d.max_logit_diff), tol=_num(d.tolerance))))
        if by_status["near-tie"]:
            d = by_status["near-tie"][0]
            found.append(Finding("DSD502", dict(
                base, count=len(by_status["near-tie"]), prompt=d.prompt, position=d.first_divergence,
                token_ref=d.token_ref, token_other=d.token_other, gap=_num(d.gap_other or 0), tol=_num(d.tolerance))))
        if by_status["drift"]:
            d = max(by_status["drift"], key=lambda x: x.max_logit_diff)
            found.append(Finding("DSD503", dict(
                base, prompt=d.prompt, position=d.max_diff_position, max_diff=_num(d.max_logit_diff),
                tol=_num(d.tolerance), times=f"{d.max_logit_diff / d.tolerance:.3g}" if d.tolerance else "-")))
        if path_of.get(p.other) == "tp" and path_of.get(p.reference) != "tp" and not p.identical:
            tol = max((d.tolerance for d in p.diffs), default=0.0)
            found.append(Finding("DSD505", dict(base, ranks=ranks, max_diff=_num(max_diff), tol=_num(tol))))
            found.append(Finding("DSD506", dict(base, dtype=dtype, torch_dtype=f"torch.{TORCH_DTYPES[dtype]}")))
    return sort_findings(found)


def _or_dash(x):
    return "-" if x is None else x
