"""Stream a merge plan into safetensors shards plus ``model.safetensors.index.json``.

The safetensors layout is simple (8-byte little-endian header length, JSON header, raw little-endian
data), and every shape is known before a byte is read, so each shard's header is written first and the
tensors are then streamed piece by piece: same-dtype pieces are copied file-to-file in the kernel
(``os.copy_file_range``), others are converted in bounded chunks. Every byte read also feeds the CRC-32 of
the zip record it came from (read from the page cache through a read-only mapping, on a worker thread,
while the next piece is copied), and a record whose CRC
does not match what its zip declares stops the merge (exit 2, file and record named) before the output is
renamed into place: a flipped byte never reaches the weights. Memory stays at one chunk, whatever the model
size. Files written here are read back by ``safetensors`` and ``transformers`` in the tests.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from dsdoctor import door
from dsdoctor.checkpoint.pieces import Piece, TensorPlan
from dsdoctor.checkpoint.unpickle import FLOAT_DTYPES, SAFETENSORS_DTYPES, TensorRef
from dsdoctor.errors import InputError, printable

ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1}
CHUNK_ELEMENTS = 8 * 1024 * 1024  # per conversion step: 32 MiB of fp32 in, at most that out
COPY_BYTES = 32 * 1024 * 1024  # per copy step
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
            self.fds[path] = door.open_fd(path, door.RANK_FILE)
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


CRC_PARTS = 4  # a chunk's CRC-32 is computed in this many parts at once, then combined
CRC_PART_MIN = 2 * 1024 * 1024


def _gf2_times(mat: list[int], vec: int) -> int:
    total, i = 0, 0
    while vec:
        if vec & 1:
            total ^= mat[i]
        vec >>= 1
        i += 1
    return total


_SHIFT_OPS: dict[int, list[int]] = {}


def _shift_op(nbytes: int) -> list[int]:
    """The GF(2) matrix that advances a CRC-32 register over ``nbytes`` zero bytes (zlib's crc32_combine,
    with the operator kept: merge chunks have a handful of lengths)."""
    op = _SHIFT_OPS.get(nbytes)
    if op is None:
        power = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
        for _ in range(3):  # -> one zero byte
            power = [_gf2_times(power, c) for c in power]
        op, n = [1 << i for i in range(32)], nbytes
        while n:
            if n & 1:
                op = [_gf2_times(power, c) for c in op]
            n >>= 1
            if n:
                power = [_gf2_times(power, c) for c in power]
        if len(_SHIFT_OPS) < 64:
            _SHIFT_OPS[nbytes] = op
    return op


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc(A), crc(B) and len(B)."""
    return _gf2_times(_shift_op(len2), crc1) ^ crc2 if len2 else crc1


def crc32(data, value: int = 0, pool=None, look=None) -> int:
    """zlib.crc32, in CRC_PARTS parts on ``pool``'s threads when the data is large (zlib releases the GIL).
    ``look`` (a value check, checks.Values.look) reads every LOOK_BYTES right after the CRC did: one pass over
    bytes still in the cache."""
    n = len(data)
    if pool is None or n < CRC_PARTS * CRC_PART_MIN:
        return _crc_look(data, look, value)
    size = -(-n // CRC_PARTS)
    size += -size % 8  # whole elements of any dtype in each part, for look
    parts = [data[i:i + size] for i in range(0, n, size)]
    futures = [pool.submit(_crc_look, part, look) for part in parts[1:]]
    value = _crc_look(parts[0], look, value)
    for part, future in zip(parts[1:], futures):
        value = crc32_combine(value, future.result(), len(part))
    return value


LOOK_BYTES = 1 << 20


def _crc_look(data, look, value: int = 0) -> int:
    if look is None:
        return zlib.crc32(data, value)
    for i in range(0, len(data), LOOK_BYTES):
        part = data[i:i + LOOK_BYTES]
        value = zlib.crc32(part, value)
        look(part)
    return value


class RecordCrcs:
    """The running CRC-32 of every zip record the merge reads, fed in whatever order pieces are read.

    Each record keeps a cursor: bytes before it are already in the CRC. A read past the cursor first reads
    the gap (padding between partitions, skipped elements); a read behind it (a tied weight written twice)
    adds nothing. When the cursor reaches the record's end the CRC is compared with the zip's; ``finish``
    reads what no tensor needed and checks the records not yet complete."""

    def __init__(self, sources: _Sources, pool=None):
        self.sources = sources
        self.pool = pool  # threads for the parts of a large CRC
        self.state: dict[tuple[str, int], list] = {}  # (path, record offset) -> [cursor, crc, ref]
        self.checked = 0

    def feed(self, ref: TensorRef, offset: int, view, look=None) -> None:
        """The CRC of ``view`` (bytes at ``offset`` of ref's file); ``look`` reads all of them too."""
        if ref.record_crc is None:
            return look(view) if look is not None else None
        st = self.state.get((ref.path, ref.data_offset))
        if st is None:
            st = self.state[(ref.path, ref.data_offset)] = [ref.data_offset, 0, ref]
        end = ref.data_offset + ref.record_size
        stop = min(offset + len(view), end)
        whole = st[0] <= offset and stop == offset + len(view)  # the CRC reads every byte of the view
        if look is not None and not whole:
            look(view)
        if stop <= st[0]:
            return
        if offset > st[0]:
            self._fill(st, offset)
        st[1] = crc32(view[st[0] - offset:stop - offset], st[1], self.pool, look if whole else None)
        st[0] = stop
        if stop == end:
            self._check(st)

    def _fill(self, st: list, upto: int) -> None:
        ref = st[2]
        fd = self.sources.fd(ref.path)
        while st[0] < upto:
            step = min(upto - st[0], COPY_BYTES)
            data = _pread_exact(fd, step, st[0], ref.path)
            st[1] = crc32(data, st[1], self.pool)
            st[0] += step

    def _check(self, st: list) -> None:
        ref = st[2]
        self.checked += 1
        if st[1] != ref.record_crc:
            raise InputError(f"corrupt: CRC-32 mismatch in zip record data/{printable(ref.storage.key)} "
                             f"(crc {st[1]:08x}, the zip says {ref.record_crc:08x}): the bytes on disk are not "
                             "the bytes torch.save wrote; nothing was written", path=ref.path,
                             hint="copy the file again from where it was saved, or merge another tag")

    def finish(self) -> None:
        for st in self.state.values():
            end = st[2].data_offset + st[2].record_size
            if st[0] < end:
                self._fill(st, end)
                self._check(st)


def _feed_mapped(crcs: RecordCrcs, ref: TensorRef, fd: int, offset: int, length: int, look) -> None:
    mapped, skip = door.map_readonly(fd, offset, length)
    try:
        with memoryview(mapped) as whole, whole[skip:] as view:
            crcs.feed(ref, offset, view, look)
    finally:
        try:
            mapped.close()
        except BufferError:  # a slice is still referenced: the collector unmaps it
            pass


class _CrcWorker:
    """Runs ``RecordCrcs.feed`` on one background thread, one chunk at a time and in order, so the CRC of a
    chunk is computed while the chunk is written and the next one is read (zlib, preadv and write all release
    the GIL). The caller waits (``sync``) before it reuses the buffer of the pending chunk."""

    def __init__(self, crcs: RecordCrcs):
        self.crcs = crcs
        self.pool = None
        self.pending = None
        self.bufs = None  # the copy buffers, shared by every shard
        self.turn = 0

    def submit(self, ref: TensorRef, offset: int, view, look=None) -> None:
        if ref.record_crc is not None or look is not None:
            self._submit(self.crcs.feed, ref, offset, view, look)

    def submit_mapped(self, ref: TensorRef, fd: int, offset: int, length: int, look=None) -> None:
        """The CRC of a range the kernel just copied, read through a read-only mapping of that range only:
        the page cache the copy filled, with no copy of its own, and no more than one range mapped (the
        peak RSS stays at a chunk)."""
        if ref.record_crc is not None or look is not None:
            self._submit(_feed_mapped, self.crcs, ref, fd, offset, length, look)

    def _submit(self, fn, *args) -> None:
        self.sync()
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(1, thread_name_prefix="dsdoctor-crc")
            self.crcs.pool = ThreadPoolExecutor(CRC_PARTS - 1, thread_name_prefix="dsdoctor-crc-part")
        self.pending = self.pool.submit(fn, *args)

    def sync(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()  # raises the CRC mismatch, if any

    def close(self) -> None:
        try:
            self.sync()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
            if self.crcs.pool is not None:
                self.crcs.pool.shutdown(wait=True)
                self.crcs.pool = None


class _Copier:
    def __init__(self, out_fd: int, sources: _Sources, on_bytes, crc: _CrcWorker):
        self.out_fd = out_fd
        self.sources = sources
        self.on_bytes = on_bytes
        self.crc = crc
        self.kernel_copy = hasattr(os, "copy_file_range")
        self._in = self._out = None

    def copy(self, piece: Piece, look=None):
        offset, length = piece.ref.byte_range(piece.start, piece.count)
        src = self.sources.fd(piece.ref.path)
        if not self.kernel_copy:
            return self._copy_checked(piece, src, offset, length, look)
        while length > 0:  # copied in the kernel; the CRC of each step runs beside the next step's copy
            step = min(length, COPY_BYTES)
            try:
                done = os.copy_file_range(src, self.out_fd, step, offset)
            except OSError:
                self.kernel_copy = False
                return self._copy_checked(piece, src, offset, length, look)
            if done <= 0:
                raise InputError("truncated: a tensor's data ends past the end of the file", path=piece.ref.path)
            self.crc.submit_mapped(piece.ref, src, offset, done, look)
            offset += done
            length -= done
            self.on_bytes(done)

    def _copy_checked(self, piece: Piece, src: int, offset: int, length: int, look):
        pipe = self.crc
        if pipe.bufs is None:  # two buffers: one read and written while the other's CRC is computed
            pipe.bufs = (memoryview(bytearray(COPY_BYTES)), memoryview(bytearray(COPY_BYTES)))
        while length > 0:
            step = min(length, COPY_BYTES)
            pipe.turn ^= 1
            view = pipe.bufs[pipe.turn][:step]  # the pending CRC, if any, reads the other buffer
            if os.preadv(src, [view], offset) != step:
                raise InputError("truncated: a tensor's data ends past the end of the file", path=piece.ref.path)
            self.crc.submit(piece.ref, offset, view, look)
            _write_all(self.out_fd, view)
            offset += step
            length -= step
            self.on_bytes(step)

    def convert(self, piece: Piece, out_dtype: str, look=None):
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
            self.crc.sync()  # the pending CRC may still read self._in
            if os.preadv(src, [view], offset) != length:
                raise InputError("truncated: a tensor's data ends past the end of the file", path=piece.ref.path)
            self.crc.submit(piece.ref, offset, view)
            out = self._out[: n * ITEMSIZE[out_dtype]].view(dst_dtype)
            values = torch.frombuffer(self._in, dtype=src_dtype, count=n)
            if piece.divisor != 1.0:  # in the shard's dtype, as DeepSpeed's own rebuild divides
                values = values / piece.divisor
            out.copy_(values)
            if look is not None:
                look(out.view(torch.uint8).numpy())
            _write_all(self.out_fd, out.view(torch.uint8).numpy())
            self.on_bytes(n * ITEMSIZE[out_dtype])
            start += n
            left -= n


    def read(self, piece: Piece):
        """The piece's elements as a 1-D tensor (its CRC fed like every other read)."""
        import torch

        offset, length = piece.ref.byte_range(piece.start, piece.count)
        buf = bytearray(length)
        self.crc.sync()
        if length and os.preadv(self.sources.fd(piece.ref.path), [buf], offset) != length:
            raise InputError("truncated: a tensor's data ends past the end of the file", path=piece.ref.path)
        self.crc.submit(piece.ref, offset, memoryview(buf))
        values = torch.frombuffer(buf, dtype=getattr(torch, piece.ref.dtype)) if length else \
            torch.empty(0, dtype=getattr(torch, piece.ref.dtype))
        return values / piece.divisor if piece.divisor != 1.0 else values

    def write_computed(self, t: OutTensor, look=None):
        """A tensor computed from its pieces (a LoRA update folded into its base weight): one tensor in memory."""
        import torch

        values = t.plan.compute(self.read)
        if tuple(values.shape) != tuple(t.plan.shape):
            raise InputError(f"{t.name}: computed shape {tuple(values.shape)} is not {tuple(t.plan.shape)}",
                             path=t.plan.pieces[0].ref.path if t.plan.pieces else None)
        out = values.to(getattr(torch, t.dtype)).contiguous().reshape(-1)
        if look is not None:
            look(out.view(torch.uint8).numpy())
        self.crc.sync()
        _write_all(self.out_fd, out.view(torch.uint8).numpy())
        self.on_bytes(out.numel() * ITEMSIZE[t.dtype])


def _write_all(fd: int, buf) -> None:
    view = memoryview(buf).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_shard(path: Path, tensors: list[OutTensor], sources: _Sources, on_bytes, crc: _CrcWorker, values=None) -> int:
    fd = door.create_fd(path)  # a new file; the umask applies
    try:
        _write_all(fd, _header(tensors, {"format": "pt"}))
        copier = _Copier(fd, sources, on_bytes, crc)
        for t in tensors:
            look = values.look(t.name, t.dtype) if values is not None else None
            if t.plan.compute is not None:
                copier.write_computed(t, look)
                continue
            for piece in t.plan.pieces:
                if piece.ref.dtype == t.dtype and piece.divisor == 1.0:
                    copier.copy(piece, look)
                else:
                    copier.convert(piece, t.dtype, look)
        os.fsync(fd)
        return os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)


def write_all(out_dir: Path, tensors: list[OutTensor], max_shard_bytes: int, extra_metadata: dict,
              on_bytes=lambda n: None, single: str | None = None, values=None) -> tuple[list[str], dict[str, str], int]:
    """Write the shards and the index into ``out_dir``. Returns (shard names, weight map, total bytes).
    ``single``: one file of that name and no index (a PEFT adapter, which PEFT reads from one file); ``values``
    (checks.Values) is fed every value written, in the same pass."""
    shards = [tensors] if single else assign_shards(tensors, max_shard_bytes)
    names = [single] if single else shard_names(len(shards))
    weight_map: dict[str, str] = {}
    sources = _Sources()
    crcs = RecordCrcs(sources)
    crc = _CrcWorker(crcs)
    total = 0
    try:
        try:
            for name, shard in zip(names, shards):
                write_shard(out_dir / name, shard, sources, on_bytes, crc, values)
                for t in shard:
                    weight_map[t.name] = name
                    total += t.nbytes
        finally:
            crc.close()
        crcs.finish()
    finally:
        sources.close()
    if not single:
        index = {"metadata": {"total_size": total, **extra_metadata}, "weight_map": weight_map}
        door.write_new(out_dir / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    return names, weight_map, total
