"""HugeCTR sparse model folders: validation, a chunked reader and a writer.

One folder holds one table:
  key         raw little-endian int64, 8 bytes per key, no header
  emb_vector  raw little-endian float32 rows, num_keys × vec_size, same row order
  slot_id     optional uint64 per key (ignored, as HugeCTR ignored it)

The files carry no width, so the width comes from the config (or is inferred by
`inspect`). A reader never holds more than one chunk of a file in memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hps.errors import ModelFileError, SourceNotFoundError
from hps.modelfiles.formats.arrays import RawArray, row_ranges
from hps.modelfiles.formats.base import DEFAULT_CHUNK_BYTES, FolderWriter, ModelReader, ReadOptions
from hps.modelfiles.source import ModelSource, SourceOptions

KEY_FILE = "key"
VECTOR_FILE = "emb_vector"
KEY_BYTES = 8
FLOAT_BYTES = 4


@dataclass(frozen=True)
class SparseModelInfo:
    """What a sparse model folder holds, read from file sizes alone."""

    uri: str
    num_keys: int
    vec_size: int
    key_bytes: int
    vector_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.key_bytes + self.vector_bytes


def _sizes(source: ModelSource) -> tuple[int, int]:
    sizes = []
    for name in (KEY_FILE, VECTOR_FILE):
        try:
            sizes.append(source.size(name))
        except SourceNotFoundError as exc:
            raise ModelFileError(
                f"sparse model {source.uri!r} has no '{name}' file ({exc})"
            ) from exc
    return sizes[0], sizes[1]


def read_info(source: ModelSource, vec_size: int | None = None) -> SparseModelInfo:
    """Validate a folder's file sizes against each other and against `vec_size`.

    With `vec_size=None` the width is inferred from the sizes. Raises ModelFileError
    naming both numbers when they disagree.
    """
    key_bytes, vector_bytes = _sizes(source)
    if key_bytes % KEY_BYTES:
        raise ModelFileError(
            f"{source.describe(KEY_FILE)} is {key_bytes} bytes, not a multiple of "
            f"{KEY_BYTES} (int64 keys): the file is truncated or not a key file"
        )
    if vector_bytes % FLOAT_BYTES:
        raise ModelFileError(
            f"{source.describe(VECTOR_FILE)} is {vector_bytes} bytes, not a multiple of "
            f"{FLOAT_BYTES} (float32 values): the file is truncated"
        )
    num_keys = key_bytes // KEY_BYTES
    if num_keys == 0 and vector_bytes:
        raise ModelFileError(
            f"{source.describe(KEY_FILE)} is empty (0 bytes) but "
            f"{source.describe(VECTOR_FILE)} holds {vector_bytes} bytes: the key file is "
            "truncated, or was not written")
    if vec_size is None:
        if num_keys == 0:
            raise ModelFileError(f"{source.uri}: empty key file, cannot infer the width")
        if (vector_bytes // FLOAT_BYTES) % num_keys:
            raise ModelFileError(
                f"{source.uri}: {vector_bytes // FLOAT_BYTES} floats in emb_vector do not "
                f"divide into {num_keys} keys: one of the files is truncated"
            )
        vec_size = vector_bytes // FLOAT_BYTES // num_keys
    if vec_size <= 0:
        raise ModelFileError(f"{source.uri}: vector width must be positive, got {vec_size}")
    expected = num_keys * vec_size * FLOAT_BYTES
    if vector_bytes != expected:  # num_keys > 0 here: no keys and no rows is a table
        raise ModelFileError(
            f"{source.describe(VECTOR_FILE)} is {vector_bytes} bytes but {num_keys} keys × "
            f"width {vec_size} × 4 bytes = {expected} bytes (the file holds "
            f"{vector_bytes / (num_keys * FLOAT_BYTES):g} floats per key): wrong "
            "embedding_vecsize_per_table, or a truncated file"
        )
    return SparseModelInfo(source.uri, num_keys, vec_size, key_bytes, vector_bytes)


class SparseModelReader(ModelReader):
    """Reads one table's folder in chunks of `(keys int64[n], vectors float32[n, dim])`."""

    format = "sparse_folder"

    def __init__(
        self,
        source: ModelSource | str,
        vec_size: int | None = None,
        *,
        options: SourceOptions | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        uint32_keys: bool = False,
    ) -> None:
        from hps.modelfiles.uri import open_source

        self.source = open_source(source, options) if isinstance(source, str) else source
        self.uri = self.source.uri
        self.info = read_info(self.source, vec_size)
        self.read_options = ReadOptions(self.info.vec_size, uint32_keys, chunk_bytes)
        self.num_keys = self.info.num_keys
        self.vec_size = self.info.vec_size
        self.dtype = "float32"
        self.key_dtype = "int64"
        self.files = [(KEY_FILE, self.info.key_bytes), (VECTOR_FILE, self.info.vector_bytes)]
        self._keys = RawArray(self.source, KEY_FILE, 0, np.dtype("<i8"), (self.num_keys,))
        self._rows = RawArray(
            self.source, VECTOR_FILE, 0, np.dtype("<f4"), (self.num_keys, self.vec_size)
        )

    def read_keys(self, start: int, stop: int) -> np.ndarray:
        """Keys of rows [start, stop) as int64."""
        return self._keys.rows(start, stop).astype(np.int64, copy=False)

    def read_vectors(self, start: int, stop: int) -> np.ndarray:
        """Vectors of rows [start, stop) as float32[stop - start, dim]."""
        return self._rows.rows(start, stop).astype(np.float32, copy=False)

    def chunk_bounds(self, chunk_keys: int | None = None) -> Iterator[tuple[int, int]]:
        return row_ranges(self.num_keys, chunk_keys or self.chunk_keys)

    def _read_chunks(self, chunk_keys: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start, stop in self.chunk_bounds(chunk_keys):
            yield self.read_keys(start, stop), self.read_vectors(start, stop)


def write_sparse_model(path: str | os.PathLike[str], keys: np.ndarray, vectors: np.ndarray) -> None:
    """Write a HugeCTR sparse model folder (`key`, `emb_vector`) at `path`."""
    keys = np.asarray(keys)
    vectors = np.asarray(vectors)
    if vectors.ndim != 2 or vectors.shape[0] != keys.size:
        raise ModelFileError(
            f"vectors must be [num_keys, dim] = [{keys.size}, dim], got {vectors.shape}"
        )
    os.makedirs(path, exist_ok=True)
    keys.astype("<i8", copy=False).reshape(-1).tofile(os.path.join(path, KEY_FILE))
    np.ascontiguousarray(vectors, dtype="<f4").tofile(os.path.join(path, VECTOR_FILE))


class SparseFolderWriter(FolderWriter):
    """Writes a HugeCTR sparse model folder chunk by chunk (`hps convert … DST`)."""

    format = "sparse_folder"
    key_file = KEY_FILE
    row_file = VECTOR_FILE
