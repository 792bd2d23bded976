"""The per-rank record: JSON lines appended to ``$PYTHON_DSDOCTOR_TRACE_DIR/rank-R.HOST.PID.jsonl``.

Every phase start and end is written and flushed at once, so a rank that is killed or hangs still leaves its
last phase behind. A daemon thread samples host RSS and GPU memory for the timeline and flushes about once a
second. Only the standard library and ``dsdoctor.door`` (itself standard library only) are imported here;
torch is looked up in ``sys.modules`` and never imported.

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

from dsdoctor import door

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
        return int((door.read_proc("/proc/self/statm", 4096) or b"").split()[1]) * _PAGE
    except (ValueError, IndexError):
        return None


def host_peak_rss() -> int | None:
    """VmHWM: the process's peak RSS since it started. Read only: the observer never resets it (writing
    ``/proc/self/clear_refs`` would change what the traced program reads about itself)."""
    for line in (door.read_proc("/proc/self/status", 1 << 16) or b"").decode("ascii", "replace").splitlines():
        if line.startswith("VmHWM:"):
            try:
                return int(line.split()[1]) * 1024
            except (ValueError, IndexError):
                return None
    return None


class HostPeak:
    """Per-phase peak RSS without touching the process's own counters.

    Between two marks it keeps the largest RSS the sampler thread saw; and when VmHWM (the lifetime peak,
    exact to the page) rose between the marks, the new lifetime peak was reached inside the interval, so
    that value is the exact interval peak."""

    def __init__(self):
        self._lock = threading.Lock()
        self._hwm = host_peak_rss()
        self._max = host_rss()

    def sample(self, rss: int | None) -> None:
        if rss is None:
            return
        with self._lock:
            if self._max is None or rss > self._max:
                self._max = rss

    def mark(self) -> int | None:
        """The peak since the previous mark; starts the next interval."""
        rss, hwm = host_rss(), host_peak_rss()
        with self._lock:
            seen = [v for v in (self._max, rss) if v is not None]
            peak = max(seen) if seen else None
            if hwm is not None and self._hwm is not None and hwm > self._hwm:
                peak = hwm
            self._hwm, self._max = hwm, rss
        return peak


class PeakLedger:
    """What the traced program sees of the CUDA allocator's peak counters, although the observer resets them
    at every phase boundary to measure per-phase peaks.

    For each device it carries the largest peaks of the intervals the observer closed since the program's
    own last reset; the program is shown ``max(carried, raw)`` for every ``peak`` statistic, which is what the
    allocator would report had the observer never reset it. A reset by the program clears the carry (and
    resets the allocator), as it would without the observer. Installed below torch's Python API, on
    ``torch._C``, so ``torch.cuda.max_memory_allocated``, ``memory_stats``, ``memory_stats_as_nested_dict``
    and ``torch.accelerator``'s functions all agree."""

    def __init__(self, raw_stats, raw_reset):
        self.raw_stats = raw_stats  # device index -> nested stats dict (the allocator's own)
        self.raw_reset = raw_reset  # device index -> None: resets the allocator's peaks
        self._carry: dict = {}  # device -> {path tuple: peak}
        self._lock = threading.Lock()

    @staticmethod
    def peaks(nested, prefix=()):
        """(path, value) of every ``peak`` entry of a nested stats dict."""
        if isinstance(nested, dict):
            for key, value in nested.items():
                if key == "peak" and isinstance(value, (int, float)):
                    yield prefix, value
                else:
                    yield from PeakLedger.peaks(value, prefix + (key,))

    def view(self, device, nested):
        """``nested`` (raw stats of ``device``) with each peak raised to the carried one."""
        with self._lock:
            carry = dict(self._carry.get(device) or {})
        if not carry or not isinstance(nested, dict):
            return nested

        def adjust(node, prefix):
            if not isinstance(node, dict):
                return node
            out = {}
            for key, value in node.items():
                if key == "peak" and isinstance(value, (int, float)) and prefix in carry:
                    out[key] = max(value, carry[prefix])
                else:
                    out[key] = adjust(value, prefix + (key,))
            return out

        return adjust(nested, ())

    def observer_reset(self, device) -> dict:
        """Close an interval: remember its peaks for the program, reset the allocator; return the raw nested
        stats of the closed interval (its peaks are the interval's own)."""
        nested = self.raw_stats(device)
        with self._lock:
            carry = self._carry.setdefault(device, {})
            for path, value in self.peaks(nested):
                if path not in carry or value > carry[path]:
                    carry[path] = value
        self.raw_reset(device)
        return nested

    def forget(self, device) -> None:
        """The program reset its peaks: from now on it sees the allocator's own again."""
        with self._lock:
            self._carry.pop(device, None)


_LEDGER: PeakLedger | None = None


def shield_cuda_counters(torch_c) -> PeakLedger | None:
    """Wrap the allocator-stat entry points of ``torch._C`` (CUDA, and ``torch.accelerator`` over the same
    allocator) with one ledger; idempotent. Returns the ledger, or None when this torch has no CUDA stats."""
    global _LEDGER
    if _LEDGER is not None:
        return _LEDGER
    stats = getattr(torch_c, "_cuda_memoryStats", None)
    reset = getattr(torch_c, "_cuda_resetPeakMemoryStats", None)
    if stats is None or reset is None:
        return None
    ledger = PeakLedger(stats, reset)

    def _cuda_memoryStats(device):
        return ledger.view(device, stats(device))

    def _cuda_resetPeakMemoryStats(device):
        ledger.forget(device)
        return reset(device)

    torch_c._cuda_memoryStats = _cuda_memoryStats
    torch_c._cuda_resetPeakMemoryStats = _cuda_resetPeakMemoryStats
    acc_stats = getattr(torch_c, "_accelerator_getDeviceStats", None)
    acc_reset = getattr(torch_c, "_accelerator_resetPeakStats", None)
    if acc_stats is not None and acc_reset is not None:
        def _accelerator_getDeviceStats(device):
            return ledger.view(device, acc_stats(device))

        def _accelerator_resetPeakStats(device):
            ledger.forget(device)
            return acc_reset(device)

        torch_c._accelerator_getDeviceStats = _accelerator_getDeviceStats
        torch_c._accelerator_resetPeakStats = _accelerator_resetPeakStats
    _LEDGER = ledger
    return ledger


def _raw_gpu_peaks(nested) -> tuple[int | None, int | None]:
    def get(kind):
        try:
            return int(nested[kind]["all"]["peak"])
        except (KeyError, TypeError, ValueError):
            return None
    return get("allocated_bytes"), get("reserved_bytes")


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
        rank = env_rank()
        self.rank = 0 if rank is None else rank
        self.host = socket.gethostname()
        self.pid = os.getpid()
        stem = os.path.join(directory, f"rank-{self.rank}.{self.host}.{self.pid}")
        self.path = stem + ".jsonl"
        self._fh = door.record_file(self.path, "a")  # makes the folder if the parent did not
        self._lock = threading.Lock()
        self._samples: list[list] = []
        self._busy = threading.local()
        self.device = None  # CUDA device index of this rank, learned from the main thread
        self.counts: dict[str, int] = {}
        self._host_peak = HostPeak()
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
                self._host_peak.sample(row[1])
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
            self._stack_fh = door.record_file(path, "w")
            faulthandler.register(signal.SIGUSR1, file=self._stack_fh, all_threads=True,
                                  chain=previous not in (signal.SIG_DFL, signal.SIG_IGN, None))
        except Exception:
            pass

    def close(self):
        try:
            self.write("exit", host_rss=host_rss(), host_peak=host_peak_rss())
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
        """Peaks of the interval since the previous phase boundary, and start the next interval. With the
        counter shield in place the allocator is reset here and the program still sees its own peaks."""
        cuda = _cuda()
        if cuda is None or self.device is None:
            return {}
        out = {}
        try:
            cuda.synchronize(self.device)
            if _LEDGER is not None:
                alloc, reserved = _raw_gpu_peaks(_LEDGER.observer_reset(self.device))
            else:  # no shield (an unusual torch): lifetime peaks, never reset behind the program's back
                alloc, reserved = cuda.max_memory_allocated(self.device), cuda.max_memory_reserved(self.device)
            out["peak_gpu_allocated"] = alloc
            out["peak_gpu_reserved"] = reserved
            out["gpu_allocated"] = cuda.memory_allocated(self.device)
            free, total = cuda.mem_get_info(self.device)
            out["gpu_used_device"] = total - free  # what nvidia-smi (NVML) shows, all processes
            out["gpu_total"] = total
        except Exception:
            pass
        return out

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
                   gap_peak_host_rss=self._host_peak.mark(),
                   gap_peak_gpu_reserved=before.get("peak_gpu_reserved"),
                   gap_peak_gpu_allocated=before.get("peak_gpu_allocated"), **info)
        return {"phase": name, "index": index, "t0": time.perf_counter()}

    def end(self, token: dict, error: BaseException | None = None, **info) -> None:
        try:
            self.learn_device()
            duration = time.perf_counter() - token["t0"]
            fields = dict(phase=token["phase"], index=token["index"], duration_s=duration, host_rss=host_rss(),
                          peak_host_rss=self._host_peak.mark(),
                          pinned_host_bytes=pinned_host_bytes(), **self._gpu_peaks(), **info)
            if error is not None:
                fields["error"] = describe_error(error)
            self.write("phase_end", **fields)
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
