"""The ZeRO-3 rebuild rule on synthetic checkpoints (no DeepSpeed launch): random shapes, world sizes and
param-group splits, written in DeepSpeed's file layout with torch.save, merged, compared with the originals."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsdoctor.checkpoint.merge import merge
from dsdoctor.checkpoint.unpickle import load
from dsdoctor.errors import InputError
from tests.checkpoint_fixtures import read_merged


def write_zero3(tag_dir: Path, params: dict, world: int, groups: int, frozen: dict | None = None) -> None:
    """Partition ``params`` the way DeepSpeed 0.19.8 stage 3 does and save one pair of files per rank."""
    import torch

    tag_dir.mkdir(parents=True)
    (tag_dir.parent / "latest").write_text(tag_dir.name)
    names = list(params)
    cut = max(1, len(names) // groups) if groups > 1 else len(names)
    group_names = [names[:cut], names[cut:]] if groups > 1 and len(names) > 1 else [names]
    frozen = frozen or {}
    for rank in range(world):
        flat_groups = []
        for gnames in group_names:
            parts = []
            for n in gnames:
                t = params[n].reshape(-1)
                per = math.ceil(t.numel() / world)
                padded = torch.cat([t, torch.zeros(per * world - t.numel())])
                parts.append(padded[rank * per:(rank + 1) * per])
            flat_groups.append(torch.cat(parts) if parts else torch.zeros(0))
        frags = {}
        for n, t in frozen.items():
            per = math.ceil(t.numel() / world)
            padded = torch.cat([t.reshape(-1), torch.zeros(per * world - t.numel(), dtype=t.dtype)])
            frags[n] = padded[rank * per:(rank + 1) * per].clone()
        torch.save({"module": {}, "buffer_names": [], "param_shapes": [{n: params[n].shape for n in g} for g in group_names],
                    "frozen_param_shapes": {n: t.shape for n, t in frozen.items()}, "frozen_param_fragments": frags,
                    "shared_params": {}, "ds_version": "0.19.8"},
                   tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        torch.save({"optimizer_state_dict": {"zero_stage": 3, "partition_count": world, "fp32_flat_groups": flat_groups}},
                   tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


shapes = st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=3), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None)
@given(shapes=shapes, world=st.integers(1, 5), groups=st.integers(1, 2), frozen_numel=st.integers(0, 11))
def test_rebuild_matches_original(tmp_path_factory, shapes, world, groups, frozen_numel):
    import torch

    tmp = tmp_path_factory.mktemp("z3")
    gen = torch.Generator().manual_seed(len(shapes) * 31 + world)
    params = {f"p{i}": torch.randn(*s, generator=gen) for i, s in enumerate(shapes)}
    frozen = {"frozen.w": torch.randn(frozen_numel, generator=gen).to(torch.bfloat16)} if frozen_numel else {}
    write_zero3(tmp / "ckpt" / "step", params, world, groups, frozen)
    result = merge(tmp / "ckpt", tmp / "out", progress=False)
    got = read_merged(tmp / "out")
    assert result.world_size == world and set(got) == set(params) | set(frozen)
    for name, t in params.items():
        assert torch.equal(got[name], t), name
    for name, t in frozen.items():
        assert torch.equal(got[name], t.float()), name


def test_param_shapes_that_do_not_match_the_partitions(tmp_path):
    import torch

    write_zero3(tmp_path / "ckpt" / "step", {"a": torch.ones(5), "b": torch.ones(3)}, 2, 1)
    optim = tmp_path / "ckpt" / "step" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 3, "partition_count": 2, "fp32_flat_groups": [torch.ones(9)]}},
               optim)
    with pytest.raises(InputError, match="different sizes"):
        merge(tmp_path / "ckpt", tmp_path / "out", progress=False)
    for r in (0, 1):
        torch.save({"optimizer_state_dict": {"zero_stage": 3, "partition_count": 2, "fp32_flat_groups": [torch.ones(9)]}},
                   tmp_path / "ckpt" / "step" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    with pytest.raises(InputError, match="param_shapes account for 5 elements per rank but the fp32 partitions hold 9"):
        merge(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unpickler_reads_views_with_storage_offsets(tmp_path):
    import torch

    base = torch.arange(20, dtype=torch.float32)
    torch.save({"view": base[5:12], "whole": base}, tmp_path / "x.pt")
    obj = load(tmp_path / "x.pt")
    view = obj["view"]
    assert view.storage_offset == 5 and view.shape == (7,) and view.storage == obj["whole"].storage
    assert torch.equal(view.to_torch(), base[5:12])
