from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps.errors import ModelFileError, SourceError, SourceNotFoundError
from hps.modelfiles.formats import ReadOptions, open_model
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


def test_what_is_wrong_with_a_folder_is_said_plainly(tmp_path: Path) -> None:
    """The load path's messages (open_model, as a server loads): a folder that does not
    exist, a key file that is a folder, an empty key file beside rows, a folder with no
    model files, a file named as a folder; exact sizes and reasons, never a key count of
    a folder's size or "nan floats per key"."""
    options = ReadOptions(vec_size=4)
    with pytest.raises(SourceNotFoundError, match=r"^sparse folder '.*absent' does not exist$"):
        open_model(str(tmp_path / "absent"), options)
    (tmp_path / "dir_key" / "key").mkdir(parents=True)
    np.zeros(40, "<f4").tofile(tmp_path / "dir_key" / "emb_vector")
    with pytest.raises(SourceError, match=r"dir_key/key' is a folder, not a model file$"):
        open_model(str(tmp_path / "dir_key"), options)
    (tmp_path / "empty_key").mkdir()
    (tmp_path / "empty_key" / "key").write_bytes(b"")
    np.zeros(40, "<f4").tofile(tmp_path / "empty_key" / "emb_vector")
    with pytest.raises(ModelFileError) as empty:
        open_model(str(tmp_path / "empty_key"), options)
    assert "empty_key/key is empty (0 bytes)" in str(empty.value)
    assert "emb_vector holds 160 bytes" in str(empty.value) and "nan" not in str(empty.value)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ModelFileError, match=r"'.*nothing' has no 'key' file.*holds no files"):
        open_model(str(tmp_path / "nothing"), options)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(SourceError, match="a_file' is a file, not a model folder"):
        open_model(str(tmp_path / "a_file"), options)
    # no keys and no rows: an empty table, served as one
    write_sparse_model(tmp_path / "none", np.zeros(0, np.int64), np.zeros((0, 4), np.float32))
    with open_model(str(tmp_path / "none"), options) as reader:
        assert reader.num_keys == 0
