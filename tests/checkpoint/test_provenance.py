"""Issue 26, provenance: merge checks that every rank file comes from one save and names the odd one.

Real DeepSpeed checkpoints (tests/checkpoint_fixtures.py), one rank file of a copy replaced by the same file
as another save wrote it: another step, another run's config, another model, another world size, another
DeepSpeed version. Each merge ends with exit 2 naming that file, writes nothing, and verify has nothing to
call verified."""
from __future__ import annotations

import pytest

from dsdoctor.checkpoint.merge import merge
from dsdoctor.errors import InputError
from tests.checkpoint_fixtures import copy_checkpoint, zero_checkpoints
from tests.helpers import run_cli

pytestmark = pytest.mark.deepspeed


def _tag(ckpt):
    return ckpt / "global_step1"


def _rewrite(path, change) -> None:
    """Load a rank file with torch (our own fixture), change it as another save would have it, save it back."""
    import torch

    sd = torch.load(path, map_location="cpu", weights_only=False)
    change(sd)
    torch.save(sd, path)


def _steps(sd, value):
    sd["global_steps"] = value
    sd["global_samples"] = value * 2


def _adam_step(sd, value):
    import torch

    inner = sd["optimizer_state_dict"]
    base = inner.get("optimizer_state_dict") or inner["base_optimizer_state"]
    for state in base["state"].values():
        state["step"] = torch.tensor(float(value))


def _config(sd):
    sd["ds_config"] = dict(sd["ds_config"], optimizer={"type": "AdamW", "params": {"lr": 3e-4}})


def _shapes(sd):
    group = sd["param_shapes"][0]
    name = next(iter(group))
    group[name] = type(group[name])([7, 7])


CASES = {
    # (checkpoint, file replaced, change, the field named)
    "zero3-step": ("w2/zero3", "zero_pp_rank_1_mp_rank_00_model_states.pt", lambda sd: _steps(sd, 9), "global_steps"),
    "zero3-w3-step": ("w3/zero3", "zero_pp_rank_2_mp_rank_00_model_states.pt", lambda sd: _steps(sd, 40),
                      "global_steps"),
    "zero3-adam-step": ("w3/zero3", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                        lambda sd: _adam_step(sd, 12), "optimizer step"),
    "zero2-adam-step": ("w2/zero2", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                        lambda sd: _adam_step(sd, 3), "optimizer step"),
    "zero1-config": ("w2/zero1", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", _config, "ds_config"),
    "zero3-version": ("w3/zero3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                      lambda sd: sd.update(ds_version="0.14.0"), "ds_version"),
    "zero3-model": ("w3/zero3", "zero_pp_rank_0_mp_rank_00_model_states.pt", _shapes, "param_shapes"),
    "zero3-world": ("w3/zero3", "zero_pp_rank_1_mp_rank_00_model_states.pt",
                    lambda sd: sd.update(dp_world_size=4), "dp_world_size"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_rank_file_from_another_save_is_named_and_nothing_is_written(tmp_path, case):
    source, victim, change, field = CASES[case]
    ckpt = copy_checkpoint(zero_checkpoints() / source, tmp_path / "ckpt")
    _rewrite(_tag(ckpt) / victim, change)
    with pytest.raises(InputError) as err:
        merge(ckpt, tmp_path / "out", progress=False)
    message = err.value.one_line()
    assert str(err.value.path) == str(_tag(ckpt) / victim), message
    assert "different save" in message and f"its {field} is" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.process
def test_merge_cli_names_the_odd_rank_file_and_verify_has_nothing_to_call_verified(tmp_path):
    base = zero_checkpoints()
    ckpt = copy_checkpoint(base / "w2" / "zero3", tmp_path / "ckpt")
    victim = _tag(ckpt) / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    _rewrite(victim, lambda sd: _steps(sd, 9))
    r = run_cli("merge", ckpt, tmp_path / "out", "--model", base / "w2" / "model", "--quiet", timeout=300)
    assert r.returncode == 2 and str(victim) in r.stderr and "global_steps is 9" in r.stderr, r.stderr
    assert "where zero_pp_rank_0_mp_rank_00_model_states.pt has 1" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") <= 2
    assert not (tmp_path / "out").exists()
    v = run_cli("verify", tmp_path / "out", "--model", base / "w2" / "model", timeout=300)
    assert v.returncode == 2 and "verified" not in v.stdout


def test_a_tie_without_a_tag_step_names_every_file(tmp_path):
    """Two ranks, two steps, and a tag that does not say which: no file is called the odd one, both named."""
    ckpt = copy_checkpoint(zero_checkpoints() / "w2" / "zero3", tmp_path / "ckpt")
    (_tag(ckpt)).rename(ckpt / "final")
    (ckpt / "latest").write_text("final")
    _rewrite(ckpt / "final" / "zero_pp_rank_0_mp_rank_00_model_states.pt", lambda sd: _steps(sd, 5))
    with pytest.raises(InputError, match="different saves: their global_steps differ") as err:
        merge(ckpt, tmp_path / "out", progress=False)
    assert "zero_pp_rank_0_mp_rank_00_model_states.pt: 5" in str(err.value)
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt: 1" in str(err.value)


def test_files_of_one_save_merge_unchanged(tmp_path):
    """The check reads what every save writes: the real checkpoints of each stage merge as before."""
    base = zero_checkpoints()
    for source in ("w2/zero3", "w2/zero2", "w2/zero1", "w3/zero3"):
        result = merge(base / source, tmp_path / source.replace("/", "-"), progress=False)
        assert result.tensors > 0
