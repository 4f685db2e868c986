"""torch.distributed.checkpoint (DCP) folders: one table is one 2-D tensor of the saved
state_dict, reassembled from the pieces each rank wrote, row range by row range.

What `torch.distributed.checkpoint.save(state_dict, checkpoint_id=folder)` writes (the
default FileSystemWriter): `.metadata`, a pickle of DCP's `Metadata` (each tensor's
global size, dtype and the chunks it was saved in: offsets and sizes), and the ranks'
`__<rank>_<n>.distcp` files, where each chunk is a `torch.save` archive at a byte range
(`_StorageInfo`). A table sharded row-wise over ranks has chunks [rows_i, dim]; one
sharded column-wise has chunks [rows, cols_i]; any grid of both is read the same way.

`.metadata` is read by an unpickler that builds only DCP's metadata classes, torch.Size
and dtypes (anything else raises ModelFileError naming it); building those needs torch
(the `torch` extra). Each chunk's archive is read like a `torch.save` file
(torch_state.py: no pickle code runs, every tensor checked against its storage). Opening
checks that the chunks of the chosen tensor tile it exactly (no hole, no overlap) and
that each chunk's stored tensor has the chunk's shape and the tensor's dtype.

Rows are then read `chunk_keys` at a time: the pieces of every shard that cross a row
range are copied into one chunk of rows (memory-mapped locally, one ranged read per
piece remotely); a row range inside one shard that spans the whole width is handed out
as it is stored, without a copy. So the table is never in memory twice: at most one
chunk of rows beside the files' pages. Keys are the row index + `key_offset`.

A table split column-wise comes in chunks of at most COLUMN_CHUNK_BYTES of rows, fewer
rows than `chunk_keys` asks for: each chunk is then still in the CPU's cache when the
load gate and the tiers read it, right after it was put together, instead of being
fetched from memory twice more.

Options (sparse_files entry): `tensor` (the state_dict key, flattened with "." as DCP
saves it: "model.embedding.weight"; default the only 2-D tensor), `key_offset` (0).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps.errors import MissingExtraError, ModelFileError
from hps.modelfiles.formats.arrays import RawArray, row_ranges
from hps.modelfiles.formats.base import (
    INT64_MAX,
    ModelReader,
    ReadOptions,
    check_width,
    rows_as_float32,
)
from hps.modelfiles.formats.safetensors import DTYPES, ROW_DTYPES
from hps.modelfiles.formats.torch_state import read_archive
from hps.modelfiles.source import ModelSource

METADATA = ".metadata"
#: the largest .metadata read (a few hundred bytes per chunk)
MAX_METADATA_BYTES = 256 << 20
#: rows put together from column pieces, handed out at a time (see the module docstring).
#: 1M × 64 float32 rows saved column-wise by 2 ranks, into the hash map over RocksDB: CPU
#: seconds of the load, median of 7, 0.90 in 64 MiB chunks, 0.73 in 4 MiB ones (the
#: row-wise checkpoint: 0.73)
COLUMN_CHUNK_BYTES = 4 << 20
#: the names DCP's metadata pickle uses, and nothing else
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.serialization": ("_get_layout",),
    "torch": ("Size", "strided", "float32", "float16", "bfloat16", "float64", "int64",
              "int32", "int16", "int8", "uint8", "bool"),
    "pathlib": ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"),
}
#: torch dtype name → safetensors dtype name of the rows
_TORCH_ROW_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name not in _METADATA_CLASSES.get(module, ()):
            raise ModelFileError(f"{self.where}: holds a {module}.{name} object, which DCP's "
                                 "metadata does not; hps does not unpickle anything else")
        return super().find_class(module, name)


@dataclass(frozen=True)
class _Piece:
    """One saved chunk of the table: rows [row, row + rows) × columns [col, col + cols)."""

    row: int
    col: int
    rows: int
    cols: int
    array: RawArray


def read_metadata(source: ModelSource) -> Any:
    """DCP's Metadata of the checkpoint folder `source`, unpickled safely (see module)."""
    where = source.describe(METADATA)
    try:
        import torch.distributed.checkpoint.metadata  # noqa: F401 - the classes it builds
    except ImportError:
        raise MissingExtraError("torch", "torch", "reading DCP checkpoints") from None
    size = source.size(METADATA)
    if size > MAX_METADATA_BYTES:
        raise ModelFileError(f"{where}: {size} bytes is not DCP metadata")
    try:
        metadata = _MetadataUnpickler(source.read(METADATA, 0, size), where).load()
    except ModelFileError:
        raise
    except Exception as exc:  # a malformed pickle raises anything at all
        raise ModelFileError(f"{where}: cannot be read as DCP metadata ({exc})") from None
    if type(metadata).__name__ != "Metadata" or not isinstance(
            getattr(metadata, "state_dict_metadata", None), dict):
        raise ModelFileError(f"{where} is not DCP metadata")
    return metadata


class DcpReader(ModelReader):
    """One 2-D tensor of the DCP checkpoint folder `source`."""

    format = "dcp"

    def __init__(self, source: ModelSource, options: ReadOptions, tensor: str | None = None,
                 key_offset: int | None = None) -> None:
        self.source = source
        self.read_options = options
        self.uri = source.uri
        metadata = read_metadata(source)
        self.tensor = self._choose(metadata.state_dict_metadata, tensor)
        entry = metadata.state_dict_metadata[self.tensor]
        self.num_keys, width = (int(d) for d in entry.size)
        self.vec_size = check_width(self.uri, width, options)
        dtype = _TORCH_ROW_DTYPES.get(str(entry.properties.dtype))
        if dtype is None:
            raise ModelFileError(f"{self.uri}: tensor {self.tensor!r} is "
                                 f"{entry.properties.dtype}; rows must be float32, float16 "
                                 "or bfloat16")
        self.dtype = ROW_DTYPES[dtype]
        self.key_dtype = "row index"
        self.key_offset = key_offset or 0
        if self.num_keys and self.key_offset + self.num_keys - 1 > INT64_MAX:
            raise ModelFileError(f"{self.uri}: key_offset {self.key_offset} overflows int64 keys")
        self._pieces = self._open_pieces(metadata, entry, dtype)
        used = sorted({p.array.name for p in self._pieces})
        self.files = [(METADATA, source.size(METADATA))] + [(n, source.size(n)) for n in used]

    def _choose(self, tensors: dict[str, Any], name: str | None) -> str:
        matrices = [k for k, v in tensors.items() if len(getattr(v, "size", ())) == 2]
        if name is None:
            if len(matrices) != 1:
                listing = ", ".join(f"{k} {list(tensors[k].size)}" for k in matrices)
                raise ModelFileError(
                    f"{self.uri}: cannot tell which tensor holds the rows (2-D tensors: "
                    f"{listing or 'none'}): name it with 'tensor' in the sparse_files entry"
                )
            return matrices[0]
        if name not in tensors:
            raise ModelFileError(f"{self.uri} has no tensor {name!r} (tensors: "
                                 f"{', '.join(tensors) or 'none'})")
        if name not in matrices:
            shape = list(getattr(tensors[name], "size", []))
            raise ModelFileError(f"{self.uri}: {name!r} is not a 2-D tensor (shape {shape}); "
                                 "rows must be a 2-D tensor [num_rows, dim]")
        return name

    def _open_pieces(self, metadata: Any, entry: Any, dtype: str) -> list[_Piece]:
        where = {tuple(int(o) for o in index.offset): info
                 for index, info in (metadata.storage_data or {}).items()
                 if index.fqn == self.tensor and index.offset is not None}
        pieces = []
        for chunk in entry.chunks:
            offsets = tuple(int(o) for o in chunk.offsets)
            rows, cols = (int(s) for s in chunk.sizes)
            info = where.get(offsets)
            if info is None:
                raise ModelFileError(f"{self.uri}: the chunk of {self.tensor!r} at {list(offsets)}"
                                     " has no storage entry in .metadata")
            if getattr(info, "transform_descriptors", None):
                raise ModelFileError(f"{self.uri}: the chunk of {self.tensor!r} at "
                                     f"{list(offsets)} is stored transformed "
                                     f"({info.transform_descriptors}); save without it")
            name = str(info.relative_path)
            if "/" in name or name.startswith(".."):
                raise ModelFileError(f"{self.uri}: storage path {name!r} leaves the folder")
            array = self._stored(name, int(info.offset), int(info.length), dtype, (rows, cols))
            pieces.append(_Piece(offsets[0], offsets[1], rows, cols, array))
        self._check_tiling(pieces)
        return sorted(pieces, key=lambda p: (p.row, p.col))

    def _stored(self, name: str, offset: int, length: int, dtype: str,
                shape: tuple[int, int]) -> RawArray:
        """The chunk tensor at bytes [offset, offset + length) of `name`, checked."""
        described = f"{self.source.describe(name)} at byte {offset}"
        item = np.dtype(DTYPES[dtype])
        if length == shape[0] * shape[1] * item.itemsize:
            # saved raw (DCP's safetensors serialization): an archive is always longer
            return RawArray(self.source, name, offset, item, shape)
        tensors = read_archive(self.source, name, offset, length)
        if len(tensors) != 1:
            raise ModelFileError(f"{described}: a chunk holds one tensor, found {len(tensors)}")
        (t,) = tensors.values()
        if t.dtype != dtype or t.shape != shape:
            raise ModelFileError(f"{described}: the chunk is {t.dtype} {list(t.shape)} but "
                                 f".metadata says {dtype} {list(shape)}")
        return RawArray(self.source, name, t.begin, item, shape)

    def _check_tiling(self, pieces: list[_Piece]) -> None:
        """Every cell of the table in exactly one piece (counted on the pieces' grid)."""
        rows = sorted({0, self.num_keys, *(p.row for p in pieces),
                       *(p.row + p.rows for p in pieces)})
        cols = sorted({0, self.vec_size, *(p.col for p in pieces),
                       *(p.col + p.cols for p in pieces)})
        if rows[-1] > self.num_keys or cols[-1] > self.vec_size or rows[0] < 0 or cols[0] < 0:
            raise ModelFileError(f"{self.uri}: a chunk of {self.tensor!r} lies outside its "
                                 f"[{self.num_keys}, {self.vec_size}]")
        count = np.zeros((len(rows) - 1, len(cols) - 1), np.int64)
        for p in pieces:
            r0, r1 = rows.index(p.row), rows.index(p.row + p.rows)
            c0, c1 = cols.index(p.col), cols.index(p.col + p.cols)
            count[r0:r1, c0:c1] += 1
        empty = [(r, c) for r in range(len(rows) - 1) for c in range(len(cols) - 1)
                 if rows[r] != rows[r + 1] and cols[c] != cols[c + 1]]
        if any(count[r, c] != 1 for r, c in empty):
            raise ModelFileError(f"{self.uri}: the chunks of {self.tensor!r} leave holes or "
                                 "overlap (an incomplete checkpoint?)")

    def settings(self) -> dict[str, object]:
        return {"tensor": self.tensor, "key_offset": self.key_offset}

    def _read_chunks(self, chunk_keys: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if any(p.cols != self.vec_size for p in self._pieces):
            chunk_keys = min(chunk_keys, max(1, COLUMN_CHUNK_BYTES // (4 * self.vec_size)))
        for start, stop in row_ranges(self.num_keys, chunk_keys):
            keys = np.arange(start + self.key_offset, stop + self.key_offset, dtype=np.int64)
            yield keys, self._rows(start, stop)

    def _rows(self, start: int, stop: int) -> np.ndarray:
        crossing = [p for p in self._pieces if p.row < stop and start < p.row + p.rows]
        if len(crossing) == 1 and crossing[0].cols == self.vec_size:
            p = crossing[0]  # a row-wise shard holds the whole range: no copy
            return rows_as_float32(p.array.rows(start - p.row, stop - p.row), self.dtype)
        out = np.empty((stop - start, self.vec_size), np.float32)
        for p in crossing:
            first, last = max(start, p.row), min(stop, p.row + p.rows)
            out[first - start:last - start, p.col:p.col + p.cols] = rows_as_float32(
                p.array.rows(first - p.row, last - p.row), self.dtype)
        return out
