"""The contract of `hps.tiers.bulk_load.BulkLoadTier`, run against every tier on real
backends (`backend` in tests/tiers/conftest.py: the hash map, Redis standalone, a Redis
Cluster, RocksDB): what a load writes and the load record kept with a table. The paths
particular to a tier (RocksDB's table files, the hash map's rows read back in place) are
tested in its own file.
"""

from __future__ import annotations

import numpy as np

from hps.tiers.bulk_load import BulkLoadTier
from tests.support.rows import vectors_of
from tests.tiers.conftest import DIM

# -- loads ------------------------------------------------------------------------------


def test_load(tier: BulkLoadTier, table: str) -> None:
    keys = np.random.default_rng(4).permutation(np.arange(-3000, 3000))
    chunks = [(c, vectors_of(c, DIM)) for c in np.array_split(keys, 5)]
    assert tier.load(table, chunks) == 6000
    assert tier.size(table) == 6000
    got, found = tier.fetch(table, keys)
    assert found.all() and np.array_equal(got, vectors_of(keys, DIM))


def test_load_duplicates_last_wins_and_keeps_other_rows(tier: BulkLoadTier, table: str) -> None:
    tier.insert(table, np.array([100, 1]), vectors_of(np.array([100, 1]), DIM, salt=0.25))
    chunks = [
        (np.array([1, 2, 1, 3]), np.arange(16, dtype=np.float32).reshape(4, DIM)),
        (np.array([3, 4]), np.full((2, DIM), 7.0, np.float32)),
        (np.array([], dtype=np.int64), np.zeros((0, DIM), np.float32)),
    ]
    assert tier.load(table, chunks) == 6
    got, found = tier.fetch(table, np.array([1, 2, 3, 4, 100]))
    assert found.all()
    assert got[0].tolist() == [8, 9, 10, 11]  # last of the chunk
    assert got[2].tolist() == [7, 7, 7, 7]  # the later chunk overrides
    assert np.array_equal(got[4], vectors_of(np.array([100]), DIM, salt=0.25)[0])
    assert tier.size(table) == 5


# -- the load record --------------------------------------------------------------------


def test_drop_table_forgets_its_load_record(tier: BulkLoadTier, table: str) -> None:
    tier.insert(table, np.array([1]), np.ones((1, DIM)))
    tier.set_metadata(table, {"a": 1})
    tier.drop_table(table)
    assert table not in tier.tables() and tier.metadata(table) is None
