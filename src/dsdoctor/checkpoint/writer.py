"""Stream a merge plan into safetensors shards plus ``model.safetensors.index.json``.

The safetensors layout is simple (8-byte little-endian header length, JSON header, raw little-endian
data), and every shape is known before a byte is read, so each shard's header is written first and the
tensors are then streamed piece by piece: same-dtype pieces are copied file-to-file in the kernel
(``os.copy_file_range``), others are converted in bounded chunks. Memory stays at one chunk, whatever the
model size. Files written here are read back by ``safetensors`` and ``transformers`` in the tests.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from dsdoctor.checkpoint.pieces import Piece, TensorPlan
from dsdoctor.checkpoint.unpickle import FLOAT_DTYPES, SAFETENSORS_DTYPES
from dsdoctor.errors import InputError

ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1}
CHUNK_ELEMENTS = 8 * 1024 * 1024  # per conversion step: 32 MiB of fp32 in, at most that out
INDEX_NAME = "model.safetensors.index.json"


@dataclass
class OutTensor:
    name: str
    plan: TensorPlan
    dtype: str  # output dtype

    @property
    def nbytes(self) -> int:
        return self.plan.numel * ITEMSIZE[self.dtype]


def output_dtype(plan: TensorPlan, dtype: str) -> str:
    """Floating tensors take the requested dtype; integer and bool buffers keep theirs."""
    return dtype if plan.dtype in FLOAT_DTYPES else plan.dtype


def assign_shards(tensors: list[OutTensor], max_shard_bytes: int) -> list[list[OutTensor]]:
    shards, current, size = [], [], 0
    for t in tensors:
        if current and size + t.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _header(tensors: list[OutTensor], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.plan.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class _Sources:
    """Open file descriptors of the shard files, one per path."""

    def __init__(self):
        self.fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def close(self):
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _pread_exact(fd: int, length: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise InputError("truncated: a tensor's data ends past the end of the file", path=path)
    return data


class _Copier:
    def __init__(self, out_fd: int, sources: _Sources, on_bytes):
        self.out_fd = out_fd
        self.sources = sources
        self.on_bytes = on_bytes
        self.kernel_copy = hasattr(os, "copy_file_range")
        self._in = self._out = None

    def copy(self, piece: Piece):
        offset, length = piece.ref.byte_range(piece.start, piece.count)
        src = self.sources.fd(piece.ref.path)
        while length > 0:
            step = min(length, 256 * 1024 * 1024)
            done = 0
            if self.kernel_copy:
                try:
                    done = os.copy_file_range(src, self.out_fd, step, offset)
                except OSError:
                    self.kernel_copy = False
            if not self.kernel_copy:
                data = _pread_exact(src, step, offset, piece.ref.path)
                _write_all(self.out_fd, data)
                done = len(data)
            if done <= 0:
                raise InputError("truncated: a tensor's data ends past the end of the file", path=piece.ref.path)
            offset += done
            length -= done
            self.on_bytes(done)

    def convert(self, piece: Piece, out_dtype: str):
        import torch

        src_dtype = getattr(torch, piece.ref.dtype)
        dst_dtype = getattr(torch, out_dtype)
        src = self.sources.fd(piece.ref.path)
        if self._in is None:  # one input and one output buffer for the whole merge
            self._in = bytearray(CHUNK_ELEMENTS * 8)
            self._out = torch.empty(CHUNK_ELEMENTS * 8, dtype=torch.uint8)
        start, left = piece.start, piece.count
        while left > 0:
            n = min(left, CHUNK_ELEMENTS)
            offset, length = piece.ref.byte_range(start, n)
            view = memoryview(self._in)[:length]
            if os.preadv(src, [view], offset) != length:
                raise InputError("truncated: a tensor's data ends past the end of the file", path=piece.ref.path)
            out = self._out[: n * ITEMSIZE[out_dtype]].view(dst_dtype)
            out.copy_(torch.frombuffer(self._in, dtype=src_dtype, count=n))
            _write_all(self.out_fd, out.view(torch.uint8).numpy())
            self.on_bytes(n * ITEMSIZE[out_dtype])
            start += n
            left -= n


def _write_all(fd: int, buf) -> None:
    view = memoryview(buf).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_shard(path: Path, tensors: list[OutTensor], sources: _Sources, on_bytes) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, _header(tensors, {"format": "pt"}))
        copier = _Copier(fd, sources, on_bytes)
        for t in tensors:
            for piece in t.plan.pieces:
                if piece.ref.dtype == t.dtype:
                    copier.copy(piece)
                else:
                    copier.convert(piece, t.dtype)
        os.fsync(fd)
        return os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)


def write_all(out_dir: Path, tensors: list[OutTensor], max_shard_bytes: int, extra_metadata: dict,
              on_bytes=lambda n: None) -> tuple[list[str], dict[str, str], int]:
    """Write the shards and the index into ``out_dir``. Returns (shard names, weight map, total bytes)."""
    shards = assign_shards(tensors, max_shard_bytes)
    names = shard_names(len(shards))
    weight_map: dict[str, str] = {}
    sources = _Sources()
    total = 0
    try:
        for name, shard in zip(names, shards):
            write_shard(out_dir / name, shard, sources, on_bytes)
            for t in shard:
                weight_map[t.name] = name
                total += t.nbytes
    finally:
        sources.close()
    index = {"metadata": {"total_size": total, **extra_metadata}, "weight_map": weight_map}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return names, weight_map, total
