"""The door's own rules, one function at a time, on real files under tmp_path (the commands' use of them is in
test_regressions.py and tests/door/test_outputs.py)."""
from __future__ import annotations

import json
import os

import pytest

from dsdoctor import door
from dsdoctor.errors import InputError


def test_every_input_kind_is_in_the_table_and_named():
    assert door.INPUTS["DS_CONFIG"] is door.DS_CONFIG and len(door.INPUTS) >= 20
    for name, kind in door.INPUTS.items():
        assert kind.what and (kind.max_bytes is None or kind.max_bytes > 0), name


def test_an_endless_line_is_dropped_not_held(tmp_path):
    p = tmp_path / "rank-0.host.1.jsonl"
    with open(p, "wb") as fh:
        fh.write(b'{"event": "start"}\n' + b"x" * (3 * 2**20) + b'\n{"event": "exit"}\n' + b"y" * (3 * 2**20))
    kind = door.Kind("trace record", None, "utf-8", max_line=2**20)
    assert list(door.iter_lines(p, kind)) == ['{"event": "start"}\n', '{"event": "exit"}\n']


def test_tail_and_head_read_only_what_they_need(tmp_path):
    p = tmp_path / "output.log"
    p.write_bytes(b"a" * 10_000 + "合并\n".encode())
    assert door.read_tail(p, 7, door.RUN_LOG) == "合并\n"
    assert door.read_head(p, 2, door.WEIGHTS_BIN) == b"aa"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InputError, match="FIFO"):
        door.read_tail(tmp_path / "fifo", 10, door.RUN_LOG)


def test_a_grown_or_oversized_file_is_refused(tmp_path):
    p = tmp_path / "latest"
    p.write_bytes(b"global_step1" * 1000)
    with pytest.raises(InputError, match="too large for a `latest` file"):
        door.read_bytes(p, door.LATEST)


def test_cache_file_is_replaced_atomically_but_never_through_a_link(tmp_path):
    cache = tmp_path / "cache" / "machine-abc.json"
    door.write_cache_file(cache, "one")
    door.write_cache_file(cache, "two")
    assert cache.read_text() == "two" and sorted(p.name for p in cache.parent.iterdir()) == ["machine-abc.json"]
    victim = tmp_path / "victim"
    victim.write_text("keep")
    cache.unlink()
    cache.symlink_to(victim)
    with pytest.raises(InputError, match="symbolic link"):
        door.write_cache_file(cache, "three")
    assert victim.read_text() == "keep" and cache.is_symlink()


def test_new_files_are_never_written_through_a_link_or_over_a_file(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "link").symlink_to(victim)
    for name in ("link", "victim"):
        with pytest.raises(FileExistsError):
            door.write_new(tmp_path / name, "x")
    assert victim.read_text() == "keep"
    with pytest.raises(OSError):
        door.record_file(tmp_path / "link", "a")
    assert victim.read_text() == "keep"


def test_the_list_of_a_nested_output_judges_what_is_inside_it(tmp_path):
    out = tmp_path / "out"
    with door.atomic_output_dir(out) as tmp:
        door.write_new(tmp / "report.md", "outer")
        with door.atomic_output_dir(tmp / "plan") as inner:
            door.write_new(inner / "plan.html", "inner")
    marker = json.loads((out / door.MARKER).read_text())
    assert marker["files"]["report.md"] == 5 and "plan" in marker["dirs"]
    assert door.foreign_entries(out) == []
    (out / "plan" / "mine.txt").write_text("a user's")
    assert door.foreign_entries(out) == ["plan/mine.txt"]
    with pytest.raises(InputError, match="plan/mine.txt"):
        door.check_output_path(out, force=True)


def test_publish_replaces_only_listed_unchanged_files(tmp_path):
    root = door.shared_root(tmp_path / "t", command="test")
    with door.publish_into(root, force=False) as staging:
        door.write_new(staging / "report.md", "first")
    assert (root / "report.md").read_text() == "first"
    with pytest.raises(InputError, match="already exists"):
        door.check_publish(root, ["report.md"], force=False)
    with door.publish_into(root, force=True) as staging:
        door.write_new(staging / "report.md", "second!")
    assert (root / "report.md").read_text() == "second!"
    (root / "report.md").write_text("edited by hand")
    with pytest.raises(InputError, match="changed since dsdoctor wrote it"):
        with door.publish_into(root, force=True) as staging:
            door.write_new(staging / "report.md", "third")
    assert (root / "report.md").read_text() == "edited by hand"
    assert sorted(p.name for p in root.iterdir()) == [door.MARKER, "report.md"]  # no staging folder left
