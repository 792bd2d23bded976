"""What to write: every output tensor as an ordered list of byte ranges in the shard files.

``read_states`` loads the (small) pickles of a layout; ``build_plan`` dispatches to the ZeRO-3 or ZeRO-1/2
rebuild rule. Nothing here reads tensor data except buffers and frozen fragments' headers.
"""
from __future__ import annotations

from dsdoctor.checkpoint import unpickle
from dsdoctor.checkpoint.layout import Layout, check_tp_ranks, missing_names
from dsdoctor.checkpoint.pieces import MergePlan, Piece, States, TensorPlan, recorded_shapes
from dsdoctor.checkpoint.provenance import check_one_save
from dsdoctor.checkpoint.unpickle import TensorRef, short_repr
from dsdoctor.checkpoint.zero3 import plan_zero3
from dsdoctor.checkpoint.zero12 import plan_zero12
from dsdoctor.errors import InputError, printable


def read_states(layout: Layout) -> States:
    model = [unpickle.load(p) for p in layout.model_files]
    optim, tops = [], []
    for p in layout.optim_files:
        sd = unpickle.load(p)
        tops.append(sd if isinstance(sd, dict) else {})
        osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
        if not isinstance(osd, dict) or "zero_stage" not in osd:
            raise InputError("not a ZeRO optimizer checkpoint (no optimizer_state_dict.zero_stage)", path=p)
        optim.append(osd)
    for p, sd in zip(layout.model_files, model):
        if not isinstance(sd, dict) or "buffer_names" not in sd:
            raise InputError("not a DeepSpeed model-states file (no buffer_names)", path=p)
        if sd.get("ds_autoep_layers") or sd.get("autoep_layers"):
            raise InputError("a DeepSpeed AutoEP ZeRO-3 checkpoint (ds_autoep_layers): its expert parameters are "
                             "partitioned over expert replica groups, not over all ranks, so a data-parallel merge "
                             "would be wrong; dsdoctor (like zero_to_fp32) does not merge this format", path=p,
                             hint="DeepSpeed's ds_to_universal.py converts it expert by expert")
        if not sd.get("param_shapes"):
            raise InputError("no param_shapes: saved without an optimizer, so the flat partitions cannot be "
                             "mapped back to parameters", path=p)
    return States(layout, model, optim, tops)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 1_000_000


def check_world_size(states: States) -> int:
    """World size from partition_count, the same in every file and equal to the number of rank files."""
    sizes = []
    for p, osd in zip(states.layout.optim_files, states.optim):
        pc = osd.get("partition_count")
        if isinstance(pc, (list, tuple)):  # one count per parameter group (MoE expert groups may differ)
            pc = max(pc) if pc and all(_count(x) for x in pc) else pc
        if not _count(pc):
            raise InputError(f"invalid partition_count {short_repr(pc)}", path=p)
        sizes.append((p, pc))
    distinct = sorted({pc for _, pc in sizes})
    if len(distinct) > 1:
        detail = ", ".join(f"{p.name}: {pc}" for p, pc in sizes)
        raise InputError(f"shards from different world sizes ({detail})", path=states.layout.tag_dir,
                         hint="an old checkpoint was partly overwritten; re-save it or pick another tag")
    world = distinct[0]
    have = len(states.layout.optim_files)
    if world != have:
        kind = "missing" if have < world else "extra"
        named = ""
        if have < world:
            named = f" ({missing_names(states.layout.optim_files, list(range(have, world)))} not found)"
        raise InputError(f"{kind} rank files: saved by {world} ranks (partition_count) but {have} "
                         f"optim-states files are present{named}", path=states.layout.tag_dir,
                         hint="a rank failed to save or files from another run were copied in")
    for p, osd in zip(states.layout.optim_files, states.optim):
        stage = osd["zero_stage"]
        if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage <= 3:
            raise InputError(f"invalid zero_stage {short_repr(stage)}", path=p)
    stages = {int(osd["zero_stage"]) for osd in states.optim}
    if len(stages) > 1:
        raise InputError(f"optim-states files of different ZeRO stages {sorted(stages)}", path=states.layout.tag_dir)
    return world


def plan_checkpoint(layout: Layout) -> MergePlan:
    """The plan of any layout: a universal folder, several tensor-parallel ranks, or one ZeRO checkpoint."""
    from dsdoctor.checkpoint import tp
    from dsdoctor.checkpoint.universal import plan_universal

    per_mp = [] if layout.universal else [read_states(sub) for sub in layout.mp_layouts or [layout]]
    try:
        if layout.universal:
            return plan_universal(layout)
        check_tp_ranks(layout, per_mp[0].model[0], layout.model_files[0])
        if layout.mp_layouts:
            return tp.plan_tp(per_mp, build_plan)
        plan = build_plan(per_mp[0])
        info = tp.recorded_info(per_mp[0].model[0])  # an AutoTP save read as one rank: its maps give the full shapes
        if info:
            plan.recorded.update(tp.logical_shapes(info, [plan.recorded], layout.model_files[0], maps_only=True))
        return plan
    except (AttributeError, TypeError, KeyError, ValueError, IndexError) as exc:
        raise InputError(f"malformed checkpoint: {type(exc).__name__}: {printable(exc)[:200]}",
                         path=layout.tag_dir) from None


def build_plan(states: States) -> MergePlan:
    world = check_world_size(states)
    check_one_save(states)  # every rank file from one save: the odd one is named
    stage = int(states.optim[0]["zero_stage"])
    if stage == 3:
        planner = plan_zero3
    elif stage in (1, 2):
        planner = plan_zero12
    else:
        raise InputError(f"unsupported zero_stage {stage}", path=states.layout.optim_files[0])
    try:
        tensors = buffers(states) + planner(states, world)
        recorded = recorded_shapes(states.model[0], states.layout.model_files[0])
    except (AttributeError, TypeError, KeyError, ValueError, IndexError) as exc:
        # a crafted or damaged file whose fields have the wrong types (a dict where a list belongs...)
        raise InputError(f"malformed checkpoint: {type(exc).__name__}: {printable(exc)[:200]}",
                         path=states.layout.tag_dir) from None
    names = [t.name for t in tensors]
    bad = [n for n in names if not isinstance(n, str) or not n or len(n) > 1024]
    if bad:
        raise InputError(f"malformed checkpoint: a parameter name is {short_repr(bad[0])}, not a string",
                         path=states.layout.model_files[0])
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise InputError(f"a parameter appears twice: {', '.join(dup[:5])}", path=states.layout.model_files[0])
    shared = states.model[0].get("shared_params") or {}
    have = set(names)
    shared = shared if isinstance(shared, dict) else {}
    aliases = {alias: src for alias, src in shared.items()
               if isinstance(alias, str) and isinstance(src, str) and src in have and alias not in have}
    return MergePlan(stage=stage, world_size=world, tensors=tensors, aliases=aliases,
                     ds_version=states.model[0].get("ds_version"), recorded=recorded)


def buffers(states: States) -> list[TensorPlan]:
    sd = states.model[0]
    module = sd.get("module") or {}
    out = []
    for name in sd.get("buffer_names") or []:
        ref = module.get(name)
        if isinstance(ref, TensorRef):
            out.append(TensorPlan(name, tuple(ref.shape), ref.dtype, [Piece(ref, 0, ref.numel)], "buffer"))
    return out
