"""The direct page path of the Parquet reader (hps.modelfiles.formats.parquet_pages) against
pyarrow's own reading of the same files, written by pyarrow with every layout it offers:
the rows must come out bit for bit, and the direct path must be the one that read them
(`direct_rows`); rows it must not accept fall to pyarrow, whose errors name the row."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hps.errors import ModelFileError
from hps.modelfiles.formats import ModelReader, ReadOptions, open_model, parquet_pages
from hps.modelfiles.formats.parquet import ParquetReader
from hps.modelfiles.formats.parquet_levels import (
    all_equal,
    decode_ids,
    row_start_bytes,
    rows_of_dim,
)
from hps.modelfiles.formats.parquet_thrift import HeaderError, read_struct
from hps.modelfiles.source import SourceOptions
from tests.modelfiles.formats.conftest import assert_served, ps_config, upload
from tests.modelfiles.formats.test_parquet import table
from tests.support.s3_server import S3Server


def direct_rows(reader: ModelReader) -> int:
    """Rows of a Parquet reader's files that the direct page path read."""
    assert isinstance(reader, ParquetReader)
    return reader.direct_rows


def read_all(path: Path, chunk_rows: int, row_bytes: int) -> tuple[int, np.ndarray, np.ndarray]:
    with open_model(str(path), ReadOptions(chunk_bytes=chunk_rows * row_bytes)) as reader:
        chunks = list(reader.chunks())
        direct = direct_rows(reader)
    keys = np.concatenate([k for k, _ in chunks])
    rows = np.concatenate([v for _, v in chunks])
    return direct, keys, rows


def pyarrow_rows(path: Path) -> tuple[np.ndarray, np.ndarray]:
    data = pq.read_table(path)
    keys = data.column("key").to_numpy()
    values = data.column("vector").combine_chunks().flatten().to_numpy()
    return keys, values.astype(np.float32).reshape(len(keys), -1)


LAYOUTS = {
    "snappy v1 plain": dict(compression="snappy", use_dictionary=False),
    "uncompressed v1": dict(compression="none", use_dictionary=False),
    "gzip": dict(compression="gzip"),
    "zstd v2": dict(compression="zstd", data_page_version="2.0"),
    "brotli v2 dictionary": dict(compression="brotli", data_page_version="2.0"),
    "lz4": dict(compression="lz4", use_dictionary=False),
    "byte stream split": dict(use_dictionary=False,
                              column_encoding={"vector": "BYTE_STREAM_SPLIT"}),
    "small pages with checksums": dict(data_page_size=1000, write_page_checksum=True),
    "small v2 pages": dict(data_page_size=700, data_page_version="2.0", use_dictionary=False),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dim", [1, 3, 64])
@pytest.mark.parametrize("fixed", [True, False], ids=["fixed_size_list", "list"])
def test_direct_path_reads_every_layout_bit_for_bit(tmp_path: Path, rng: np.random.Generator,
                                                     layout: str, dim: int, fixed: bool) -> None:
    n = 3000
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    vectors[::7] = rng.integers(0, 5, (len(vectors[::7]), dim))  # repeats: dictionary pages
    path = tmp_path / "t.parquet"
    pq.write_table(table(keys, vectors, fixed=fixed, nullable=not fixed), path,
                   row_group_size=1100, **LAYOUTS[layout])  # type: ignore[arg-type]
    direct, got_keys, got_rows = read_all(path, 400, 4 * dim)  # chunks across row groups
    assert direct == n
    want_keys, want_rows = pyarrow_rows(path)
    np.testing.assert_array_equal(got_keys, want_keys)
    np.testing.assert_array_equal(got_rows.view(np.uint32), want_rows.view(np.uint32))


def test_remote_file_read_directly_by_ranged_reads(tmp_path: Path, rng: np.random.Generator,
                                                   s3_server: S3Server) -> None:
    keys = rng.choice(2**40, 3000, replace=False).astype(np.int64)
    vectors = rng.standard_normal((3000, 8)).astype(np.float32)
    path = tmp_path / "t.parquet"
    pq.write_table(table(keys, vectors), path, row_group_size=1000, compression="zstd")
    bucket = s3_server.new_bucket()
    upload(s3_server, bucket, path, "t.parquet")
    uri = f"s3://{bucket}/t.parquet"
    options = SourceOptions(s3_endpoint=s3_server.endpoint)
    with open_model(uri, ReadOptions(chunk_bytes=700 * 32), options) as reader:
        chunks = list(reader.chunks())
        assert direct_rows(reader) == 3000
    np.testing.assert_array_equal(np.concatenate([k for k, _ in chunks]), keys)
    np.testing.assert_array_equal(np.concatenate([v for _, v in chunks]), vectors)
    assert_served(ps_config(tmp_path, uri, 8, s3=s3_server), keys, vectors)


def test_headers_longer_than_the_window_parse_in_place(tmp_path: Path, rng: np.random.Generator,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parquet_pages, "HEADER_WINDOW", 12)  # shorter than any page header
    keys = np.arange(2000, dtype=np.int64)
    vectors = rng.standard_normal((2000, 8)).astype(np.float32)
    path = tmp_path / "t.parquet"
    pq.write_table(table(keys, vectors), path, row_group_size=900, data_page_size=2000)
    direct, got_keys, got_rows = read_all(path, 700, 32)
    assert direct == 2000
    np.testing.assert_array_equal(got_keys, keys)
    np.testing.assert_array_equal(got_rows, vectors)


def test_a_read_file_is_unmapped_without_the_garbage_collector(tmp_path: Path,
                                                              rng: np.random.Generator) -> None:
    """The direct path maps the file; nothing may keep it mapped (a reference cycle
    would, until a collection: a table-sized file held in memory after its load)."""
    path = tmp_path / "t.parquet"
    pq.write_table(table(np.arange(3000), rng.standard_normal((3000, 8)).astype(np.float32)),
                   path, row_group_size=1000)
    gc.disable()
    try:
        with open_model(str(path), ReadOptions(chunk_bytes=700 * 32)) as reader:
            for _chunk in reader.chunks():
                assert str(path) in Path("/proc/self/maps").read_text()
            assert direct_rows(reader) == 3000
        del _chunk
        assert str(path) not in Path("/proc/self/maps").read_text()
    finally:
        gc.enable()


def test_float16_dictionary_and_plain(tmp_path: Path, rng: np.random.Generator) -> None:
    keys = np.arange(5000, dtype=np.int64)
    vectors = rng.standard_normal((5000, 8)).astype(np.float16)
    for options in ({"use_dictionary": True}, {"use_dictionary": False, "compression": "zstd"}):
        path = tmp_path / "half.parquet"
        pq.write_table(table(keys, vectors, fixed=True), path, row_group_size=2000,
                       **options)
        direct, got_keys, got_rows = read_all(path, 999, 16)
        assert direct == 5000
        np.testing.assert_array_equal(got_keys, keys)
        np.testing.assert_array_equal(got_rows, vectors.astype(np.float32))


def test_served_through_hps_from_the_direct_path(tmp_path: Path, rng: np.random.Generator) -> None:
    keys = rng.choice(2**40, 4000, replace=False).astype(np.int64)
    vectors = rng.standard_normal((4000, 16)).astype(np.float32)
    path = tmp_path / "t.parquet"
    pq.write_table(table(keys, vectors, fixed=False), path, row_group_size=1500)
    assert_served(ps_config(tmp_path, str(path), 16), keys, vectors)


def test_bad_rows_late_in_a_part_fall_to_pyarrow_naming_the_row(tmp_path: Path,
                                                               rng: np.random.Generator) -> None:
    """Row groups before the bad one are read directly; the bad one by pyarrow, whose
    error names the row counted from the start of the file."""
    keys = np.arange(3000, dtype=np.int64)
    vectors = rng.standard_normal((3000, 4)).astype(np.float32)
    lists: list[Any] = [list(v) for v in vectors]
    schema = pa.schema([("key", pa.int64()), ("vector", pa.list_(pa.float32()))])
    for bad, value, message in ((2345, [1.0, 2.0], "row 2345 has a vector of 2 values"),
                                (2801, None, "row 2801 has a null vector"),
                                (2999, [1.0, None, 3.0, 4.0], "near row 2800 holds a null")):
        rows = lists.copy()
        rows[bad] = value
        path = tmp_path / "bad.parquet"
        pq.write_table(pa.table({"key": keys, "vector": rows}, schema=schema), path,
                       row_group_size=1000)
        with open_model(str(path), ReadOptions(chunk_bytes=400 * 16)) as reader:
            with pytest.raises(ModelFileError, match=message):
                for _ in reader.chunks():
                    pass
            assert direct_rows(reader) == 2000  # the two good row groups


def test_corrupt_page_header_is_an_error(tmp_path: Path, rng: np.random.Generator) -> None:
    keys = np.arange(2000, dtype=np.int64)
    vectors = rng.standard_normal((2000, 4)).astype(np.float32)
    path = tmp_path / "bad.parquet"
    pq.write_table(table(keys, vectors, fixed=True), path, row_group_size=1000,
                   use_dictionary=False)
    column = pq.ParquetFile(path).metadata.row_group(1).column(1)
    blob = bytearray(path.read_bytes())
    blob[column.data_page_offset : column.data_page_offset + 6] = bytes(6 * [0xFF])
    path.write_bytes(bytes(blob))
    with open_model(str(path), ReadOptions(chunk_bytes=500 * 16)) as reader:
        with pytest.raises(ModelFileError, match=r"bad\.parquet: cannot read the Parquet data"):
            for _ in reader.chunks():
                pass
        assert direct_rows(reader) == 1000


def test_thrift_compact_struct() -> None:
    # field 1 i32 -3, field 2 binary b"ab", field 4 (delta 2) true, field 5 list<i32> [1, 2],
    # field 6 struct {1: i64 300}, field 7 double (skipped), field 8 map (skipped), stop
    blob = bytes([0x15, 0x05, 0x18, 0x02, ord("a"), ord("b"), 0x21, 0x19, 0x25, 0x02, 0x04,
                  0x1C, 0x16, 0xD8, 0x04, 0x00, 0x17, *([0] * 8), 0x1B, 0x01, 0x55, 0x02,
                  0x04, 0x00])
    fields, end = read_struct(blob, 0)
    assert fields == {1: -3, 2: b"ab", 4: True, 5: [1, 2], 6: {1: 300}, 7: None, 8: None}
    assert end == len(blob)
    for cut in range(len(blob)):
        with pytest.raises(HeaderError):
            read_struct(blob[:cut], 0)


def hybrid_bit_packed(values: list[int], width: int) -> bytes:
    """One bit-packed run of `values` (padded to a multiple of 8) at `width` bits."""
    padded = values + [0] * (-len(values) % 8)
    bits = 0
    for i, v in enumerate(padded):
        bits |= v << (i * width)
    groups = len(padded) // 8
    return bytes([(groups << 1) | 1]) + bits.to_bytes(groups * width, "little")


def hybrid_run(value: int, count: int, width: int) -> bytes:
    header = count << 1
    out = bytearray()
    while True:
        byte, header = header & 0x7F, header >> 7
        out.append(byte | (0x80 if header else 0))
        if not header:
            break
    return bytes(out) + value.to_bytes((width + 7) // 8, "little")


def as_buf(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, np.uint8)


def test_level_checks_accept_rows_and_refuse_anything_else() -> None:
    dim = 5
    starts = row_start_bytes(dim)
    levels = [0 if i % dim == 0 else 1 for i in range(3 * dim)]
    for blob in (hybrid_bit_packed(levels, 1),
                 hybrid_run(0, 1, 1) + hybrid_run(1, 4, 1) + hybrid_bit_packed(levels[5:], 1)):
        buf = as_buf(blob)
        assert rows_of_dim(buf, 0, buf.size, 3 * dim, 0, dim, starts)
        assert not rows_of_dim(buf, 0, buf.size - 1, 3 * dim, 0, dim, starts)  # cut short
    wrong = levels.copy()
    wrong[7] = 0  # a row of 2 values, then one of 8
    buf = as_buf(hybrid_bit_packed(wrong, 1))
    assert not rows_of_dim(buf, 0, buf.size, 3 * dim, 0, dim, starts)
    buf = as_buf(hybrid_run(1, 5, 1))  # a run of 1s crossing a row start
    assert not rows_of_dim(buf, 0, buf.size, 5, 1, dim, starts)
    buf = as_buf(hybrid_run(1, 4, 1))  # a page starting inside a row: its rest
    assert rows_of_dim(buf, 0, buf.size, 4, 1, dim, starts)
    assert not rows_of_dim(buf, 0, buf.size, 4, 0, dim, starts)
    maximum = as_buf(hybrid_bit_packed([3] * 16, 2) + hybrid_run(3, 1, 2))
    assert all_equal(maximum, 0, maximum.size, 17, 2, 3)
    one_null = as_buf(hybrid_bit_packed([3] * 10 + [2], 2))
    assert not all_equal(one_null, 0, one_null.size, 11, 2, 3)


def test_dictionary_ids_decode_and_refuse_short_runs() -> None:
    ids = [5, 0, 7, 7, 1, 2, 3, 6, 4, 0, 1]
    blob = as_buf(hybrid_bit_packed(ids[:8], 3) + hybrid_run(4, 1, 3) + hybrid_bit_packed(
        ids[9:], 3))
    out = np.empty(len(ids), np.uint32)
    assert decode_ids(blob, 0, blob.size, 3, out) == 7
    assert out.tolist() == ids
    assert decode_ids(blob, 0, 3, 3, out) == -1
