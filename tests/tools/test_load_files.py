"""The load benchmark's synthetic files: distinct keys, rows known without the files."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hps.modelfiles.formats.sparse_folder import SparseModelReader
from hps.tools.bench import load_files


def test_a_written_table_holds_distinct_keys_and_the_rows_rows_of_gives(tmp_path: Path
                                                                          ) -> None:
    num_keys, dim = 50_003, 5  # blocks of a few rows: many threads, a short last block
    load_files.BLOCK_BYTES, saved = 4 * dim * 997, load_files.BLOCK_BYTES
    try:
        load_files.write_table(str(tmp_path / "t"), num_keys, dim, threads=3)
    finally:
        load_files.BLOCK_BYTES = saved
    reader = SparseModelReader(str(tmp_path / "t"), dim)
    keys, rows = reader.read_keys(0, num_keys), reader.read_vectors(0, num_keys)
    assert np.unique(keys).size == num_keys and keys.min() >= 0
    assert not np.all(keys[1:] > keys[:-1])  # in no order, as a trained model's
    assert np.array_equal(keys, load_files.keys_of(np.arange(num_keys)))
    assert np.array_equal(rows, load_files.rows_of(keys, dim))
    assert rows.min() >= 0.0 and rows.max() < 1.0 and np.unique(rows).size > num_keys


def test_keys_of_is_a_permutation_of_row_numbers_not_a_hash_with_collisions() -> None:
    rows = np.arange(2_000_000, dtype=np.int64)
    assert np.unique(load_files.keys_of(rows)).size == rows.size
    far = np.array([2**40, 2**61, 2**62 - 1], np.int64)  # still distinct, still in range
    keys = load_files.keys_of(far)
    assert np.unique(keys).size == 3 and keys.min() >= 0 and keys.max() < 2**62
