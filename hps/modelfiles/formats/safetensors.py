"""safetensors model files: a 2-D tensor of rows, keyed by row index or by a keys tensor.

How PyTorch saves an `nn.Embedding` (`safetensors.torch.save_file(emb.state_dict(),
path)` → one tensor "weight" [num_embeddings, dim]) or a TorchRec table: the key of row
i is `i + key_offset`. A file may instead hold a 1-D integer tensor of keys beside the
rows (what `hps convert` writes: "keys" and "weight").

Which tensors (options of the sparse_files entry):
  tensor        the rows; default the only 2-D tensor, else the one named "weight"
  keys_tensor   the keys; default "keys" when the file has one and key_offset is unset,
                else none: keys are the row index + key_offset
  key_offset    added to the row index (default 0)

The file is read from its layout (an 8-byte header length, a JSON header, then the
tensors' bytes) with ranged reads: a remote file is never downloaded whole, and a local
one is memory-mapped. The header is checked against the file before any row is read:
every tensor's offsets must lie in the file, match its shape and dtype, and the tensors
must tile the data without holes or overlaps. Rows may be float32, float16 or bfloat16
(widened to float32 exactly); keys int64, int32, uint32 or uint64.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps.errors import ModelFileError
from hps.modelfiles.formats.arrays import RawArray, row_ranges
from hps.modelfiles.formats.base import (
    INT64_MAX,
    ModelReader,
    ModelWriter,
    ReadOptions,
    check_width,
    keys_as_int64,
    rows_as_float32,
)
from hps.modelfiles.source import ModelSource

#: the safetensors library refuses larger headers; so do we
MAX_HEADER_BYTES = 100_000_000
DEFAULT_ROWS_TENSOR = "weight"
DEFAULT_KEYS_TENSOR = "keys"

#: safetensors dtype → NumPy dtype of the stored bytes (bfloat16 as its raw bits)
DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
    "F8_E4M3": "u1", "F8_E5M2": "u1",
}  # fmt: skip
ROW_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
KEY_DTYPES = {"I64": "int64", "I32": "int32", "U32": "uint32", "U64": "uint64"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the header: dtype name, shape, byte range in the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(source: ModelSource, name: str, size: int) -> tuple[int, dict[str, TensorInfo]]:
    """(data section offset, tensors by name) of a safetensors file, checked; see module."""
    where = source.describe(name)
    if size < 8:
        raise ModelFileError(f"{where}: {size} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", source.read(name, 0, 8))
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise ModelFileError(
            f"{where}: the header claims {length} bytes but the file is {size} bytes "
            "(not a safetensors file, or truncated)"
        )
    try:
        header = json.loads(source.read(name, 8, length))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{where}: the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{where}: the header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + length
    tensors = {n: _tensor(where, n, t, size - data_start) for n, t in header.items()}
    _check_tiling(where, tensors, size - data_start)
    return data_start, tensors


def _tensor(where: str, name: str, entry: Any, data_bytes: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise ModelFileError(f"{where}: header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise ModelFileError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ModelFileError(f"{where}: tensor {name!r} has a malformed shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise ModelFileError(
            f"{where}: tensor {name!r} has data_offsets {offsets!r} outside the "
            f"{data_bytes} data bytes of the file (header lies, or the file is truncated)"
        )
    expected = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
    if offsets[1] - offsets[0] != expected:
        raise ModelFileError(
            f"{where}: tensor {name!r} of shape {shape} {dtype} needs {expected} bytes but "
            f"its data_offsets {offsets} span {offsets[1] - offsets[0]} (header lies)"
        )
    return TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_tiling(where: str, tensors: dict[str, TensorInfo], data_bytes: int) -> None:
    """The tensors must cover the data section exactly: no holes, no overlaps."""
    at = 0
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != at:
            what = "overlaps the tensor before it" if t.begin < at else "leaves a hole before it"
            raise ModelFileError(
                f"{where}: tensor {t.name!r} starts at data byte {t.begin}, which {what} "
                f"(expected {at}): the header lies about offsets"
            )
        at = t.end
    if at != data_bytes:
        raise ModelFileError(
            f"{where}: the tensors end at data byte {at} but the file holds {data_bytes} "
            "data bytes (truncated, or trailing bytes)"
        )


class SafetensorsReader(ModelReader):
    """The rows tensor (and keys tensor) of one `.safetensors` file `name` in `source`."""

    format = "safetensors"

    def __init__(
        self,
        source: ModelSource,
        name: str,
        options: ReadOptions,
        tensor: str | None = None,
        keys_tensor: str | None = None,
        key_offset: int | None = None,
    ) -> None:
        self.source = source
        self.read_options = options
        self.uri = source.describe(name)
        size = source.size(name)
        self.files = [(name, size)]
        data_start, tensors = read_header(source, name, size)
        if keys_tensor is None and key_offset is None and DEFAULT_KEYS_TENSOR in tensors:
            keys_tensor = DEFAULT_KEYS_TENSOR
        self._take_tensors(source, name, data_start, tensors, tensor, keys_tensor, key_offset,
                           options)

    def _take_tensors(self, source: ModelSource, name: str, data_start: int,
                      tensors: dict[str, TensorInfo], tensor: str | None,
                      keys_tensor: str | None, key_offset: int | None,
                      options: ReadOptions) -> None:
        """Chooses the rows (and keys) tensor among `tensors`, whose byte ranges start at
        `data_start` in file `name`, and sets the reader's rows, width, types and keys.
        Shared by every format of named tensors (safetensors, torch.save)."""
        rows = self._rows_tensor(tensors, tensor)
        keys = self._keys_tensor(tensors, keys_tensor, rows) if keys_tensor else None
        self.num_keys = rows.shape[0]
        self.vec_size = check_width(self.uri, rows.shape[1], options)
        self.dtype = ROW_DTYPES[rows.dtype]
        self.tensor, self.keys_tensor, self.key_offset = rows.name, keys_tensor, key_offset or 0
        if keys is None and self.num_keys and self.key_offset + self.num_keys - 1 > INT64_MAX:
            raise ModelFileError(f"{self.uri}: key_offset {self.key_offset} overflows int64 keys")
        self.key_dtype = KEY_DTYPES[keys.dtype] if keys else "row index"
        self._rows = RawArray(
            source, name, data_start + rows.begin, np.dtype(DTYPES[rows.dtype]), rows.shape
        )
        self._keys = None
        if keys is not None:
            key_dtype = np.dtype(DTYPES[keys.dtype])
            self._keys = RawArray(source, name, data_start + keys.begin, key_dtype, keys.shape)

    def _rows_tensor(self, tensors: dict[str, TensorInfo], name: str | None) -> TensorInfo:
        if name is None:
            matrices = [t for t in tensors.values() if len(t.shape) == 2]
            if len(matrices) == 1:
                name = matrices[0].name
            elif DEFAULT_ROWS_TENSOR in tensors:
                name = DEFAULT_ROWS_TENSOR
            else:
                listing = ", ".join(f"{t.name} {list(t.shape)}" for t in tensors.values())
                raise ModelFileError(
                    f"{self.uri}: cannot tell which tensor holds the rows (tensors: "
                    f"{listing or 'none'}): name it with 'tensor' in the sparse_files entry"
                )
        if name not in tensors:
            raise ModelFileError(
                f"{self.uri} has no tensor {name!r} (tensors: {', '.join(tensors) or 'none'})"
            )
        t = tensors[name]
        if len(t.shape) != 2:
            raise ModelFileError(
                f"{self.uri}: tensor {name!r} has shape {list(t.shape)} ({len(t.shape)}-D); "
                "rows must be a 2-D tensor [num_rows, dim]"
            )
        if t.dtype not in ROW_DTYPES:
            raise ModelFileError(
                f"{self.uri}: tensor {name!r} is {t.dtype}; rows must be F32, F16 or BF16"
            )
        return t

    def _keys_tensor(self, tensors: dict[str, TensorInfo], name: str, rows: TensorInfo
                     ) -> TensorInfo:
        if name not in tensors:
            raise ModelFileError(
                f"{self.uri} has no keys tensor {name!r} (tensors: {', '.join(tensors)})"
            )
        t = tensors[name]
        if len(t.shape) != 1 or t.dtype not in KEY_DTYPES:
            raise ModelFileError(
                f"{self.uri}: keys tensor {name!r} is {t.dtype} of shape {list(t.shape)}; "
                "keys must be a 1-D I64, I32, U32 or U64 tensor"
            )
        if t.shape[0] != rows.shape[0]:
            raise ModelFileError(
                f"{self.uri}: keys tensor {name!r} holds {t.shape[0]} keys but rows tensor "
                f"{rows.name!r} holds {rows.shape[0]} rows: one per key expected"
            )
        return t

    def settings(self) -> dict[str, object]:
        return {"tensor": self.tensor, "keys_tensor": self.keys_tensor,
                "key_offset": self.key_offset}

    def _read_chunks(self, chunk_keys: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start, stop in row_ranges(self.num_keys, chunk_keys):
            if self._keys is None:
                keys = np.arange(start + self.key_offset, stop + self.key_offset, dtype=np.int64)
            else:
                keys = keys_as_int64(self.uri, self._keys.rows(start, stop), start)
            yield keys, rows_as_float32(self._rows.rows(start, stop), self.dtype)


class SafetensorsWriter(ModelWriter):
    """Writes "keys" (I64) and "weight" (F32) into one `.safetensors` file, chunk by chunk."""

    format = "safetensors"

    def __init__(self, path: str, num_keys: int, vec_size: int) -> None:
        super().__init__(path, num_keys, vec_size)
        key_bytes, row_bytes = 8 * num_keys, 4 * num_keys * vec_size
        header = json.dumps({
            DEFAULT_KEYS_TENSOR: {"dtype": "I64", "shape": [num_keys],
                                  "data_offsets": [0, key_bytes]},
            DEFAULT_ROWS_TENSOR: {"dtype": "F32", "shape": [num_keys, vec_size],
                                  "data_offsets": [key_bytes, key_bytes + row_bytes]},
        }, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data section starts 8-byte aligned
        self._file = open(self.tmp, "wb")
        self._file.write(struct.pack("<Q", len(header)) + header)
        self._key_at = 8 + len(header)
        self._row_at = self._key_at + key_bytes
        self._file.truncate(self._row_at + row_bytes)

    def _write(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self._file.seek(self._key_at)
        self._file.write(keys.astype("<i8", copy=False).tobytes())
        self._key_at += keys.nbytes
        self._file.seek(self._row_at)
        self._file.write(rows.astype("<f4", copy=False).tobytes())
        self._row_at += rows.nbytes

    def _finish(self) -> None:
        self._release()

    def _release(self) -> None:
        self._file.close()
