"""Start the worker for one load path: in this process (``plain``), or N ranks through DeepSpeed's
launcher (``deepspeed --num_gpus N``) when it is installed, else ``python -m torch.distributed.run``.

Launchers are wrapped, not rebuilt. Each launch gets a free port (several users on one host must not
collide on 29500) and its own log file; rank 0 writes the run record.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dsdoctor import door
from dsdoctor.compare.runner import MULTI_RANK
from dsdoctor.errors import InputError
from dsdoctor.proctree import contained_run, free_port, terminate_tree

LOG_TAIL_LINES = 25
LOG_TAIL_BYTES = 4 * 2**20


@dataclass
class LaunchOutcome:
    ok: bool
    record: dict | None
    command: list[str]
    log: str  # path of the worker log ("" for in-process runs)
    error: str = ""  # one line: why it failed
    log_tail: str = ""


def deepspeed_launcher() -> str | None:
    """The ``deepspeed`` script next to this interpreter, else on PATH."""
    sibling = Path(sys.executable).parent / "deepspeed"
    if sibling.exists():
        return str(sibling)
    return shutil.which("deepspeed")


def launch_command(job_file: Path, nprocs: int) -> list[str]:
    port = str(free_port())
    launcher = deepspeed_launcher()
    if launcher:
        return [launcher, "--num_gpus", str(nprocs), "--master_port", port,
                "--module", "dsdoctor.compare.runner", str(job_file)]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs),
            "--master_addr", "127.0.0.1", "--master_port", port, "-m", "dsdoctor.compare.runner", str(job_file)]


def _child_env(nprocs: int) -> dict:
    """The workers import this very dsdoctor, even when it is not installed (a source checkout).

    LOCAL_SIZE, CROSS_RANK and CROSS_SIZE are what DeepSpeed's own launcher exports and torchrun does not:
    without LOCAL_SIZE the CPU accelerator counts 0 devices and its shared-memory all-reduce (tensor
    parallelism on the CPU) crashes with SIGSEGV."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               LOCAL_SIZE=str(nprocs), CROSS_RANK="0", CROSS_SIZE="1")
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


def run_path(job: dict, workdir: Path, nprocs: int, timeout: float | None = None) -> LaunchOutcome:
    """Run one load path; never raises for a failing worker (the outcome says why)."""
    label = job["label"]
    job = dict(job, out=str(workdir / f"{label}.json"))
    if job["path"] not in MULTI_RANK:
        return _run_in_process(job)
    job_file = workdir / f"{label}.job.json"
    door.write_new(job_file, json.dumps(job))
    log = workdir / f"{label}.log"
    cmd = launch_command(job_file, nprocs)
    try:
        with door.open_new(log) as fh:
            rc = _run_group(cmd, fh, timeout, _child_env(nprocs))
    except OSError as exc:
        return LaunchOutcome(False, None, cmd, str(log), f"cannot start the launcher: {exc}")
    tail = _tail(log)
    out = Path(job["out"])
    if rc == 0 and out.exists():
        try:
            record = door.read_json(out, door.COMPARE_RECORD)
        except InputError as exc:
            return LaunchOutcome(False, None, cmd, str(log), f"rank 0 wrote an unreadable record: {exc}", tail)
        return LaunchOutcome(True, record, cmd, str(log), log_tail=tail)
    why = "timed out" if rc is None else f"ranks exited with status {rc}" if rc else "rank 0 wrote no record"
    return LaunchOutcome(False, None, cmd, str(log), f"{why}: {_last_error(tail)}", tail)


def _run_group(cmd: list[str], log, timeout: float | None, env: dict) -> int | None:
    """Run the launcher so that a timeout, Ctrl-C, SIGTERM or SIGHUP ends every rank it started (and any
    process those started), then unlink the CPU ranks' shared memory. None: timed out."""
    with contained_run() as run:
        proc = run.adopt(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run.env(env),
                                          start_new_session=True))
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None
        except BaseException:
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen) -> None:
    terminate_tree(proc, grace_s=10.0)


def _run_in_process(job: dict) -> LaunchOutcome:
    from dsdoctor.compare.runner import run_job

    cmd = ["(in-process)", job["path"]]
    try:
        record = run_job(job)
    except Exception as exc:  # the load path failing is a finding, not a crash of dsdoctor
        return LaunchOutcome(False, None, cmd, "", f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    finally:
        _release_memory()
    door.write_record(job["out"], json.dumps(record))
    return LaunchOutcome(True, record, cmd, "")


def _release_memory() -> None:
    """Free the in-process model before the next path's ranks need the same GPU."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _tail(log: Path) -> str:
    """The last lines of a worker log (read from its last 4 MiB: a log can be any size)."""
    try:
        text = door.read_tail(log, LOG_TAIL_BYTES, door.RUN_LOG)
    except InputError:
        return ""
    lines = text.splitlines()
    if len(text.encode("utf-8", "replace")) >= LOG_TAIL_BYTES and lines:
        lines = lines[1:]  # the first line may be cut
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _last_error(tail: str) -> str:
    """The most telling line of a worker log: the last exception line, else the last line."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0].split("]")[-1].strip()
        if head.endswith(("Error", "Exception")) or head in ("Segmentation fault", "Killed"):
            return ln[:300]
    return (lines[-1][:300] if lines else "no output")
