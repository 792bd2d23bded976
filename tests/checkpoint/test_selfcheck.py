"""Every writer checks its own output before it says ✓ (issue 33). Real DeepSpeed checkpoints from the shared
fixtures (CPU ranks), each corrupted in a copy the way the hostile-input rerun found merge writing a wrong model
with exit 0; now each is exit 2 naming the contradiction, and nothing is left beside the input (no output, no
partial folder, no lock)."""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from dsdoctor.checkpoint import unpickle
from tests.checkpoint_fixtures import (
    autotp_checkpoints,
    copy_checkpoint,
    lora_checkpoint,
    universal,
    zero_checkpoints,
)
from tests.helpers import run_cli

pytestmark = [pytest.mark.deepspeed, pytest.mark.process]


def _refused(ckpt: Path, out: Path, *flags) -> str:
    proc = run_cli("merge", ckpt, out, "--quiet", *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == [ckpt.name], "something was left beside the input"
    return proc.stderr


def _tag(ckpt: Path) -> Path:
    return ckpt / (ckpt / "latest").read_text().strip()


# ---- values: what verify calls NaN/Inf (DSD405) or implausible (DSD413) never passes merge ----------------------
@pytest.mark.parametrize("edit,code", [({"lora_alpha": 1e300}, "DSD405"), ({"alpha_pattern": {"v_proj": 1e12}}, "DSD413")],
                         ids=["lora_alpha", "alpha_pattern"])
def test_merge_lora_refuses_the_weights_a_huge_finite_alpha_makes(tmp_path, edit, code):
    run = lora_checkpoint()
    ckpt = copy_checkpoint(run / "ckpt", tmp_path / "ckpt")
    cfg = json.loads((ckpt / "adapter_config.json").read_text())
    (ckpt / "adapter_config.json").write_text(json.dumps(dict(cfg, **edit)))
    err = _refused(ckpt, tmp_path / "merged", "--merge-lora", "--model", run / "base")
    assert "DSD417" in err and code in err and "model.layers.1.self_attn.v_proj.weight" in err, err
    assert ("q_proj" in err) == (code == "DSD405")  # alpha_pattern scales v_proj only


def _write_keeping_crc(path: Path, offset: int, raw: bytes) -> None:
    """Overwrite bytes of a zip record and write the record's new CRC-32 into its local header and the central
    directory: the file then reads as torch.save wrote it with these values (a run that saved NaN weights)."""
    ref = unpickle.load(path)["optimizer_state_dict"]["fp32_flat_groups"][0]
    data = bytearray(path.read_bytes())
    data[ref.data_offset + offset:ref.data_offset + offset + len(raw)] = raw
    new = struct.pack("<I", zlib.crc32(data[ref.data_offset:ref.data_offset + ref.record_size]))
    local = data.rfind(b"PK\x03\x04", 0, ref.data_offset)
    data[local + 14:local + 18] = new
    at = data.find(b"PK\x01\x02")
    while at != -1:
        if struct.unpack_from("<I", data, at + 42)[0] == local:
            data[at + 16:at + 20] = new
        at = data.find(b"PK\x01\x02", at + 4)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("value,code", [(float("nan"), "DSD405"), (2.97e38, "DSD413")], ids=["nan", "huge"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # the kernel copy, and the conversion in memory
def test_values_verify_rejects_stop_the_merge_on_every_write_path(tmp_path, value, code, dtype):
    ckpt = copy_checkpoint(zero_checkpoints() / "w2" / "zero3", tmp_path / "ckpt")
    victim = next(_tag(ckpt).glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    _write_keeping_crc(victim, 256, struct.pack("<f", value) * 4)
    err = _refused(ckpt, tmp_path / "out", "--dtype", dtype)
    # no config.json beside the copy: the tied lm_head is written as a copy of the embedding, and named too
    assert "DSD417" in err and f"{code} 2 weight(s)" in err and "lm_head.weight, model.embed_tokens.weight" in err, err


# ---- ranks: a tensor-parallel rank whose files are all gone ---------------------------------------------------
@pytest.mark.parametrize("variant", ["zero3", "zero1"])
def test_an_autotp_checkpoint_without_its_last_tensor_parallel_rank_is_named(tmp_path, variant):
    ckpt = copy_checkpoint(autotp_checkpoints() / variant, tmp_path / "ckpt")
    gone = list(_tag(ckpt).glob("*mp_rank_01_*"))
    assert gone
    for f in gone:
        f.unlink()
    err = _refused(ckpt, tmp_path / "out")
    assert "missing the files of tensor-parallel rank(s) mp_rank_01 (found mp_rank_00;" in err
    assert "records mp_world_size 2" in err


# ---- shapes: a universal checkpoint's fp32.pt swapped for another parameter's ---------------------------------
@pytest.mark.parametrize("source,pair,words", [
    # same element count, other shape: only the recorded shape tells, read back from what was written
    ("zero2", "mlp.gate_proj/mlp.down_proj", "DSD403 2 weight(s) have a shape other than the model's: "
                                             "model.layers.1.mlp.gate_proj.weight [45, 99] != [99, 45]"),
    # tensor parallel: the full shapes the recorded maps give from every rank's shard shapes
    ("autotp", "mlp.gate_proj/mlp.down_proj", "model.layers.1.mlp.gate_proj.weight [48, 99] != [99, 48]"),
    # flat (ZeRO-3): the element count tells, before anything is written
    ("zero3", "self_attn.q_proj/self_attn.k_proj", "model.layers.1.self_attn.q_proj.weight: 720 elements for "
                                                   "shape [48, 45]"),
])
def test_a_universal_checkpoint_with_a_swapped_fp32_pt_is_refused(tmp_path, source, pair, words):
    base = autotp_checkpoints() / "zero1" if source == "autotp" else zero_checkpoints() / "w2" / source
    root = copy_checkpoint(universal(base), tmp_path / "ckpt")
    zero = root / "global_step1_universal" / "zero"
    a, b = (zero / f"model.layers.1.{p}.weight" / "fp32.pt" for p in pair.split("/"))
    raw = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(raw)
    err = _refused(root, tmp_path / "out", "--tag", "global_step1_universal")
    assert words in err, err


# ---- an adapter_config.json that contradicts the adapter's tensors --------------------------------------------
CONTRADICTIONS = [
    ("", {"target_modules": ["q_proj"]}, "target_modules ['q_proj'] leaves out LoRA layer(s) "
                                         "model.layers.0.self_attn.v_proj, model.layers.1.self_attn.v_proj"),
    ("", {"target_modules": ["q_proj", "v_proj", "k_proj"]}, "targets model.layers.0.self_attn.k_proj, "
                                                             "model.layers.1.self_attn.k_proj, which hold(s) no LoRA"),
    ("", {"use_dora": True}, "use_dora is true but LoRA layer(s) model.layers.0.self_attn.q_proj, "),
    ("dora", {"use_dora": False}, "use_dora is false but LoRA layer(s) model.layers.0.self_attn.q_proj, "),
]


@pytest.mark.parametrize("variant,edit,words", CONTRADICTIONS, ids=["left-out", "extra", "dora-on", "dora-off"])
def test_an_adapter_config_contradicting_the_weights_is_refused_by_merge_and_verify(tmp_path, variant, edit, words):
    from dsdoctor.checkpoint.merge import merge

    run = lora_checkpoint() / variant
    ckpt = copy_checkpoint(run / "ckpt", tmp_path / "ckpt")
    edited = dict(json.loads((ckpt / "adapter_config.json").read_text()), **edit)
    (ckpt / "adapter_config.json").write_text(json.dumps(edited))
    for flags in ((), ("--merge-lora", "--model", run / "base")):  # the adapter, and the weights with it folded in
        err = _refused(ckpt, tmp_path / "out", *flags)
        assert "DSD423" in err and words in err, err
    # verify, given an adapter folder that holds the contradiction, rejects it too
    merge(run / "ckpt", tmp_path / "adapter", progress=False)
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(edited))
    proc = run_cli("verify", tmp_path / "adapter", "--model", run / "base", "--format", "json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = {f["code"]: f["message"] for f in json.loads(proc.stdout)["findings"]}
    assert "DSD423" in found and words in found["DSD423"], found
