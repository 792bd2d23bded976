"""Issue 33.3: the door's outside-the-tree rule for every flag that names a file, with real CLI processes.

The flags are found by walking the CLI's own parsers: every option and positional of every command is either a
file it reads (run here with a file and a folder whose files are links to a system file), a file or folder it
writes, a choice, a switch, a number (``tests/security/test_numbers.py``) or a value that is not a path. A new
flag fails ``test_every_flag_is_classified`` until it is placed, and a new input flag is then run here."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dsdoctor import door
from dsdoctor.cli.main import build_parser
from dsdoctor.errors import InputError
from tests.helpers import EXAMPLES, run_cli

WAIT_S = 180  # a guard against a hung suite, not a timing assertion
SYSTEM = Path("/etc/passwd")
LLAMA = EXAMPLES / "llama-7b"
CFG = EXAMPLES / "train_zero3_offload.json"
FORMULA = ("--counts", "formula")

# every input flag: the command line with the flag naming {F} (a link to a system file) or {D} (a folder of such
# links under every name dsdoctor reads in a model, weights or checkpoint folder); {O} a new output path
INPUTS = {
    ("diagnose", "config"): ("diagnose", "--config", "{F}", "--model", LLAMA, "--out", "{O}"),
    ("diagnose", "model"): ("diagnose", "--config", CFG, "--model", "{D}", "--out", "{O}"),
    ("diagnose", "machine"): ("diagnose", "--machine", "{F}", "--out", "{O}"),
    ("diagnose", "checkpoint"): ("diagnose", "--config", CFG, "--model", LLAMA, "--checkpoint", "{D}", "--out", "{O}"),
    ("check", "config"): ("check", "{F}"),
    ("check", "model"): ("check", CFG, "--model", "{D}"),
    ("split", "config"): ("split", "{F}", "-o", "{O}"),
    ("split", "model"): ("split", CFG, "--model", "{D}", "-o", "{O}"),
    ("plan", "model"): ("plan", "--model", "{D}", *FORMULA),
    ("plan", "config"): ("plan", "--model", LLAMA, "--config", "{F}", *FORMULA),
    ("plan", "machine"): ("plan", "--model", LLAMA, "--machine", "{F}", *FORMULA),
    ("plan", "job"): ("plan", "--loop", "--job", "{F}", *FORMULA),
    ("plan", "ref"): ("plan", "--loop", "--model", "7B", "--ref", "{D}", *FORMULA),
    ("plan", "critic"): ("plan", "--loop", "--model", "7B", "--critic", "{F}", *FORMULA),
    ("plan", "reward"): ("plan", "--loop", "--model", "7B", "--reward", "{D}:frozen", *FORMULA),
    ("trace", "report_only"): ("trace", "--report-only", "{D}"),
    ("merge", "ckpt_dir"): ("merge", "{D}", "{O}"),
    ("merge", "model"): ("merge", "{D}", "{O}", "--model", "{D}"),
    ("merge", "adapter_config"): ("merge", "{D}", "{O}", "--adapter-config", "{F}"),
    ("verify", "out_dir"): ("verify", "{D}", "--model", LLAMA),
    ("verify", "model"): ("verify", "{D}", "--model", "{D}"),
    ("verify", "reference"): ("verify", "{D}", "--model", LLAMA, "--reference", "{D}"),
    ("compare", "model_dir"): ("compare", "{D}", "--paths", "plain"),
    ("compare", "model_dir_b"): ("compare", "{M}", "{D}"),
    ("compare", "base"): ("compare", "{D}", "--base", "{D}"),
    ("compare", "prompts"): ("compare", "{M}", "--paths", "plain", "--prompts", "{F}"),
}
OUTPUTS = {("diagnose", "out"), ("split", "out"), ("plan", "plot"), ("trace", "out"), ("ab", "out"), ("merge", "out_dir"),
           ("compare", "out"), ("calibrate", "out"), ("calibrate", "nvme_path"), ("env", "out"), ("env", "nvme_path")}
# values that are not paths: memory sizes, names, versions, a tag inside the checkpoint, the traced command
TEXT = {("diagnose", "gpu_memory"), ("diagnose", "host_memory"), ("diagnose", "command"), ("check", "gpu_name"),
        ("check", "deepspeed_version"), ("check", "transformers_version"), ("check", "accelerate_version"),
        ("explain", "code"), ("plan", "alloc_conf"), ("plan", "transformers_version"), ("plan", "gpu_memory"),
        ("plan", "host_memory"), ("plan", "h2d_bandwidth"), ("plan", "gpu_name"), ("trace", "command"),
        ("ab", "variants"), ("ab", "command"), ("merge", "tag"), ("merge", "max_shard_size"), ("compare", "paths")}
# every name dsdoctor reads inside a model, weights, checkpoint or trace folder
FOLDER_NAMES = ("config.json", "adapter_config.json", "latest", "model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "adapter_model.safetensors", "tokenizer.json", "generation_config.json",
                "ds_config.json", "done.json", "rank-0.host.1.jsonl")


def _actions():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        for action in command._actions:
            if not isinstance(action, argparse._HelpAction):
                yield name, action


def test_every_flag_is_classified():
    """A flag is a switch, a choice, a bounded number, or listed here as an input, an output or text."""
    unplaced = []
    for name, action in _actions():
        if action.nargs == 0 or action.choices is not None or hasattr(action.type, "bounds") or \
                getattr(action.type, "__name__", "") == "dtype_name":
            continue
        if (name, action.dest) not in set(INPUTS) | OUTPUTS | TEXT:
            unplaced.append((name, action.dest))
    assert unplaced == []
    assert set(INPUTS) <= {(n, a.dest) for n, a in _actions()}  # no stale entry


def _lines(path: Path) -> list[str]:
    """Pieces of the file's first lines, as an echo of it would show them."""
    return [line[:12] for line in path.read_text(errors="replace").splitlines()[:8] if len(line) >= 12]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("named")
    folder = root / "links"
    folder.mkdir()
    for name in FOLDER_NAMES:
        (folder / name).symlink_to(SYSTEM)
    (folder / "checkpoint-1").mkdir()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "adapter_config.json"):
        (folder / "checkpoint-1" / name).symlink_to(SYSTEM)
    model = root / "model"  # a model a compare of the other side can start from
    model.mkdir()
    (model / "config.json").write_text((LLAMA / "config.json").read_text())
    (model / "model.safetensors").write_bytes(b"never loaded: refused before any launch")
    (root / "file.json").symlink_to(SYSTEM)
    return {"F": root / "file.json", "D": folder, "M": model, "O": root / "out"}


@pytest.mark.process
@pytest.mark.parametrize("flag", sorted(INPUTS), ids=lambda f: "-".join(f))
def test_a_system_file_behind_any_input_flag_is_refused_and_never_shown(hostile, flag):
    if not SYSTEM.is_file() or len(_lines(SYSTEM)) < 2:
        pytest.skip("no /etc/passwd with lines to recognise here")
    names = dict(hostile, O=hostile["O"].with_name("out-" + "-".join(flag)))
    argv = [str(a).format(**names) if "{" in str(a) else a for a in INPUTS[flag]]
    r = run_cli(*argv, cwd=hostile["O"].parent, timeout=WAIT_S)
    shown = r.stdout + r.stderr
    assert "Traceback" not in shown and "internal error" not in shown, (flag, shown[-2000:])
    assert not any(piece in shown for piece in _lines(SYSTEM)), (flag, shown[-2000:])
    if flag[0] == "diagnose" and r.returncode == 1:  # diagnose reports a step it could not run and goes on
        assert "its content is not shown" in shown or "not a DeepSpeed config" in shown, (flag, shown[-2000:])
        assert not any(piece in (names["O"] / "report.json").read_text() for piece in _lines(SYSTEM))
    else:
        assert r.returncode == 2 and not names["O"].exists(), (flag, shown[-2000:])


@pytest.mark.process
def test_a_model_named_by_a_job_file_outside_the_tree_is_refused_unread(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"models:\n  actor: {SYSTEM}\n  reference: {LLAMA}\n")
    r = run_cli("plan", "--loop", "--job", job, *FORMULA, cwd=tmp_path, timeout=WAIT_S)
    assert r.returncode == 2 and f"{SYSTEM}: is not a model config.json" in r.stderr and f"named by {job}" in r.stderr
    assert not any(piece in r.stdout + r.stderr for piece in _lines(SYSTEM))


@pytest.mark.process
def test_real_files_outside_the_tree_are_still_read(tmp_path):
    """The rule refuses what is not of the kind, not where it lives: a model config linked from a system-like
    place is read when it is one (here: a job file naming a model folder away from it and the working directory)."""
    jobs, work = tmp_path / "jobs", tmp_path / "work"
    jobs.mkdir(), work.mkdir()
    job = jobs / "job.yaml"
    job.write_text(f"models:\n  actor: {LLAMA}\n")
    r = run_cli("plan", "--loop", "--job", job, *FORMULA, cwd=work, timeout=WAIT_S)
    assert r.returncode in (0, 1) and "actor" in r.stdout, r.stderr


def test_the_door_refuses_each_kind_outside_the_tree_by_its_words(tmp_path):
    """Library level: a file under a system folder is read only when it holds its kind's words; a prompt
    file never; a file named by another file also in a hidden folder or away from both folders."""
    for kind in (door.MODEL_CONFIG, door.ADAPTER_CONFIG, door.RL_JOB, door.MACHINE_PROFILE, door.WEIGHTS_INDEX,
                 door.PROMPTS):
        with pytest.raises(InputError) as exc:
            door.read_bytes(SYSTEM, kind)
        assert "its content is not shown" in str(exc.value) and not any(p in str(exc.value) for p in _lines(SYSTEM))
    hidden = tmp_path / ".secret" / "config.json"
    hidden.parent.mkdir()
    hidden.write_text('{"token": "abc"}')
    assert door.read_bytes(hidden, door.MODEL_CONFIG)  # named on the command line: the user's own choice
    with pytest.raises(InputError, match="named by"):
        door.read_bytes(hidden, door.MODEL_CONFIG, named_by=tmp_path / "job.yaml")
    hidden.write_text('{"hidden_size": 8}')
    assert door.read_bytes(hidden, door.MODEL_CONFIG, named_by=tmp_path / "job.yaml")


@pytest.mark.process
def test_a_latest_linked_out_of_the_checkpoint_is_not_read(tmp_path):
    secret = tmp_path / ".ssh" / "id_key"
    secret.parent.mkdir()
    secret.write_text("SECRET-KEY-MATERIAL-0123456789\n")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").symlink_to(secret)
    r = run_cli("merge", ckpt, tmp_path / "out", timeout=WAIT_S)
    assert r.returncode == 2 and "links out of the checkpoint folder" in r.stderr, r.stderr
    assert "SECRET" not in r.stdout + r.stderr and not (tmp_path / "out").exists()
