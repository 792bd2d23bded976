"""Issue 33.4 / 32.3: one launch-line reader (``config.load.launch_words`` and ``launch_flags``), bounded, used by
check's command configs and by the RL job readers (``config/rl.py``); a huge launch line or one-line YAML is
refused at once by check and by plan --loop --job."""
from __future__ import annotations

import shlex
import time

import pytest

from dsdoctor import door
from dsdoctor.config import load, rl
from tests.helpers import run_cli

WAIT_S = 180  # a guard against a hung suite
FAST_S = 30  # a refusal: the unbounded reader took 20-120 s on these files on a loaded 2-core machine


def _fed(monkeypatch) -> list[int]:
    fed: list[int] = []
    real = shlex.split
    monkeypatch.setattr(shlex, "split", lambda s, *a, **k: fed.append(len(s)) or real(s, *a, **k))
    return fed


@pytest.mark.parametrize("text", [
    "python -m openrlhf.cli.train_ppo_ray --pretrain " + "x" * 5_000_000,
    "deepspeed a b 'c\n" * 200_000,
    "a: " + "b" * (1 << 20),
    "A=1\n" * 300_000,
])
def test_both_readers_split_a_bounded_number_of_bytes(monkeypatch, text):
    fed = _fed(monkeypatch)
    rl.read_launch(text)
    assert sum(fed) <= door.DS_CONFIG.slow_parse_bytes
    fed.clear()
    load.looks_like_command(text)
    assert sum(fed) <= door.DS_CONFIG.slow_parse_bytes


def test_one_reader_reads_one_line_the_same_for_both():
    line = ("CUDA_VISIBLE_DEVICES=0 deepspeed --num_gpus 2 main.py --deepspeed ds.json --lr -1e-5 --offload "
            "--actor_model_name_or_path m --actor_zero_stage 3 # comment\n")
    check_args = load.parse_command(line)
    rl_args = rl.parse_flags(rl._tokens(line))
    for key in ("num_gpus", "deepspeed", "offload", "actor_model_name_or_path", "actor_zero_stage"):
        assert check_args[key] == rl_args[key], key
    assert check_args["lr"] == "-1e-5" and rl_args["lr"] == -1e-5  # a value, not a flag (each reads its scalars)
    assert check_args["offload"] is True and check_args["_command"] == "deepspeed main.py"


@pytest.mark.process
@pytest.mark.parametrize("name,text", [
    ("run.sh", "python -m openrlhf.cli.train_ppo_ray --pretrain 7B --micro_rollout_batch_size " + "x" * (12 << 20)),
    ("one-line.yaml", "a: " + "b" * ((1 << 20) - 8) + "\n"),
])
def test_a_huge_launch_line_or_yaml_is_refused_at_once(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    commands = [("check", path), ("plan", "--loop", "--job", path, "--counts", "formula")]
    for command in commands:
        start = time.monotonic()
        r = run_cli(*command, timeout=WAIT_S)
        took = time.monotonic() - start
        if name == "run.sh" and command[0] == "plan":
            assert r.returncode == 2 and "too large for a RL job file" in r.stderr, r.stderr  # 1 MiB bound
        else:
            assert r.returncode == 2 and "bytes of YAML" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and took < FAST_S, (command, took)
