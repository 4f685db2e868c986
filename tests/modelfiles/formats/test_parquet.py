"""Parquet tables written by pyarrow, served through HPS.lookup locally and from S3."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hps.errors import ModelFileError
from hps.modelfiles.formats import ReadOptions, TableSpec, open_model
from tests.conftest import make_table
from tests.modelfiles.formats.conftest import assert_loads_nothing, assert_served, ps_config, upload
from tests.support.s3_server import S3Server


def table(keys: np.ndarray, vectors: np.ndarray, *, fixed: bool = False,
          key_name: str = "key", vector_name: str = "vector", nullable: bool = True
          ) -> pa.Table:
    """(key, vector) rows as pyarrow builds them: list<float> or fixed_size_list;
    `nullable=False` declares both columns non-null (fewer definition levels)."""
    flat = pa.array(vectors.reshape(-1))
    if fixed:
        column = pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])
    else:
        offsets = pa.array(np.arange(0, vectors.size + 1, vectors.shape[1], dtype=np.int32))
        column = pa.ListArray.from_arrays(offsets, flat)
    schema = pa.schema([pa.field(key_name, pa.array(keys).type, nullable=nullable),
                        pa.field(vector_name, column.type, nullable=nullable)])
    return pa.table([pa.array(keys), column], schema=schema)


def test_list_column_file_local(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 5000, 8)
    pq.write_table(table(keys, vectors), tmp_path / "t.parquet", row_group_size=700)
    assert_served(ps_config(tmp_path, str(tmp_path / "t.parquet"), 8), keys, vectors)


def test_fixed_size_float16_int32_keys_named_columns(tmp_path: Path,
                                                     rng: np.random.Generator) -> None:
    keys = rng.choice(2**31 - 1, 3000, replace=False).astype(np.int32)
    vectors = rng.standard_normal((3000, 16)).astype(np.float16)
    data = table(keys, vectors, fixed=True, key_name="id", vector_name="emb")
    pq.write_table(data, tmp_path / "t.pq")
    entry = {"path": str(tmp_path / "t.pq"), "format": "parquet",
             "key_column": "id", "vector_column": "emb"}
    with open_model(TableSpec(**entry)) as reader:  # type: ignore[arg-type]
        assert (reader.dtype, reader.key_dtype, reader.vec_size) == ("float16", "int32", 16)
    assert_served(ps_config(tmp_path, entry, 16), keys.astype(np.int64),
                  vectors.astype(np.float32))


def test_folder_of_parts_local_and_chunks_cross_parts(tmp_path: Path,
                                                      rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 4000, 4)
    folder = tmp_path / "table"
    folder.mkdir()
    for i, start in enumerate(range(0, 4000, 1500)):
        part = table(keys[start : start + 1500], vectors[start : start + 1500])
        pq.write_table(part, folder / f"part-{i:05d}.snappy.parquet", row_group_size=400)
    (folder / "_SUCCESS").write_bytes(b"")
    with open_model(str(folder), ReadOptions(chunk_bytes=1000 * 16)) as reader:
        assert reader.format == "parquet" and reader.num_keys == 4000
        chunks = list(reader.chunks())
    assert [len(k) for k, _ in chunks] == [1000, 500, 1000, 500, 1000]
    np.testing.assert_array_equal(np.concatenate([k for k, _ in chunks]), keys)
    np.testing.assert_array_equal(np.concatenate([r for _, r in chunks]), vectors)
    assert_served(ps_config(tmp_path, str(folder), 4), keys, vectors)


def test_default_chunks_hold_a_bounded_amount_of_decoded_rows(
        tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoded rows are memory of their own (a mapped format's are not): without a size
    asked for, a chunk holds at most DECODED_CHUNK_BYTES of float32 rows, float16 files
    counted as widened; a size asked for is honoured."""
    from hps.modelfiles.formats import parquet

    monkeypatch.setattr(parquet, "DECODED_CHUNK_BYTES", 100 * 8 * 4)
    keys, vectors = make_table(rng, 450, 8)
    for name, rows in (("f32.parquet", vectors), ("f16.parquet", vectors.astype(np.float16))):
        pq.write_table(table(keys, rows, fixed=True), tmp_path / name, row_group_size=170)
        with open_model(str(tmp_path / name)) as reader:
            assert reader.chunk_keys == 100
            chunks = list(reader.chunks())
            assert [len(k) for k, _ in chunks] == [100, 100, 100, 100, 50]
            assert reader.direct_rows == 450
            np.testing.assert_array_equal(np.concatenate([r for _, r in chunks]),
                                          rows.astype(np.float32))
            assert [len(k) for k, _ in reader.chunks(300)] == [300, 150]
        with open_model(str(tmp_path / name), ReadOptions(chunk_bytes=40 * 8 * 4)) as reader:
            assert reader.chunk_keys == 40


def test_file_and_prefix_from_s3(tmp_path: Path, rng: np.random.Generator,
                                 s3_server: S3Server) -> None:
    keys, vectors = make_table(rng, 3000, 8)
    pq.write_table(table(keys, vectors), tmp_path / "t.parquet", row_group_size=1000)
    folder = tmp_path / "parts"
    folder.mkdir()
    for i in range(3):
        part = table(keys[i * 1000 : (i + 1) * 1000], vectors[i * 1000 : (i + 1) * 1000],
                     fixed=True)
        pq.write_table(part, folder / f"part-{i}.parquet")
    bucket = s3_server.new_bucket()
    upload(s3_server, bucket, tmp_path / "t.parquet", "models/t.parquet")
    upload(s3_server, bucket, folder, "models/parts")
    uri = f"s3://{bucket}/models/t.parquet"
    assert_served(ps_config(tmp_path / "a", uri, 8, s3=s3_server), keys, vectors)
    prefix = f"s3://{bucket}/models/parts"
    assert_served(ps_config(tmp_path / "b", prefix, 8, s3=s3_server), keys, vectors)


# -- bad files: a clear error naming the file, and nothing loaded --------------------------


def write(tmp_path: Path, data: pa.Table, **kw: object) -> str:
    path = tmp_path / "bad.parquet"
    pq.write_table(data, path, **kw)
    return str(path)


def test_truncated_file(tmp_path: Path, rng: np.random.Generator) -> None:
    path = write(tmp_path, table(*make_table(rng, 100, 4)))
    blob = Path(path).read_bytes()
    Path(path).write_bytes(blob[: len(blob) // 2])
    assert_loads_nothing(tmp_path, path, 4, r"bad\.parquet: not a readable Parquet file")


def write_corrupt(path: Path, keys: np.ndarray, vectors: np.ndarray) -> None:
    """Four row groups with page checksums; bytes in the last group's vectors flipped."""
    pq.write_table(table(keys, vectors), path, row_group_size=len(keys) // 4,
                   compression="none", use_dictionary=False, write_page_checksum=True)
    column = pq.ParquetFile(path).metadata.row_group(3).column(1)
    blob = bytearray(path.read_bytes())
    middle = column.data_page_offset + column.total_compressed_size // 2
    blob[middle : middle + 8] = bytes(8 * [0xFF])
    path.write_bytes(bytes(blob))


def test_corrupt_page_late_in_the_file(tmp_path: Path, rng: np.random.Generator) -> None:
    write_corrupt(tmp_path / "bad.parquet", *make_table(rng, 4000, 4))
    assert_loads_nothing(tmp_path, str(tmp_path / "bad.parquet"), 4,
                         r"bad\.parquet: cannot read the Parquet data")


def test_wrong_column_types(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 50, 4)
    strings = table(keys, vectors).set_column(0, "key", pa.array([str(k) for k in keys]))
    path = write(tmp_path, strings)
    assert_loads_nothing(tmp_path, path, 4, r"bad\.parquet: key column 'key' is string")
    path = write(tmp_path, table(keys, vectors.astype(np.float64)))
    assert_loads_nothing(tmp_path, path, 4, r"vector column 'vector' is list<.*double.*cast")


def test_missing_column(tmp_path: Path, rng: np.random.Generator) -> None:
    path = write(tmp_path, table(*make_table(rng, 50, 4), vector_name="embedding"))
    assert_loads_nothing(tmp_path, path, 4,
                         r"bad\.parquet has no column 'vector' \(columns: key, embedding\)")


def test_width_nulls_and_ragged_rows(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 50, 4)
    path = write(tmp_path, table(keys, vectors, fixed=True))
    assert_loads_nothing(tmp_path, path, 8, "rows are 4 wide but embedding_vecsize")
    ragged = pa.table({"key": keys, "vector": [list(v) for v in vectors[:49]] + [[1.0]]},
                      schema=pa.schema([("key", pa.int64()), ("vector", pa.list_(pa.float32()))]))
    path = write(tmp_path, ragged)
    assert_loads_nothing(tmp_path, path, 4, "row 49 has a vector of 1 values, expected 4")
    nulls = pa.table({"key": keys, "vector": [list(v) for v in vectors[:10]] + [None] * 40},
                     schema=ragged.schema)
    path = write(tmp_path, nulls)
    assert_loads_nothing(tmp_path, path, 4, "row 10 has a null vector")


def test_keys_out_of_range(tmp_path: Path, rng: np.random.Generator) -> None:
    keys = np.arange(100, dtype=np.int64)
    keys[77] = 2**32
    vectors = rng.standard_normal((100, 4)).astype(np.float32)
    path = write(tmp_path, table(keys, vectors))
    assert_loads_nothing(tmp_path, path, 4, r"key 4294967296 at row 77 is out of range for "
                         "supportlonglong: false", supportlonglong=False)
    big = pa.table({"key": pa.array(np.arange(100, dtype=np.uint64) + np.uint64(2**63)),
                    "vector": table(keys, vectors).column(1)})
    path = write(tmp_path, big)
    assert_loads_nothing(tmp_path, path, 4, r"uint64 key 9223372036854775808 at row 0")


def test_empty_folder_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README").write_text("no model here")
    with pytest.raises(ModelFileError, match=r"no 'key' file.*it holds README"):
        open_model(str(tmp_path / "empty"))
