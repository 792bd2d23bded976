"""Index the tensors of a weights directory (safetensors shards, or one .bin) without loading them."""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from dsdoctor.errors import InputError

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


def read_safetensors_header(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise InputError("truncated safetensors file (no header)", path=path)
            (n,) = struct.unpack("<Q", raw)
            size = path.stat().st_size
            if n > min(size - 8, 100 * 2**20):
                raise InputError(f"truncated or corrupt safetensors file: header of {n} bytes in a {size}-byte file", path=path)
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise InputError("file not found", path=path) from None
    except ValueError as exc:
        raise InputError(f"corrupt safetensors header: {exc}", path=path) from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise InputError(f"truncated: tensors end at byte {8 + n + end} of a {size}-byte file", path=path)
    return header


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
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise InputError(f"corrupt index: {exc}", path=index) from None
            files = sorted({d / f for f in weight_map.values()})
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
        import torch

        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises many types for bad files
            raise InputError(f"cannot read (weights_only=True): {exc}", path=path) from None
        if not isinstance(sd, dict):
            raise InputError("not a state dict", path=path)
        _BIN_CACHE[path] = sd
    return _BIN_CACHE[path]


def load_tensor(entry: Entry):
    """One tensor, memory-mapped where the format allows."""
    if entry.file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(entry.file), framework="pt") as fh:
            return fh.get_tensor(entry.name)
    return _load_bin(entry.file)[entry.name]
