"""The ModelReader contract: one embedding table in some file format, read in chunks.

Every format (HugeCTR sparse folders, Parquet, NumPy, safetensors) is read through this
one contract; the loader, `hps convert` and `hps inspect` see nothing else:

    reader.num_keys, reader.vec_size      rows and width, known when the reader opens
    reader.dtype, reader.key_dtype        element types as stored (rows are always
                                          served as float32, keys as int64)
    reader.files                          (name, bytes) of each file read, in its source
    reader.chunks(chunk_keys=None)        (keys int64[n], rows float32[n, vec_size]) in
                                          file order, a chunk at a time

Opening a reader validates everything that can be known without reading the rows (files
present, sizes, headers, column types, width against the config), so a bad model fails
before anything is written. What only the rows can show (a key out of range, a corrupt
page) fails in `chunks`, naming the file; the loader then drops what it wrote.

A reader never holds more than a chunk (a row group for Parquet) of a table in memory.
Writers (`ModelWriter`) are the streaming opposite, used by `hps convert`: they write
to a temporary name and move it into place on `close`, so a failed conversion leaves no
half-written model behind.
"""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar

import numpy as np

from hps.errors import ModelFileError
from hps.modelfiles.source import Closing, ModelSource

#: bytes of rows read per chunk; a load holds a few chunks at most
DEFAULT_CHUNK_BYTES = 64 << 20

#: with `supportlonglong: false` keys are uint32 (HugeCTR's ps.json)
UINT32_KEY_LIMIT = 2**32
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class ReadOptions:
    """How a table is read, whatever its format.

    vec_size     the width the config expects (embedding_vecsize_per_table); None takes
                 the file's own width (`hps inspect`, `hps convert`)
    uint32_keys  `supportlonglong: false`: every key must lie in [0, 2**32)
    chunk_bytes  rows per chunk = chunk_bytes // bytes of one stored row
    """

    vec_size: int | None = None
    uint32_keys: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        if self.vec_size is not None and self.vec_size <= 0:
            raise ModelFileError(f"vector width must be positive, got {self.vec_size}")
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")


class ModelReader(Closing, ABC):
    """One table of keys and rows in one format; see the module docstring.

    Subclasses set `uri`, `source`, `num_keys`, `vec_size`, `dtype`, `key_dtype` and
    `files` when they open, and implement `_read_chunks`.
    """

    #: the format's name, as written in a sparse_files entry
    format: ClassVar[str]

    uri: str
    source: ModelSource
    num_keys: int
    vec_size: int
    dtype: str
    key_dtype: str
    #: (name in `source`, size in bytes) of every file the table is read from
    files: list[tuple[str, int]]
    read_options: ReadOptions

    @property
    def num_bytes(self) -> int:
        """Bytes of all files read (what a progress bar counts)."""
        return sum(size for _, size in self.files)

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row (its key not counted)."""
        return self.vec_size * np.dtype(STORED_ITEMSIZE.get(self.dtype, "f4")).itemsize

    @property
    def chunk_keys(self) -> int:
        """Rows per chunk when `chunks` is called without a size."""
        return max(1, self.read_options.chunk_bytes // self.row_bytes)

    def settings(self) -> dict[str, object]:
        """The format options this reader was opened with (part of its fingerprint)."""
        return {}

    @abstractmethod
    def _read_chunks(self, chunk_keys: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(keys int64[n], rows float32[n, vec_size]) of about `chunk_keys` rows each."""

    def chunks(self, chunk_keys: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The whole table in file order, `chunk_keys` rows at a time (the last fewer).

        Raises ModelFileError naming the file when a chunk cannot be read or holds a key
        out of range (negative or >= 2**32 under `uint32_keys`).
        """
        step = chunk_keys or self.chunk_keys
        seen = 0
        for keys, rows in self._read_chunks(step):
            if self.read_options.uint32_keys:
                check_uint32_keys(self.uri, keys, seen)
            seen += len(keys)
            yield keys, rows
        if seen != self.num_keys:
            raise ModelFileError(
                f"{self.uri}: read {seen} rows but the file says it holds {self.num_keys} "
                "(changed while loading?)"
            )

    def fingerprint(self) -> str:
        """Identity of the files' contents as far as cheaply known; '' when unknown.

        Local files: format, options, sizes and modification times. Remote files: ''
        (they are always re-read), because a size alone cannot tell two uploads apart.
        """
        from hps.modelfiles.uri import LocalSource

        if not isinstance(self.source, LocalSource):
            return ""
        parts = [self.format, self.uri, repr(sorted(self.settings().items()))]
        for name, size in self.files:
            mtime = os.stat(os.path.join(self.source.path, name)).st_mtime_ns
            parts += [name, str(size), str(mtime)]
        return "|".join(parts)

    def close(self) -> None:
        """Release the source's connections."""
        self.source.close()


#: NumPy dtype of each stored row type (bfloat16 is read as its raw 16 bits)
STORED_ITEMSIZE = {"float32": "f4", "float16": "f2", "bfloat16": "u2"}


def check_width(uri: str, found: int, options: ReadOptions) -> int:
    """`found` if it is a usable width that matches the config's, else ModelFileError."""
    if found <= 0:
        raise ModelFileError(f"{uri}: vector width must be positive, got {found}")
    if options.vec_size is not None and found != options.vec_size:
        raise ModelFileError(
            f"{uri}: rows are {found} wide but embedding_vecsize_per_table says "
            f"{options.vec_size}"
        )
    return found


def check_uint32_keys(uri: str, keys: np.ndarray, first_row: int) -> None:
    """ModelFileError naming the first key outside [0, 2**32) (supportlonglong: false)."""
    if keys.size == 0:
        return
    bad = (keys < 0) | (keys >= UINT32_KEY_LIMIT)
    if bad.any():
        at = int(np.argmax(bad))
        raise ModelFileError(
            f"{uri}: key {int(keys[at])} at row {first_row + at} is out of range for "
            "supportlonglong: false (keys must lie in [0, 2**32)); set supportlonglong: "
            "true for 64-bit keys"
        )


def keys_as_int64(uri: str, keys: np.ndarray, first_row: int) -> np.ndarray:
    """Integer keys of any width as int64; uint64 keys above 2**63 - 1 are refused."""
    if keys.dtype.kind == "u" and keys.dtype.itemsize == 8 and keys.size:
        big = keys > INT64_MAX
        if big.any():
            at = int(np.argmax(big))
            raise ModelFileError(
                f"{uri}: uint64 key {int(keys[at])} at row {first_row + at} does not fit "
                "the int64 keys hps serves"
            )
    return keys.astype(np.int64, copy=False)


def rows_as_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored rows (float32, float16, or bfloat16 as uint16 bits) as float32 (exact)."""
    if dtype == "bfloat16":
        # bfloat16 is the top half of a float32: shift the bits back into place
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False)


class ModelWriter(Closing, ABC):
    """Writes one table, chunk by chunk, in one format (for `hps convert`).

    `num_keys` and `vec_size` are known up front (formats with headers need them). Files
    go to a temporary path beside `path`, moved into place by `close()`; `abort()` (or
    leaving a `with` block by an exception) removes them.
    """

    format: ClassVar[str]

    def __init__(self, path: str, num_keys: int, vec_size: int) -> None:
        if "://" in path and not path.startswith("file://"):
            raise ModelFileError(
                f"{path}: hps convert writes local files only; upload the result afterwards"
            )
        self.path = path.removeprefix("file://")
        self.tmp = f"{self.path}.partial"
        self.num_keys = num_keys
        self.vec_size = vec_size
        self.written = 0
        remove_path(self.tmp)

    @abstractmethod
    def _write(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Append `keys` (int64[n]) and `rows` (float32[n, vec_size]) to the files."""

    @abstractmethod
    def _finish(self) -> None:
        """Complete the files at `self.tmp` (footers, headers)."""

    def write(self, keys: np.ndarray, rows: np.ndarray) -> None:
        if rows.shape != (len(keys), self.vec_size) or self.written + len(keys) > self.num_keys:
            raise ModelFileError(
                f"{self.path}: chunk of {len(keys)} keys and rows {rows.shape} does not fit "
                f"a table of {self.num_keys} rows of width {self.vec_size}"
            )
        self._write(
            np.ascontiguousarray(keys, dtype=np.int64),
            np.ascontiguousarray(rows, dtype=np.float32),
        )
        self.written += len(keys)

    def close(self) -> None:
        if self.written != self.num_keys:
            self.abort()
            raise ModelFileError(
                f"{self.path}: {self.written} rows written of {self.num_keys} announced"
            )
        self._finish()
        remove_path(self.path)
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self._release()
        remove_path(self.tmp)

    def _release(self) -> None:  # noqa: B027 - optional hook: writers holding files close them
        """Close open files (before an abort removes them)."""

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Leaving a `with` block completes the files, or removes them on an exception."""
        if exc is None:
            self.close()
        else:
            self.abort()


class FolderWriter(ModelWriter):
    """A writer of two raw files in a folder: keys as <i8, rows as <f4, each after an
    optional header (`headers()`); subclasses name the files."""

    key_file: ClassVar[str]
    row_file: ClassVar[str]

    def __init__(self, path: str, num_keys: int, vec_size: int) -> None:
        super().__init__(path, num_keys, vec_size)
        os.makedirs(self.tmp)
        self._keys = open(os.path.join(self.tmp, self.key_file), "wb")
        self._rows = open(os.path.join(self.tmp, self.row_file), "wb")
        key_header, row_header = self.headers()
        self._keys.write(key_header)
        self._rows.write(row_header)

    def headers(self) -> tuple[bytes, bytes]:
        """Bytes written before the keys and before the rows (none by default)."""
        return b"", b""

    def _write(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self._keys.write(keys.astype("<i8", copy=False).tobytes())
        self._rows.write(rows.astype("<f4", copy=False).tobytes())

    def _finish(self) -> None:
        self._release()

    def _release(self) -> None:
        self._keys.close()
        self._rows.close()


def remove_path(path: str) -> None:
    """Remove a file or a folder, if there is one."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
