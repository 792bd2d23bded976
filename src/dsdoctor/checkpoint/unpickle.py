"""Read torch zip checkpoints (``torch.save``) without running code from them and without torch.

The pickle is read by an Unpickler that resolves only an allow-list of globals: containers, torch's tensor
rebuild functions and storage classes (mapped to stand-ins), and the few DeepSpeed types these files carry
(mapped to inert stand-ins, so DeepSpeed need not be installed). Anything else is refused. Tensors become
``TensorRef``s: dtype, shape, stride and the byte offset of their data inside the zip file (torch stores
records uncompressed), so a caller reads exactly the bytes it needs with ``os.pread`` and nothing else.

A checkpoint is untrusted input, so before anything is parsed: the file must be a regular file (not
``/dev/zero``, not a FIFO); the zip directory's declared size and record count must fit the file and sane
bounds; ``data.pkl`` must be small and its CRC-32 must match. The pickle's opcodes are then scanned (without
building anything) into the graph they would build, and refused if that graph, expanded as a tree, is
larger or deeper than any real checkpoint: memo references let a few hundred bytes describe a structure
whose naive walk (or hashing, or printing) never ends. Each tensor carries its zip record's offset, size and
CRC-32, so the merge checks the CRC of every record it reads as it streams (``writer.py``).
"""
from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
import reprlib
import struct
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass

from dsdoctor import door
from dsdoctor.errors import InputError, printable

PKL_MAX_BYTES = 64 * 2**20  # data.pkl of DeepSpeed rank files: kilobytes to a few MB
MAX_RECORDS = 250_000  # zip records (one per storage) in one file
MAX_DIRECTORY_BYTES = 128 * 2**20  # the zip central directory
MAX_PICKLE_NODES = 5_000_000  # objects the pickle builds
MAX_TREE_NODES = 20_000_000  # the same, with each shared (memo) reference counted as a copy
MAX_DEPTH = 100  # nesting; real checkpoints stay under 20

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
    record_size: int = -1  # bytes of the whole zip record
    record_crc: int | None = None  # its CRC-32 as the zip declares it (None: saved without CRCs)

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

    def read_data(self, start: int = 0, count: int | None = None) -> bytes:
        offset, length = self.byte_range(start, count)
        fd = door.open_fd(self.path, door.RANK_FILE)
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        if len(data) != length:
            raise InputError("truncated: a tensor's data ends past the end of the file", path=self.path)
        return data

    def to_torch(self):
        """Materialize (small tensors only: buffers, frozen fragments)."""
        import torch

        data = bytearray(self.read_data())
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
        raise pickle.UnpicklingError(f"refusing to reconstruct {short_repr(cls)}")
    return cls()


class _TensorRefPending(TensorRef):
    def __init__(self, storage, storage_offset, shape, stride):
        super().__init__(path="", storage=storage, storage_offset=storage_offset, shape=shape, stride=stride)


_DEEPSPEED_OPAQUE = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.checkpoint.universal_checkpoint.SubparamShape",  # in ds_to_universal's fp32.pt files
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
            raise pickle.UnpicklingError(f"unexpected persistent id {short_repr(pid)}")
        storage_type, key, _location, numel = pid[1:]
        if storage_type not in STORAGE_DTYPES:
            raise pickle.UnpicklingError(f"unsupported storage type {short_repr(storage_type)}")
        dtype, itemsize = STORAGE_DTYPES[storage_type]
        return StorageRef(str(key), dtype, itemsize, int(numel))


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 4, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 40, 40, 40


def short_repr(obj) -> str:
    """A bounded, one-line repr of a value read from an untrusted file (its full repr may never end)."""
    try:
        return printable(_REPR.repr(obj))
    except Exception:  # a stand-in whose repr fails
        return f"<{type(obj).__name__}>"


def _walk(obj):
    """Every TensorRef inside nested containers, each container visited once (memo-shared ones too)."""
    stack, seen = [obj], set()
    while stack:
        o = stack.pop()
        if isinstance(o, TensorRef):
            yield o
            continue
        if isinstance(o, Opaque):
            o = getattr(o, "state", None)
        if isinstance(o, (dict, list, tuple, set, frozenset)):
            if id(o) in seen:
                continue
            seen.add(id(o))
            stack.extend(o.values() if isinstance(o, dict) else o)


class PickleBomb(Exception):
    pass


MAX_OPS = 10_000_000  # pickle opcodes; a real rank file's data.pkl has about ten per tensor name
_POP_TO_MARK_NEW = {"TUPLE", "LIST", "DICT", "FROZENSET", "OBJ", "INST"}
_POP_TO_MARK_INTO = {"APPENDS", "SETITEMS", "ADDITEMS"}
_NEW_FROM = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "BINPERSID": 1, "STACK_GLOBAL": 2, "REDUCE": 2,
             "NEWOBJ": 2, "NEWOBJ_EX": 3}
_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}
_MEMO_GET = {"GET", "BINGET", "LONG_BINGET"}

# what prescan does per opcode (small ints: the scan loop compares them, the fastest dispatch in Python)
(_STOP, _MARK, _SKIP, _POP, _POP_MARK, _DUP, _PUT, _MEMOIZE, _GET, _NEW_MARK, _NEW_N, _INTO_MARK, _ADD_ONE,
 _ADD_TWO, _CONST, _REFUSE) = range(16)
# how its argument is laid out: (kind, size); kind 0 fixed size, 1 one line, 2 two lines, 3 a length of
# ``size`` bytes (unsigned) then that many bytes, 4 a signed 4-byte length then that many bytes
_FIXED, _LINE, _TWO_LINES, _COUNTED, _COUNTED_SIGNED = range(5)


def _opcode_table() -> list:  # noqa: C901,PLR0912 (one branch per opcode family, a table built once)
    """code byte -> (name, action, argument kind, argument size, [n popped]), from pickletools' own
    description of every opcode (so the scan parses exactly what the unpickler parses)."""
    table: list = [None] * 256
    for op in pickletools.opcodes:
        name, arg = op.name, op.arg
        if arg is None:
            layout = (_FIXED, 0)
        elif arg.n >= 0:
            layout = (_FIXED, arg.n)
        elif arg.n == pickletools.UP_TO_NEWLINE:
            layout = (_TWO_LINES, 0) if arg.name == "stringnl_noescape_pair" else (_LINE, 0)
        elif arg.n == pickletools.TAKEN_FROM_ARGUMENT1:
            layout = (_COUNTED, 1)
        elif arg.n == pickletools.TAKEN_FROM_ARGUMENT4:
            layout = (_COUNTED_SIGNED, 4)
        elif arg.n == pickletools.TAKEN_FROM_ARGUMENT4U:
            layout = (_COUNTED, 4)
        else:  # TAKEN_FROM_ARGUMENT8U
            layout = (_COUNTED, 8)
        n = 0
        if name == "STOP":
            action = _STOP
        elif name == "MARK":
            action = _MARK
        elif name in ("PROTO", "FRAME"):
            action = _SKIP
        elif name == "POP":
            action = _POP
        elif name == "POP_MARK":
            action = _POP_MARK
        elif name == "DUP":
            action = _DUP
        elif name in _MEMO_PUT:
            action = _PUT
        elif name == "MEMOIZE":
            action = _MEMOIZE
        elif name in _MEMO_GET:
            action = _GET
        elif name in _POP_TO_MARK_NEW:
            action = _NEW_MARK
        elif name in _NEW_FROM:
            action, n = _NEW_N, _NEW_FROM[name]
        elif name in _POP_TO_MARK_INTO:
            action = _INTO_MARK
        elif name in ("APPEND", "BUILD"):
            action = _ADD_ONE
        elif name == "SETITEM":
            action = _ADD_TWO
        elif not op.stack_before and len(op.stack_after) == 1:
            action = _CONST  # a constant, an empty container, a global name
        else:  # NEXT_BUFFER, READONLY_BUFFER: out-of-band buffers, never written by torch.save
            action = _REFUSE
        table[op.code.encode("latin-1")[0]] = (name, action, *layout, n)
    return table


_OPCODES = _opcode_table()


def prescan(data: bytes) -> tuple[int, int, int]:  # noqa: C901,PLR0912,PLR0915
    """Check the object graph a pickle would build, without building it: (objects, tree size, depth).

    Every opcode is simulated on a stack of node numbers; memo GETs push the same node again (sharing),
    appends and BUILD add children. Raises PickleBomb when the pickle has more than MAX_OPS opcodes, sets a
    memo entry past the ones set so far (the unpickler would size its memo table by that index: 9 bytes ask
    it for gigabytes), or when the graph has more objects than MAX_PICKLE_NODES, is cyclic, nests deeper
    than MAX_DEPTH, or expands (shared references counted as copies, as a naive walk, hash or repr would
    visit them) past MAX_TREE_NODES.

    Time and memory are linear in the opcodes and bounded by MAX_OPS: the opcodes are decoded here from
    pickletools' table, not by ``pickletools.genops`` (which builds an object per opcode: a flood of tiny
    opcodes under the size bound took minutes)."""
    kids: list = []  # node -> list of children, or None (a leaf: most nodes)
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    table = _OPCODES
    end = len(data)
    pos = ops = 0
    find = data.find
    from_bytes = int.from_bytes

    def bomb_nodes():
        return PickleBomb(f"it builds more than {MAX_PICKLE_NODES} objects")

    def underflow():
        return PickleBomb("corrupt: the pickle stack underflows")

    while True:
        if pos >= end:
            raise PickleBomb("corrupt: it ends without a STOP opcode")
        spec = table[data[pos]]
        if spec is None:
            raise PickleBomb(f"corrupt: unknown opcode {data[pos]:#04x} at byte {pos}")
        name, action, layout, size, n = spec
        arg_at = pos + 1
        if layout == _FIXED:
            pos = arg_at + size
        elif layout == _LINE:
            nl = find(b"\n", arg_at)
            if nl < 0:
                raise PickleBomb(f"corrupt: {name} at byte {arg_at - 1} has no end of line")
            pos = nl + 1
        elif layout == _TWO_LINES:
            nl = find(b"\n", arg_at)
            nl = find(b"\n", nl + 1) if nl >= 0 else -1
            if nl < 0:
                raise PickleBomb(f"corrupt: {name} at byte {arg_at - 1} has no end of line")
            pos = nl + 1
        else:
            length = from_bytes(data[arg_at:arg_at + size], "little", signed=layout == _COUNTED_SIGNED)
            if length < 0:
                raise PickleBomb(f"corrupt: {name} at byte {arg_at - 1} has a negative length")
            pos = arg_at + size + length
        if pos > end:
            raise PickleBomb(f"corrupt: {name} at byte {arg_at - 1} runs past the end of the pickle")
        ops += 1
        if ops > MAX_OPS:
            raise PickleBomb(f"it has more than {MAX_OPS} opcodes")
        if action == _CONST:
            if len(kids) >= MAX_PICKLE_NODES:
                raise bomb_nodes()
            stack.append(len(kids))
            kids.append(None)
        elif action == _PUT or action == _GET:
            if layout == _LINE:
                try:
                    index = int(data[arg_at:pos - 1])
                except ValueError:
                    raise PickleBomb(f"corrupt: {name} at byte {arg_at - 1} has no valid index") from None
            else:
                index = from_bytes(data[arg_at:pos], "little")
            if action == _PUT:
                if index > len(memo):
                    raise PickleBomb(f"memo index {index} skips past the {len(memo)} entries set so far (the "
                                     "unpickler would allocate a table that large)")
                if len(stack) <= (marks[-1] if marks else 0):
                    raise underflow()
                memo[index] = stack[-1]
            else:
                node = memo.get(index)
                if node is None:
                    raise PickleBomb(f"corrupt: memo entry {index} was never set")
                stack.append(node)
        elif action == _MARK:
            marks.append(len(stack))
        elif action == _SKIP:
            pass
        elif action == _ADD_ONE or action == _ADD_TWO or action == _NEW_N:
            want = 2 if action == _ADD_TWO else 1 if action == _ADD_ONE else n
            base = len(stack) - want
            if base < (marks[-1] if marks else 0) + (0 if action == _NEW_N else 1):
                raise underflow()
            items = stack[base:]
            del stack[base:]
            if action == _NEW_N:
                if len(kids) >= MAX_PICKLE_NODES:
                    raise bomb_nodes()
                stack.append(len(kids))
                kids.append(items)
            else:
                parent = stack[-1]
                if kids[parent] is None:
                    kids[parent] = items
                else:
                    kids[parent].extend(items)
        elif action == _NEW_MARK or action == _INTO_MARK or action == _POP_MARK:
            if not marks:
                raise PickleBomb("corrupt: an opcode pops to a mark that was never set")
            at = marks.pop()
            items = stack[at:]
            del stack[at:]
            if action == _NEW_MARK:
                if len(kids) >= MAX_PICKLE_NODES:
                    raise bomb_nodes()
                stack.append(len(kids))
                kids.append(items)
            elif action == _INTO_MARK:
                if len(stack) <= (marks[-1] if marks else 0):
                    raise underflow()
                parent = stack[-1]
                if kids[parent] is None:
                    kids[parent] = items
                else:
                    kids[parent].extend(items)
        elif action == _POP:
            if stack and marks and marks[-1] == len(stack):
                marks.pop()  # POP of a mark
            elif len(stack) <= (marks[-1] if marks else 0):
                raise underflow()
            else:
                stack.pop()
        elif action == _DUP:
            if len(stack) <= (marks[-1] if marks else 0):
                raise underflow()
            stack.append(stack[-1])
        elif action == _MEMOIZE:
            if len(stack) <= (marks[-1] if marks else 0):
                raise underflow()
            memo[len(memo)] = stack[-1]
        elif action == _STOP:
            break
        else:
            raise PickleBomb(f"out-of-band buffers ({name}) are not used by torch.save")
    return len(kids), *_tree_size_and_depth(kids)


def _tree_size_and_depth(kids: list[list[int]]) -> tuple[int, int]:
    """Largest tree size and depth over every node of a DAG (iterative; refuses cycles)."""
    n = len(kids)
    size = [0] * n
    depth = [0] * n
    state = bytearray(n)  # 0 new, 1 on the path, 2 done
    worst_size = worst_depth = 0
    for root in range(n):
        if state[root]:
            continue
        path = [(root, 0)]
        state[root] = 1
        while path:
            node, i = path[-1]
            children = kids[node] or ()
            if i < len(children):
                path[-1] = (node, i + 1)
                child = children[i]
                if state[child] == 1:
                    raise PickleBomb("it builds a structure that contains itself")
                if state[child] == 0:
                    state[child] = 1
                    path.append((child, 0))
                continue
            path.pop()
            state[node] = 2
            total, deep = 1, 0
            for c in children:
                total += size[c]
                deep = max(deep, depth[c])
            size[node] = min(total, MAX_TREE_NODES + 1)
            depth[node] = deep + 1
            if size[node] > MAX_TREE_NODES:
                raise PickleBomb(f"its shared references expand to more than {MAX_TREE_NODES} objects "
                                 "(a walk over it would not end)")
            if depth[node] > MAX_DEPTH:
                raise PickleBomb(f"it nests deeper than {MAX_DEPTH} levels")
            worst_size, worst_depth = max(worst_size, size[node]), max(worst_depth, depth[node])
    return worst_size, worst_depth


def _directory_bounds(fh, size: int, path) -> None:
    """Check the zip's end-of-directory record before zipfile parses it: the central directory must fit the
    file, and its size and record count must be sane (zipfile would read all of it into memory)."""
    tail_len = min(size, 22 + 65535)
    fh.seek(size - tail_len)
    tail = fh.read(tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        raise InputError("truncated or corrupt: not a complete torch zip checkpoint (no zip directory at the "
                         "end: an interrupted save, a partial copy, or the legacy torch.save format)", path=path)
    _, _, _, _, entries, cd_size, cd_offset, _ = struct.unpack("<4s4H2LH", tail[at:at + 22])
    if entries == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:  # zip64
        loc = size - tail_len + at - 20
        fh.seek(loc)
        locator = fh.read(20)
        if len(locator) != 20 or locator[:4] != b"PK\x06\x07":
            raise InputError("corrupt zip64 directory locator", path=path)
        (eocd64,) = struct.unpack("<Q", locator[8:16])
        if eocd64 + 56 > size:
            raise InputError("corrupt zip64 directory: it points past the end of the file", path=path)
        fh.seek(eocd64)
        rec = fh.read(56)
        if rec[:4] != b"PK\x06\x06":
            raise InputError("corrupt zip64 end-of-directory record", path=path)
        entries, _, cd_size, cd_offset = struct.unpack("<4Q", rec[24:56])
    if entries > MAX_RECORDS or cd_size > MAX_DIRECTORY_BYTES:
        raise InputError(f"the zip directory declares {entries} records in {cd_size} bytes, more than any torch "
                         f"checkpoint ({MAX_RECORDS} records, {MAX_DIRECTORY_BYTES} bytes at most); refusing "
                         "to read it", path=path)
    if cd_offset + cd_size > size:
        raise InputError(f"truncated: the zip directory declares {cd_offset + cd_size} bytes, the file has "
                         f"{size}", path=path)


def _record_offset(fh, info: zipfile.ZipInfo, path) -> int:
    fh.seek(info.header_offset)
    header = fh.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise InputError(f"corrupt zip record for {printable(info.filename)}", path=path)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _record(fh, info: zipfile.ZipInfo, size: int, path) -> int:
    """Data offset of a stored record, checked to lie inside the file."""
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        raise InputError(f"record {printable(info.filename)} is compressed; not a torch.save file", path=path)
    start = _record_offset(fh, info, path)
    if start + info.file_size > size:
        raise InputError(f"truncated: record {printable(info.filename)} ends past the end of the file", path=path)
    return start


def load(path: str | os.PathLike):
    """The object in a torch zip checkpoint, with tensors as TensorRefs (checked against the file size)."""
    path = os.fspath(path)
    with door.open_binary(path, door.RANK_FILE) as fh:
        size = os.fstat(fh.fileno()).st_size
        _directory_bounds(fh, size, path)
        try:
            zf = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
            raise InputError(
                "truncated or corrupt: not a complete torch zip checkpoint (an interrupted save, a partial copy, "
                f"or the legacy torch.save format): {printable(exc)}", path=path) from None
        with zf:
            return _load_zip(zf, fh, size, path)


def _load_zip(zf: zipfile.ZipFile, fh, size: int, path: str):
    infos = {i.filename: i for i in zf.infolist()}
    pkl_names = [n for n in infos if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl_names) != 1:
        raise InputError("not a torch checkpoint (no data.pkl record)", path=path)
    # torch.save can be told not to compute CRCs (torch.serialization.set_crc32_options): then all are 0
    with_crc = any(i.CRC != 0 for i in infos.values())
    prefix = pkl_names[0][: -len("data.pkl")]
    byteorder = infos.get(prefix + "byteorder")
    if byteorder is not None:
        if byteorder.file_size > 16:
            raise InputError("corrupt byteorder record", path=path)
        fh.seek(_record(fh, byteorder, size, path))
        if fh.read(byteorder.file_size).strip() not in (b"little", b""):
            raise InputError("big-endian checkpoints are not supported", path=path)
    obj = _unpickle(_pickle_bytes(fh, infos[pkl_names[0]], size, path, with_crc), path)
    records: dict[str, tuple[int, int, int | None]] = {}
    for ref in _walk(obj):
        key = ref.storage.key
        if key not in records:
            records[key] = _storage_record(fh, infos.get(f"{prefix}data/{key}"), ref, size, path, with_crc)
        ref.path = path
        ref.data_offset, ref.record_size, ref.record_crc = records[key]
        end = ref.storage_offset + _span(ref)
        if ref.storage_offset < 0 or any(d < 0 for d in ref.shape) or end > ref.storage.numel:
            raise InputError(f"corrupt: a tensor extends past its storage data/{printable(key)}", path=path)
        ref.__class__ = TensorRef
    return obj


def _pickle_bytes(fh, info: zipfile.ZipInfo, size: int, path: str, with_crc: bool) -> bytes:
    """data.pkl's bytes, bounded, whole, with their CRC-32 checked (when the file has CRCs)."""
    if info.file_size > PKL_MAX_BYTES:
        raise InputError(f"data.pkl declares {info.file_size} bytes; the pickle of a real checkpoint is far "
                         f"smaller ({PKL_MAX_BYTES} at most); refusing to read it", path=path)
    fh.seek(_record(fh, info, size, path))
    data = fh.read(info.file_size)
    if len(data) != info.file_size:
        raise InputError("truncated: data.pkl ends past the end of the file", path=path)
    if with_crc and zlib.crc32(data) != info.CRC:
        raise InputError(f"corrupt: CRC-32 mismatch in record {printable(info.filename)} (the bytes on disk are "
                         "not the bytes torch.save wrote)", path=path)
    return data


def _unpickle(data: bytes, path: str):
    """The pickle's object, after ``prescan`` passed it, through the allow-list unpickler only."""
    try:
        prescan(data)
    except PickleBomb as exc:
        raise InputError(f"refused to load data.pkl: {exc}", path=path) from None
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except RefusedGlobal as exc:
        raise InputError(
            f"refused to load: the pickle references {printable(exc)}, which is not a tensor, a container or a "
            "known DeepSpeed checkpoint type (dsdoctor never runs code from a checkpoint)", path=path) from None
    except (MemoryError, RecursionError):
        raise InputError("refused to load data.pkl: it is too large or too deep to be a checkpoint", path=path) from None
    except Exception as exc:  # anything a corrupt pickle makes the allowed constructors raise
        raise InputError(f"corrupt checkpoint pickle: {type(exc).__name__}: {printable(exc)}", path=path) from None


def _storage_record(fh, rinfo: zipfile.ZipInfo | None, ref, size: int, path: str,
                    with_crc: bool) -> tuple[int, int, int | None]:
    """(offset, size, CRC or None) of a storage's record, which holds at least what its tensor declares."""
    key = ref.storage.key
    if rinfo is None:
        raise InputError(f"storage record data/{printable(key)} is missing", path=path)
    start = _record(fh, rinfo, size, path)
    if rinfo.file_size < ref.storage.numel * ref.storage.itemsize:
        raise InputError(f"truncated: storage data/{printable(key)} holds {rinfo.file_size} bytes, its "
                         f"tensor declares {ref.storage.numel * ref.storage.itemsize}", path=path)
    return start, rinfo.file_size, rinfo.CRC if with_crc else None


def _span(ref: TensorRef) -> int:
    if any(s == 0 for s in ref.shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride))
