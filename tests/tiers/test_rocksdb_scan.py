"""A RocksDB table read back whole (`scan`) and its mark (`stored_version`): real stores
in temporary directories."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hps.config import PersistentDBConfig
from hps.tiers.rocksdb.bulk import bytewise_order
from hps.tiers.rocksdb.tier import RocksDBTier

T = "hps_et.model.table0"


def open_tier(store: Path) -> RocksDBTier:
    return RocksDBTier(PersistentDBConfig.model_validate({"type": "rocks_db",
                                                          "path": str(store)}))


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[RocksDBTier]:
    t = open_tier(tmp_path / "rocks")
    t.create_table(T, 4)
    yield t
    t.close()


def test_a_scan_gives_every_row_in_bytewise_order_in_chunks(
        tier: RocksDBTier, rng: np.random.Generator) -> None:
    keys = rng.choice(np.int64(2**62), 5000, replace=False) - np.int64(2**61)
    rows = rng.standard_normal((5000, 4)).astype(np.float32)
    tier.load(T, [(keys, rows)])
    tier.insert(T, keys[:10], rows[:10] + 1)  # newer rows of some keys, in a memtable
    chunks = list(tier.scan(T, 1024))
    assert [len(k) for k, _ in chunks] == [1024] * 4 + [904]
    got_keys = np.concatenate([k for k, _ in chunks])
    got_rows = np.concatenate([r for _, r in chunks])
    order = bytewise_order(keys)
    np.testing.assert_array_equal(got_keys, keys[order])
    expected = rows.copy()
    expected[:10] += 1
    np.testing.assert_array_equal(got_rows, expected[order])


def test_rows_of_another_width_are_left_out_and_counted(tier: RocksDBTier) -> None:
    tier.insert(T, np.array([1, 2, 3]), np.ones((3, 4)))
    tier.raw_table(T)[np.int64(2).tobytes()] = b"\0" * 12  # 3 floats wide
    [(keys, rows)] = list(tier.scan(T, 1024))
    assert sorted(keys.tolist()) == [1, 3] and rows.shape == (2, 4)
    assert tier.stats()["failures"] == {"bad_row": 1}


def test_the_mark_changes_with_every_write_and_is_unknown_while_a_memtable_holds_one(
        tier: RocksDBTier) -> None:
    keys = np.arange(100, dtype=np.int64)
    tier.load(T, [(keys, np.ones((100, 4), np.float32))])
    loaded = tier.stored_version(T)
    assert loaded and tier.stored_version(T) == loaded  # reads change nothing
    list(tier.scan(T, 64))
    tier.fetch(T, keys)
    assert tier.stored_version(T) == loaded
    tier.insert(T, keys[:1], np.zeros((1, 4)))
    assert tier.stored_version(T) == ""  # in the memtable: not known to be the load's
    path = Path(tier.path)
    tier.close()
    gc.collect()
    reopened = open_tier(path)
    try:
        reopened.create_table(T, 4)
        flushed = reopened.stored_version(T)
        assert flushed and flushed != loaded
        reopened.remove(T, keys[1:2])
        assert reopened.stored_version(T) == ""
        reopened.load(T, [(keys[:5], np.ones((5, 4), np.float32))])  # an ingestion too
        assert reopened.stored_version(T) not in ("", loaded, flushed)
    finally:
        reopened.close()
