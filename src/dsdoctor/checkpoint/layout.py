"""Find a DeepSpeed checkpoint's files: the tag, one model-states and one optim-states file per rank.

Layouts (DeepSpeed 0.19.8, runtime/engine.py):
  ZeRO-3:   <tag>/zero_pp_rank_{r}_mp_rank_{mm}_model_states.pt and [bf16_]zero_pp_rank_{r}_mp_rank_{mm}_optim_states.pt
  ZeRO-1/2: <tag>/mp_rank_{mm}_model_states.pt (one) and [bf16_]zero_pp_rank_{r}_mp_rank_{mm}_optim_states.pt
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dsdoctor import door
from dsdoctor.errors import InputError, printable

OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
EXPERT_RE = re.compile(r"^(?:layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$|^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$")


@dataclass
class Layout:
    root: Path  # the directory given
    tag: str
    tag_dir: Path
    optim_files: list[Path]  # index = data-parallel rank
    model_files: list[Path]  # one per rank (ZeRO-3) or one in all (ZeRO-1/2)
    mp_rank: int = 0

    @property
    def world_size(self) -> int:
        return len(self.optim_files)


def _is_tag_dir(p: Path) -> bool:
    return p.is_dir() and any(p.glob("*_model_states.pt"))


def list_tags(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if _is_tag_dir(p)) if root.is_dir() else []


def find_tag_dir(ckpt_dir, tag: str | None = None) -> tuple[Path, str, Path]:
    root = Path(ckpt_dir)
    if not root.exists():
        raise InputError("checkpoint directory not found", path=root)
    if not root.is_dir():
        raise InputError("not a directory; give the checkpoint directory (the one holding `latest`)", path=root)
    if tag is None and _is_tag_dir(root) and not (root / "latest").exists():
        return root, root.name, root  # given the tag directory itself
    tags = list_tags(root)
    found = f"tags found: {', '.join(tags)}" if tags else "no tag directories with *_model_states.pt found"
    source = "--tag"
    if tag is None:
        latest = root / "latest"
        if not latest.exists() and not latest.is_symlink():
            raise InputError("no `latest` file naming the checkpoint tag", path=root,
                             hint=f"{found}; pass --tag TAG" if tags else found)
        tag = door.read_bytes(latest, door.LATEST).decode("utf-8", "replace").strip()
        if not tag:
            raise InputError("`latest` is empty", path=latest, hint=found)
        source = "`latest`"
    tag_dir = _inside(root, tag, source)
    if not tag_dir.is_dir():
        raise InputError(f"tag {printable(repr(tag))} has no directory", path=root, hint=found)
    return root, tag, tag_dir


def _inside(root: Path, tag: str, source: str) -> Path:
    """The tag's directory, which must be a folder inside the checkpoint folder: a tag is a name, never a path
    out of it (an absolute path, `..`, or a symbolic link elsewhere would merge another checkpoint and pair it
    with this folder's config.json)."""
    shown = printable(repr(tag))
    if "\x00" in tag or Path(tag).is_absolute() or ".." in Path(tag).parts:
        raise InputError(f"{source} names tag {shown}, which is not a name inside the checkpoint folder", path=root,
                         hint="a tag is a folder name such as global_step500")
    tag_dir = root / tag
    real_root = root.resolve()
    try:
        real = tag_dir.resolve()
    except (OSError, RuntimeError):
        real = None
    if real is None or real == real_root or real_root not in real.parents:
        raise InputError(f"{source} names tag {shown}, which leads out of the checkpoint folder "
                         f"(to {printable(real)})", path=root, hint="a tag is a folder inside the checkpoint folder")
    return tag_dir


def _by_rank(files: dict[tuple[int, int], Path], what: str, tag_dir: Path) -> tuple[int, list[Path]]:
    mp_ranks = sorted({mp for _, mp in files})
    if len(mp_ranks) > 1:
        raise InputError(
            f"{len(mp_ranks)} model-parallel ranks (mp_rank {', '.join(f'{m:02d}' for m in mp_ranks)}): this is a "
            "tensor-parallel (AutoTP/Megatron) + ZeRO checkpoint. Merging it needs, for every parameter, the "
            "dimension it was split along and whether it is replicated; DeepSpeed does not record either in the "
            "checkpoint, so dsdoctor refuses rather than guess",
            path=tag_dir,
            hint="merge it with the framework that did the tensor-parallel split, or save with tp_size 1",
        )
    ranks = sorted(r for r, _ in files)
    want = list(range(len(ranks)))
    if ranks != want:
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise InputError(f"missing {what} file(s) {missing_names(list(files.values()), missing)} for rank(s) "
                         f"{', '.join(map(str, missing))} (found ranks {', '.join(map(str, ranks))})", path=tag_dir,
                         hint="a rank failed to save, or the files were copied incompletely")
    return mp_ranks[0], [files[(r, mp_ranks[0])] for r in ranks]


def missing_names(present: list[Path], missing_ranks: list[int], limit: int = 4) -> str:
    """The file names the missing ranks would have, from a present file's name (e.g.
    zero_pp_rank_1_mp_rank_00_optim_states.pt)."""
    template = sorted(p.name for p in present)[0]
    names = [re.sub(r"zero_pp_rank_\d+_", f"zero_pp_rank_{r}_", template, count=1) for r in missing_ranks[:limit]]
    more = f", ... ({len(missing_ranks) - limit} more)" if len(missing_ranks) > limit else ""
    return ", ".join(names) + more


def find_layout(ckpt_dir, tag: str | None = None) -> Layout:
    root, tag, tag_dir = find_tag_dir(ckpt_dir, tag)
    optim, model3, model12 = {}, {}, {}
    for p in sorted(tag_dir.iterdir()):
        if m := OPTIM_RE.match(p.name):
            key = (int(m.group(1)), int(m.group(2)))
            if key in optim:
                raise InputError(f"two optim-states files for rank {key[0]}: {optim[key].name} and {p.name}",
                                 path=tag_dir)
            optim[key] = p
        elif m := ZERO3_MODEL_RE.match(p.name):
            model3[(int(m.group(1)), int(m.group(2)))] = p
        elif m := MODEL_RE.match(p.name):
            model12[(0, int(m.group(1)))] = p
        elif EXPERT_RE.match(p.name):
            raise InputError(
                f"mixture-of-experts checkpoint ({p.name}): expert parameters are saved per expert-parallel rank "
                "outside the ZeRO partitions; dsdoctor (like zero_to_fp32) does not merge them yet, and a merge "
                "without them would silently lack every expert", path=tag_dir)
    if not optim:
        hint = ("a checkpoint saved without an optimizer (ZeRO-Inference) has no fp32 partitions and no "
                "param_shapes, so neither dsdoctor nor zero_to_fp32 can rebuild it; save it from a training engine")
        if not model3 and not model12:
            hint = f"tags found: {', '.join(list_tags(root)) or 'none'}"
        raise InputError("no *_optim_states.pt files", path=tag_dir, hint=hint)
    mp, optim_files = _by_rank(optim, "optim-states", tag_dir)
    if model3:
        mp3, model_files = _by_rank(model3, "model-states", tag_dir)
        if len(model_files) != len(optim_files):
            raise InputError(f"{len(model_files)} model-states files but {len(optim_files)} optim-states files",
                             path=tag_dir, hint="the files come from different runs or a rank failed to save")
    elif model12:
        if len(model12) > 1:
            _by_rank(model12, "model-states", tag_dir)  # raises on several mp ranks
        model_files = list(model12.values())
    else:
        raise InputError("no *_model_states.pt file", path=tag_dir)
    return Layout(root=root, tag=tag, tag_dir=tag_dir, optim_files=optim_files, model_files=model_files, mp_rank=mp)
