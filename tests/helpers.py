"""Shared test helpers: run the real CLI, write tiny models, launch real DeepSpeed ranks on the CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsdoctor.proctree import terminate_tree

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "src" / "dsdoctor" / "examples"
TESTS = ROOT / "tests"
DATA = TESTS / "data"  # configs/, arch_configs/, alloc_history/
SCRIPTS = TESTS / "scripts"  # the scripts tests launch
# the real DeepSpeed configs the config doctor must read: the project's shared folder beside the checkout;
# DSDOCTOR_CORPUS, when set, is the only place looked at. Without it the corpus tests skip, unless
# DSDOCTOR_REQUIRE_CORPUS=1 says they must run (then a missing corpus fails them)
CORPUS = Path(os.environ.get("DSDOCTOR_CORPUS") or ROOT.parent / "shared" / "corpus" / "ds_configs")

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def corpus_required() -> bool:
    return os.environ.get("DSDOCTOR_REQUIRE_CORPUS", "").lower() in ("1", "true", "yes")


def require_corpus() -> Path:
    """The config corpus; without it a skip, or a failure where DSDOCTOR_REQUIRE_CORPUS=1 (the corpus tests
    must run there)."""
    if not CORPUS.is_dir():
        if corpus_required():
            pytest.fail(f"config corpus not found at {CORPUS} (DSDOCTOR_REQUIRE_CORPUS is set: the corpus tests "
                        "must run)", pytrace=False)
        pytest.skip(f"config corpus not found at {CORPUS}")
    return CORPUS


def corpus_file(name: str) -> Path:
    """One config of the corpus (see ``require_corpus``); a name the corpus lacks is a failure anywhere."""
    path = require_corpus() / name
    if not path.is_file():
        pytest.fail(f"{name} is not in the config corpus at {CORPUS}", pytrace=False)
    return path


def write_model_config(directory: Path, **overrides) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY_LLAMA, **overrides)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


def run_cli(*args: str, env: dict | None = None, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m dsdoctor ARGS`` as a real process."""
    full_env = dict(os.environ, PYTHONIOENCODING="utf-8", LANG="C.UTF-8")
    full_env.pop("DSDOCTOR_DEBUG", None)
    if env:
        full_env.update(env)
    return run_process([sys.executable, "-m", "dsdoctor", *map(str, args)], env=full_env, cwd=cwd, timeout=timeout)


def run_process(cmd: list, *, env: dict | None = None, cwd=None, timeout: float = 120,
                input_text: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` that cannot hang the suite.

    subprocess.run kills only the direct child on a timeout and then waits for EOF on the pipes, which
    DeepSpeed's rank processes (grandchildren) keep open: a hung launch would hang pytest for good. Here
    a timeout ends the child's whole process tree (dsdoctor.proctree) before reading what is left.
    """
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True,
                            stdin=subprocess.PIPE if input_text is not None else None)
    try:
        out, err = proc.communicate(input=input_text, timeout=timeout)
    except subprocess.TimeoutExpired:
        terminate_tree(proc, grace_s=2.0)  # ranks torchrun starts in sessions of their own too
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # something outside the group still holds the pipes
            proc.kill()
            out, err = "", ""
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


PORTS_HANDED_OUT: set[int] = set()  # this process's launches: their DeepSpeed /dev/shm workspaces are its own


def reached_in_time(marker: Path, start: float, limit_s: float, slack_s: float = 2.0) -> bool:
    """Whether the program under test wrote ``marker`` (its "I got there" file) ``slack_s`` before a watchdog
    of ``limit_s`` seconds, started after ``start``, could fire. A test of what dsdoctor says at a timeout
    needs the program to be where the test expects when the watchdog fires; a loaded machine takes longer to
    get there, so such a test runs again with a longer limit when this is False (asserting the same)."""
    try:
        return marker.stat().st_mtime < start + limit_s - slack_s
    except FileNotFoundError:
        return False


def free_port() -> int:
    """A free TCP port for a launch's rendezvous (the default 29500 collides between concurrent runs, e.g.
    two xdist workers). The port names the launch's DeepSpeed CPU workspaces, so tests/conftest.py unlinks
    those after the test, and never another worker's."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    PORTS_HANDED_OUT.add(port)
    return port


def deepspeed_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    if extra:
        env.update(extra)
    return env


def deepspeed_launch(script: Path, *args: str, nprocs: int = 2, timeout: float = 300, cwd=None,
                     env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``deepspeed --num_gpus N script ARGS`` with real ranks on the CPU accelerator."""
    launcher = Path(sys.executable).parent / "deepspeed"
    cmd = [str(launcher), "--num_gpus", str(nprocs), "--master_port", str(free_port()), str(script), *map(str, args)]
    return run_process(cmd, env=deepspeed_env(env), cwd=cwd, timeout=timeout)


def created_peak(call, *args, known=(), **kwargs) -> int:
    """Bytes of the tensor storages ``call(*args, **kwargs)`` creates that are alive at once at their peak: a
    dispatch mode sees each op's outputs, a storage lives while any tensor of it does, and storages in ``known``
    (the tensors passed in, a model's parameters) are not counted. The CPU stand-in for the allocator's peak."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    skip = {t.untyped_storage().data_ptr() for t in known}

    class Live(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.refs, self.size, self.cur, self.peak = {}, {}, 0, 0

        def _drop(self, key):
            self.refs[key] -= 1
            if not self.refs[key]:
                self.cur -= self.size.pop(key)
                del self.refs[key]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in skip:
                    key = t.untyped_storage().data_ptr()
                    if key not in self.refs:
                        self.refs[key], self.size[key] = 0, t.untyped_storage().nbytes()
                        self.cur += self.size[key]
                    self.refs[key] += 1
                    weakref.finalize(t, self._drop, key)
                    self.peak = max(self.peak, self.cur)
            return out

    mode = Live()
    with torch.no_grad(), mode:
        call(*args, **kwargs)
    return mode.peak

