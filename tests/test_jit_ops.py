"""The suite's own DeepSpeed op folder: a lock a killed rank left is removed, a build's lock is not."""
import os
import time

from tests import jit_ops


def _lock(folder, age_s):
    op = folder / jit_ops.OP_DIR_NAME
    op.mkdir(parents=True, exist_ok=True)
    lock = op / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_lock_older_than_any_no_op_load_is_removed_once_the_op_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(jit_ops, "EXT_DIR", tmp_path)
    monkeypatch.setenv(jit_ops.BUILT_ENV, "1")
    old, fresh = _lock(tmp_path / "a", jit_ops.STALE_LOCK_S + 30), _lock(tmp_path / "b", 1)
    monkeypatch.setattr(jit_ops, "EXT_DIR", tmp_path / "a")
    assert jit_ops.clear_stale_lock() == [old]
    assert not old.exists()
    monkeypatch.setattr(jit_ops, "EXT_DIR", tmp_path / "b")
    assert jit_ops.clear_stale_lock() == [] and fresh.exists()  # a rank may hold it right now


def test_no_lock_is_touched_while_the_op_may_still_be_building(tmp_path, monkeypatch):
    monkeypatch.setattr(jit_ops, "EXT_DIR", tmp_path)
    monkeypatch.delenv(jit_ops.BUILT_ENV, raising=False)
    old = _lock(tmp_path, jit_ops.STALE_LOCK_S * 10)
    assert jit_ops.clear_stale_lock() == [] and old.exists()


def test_the_session_points_every_process_at_the_folder_of_its_own_environment():
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(jit_ops.EXT_DIR)
