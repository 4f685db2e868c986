"""The contract of `hps.tiers.contract.Tier`, run against every tier on real backends.

One suite, four backends (`backend` in tests/tiers/conftest.py): the in-process hash map,
Redis standalone, a 3-master Redis Cluster (both real `redis-server` processes) and RocksDB
in a temporary folder. The bulk-load contract has its suite beside this one
(tests/tiers/test_bulk_load.py); the dict model below mixes loads into its sequences. What a
single tier does beyond the contracts (layouts, overflow policies, faults, bulk-load files,
memory bounds) is tested in its own file.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hps.errors import LookupInputError, UnknownTableError
from hps.tiers.bulk_load import BulkLoadTier
from hps.tiers.contract import Tier
from tests.support.redis_servers import eventually
from tests.support.rows import vectors_of
from tests.tiers.conftest import DIM, Backend

# -- tables -----------------------------------------------------------------------------


def test_tables_are_separate_listed_and_keep_contents(tier: Tier, table: str) -> None:
    other = table + "b"
    tier.create_table(other, 2)
    assert tier.dim(table) == DIM and tier.dim(other) == 2
    tier.insert(table, np.array([1]), np.ones((1, DIM)))
    tier.insert(other, np.array([1, 2]), np.full((2, 2), 3.0))
    tier.create_table(table, DIM)  # keeps contents
    assert tier.size(table) == 1 and tier.size(other) == 2
    assert tier.tables() == [table, other]
    got, found = tier.fetch(other, np.array([1, 2]))
    assert found.all() and np.array_equal(got, np.full((2, 2), 3.0))
    tier.drop_table(other)
    assert tier.tables() == [table]
    with pytest.raises(UnknownTableError):
        tier.size(other)


def test_unknown_table_is_an_error_everywhere(tier: Tier, table: str) -> None:
    nope = "hps_et.contract.nope" + uuid.uuid4().hex[:8]
    keys = np.array([1], dtype=np.int64)
    calls: list[Callable[[], object]] = [
        lambda: tier.dim(nope),
        lambda: tier.fetch(nope, keys),
        lambda: tier.insert(nope, keys, np.ones((1, DIM))),
        lambda: tier.remove(nope, keys),
        lambda: tier.size(nope),
    ]
    for call in calls:
        with pytest.raises(UnknownTableError, match="no table"):
            call()
    assert nope not in tier.tables()


def test_drop_table(tier: Tier, table: str) -> None:
    tier.insert(table, np.array([1]), np.ones((1, DIM)))
    tier.drop_table(table)
    assert table not in tier.tables()
    with pytest.raises(UnknownTableError):
        tier.fetch(table, np.array([1]))
    tier.create_table(table, DIM)  # comes back empty
    assert tier.size(table) == 0 and not tier.fetch(table, np.array([1]))[1].any()


# -- fetch and insert -------------------------------------------------------------------


def test_round_trip_extremes_and_missing(tier: Tier, table: str) -> None:
    # int64 extremes, negative keys and keys with trailing zero bytes (256)
    keys = np.array([5, -3, 2**63 - 1, -(2**63), 0, 256], dtype=np.int64)
    tier.insert(table, keys, vectors_of(keys, DIM))
    query = np.array([0, 7, 5, -(2**63), 1, 2**63 - 1, -3, 256, 8])
    got, found = tier.fetch(table, query)
    assert got.dtype == np.float32 and got.shape == (9, DIM) and found.dtype == bool
    assert found.shape == (9,)
    assert found.tolist() == [True, False, True, True, False, True, True, True, False]
    assert np.array_equal(got[found], vectors_of(query[found], DIM))
    assert not got[~found].any()
    assert tier.size(table) == 6


def test_vectors_come_back_bit_exact(tier: Tier, table: str) -> None:
    rng = np.random.default_rng()
    keys = np.unique(rng.integers(-(2**62), 2**62, 2000))
    rows = rng.standard_normal((keys.size, DIM)).astype(np.float32)
    # signed zero, infinities and a subnormal come back as they went in
    rows[0] = np.array([-0.0, np.inf, -np.inf, 1e-45], np.float32)
    tier.insert(table, keys, rows)
    order = rng.permutation(keys.size)
    got, found = tier.fetch(table, keys[order])
    assert found.all()
    assert np.array_equal(got.view(np.uint32), rows[order].view(np.uint32))


def test_fresh_table_all_missing_and_empty_batches(tier: Tier, table: str) -> None:
    got, found = tier.fetch(table, np.array([1, 2, 3]))
    assert not found.any() and not got.any() and got.shape == (3, DIM)
    got, found = tier.fetch(table, np.array([], dtype=np.int64))
    assert got.shape == (0, DIM) and found.shape == (0,)
    tier.insert(table, np.array([], dtype=np.int64), np.zeros((0, DIM), np.float32))
    assert tier.size(table) == 0
    assert tier.remove(table, np.array([], dtype=np.int64)) == 0


def test_duplicates_in_fetch_are_answered_alike(tier: Tier, table: str) -> None:
    tier.insert(table, np.array([1, 2]), vectors_of(np.array([1, 2]), DIM))
    got, found = tier.fetch(table, np.array([2, 1, 2, 9, 2, 9]))
    assert found.tolist() == [True, True, True, False, True, False]
    assert np.array_equal(got[[0, 2, 4]], vectors_of(np.array([2, 2, 2]), DIM))
    assert np.array_equal(got[1], vectors_of(np.array([1]), DIM)[0])
    assert not got[[3, 5]].any()


def test_duplicates_in_insert_last_one_wins(tier: Tier, table: str) -> None:
    keys = np.array([4, 5, 4, 4, 6, 5])
    vecs = np.arange(24, dtype=np.float32).reshape(6, DIM)
    tier.insert(table, keys, vecs)
    got, found = tier.fetch(table, np.array([4, 5, 6]))
    assert found.all() and np.array_equal(got, vecs[[3, 5, 4]])
    assert tier.size(table) == 3


def test_overwrite_keeps_size(tier: Tier, table: str) -> None:
    keys = np.arange(100)
    tier.insert(table, keys, vectors_of(keys, DIM))
    tier.insert(table, keys[::2], vectors_of(keys[::2], DIM, salt=0.5))
    got, found = tier.fetch(table, keys)
    assert found.all() and tier.size(table) == 100
    assert np.array_equal(got[::2], vectors_of(keys[::2], DIM, salt=0.5))
    assert np.array_equal(got[1::2], vectors_of(keys[1::2], DIM))


def test_keys_of_other_int_types_are_widened(tier: Tier, table: str) -> None:
    tier.insert(table, np.array([1, 2], dtype=np.uint32), np.ones((2, DIM)))
    got, found = tier.fetch(table, np.array([2, 3], dtype=np.int32))
    assert found.tolist() == [True, False]
    assert np.array_equal(got[0], np.ones(DIM))


@pytest.mark.parametrize("shape", [(2, DIM), (3, DIM + 1), (3, 2 * DIM), (7,)])
def test_wrong_width_insert_is_refused_and_changes_nothing(
    tier: Tier, table: str, shape: tuple[int, ...]
) -> None:
    kept = np.array([1, 2], dtype=np.int64)
    tier.insert(table, kept, vectors_of(kept, DIM))
    with pytest.raises(LookupInputError, match=f"3 keys need 3 × {DIM}"):
        tier.insert(table, np.array([1, 2, 3]), np.ones(shape))
    got, found = tier.fetch(table, np.array([1, 2, 3]))
    assert found.tolist() == [True, True, False]
    assert np.array_equal(got[:2], vectors_of(kept, DIM))
    assert tier.size(table) == 2


def test_insert_async_rows_arrive_from_a_copy(tier: Tier, table: str) -> None:
    keys = np.arange(-150, 150)
    buffer = vectors_of(keys, DIM)
    assert tier.insert_async(table, keys, buffer)
    buffer[:] = 0  # the tier took a copy
    # network tiers write in the background: poll until the rows are there
    eventually(lambda: tier.fetch(table, keys)[1].all() or 1 / 0, 5, "rows did not arrive")
    got, _ = tier.fetch(table, keys)
    assert np.array_equal(got, vectors_of(keys, DIM))
    with pytest.raises(LookupInputError, match=f"3 keys need 3 × {DIM}"):
        tier.insert_async(table, np.array([1, 2, 3]), np.ones((3, DIM + 1)))
    assert tier.size(table) == keys.size


# -- remove -----------------------------------------------------------------------------


def test_remove(tier: Tier, table: str) -> None:
    keys = np.arange(1000)
    tier.insert(table, keys, vectors_of(keys, DIM))
    assert tier.size(table) == 1000
    # duplicates and absent keys in the batch count once and not at all
    assert tier.remove(table, np.array([3, 3, 5, 2000, -1, 999])) == 3
    assert tier.size(table) == 997
    got, found = tier.fetch(table, keys)
    gone = np.isin(keys, [3, 5, 999])
    assert not found[gone].any() and found[~gone].all()
    assert np.array_equal(got[~gone], vectors_of(keys[~gone], DIM))
    assert tier.remove(table, np.array([3])) == 0
    # removed keys come back cleanly
    tier.insert(table, np.array([5]), vectors_of(np.array([5]), DIM, salt=9))
    got, found = tier.fetch(table, np.array([5]))
    assert found[0] and np.array_equal(got[0], vectors_of(np.array([5]), DIM, salt=9)[0])
    assert tier.size(table) == 998


# -- health ----------------------------------------------------------------------------


def test_stats_of_a_healthy_tier(tier: Tier, table: str) -> None:
    tier.insert(table, np.arange(10), vectors_of(np.arange(10), DIM))
    tier.fetch(table, np.arange(20))
    stats = tier.stats()
    assert stats["available"] is True
    assert stats["failures"] == {} and stats["dropped"] == {}


# -- close ------------------------------------------------------------------------------


def test_close_releases_the_store(backend: Backend, tier: Tier, table: str) -> None:
    keys = np.arange(-10, 10)
    tier.insert(table, keys, vectors_of(keys, DIM))
    backend.close(tier)
    # a second tier opens over the same store (RocksDB refuses a second writer while the
    # first is open) and sees the rows where the store outlives the process's tier
    again = backend.open()
    again.create_table(table, DIM)
    got, found = again.fetch(table, keys)
    if backend.durable:
        assert found.all() and np.array_equal(got, vectors_of(keys, DIM))
    else:
        assert not found.any() and again.size(table) == 0


# -- a dict model -----------------------------------------------------------------------

key_values = st.one_of(
    st.integers(-40, 40), st.sampled_from([-(2**63), 2**63 - 1, 2**40, 256])
)
ops = st.lists(
    st.tuples(st.sampled_from(["insert", "remove", "load", "fetch"]),
              st.lists(key_values, max_size=60)),
    max_size=25,
)


def test_answers_like_a_dict(backend: Backend, tier: BulkLoadTier) -> None:
    """Random sequences of inserts, loads and removes answer as a dict would."""

    @settings(max_examples=backend.examples, deadline=None)
    @given(sequence=ops)
    def check(sequence: list[tuple[str, list[int]]]) -> None:
        table = f"hps_et.contract.prop{uuid.uuid4().hex[:12]}"
        tier.create_table(table, 3)
        model: dict[int, np.ndarray] = {}
        for step, (op, key_list) in enumerate(sequence):
            keys = np.array(key_list, dtype=np.int64)
            vecs = vectors_of(keys, 3, salt=step)
            if op == "insert":
                tier.insert(table, keys, vecs)
                model.update(zip(key_list, vecs, strict=True))
            elif op == "load":
                half = len(key_list) // 2
                tier.load(table, [(keys[:half], vecs[:half]), (keys[half:], vecs[half:])])
                model.update(zip(key_list, vecs, strict=True))
            elif op == "remove":
                assert tier.remove(table, keys) == len(set(key_list) & model.keys())
                for k in key_list:
                    model.pop(k, None)
            probe = np.array(key_list + [41, -41], dtype=np.int64)
            got, found = tier.fetch(table, probe)
            assert found.tolist() == [k in model for k in probe.tolist()]
            zero = np.zeros(3, np.float32)
            expected = np.array([model.get(k, zero) for k in probe.tolist()], np.float32)
            assert np.array_equal(got, expected.reshape(-1, 3))
            assert tier.size(table) == len(model)
        tier.drop_table(table)

    check()


def test_clear_table_empties_it_and_keeps_it_known(tier: Tier, table: str) -> None:
    tier.insert(table, np.array([1, 2]), np.ones((2, DIM)))
    tier.clear_table(table, DIM)
    assert table in tier.tables() and tier.dim(table) == DIM
    assert tier.size(table) == 0 and not tier.fetch(table, np.array([1, 2]))[1].any()
    tier.insert(table, np.array([3]), np.full((1, DIM), 3.0))
    vectors, found = tier.fetch(table, np.array([3]))
    assert found.all() and (vectors == 3.0).all()
