"""Hostile and careless input files (configs, prompt files, a model's config.json) and flags: every case ends
with exit 2 and one line naming the file, never a hang, a traceback or raw terminal control bytes.

The CLI cases run real ``dsdoctor`` processes; the timeouts passed to them only guard the suite against a
hang (a regression shows up as ``TimeoutExpired``), they assert nothing about speed."""
import json
import os
import re
import socket
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsdoctor import door
from dsdoctor.config.load import load_config
from dsdoctor.errors import InputError, one_line, printable_block
from dsdoctor.findings import Finding
from tests.helpers import ROOT, TINY_LLAMA, run_cli

RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what may never reach a terminal unescaped
HANG_GUARD_S = 120
SMALL_RUN = ("--prompt-len", "16", "--new-tokens", "8")  # within the tiny model's 128 positions


# ---------------------------------------------------------------------------- crafted files

def _alias_cycle(tmp_path):
    p = tmp_path / "cycle.yaml"
    p.write_text("zero_optimization: &a\n  stage: 3\n  again: *a\n")  # a mapping that contains itself
    return p


def _alias_cycle_list(tmp_path):
    p = tmp_path / "cycle_list.yaml"
    p.write_text("a: &a [*a]\n")
    return p


def _billion_laughs(tmp_path, levels=9, fanout=9):
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * fanout) + "]")
    p = tmp_path / "laughs.yaml"
    p.write_text("\n".join(lines) + "\n")
    return p


def _merge_key_laughs(tmp_path):
    """The same bomb through YAML merge keys (``<<: *x``) instead of sequences."""
    lines = ["m0: &m0 {a: 1, b: 2, c: 3, d: 4, e: 5, f: 6, g: 7, h: 8}"]
    for i in range(1, 9):
        keys = ", ".join(f"k{j}: *m{i - 1}" for j in range(9))
        lines.append(f"m{i}: &m{i} {{{keys}}}")
    p = tmp_path / "merge_laughs.yaml"
    p.write_text("\n".join(lines) + "\n")
    return p


def _deep_json(tmp_path, depth):
    p = tmp_path / f"deep{depth}.json"
    p.write_text('{"a":' * depth + "1" + "}" * depth)
    return p


def _deep_yaml(tmp_path, depth=800):
    p = tmp_path / "deep.yaml"
    p.write_text("a: " + "[" * depth + "]" * depth + "\n")
    return p


def _fifo(tmp_path, name="fifo.json"):
    p = tmp_path / name
    os.mkfifo(p)
    return p


def _dev_zero_link(tmp_path, name="zero.json"):
    p = tmp_path / name
    p.symlink_to("/dev/zero")
    return p


def _socket(tmp_path, name="sock.json"):
    p = tmp_path / name
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    return p, s


def _huge(tmp_path):
    p = tmp_path / "huge.json"
    with open(p, "wb") as fh:  # sparse: costs no disk
        fh.truncate(door.DS_CONFIG.max_bytes + 1)
    return p


def _big_yaml(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_text("".join(f"key{i}: [1, 2, 3]\n" for i in range(door.DS_CONFIG.slow_parse_bytes // 10)))
    return p


CRAFTED = {
    "yaml-too-big-for-a-pure-python-parser": (_big_yaml, "a YAML config is limited to"),
    "alias-cycle": (_alias_cycle, "refers to its own anchor"),
    "alias-cycle-list": (_alias_cycle_list, "refers to its own anchor"),
    "billion-laughs": (_billion_laughs, "through aliases"),
    "merge-key-laughs": (_merge_key_laughs, "through aliases"),
    "json-nested-700": (lambda t: _deep_json(t, 700), "nested"),
    "json-nested-990": (lambda t: _deep_json(t, 990), "nested"),
    "json-nested-100000": (lambda t: _deep_json(t, 100000), "nested"),
    "yaml-nested-800": (_deep_yaml, "nested"),
    "fifo": (_fifo, "FIFO"),
    "dev-zero-symlink": (_dev_zero_link, "character device"),
    "huge": (_huge, "too large"),
}


def _one_error_line(proc, path):
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"dsdoctor: error: {path}: "), lines[0]
    assert not RAW_CONTROL.search(proc.stderr)
    return lines[0]


@pytest.mark.parametrize("case", sorted(CRAFTED))
@pytest.mark.process
def test_crafted_config_ends_at_once_with_exit_2_in_every_command(tmp_path, case):
    make, problem = CRAFTED[case]
    bad = make(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    commands = {
        "check": ("check", bad),
        "split": ("split", bad, "-o", tmp_path / "out.json"),
        "plan": ("plan", "--model", model, "--config", bad, "--counts", "formula", *SMALL_RUN),
        "diagnose": ("diagnose", "--config", bad, "--model", model, "--out", tmp_path / "diag", *SMALL_RUN),
    }
    for name, args in commands.items():
        line = _one_error_line(run_cli(*args, timeout=HANG_GUARD_S), bad)
        assert problem in line, (name, line)
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "diag").exists()


@pytest.mark.process
def test_socket_as_config_is_refused(tmp_path):
    path, sock = _socket(tmp_path)
    try:
        line = _one_error_line(run_cli("check", path, timeout=HANG_GUARD_S), path)
        assert "socket" in line
    finally:
        sock.close()


@pytest.mark.parametrize("make", [_fifo, _dev_zero_link])
@pytest.mark.process
def test_non_regular_prompt_file_is_refused_before_any_model_loads(tmp_path, make):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    (model / "model.safetensors").write_bytes(b"not read: the prompts are refused first")
    prompts = make(tmp_path, "prompts.txt")
    proc = run_cli("compare", model, model, "--paths", "plain", "--prompts", prompts, timeout=HANG_GUARD_S)
    assert "regular file" in _one_error_line(proc, prompts)


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
@pytest.mark.process
def test_compare_refuses_a_fifo_among_the_model_files(tmp_path, name):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    if name != "model.safetensors":
        (model / "model.safetensors").write_bytes(b"never read")
    bad = _fifo(model, name)
    proc = run_cli("compare", model, model, "--paths", "plain", timeout=HANG_GUARD_S)
    assert "FIFO" in _one_error_line(proc, bad)


@pytest.mark.parametrize("make", [_fifo, _dev_zero_link])
@pytest.mark.process
def test_non_regular_model_config_json_is_refused(tmp_path, make):
    model = tmp_path / "model"
    model.mkdir()
    bad = make(model, "config.json")
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"stage": 3}}')
    for args in (("plan", "--model", model, *SMALL_RUN), ("check", cfg, "--model", model)):
        line = _one_error_line(run_cli(*args, timeout=HANG_GUARD_S), bad)
        assert "regular file" in line


def test_library_refuses_non_regular_files_before_opening(tmp_path):
    fifo = _fifo(tmp_path)
    for reader in (load_config, lambda p: door.read_text(p, door.PROMPTS)):
        with pytest.raises(InputError, match="FIFO"):
            reader(fifo)  # opening a FIFO for reading would block here without a writer
    with pytest.raises(InputError, match="character device"):
        load_config("/dev/zero")


# ---------------------------------------------------------------------------- YAML aliases, property-based

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(levels=st.integers(1, 12), fanout=st.integers(1, 12))
def test_yaml_alias_expansion_is_bounded(tmp_path, levels, fanout):
    """Any alias pyramid either loads (its expanded size is small) or is refused with an InputError; nothing
    in between hangs or exhausts memory."""
    path = _billion_laughs(tmp_path, levels, fanout)
    expanded = sum(9 * fanout ** i for i in range(levels + 1))  # the strings, counted per appearance
    if expanded < door.DS_CONFIG.max_nodes // 2:
        data = load_config(path).raw
        assert len(data) == levels + 1
    elif expanded > door.DS_CONFIG.max_nodes * 2:
        with pytest.raises(InputError, match="through aliases"):
            load_config(path)
    else:  # near the bound: either answer, but only these two
        try:
            load_config(path)
        except InputError as exc:
            assert "through aliases" in str(exc)


@settings(max_examples=80, deadline=None)
@given(depth=st.integers(1, 3000), opener=st.sampled_from(["[", "{\"k\": "]))
def test_nesting_is_accepted_up_to_the_bound_and_refused_beyond(depth, opener):
    closer = "]" if opener == "[" else "}"
    text = '{"a": ' + opener * depth + "1" + closer * depth + "}"
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        fh.write(text)
    try:
        if depth + 1 <= door.DS_CONFIG.max_depth:  # the top object and `depth` containers inside it
            load_config(fh.name)
        else:
            with pytest.raises(InputError, match="nested"):
                load_config(fh.name)
    finally:
        os.unlink(fh.name)


# JSON-ish trees with arbitrary strings, control characters and terminal escapes included
_texts = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x2070), max_size=12)
_trees = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | _texts,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_texts, children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(tree=st.dictionaries(_texts, _trees, max_size=5))
def test_any_json_config_loads_or_is_one_input_error(tmp_path_factory, tree):
    path = tmp_path_factory.mktemp("fuzz") / "ds.json"
    path.write_text(json.dumps(tree), encoding="utf-8")
    try:
        load_config(path)
    except InputError as exc:
        assert "\n" not in str(exc) and not RAW_CONTROL.search(str(exc))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_texts.filter(lambda t: t.strip()), where=st.sampled_from(["key", "value", "stage"]))
def test_config_text_reaches_the_terminal_escaped(tmp_path, capsys, value, where):
    """Config keys and values end up in messages and tables: escape sequences and newlines in them are shown
    escaped, in every output format but JSON (which escapes them itself)."""
    from dsdoctor.cli.main import main

    cfg = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    if where == "key":
        cfg[value] = 1
    elif where == "value":
        cfg["zero_optimization"]["offload_param"] = {"device": value}
    else:
        cfg["zero_optimization"]["stage"] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    for fmt in ("text", "markdown", "json"):
        code = main(["check", str(path), "--format", fmt])
        out, err = capsys.readouterr()
        assert code in (0, 1, 2)
        assert not RAW_CONTROL.search(out.replace("\t", "")), (fmt, out)
        assert not RAW_CONTROL.search(err) and err.count("\n") <= 1, err


def test_escaping_helpers():
    assert one_line("a\x1b]0;title\x07b\nc\rd") == "a\\x1b]0;title\\x07b\\nc\\rd"
    assert one_line("\u202eevil") == "\\u202eevil"  # a bidi override cannot reorder the line
    assert printable_block("row\tcell\x1b[2J\nnext\n") == "row\tcell\\x1b[2J\nnext\n"
    finding = Finding("DSD503", {"other": "B\x1b[31m", "ref": "A\nforged line", "max_diff": 1, "tol": 0.1,
                                 "times": 10, "prompt": 0, "position": 0})
    assert "\x1b" not in finding.message() and "\n" not in finding.message()
    err = InputError("bad\nthing", path="dir/\x1b[2Jname", hint="try\x07")
    assert err.one_line() == "dir/\\x1b[2Jname: bad\\nthing (try\\x07)"


@pytest.mark.process
def test_path_with_escape_sequences_is_named_escaped(tmp_path):
    weird = tmp_path / "we\x1b[31mird\nname.json"
    proc = run_cli("check", weird)
    assert proc.returncode == 2 and "\x1b" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "we\\x1b[31mird\\nname.json: no such file" in proc.stderr


# ---------------------------------------------------------------------------- model config.json and sizes

def _model(tmp_path, **overrides):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(TINY_LLAMA, **overrides)))
    return d


@pytest.mark.parametrize("key,value,problem", [
    ("hidden_size", 0, "hidden_size is 0; it must be at least 1"),
    ("num_attention_heads", 0, "num_attention_heads is 0; it must be at least 1"),
    ("num_key_value_heads", 0, "num_key_value_heads is 0"),
    ("num_hidden_layers", 1e12, "num_hidden_layers is 1000000000000; larger than any real model"),
    ("vocab_size", 2**40, "vocab_size is"),
    ("intermediate_size", -5, "intermediate_size is -5"),
    ("hidden_size", "4096", "hidden_size must be an integer"),
    ("num_attention_heads", 128, "smaller than num_attention_heads"),  # hidden 64 < 128 heads
])
@pytest.mark.process
def test_impossible_model_shapes_are_bad_input_naming_config_json_and_key(tmp_path, key, value, problem):
    model = _model(tmp_path, **{key: value})
    proc = run_cli("plan", "--model", model, *SMALL_RUN, timeout=HANG_GUARD_S)
    line = _one_error_line(proc, model / "config.json")
    assert problem in line


@pytest.mark.parametrize("flags,problem", [
    (("--gpus", "1000000"), "argument --gpus: value is '1000000'; it must be between 1 and 512"),
    (("--batch", "1000000000"), "argument --batch: value is '1000000000'"),
    (("--prompt-len", str(2**40)), "argument --prompt-len: value is"),
    (("--gpu-memory", "100PiB"), "--gpu-memory"),
])
@pytest.mark.process
def test_absurd_plan_flags_end_at_once(tmp_path, flags, problem):
    proc = run_cli("plan", "--model", _model(tmp_path), *SMALL_RUN, *flags, timeout=HANG_GUARD_S)
    assert proc.returncode == 2 and problem in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.process
def test_compare_refuses_more_cpu_ranks_than_cores_unless_asked(tmp_path):
    model = _model(tmp_path)
    (model / "model.safetensors").write_bytes(b"never loaded: refused before any launch")
    cores = len(os.sched_getaffinity(0))
    env = {"DS_ACCELERATOR": "cpu"}
    proc = run_cli("compare", model, "--paths", "plain,zero3", "--gpus", str(cores + 1), env=env)
    assert proc.returncode == 2 and f"only {cores} CPU core(s) usable" in proc.stderr, proc.stderr
    assert "--oversubscribe" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli("compare", model, "--paths", "plain,zero3", "--gpus", "300", "--oversubscribe", env=env)
    assert proc.returncode == 2 and "more ranks than one host runs" in proc.stderr, proc.stderr
    proc = run_cli("compare", model, model, "--paths", "plain", "--max-new-tokens", "10000000")
    assert proc.returncode == 2 and "more than a comparison needs" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------- stdout and optional packages

@pytest.mark.process
def test_closed_stdout_and_full_disk_are_one_line_exit_2(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"stage": 3}}')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env.pop("DSDOCTOR_DEBUG", None)
    cmd = [sys.executable, "-m", "dsdoctor", "check", str(cfg)]
    closed = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True, env=env, timeout=HANG_GUARD_S,
                            preexec_fn=lambda: os.close(1))
    assert closed.returncode == 2, closed.stderr
    assert closed.stderr.strip() == ("dsdoctor: error: <stdout>: cannot write the result: stdout is closed "
                                     "(redirect the output to a file with room, or use -o where the command has it)")
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=HANG_GUARD_S)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "cannot write the result: No space left on device" in proc.stderr


@pytest.mark.process
def test_plan_plot_without_matplotlib_says_so_in_one_line(tmp_path):
    model = _model(tmp_path)
    code = ("import sys; sys.modules['matplotlib'] = None; from dsdoctor.cli.main import main; "
            f"sys.exit(main(['plan', '--model', {str(model)!r}, '--counts', 'formula', '--plot', "
            f"{str(tmp_path / 'plots')!r}]))")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("dsdoctor: error: --plot needs matplotlib")
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    assert not (tmp_path / "plots").exists()
