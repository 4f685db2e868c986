"""`torch.save` files (a state_dict: `.pt`, `.pth`, `.bin`, `.ckpt`) read without running
their pickle's code: one table is one 2-D tensor, chosen by its state_dict key.

What `torch.save(model.state_dict(), path)` writes since PyTorch 1.6 is a zip archive
(every member stored, not compressed): `<archive>/data.pkl`, a pickle naming each tensor's
storage, offset, shape and strides, and `<archive>/data/<storage>`, the raw bytes of each
storage. The pickle is read by an unpickler that knows only the names a state_dict uses
(`collections.OrderedDict`, `torch._utils._rebuild_tensor_v2` / `_rebuild_parameter`,
the typed storages): any other object (a pickled module, an optimizer's class, a
`ShardedTensor`, a `__reduce__` trick) raises ModelFileError naming it, before anything
is built. Nested dicts are flattened with "." (`{"model": {"emb.weight": t}}` →
`model.emb.weight`); plain values beside the tensors (an epoch number) are ignored. A
pre-1.6 file (one raw pickle, not a zip) is refused with how to re-save it.

The rows are then read like a safetensors tensor (hps.modelfiles.formats.safetensors:
the same options `tensor`, `keys_tensor`, `key_offset` and the same choice of defaults):
memory-mapped locally, one ranged read per chunk remotely; never the whole file at once.
Which tensor: `embedding.weight` for an `nn.Embedding` attribute named `embedding`,
`ebc.embedding_bags.<table>.weight` for a TorchRec EmbeddingBagCollection `ebc`,
`ec.embeddings.<table>.weight` for an EmbeddingCollection. Rows may be float32, float16
or bfloat16, stored C-contiguous (a transposed or sliced view is refused: save
`.contiguous()`).
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps.errors import ModelFileError, UnsupportedFormatError
from hps.modelfiles.formats.base import ReadOptions
from hps.modelfiles.formats.safetensors import DTYPES, SafetensorsReader, TensorInfo
from hps.modelfiles.formats.spec import PICKLE_HINT
from hps.modelfiles.source import ModelSource
from hps.modelfiles.source_file import SourceFile

#: the typed storages a state_dict names, as safetensors dtype names
STORAGE_DTYPES = {
    "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "DoubleStorage": "F64", "LongStorage": "I64", "IntStorage": "I32",
    "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8", "BoolStorage": "BOOL",
}  # fmt: skip
#: the largest data.pkl read (a state_dict's pickle is a few bytes per tensor)
MAX_PICKLE_BYTES = 256 << 20
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length


@dataclass(frozen=True)
class _StorageType:
    dtype: str


@dataclass(frozen=True)
class _Storage:
    dtype: str
    key: str
    numel: int


@dataclass(frozen=True)
class _Tensor:
    """A tensor as the pickle describes it: its storage, offset, shape and strides."""

    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage: Any, offset: Any, shape: Any, stride: Any, *_: Any) -> _Tensor:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor whose storage is not a storage")
    return _Tensor(storage, int(offset), tuple(int(d) for d in shape),
                   tuple(int(s) for s in stride))


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


_ALLOWED: dict[str, Any] = {
    "collections.OrderedDict": OrderedDict,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    **{f"torch.{name}": _StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()},
}


class _StateDictUnpickler(pickle.Unpickler):
    """An unpickler that builds nothing but dicts, plain values and tensor descriptions."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get(f"{module}.{name}")
        if found is None:
            raise ModelFileError(
                f"{self.where}: holds a {module}.{name} object; hps reads only plain tensors "
                "(a state_dict) and never unpickles anything else: save "
                "`model.state_dict()`, or a dict of tensors"
            )
        return found

    def persistent_load(self, pid: Any) -> _Storage:
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType)):
            raise ModelFileError(f"{self.where}: a storage reference {pid!r:.80} is not one "
                                 "torch.save writes")
        return _Storage(pid[1].dtype, str(pid[2]), int(pid[4]))


class _Window(SourceFile):
    """Bytes [base, base + size) of a source file as a file of its own."""

    def __init__(self, source: ModelSource, name: str, base: int, size: int) -> None:
        super().__init__(source, name, size)
        self.base = base

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        length = max(0, min(len(view), self.size - self._pos))
        if length:
            view[:length] = self.source.read(self.name, self.base + self._pos, length)
            self._pos += length
        return length

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        try:
            return super().seek(offset, whence)
        except ValueError as exc:  # what a file raises there, and zipfile expects
            raise OSError(str(exc)) from None

    def readall(self) -> bytes:
        length = max(0, self.size - self._pos)
        data = self.source.read(self.name, self.base + self._pos, length) if length else b""
        self._pos += length
        return data


def read_archive(source: ModelSource, name: str, base: int = 0, size: int | None = None,
                 ) -> dict[str, TensorInfo]:
    """The tensors of the torch.save archive at bytes [base, base + size) of `name`, by
    flattened key, with their byte ranges in the file (`begin`, `end`: absolute offsets).

    Raises UnsupportedFormatError for a pre-1.6 pickle, ModelFileError for anything else
    that is not a zip of plain tensors (see the module docstring).
    """
    where = source.describe(name)
    size = source.size(name) - base if size is None else size
    window = _Window(source, name, base, size)
    try:
        archive = zipfile.ZipFile(io.BufferedReader(window, 1 << 16))
    except zipfile.BadZipFile:
        head = source.read(name, base, min(size, 2))
        if head[:1] == b"\x80":
            raise UnsupportedFormatError(
                f"{where} {PICKLE_HINT} (this is torch.save's pre-1.6 format; a file saved by "
                "PyTorch >= 1.6 is read as it is)"
            ) from None
        raise ModelFileError(f"{where} is not a torch.save file (no zip archive)") from None
    with archive:
        members = {info.filename: info for info in archive.infolist()}
        pickles = [n for n in members if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise ModelFileError(f"{where}: a torch.save archive holds one <name>/data.pkl; "
                                 f"found {len(pickles)}")
        prefix = pickles[0][: -len("data.pkl")]
        byteorder = members.get(f"{prefix}byteorder")
        if byteorder is not None and archive.read(byteorder).strip() != b"little":
            raise ModelFileError(f"{where} was saved on a big-endian machine; re-save it on a "
                                 "little-endian one")
        if members[pickles[0]].file_size > MAX_PICKLE_BYTES:
            raise ModelFileError(f"{where}: data.pkl of {members[pickles[0]].file_size} bytes "
                                 "is not a state_dict's")
        data = archive.read(pickles[0])
    try:
        top = _StateDictUnpickler(data, where).load()
    except ModelFileError:
        raise
    except Exception as exc:  # a malformed pickle raises anything at all
        raise ModelFileError(f"{where}: data.pkl cannot be read ({exc})") from None
    found: dict[str, _Tensor] = {}
    _flatten(top, "", found, where)

    def storage_range(key: str) -> tuple[int, int]:
        info = members.get(f"{prefix}data/{key}")
        if info is None:
            raise ModelFileError(f"{where}: storage {key!r} is named but not in the archive")
        if info.compress_type != zipfile.ZIP_STORED:
            raise ModelFileError(f"{where}: storage {key!r} is compressed; torch.save stores "
                                 "storages uncompressed")
        signature, name_len, extra_len = _LOCAL_HEADER.unpack(
            source.read(name, base + info.header_offset, _LOCAL_HEADER.size))
        if signature != b"PK\x03\x04":
            raise ModelFileError(f"{where}: the archive's directory lies about {key!r}")
        start = base + info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        return start, start + info.file_size

    return {key: _located(where, key, t, storage_range(t.storage.key))
            for key, t in found.items()}


def _flatten(value: Any, prefix: str, out: dict[str, _Tensor], where: str) -> None:
    if isinstance(value, _Tensor):
        out[prefix] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out, where)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, _Tensor) for v in value):
        for index, item in enumerate(value):
            _flatten(item, f"{prefix}.{index}" if prefix else str(index), out, where)


def _located(where: str, key: str, t: _Tensor, storage: tuple[int, int]) -> TensorInfo:
    """The byte range of a C-contiguous tensor inside its storage, checked."""
    itemsize = np.dtype(DTYPES[t.storage.dtype]).itemsize
    contiguous = all(
        t.stride[i] == math.prod(t.shape[i + 1:]) for i in range(len(t.shape)) if t.shape[i] > 1
    )
    if len(t.stride) != len(t.shape) or not contiguous:
        raise ModelFileError(
            f"{where}: tensor {key!r} of shape {list(t.shape)} has strides {list(t.stride)} "
            "(a transposed or sliced view): save it `.contiguous()`"
        )
    begin = storage[0] + t.offset * itemsize
    end = begin + math.prod(t.shape) * itemsize
    if t.offset < 0 or end > storage[1] or storage[1] - storage[0] != t.storage.numel * itemsize:
        raise ModelFileError(f"{where}: tensor {key!r} lies outside its storage "
                             "(truncated or corrupt file)")
    return TensorInfo(key, t.storage.dtype, t.shape, begin, end)


class TorchStateReader(SafetensorsReader):
    """One tensor (and optionally a keys tensor) of a `torch.save` file `name`: the
    safetensors reader's choice of tensors and chunks over the archive's tensors."""

    format = "torch"

    def __init__(self, source: ModelSource, name: str, options: ReadOptions,
                 tensor: str | None = None, keys_tensor: str | None = None,
                 key_offset: int | None = None) -> None:
        self.source = source
        self.read_options = options
        self.uri = source.describe(name)
        self.files = [(name, source.size(name))]
        tensors = read_archive(source, name)
        # the archive's tensors carry their absolute offsets in the file
        self._take_tensors(source, name, 0, tensors, tensor, keys_tensor, key_offset, options)


#: the module names under which TorchRec's collections hold their tables
TORCHREC_TABLES = ("embedding_bags", "embeddings")


def table_name_of(key: str) -> str:
    """The ps.json table name of the state_dict key of a table's weight: TorchRec's
    `<path>.embedding_bags.<table>.weight` and `<path>.embeddings.<table>.weight` give
    `<table>`; any other `<path>.weight` gives the path with "." written "_"
    (`embedding.weight` → `embedding`, `towers.0.emb.weight` → `towers_0_emb`)."""
    parts = key.split(".")
    if parts[-1] == "weight" and len(parts) > 1:
        parts = parts[:-1]
    if len(parts) >= 2 and parts[-2] in TORCHREC_TABLES:
        return parts[-1]
    return "_".join(parts)


def embedding_keys(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The keys of `shapes` (state_dict key → shape) that hold embedding tables, guessed
    from the names PyTorch and TorchRec give them: 2-D `.weight` tensors under a TorchRec
    collection, or whose path names an embedding ("emb" in it, any case)."""
    found = []
    for key, shape in shapes.items():
        parts = key.lower().split(".")
        if len(shape) != 2 or parts[-1] != "weight":
            continue
        if any(p in TORCHREC_TABLES or "emb" in p for p in parts[:-1]):
            found.append(key)
    return found
