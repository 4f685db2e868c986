"""The vector column of a Parquet file, read straight from its pages into rows.

Why: a `list<float>` / `fixed_size_list<float>[dim]` column stores a repetition and a
definition level beside every value, and pyarrow decodes each of them to rebuild the
lists (then copies the values out of them): measured on 1M rows of width 64, about 0.23
CPU-seconds, of which only the value copies are needed, where the whole load of the
same rows from a HugeCTR folder costs about 0.6. Here a page is decompressed (pyarrow's
codecs), its levels are only checked (`parquet_levels`: every row `dim` values, none
null, a byte per 8 levels) and its values are copied once, into the rows handed to the
loader: about a third of pyarrow's time.

What it reads: a column chunk of the vector column's one leaf (float32, or float16 as
2-byte fixed-length values) with repetition level 1, in data pages v1 or v2, values
PLAIN, dictionary-encoded or BYTE_STREAM_SPLIT, levels RLE, compressed with snappy,
gzip, zstd, brotli, LZ4 (raw) or not at all; page checksums, where written, are verified.
Anything else (another codec or encoding, a null, a row of another width, a header that
does not parse, a checksum that does not match) raises NotDirect *before* the rows it
concerns are handed out, and the caller reads the row group with pyarrow instead, which
reads what this does not and names what is wrong with a bad file. So this path never
accepts a file that pyarrow's path refuses: it only accepts less.

Bytes come through a `read(offset, length)` of the file: slices of a memory map for a
local file, one ranged read per row group's column chunk for a remote one (what pyarrow
reads at a time too).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import hps.modelfiles.formats.parquet_thrift as thrift
from hps.modelfiles.formats.parquet_levels import (
    all_equal,
    decode_ids,
    row_start_bytes,
    rows_of_dim,
)

#: codecs as pyarrow's metadata names them → pyarrow's codec names ("LZ4" is Parquet's
#: LZ4_RAW, a bare LZ4 block; the older Hadoop-framed LZ4 is left to pyarrow)
CODECS: dict[str, str | None] = {
    "UNCOMPRESSED": None, "SNAPPY": "snappy", "GZIP": "gzip", "ZSTD": "zstd",
    "BROTLI": "brotli", "LZ4": "lz4_raw", "LZ4_RAW": "lz4_raw",
}
_U32 = np.dtype("<u4")
#: reads `length` bytes of a file from `offset`, as uint8
FileRead = Callable[[int, int], np.ndarray]
#: bytes copied to parse a page header from (one that is longer is parsed in place)
HEADER_WINDOW = 512


class NotDirect(Exception):
    """This column chunk (or a page of it) is not one the direct path reads: read the
    row group with pyarrow. The message says why (for the debug log)."""


@dataclass(frozen=True)
class VectorLeaf:
    """The one leaf (primitive) column of a Parquet file under the vector column."""

    index: int
    max_definition_level: int
    dtype: np.dtype[Any]


def vector_leaf(schema: Any, column: str) -> VectorLeaf | None:
    """The leaf of `column` in a pyarrow ParquetSchema when the direct path can read it
    (one leaf, lists one level deep, float32 or float16 values), else None."""
    leaves = [i for i in range(len(schema))
              if schema.column(i).path == column or schema.column(i).path.startswith(f"{column}.")]
    if len(leaves) != 1:
        return None
    leaf = schema.column(leaves[0])
    if leaf.max_repetition_level != 1 or leaf.max_definition_level < 1:
        return None
    dtype: np.dtype[Any]
    if leaf.physical_type == "FLOAT":
        dtype = np.dtype("<f4")
    elif (leaf.physical_type == "FIXED_LEN_BYTE_ARRAY" and leaf.length == 2
          and str(leaf.logical_type) == "Float16"):
        dtype = np.dtype("<f2")
    else:
        return None
    return VectorLeaf(leaves[0], leaf.max_definition_level, dtype)


class ColumnRows:
    """The rows of a file's vector column over some of its row groups, in order:
    `read(n)` hands out the next n rows (across row groups).

    `read(offset, length)` returns bytes of the file (`size` bytes long) as uint8;
    `chunks` holds the column chunk (pyarrow metadata) and row count of each row group.
    `read` raises NotDirect, before returning rows, when a chunk or page it needs is one
    it cannot read or check.
    """

    def __init__(self, read: FileRead, size: int, chunks: list[tuple[Any, int]],
                 leaf: VectorLeaf, dim: int, codecs: dict[str, Any]) -> None:
        column = _Column(read, size, leaf, dim, codecs,
                         leaf.max_definition_level.bit_length(), row_start_bytes(dim))
        self._dim = dim
        # a function's generator, not a method's: one holding `self` would make a cycle
        # that keeps the file mapped until the garbage collector runs
        self._pages = _column_values(column, chunks)
        self._left = np.empty(0, leaf.dtype)

    def read(self, n: int) -> np.ndarray:
        """The next `n` rows as float32[n, dim] (float16 values widened)."""
        import pyarrow as pa

        # from pyarrow's pool, which reuses a freed chunk's memory as it is; a fresh NumPy
        # array of this size is fresh pages, which the kernel zeroes first (a quarter of
        # this path's time). The reader's close hands the pool's unused memory back.
        buffer = pa.allocate_buffer(n * self._dim * 4)
        rows = np.frombuffer(buffer, np.float32).reshape(n, self._dim)
        flat = rows.reshape(-1)
        filled = 0
        while filled < flat.size:
            if not self._left.size:
                page = next(self._pages, None)
                if page is None:
                    raise NotDirect("the pages hold fewer values than the rows")
                self._left = page
            take = min(self._left.size, flat.size - filled)
            flat[filled : filled + take] = self._left[:take]
            self._left = self._left[take:]
            filled += take
        return rows


@dataclass(frozen=True)
class _Column:
    """What decoding any chunk of one file's vector column needs."""

    read: FileRead
    size: int
    leaf: VectorLeaf
    dim: int
    codecs: dict[str, Any]  # pyarrow codecs by name, shared by a reader's parts
    def_width: int
    row_starts: np.ndarray


def _column_values(column: _Column, chunks: list[tuple[Any, int]]) -> Iterator[np.ndarray]:
    """The checked values of each data page of each chunk, in order."""
    for chunk, num_rows in chunks:
        yield from _ChunkPages(column, chunk, num_rows).values()


class _ChunkPages:
    """The pages of one column chunk (one row group's vector column), decoded."""

    def __init__(self, column: _Column, chunk: Any, num_rows: int) -> None:
        if chunk.compression not in CODECS:
            raise NotDirect(f"codec {chunk.compression}")
        name = CODECS[chunk.compression]
        if name is not None and name not in column.codecs:
            try:
                import pyarrow as pa

                column.codecs[name] = pa.Codec(name)
            except Exception as exc:  # a codec this pyarrow build lacks
                raise NotDirect(f"codec {name}: {exc}") from None
        self._codec = column.codecs[name] if name is not None else None
        dim = column.dim
        if chunk.file_path or chunk.num_values != num_rows * dim:
            raise NotDirect("values are not rows × width, or live in another file")
        start = chunk.data_page_offset
        if chunk.has_dictionary_page and chunk.dictionary_page_offset:
            start = min(start, chunk.dictionary_page_offset)
        end = start + chunk.total_compressed_size
        if start < 0 or end > column.size:
            raise NotDirect("column chunk outside the file")
        # positions below are within the chunk's bytes; `_base` is where they start
        self._data, self._start, self._end = column.read(start, end - start), 0, end - start
        self._base = start
        self._leaf, self._dim, self._total = column.leaf, dim, num_rows * dim
        self._def_width, self._row_starts = column.def_width, column.row_starts

    def values(self) -> Iterator[np.ndarray]:
        """The checked values of each data page, in order."""
        pos, seen, dictionary = self._start, 0, None
        while seen < self._total:
            header, body = self._header(pos)
            size = header.get(thrift.COMPRESSED_SIZE, -1)
            if not 0 <= size <= self._end - body:
                raise NotDirect(f"page at byte {self._base + pos} runs past its column chunk")
            page = self._data[body : body + size]
            pos = body + size
            if thrift.CRC in header and zlib.crc32(page.data) != header[thrift.CRC] & 0xFFFFFFFF:
                raise NotDirect(f"page at byte {self._base + body}: checksum does not match")
            kind = header.get(thrift.PAGE_TYPE)
            if kind == thrift.DICTIONARY_PAGE:
                dictionary = self._dictionary(header, page)
            elif kind in (thrift.DATA_PAGE, thrift.DATA_PAGE_V2):
                values = self._data_page(header, page, seen, dictionary)
                seen += values.size
                yield values
            elif kind != thrift.INDEX_PAGE:
                raise NotDirect(f"page type {kind}")

    def _header(self, pos: int) -> tuple[dict[int, Any], int]:
        """The page header at byte `pos` of the file, and the byte after it."""
        # bytes index faster than a NumPy array; a header is tens of bytes, rarely more
        window = bytes(self._data[pos : min(pos + HEADER_WINDOW, self._end)])
        try:
            header, used = thrift.read_struct(window, 0)
        except thrift.HeaderError as exc:
            if len(window) < HEADER_WINDOW:
                raise NotDirect(f"page header at byte {self._base + pos}: {exc}") from None
            try:  # a long header (large statistics): parse it in place
                return thrift.read_struct(self._data[: self._end], pos)
            except thrift.HeaderError as exc:
                raise NotDirect(f"page header at byte {self._base + pos}: {exc}") from None
        return header, pos + used

    def _data_page(self, header: dict[int, Any], page: np.ndarray, first: int,
                   dictionary: np.ndarray | None) -> np.ndarray:
        """The values of a data page (v1 or v2), its levels checked: positions first,
        first + 1, … of rows `dim` wide, none null."""
        if header[thrift.PAGE_TYPE] == thrift.DATA_PAGE:
            fields = _struct(header, thrift.DATA_PAGE_HEADER)
            count, encoding = fields.get(thrift.V1_NUM_VALUES, -1), fields.get(thrift.V1_ENCODING)
            if (fields.get(thrift.V1_REP_ENCODING), fields.get(thrift.V1_DEF_ENCODING)) != (
                    thrift.RLE, thrift.RLE):
                raise NotDirect("levels not RLE-encoded")
            raw = self._inflate(page, header.get(thrift.UNCOMPRESSED_SIZE, -1))
            rep_start = 4
            rep_end = rep_start + _length(raw, 0)
            def_start = rep_end + 4
            def_end = def_start + _length(raw, rep_end)
            levels, values = raw, raw[def_end:]
        else:
            fields = _struct(header, thrift.DATA_PAGE_HEADER_V2)
            count, encoding = fields.get(thrift.V2_NUM_VALUES, -1), fields.get(thrift.V2_ENCODING)
            if fields.get(thrift.V2_NUM_NULLS, 0):
                raise NotDirect("nulls")
            rep_start, rep_end = 0, fields.get(thrift.V2_REP_BYTES, -1)
            def_start, def_end = rep_end, rep_end + fields.get(thrift.V2_DEF_BYTES, -1)
            if not 0 <= rep_end <= def_end <= page.size:
                raise NotDirect("level lengths do not fit the page")
            levels, values = page, page[def_end:]
            if fields.get(thrift.V2_IS_COMPRESSED, True):
                values = self._inflate(values, header.get(thrift.UNCOMPRESSED_SIZE, -1) - def_end)
        if count < 0 or first + count > self._total or def_end > levels.size:
            raise NotDirect("a data page's value count or level lengths do not fit")
        if not rows_of_dim(levels, rep_start, rep_end, count, first, self._dim, self._row_starts):
            raise NotDirect(f"a row near value {first} is not {self._dim} values long")
        if not all_equal(levels, def_start, def_end, count, self._def_width,
                         self._leaf.max_definition_level):
            raise NotDirect(f"a null near value {first}")
        return self._decode(encoding, values, count, dictionary)

    def _decode(self, encoding: Any, buf: np.ndarray, count: int,
                dictionary: np.ndarray | None) -> np.ndarray:
        dtype = self._leaf.dtype
        nbytes = count * dtype.itemsize
        if encoding == thrift.PLAIN and buf.size >= nbytes:
            return buf[:nbytes].view(dtype)
        if encoding == thrift.BYTE_STREAM_SPLIT and buf.size >= nbytes:
            planes = buf[:nbytes].reshape(dtype.itemsize, count)  # byte i of every value
            return np.ascontiguousarray(planes.T).view(dtype).reshape(count)
        if encoding in (thrift.PLAIN_DICTIONARY, thrift.RLE_DICTIONARY) and buf.size:
            width = int(buf[0])
            if dictionary is None or width > 32:
                raise NotDirect("dictionary ids without a dictionary page, or too wide")
            ids = np.empty(count, np.uint32)
            largest = decode_ids(buf, 1, buf.size, width, ids)
            if largest < 0 or (count and largest >= dictionary.size):
                raise NotDirect("dictionary ids out of range or cut short")
            return dictionary[ids]
        raise NotDirect(f"value encoding {encoding} (or values cut short)")

    def _dictionary(self, header: dict[int, Any], page: np.ndarray) -> np.ndarray:
        fields = _struct(header, thrift.DICTIONARY_PAGE_HEADER)
        count = fields.get(thrift.DICT_NUM_VALUES, -1)
        if fields.get(thrift.DICT_ENCODING) not in (thrift.PLAIN, thrift.PLAIN_DICTIONARY):
            raise NotDirect("dictionary page not PLAIN")
        raw = self._inflate(page, header.get(thrift.UNCOMPRESSED_SIZE, -1))
        nbytes = count * self._leaf.dtype.itemsize
        if count < 0 or raw.size < nbytes:
            raise NotDirect("dictionary page cut short")
        return raw[:nbytes].view(self._leaf.dtype)

    def _inflate(self, buf: np.ndarray, size: int) -> np.ndarray:
        """`buf` decompressed to exactly `size` bytes."""
        if self._codec is None:
            if buf.size != size:
                raise NotDirect("uncompressed page of the wrong size")
            return buf
        import pyarrow as pa

        if size < 0:
            raise NotDirect("negative page size")
        try:
            out = self._codec.decompress(pa.py_buffer(buf), decompressed_size=size)
        except (pa.ArrowException, ValueError) as exc:
            raise NotDirect(f"page does not decompress: {exc}") from None
        raw = np.frombuffer(out, np.uint8)
        if raw.size != size:
            raise NotDirect("page decompresses to the wrong size")
        return raw


def _struct(header: dict[int, Any], field: int) -> dict[int, Any]:
    fields = header.get(field)
    if not isinstance(fields, dict):
        raise NotDirect(f"page header without field {field}")
    return fields


def _length(raw: np.ndarray, at: int) -> int:
    """The little-endian uint32 at raw[at] (a v1 page's level section length)."""
    if at + 4 > raw.size:
        raise NotDirect("level section cut short")
    return int(raw[at : at + 4].view(_U32)[0])
