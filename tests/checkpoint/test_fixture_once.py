"""The checkpoint fixtures' memo: a maker that failed is not run again; every later caller fails at once with the
first failure's reason (a CI run once relaunched a failing DeepSpeed maker for every test)."""
from __future__ import annotations

import subprocess

import pytest

from tests.checkpoint_fixtures import once


def test_a_failed_maker_runs_once_and_later_callers_get_its_reason():
    calls = []

    @once
    def maker(arg):
        calls.append(arg)
        raise subprocess.TimeoutExpired(["deepspeed", "make.py"], 900, output=b"rank 1 stuck in all_reduce")

    with pytest.raises(subprocess.TimeoutExpired):
        maker("a")
    for _ in range(3):
        with pytest.raises(pytest.fail.Exception, match=r"maker\('a',\) failed once .*timed out after 900 s"):
            maker("a")
    with pytest.raises(pytest.fail.Exception, match="rank 1 stuck in all_reduce"):
        maker("a")
    assert calls == ["a"]


def test_a_maker_that_succeeded_is_not_run_again_and_arguments_are_kept_apart():
    calls = []

    @once
    def maker(arg):
        calls.append(arg)
        if arg == "bad":
            raise AssertionError("MAKE_OK not in the output")
        return arg.upper()

    assert [maker("a"), maker("a")] == ["A", "A"]
    with pytest.raises(AssertionError):
        maker("bad")
    with pytest.raises(pytest.fail.Exception, match="MAKE_OK not in the output"):
        maker("bad")
    assert maker("b") == "B" and calls == ["a", "bad", "b"]
