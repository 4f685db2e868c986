"""Invariants of the lookup path (docs/architecture.md), checked with hypothesis over real tiers."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hps.server import HierarchicalParameterServer

TABLE = "hps_et.m.sparse_embedding0"
DIM = 8
fixture_ok = settings(max_examples=40, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])
keys_st = st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=40)


@pytest.fixture
def server(two_tables: dict[str, Any]) -> Any:
    config = copy.deepcopy(two_tables["config"])
    config["volatile_db"]["initial_cache_rate"] = 0.0
    with HierarchicalParameterServer(config) as s:
        yield s


def rows_for(keys: np.ndarray, salt: float) -> np.ndarray:
    return (keys[:, None] % 1000).astype(np.float32) + salt + np.arange(DIM, dtype=np.float32)


@fixture_ok
@given(volatile_keys=keys_st, persistent_keys=keys_st, probe=keys_st)
def test_lookup_returns_the_highest_tier_holding_the_key(
    server: Any, volatile_keys: list[int], persistent_keys: list[int], probe: list[int]
) -> None:
    v = np.unique(np.array(volatile_keys, np.int64))
    p = np.unique(np.array(persistent_keys, np.int64))
    server.persistent.insert(TABLE, p, rows_for(p, 0.25))
    server.volatile.insert(TABLE, v, rows_for(v, 0.75))
    keys = np.array(probe + volatile_keys[:3] + persistent_keys[:3], np.int64)
    got = server.lookup("m", 0, keys)
    # expected: what the highest tier holding each key holds, across all examples so far
    vol_rows, vol_found = server.volatile.fetch(TABLE, keys)
    per_rows, per_found = server.persistent.fetch(TABLE, keys)
    expected = np.where(vol_found[:, None], vol_rows, np.where(per_found[:, None], per_rows, 0.5))
    np.testing.assert_array_equal(got, expected)
    assert np.all(vol_found[np.isin(keys, v)])  # what was just inserted is held


@fixture_ok
@given(probe=keys_st, repeats=st.integers(1, 4))
def test_duplicates_alike_and_lookups_idempotent(server: Any, probe: list[int], repeats: int
                                                 ) -> None:
    keys = np.array(probe * repeats, np.int64)
    first = server.lookup("m", 0, keys)
    second = server.lookup("m", 0, keys)
    np.testing.assert_array_equal(first, second)
    _, index = np.unique(keys, return_index=True)
    canonical = first[index][np.searchsorted(np.unique(keys), keys)]
    np.testing.assert_array_equal(first, canonical)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(["evict_random", "evict_least_used", "evict_oldest"]),
       margin=st.integers(1, 50), seed=st.integers(0, 2**32 - 1))
def test_overflow_pruning_never_loses_what_rocksdb_holds(
    two_tables: dict[str, Any], policy: str, margin: int, seed: int
) -> None:
    config = copy.deepcopy(two_tables["config"])
    config["volatile_db"].update(overflow_policy=policy, overflow_margin=margin,
                                 num_partitions=2, cache_missed_embeddings=True)
    keys, vectors = two_tables["tables"][0]
    rng = np.random.default_rng(seed)
    with HierarchicalParameterServer(config) as server:
        assert server.volatile.size(TABLE) <= 2 * margin
        for _ in range(5):
            rows = rng.integers(0, len(keys), size=300)
            np.testing.assert_array_equal(server.lookup("m", 0, keys[rows]), vectors[rows])
            assert server.volatile.size(TABLE) <= 2 * margin
