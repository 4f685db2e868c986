"""Parquet model files: one file, or a folder/prefix of part files, of (key, vector) rows.

    key      int64, uint64 (up to 2**63 - 1), int32 or uint32
    vector   list<float>, large_list<float> or fixed_size_list<float>[dim], with float32
             or float16 elements (float16 widened to float32); every list `dim` long

What Spark (`df.write.parquet`), pandas (`df.to_parquet`) and pyarrow write. The column
names default to `key` and `vector` (`key_column`, `vector_column` in the sparse_files
entry). A folder is read as every `*.parquet` file in it, in name order (Spark's
`_SUCCESS` and `.crc` files are ignored); all parts must share the two columns' types.

Read with pyarrow (the `parquet` extra) by row group, through the URI layer: a remote
file's footer and row groups come by ranged reads, never the whole file at once. The
footers are checked when the reader opens (columns present, their types, the width);
a corrupt page, a null, or a list of the wrong length fails while reading, naming the
file and the row.

A file's vector column is read straight from its pages where it can be
(`parquet_pages`: pyarrow rebuilding the lists cost more than the rest of a load); a row
group that path does not read, or finds anything wrong with, is read by pyarrow, so
what loads and what errors say do not depend on which path read it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from hps.errors import HPSError, MissingExtraError, ModelFileError, SourceError
from hps.modelfiles.formats.base import (
    ModelReader,
    ModelWriter,
    ReadOptions,
    check_width,
    keys_as_int64,
    rows_as_float32,
)
from hps.modelfiles.formats.parquet_pages import ColumnRows, FileRead, NotDirect, vector_leaf
from hps.modelfiles.source import ModelSource
from hps.modelfiles.source_file import SourceFile

log = logging.getLogger("hps.modelfiles.parquet")

DEFAULT_KEY_COLUMN = "key"
DEFAULT_VECTOR_COLUMN = "vector"
PART_SUFFIXES = (".parquet", ".pq")

#: bytes of decoded (float32) rows in a chunk when the caller names no size. A mapped
#: format's chunk is a view of the page cache; a Parquet chunk is decoded into memory of
#: pyarrow's pool, which reuses what the chunks before it freed. A load holds about four
#: chunks (the one written, one queued, one decoded, the one freed), so with chunks of
#: 64 MiB a table of a million 64-wide rows was all fresh memory (zeroed by the kernel
#: first, more CPU than decoding it); chunks of 8 MiB are fresh only for the first few.
DECODED_CHUNK_BYTES = 8 << 20


def import_pyarrow() -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet), or MissingExtraError naming the 'parquet' extra."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise MissingExtraError("pyarrow", "parquet", "reading Parquet model files") from None
    return pyarrow, pyarrow.parquet


def part_names(names: list[str]) -> list[str]:
    """The Parquet part files among a folder's file names, in name order."""
    return sorted(
        n for n in names if n.lower().endswith(PART_SUFFIXES) and not n.startswith(("_", "."))
    )


class ParquetReader(ModelReader):
    """Parquet file(s) `names` of `source`; `folder=True` when they are a folder's parts."""

    format = "parquet"

    def __init__(
        self,
        source: ModelSource,
        names: list[str],
        options: ReadOptions,
        *,
        folder: bool,
        key_column: str | None = None,
        vector_column: str | None = None,
    ) -> None:
        self._pa, self._pq = import_pyarrow()
        self.source = source
        self.read_options = options
        self.uri = source.uri if folder else source.describe(names[0])
        if not names:
            raise ModelFileError(f"{source.uri}: no *.parquet part files in the folder")
        self.key_column = key_column or DEFAULT_KEY_COLUMN
        self.vector_column = vector_column or DEFAULT_VECTOR_COLUMN
        self.files = []
        self._parts: list[tuple[str, Any]] = []
        types: tuple[Any, Any] | None = None
        for name in names:
            size = source.size(name)
            self.files.append((name, size))
            part = self._open(name, size)
            part_types = self._check_schema(name, part.schema_arrow)
            if types is not None and part_types != types:
                raise ModelFileError(
                    f"{source.describe(name)}: columns are {part_types[0]}, {part_types[1]} "
                    f"but {source.describe(names[0])} has {types[0]}, {types[1]}: the parts "
                    "of one table must agree"
                )
            types = part_types
            self._parts.append((name, part))
        assert types is not None
        key_type, vector_type = types
        self.key_dtype = str(key_type)
        self.dtype = "float16" if vector_type.value_type == self._pa.float16() else "float32"
        self.num_keys = sum(part.metadata.num_rows for _, part in self._parts)
        if self._pa.types.is_fixed_size_list(vector_type):
            width = vector_type.list_size
        else:
            width = options.vec_size or self._probe_width()
        self.vec_size = check_width(self.uri, width, options)
        #: rows whose vectors the direct page path read (the rest: pyarrow)
        self.direct_rows = 0
        self._codecs: dict[str, Any] = {}

    def _open(self, name: str, size: int) -> Any:
        from hps.modelfiles.uri import LocalSource

        where = self.source.describe(name)
        try:
            # pages written with a CRC are checked: a flipped bit fails instead of loading
            if isinstance(self.source, LocalSource):
                path = os.path.join(self.source.path, name)
                return self._pq.ParquetFile(path, page_checksum_verification=True)
            return self._pq.ParquetFile(
                SourceFile(self.source, name, size), page_checksum_verification=True
            )
        except SourceError:
            raise
        except (self._pa.ArrowException, OSError) as exc:
            raise ModelFileError(f"{where}: not a readable Parquet file ({exc})") from None

    def _check_schema(self, name: str, schema: Any) -> tuple[Any, Any]:
        """(key type, vector type) of a part, or ModelFileError naming what is wrong."""
        pa, where = self._pa, self.source.describe(name)
        columns = ", ".join(schema.names)
        found = []
        for option, column in (("key_column", self.key_column),
                               ("vector_column", self.vector_column)):
            if schema.get_field_index(column) < 0:
                raise ModelFileError(
                    f"{where} has no column {column!r} (columns: {columns}): name it with "
                    f"'{option}' in the sparse_files entry"
                )
            found.append(schema.field(column).type)
        key_type, vector_type = found
        if not (pa.types.is_integer(key_type) and key_type.bit_width in (32, 64)):
            raise ModelFileError(
                f"{where}: key column {self.key_column!r} is {key_type}; keys must be int64, "
                "uint64, int32 or uint32"
            )
        is_list = (pa.types.is_list(vector_type) or pa.types.is_large_list(vector_type)
                   or pa.types.is_fixed_size_list(vector_type))
        if not is_list or vector_type.value_type not in (pa.float32(), pa.float16()):
            hint = ""
            if is_list and vector_type.value_type == pa.float64():
                hint = ": cast the column to float32"
            raise ModelFileError(
                f"{where}: vector column {self.vector_column!r} is {vector_type}; expected "
                f"list<float>, fixed_size_list<float>[dim] or float16 elements{hint}"
            )
        return key_type, vector_type

    def _probe_width(self) -> int:
        """The length of the first list (list<float> columns carry no width of their own)."""
        for name, part in self._parts:
            if part.metadata.num_rows:
                with self._reading(name):
                    batch = next(part.iter_batches(batch_size=1, columns=[self.vector_column]))
                    first = batch.column(0)[0]
                if not first.is_valid:
                    raise ModelFileError(f"{self.source.describe(name)}: row 0 has a null vector")
                return len(first)
        raise ModelFileError(f"{self.uri}: no rows, so no width to infer: pass the width")

    @property
    def chunk_keys(self) -> int:
        """Rows per chunk when `chunks` is called without a size: `chunk_bytes` of rows,
        at most DECODED_CHUNK_BYTES of them as float32."""
        return max(1, min(self.read_options.chunk_bytes, DECODED_CHUNK_BYTES)
                   // (4 * self.vec_size))

    def settings(self) -> dict[str, object]:
        return {"key_column": self.key_column, "vector_column": self.vector_column}

    def _reading(self, name: str) -> _ReadErrors:
        return _ReadErrors(self._pa, self.source.describe(name))

    def _read_chunks(self, chunk_keys: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        first_row = 0
        for name, part in self._parts:
            yield from self._part_chunks(name, part, chunk_keys, first_row)
            first_row += part.metadata.num_rows

    def _part_chunks(self, name: str, part: Any, chunk_keys: int, first_row: int
                     ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """A part's rows in chunks of `chunk_keys` (across its row groups): the vectors
        from the pages directly where that path reads them, else, from the row group
        it could not read on, by pyarrow."""
        done = 0
        rows = self._direct_rows(name, part)
        if rows is not None:
            try:
                for batch in self._batches(name, part, [self.key_column], chunk_keys):
                    vectors = rows.read(len(batch))
                    keys = self._keys(name, batch.column(0), first_row + done)
                    done += len(keys)
                    self.direct_rows += len(keys)
                    yield keys, vectors
                return
            except NotDirect as why:
                log.debug("%s from row %d: read by pyarrow (%s)", self.source.describe(name),
                          done, why)
        sizes = [part.metadata.row_group(g).num_rows for g in range(part.num_row_groups)]
        group, skip = 0, done
        while group < len(sizes) and skip >= sizes[group]:
            skip -= sizes[group]
            group += 1
        groups = list(range(group, len(sizes)))
        for batch in self._batches(name, part, [self.key_column, self.vector_column],
                                   chunk_keys, groups):
            if skip >= len(batch):
                skip -= len(batch)
                continue
            batch, skip = batch.slice(skip), 0
            keys, vectors = self._convert(name, batch, first_row + done)
            done += len(keys)
            yield keys, vectors

    def _direct_rows(self, name: str, part: Any) -> ColumnRows | None:
        """The direct page reader of a part's vector column, if it decodes that column."""
        leaf = vector_leaf(part.schema, self.vector_column)
        if leaf is None:
            return None
        groups = [part.metadata.row_group(g) for g in range(part.num_row_groups)]
        return ColumnRows(self._file_read(name), dict(self.files)[name],
                          [(g.column(leaf.index), g.num_rows) for g in groups], leaf,
                          self.vec_size, self._codecs)

    def _file_read(self, name: str) -> FileRead:
        """Byte ranges of part `name`: slices of a memory map of a local file, ranged
        reads of a remote one."""
        from hps.modelfiles.uri import LocalSource

        if isinstance(self.source, LocalSource):
            data = np.memmap(os.path.join(self.source.path, name), np.uint8, "r")
            return lambda offset, length: data[offset : offset + length].view(np.ndarray)
        source = self.source
        return lambda offset, length: np.frombuffer(source.read(name, offset, length), np.uint8)

    def _batches(self, name: str, part: Any, columns: list[str], chunk_keys: int,
                 groups: list[int] | None = None) -> Iterator[Any]:
        """pyarrow's record batches of `columns` of a part (of `groups` only, if given),
        read errors mapped."""
        with self._reading(name):
            batches = part.iter_batches(batch_size=chunk_keys,
                                        row_groups=groups, columns=columns)
        while True:
            with self._reading(name):
                batch = next(batches, None)
            if batch is None:
                return
            yield batch

    def _keys(self, name: str, column: Any, first_row: int) -> np.ndarray:
        """A batch's key column as int64 (nulls and keys that do not fit refused)."""
        where = self.source.describe(name)
        _refuse_nulls(where, "key", column, first_row)
        return keys_as_int64(where, column.to_numpy(), first_row)

    def _convert(self, name: str, batch: Any, first_row: int) -> tuple[np.ndarray, np.ndarray]:
        pa, where = self._pa, self.source.describe(name)
        vec_col = batch.column(1)
        keys = self._keys(name, batch.column(0), first_row)
        _refuse_nulls(where, "vector", vec_col, first_row)
        if not pa.types.is_fixed_size_list(vec_col.type):
            import pyarrow.compute as pc

            lengths = pc.list_value_length(vec_col).to_numpy()
            wrong = lengths != self.vec_size
            if wrong.any():
                at = int(np.argmax(wrong))
                raise ModelFileError(
                    f"{where}: row {first_row + at} has a vector of {lengths[at]} values, "
                    f"expected {self.vec_size}"
                )
        values = vec_col.flatten()
        if values.null_count:
            raise ModelFileError(f"{where}: a vector near row {first_row} holds a null value")
        rows = values.to_numpy().reshape(len(batch), self.vec_size)
        return keys, rows_as_float32(rows, self.dtype)

    def close(self) -> None:
        for _, part in self._parts:
            part.close()
        # pyarrow's pool keeps freed memory for reuse until told: the rows, pages and
        # batches of this read are the server's to use no more
        self._pa.default_memory_pool().release_unused()
        super().close()


def _refuse_nulls(where: str, label: str, column: Any, first_row: int) -> None:
    if column.null_count:
        at = first_row + int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))
        raise ModelFileError(f"{where}: row {at} has a null {label}")


class _ReadErrors:
    """Maps pyarrow's read errors (corrupt pages, truncated data) to ModelFileError."""

    def __init__(self, pa: Any, where: str) -> None:
        self.pa, self.where = pa, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or isinstance(exc, HPSError):
            return
        if isinstance(exc, (self.pa.ArrowException, OSError, EOFError)):
            raise ModelFileError(f"{self.where}: cannot read the Parquet data ({exc})") from exc


class ParquetWriter(ModelWriter):
    """Writes one Parquet file (key int64, vector fixed_size_list<float>[dim]), a row
    group per chunk."""

    format = "parquet"

    def __init__(self, path: str, num_keys: int, vec_size: int) -> None:
        super().__init__(path, num_keys, vec_size)
        self._pa, pq = import_pyarrow()
        pa = self._pa
        # no nulls declared: readers then decode no definition levels (about twice as fast)
        self._vector_type = pa.list_(pa.field("element", pa.float32(), nullable=False), vec_size)
        self._schema = pa.schema([
            pa.field(DEFAULT_KEY_COLUMN, pa.int64(), nullable=False),
            pa.field(DEFAULT_VECTOR_COLUMN, self._vector_type, nullable=False),
        ])
        # random floats gain nothing from a dictionary, and reading one costs time
        self._writer = pq.ParquetWriter(self.tmp, self._schema, use_dictionary=False)

    def _write(self, keys: np.ndarray, rows: np.ndarray) -> None:
        pa = self._pa
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)),
                                                    type=self._vector_type)
        self._writer.write_table(pa.table([pa.array(keys), vectors], schema=self._schema))

    def _finish(self) -> None:
        self._release()

    def _release(self) -> None:
        self._writer.close()
