"""Issue 26, bounded everything: every parser's cost is proportional to its input and bounded by its kind,
with real files and real processes. Memory is held to its bound by running the reader under an address-space
limit (``RLIMIT_AS``) in a child process, not by timing anything.

- a DeepSpeed config: a 15 MB JSON line once went through shlex for minutes;
- JSON of any kind: its values are counted (C speed) before ``json.loads`` builds them;
- a checkpoint pickle: the opcode scan is linear and bounded (opcode floods, a 9-byte memo index);
- a safetensors header and verify's ``config.json``;
- trace's pump: a traced program's endless line;
- merge's copies: a sparse file is refused before anything is written;
- the machine profile: figures no hardware measures are refused (and a cached one ignored)."""
from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsdoctor import door
from dsdoctor.checkpoint import unpickle
from dsdoctor.errors import InputError
from tests.helpers import EXAMPLES, ROOT, run_cli, write_model_config

WAIT_S = 120  # a guard against a hung suite, not a timing assertion


def _limited(code: str, *args, limit_mib: int) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS`` under an address-space limit: a reader that builds gigabytes fails there."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit_mib * 2**20, limit_mib * 2**20))

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          preexec_fn=limit, timeout=WAIT_S)


# ---- DeepSpeed configs: no per-line pure-Python pass ---------------------------------------------------------------

@pytest.mark.process
@pytest.mark.parametrize("name,text", [
    ("one-line.json", '{"train_batch_size": 8, "x": ["' + "x" * 15_000_000 + '"]}'),
    ("many-lines.json", '{"train_batch_size": 8, "x": [\n' + ',\n'.join(['"python a b c"'] * 90_000) + "]}"),
])
def test_a_large_json_config_is_read_in_one_pass(tmp_path, name, text):
    """A 15 MB line once spent minutes in shlex (the command-line sniffer) before the JSON parse."""
    path = tmp_path / name
    path.write_text(text)
    for command in (("check", path), ("split", path, "-o", tmp_path / f"{name}.out")):
        r = run_cli(*command, timeout=WAIT_S)
        assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_the_command_sniffer_splits_a_bounded_number_of_bytes(monkeypatch):
    import shlex

    from dsdoctor.config import load

    fed = []
    real = shlex.split
    monkeypatch.setattr(shlex, "split", lambda s, *a, **k: fed.append(len(s)) or real(s, *a, **k))
    texts = ["python " + "x" * 5_000_000, ("deepspeed a b 'c\n" * 200_000), "a: 1\n" * 300_000]
    for text in texts:
        fed.clear()
        assert load.looks_like_command(text) is False
        assert sum(fed) <= door.DS_CONFIG.slow_parse_bytes
    assert load.looks_like_command("export A=1\nCUDA_VISIBLE_DEVICES=0 deepspeed run.py --deepspeed ds.json\n")


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet=',[]{}"\\ab', max_size=6),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(',[{"', max_size=3), kids,
                                                                               max_size=4), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(tree=_json, limit=st.integers(1, 60))
def test_json_values_are_counted_before_parsing_and_never_wrongly(tree, limit):
    """``json_bound`` refuses only text whose tree is past the bound (commas and brackets outside strings are
    lower bounds of its values), and what it lets through builds at most twice the bound."""
    kind = door.Kind("test file", None, max_nodes=limit)
    text = json.dumps(tree)
    nodes = _count(tree)
    try:
        door.json_bound(text, "t.json", kind)
        door.json_bound(text.encode(), "t.json", kind)
    except InputError:
        assert nodes > limit
    else:
        assert nodes <= 2 * limit + 1


def _count(tree) -> int:
    if isinstance(tree, dict):
        return 1 + sum(_count(v) for v in tree.values())
    if isinstance(tree, list):
        return 1 + sum(_count(v) for v in tree)
    return 1


@pytest.mark.process
@pytest.mark.parametrize("reader,kind,limit_mib", [
    ("from dsdoctor.config.load import load_config as f", "DS_CONFIG", 400),
    ("from dsdoctor.model.spec import read_config_json as f", "MODEL_CONFIG", 400),
    ("from dsdoctor.calibrate.profile import load_profile as f", "MACHINE_PROFILE", 150),
])
def test_json_of_tiny_values_is_refused_before_it_is_built(tmp_path, reader, kind, limit_mib):
    """``[[],[],...]`` fills a kind's byte bound with lists (5.6 million in 16 MiB: 450 MB once parsed); it is
    refused within a few times the file's size of address space."""
    bound = getattr(door, kind).max_bytes
    path = tmp_path / "config.json"
    path.write_text('{"a": [' + ",".join(["[]"] * ((bound - 20) // 3)) + "]}")
    code = f"import sys\n{reader}\nfrom dsdoctor.errors import InputError\n" \
           "try:\n    f(sys.argv[1])\nexcept InputError as e:\n    print(e.one_line())\n"
    r = _limited(code, path, limit_mib=limit_mib)
    assert r.returncode == 0 and "values" in r.stdout and str(path) in r.stdout, r.stderr[-2000:]


# ---- checkpoint pickles: the scan is linear, bounded and refuses what the unpickler would choke on ---------------

def _torch_zip(path: Path, pickle_bytes: bytes) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle_bytes)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")
    return path


PICKLES = {
    # 9 bytes that set memo entry 2**31-1: the C unpickler sizes its memo table by the index (gigabytes)
    "memo-index": (b"\x80\x02N" + b"r" + struct.pack("<I", 2**31 - 1) + b".", "memo index"),
    "memo-index-text": (b"\x80\x02Np999999999\n.", "memo index"),
    "memo-get-unset": (b"\x80\x02h\x05.", "never set"),
    # floods of one-byte opcodes under the 64 MiB size bound: minutes through pickletools.genops
    "pop-flood": (b"\x80\x02" + b"N0" * (31 * 2**20) + b"N.", "opcodes"),
    "append-flood": (b"\x80\x02]" + b"Na" * (31 * 2**20) + b".", "opcodes"),
    "mark-flood": (b"\x80\x02" + b"(1" * (31 * 2**20) + b"N.", "opcodes"),
    "no-stop": (b"\x80\x02N", "without a STOP"),
    "truncated-arg": (b"\x80\x02X\xff\xff\x00\x00ab", "past the end"),
    "unknown-opcode": (b"\x80\x02\xff.", "unknown opcode"),
}


@pytest.mark.parametrize("case", sorted(PICKLES))
def test_crafted_pickles_are_refused_by_the_scan(tmp_path, case):
    data, words = PICKLES[case]
    path = _torch_zip(tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt", data)
    with pytest.raises(InputError, match=words) as err:
        unpickle.load(path)
    assert str(path) in str(err.value)


@pytest.mark.process
@pytest.mark.parametrize("case", ["memo-index", "append-flood"])
def test_merge_of_a_crafted_pickle_ends_within_bounded_memory(tmp_path, case):
    ckpt = tmp_path / "ckpt"
    tag = ckpt / "global_step1"
    tag.mkdir(parents=True)
    (ckpt / "latest").write_text("global_step1")
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        _torch_zip(tag / name, PICKLES[case][0])
    code = "import sys\nfrom dsdoctor.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    r = _limited(code, "merge", ckpt, tmp_path / "out", "--quiet", limit_mib=1024)
    assert r.returncode == 2 and "refused to load data.pkl" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def _reference_scan(data: bytes) -> tuple[int, int, int]:  # noqa: C901 (one branch per opcode family)
    """The same graph built through ``pickletools.genops`` (slow, obviously right): objects, tree size, depth."""
    import pickletools

    kids: list[list[int]] = []
    stack: list[int] = []
    marks: list[int] = []
    memo: dict = {}

    def pop_mark():
        at = marks.pop()
        items = stack[at:]
        del stack[at:]
        return items

    def pop(n):
        items = stack[len(stack) - n:]
        del stack[len(stack) - n:]
        return items

    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "STOP":
            break
        if name == "MARK":
            marks.append(len(stack))
        elif name in ("PROTO", "FRAME"):
            pass
        elif name == "POP":
            stack.pop()
        elif name == "DUP":
            stack.append(stack[-1])
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif name in ("TUPLE", "LIST", "DICT", "FROZENSET", "OBJ", "INST"):
            kids.append(pop_mark())
            stack.append(len(kids) - 1)
        elif name in unpickle._NEW_FROM:
            kids.append(pop(unpickle._NEW_FROM[name]))
            stack.append(len(kids) - 1)
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            items = pop_mark()
            kids[stack[-1]].extend(items)
        elif name in ("APPEND", "BUILD"):
            kids[stack[-2]].append(stack.pop())
        elif name == "SETITEM":
            k, v = pop(2)
            kids[stack[-1]].extend((k, v))
        else:
            kids.append([])
            stack.append(len(kids) - 1)

    def walk(node):
        sizes = [walk(c) for c in kids[node]]
        return 1 + sum(s for s, _ in sizes), 1 + max((d for _, d in sizes), default=0)

    measured = [walk(n) for n in range(len(kids))]
    return len(kids), max(s for s, _ in measured), max(d for _, d in measured)


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**80, 2**80) | st.floats(allow_nan=False) | st.text(max_size=300)
    | st.binary(max_size=300),
    lambda kids: st.lists(kids, max_size=5) | st.tuples(kids) | st.tuples(kids, kids) | st.tuples(kids, kids, kids)
    | st.lists(kids, max_size=5).map(tuple) | st.dictionaries(st.text(max_size=4), kids, max_size=4)
    | st.frozensets(st.integers(), max_size=3) | st.sets(st.text(max_size=3), max_size=3),
    max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(value=_values, proto=st.integers(0, pickle.HIGHEST_PROTOCOL), shared=st.booleans())
def test_the_scan_builds_the_graph_genops_describes(value, proto, shared):
    """The scan decodes opcodes from pickletools' own table, not through genops: on every protocol it sees
    the same objects, tree size and depth as a plain genops walk (memo-shared values included)."""
    value = [value, value] if shared else value
    data = pickle.dumps(value, protocol=proto)
    assert unpickle.prescan(data) == _reference_scan(data)


# ---- verify's inputs: safetensors headers and config.json --------------------------------------------------------

@pytest.mark.process
def test_a_safetensors_header_of_tiny_values_is_refused_within_bounded_memory(tmp_path):
    """99 MiB of ``[[],[],...]`` in a header once cost 2.3 GiB."""
    header = b'{"a": [' + b",".join([b"[]"] * (33 * 2**20)) + b"]}"
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
    code = "import sys\nfrom pathlib import Path\nfrom dsdoctor.checkpoint.weights import read_safetensors_header\n" \
           "from dsdoctor.errors import InputError\n" \
           "try:\n    read_safetensors_header(Path(sys.argv[1]))\nexcept InputError as e:\n    print(e.one_line())\n"
    r = _limited(code, path, limit_mib=700)
    assert r.returncode == 0 and "values" in r.stdout and str(path) in r.stdout, r.stderr[-2000:]


@pytest.mark.process
def test_verify_refuses_an_oversized_config_json_before_transformers_reads_it(tmp_path):
    import torch
    from safetensors.torch import save_file

    weights = tmp_path / "weights"
    weights.mkdir()
    save_file({"w": torch.zeros(2)}, str(weights / "model.safetensors"), metadata={"format": "pt"})
    model = tmp_path / "model"
    model.mkdir()
    with open(model / "config.json", "wb") as fh:  # sparse: 3 GiB to whoever reads it whole
        fh.truncate(3 * 2**30)
    r = run_cli("verify", weights, "--model", model, timeout=WAIT_S)
    assert r.returncode == 2 and "config.json" in r.stderr and "too large" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


# ---- trace: the traced program's output is streamed, its lines capped ------------------------------------------------

def test_the_pump_keeps_a_bounded_tail_and_copies_every_byte():
    from dsdoctor.trace.launch import TAIL_LINE_CAP, _pump

    read_fd, write_fd = os.pipe()
    sizes = [40 * 2**20, 3, 0, TAIL_LINE_CAP + 1]

    def writer():
        with os.fdopen(write_fd, "wb") as out:
            for n in sizes:
                out.write(b"y" * n + b"\n")
            out.write("é".encode() * 5)  # no newline at the end, multi-byte characters cut across reads

    thread = threading.Thread(target=writer)
    thread.start()
    import collections

    tail: collections.deque = collections.deque(maxlen=200)
    log = io.StringIO()
    _pump(read_fd, tail, log, False, chunk=4093)
    thread.join()
    os.close(read_fd)
    assert log.getvalue() == "".join("y" * n + "\n" for n in sizes) + "é" * 5
    lines = list(tail)
    assert len(lines) == 5 and all(len(line) <= TAIL_LINE_CAP + 64 for line in lines)
    assert lines[0].endswith(f" [... {40 * 2**20 - TAIL_LINE_CAP} more characters]\n")
    assert lines[1:3] == ["yyy\n", "\n"] and lines[3].endswith("[... 1 more characters]\n") and lines[4] == "é" * 5


@pytest.mark.process
def test_trace_of_a_program_printing_300_mb_without_a_newline_stays_small(tmp_path):
    """Measured as the largest resident size of dsdoctor and its program (both waited for by a wrapper):
    ``readline`` once held the whole line, twice (bytes and text)."""
    program = tmp_path / "spew.py"
    program.write_text("import os\nout = os.fdopen(1, 'wb', buffering=0)\nblock = b'x' * 2**20\n"
                       "for _ in range(300):\n    out.write(block)\n")
    wrapper = ("import resource, subprocess, sys\n"
               "r = subprocess.run([sys.executable, '-m', 'dsdoctor', *sys.argv[1:]], stdout=subprocess.DEVNULL,"
               " stderr=subprocess.DEVNULL)\n"
               "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-c", wrapper, "trace", "-o", tmp_path / "t", "--", sys.executable, program],
                       capture_output=True, text=True, env=env, timeout=WAIT_S * 2)
    code, max_rss_kib = map(int, r.stdout.split())
    assert code in (0, 1), r.stderr
    assert max_rss_kib < 250 * 1024, max_rss_kib
    assert (tmp_path / "t" / "output.log").stat().st_size == 300 * 2**20  # the log still has every byte


# ---- copies: a sparse file is refused before anything is written ----------------------------------------------------

@pytest.mark.process
def test_merge_refuses_a_sparse_model_file_under_the_size_bound(tmp_path):
    from tests.checkpoint.test_hostile import _synthetic

    ckpt, _ = _synthetic(tmp_path)
    model = write_model_config(tmp_path / "model")
    with open(model / "tokenizer.json", "wb") as fh:  # 900 MiB of holes: under the 1 GiB bound, no disk used
        fh.write(b"{}")
        fh.truncate(900 * 2**20)
    out = tmp_path / "out"
    r = run_cli("merge", ckpt, out, "--model", model, "--quiet", timeout=WAIT_S)
    assert r.returncode == 2 and "tokenizer.json" in r.stderr and "sparse" in r.stderr, r.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model"]


def test_a_dense_file_is_copied_and_a_sparse_one_refused(tmp_path):
    dense = tmp_path / "dense.json"
    dense.write_bytes(os.urandom(3 * 2**20))
    assert door.copy_size(dense, door.MODEL_FILE) == 3 * 2**20
    holes = tmp_path / "holes.json"
    with open(holes, "wb") as fh:
        fh.write(b"x" * 4096)
        fh.seek(8 * 2**20)
        fh.write(b"x" * 4096)
    with pytest.raises(InputError, match="sparse"):
        door.copy_size(holes, door.MODEL_FILE)
    (tmp_path / "out").mkdir()
    with pytest.raises(InputError, match="sparse"):
        door.copy_file(holes, tmp_path / "out" / "holes.json", door.MODEL_FILE)
    assert not (tmp_path / "out" / "holes.json").exists()


# ---- the machine profile: values no hardware measures ---------------------------------------------------------------

PLAN = ("plan", "--model", EXAMPLES / "llama-7b", "--gpus", "2", "--gpu-memory", "80GiB", "--host-memory", "1TiB",
        "--counts", "formula")


def _profile(path: Path, value) -> Path:
    from dsdoctor.calibrate.profile import FIGURES, SCHEMA

    path.write_text(json.dumps({"schema": SCHEMA, "measured": {k: value for k in FIGURES}}))
    return path


@pytest.mark.process
@pytest.mark.parametrize("value", [0, 1e-300, 5e-324, 1e300])
def test_a_profile_with_figures_no_hardware_measures_is_refused(tmp_path, value):
    """A bandwidth of 0 once ended every plan in ZeroDivisionError."""
    path = _profile(tmp_path / "h200.json", value)
    for extra in ((), ("--loop",)):
        r = run_cli(*PLAN, *extra, "--machine", path, timeout=WAIT_S)
        assert r.returncode == 2 and "measured." in r.stderr and str(path) in r.stderr, r.stderr[-2000:]
        assert "internal error" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.process
def test_a_cached_profile_with_a_zero_bandwidth_is_ignored_with_a_warning(tmp_path, monkeypatch):
    from dsdoctor.calibrate.profile import cache_path, fingerprint, machine_description

    good = run_cli(*PLAN, "--format", "json", env={"DSDOCTOR_CACHE_DIR": str(tmp_path / "empty")})
    env = {"DSDOCTOR_CACHE_DIR": str(tmp_path / "cache")}
    monkeypatch.setenv("DSDOCTOR_CACHE_DIR", env["DSDOCTOR_CACHE_DIR"])
    cached = cache_path(fingerprint(machine_description()))
    cached.parent.mkdir(parents=True)
    _profile(cached, 0)
    r = run_cli(*PLAN, "--format", "json", env=env, timeout=WAIT_S)
    assert r.returncode == good.returncode and "ignoring the cached machine profile" in r.stderr, r.stderr[-2000:]
    assert json.loads(r.stdout) == json.loads(good.stdout)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(st.floats(allow_nan=True), st.integers(-2**70, 2**70), st.text(max_size=5), st.booleans()))
def test_any_profile_figure_loads_within_the_plausible_range_or_is_one_input_error(tmp_path, value):
    from dsdoctor.calibrate.profile import FIGURES, PLAUSIBLE, SCHEMA, MachineProfile

    for name, (unit, _) in FIGURES.items():
        try:
            prof = MachineProfile.from_dict({"schema": SCHEMA, "measured": {name: value}}, "p.json")
        except InputError as exc:
            assert name in exc.one_line()
        else:
            low, high = PLAUSIBLE[unit]
            assert low <= prof.measured[name] <= high
