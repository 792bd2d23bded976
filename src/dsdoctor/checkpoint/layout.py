"""Find a DeepSpeed checkpoint's files: the tag, one model-states and one optim-states file per rank.

Layouts (DeepSpeed 0.19.8, runtime/engine.py):
  ZeRO-3:   <tag>/zero_pp_rank_{r}_mp_rank_{mm}_model_states.pt and [bf16_]zero_pp_rank_{r}_mp_rank_{mm}_optim_states.pt
  ZeRO-1/2: <tag>/mp_rank_{mm}_model_states.pt (one) and [bf16_]zero_pp_rank_{r}_mp_rank_{mm}_optim_states.pt
r is the data-parallel (ZeRO partition) rank, mm the tensor-parallel (AutoTP) rank: each mm has its own set of
files, one ZeRO checkpoint of its shard of every parameter (``mp_layouts``).
Universal (deepspeed/checkpoint/ds_to_universal.py): <folder>/zero/<param>/fp32.pt plus the copied
*_model_states.pt; the checkpoint folder's ``latest_universal`` names the folder.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
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
    mp_layouts: list[Layout] = field(default_factory=list)  # one per tensor-parallel rank, when there are several
    universal: bool = False  # a ds_to_universal folder: no optim-states files, zero/<param>/fp32.pt instead

    @property
    def world_size(self) -> int:
        return len(self.optim_files)

    @property
    def tp_size(self) -> int:
        return len(self.mp_layouts) or 1


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
        if not latest.exists() and not latest.is_symlink() and (root / "latest_universal").is_file():
            latest = root / "latest_universal"  # only ds_to_universal's output is here
        if not latest.exists() and not latest.is_symlink():
            raise InputError("no `latest` file naming the checkpoint tag", path=root,
                             hint=f"{found}; pass --tag TAG" if tags else found)
        real = Path(os.path.realpath(latest))  # a link out (but the Hugging Face cache's to its blobs): never read
        if latest.is_symlink() and Path(os.path.realpath(root)) not in real.parents and real.parent.name != "blobs":
            raise InputError(f"`{latest.name}` links out of the checkpoint folder; it is not read", path=latest)
        tag = door.read_bytes(latest, door.LATEST).decode("utf-8", "replace").strip()
        if not tag:
            raise InputError(f"`{latest.name}` is empty", path=latest, hint=found)
        source = f"`{latest.name}`"
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


def _by_rank(files: dict[tuple[int, int], Path], what: str, tag_dir: Path) -> list[Path]:
    """The files of one tensor-parallel rank in data-parallel rank order; a gap is named."""
    ranks = sorted(r for r, _ in files)
    want = list(range(len(ranks)))
    if ranks != want:
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise InputError(f"missing {what} file(s) {missing_names(list(files.values()), missing)} for rank(s) "
                         f"{', '.join(map(str, missing))} (found ranks {', '.join(map(str, ranks))})", path=tag_dir,
                         hint="a rank failed to save, or the files were copied incompletely")
    return [files[key] for key in sorted(files)]


def missing_names(present: list[Path], missing_ranks: list[int], limit: int = 4, mp: int | None = None) -> str:
    """The file names the missing ranks would have, from a present file's name (e.g.
    zero_pp_rank_1_mp_rank_00_optim_states.pt); ``mp`` also sets the tensor-parallel rank."""
    template = sorted(p.name for p in present)[0]
    if mp is not None:
        template = re.sub(r"mp_rank_\d+", f"mp_rank_{mp:02d}", template, count=1)
    names = [re.sub(r"zero_pp_rank_\d+_", f"zero_pp_rank_{r}_", template, count=1) for r in missing_ranks[:limit]]
    more = f", ... ({len(missing_ranks) - limit} more)" if len(missing_ranks) > limit else ""
    return ", ".join(names) + more


def _pair(model: dict, optim: dict, tag_dir: Path) -> None:
    """Every data-parallel rank has both its model-states and its optim-states file: name the missing ones."""
    for have, lack, have_what, lack_what in ((model, optim, "model-states", "optim-states"),
                                             (optim, model, "optim-states", "model-states")):
        gone = sorted(set(have) - set(lack))
        if gone and lack:
            by_mp: dict[int, list[int]] = {}
            for r, mp in gone:
                by_mp.setdefault(mp, []).append(r)
            names = ", ".join(missing_names(list(lack.values()), ranks, mp=mp) for mp, ranks in sorted(by_mp.items()))
            ranks = ", ".join(str(r) for r in sorted({r for r, _ in gone}))
            raise InputError(f"missing {lack_what} file(s) {names} for rank(s) {ranks}: {len(have)} {have_what} "
                             f"files but {len(lack)} {lack_what} files", path=tag_dir,
                             hint="a rank failed to save, or the files were copied incompletely")


def _mp_ranks(groups: list[dict], tag_dir: Path) -> list[int]:
    mps = sorted({mp for g in groups for _, mp in g})
    if mps != list(range(len(mps))):
        gone = sorted(set(range(max(mps) + 1)) - set(mps))
        raise InputError(f"missing the files of tensor-parallel rank(s) {', '.join(f'mp_rank_{m:02d}' for m in gone)} "
                         f"(found {', '.join(f'mp_rank_{m:02d}' for m in mps)})", path=tag_dir,
                         hint="a rank failed to save, or the files were copied incompletely")
    return mps


def check_tp_ranks(layout: Layout, sd: dict, path: Path) -> None:
    """At least as many tensor-parallel ranks' files as the model-states file ``path`` records
    (``mp_world_size``): the last rank's files gone would otherwise merge as a smaller model."""
    want, have = sd.get("mp_world_size"), layout.tp_size
    if not isinstance(want, int) or isinstance(want, bool) or not have < want <= 1_000_000:
        return
    gone = [f"mp_rank_{m:02d}" for m in range(have, min(want, have + 4))] + (["..."] if want > have + 4 else [])
    raise InputError(f"missing the files of tensor-parallel rank(s) {', '.join(gone)} "
                     f"(found {', '.join(f'mp_rank_{m:02d}' for m in range(min(have, 4)))}"
                     f"{', ...' if have > 4 else ''}; {path.name} records mp_world_size {want})", path=layout.tag_dir,
                     hint="a rank failed to save, or the files were copied incompletely")


def find_layout(ckpt_dir, tag: str | None = None) -> Layout:
    root, tag, tag_dir = find_tag_dir(ckpt_dir, tag)
    optim, model3, model12 = _rank_files(tag_dir)
    if not optim and (model3 or model12) and (tag_dir / "zero").is_dir():
        return _universal_layout(root, tag, tag_dir, model3 or model12)
    if not optim:
        raise _no_optim(root, tag_dir, bool(model3 or model12))
    if not model3 and not model12:
        raise InputError("no *_model_states.pt file", path=tag_dir)
    if model3:
        _pair(model3, optim, tag_dir)
    layouts = [_mp_layout(root, tag, tag_dir, mp, optim, model3, model12)
               for mp in _mp_ranks([optim, model3 or model12], tag_dir)]
    counts = {len(lay.optim_files) for lay in layouts}
    if len(counts) > 1:
        detail = ", ".join(f"mp_rank_{lay.mp_rank:02d}: {len(lay.optim_files)}" for lay in layouts)
        raise InputError(f"the tensor-parallel ranks have different numbers of optim-states files ({detail})",
                         path=tag_dir, hint="a rank failed to save, or the files were copied incompletely")
    if len(layouts) == 1:
        return layouts[0]
    first = layouts[0]
    return Layout(root=root, tag=tag, tag_dir=tag_dir, optim_files=first.optim_files, model_files=first.model_files,
                  mp_layouts=layouts)


def _no_optim(root: Path, tag_dir: Path, has_model: bool) -> InputError:
    hint = ("a checkpoint saved without an optimizer (ZeRO-Inference) has no fp32 partitions and no "
            "param_shapes, so neither dsdoctor nor zero_to_fp32 can rebuild it; save it from a training engine")
    if not has_model:
        hint = f"tags found: {', '.join(list_tags(root)) or 'none'}"
    return InputError("no *_optim_states.pt files", path=tag_dir, hint=hint)


def _rank_files(tag_dir: Path) -> tuple[dict, dict, dict]:
    """The tag folder's optim-states, ZeRO-3 and ZeRO-1/2 model-states files by (rank, mp rank); one layout kind
    a file name each. DeepSpeed-MoE's expert files are refused."""
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
                f"a DeepSpeed-MoE checkpoint (deepspeed.moe expert files such as {p.name}, saved per expert-parallel "
                "rank outside the ZeRO partitions): dsdoctor does not merge this format (zero_to_fp32 fails on it "
                "too), and a merge without those files would lack every expert", path=tag_dir)
    return optim, model3, model12


def _mp_layout(root: Path, tag: str, tag_dir: Path, mp: int, optim: dict, model3: dict, model12: dict) -> Layout:
    """The files of one tensor-parallel rank ``mp``."""
    optim_files = _by_rank({k: v for k, v in optim.items() if k[1] == mp}, "optim-states", tag_dir)
    if model3:
        model_files = _by_rank({k: v for k, v in model3.items() if k[1] == mp}, "model-states", tag_dir)
    else:
        model_files = [v for k, v in model12.items() if k[1] == mp]
        if not model_files:
            raise InputError(f"missing mp_rank_{mp:02d}_model_states.pt (found "
                             f"{', '.join(p.name for p in model12.values())})", path=tag_dir)
    return Layout(root=root, tag=tag, tag_dir=tag_dir, optim_files=optim_files, model_files=model_files, mp_rank=mp)


def _universal_layout(root: Path, tag: str, tag_dir: Path, models: dict) -> Layout:
    """ds_to_universal's output: the model-states files it copied (the tensor-parallel rank 0's, data-parallel
    ranks in order) and zero/<param>/fp32.pt."""
    mps = _mp_ranks([models], tag_dir)
    per_mp = [_by_rank({k: v for k, v in models.items() if k[1] == mp}, "model-states", tag_dir) for mp in mps]
    return Layout(root=root, tag=tag, tag_dir=tag_dir, optim_files=[], model_files=per_mp[0], universal=True,
                  mp_layouts=[Layout(root, tag, tag_dir, [], files, mp) for mp, files in enumerate(per_mp)]
                  if len(mps) > 1 else [])


def checkpoint_near(path) -> Path | None:
    """A DeepSpeed checkpoint folder (``latest`` or a tag folder with *_model_states.pt) at or beside ``path``:
    itself, its parent, or one of their sub-folders (what the HF Trainer and save_checkpoint leave there)."""
    p = Path(path)
    p = p.parent if p.is_file() else p
    for base in (p, p.parent):
        try:
            subs = sorted(x for x in base.iterdir() if x.is_dir() and not x.is_symlink())[:256]
        except OSError:
            continue
        for d in [base, *subs]:
            try:
                if (d / "latest").is_file() or list_tags(d):
                    return d
            except OSError:
                continue
    return None
