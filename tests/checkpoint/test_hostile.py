"""Crafted and damaged checkpoints: merge and verify end with exit 2 naming the file (or a finding), never
hang, never eat memory, never write through a path they were handed, never lose or corrupt data.

The first tests build small torch zip files themselves; the rest copy the real DeepSpeed checkpoints of
tests/checkpoint_fixtures.py into tmp_path and damage the copy."""
from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from dsdoctor.checkpoint import unpickle
from dsdoctor.checkpoint.merge import merge
from dsdoctor.door import MARKER
from dsdoctor.errors import InputError
from tests.checkpoint_fixtures import copy_checkpoint, read_merged, zero_checkpoints
from tests.helpers import ROOT, run_cli, run_process


def _torch_zip(path: Path, pickle_bytes: bytes) -> Path:
    """A file laid out as torch.save writes one, with the given data.pkl."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle_bytes)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")
    return path


def _memo_bomb(levels: int) -> bytes:
    """Nested lists, each holding the one below twice through the pickle memo: a few hundred bytes that a
    naive walk expands to 2**levels nodes."""
    x: list = []
    for _ in range(levels):
        x = [x, x]
    return pickle.dumps({"buffer_names": [], "module": x}, protocol=2)


def _tuple_key_bomb(levels: int) -> bytes:
    """A dict whose key is a memo-shared nested tuple: the unpickler itself would hash 2**levels tuples."""
    body = pickle.dumps(_nested_tuple(levels), protocol=2)[2:-1]  # without PROTO and STOP
    return b"\x80\x02}" + body + b"Ns."


def _nested_tuple(levels: int):
    t: tuple = ()
    for _ in range(levels):
        t = (t, t)
    return t


@pytest.mark.parametrize("make,words", [
    (lambda: _memo_bomb(100), "shared references expand"),
    (lambda: _tuple_key_bomb(80), "shared references expand"),
    (lambda: pickle.dumps(_self_list(), protocol=2), "contains itself"),
    (lambda: b"\x80\x02" + b"]" * 1500 + b"a" * 1499 + b".", "deeper than"),
], ids=["memo-lists", "memo-tuple-key", "cycle", "deep"])
def test_pickle_bombs_are_refused_at_once(tmp_path, make, words):
    data = make()
    assert len(data) < 4000
    path = _torch_zip(tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt", data)
    with pytest.raises(InputError, match=words) as err:
        unpickle.load(path)
    assert str(path) in str(err.value)


@pytest.mark.process
def test_a_658_byte_class_memo_bomb_through_the_cli_ends_with_exit_2(tmp_path):
    ckpt = tmp_path / "ckpt"
    tag = ckpt / "global_step1"
    tag.mkdir(parents=True)
    (ckpt / "latest").write_text("global_step1")
    data = _memo_bomb(100)
    _torch_zip(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", data)
    _torch_zip(tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", data)
    proc = run_cli("merge", ckpt, tmp_path / "out", "--quiet", timeout=60)
    assert proc.returncode == 2 and "refused to load data.pkl" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


def _self_list():
    x: list = []
    x.append(x)
    return x


def test_zip_directory_that_declares_absurd_sizes_is_refused_before_reading(tmp_path):
    path = _torch_zip(tmp_path / "a.pt", pickle.dumps({}, protocol=2))
    data = bytearray(path.read_bytes())
    at = data.rfind(b"PK\x05\x06")
    struct.pack_into("<HH", data, at + 8, 0xFFFE, 0xFFFE)  # 65534 records
    struct.pack_into("<L", data, at + 12, 0xFFFFFFF0)  # a 4 GB directory
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match="zip directory declares"):
        unpickle.load(path)


def test_data_pkl_crc_is_checked(tmp_path):
    path = _torch_zip(tmp_path / "a.pt", pickle.dumps({"buffer_names": ["abcdef"]}, protocol=2))
    data = path.read_bytes()
    path.write_bytes(data.replace(b"abcdef", b"abcdeg", 1))
    with pytest.raises(InputError, match="CRC-32 mismatch in record archive/data.pkl"):
        unpickle.load(path)


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_rank_file_that_is_not_a_regular_file_is_refused(tmp_path, special):
    target = tmp_path / "x.pt"
    if special == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to(special)
    with pytest.raises(InputError, match="not a regular file"):
        unpickle.load(target)


# ---- real DeepSpeed checkpoints, copied and damaged -----------------------------------------------------------

deepspeed = pytest.mark.deepspeed


def _tag(ckpt: Path) -> Path:
    return ckpt / "global_step1"


def _fails(*args, timeout: float = 120) -> str:
    proc = run_cli("merge", *args, "--quiet", timeout=timeout)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("dsdoctor: error: ") and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


def _ckpt(tmp_path: Path, name: str = "ckpt") -> Path:
    return copy_checkpoint(zero_checkpoints() / "w2" / "zero3", tmp_path / name)


@deepspeed
def test_force_never_deletes_a_folder_holding_the_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    ckpt = _ckpt(runs)
    (runs / "notes.txt").write_text("keep")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert "holds an input" in _fails(ckpt, runs, "--force")
    assert "is an input" in _fails(ckpt, ckpt, "--force")
    assert "is an input" in _fails(ckpt, _tag(ckpt), "--force")
    user = tmp_path / "user-folder"
    user.mkdir()
    (user / "data.bin").write_bytes(b"1")
    assert "not written by dsdoctor" in _fails(ckpt, user, "--force")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if not p.is_relative_to(user)) == before
    assert (user / "data.bin").read_bytes() == b"1"
    merged = tmp_path / "merged"
    assert run_cli("merge", ckpt, merged, "--quiet").returncode == 0 and (merged / MARKER).is_file()
    assert run_cli("merge", ckpt, merged, "--quiet", "--force").returncode == 0  # its own output: replaced


@deepspeed
def test_merge_to_a_device_leaves_it_a_device(tmp_path):
    ckpt = _ckpt(tmp_path)
    for dev in ("/dev/null", "/dev/full"):
        assert "character device" in _fails(ckpt, dev, "--force")
        assert stat.S_ISCHR(os.stat(dev).st_mode)


def _flip_record_bytes(ckpt: Path) -> tuple[Path, str]:
    """Overwrite 64 bytes inside rank 1's fp32 partition with a float that reads 2.97e38."""
    victim = _tag(ckpt) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    ref = unpickle.load(victim)["optimizer_state_dict"]["fp32_flat_groups"][0]
    with open(victim, "r+b") as fh:
        fh.seek(ref.data_offset + 256)
        fh.write(struct.pack("<f", 2.97e38) * 16)
    return victim, f"data/{ref.storage.key}"


@deepspeed
def test_flipped_bytes_in_a_shard_stop_the_merge_naming_file_and_record(tmp_path):
    ckpt = _ckpt(tmp_path)
    victim, record = _flip_record_bytes(ckpt)
    err = _fails(ckpt, tmp_path / "out")
    assert str(victim) in err and f"CRC-32 mismatch in zip record {record}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no output, no partial, no lock


@deepspeed
def test_verify_flags_implausible_values_even_without_merge(tmp_path):
    from safetensors.torch import save_file

    base = zero_checkpoints()
    out = tmp_path / "merged"
    merge(base / "w2" / "zero3", out, model=base / "w2" / "model", progress=False)
    tensors = read_merged(out)
    tensors["model.embed_tokens.weight"][3, :16] = 2.97e38
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_bytes((out / "config.json").read_bytes())
    proc = run_cli("verify", bad, "--model", bad, "--format", "json")
    assert proc.returncode == 1, proc.stderr
    found = {f["code"]: f for f in json.loads(proc.stdout)["findings"]}
    assert "DSD413" in found and "model.embed_tokens.weight" in found["DSD413"]["message"]
    assert "2.97e+38" in found["DSD413"]["message"]
    clean = run_cli("verify", out, "--model", out, "--format", "json")
    assert clean.returncode == 0 and json.loads(clean.stdout)["findings"] == []


@deepspeed
@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_rank_file_linked_to_a_device_or_a_fifo_ends_at_once(tmp_path, special):
    ckpt = _ckpt(tmp_path)
    victim = _tag(ckpt) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.unlink()
    if special == "fifo":
        os.mkfifo(victim)
    else:
        victim.symlink_to(special)
    err = _fails(ckpt, tmp_path / "out", timeout=60)
    assert str(victim) in err and "not a regular file" in err


@deepspeed
def test_latest_and_tag_must_stay_inside_the_checkpoint(tmp_path):
    ckpt = _ckpt(tmp_path)
    other = _ckpt(tmp_path, "other")
    (ckpt / "latest").write_text(str(_tag(other)))
    assert "not a name inside the checkpoint folder" in _fails(ckpt, tmp_path / "out")
    (ckpt / "latest").write_text("../other/global_step1")
    assert "not a name inside the checkpoint folder" in _fails(ckpt, tmp_path / "out")
    (ckpt / "latest").write_text("escape")
    (ckpt / "escape").symlink_to(_tag(other))
    assert "leads out of the checkpoint folder" in _fails(ckpt, tmp_path / "out")
    assert "not a name inside" in _fails(ckpt, tmp_path / "out", "--tag", str(_tag(other)))
    (ckpt / "latest").write_bytes(b"global\x1b[31m_step\nrm -rf /\xff")
    err = _fails(ckpt, tmp_path / "out")
    assert "\\x1b[31m" in err and "\\n" in err and "\x1b" not in err
    os.unlink(ckpt / "latest")
    os.mkfifo(ckpt / "latest")
    assert "FIFO" in _fails(ckpt, tmp_path / "out", timeout=60)
    assert not (tmp_path / "out").exists()


@deepspeed
def test_model_files_linked_out_of_the_folder_are_not_copied(tmp_path):
    base = zero_checkpoints()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes((base / "w2" / "model" / "config.json").read_bytes())
    secret = tmp_path / "secret.txt"
    secret.write_text("root:$6$hash")
    (model / "tokenizer.json").symlink_to(secret)
    os.mkfifo(model / "vocab.json")
    (model / "merges.txt").symlink_to("/etc/hostname" if Path("/etc/hostname").exists() else secret)
    (model / "tokenizer_config.json").write_text("{}")
    (model / "special_tokens_map.json").symlink_to(model / "tokenizer_config.json")  # inside: fine
    out = tmp_path / "out"
    proc = run_cli("merge", base / "w2" / "zero3", out, "--model", model, "--quiet", "--format", "json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    skipped = [f["message"] for f in summary["findings"] if f["code"] == "DSD415"]
    assert len(skipped) == 3 and any("tokenizer.json" in m and "symbolic link out" in m for m in skipped)
    assert any("vocab.json" in m and "not a regular file" in m for m in skipped)
    assert sorted(summary["copied_files"]) == ["config.json", "special_tokens_map.json", "tokenizer_config.json"]
    assert not (out / "tokenizer.json").exists() and not (out / "vocab.json").exists()
    assert "root:" not in "".join(p.read_text(errors="replace") for p in out.iterdir() if p.suffix != ".safetensors")


@deepspeed
def test_missing_rank_file_is_named(tmp_path):
    ckpt = _ckpt(tmp_path)
    for kind, prefix in (("optim", "bf16_"), ("model", "")):
        (_tag(ckpt) / f"{prefix}zero_pp_rank_1_mp_rank_00_{kind}_states.pt").unlink()
    err = _fails(ckpt, tmp_path / "out")
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in err


@deepspeed
def test_outputs_follow_the_umask_through_the_cli(tmp_path):
    base = zero_checkpoints()
    for mask in ("022", "077"):
        out = tmp_path / f"out{mask}"
        cmd = ["sh", "-c", f'umask {mask}; exec "$0" -m dsdoctor merge "$1" "$2" --model "$3" --quiet', sys.executable,
               str(base / "w2" / "zero3"), str(out), str(base / "w2" / "model")]
        proc = run_process(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=120)
        assert proc.returncode == 0, proc.stderr
        m = int(mask, 8)
        assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~m
        for f in out.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~m, f


@deepspeed
def test_disk_full_during_merge_is_named_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    from dsdoctor.checkpoint import writer

    def full(fd, buf):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer, "_write_all", full)
    with pytest.raises(InputError, match="no space left on device") as err:
        merge(zero_checkpoints() / "w2" / "zero3", tmp_path / "out", progress=False)
    assert str(tmp_path / "out") in str(err.value)
    assert list(tmp_path.iterdir()) == []


# ---- signals and concurrency on a real merge ------------------------------------------------------------------

PAUSED_MERGE = textwrap.dedent("""
    # a real `dsdoctor merge`, paused after its first shard until the test writes a line to stdin
    import sys
    from dsdoctor.checkpoint import writer
    from dsdoctor.cli.main import main
    real = writer.write_shard
    def paused(*args, **kwargs):
        n = real(*args, **kwargs)
        if not getattr(paused, "done", False):
            paused.done = True
            print("PAUSED", flush=True)
            sys.stdin.readline()
        return n
    writer.write_shard = paused
    sys.exit(main(sys.argv[1:]))
""")


def _paused_merge(ckpt: Path, out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_MERGE, "merge", str(ckpt), str(out), "--quiet",
                             "--max-shard-size", "20KB"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline().strip()
    assert line == "PAUSED", proc.stderr.read()
    return proc


@deepspeed
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_merge_killed_by_each_signal_leaves_nothing(tmp_path, sig):
    ckpt = _ckpt(tmp_path)
    proc = _paused_merge(ckpt, tmp_path / "out")
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".out.") and p.name.endswith(".partial")]
    assert len(partial) == 1 and any(partial[0].glob("*.safetensors"))  # a shard is written
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and f"interrupted by {sig.name}" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@deepspeed
def test_sigkilled_merge_is_named_by_the_next_merge(tmp_path):
    ckpt = _ckpt(tmp_path)
    proc = _paused_merge(ckpt, tmp_path / "out")
    proc.kill()
    proc.communicate(timeout=60)
    (partial,) = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    again = run_cli("merge", ckpt, tmp_path / "out", "--quiet", "--format", "json")
    assert again.returncode == 0, again.stderr
    stale = [f for f in json.loads(again.stdout)["findings"] if f["code"] == "DSD414"]
    assert len(stale) == 1 and str(partial) in stale[0]["message"] and partial.is_dir()


@deepspeed
def test_two_merges_into_one_output_the_second_stops_naming_the_first(tmp_path):
    ckpt = _ckpt(tmp_path)
    first = _paused_merge(ckpt, tmp_path / "out")
    try:
        for extra in ((), ("--force",)):
            err = _fails(ckpt, tmp_path / "out", *extra)
            assert f"being written by another dsdoctor (pid {first.pid})" in err
    finally:
        out, err = first.communicate("go\n", timeout=120)
    assert first.returncode == 0, err
    assert len(read_merged(tmp_path / "out")) == 29
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]


# ---- verify: malformed weights files are named -----------------------------------------------------------------

def _safetensors(path: Path, header: dict, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("header,words", [
    ([1, 2], "not a JSON object"),
    ({"w": 5}, "is not described by an object"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": "x"}}, "invalid data_offsets"),
    ({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, "unknown dtype"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "need 12"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, "invalid shape"),
], ids=["list", "entry", "offsets", "dtype", "size", "shape"])
def test_malformed_safetensors_headers_are_named(tmp_path, header, words):
    from dsdoctor.checkpoint.weights import index_weights

    f = _safetensors(tmp_path / "model.safetensors", header, b"\0" * 8)
    with pytest.raises(InputError, match=words) as err:
        index_weights(tmp_path)
    assert str(f) in str(err.value)


@pytest.mark.parametrize("index,words", [
    ("not json", "corrupt index"),
    (json.dumps({"weight_map": ["a"]}), "no weight_map"),
    (json.dumps({"weight_map": {"w": "../outside.safetensors"}}), "is not a file name"),
    (json.dumps({"weight_map": {"w": "/etc/passwd"}}), "is not a file name"),
], ids=["json", "map", "dotdot", "absolute"])
def test_malformed_index_files_are_named(tmp_path, index, words):
    from dsdoctor.checkpoint.weights import index_weights

    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(InputError, match=words) as err:
        index_weights(tmp_path)
    assert "model.safetensors.index.json" in str(err.value)


@pytest.mark.process
def test_verify_cli_names_a_malformed_header(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    f = _safetensors(tmp_path / "model.safetensors", {"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8)
    proc = run_cli("verify", tmp_path, "--model", tmp_path)
    assert proc.returncode == 2 and str(f) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# ---- the CRC-32 check on synthetic ZeRO-3 checkpoints (no DeepSpeed launch) -------------------------------------

def _synthetic(tmp_path: Path, crc: bool = True) -> tuple[Path, dict]:
    import torch

    from tests.checkpoint.test_rebuild import write_zero3

    params = {"a": torch.randn(300, 7, generator=torch.Generator().manual_seed(1)), "b": torch.randn(5)}
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)
    try:
        write_zero3(tmp_path / "ckpt" / "global_step1", params, world=2, groups=1)
    finally:
        torch.serialization.set_crc32_options(previous)
    return tmp_path / "ckpt", params


def test_crc_mismatch_in_any_record_stops_the_merge(tmp_path):
    ckpt, _ = _synthetic(tmp_path)
    victim = _tag(ckpt) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    ref = unpickle.load(victim)["optimizer_state_dict"]["fp32_flat_groups"][0]
    data = bytearray(victim.read_bytes())
    data[ref.data_offset + ref.record_size - 1] ^= 0x40  # the last byte: padding no tensor reads
    victim.write_bytes(bytes(data))
    for dtype in ("fp32", "bf16"):  # kernel copy and conversion paths
        with pytest.raises(InputError, match=f"CRC-32 mismatch in zip record data/{ref.storage.key}") as err:
            merge(ckpt, tmp_path / "out", dtype=dtype, progress=False)
        assert str(victim) in str(err.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_checkpoint_saved_without_crcs_merges_with_a_note(tmp_path):
    import torch

    ckpt, params = _synthetic(tmp_path, crc=False)
    result = merge(ckpt, tmp_path / "out", progress=False)
    assert [f.code for f in result.findings] == ["DSD416", "DSD410"]  # and no config.json near it
    got = read_merged(tmp_path / "out")
    assert all(torch.equal(got[k], v) for k, v in params.items())


def test_crc32_in_parts_equals_zlib():
    import random
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    from dsdoctor.checkpoint.writer import crc32, crc32_combine

    rng = random.Random(0)
    with ThreadPoolExecutor(3) as pool:
        for n in (0, 1, 4095, 9 * 2**20 + 3):
            data = rng.randbytes(n)
            start = rng.randrange(2**32)
            assert crc32(memoryview(data), start, pool) == zlib.crc32(data, start)
            cut = rng.randrange(n + 1)
            assert crc32_combine(zlib.crc32(data[:cut]), zlib.crc32(data[cut:]), n - cut) == zlib.crc32(data)
