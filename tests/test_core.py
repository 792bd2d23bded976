import pytest

from dsdoctor.errors import InputError
from dsdoctor.findings import Finding, exit_code, rule
from dsdoctor.fsutil import atomic_output_dir, atomic_write_text
from dsdoctor.units import human_bytes, parse_bytes

_T = rule(
    "DSD999", "test-rule", "warning",
    message={"en": "value is {v}", "zh": "值为 {v}"},
    fix={"en": "set it to {good}", "zh": "改为 {good}"},
    explanation={"en": "What it does", "zh": "作用"},
)


def test_finding_renders_values_in_both_languages():
    f = Finding("DSD999", {"v": 3, "good": 1})
    assert f.message("en") == "value is 3" and f.message("zh") == "值为 3"
    assert f.to_dict("zh")["fix"] == "改为 1"


def test_exit_code_threshold():
    warn = [Finding("DSD999", {"v": 1, "good": 2})]
    assert exit_code(warn, "error") == 0
    assert exit_code(warn, "warning") == 1
    assert exit_code(warn, "info") == 1
    assert exit_code([], "info") == 0


@pytest.mark.parametrize("text,expected", [("80GiB", 80 * 2**30), ("5GB", 5 * 10**9), ("5e8", 500_000_000), (1024, 1024)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_garbage():
    with pytest.raises(InputError):
        parse_bytes("lots")
    assert human_bytes(3 * 2**30) == "3.0 GiB"


def test_atomic_write_refuses_overwrite(tmp_path):
    out = tmp_path / "a.json"
    atomic_write_text(out, "1")
    with pytest.raises(InputError, match="--force"):
        atomic_write_text(out, "2")
    atomic_write_text(out, "3", force=True)
    assert out.read_text() == "3"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_atomic_output_dir_leaves_nothing_on_error(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(target) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_output_dir(target) as tmp:
        (tmp / "done.bin").write_bytes(b"x")
    assert (target / "done.bin").exists() and len(list(tmp_path.iterdir())) == 1


@pytest.mark.process
def test_readme_finding_tables_match_the_rule_registry():
    import subprocess
    import sys

    from tests.helpers import ROOT

    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_codes.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
