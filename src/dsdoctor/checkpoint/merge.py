"""``dsdoctor merge``: DeepSpeed ZeRO-1/2/3 checkpoint -> safetensors shards that ``from_pretrained`` loads.

Flow: find the files (layout) -> read the small pickles safely (unpickle) -> map every tensor to byte ranges
(plan) -> check disk space -> stream into a temporary directory (writer) -> copy config/tokenizer files ->
rename into place. Memory stays at one conversion chunk; no pickle code runs; an interrupted run leaves
nothing that looks complete.
"""
from __future__ import annotations

import os
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsdoctor import door
from dsdoctor.checkpoint import lora, moe
from dsdoctor.checkpoint.checks import Values, names_and_shapes
from dsdoctor.checkpoint.layout import find_layout
from dsdoctor.checkpoint.plan import plan_checkpoint
from dsdoctor.checkpoint.weights import index_weights
from dsdoctor.checkpoint.writer import INDEX_NAME, OutTensor, output_dtype, write_all
from dsdoctor.dtypes import TORCH_NAMES
from dsdoctor.errors import InputError, printable
from dsdoctor.findings import Finding, Phrase, sort_findings
from dsdoctor.i18n import message_table, pick
from dsdoctor.report.render import (
    Style,
    findings_markdown,
    findings_text,
    markdown_table,
)
from dsdoctor.units import human_bytes, human_count, parse_bytes

DTYPES = {**TORCH_NAMES, **{name: name for name in TORCH_NAMES.values()}}  # --dtype: short or torch's name
# files next to the weights that from_pretrained / AutoTokenizer read
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
               "merges.txt", "chat_template.json", "chat_template.jinja", "preprocessor_config.json")
DISK_MARGIN = 64 * 1024 * 1024


# the words of the rendered merge, per language
TEXT = message_table("checkpoint.merge.TEXT")  # the texts live in dsdoctor/messages.json


@dataclass
class MergeResult:
    checkpoint: str
    tag: str
    zero_stage: int
    world_size: int
    ds_version: str | None
    out_dir: str
    dtype: str
    tensors: int
    parameters: int
    frozen: int
    buffers: int
    bytes_written: int
    shards: list[str]
    tied: dict[str, str]  # alias -> stored name
    tied_stored_once: bool
    copied_files: list[str]
    seconds: float
    findings: list[Finding] = field(default_factory=list)
    tensor_parallel: int = 1  # AutoTP ranks; world_size counts the data-parallel (ZeRO) ranks of each
    source: str = "zero"  # zero | universal (ds_to_universal's folder)
    lora: dict | None = None  # {"output": "adapter"|"merged", "adapter", "layers", "scaling", "config"}
    experts: dict | None = None  # MoE: {"layout" written, "saved" (the checkpoint's), "family", "transformers", "example"}

    def to_dict(self, lang: str = "en") -> dict:
        return {
            "checkpoint": self.checkpoint, "tag": self.tag, "zero_stage": self.zero_stage,
            "world_size": self.world_size, "tensor_parallel": self.tensor_parallel, "source": self.source,
            "lora": self.lora, "experts": self.experts, "ds_version": self.ds_version, "out_dir": self.out_dir,
            "dtype": self.dtype, "tensors": self.tensors, "parameters": self.parameters, "frozen": self.frozen,
            "buffers": self.buffers, "bytes_written": self.bytes_written, "shards": self.shards,
            "tied": self.tied, "tied_stored_once": self.tied_stored_once, "copied_files": self.copied_files,
            "seconds": round(self.seconds, 3),
            "findings": [f.to_dict(lang) for f in sort_findings(self.findings)],
        }

    def _rows(self, lang: str):
        def t(key):
            return pick(TEXT[key], lang)

        tied = ", ".join(f"{a} = {s}" for a, s in self.tied.items()) or "-"
        ranks = f"{self.zero_stage} / {self.world_size}"
        if self.tensor_parallel > 1:
            ranks = t("stage ranks tp").format(stage=self.zero_stage, ranks=self.world_size * self.tensor_parallel,
                                               tp=self.tensor_parallel, dp=self.world_size)
        rows = [
            (t("checkpoint"), f"{self.checkpoint} (tag {self.tag})"
                              + (t("universal") if self.source == "universal" else "")),
            (t("stage ranks"), ranks),
            (t("tensors"), t("tensors value").format(tensors=self.tensors, params=human_count(self.parameters),
                                                     frozen=self.frozen, buffers=self.buffers)),
        ]
        if self.lora:
            rows.append(("LoRA", t("lora " + self.lora["output"]).format(**self.lora)))
        if self.experts:
            known = self.experts["family"] in moe.FAMILIES
            rows.append((t("experts"), t("experts " + (self.experts["layout"] if known else "as saved")).format(**self.experts)
                         + (t("experts converted").format(**self.experts)
                            if self.experts["saved"] != self.experts["layout"] else "")))
        return rows + [
            (t("written"), t("written value").format(out=self.out_dir, shards=len(self.shards),
                                                     size=human_bytes(self.bytes_written), dtype=self.dtype)),
            (t("tied"), tied + ("" if not self.tied else t("stored once" if self.tied_stored_once else "copied tied"))),
            (t("copied"), ", ".join(self.copied_files) or "-"),
            (t("time"), f"{self.seconds:.1f} s"),
        ]

    def to_text(self, lang: str = "en", style: Style | None = None) -> str:
        style = style or Style()
        lines = [f"{style.ok} " + pick(TEXT["merged"], lang)] + kv_lines(self._rows(lang))
        return "\n".join(lines) + "\n" + findings_text(self.findings, lang, style)

    def to_markdown(self, lang: str = "en") -> str:
        head = ("", pick(TEXT["merge"], lang))
        return markdown_table(head, self._rows(lang)) + "\n" + findings_markdown(self.findings, lang)


def _width(text: str) -> int:
    import unicodedata

    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def kv_lines(rows) -> list[str]:
    """Aligned ``key  value`` lines (wide characters count as two columns)."""
    width = max((_width(k) for k, _ in rows), default=0)
    return [f"  {k}{' ' * (width - _width(k))}  {v}" for k, v in rows]


def _config_dir(model, root: Path) -> tuple[Path | None, list[Path]]:
    searched = [Path(model)] if model else [root, root.parent]
    if model and not Path(model).is_dir():
        raise InputError("--model must be a directory holding config.json", path=model)
    for d in searched:
        if (d / "config.json").is_file():
            return d, searched
    return None, searched


def _read_config(d: Path | None) -> dict:
    if d is None:
        return {}
    from dsdoctor.model.spec import read_config_json  # the one reader of config.json: bounded size, depth, nodes

    return read_config_json(d)[1]


def model_file_problem(src: Path, folder: Path) -> Phrase | None:
    """Why ``src`` must not be copied into the output (None: copy it). Only regular files inside the model
    folder are copied: a checkpoint folder is untrusted, and a ``tokenizer.json`` linked to ``/etc/shadow``
    would otherwise land in a folder that is then shared. One kind of link out is allowed: the Hugging Face
    cache's, from ``snapshots/REV/NAME`` to ``blobs/HASH`` of the same model repository."""
    try:
        st = os.stat(src)
    except OSError as exc:
        return Phrase("unreadable", {"error": exc.strerror})
    if not stat.S_ISREG(st.st_mode):
        return Phrase("not_regular")
    if not src.is_symlink():
        return None
    real, home = src.resolve(), folder.resolve()
    if home in real.parents:
        return None
    if home.parent.name == "snapshots" and (home.parent.parent / "blobs") in real.parents:
        return None
    return Phrase("link_out", {"folder": printable(folder), "target": printable(real)})


def _ties_embeddings(cfg: dict) -> bool:
    for c in (cfg, cfg.get("text_config") or {}):
        if c.get("tie_word_embeddings") is True:
            return True
    return False


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="merging", file=sys.stderr,
                disable=not sys.stderr.isatty(), leave=False)


def merge(ckpt_dir, out_dir, tag: str | None = None, dtype: str = "fp32", max_shard_size="5GB",
          model=None, force: bool = False, progress: bool = True, merge_lora: bool = False,
          adapter_config=None, expert_layout: str = "auto") -> MergeResult:
    """Merge a DeepSpeed ZeRO checkpoint into safetensors shards + index in ``out_dir``.

    A PEFT LoRA checkpoint becomes a PEFT adapter (``adapter_model.safetensors`` + the run's
    ``adapter_config.json``, found beside the checkpoint or given as ``adapter_config``), or with
    ``merge_lora`` the base model's weights with every LoRA update folded in. A mixture-of-experts model's expert
    weights are written in ``expert_layout`` (moe.plan_layout; 'auto': per-expert, which every transformers loads)."""
    started = time.perf_counter()
    if dtype not in DTYPES:
        raise InputError(f"--dtype must be one of fp32, bf16, fp16, not {dtype!r}")
    out_dtype = DTYPES[dtype]
    max_bytes = parse_bytes(max_shard_size, "--max-shard-size")
    if max_bytes <= 0:
        raise InputError("--max-shard-size must be positive")
    out = Path(out_dir)
    layout = find_layout(ckpt_dir, tag)
    cfg_dir, searched = _config_dir(model, layout.root)
    inputs = [layout.root, layout.tag_dir, cfg_dir, *layout.optim_files, *layout.model_files,
              *[f for sub in layout.mp_layouts for f in sub.optim_files + sub.model_files]]
    door.check_output_path(out, force, inputs)
    plan = plan_checkpoint(layout)
    keyed, aliases, lora_info, adapter_file, rename = _lora_outputs(plan, layout, model, merge_lora, adapter_config)
    adapter_out = lora_info is not None and lora_info["output"] == "adapter"
    # a config.json that is a link out of its folder is neither read nor copied (DSD415 below says so)
    cfg = {} if cfg_dir is None or model_file_problem(cfg_dir / "config.json", cfg_dir) else _read_config(cfg_dir)
    keyed, experts = (keyed, None) if adapter_out else moe.plan_layout(keyed, cfg.get("model_type"), expert_layout)

    findings: list[Finding] = []
    tensors = [OutTensor(key, t, output_dtype(t, out_dtype)) for key, t in keyed]
    stored_once = _ties_embeddings(cfg)
    if aliases and not stored_once:
        by_name = {t.name: t for t in tensors}
        tensors += [OutTensor(alias, by_name[src].plan, by_name[src].dtype) for alias, src in aliases.items()]
        findings.append(Finding("DSD411", {"names": ", ".join(f"{a} = {s}" for a, s in aliases.items())}))
    from_module = [key for key, t in keyed if t.kind == "module"]
    if from_module:
        findings.append(Finding("DSD412", {"count": len(from_module), "names": _listed(from_module, 5)}))
    to_copy = ([] if adapter_file is None else [adapter_file]) + _model_files(cfg_dir, adapter_out, findings)
    # bounded, not sparse: checked first
    total = sum(t.nbytes for t in tensors) + sum(door.copy_size(src, door.MODEL_FILE) for src in to_copy)
    no_crc = sorted({str(p.ref.path) for _, t in keyed for p in t.pieces if p.ref.record_crc is None})
    if no_crc:
        findings.append(Finding("DSD416", {"count": len(no_crc), "files": _listed([Path(f).name for f in no_crc], 3)}))
    _check_disk(out, total)

    def stale_found(stale):
        from dsdoctor.units import human_bytes

        for p, size in stale:
            findings.append(Finding("DSD414", {"path": printable(p), "size": human_bytes(size)}))

    bar = _progress(total, progress)
    values = Values()
    try:
        with door.atomic_output_dir(out, force=force, inputs=inputs, command="merge", on_stale=stale_found) as tmp:
            metadata = {"format": "pt", "dsdoctor": {
                "source": str(layout.tag_dir), "zero_stage": plan.stage, "world_size": plan.world_size,
                "tensor_parallel": plan.tp_size, "dtype": out_dtype, "tied_weights": aliases,
                "tied_stored_once": stored_once and bool(aliases), "lora": lora_info, "experts": experts,
            }}
            shards, _, written = write_all(tmp, tensors, max_bytes, metadata,
                                           on_bytes=(bar.update if bar is not None else lambda n: None),
                                           single=lora.ADAPTER_WEIGHTS if adapter_out else None, values=values)
            check_output(tmp / shards[0] if adapter_out else tmp, tensors, plan.recorded, rename, values, out,
                         experts)
            copied = _copy_files(to_copy, adapter_file, tmp)
    finally:
        if bar is not None:
            bar.close()
    if adapter_out:
        findings.append(Finding("DSD421", {"out_dir": str(out), "count": len(tensors), "adapter": lora_info["adapter"],
                                           "layers": lora_info["layers"], "ckpt": str(layout.root)}))
    elif "config.json" not in copied:
        findings.append(Finding("DSD410", {"searched": ", ".join(map(str, searched)), "out_dir": str(out)}))

    return MergeResult(
        checkpoint=str(layout.root), tag=layout.tag, zero_stage=plan.stage, world_size=plan.world_size,
        ds_version=plan.ds_version, out_dir=str(out), dtype=out_dtype,
        tensors=len(tensors),
        parameters=sum(t.plan.numel for t in tensors if t.plan.kind != "buffer" and t.name not in aliases),
        frozen=sum(1 for _, t in keyed if t.kind in ("frozen", "module")),
        buffers=sum(1 for _, t in keyed if t.kind == "buffer"),
        bytes_written=written, shards=shards, tied=dict(aliases), tied_stored_once=stored_once and bool(aliases),
        copied_files=copied, seconds=time.perf_counter() - started, findings=findings,
        tensor_parallel=plan.tp_size, source=plan.source, lora=lora_info, experts=experts,
    )


def _copy_files(to_copy: list[Path], adapter_file, tmp: Path) -> list[str]:
    """The model's files (the adapter's config under PEFT's name) copied into the output; their names."""
    copied = []
    for src in to_copy:
        name = lora.CONFIG_NAME if src == adapter_file else src.name
        door.copy_file(src, tmp / name, door.ADAPTER_CONFIG if src == adapter_file else door.MODEL_FILE)
        copied.append(name)
    return copied


def _listed(names: list[str], limit: int) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _model_files(cfg_dir: Path | None, adapter_out: bool, findings: list[Finding]) -> list[Path]:
    """The model's files to copy beside the weights; one that is a link out of its folder is DSD415, not copied."""
    out = []
    for name in MODEL_FILES if cfg_dir is not None else ():
        src = cfg_dir / name
        if adapter_out and name in ("config.json", "generation_config.json"):
            continue  # a base config beside adapter keys is the bug this output avoids
        if not src.exists() and not src.is_symlink():
            continue
        problem = model_file_problem(src, cfg_dir)
        if problem:
            findings.append(Finding("DSD415", {"file": printable(src), "problem": problem}))
        else:
            out.append(src)
    return out


def _check_disk(out: Path, total: int) -> None:
    parent = door.make_dir(out.resolve().parent, "the output's folder")
    free = door.free_bytes(parent)
    if free < total + DISK_MARGIN:
        raise InputError(f"not enough free disk space: the merge writes {human_bytes(total)}, "
                         f"{human_bytes(free)} free", path=parent)


def check_output(written, tensors: list[OutTensor], recorded: dict, rename, values: Values, out,
                 experts: dict | None = None) -> None:
    """merge's own output, before it is renamed into place, with verify's checks: its headers read back against
    the checkpoint's record of every tensor (``rename``: a recorded name's key in the output, None where the
    output leaves it out; ``experts``: the expert layout written, moe.plan_layout's), and the values seen while
    writing (finite; parameters plausible). A contradiction is exit 2 naming it (DSD417); the caller's output
    folder is then removed."""
    entries = index_weights(written)
    expected = {key: tuple(shape) for name, shape in recorded.items() if (key := rename(name)) is not None}
    if experts is not None:
        expected = moe.converted_shapes(expected, experts["family"], experts["layout"])
    expected.update({t.name: expected[key] for t in tensors  # tied weights written twice
                     if t.name not in expected and (key := rename(t.plan.name)) in expected})
    found = {n: e.shape for n, e in entries.items()}
    details = [f"{f.code} {f.message('en')}" for f in (names_and_shapes(found, expected, out) if recorded else [])
               + values.findings({t.name for t in tensors if t.plan.kind != "buffer"})]
    details += [f"{t.name} written as {entries[t.name].dtype}, not {t.dtype}" for t in tensors
                if t.name in entries and entries[t.name].dtype != t.dtype]
    if details:
        found = Finding("DSD417", {"details": "; ".join(details)})
        raise InputError(f"{found.code}: {found.message('en')}", path=out, hint=f"dsdoctor explain {found.code}")


def _lora_outputs(plan, layout, model, merge_lora: bool, adapter_config):
    """(key, tensor) pairs to write, tied aliases, what was done with a LoRA checkpoint (None: not one), the
    adapter_config.json to copy beside an adapter, and each tensor's key in the output (None: left out)."""
    adapter = lora.detect(plan)
    if adapter is None:
        if merge_lora or adapter_config is not None:
            flag = "--merge-lora" if merge_lora else "--adapter-config"
            raise InputError(f"{flag}: not a LoRA checkpoint (no lora_A / lora_B tensors)", path=layout.tag_dir)
        return [(t.name, t) for t in plan.tensors], dict(plan.aliases), None, None, str
    folders = [layout.tag_dir, layout.root, layout.root.parent] + ([Path(model)] if model else [])
    cfg_path, looked = lora.find_config(adapter_config, folders)
    example = next(iter(adapter.modules))
    if cfg_path is None:
        raise InputError(f"a PEFT LoRA checkpoint (adapter '{adapter.name}', {len(adapter.modules)} LoRA layers such "
                         f"as {example}): writing it needs the run's adapter_config.json (r, lora_alpha, use_rslora), "
                         f"which is in none of {', '.join(map(str, looked))}", path=layout.tag_dir,
                         hint="pass --adapter-config FILE; PEFT writes it with model.save_pretrained(DIR)")
    if model_file_problem(cfg_path, cfg_path.parent) is not None:
        raise InputError("not a regular file inside its folder (a link out of it, or a device); dsdoctor neither "
                         "reads nor copies it", path=cfg_path, hint="copy the real adapter_config.json there")
    cfg = lora.read_config(cfg_path)
    layers = {lora.relative(m.path, adapter): set(m.parts) for m in adapter.modules.values()}
    weights = {key.rsplit(".", 1)[0] for t in plan.tensors if (key := lora.base_key(t.name, adapter)) and
               key.endswith(".weight")}
    problems = lora.contradictions(cfg, layers, weights)
    if problems:  # PEFT would load another model than the one trained; verify rejects it too
        found = Finding("DSD423", {"config": lora.CONFIG_NAME, "details": "; ".join(problems)})
        raise InputError(f"{found.code}: {found.message('en')}", path=cfg_path, hint=f"dsdoctor explain {found.code}")
    info = {"adapter": adapter.name, "layers": len(adapter.modules), "config": str(cfg_path), "r": cfg.r,
            "alpha": cfg.alpha, "rslora": cfg.use_rslora, "dora": cfg.use_dora}
    if merge_lora:
        keyed, aliases = lora.merged_plan(plan, adapter, cfg)
        return keyed, aliases, dict(info, output="merged"), None, lambda n: lora.base_key(n, adapter)
    keyed = lora.adapter_plan(plan, adapter, cfg)
    kept = {t.name for _, t in keyed}
    return keyed, {}, dict(info, output="adapter"), cfg_path, lambda n: lora.saved_key(n, adapter) if n in kept else None


__all__ = ["merge", "MergeResult", "INDEX_NAME"]
