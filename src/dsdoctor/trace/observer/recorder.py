"""The per-rank record: JSON lines appended to ``$PYTHON_DSDOCTOR_TRACE_DIR/rank-R.HOST.PID.jsonl``.

Every phase start and end is written and flushed at once, so a rank that is killed or hangs still leaves its
last phase behind. A daemon thread samples host RSS and GPU memory for the timeline and flushes about once a
second. Only the standard library is imported here; torch is looked up in ``sys.modules`` and never imported.

Environment variables are named ``PYTHON_DSDOCTOR_*`` on purpose: DeepSpeed's multi-node runner forwards
every variable whose name starts with ``PYTHON`` to every node (``EXPORT_ENVS`` in
``deepspeed/launcher/runner.py``), so the observer reaches remote ranks without a ``.deepspeed_env`` file.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import threading
import time

ENV_DIR = "PYTHON_DSDOCTOR_TRACE_DIR"
ENV_VARIANT = "PYTHON_DSDOCTOR_AB_VARIANT"
ENV_INTERVAL = "PYTHON_DSDOCTOR_SAMPLE_S"

_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def env_rank() -> int | None:
    for var in _RANK_VARS:
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return None


# ---------------------------------------------------------------- memory probes (all return None on failure)

def host_rss() -> int | None:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def host_peak_rss() -> int | None:
    """VmHWM: the process's peak RSS since start or since the last ``reset_host_peak``."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def reset_host_peak() -> bool:
    try:  # Linux: "5" resets VmHWM to the current RSS
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def host_total() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * _PAGE
    except (ValueError, OSError, AttributeError):
        return None


def _cuda():
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda
    except Exception:
        pass
    return None


def pinned_host_bytes() -> int | None:
    cuda = _cuda()
    if cuda is None or not hasattr(cuda, "host_memory_stats"):
        return None
    try:
        stats = cuda.host_memory_stats()
    except Exception:
        return None
    for key in ("allocated_bytes.current", "reserved_bytes.current", "active_bytes.current"):
        if key in stats:
            return int(stats[key])
    return None


class Recorder:
    """One per process, created on the first observed call (so launchers that import deepspeed stay silent)."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        rank = env_rank()
        self.rank = 0 if rank is None else rank
        self.host = socket.gethostname()
        self.pid = os.getpid()
        stem = os.path.join(directory, f"rank-{self.rank}.{self.host}.{self.pid}")
        self.path = stem + ".jsonl"
        self._fh = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._samples: list[list] = []
        self._busy = threading.local()
        self.device = None  # CUDA device index of this rank, learned from the main thread
        self.counts: dict[str, int] = {}
        self._host_peak_resettable = reset_host_peak()
        self._install_stack_dump(stem + ".stack.txt")
        self.write("start", rank=self.rank, local_rank=_int_env("LOCAL_RANK"), world_size=_int_env("WORLD_SIZE"),
                   host=self.host, pid=self.pid, argv=list(sys.argv), host_total=host_total(),
                   host_rss=host_rss(), variant=os.environ.get(ENV_VARIANT))
        interval = float(os.environ.get(ENV_INTERVAL) or 0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, args=(interval,), name="dsdoctor-sampler",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # ------------------------------------------------------------ writing
    def write(self, event: str, **fields) -> None:
        fields = {"event": event, "t": time.time(), **fields}
        line = json.dumps(fields, default=str)
        with self._lock:
            if self._fh.closed:
                return
            self._flush_samples_locked()
            self._fh.write(line + "\n")
            self._fh.flush()

    def _flush_samples_locked(self):
        if self._samples:
            self._fh.write(json.dumps({"event": "samples", "data": self._samples}) + "\n")
            self._samples = []
            self._fh.flush()

    def _sample_loop(self, interval: float):
        last_flush = time.time()
        while not self._stop.wait(interval):
            try:
                now = time.time()
                row = [round(now, 3), host_rss(), None, None]
                cuda = _cuda()
                if cuda is not None and self.device is not None:
                    row[2] = cuda.memory_allocated(self.device)
                    row[3] = cuda.memory_reserved(self.device)
                with self._lock:
                    self._samples.append(row)
                    if now - last_flush >= 1.0 and not self._fh.closed:
                        self._flush_samples_locked()
                        last_flush = now
            except Exception:
                pass

    def _install_stack_dump(self, path: str):
        """On SIGUSR1 (sent by dsdoctor's watchdog) dump every thread's Python stack: where a hung rank is."""
        try:
            import faulthandler

            if threading.current_thread() is not threading.main_thread():
                return
            previous = signal.getsignal(signal.SIGUSR1)
            self._stack_fh = open(path, "w", encoding="utf-8")
            faulthandler.register(signal.SIGUSR1, file=self._stack_fh, all_threads=True,
                                  chain=previous not in (signal.SIG_DFL, signal.SIG_IGN, None))
        except Exception:
            pass

    def close(self):
        try:
            self.write("exit", host_rss=host_rss(), host_peak=None if self._host_peak_resettable else host_peak_rss())
            self._stop.set()
            with self._lock:
                self._flush_samples_locked()
                self._fh.close()
        except Exception:
            pass

    # ------------------------------------------------------------ phases
    @property
    def busy(self) -> bool:
        return getattr(self._busy, "on", False)

    def learn_device(self):
        cuda = _cuda()
        if cuda is not None:
            try:
                self.device = cuda.current_device()
            except Exception:
                pass

    def _gpu_peaks(self) -> dict:
        cuda = _cuda()
        if cuda is None or self.device is None:
            return {}
        out = {}
        try:
            cuda.synchronize(self.device)
            out["peak_gpu_allocated"] = cuda.max_memory_allocated(self.device)
            out["peak_gpu_reserved"] = cuda.max_memory_reserved(self.device)
            out["gpu_allocated"] = cuda.memory_allocated(self.device)
            free, total = cuda.mem_get_info(self.device)
            out["gpu_used_device"] = total - free  # what nvidia-smi (NVML) shows, all processes
            out["gpu_total"] = total
        except Exception:
            pass
        return out

    def _reset_peaks(self):
        cuda = _cuda()
        if cuda is not None and self.device is not None:
            try:
                cuda.reset_peak_memory_stats(self.device)
            except Exception:
                pass
        if self._host_peak_resettable:
            reset_host_peak()

    def begin(self, name: str, **info) -> dict:
        self._busy.on = True
        try:
            return self._begin(name, **info)
        except BaseException:
            self._busy.on = False
            raise

    def _begin(self, name: str, **info) -> dict:
        self.learn_device()
        index = self.counts.get(name, 0)
        self.counts[name] = index + 1
        # peaks of the time since the previous phase, so nothing between phases is lost
        before = self._gpu_peaks()
        self.write("phase_start", phase=name, index=index, host_rss=host_rss(),
                   gap_peak_host_rss=host_peak_rss() if self._host_peak_resettable else None,
                   gap_peak_gpu_reserved=before.get("peak_gpu_reserved"),
                   gap_peak_gpu_allocated=before.get("peak_gpu_allocated"), **info)
        self._reset_peaks()
        return {"phase": name, "index": index, "t0": time.perf_counter()}

    def end(self, token: dict, error: BaseException | None = None, **info) -> None:
        try:
            self.learn_device()
            duration = time.perf_counter() - token["t0"]
            fields = dict(phase=token["phase"], index=token["index"], duration_s=duration, host_rss=host_rss(),
                          peak_host_rss=host_peak_rss() if self._host_peak_resettable else None,
                          pinned_host_bytes=pinned_host_bytes(), **self._gpu_peaks(), **info)
            if error is not None:
                fields["error"] = describe_error(error)
            self.write("phase_end", **fields)
            self._reset_peaks()
        finally:
            self._busy.on = False


def describe_error(exc: BaseException) -> dict:
    text = str(exc)
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    oom = (oom_type is not None and isinstance(exc, oom_type)) or "out of memory" in text.lower()
    return {"type": type(exc).__name__, "message": text[:1000], "oom": bool(oom)}


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else None


_RECORDER: Recorder | None = None
_RECORDER_LOCK = threading.Lock()


def get() -> Recorder | None:
    """The process's recorder, created on first use; None when tracing is off or the directory is unusable."""
    global _RECORDER
    if _RECORDER is not None and _RECORDER.pid == os.getpid():
        return _RECORDER
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return None
    with _RECORDER_LOCK:
        if _RECORDER is None or _RECORDER.pid != os.getpid():  # a forked child records on its own
            try:
                _RECORDER = Recorder(directory)
            except Exception as exc:
                sys.stderr.write(f"dsdoctor: cannot record this rank: {type(exc).__name__}: {exc}\n")
                os.environ.pop(ENV_DIR, None)
                return None
    return _RECORDER
