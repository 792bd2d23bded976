"""Read torch zip checkpoints (``torch.save``) without running code from them and without torch.

The pickle is read by an Unpickler that resolves only an allow-list of globals: containers, torch's tensor
rebuild functions and storage classes (mapped to stand-ins), and the few DeepSpeed types these files carry
(mapped to inert stand-ins, so DeepSpeed need not be installed). Anything else is refused. Tensors become
``TensorRef``s: dtype, shape, stride and the byte offset of their data inside the zip file (torch stores
records uncompressed), so a caller reads exactly the bytes it needs with ``os.pread`` and nothing else.
"""
from __future__ import annotations

import math
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

from dsdoctor.errors import InputError

# torch storage class -> (dtype name, item size); dtype names are torch's (torch.<name>)
STORAGE_DTYPES = {
    "FloatStorage": ("float32", 4), "DoubleStorage": ("float64", 8), "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2), "LongStorage": ("int64", 8), "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2), "CharStorage": ("int8", 1), "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
}
SAFETENSORS_DTYPES = {
    "float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}
FLOAT_DTYPES = {"float32", "float64", "float16", "bfloat16"}


@dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: str
    itemsize: int
    numel: int


@dataclass
class TensorRef:
    """A tensor inside a checkpoint file: where its bytes are, never the bytes themselves."""

    path: str
    storage: StorageRef
    storage_offset: int  # in elements
    shape: tuple
    stride: tuple
    data_offset: int = -1  # byte offset of the storage record in the file (filled after unpickling)

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def byte_range(self, start: int = 0, count: int | None = None) -> tuple[int, int]:
        """(file offset, length) of elements [start, start+count) of this (contiguous) tensor."""
        count = self.numel - start if count is None else count
        if not self.is_contiguous():
            raise InputError(f"tensor of shape {self.shape} is not contiguous in the file", path=self.path)
        if start < 0 or count < 0 or start + count > self.numel:
            raise InputError(f"element range {start}+{count} outside a tensor of {self.numel}", path=self.path)
        return self.data_offset + (self.storage_offset + start) * self.itemsize, count * self.itemsize

    def read_bytes(self, start: int = 0, count: int | None = None) -> bytes:
        offset, length = self.byte_range(start, count)
        with open(self.path, "rb") as fh:
            data = os.pread(fh.fileno(), length, offset)
        if len(data) != length:
            raise InputError("truncated: a tensor's data ends past the end of the file", path=self.path)
        return data

    def to_torch(self):
        """Materialize (small tensors only: buffers, frozen fragments)."""
        import torch

        data = bytearray(self.read_bytes())
        t = torch.frombuffer(data, dtype=getattr(torch, self.dtype)) if data else torch.empty(0, dtype=getattr(torch, self.dtype))
        return t.reshape(self.shape)


class Size(tuple):
    """Stand-in for torch.Size."""

    def numel(self) -> int:
        n = 1
        for d in self:
            n *= d
        return n


class Opaque:
    """Stand-in for an allowed DeepSpeed object (loss scaler, fragment address...): keeps its state, runs nothing."""

    _qualname = "?"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{self._qualname}>"


def _opaque(qualname: str):
    return type(qualname.rsplit(".", 1)[-1], (Opaque,), {"_qualname": qualname})


class _TensorType:
    """Stand-in for torch.Tensor / torch.nn.Parameter used as a type marker."""


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("tensor without storage")
    return _TensorRefPending(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    return func(*args)


def _zero_stage_enum(value):
    return int(value)


def _reconstructor(cls, base, state=None):
    if not (isinstance(cls, type) and issubclass(cls, Opaque)):
        raise pickle.UnpicklingError(f"refusing to reconstruct {cls!r}")
    return cls()


class _TensorRefPending(TensorRef):
    def __init__(self, storage, storage_offset, shape, stride):
        super().__init__(path="", storage=storage, storage_offset=storage_offset, shape=shape, stride=stride)


_DEEPSPEED_OPAQUE = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "argparse.Namespace",
)

ALLOWED = {
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorType,
    ("torch.nn.parameter", "Parameter"): _TensorType,
    ("torch", "Size"): Size,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("builtins", "object"): object,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _zero_stage_enum,
}
for _name in STORAGE_DTYPES:
    ALLOWED[("torch", _name)] = _name
for _dt in SAFETENSORS_DTYPES:
    ALLOWED[("torch", _dt)] = _dt  # torch.float32 etc. pickled as dtype objects
for _q in _DEEPSPEED_OPAQUE:
    _mod, _cls = _q.rsplit(".", 1)
    ALLOWED[(_mod, _cls)] = _opaque(_q)


class RefusedGlobal(pickle.UnpicklingError):
    pass


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise RefusedGlobal(f"{module}.{name}") from None

    def persistent_load(self, pid):
        # ('storage', storage_type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        storage_type, key, _location, numel = pid[1:]
        if storage_type not in STORAGE_DTYPES:
            raise pickle.UnpicklingError(f"unsupported storage type {storage_type!r}")
        dtype, itemsize = STORAGE_DTYPES[storage_type]
        return StorageRef(str(key), dtype, itemsize, int(numel))


def _walk(obj, seen=None):
    """Every TensorRef inside nested containers."""
    if isinstance(obj, TensorRef):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from _walk(v)
    elif isinstance(obj, Opaque):
        yield from _walk(getattr(obj, "state", None))


def _record_offset(fh, info: zipfile.ZipInfo, path) -> int:
    fh.seek(info.header_offset)
    header = fh.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise InputError(f"corrupt zip record for {info.filename}", path=path)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def load(path: str | os.PathLike):
    """The object in a torch zip checkpoint, with tensors as TensorRefs (checked against the file size)."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise InputError("file not found", path=path) from None
    except zipfile.BadZipFile:
        raise InputError(
            "truncated or corrupt: not a complete torch zip checkpoint (an interrupted save, a partial copy, "
            "or the legacy torch.save format)", path=path) from None
    with zf, open(path, "rb") as fh:
        infos = {i.filename: i for i in zf.infolist()}
        pkl_names = [n for n in infos if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl_names) != 1:
            raise InputError("not a torch checkpoint (no data.pkl record)", path=path)
        prefix = pkl_names[0][: -len("data.pkl")]
        byteorder = infos.get(prefix + "byteorder")
        if byteorder is not None and zf.read(byteorder).strip() not in (b"little", b""):
            raise InputError("big-endian checkpoints are not supported", path=path)
        try:
            obj = _Unpickler(zf.open(pkl_names[0])).load()
        except RefusedGlobal as exc:
            raise InputError(
                f"refused to load: the pickle references {exc}, which is not a tensor, a container or a known "
                "DeepSpeed checkpoint type (dsdoctor never runs code from a checkpoint)", path=path) from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, zipfile.BadZipFile, OSError) as exc:
            raise InputError(f"corrupt checkpoint pickle: {exc}", path=path) from None
        offsets: dict[str, int] = {}
        for ref in _walk(obj):
            key = ref.storage.key
            if key not in offsets:
                info = infos.get(f"{prefix}data/{key}")
                if info is None:
                    raise InputError(f"storage record data/{key} is missing", path=path)
                if info.compress_type != zipfile.ZIP_STORED:
                    raise InputError(f"storage record data/{key} is compressed; not a torch.save file", path=path)
                start = _record_offset(fh, info, path)
                if info.file_size < ref.storage.numel * ref.storage.itemsize or start + info.file_size > size:
                    raise InputError(f"truncated: storage data/{key} ends past the end of the file", path=path)
                offsets[key] = start
            ref.path = path
            ref.data_offset = offsets[key]
            end = ref.storage_offset + _span(ref)
            if end > ref.storage.numel:
                raise InputError(f"corrupt: a tensor extends past its storage data/{key}", path=path)
            ref.__class__ = TensorRef
    return obj


def _span(ref: TensorRef) -> int:
    if any(s == 0 for s in ref.shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride))
