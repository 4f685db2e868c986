from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps.errors import ModelFileError
from hps.modelfiles.formats.sparse_folder import SparseModelReader, read_info, write_sparse_model
from hps.modelfiles.uri import LocalSource
from tests.conftest import make_table, write_table


def test_chunked_read_returns_the_files(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 1000, 12)
    write_table(tmp_path / "t", keys, vectors)
    reader = SparseModelReader(str(tmp_path / "t"), 12, chunk_bytes=12 * 4 * 64)
    assert reader.chunk_keys == 64
    chunks = list(reader.chunks())
    assert len(chunks) == 16  # 15 full chunks and the last partial one
    np.testing.assert_array_equal(np.concatenate([k for k, _ in chunks]), keys)
    np.testing.assert_array_equal(np.concatenate([v for _, v in chunks]), vectors)


def test_writer_round_trip_and_width_inference(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 100, 5)
    write_sparse_model(tmp_path / "t", keys, vectors)
    info = read_info(LocalSource(str(tmp_path / "t")))
    assert (info.num_keys, info.vec_size) == (100, 5)
    assert info.key_bytes == 800 and info.vector_bytes == 2000


def test_width_mismatch_reports_both_numbers(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 10, 8)
    write_table(tmp_path / "t", keys, vectors)
    with pytest.raises(ModelFileError, match=r"320 bytes but 10 keys × width 16 × 4 bytes = 640"):
        SparseModelReader(str(tmp_path / "t"), 16)


def test_truncated_files(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 10, 4)
    folder = write_table(tmp_path / "t", keys, vectors)
    data = (folder / "emb_vector").read_bytes()
    (folder / "emb_vector").write_bytes(data[:-2])
    with pytest.raises(ModelFileError, match="not a multiple of 4"):
        SparseModelReader(str(folder), 4)
    (folder / "emb_vector").write_bytes(data[:-16])
    with pytest.raises(ModelFileError, match="wrong embedding_vecsize_per_table, or a truncated"):
        SparseModelReader(str(folder), 4)
    (folder / "key").write_bytes((folder / "key").read_bytes()[:-3])
    with pytest.raises(ModelFileError, match="not a multiple of 8"):
        SparseModelReader(str(folder), 4)


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no 'key' file"):
        SparseModelReader(str(tmp_path / "absent"), 4)
    (tmp_path / "t").mkdir()
    np.arange(3, dtype="<i8").tofile(tmp_path / "t" / "key")
    with pytest.raises(ModelFileError, match="no 'emb_vector' file"):
        SparseModelReader(str(tmp_path / "t"), 4)


def test_writer_rejects_mismatched_arrays(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=r"\[num_keys, dim\]"):
        write_sparse_model(tmp_path / "t", np.arange(3), np.zeros((4, 2), np.float32))
