"""NumPy model files: a folder with `keys.npy` + `vectors.npy`, or one `.npz` holding both.

    keys.npy      1-D integers (int64, int32, uint32, uint64 up to 2**63 - 1)
    vectors.npy   2-D float32 or float16 [num_keys, dim], C order (float16 widened)

`np.save(f"{folder}/keys.npy", keys); np.save(f"{folder}/vectors.npy", vectors)`, or
`np.savez(path, keys=keys, vectors=vectors)` (`savez_compressed` works too), write them.
Headers are parsed with NumPy's own `.npy` header reader (a literal, never a pickle).
Local `.npy` files, and `.npz` members stored without compression, are memory-mapped;
remote ones are read with ranged reads. A compressed `.npz` member is inflated as a
stream, a chunk at a time. Refused with a ModelFileError naming the file: object dtype
(a pickle), Fortran order, other dtypes or ranks, keys and vectors of different lengths,
a data size that disagrees with the header.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Protocol

import numpy as np

from hps.errors import ModelFileError, SourceError
from hps.modelfiles.formats.arrays import RawArray, row_ranges
from hps.modelfiles.formats.base import (
    FolderWriter,
    ModelReader,
    ModelWriter,
    ReadOptions,
    check_width,
    keys_as_int64,
    rows_as_float32,
)
from hps.modelfiles.source import ModelSource
from hps.modelfiles.source_file import SourceFile

KEYS_NPY = "keys.npy"
VECTORS_NPY = "vectors.npy"
#: the largest .npy header read (NumPy's own default limit)
MAX_HEADER_BYTES = 10_000
_ZIP_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, …, name length, extra length


@dataclass(frozen=True)
class NpyHeader:
    """What a `.npy` header says: dtype, shape, order, and the header's length."""

    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    header_bytes: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def read_npy_header(fp: IO[bytes], where: str) -> NpyHeader:
    """Parse the `.npy` header at the file position; ModelFileError when it is not one."""
    start = fp.tell()
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(
                fp, max_header_size=MAX_HEADER_BYTES
            )
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(
                fp, max_header_size=MAX_HEADER_BYTES
            )
        else:
            raise ValueError(f".npy format version {version} is not supported (1.0, 2.0 are)")
    except (ValueError, SyntaxError, EOFError) as exc:
        raise ModelFileError(f"{where}: not a readable .npy array ({exc})") from None
    return NpyHeader(np.dtype(dtype), tuple(shape), bool(fortran), fp.tell() - start)


def check_arrays(keys: NpyHeader, rows: NpyHeader, where: str, options: ReadOptions) -> int:
    """Validate the two arrays' dtypes, ranks, order and lengths; returns the width."""
    for label, header in ((KEYS_NPY, keys), (VECTORS_NPY, rows)):
        if header.dtype.hasobject:
            raise ModelFileError(
                f"{where}/{label}: object dtype (pickled Python objects); hps never unpickles: "
                "save a numeric array"
            )
        if header.fortran_order and len(header.shape) > 1:
            raise ModelFileError(
                f"{where}/{label}: stored in Fortran order; save np.ascontiguousarray(a)"
            )
    if keys.dtype.kind not in "iu" or len(keys.shape) != 1:
        raise ModelFileError(
            f"{where}/{KEYS_NPY}: keys must be a 1-D integer array, got {keys.dtype} "
            f"of shape {list(keys.shape)}"
        )
    if len(rows.shape) != 2:
        raise ModelFileError(
            f"{where}/{VECTORS_NPY}: vectors must be a 2-D array [num_keys, dim], got shape "
            f"{list(rows.shape)} ({len(rows.shape)}-D)"
        )
    if rows.dtype.kind != "f" or rows.dtype.itemsize not in (2, 4):
        hint = ": save vectors.astype(np.float32)" if rows.dtype.kind == "f" else ""
        raise ModelFileError(
            f"{where}/{VECTORS_NPY}: vectors must be float32 or float16, got {rows.dtype}{hint}"
        )
    if keys.shape[0] != rows.shape[0]:
        raise ModelFileError(
            f"{where}: {KEYS_NPY} holds {keys.shape[0]} keys but {VECTORS_NPY} holds "
            f"{rows.shape[0]} rows: one per key expected"
        )
    return check_width(where, rows.shape[1], options)


class _Rows(Protocol):
    def rows(self, start: int, stop: int) -> np.ndarray: ...


class StreamedArray:
    """An array read front to back from a stream (a compressed `.npz` member)."""

    def __init__(self, stream: IO[bytes], header: NpyHeader, where: str) -> None:
        self.stream = stream
        self.header = header
        self.where = where
        self.row_bytes = int(np.prod(header.shape[1:], dtype=np.int64)) * header.dtype.itemsize
        self._next = 0

    def rows(self, start: int, stop: int) -> np.ndarray:
        if start != self._next:
            raise ModelFileError(f"{self.where}: a compressed member is read in order only")
        want = (stop - start) * self.row_bytes
        try:
            data = self.stream.read(want)
        except (zipfile.BadZipFile, EOFError, ValueError) as exc:
            raise ModelFileError(f"{self.where}: corrupt compressed data ({exc})") from None
        if len(data) != want:
            raise ModelFileError(f"{self.where}: data ends early (truncated file)")
        self._next = stop
        shape = (stop - start, *self.header.shape[1:])
        return np.frombuffer(data, self.header.dtype).reshape(shape)


class NumpyReader(ModelReader):
    """A `keys.npy` + `vectors.npy` folder (`name=None`) or one `.npz` file `name`."""

    format = "numpy"

    def __init__(self, source: ModelSource, name: str | None, options: ReadOptions) -> None:
        self.source = source
        self.read_options = options
        self._zip: zipfile.ZipFile | None = None
        if name is None:
            self.uri = source.uri
            keys, rows = self._open_folder()
        else:
            self.uri = source.describe(name)
            keys, rows = self._open_npz(name)
        self._key_array, self._row_array = keys, rows

    def _open_folder(self) -> tuple[_Rows, _Rows]:
        sizes, headers = [], []
        for label in (KEYS_NPY, VECTORS_NPY):
            sizes.append(self.source.size(label))
            with io.BufferedReader(SourceFile(self.source, label, sizes[-1]), 4096) as fp:
                headers.append(read_npy_header(fp, self.source.describe(label)))
        self._describe(headers[0], headers[1])  # dtypes first: an object array's size lies
        self.files = [(KEYS_NPY, sizes[0]), (VECTORS_NPY, sizes[1])]
        arrays = []
        for (label, size), header in zip(self.files, headers, strict=True):
            if size != header.header_bytes + header.nbytes:
                raise ModelFileError(
                    f"{self.source.describe(label)} is {size} bytes but its header says "
                    f"{header.header_bytes} + {header.nbytes} (shape {list(header.shape)}, "
                    f"{header.dtype}): the file is truncated or has trailing bytes"
                )
            arrays.append(
                RawArray(self.source, label, header.header_bytes, header.dtype, header.shape)
            )
        return arrays[0], arrays[1]

    def _open_npz(self, name: str) -> tuple[_Rows, _Rows]:
        size = self.source.size(name)
        self.files = [(name, size)]
        fp = io.BufferedReader(SourceFile(self.source, name, size), 1 << 16)
        try:
            self._zip = zipfile.ZipFile(fp)
            members = {info.filename: info for info in self._zip.infolist()}
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            if isinstance(exc, SourceError):
                raise
            raise ModelFileError(f"{self.uri}: not a readable .npz (zip) file ({exc})") from None
        missing = [m for m in (KEYS_NPY, VECTORS_NPY) if m not in members]
        if missing:
            raise ModelFileError(
                f"{self.uri} has no {' or '.join(m[:-4] for m in missing)} array (arrays: "
                f"{', '.join(sorted(n.removesuffix('.npy') for n in members)) or 'none'}): "
                "save it with np.savez(path, keys=keys, vectors=vectors)"
            )
        streams, headers = [], []
        for label in (KEYS_NPY, VECTORS_NPY):
            where = f"{self.uri}[{label}]"
            try:
                streams.append(self._zip.open(members[label]))
            except (zipfile.BadZipFile, NotImplementedError, OSError) as exc:
                if isinstance(exc, SourceError):
                    raise
                raise ModelFileError(f"{where}: cannot open the member ({exc})") from None
            headers.append(read_npy_header(streams[-1], where))
        self._describe(headers[0], headers[1])  # dtypes first: an object array's size lies
        out: list[_Rows] = []
        for label, stream, header in zip((KEYS_NPY, VECTORS_NPY), streams, headers, strict=True):
            info, where = members[label], f"{self.uri}[{label}]"
            if info.file_size != header.header_bytes + header.nbytes:
                raise ModelFileError(
                    f"{where} is {info.file_size} bytes but its header says "
                    f"{header.header_bytes} + {header.nbytes}: the member is damaged"
                )
            if info.compress_type == zipfile.ZIP_STORED:
                stream.close()
                start = self._stored_data_offset(fp, info, where) + header.header_bytes
                if start + header.nbytes > size:
                    raise ModelFileError(f"{where}: data lies past the end of the file (truncated)")
                out.append(RawArray(self.source, name, start, header.dtype, header.shape))
            else:
                out.append(StreamedArray(stream, header, where))
        return out[0], out[1]

    @staticmethod
    def _stored_data_offset(fp: IO[bytes], info: zipfile.ZipInfo, where: str) -> int:
        """Where an uncompressed member's bytes start: after its local file header."""
        fp.seek(info.header_offset)
        raw = fp.read(_ZIP_LOCAL_HEADER.size)
        if len(raw) != _ZIP_LOCAL_HEADER.size:
            raise ModelFileError(f"{where}: local zip header cut short (truncated file)")
        signature, name_len, extra_len = _ZIP_LOCAL_HEADER.unpack(raw)
        if signature != b"PK\x03\x04":
            raise ModelFileError(f"{where}: bad local zip header (corrupt file)")
        return int(info.header_offset + _ZIP_LOCAL_HEADER.size + name_len + extra_len)

    def _describe(self, keys: NpyHeader, rows: NpyHeader) -> None:
        self.vec_size = check_arrays(keys, rows, self.uri, self.read_options)
        self.num_keys = keys.shape[0]
        self.key_dtype = keys.dtype.name
        self.dtype = rows.dtype.name

    def _read_chunks(self, chunk_keys: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start, stop in row_ranges(self.num_keys, chunk_keys):
            keys = keys_as_int64(self.uri, self._key_array.rows(start, stop), start)
            yield keys, rows_as_float32(self._row_array.rows(start, stop), self.dtype)

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
        super().close()


def _npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_2_0(
        out, {"descr": dtype, "fortran_order": False, "shape": shape}
    )
    return out.getvalue()


class NumpyFolderWriter(FolderWriter):
    """Writes `keys.npy` (int64) + `vectors.npy` (float32) into a folder, chunk by chunk."""

    format = "numpy"
    key_file = KEYS_NPY
    row_file = VECTORS_NPY

    def headers(self) -> tuple[bytes, bytes]:
        return _npy_header("<i8", (self.num_keys,)), _npy_header(
            "<f4", (self.num_keys, self.vec_size)
        )


class NpzWriter(ModelWriter):
    """Writes one uncompressed `.npz` (keys, vectors); keys wait in a spill file meanwhile.

    A zip member is written front to back, so the vectors stream straight into theirs
    and the keys (8 bytes a row) are spilled beside it and copied in at the end.
    """

    format = "numpy"

    def __init__(self, path: str, num_keys: int, vec_size: int) -> None:
        super().__init__(path, num_keys, vec_size)
        self._zip = zipfile.ZipFile(self.tmp, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._rows = self._zip.open(VECTORS_NPY, "w", force_zip64=True)
        self._rows.write(_npy_header("<f4", (num_keys, vec_size)))
        self._spill = open(f"{self.tmp}.keys", "w+b")

    def _write(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self._spill.write(keys.astype("<i8", copy=False).tobytes())
        self._rows.write(rows.astype("<f4", copy=False).tobytes())

    def _finish(self) -> None:
        self._rows.close()
        with self._zip.open(KEYS_NPY, "w", force_zip64=True) as member:
            member.write(_npy_header("<i8", (self.num_keys,)))
            self._spill.seek(0)
            while block := self._spill.read(16 << 20):
                member.write(block)
        self._release()

    def _release(self) -> None:
        if not self._rows.closed:
            self._rows.close()
        self._zip.close()
        self._spill.close()
        if os.path.exists(self._spill.name):
            os.remove(self._spill.name)
