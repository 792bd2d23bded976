"""The value scan every writer and verify share (dsdoctor/checkpoint/checks.py): the largest |x| of raw bytes in
each float dtype, NaN and infinities as inf, against torch's own reading of the same bytes."""
from __future__ import annotations

import math

import pytest

from dsdoctor.checkpoint.checks import IMPLAUSIBLE_ABS, Values, names_and_shapes, scan, tensor_bytes


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_scan_reads_each_float_dtype_as_torch_does(dtype):
    import torch

    torch_dtype = getattr(torch, dtype)
    values = torch.randn(10_001, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 300
    values[77] = -torch.finfo(torch_dtype).max  # the largest magnitude is negative
    values[5] = torch.finfo(torch_dtype).tiny / 4  # a subnormal
    t = values.to(torch_dtype)
    assert scan(tensor_bytes(t), dtype) == t.abs().max().item()
    for bad in (float("nan"), float("inf"), float("-inf")):
        t2 = t.clone()
        t2[9_999] = bad
        assert scan(tensor_bytes(t2), dtype) == math.inf, (dtype, bad)
    assert scan(b"", dtype) == 0.0


def test_integer_tensors_are_not_scanned():
    import torch

    assert scan(tensor_bytes(torch.arange(5)), "int64") is None
    assert Values().look("steps", "int64") is None


def test_findings_name_the_tensors_and_spare_buffers():
    values = Values()
    for name, peak in (("a.weight", 3.0), ("b.weight", math.inf), ("c.weight", 2e5), ("mask", 6e4), ("mask2", math.inf)):
        values.add(name, peak)
    found = {f.code: f.values for f in values.findings({"a.weight", "b.weight", "c.weight"})}
    assert found["DSD405"]["names"] == "b.weight, mask2"  # NaN/Inf in any tensor
    assert found["DSD413"]["names"] == "c.weight" and found["DSD413"]["limit"] == f"{IMPLAUSIBLE_ABS:g}"


def test_names_and_shapes_say_missing_extra_empty_and_other_shapes():
    found = {"a": (2, 3), "b": (0,), "c": (4,), "x": (1,)}
    expected = {"a": (2, 3), "b": (5,), "c": (5,), "d": (1,), "e": (1,)}
    codes = {f.code: f.values for f in names_and_shapes(found, expected, "out", tied_of={"e": ["a", "e"]})}
    assert codes["DSD401"]["names"] == "d" and codes["DSD402"]["names"] == "x"
    assert codes["DSD404"]["names"] == "b" and codes["DSD403"]["details"] == "c [4] != [5]"
    assert names_and_shapes({"a": (2, 3)}, {"a": (2, 3)}, "out") == []


def test_the_scan_in_the_crc_pass_sees_every_value_of_any_length():
    """merge scans values in the CRC-32's own pass (in parts on threads, each MiB after its CRC): every element is
    seen whatever the length, and the CRC stays zlib's."""
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from dsdoctor.checkpoint.writer import crc32

    with ThreadPoolExecutor(3) as pool:
        for n in (1, 2_097_153, 3_000_001):  # odd element counts: parts must not cut an element
            t = torch.rand(n, generator=torch.Generator().manual_seed(n))
            t[n - 1] = -7.5e4  # the last element holds the largest magnitude
            values = Values()
            raw = tensor_bytes(t)
            assert crc32(memoryview(raw), 0, pool, values.look("w", "float32")) == zlib.crc32(raw)
            assert values.peak == {"w": 7.5e4}
