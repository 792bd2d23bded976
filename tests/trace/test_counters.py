"""The tracer must not change what it measures: a traced program reads the same VmHWM and the same
``torch.cuda.max_memory_allocated`` as it would bare, although the observer keeps per-phase peaks."""
import json
import subprocess
import sys
import warnings

import pytest

from dsdoctor.trace.observer import recorder
from tests.helpers import ROOT, run_cli

SCRIPT = ROOT / "tests" / "scripts" / "reads_own_peak.py"
BUFFER = 300 * 2**20


def _result(text: str) -> dict:
    line = next(ln for ln in text.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.process
def test_traced_script_reads_the_same_vmhwm_as_bare(tmp_path):
    """The script allocates a big buffer between two observed phases, frees it, then reads VmHWM. Writing
    /proc/self/clear_refs at the phase boundary (what the observer once did) made the traced VmHWM forget
    the buffer."""
    bare = subprocess.run([sys.executable, SCRIPT, str(BUFFER)], capture_output=True, text=True, timeout=600,
                          env=_env())
    assert bare.returncode == 0, bare.stderr[-2000:]
    traced = run_cli("trace", "-o", tmp_path / "trace", "--", sys.executable, SCRIPT, str(BUFFER), timeout=600)
    assert traced.returncode in (0, 1), traced.stderr[-3000:]
    b, t = _result(bare.stdout), _result(traced.stderr + traced.stdout)
    for run in (b, t):  # the buffer's pages were resident at once: the lifetime peak holds them
        assert run["vm_hwm"] >= run["rss_before_buffer"] + 0.9 * BUFFER, run
    # and the per-phase peaks are still recorded: the gap before generate saw the buffer too
    events = [json.loads(ln) for f in (tmp_path / "trace" / "records").glob("rank-*.jsonl") for ln in f.open()]
    starts = [e for e in events if e.get("event") == "phase_start" and e.get("phase") == "generate"]
    assert starts and starts[0]["gap_peak_host_rss"] >= t["rss_before_buffer"] + 0.9 * BUFFER


def _env():
    import os

    env = dict(os.environ)
    env.pop(recorder.ENV_DIR, None)
    return env


# ---------------------------------------------------------------------------- CUDA counters, faked allocator

class FakeAllocator:
    """The two ``torch._C`` entry points the CUDA statistics go through, over a fake allocator."""

    def __init__(self):
        self.current = {0: 0, 1: 0}
        self.peak = {0: 0, 1: 0}
        self.stats_calls = 0

    def alloc(self, device, n):
        self.current[device] += n
        self.peak[device] = max(self.peak[device], self.current[device])

    def free(self, device, n):
        self.current[device] -= n

    def memoryStats(self, device):
        self.stats_calls += 1
        cur, peak = self.current[device], self.peak[device]
        return {"allocated_bytes": {"all": {"current": cur, "peak": peak}, "large_pool": {"peak": peak}},
                "reserved_bytes": {"all": {"current": 2 * cur, "peak": 2 * peak}},
                "num_alloc_retries": 0}

    def resetPeak(self, device):
        self.peak[device] = self.current[device]


@pytest.fixture
def shielded(monkeypatch):
    """torch's own Python API (torch.cuda.max_memory_allocated & co.) over the fake allocator, shielded."""
    torch = pytest.importorskip("torch")
    fake = FakeAllocator()
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", fake.memoryStats, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", fake.resetPeak, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: True)
    monkeypatch.setattr(recorder, "_LEDGER", None)
    ledger = recorder.shield_cuda_counters(torch._C)
    assert ledger is not None and recorder.shield_cuda_counters(torch._C) is ledger  # idempotent
    return torch, fake, ledger


def test_program_sees_its_own_peak_across_observer_resets(shielded):
    torch, fake, ledger = shielded
    fake.alloc(0, 1000)  # phase 1 peaks at 1000
    fake.free(0, 1000)
    closed = ledger.observer_reset(0)  # the observer closes phase 1: its own numbers are the interval's
    assert recorder._raw_gpu_peaks(closed) == (1000, 2000)
    fake.alloc(0, 300)  # phase 2 peaks at 300
    assert fake.peak[0] == 300  # the allocator itself was reset...
    # ...but the program reads what it would without the observer
    assert torch.cuda.max_memory_allocated(0) == 1000
    assert torch.cuda.max_memory_reserved(0) == 2000
    assert torch.cuda.memory_stats(0)["allocated_bytes.large_pool.peak"] == 1000
    assert torch.cuda.memory_stats_as_nested_dict(0)["allocated_bytes"]["all"]["peak"] == 1000
    assert torch.cuda.memory_allocated(0) == 300  # current values are untouched
    closed = ledger.observer_reset(0)
    assert recorder._raw_gpu_peaks(closed) == (300, 600)  # the observer's per-phase peak
    assert torch.cuda.max_memory_allocated(0) == 1000


def test_program_reset_is_honoured_and_device_scoped(shielded):
    torch, fake, ledger = shielded
    fake.alloc(0, 1000)
    fake.free(0, 1000)
    fake.alloc(1, 50)
    ledger.observer_reset(0)
    ledger.observer_reset(1)
    torch.cuda.reset_peak_memory_stats(0)  # the program's own reset: it now expects the current value
    assert torch.cuda.max_memory_allocated(0) == 0
    assert torch.cuda.max_memory_allocated(1) == 50  # the other device keeps its carried peak
    fake.alloc(0, 400)
    fake.free(0, 400)
    ledger.observer_reset(0)
    assert torch.cuda.max_memory_allocated(0) == 400
    with warnings.catch_warnings():  # deprecated spelling (FutureWarning); it resets through the same entry point
        warnings.simplefilter("ignore", FutureWarning)
        torch.cuda.reset_max_memory_allocated(0)
    assert torch.cuda.max_memory_allocated(0) == 0


def test_unshielded_view_is_the_raw_one():
    ledger = recorder.PeakLedger(lambda d: {"a": {"peak": 5}}, lambda d: None)
    assert ledger.view(0, {"a": {"peak": 5}}) == {"a": {"peak": 5}}
    ledger.observer_reset(0)
    assert ledger.view(0, {"a": {"peak": 1, "current": 1}}) == {"a": {"peak": 5, "current": 1}}
    ledger.forget(0)
    assert ledger.view(0, {"a": {"peak": 1}}) == {"a": {"peak": 1}}

