"""NumPy tables (keys.npy + vectors.npy folders, .npz files) written by NumPy itself,
served through HPS.lookup locally and from S3."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hps.errors import UnsupportedFormatError
from hps.modelfiles.formats import open_model
from tests.conftest import make_table
from tests.modelfiles.formats.conftest import assert_loads_nothing, assert_served, ps_config, upload
from tests.support.s3_server import S3Server


def save_folder(folder: Path, keys: np.ndarray, vectors: np.ndarray) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "keys.npy", keys)
    np.save(folder / "vectors.npy", vectors)
    return folder


def test_folder_local_is_memory_mapped(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 5000, 8)
    folder = save_folder(tmp_path / "t", keys, vectors)
    with open_model(str(folder)) as reader:
        assert reader.format == "numpy" and (reader.num_keys, reader.vec_size) == (5000, 8)
        _, rows = next(reader.chunks(100))
        assert isinstance(rows.base, np.memmap) or isinstance(rows, np.memmap)
    assert_served(ps_config(tmp_path, str(folder), 8), keys, vectors)


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_local(tmp_path: Path, rng: np.random.Generator, save: object) -> None:
    keys = rng.choice(2**32, 3000, replace=False).astype(np.uint32)
    vectors = rng.standard_normal((3000, 16)).astype(np.float16)
    save(tmp_path / "t.npz", keys=keys, vectors=vectors)  # type: ignore[operator]
    config = ps_config(tmp_path, str(tmp_path / "t.npz"), 16, supportlonglong=False)
    with open_model(str(tmp_path / "t.npz")) as reader:
        got = list(reader.chunks(700))  # compressed members stream chunk by chunk
    np.testing.assert_array_equal(np.concatenate([k for k, _ in got]), keys)
    assert_served(config, keys.astype(np.int64), vectors.astype(np.float32))


@pytest.mark.parametrize("form", ["folder", "npz", "npz_compressed"])
def test_from_s3(tmp_path: Path, rng: np.random.Generator, s3_server: S3Server,
                 form: str) -> None:
    keys, vectors = make_table(rng, 3000, 8)
    bucket = s3_server.new_bucket()
    if form == "folder":
        upload(s3_server, bucket, save_folder(tmp_path / "t", keys, vectors), "m/t")
        uri = f"s3://{bucket}/m/t"
    else:
        save = np.savez if form == "npz" else np.savez_compressed
        save(tmp_path / "t.npz", keys=keys, vectors=vectors)
        upload(s3_server, bucket, tmp_path / "t.npz", "m/t.npz")
        uri = f"s3://{bucket}/m/t.npz"
    assert_served(ps_config(tmp_path, uri, 8, s3=s3_server), keys, vectors)


# -- bad files ----------------------------------------------------------------------------


def test_object_dtype(tmp_path: Path) -> None:
    folder = save_folder(tmp_path / "t", np.arange(3), np.zeros((3, 4), np.float32))
    np.save(folder / "keys.npy", np.array([1, "two", 3], dtype=object), allow_pickle=True)
    assert_loads_nothing(tmp_path, str(folder), 4,
                         r"t/keys\.npy: object dtype \(pickled Python objects\)")
    np.savez(tmp_path / "o.npz", keys=np.array([1, None, 3], dtype=object),
             vectors=np.zeros((3, 4), np.float32))
    assert_loads_nothing(tmp_path, str(tmp_path / "o.npz"), 4, r"o\.npz.*object dtype")


def test_fortran_order(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 10, 4)
    folder = save_folder(tmp_path / "t", keys, np.asfortranarray(vectors))
    assert_loads_nothing(tmp_path, str(folder), 4, r"vectors\.npy: stored in Fortran order")


def test_mismatched_lengths_ranks_and_dtypes(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 10, 4)
    folder = save_folder(tmp_path / "t", keys, vectors[:9])
    assert_loads_nothing(tmp_path, str(folder), 4, "keys.npy holds 10 keys but vectors.npy "
                         "holds 9 rows")
    save_folder(folder, keys, vectors.reshape(10, 2, 2))
    assert_loads_nothing(tmp_path, str(folder), 4, r"2-D array .* got shape \[10, 2, 2\]")
    save_folder(folder, keys, vectors.astype(np.float64))
    assert_loads_nothing(tmp_path, str(folder), 4, r"float32 or float16, got float64: save")
    save_folder(folder, keys.astype(np.float64), vectors)
    assert_loads_nothing(tmp_path, str(folder), 4, "keys must be a 1-D integer array")


def test_truncated_files(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 10, 4)
    folder = save_folder(tmp_path / "t", keys, vectors)
    blob = (folder / "vectors.npy").read_bytes()
    (folder / "vectors.npy").write_bytes(blob[:-4])
    assert_loads_nothing(tmp_path, str(folder), 4, r"vectors\.npy is \d+ bytes but its header")
    (folder / "vectors.npy").write_bytes(blob[:20])
    assert_loads_nothing(tmp_path, str(folder), 4, r"vectors\.npy: not a readable \.npy")
    np.savez(tmp_path / "t.npz", keys=keys, vectors=vectors)
    blob = (tmp_path / "t.npz").read_bytes()
    (tmp_path / "t.npz").write_bytes(blob[: len(blob) // 2])
    assert_loads_nothing(tmp_path, str(tmp_path / "t.npz"), 4,
                         r"t\.npz: not a readable \.npz \(zip\) file")


def test_npz_without_the_arrays(tmp_path: Path, rng: np.random.Generator) -> None:
    keys, vectors = make_table(rng, 10, 4)
    np.savez(tmp_path / "t.npz", ids=keys, vectors=vectors)
    assert_loads_nothing(tmp_path, str(tmp_path / "t.npz"), 4,
                         r"t\.npz has no keys array \(arrays: ids, vectors\)")


def test_keys_out_of_range(tmp_path: Path, rng: np.random.Generator) -> None:
    keys = np.arange(5000, dtype=np.int64)
    keys[4321] = -1
    folder = save_folder(tmp_path / "t", keys, rng.standard_normal((5000, 4)).astype("f4"))
    assert_loads_nothing(tmp_path, str(folder), 4, "key -1 at row 4321 is out of range",
                         supportlonglong=False)


def test_a_lone_npy_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "vectors.npy", np.zeros((3, 4), np.float32))
    assert_loads_nothing(tmp_path, str(tmp_path / "vectors.npy"), 4,
                         "a single .npy holds one array", error=UnsupportedFormatError)
