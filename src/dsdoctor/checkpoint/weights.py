"""Index the tensors of a weights directory (safetensors shards, or one .bin) without loading them."""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from dsdoctor import door
from dsdoctor.errors import InputError, printable

ST_DTYPES = {"F32": "float32", "F64": "float64", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


@dataclass(frozen=True)
class Entry:
    name: str
    file: Path
    dtype: str  # torch dtype name
    shape: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


ST_ITEMSIZE = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def read_safetensors_header(path: Path) -> dict:
    """The header of a safetensors file, every entry checked (dtype, shape, offsets inside the file and
    matching the shape), so a malformed file is named here rather than failing later in a library."""
    with door.open_binary(path, door.SAFETENSORS) as fh:
        fd = fh.fileno()
        raw = fh.read(8)
        if len(raw) != 8:
            raise InputError("truncated safetensors file (no header)", path=path)
        (n,) = struct.unpack("<Q", raw)
        size = os.fstat(fd).st_size
        if n > min(size - 8, 100 * 2**20):
            raise InputError(f"is not a safetensors file, or a truncated one: its first 8 bytes do not give a header "
                             f"length inside the {size}-byte file (their value is not shown)", path=path)
        blob = fh.read(n)
        door.json_bound(blob, path, door.SAFETENSORS)
        try:
            header = json.loads(blob)
        except (ValueError, RecursionError) as exc:
            raise InputError(f"corrupt safetensors header: {printable(exc)}", path=path) from None
    if not isinstance(header, dict):
        raise InputError("corrupt safetensors header: not a JSON object", path=path)
    end = 0
    for name, v in header.items():
        if name == "__metadata__":
            if v is not None and not (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())):
                raise InputError("corrupt safetensors header: __metadata__ is not a map of strings", path=path)
            continue
        problem = _entry_problem(v)
        if problem:
            raise InputError(f"corrupt safetensors header: tensor {printable(repr(name))[:120]} {problem}", path=path)
        end = max(end, v["data_offsets"][1])
    if 8 + n + end > size:
        raise InputError(f"truncated: tensors end at byte {8 + n + end} of a {size}-byte file", path=path)
    return header


def _entry_problem(v) -> str | None:
    if not isinstance(v, dict):
        return "is not described by an object"
    dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
    if dtype not in ST_ITEMSIZE:
        return f"has an unknown dtype {printable(repr(dtype))[:40]}"
    if not isinstance(shape, list) or len(shape) > 16 or \
            not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in shape):
        return "has an invalid shape"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and not isinstance(o, bool)
                                                                      for o in offsets)) \
            or not 0 <= offsets[0] <= offsets[1]:
        return "has invalid data_offsets"
    if offsets[1] - offsets[0] != math.prod(shape) * ST_ITEMSIZE[dtype]:
        return f"holds {offsets[1] - offsets[0]} bytes but its shape {shape} and dtype {dtype} need " \
               f"{math.prod(shape) * ST_ITEMSIZE[dtype]}"
    return None


def _read_index(index: Path, d: Path) -> list[Path]:
    blob = door.read_bytes(index, door.WEIGHTS_INDEX)
    door.json_bound(blob, index, door.WEIGHTS_INDEX)
    try:
        data = json.loads(blob.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise InputError(f"corrupt index: {printable(exc)}", path=index) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise InputError("corrupt index: no weight_map of tensor names to shard file names", path=index)
    names = set(weight_map.values())
    bad = sorted(n for n in names if not n or "/" in n or "\\" in n or n in (".", "..") or "\x00" in n)
    if bad:
        raise InputError(f"corrupt index: shard name {printable(repr(bad[0]))} is not a file name in {printable(d)}",
                         path=index)
    return sorted(d / f for f in names)


def index_weights(directory) -> dict[str, Entry]:
    """Every tensor of a weights directory: safetensors (with or without an index) or a torch .bin file."""
    d = Path(directory)
    if not d.exists():
        raise InputError("weights directory not found", path=d)
    files: list[Path]
    if d.is_file():
        files = [d]
    else:
        index = d / "model.safetensors.index.json"
        if index.exists():
            files = _read_index(index, d)
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise InputError(f"the index names shard(s) that do not exist: {', '.join(f.name for f in missing)}",
                                 path=index)
        else:
            files = sorted(d.glob("*.safetensors")) or sorted(d.glob("pytorch_model*.bin"))
        if not files:
            raise InputError("no model.safetensors.index.json, *.safetensors or pytorch_model*.bin", path=d)
    out: dict[str, Entry] = {}
    for f in files:
        if f.suffix == ".safetensors":
            for name, v in read_safetensors_header(f).items():
                if name == "__metadata__":
                    continue
                out[name] = Entry(name, f, ST_DTYPES.get(v["dtype"], v["dtype"].lower()), tuple(v["shape"]))
        else:
            for name, t in _load_bin(f).items():
                out[name] = Entry(name, f, str(t.dtype).removeprefix("torch."), tuple(t.shape))
    return out


_BIN_CACHE: dict[Path, dict] = {}


def _load_bin(path: Path) -> dict:
    if path not in _BIN_CACHE:
        sd = door.load_torch_weights(path, door.WEIGHTS_BIN)
        if not isinstance(sd, dict):
            raise InputError("not a state dict", path=path)
        _BIN_CACHE[path] = sd
    return _BIN_CACHE[path]


def load_tensor(entry: Entry):
    """One tensor, memory-mapped where the format allows."""
    if entry.file.suffix == ".safetensors":
        try:
            with door.safetensors_reader(entry.file, door.SAFETENSORS) as fh:
                return fh.get_tensor(entry.name)
        except InputError:
            raise
        except Exception as exc:  # the safetensors library's own error types
            raise InputError(f"cannot read tensor {entry.name}: {printable(exc)[:300]}", path=entry.file) from None
    return _load_bin(entry.file)[entry.name]
