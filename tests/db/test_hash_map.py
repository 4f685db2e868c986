"""The in-process hash map tier beyond the Tier contract (tests/db/test_tier_contract.py):
its width check, slot-array rebuilds, overflow policies, memory bound, threads."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from hps.config import VolatileDBConfig
from hps.db.hash_map import HashMapTier
from hps.db.partition import partition_of
from hps.errors import ConfigError
from tests.db.rows import vectors_of

T = "hps_et.model.table0"


def config(**kw: Any) -> VolatileDBConfig:
    return VolatileDBConfig.model_validate(kw)


@pytest.fixture
def tier() -> HashMapTier:
    t = HashMapTier(config())
    t.create_table(T, 4)
    return t


def test_remove_everything_then_refill(tier: HashMapTier) -> None:
    keys = np.arange(50_000)
    tier.insert(T, keys, vectors_of(keys, 4))
    assert tier.remove(T, keys) == 50_000
    assert tier.size(T) == 0
    assert not tier.fetch(T, keys)[1].any()
    assert tier.memory_bytes(T) < 10_000  # slots and rows were given back
    tier.insert(T, keys[:10], vectors_of(keys[:10], 4))
    assert tier.fetch(T, keys[:20])[1].tolist() == [True] * 10 + [False] * 10


def test_many_keys_through_rebuilds(tier: HashMapTier) -> None:
    rng = np.random.default_rng(3)
    keys = np.unique(rng.integers(-(2**62), 2**62, 120_000))
    for chunk in np.array_split(keys, 7):
        tier.insert(T, chunk, vectors_of(chunk, 4))
    assert tier.size(T) == keys.size
    query = np.concatenate([keys, rng.integers(2**62, 2**63 - 1, 5000)])
    got, found = tier.fetch(T, query)
    assert found[: keys.size].all() and not found[keys.size :].any()
    assert np.array_equal(got[: keys.size], vectors_of(keys, 4))


def test_create_table_with_another_width_is_refused(tier: HashMapTier) -> None:
    with pytest.raises(ConfigError, match="width 4, not 8"):
        tier.create_table(T, 8)
    assert tier.size(T) == 0 and tier.dim(T) == 4


# -- overflow --------------------------------------------------------------------------


def keys_in_partition(partition: int, num_partitions: int, count: int) -> np.ndarray:
    candidates = np.arange(count * num_partitions * 4, dtype=np.int64)
    chosen = candidates[partition_of(candidates, num_partitions) == partition][:count]
    assert chosen.size == count
    return chosen


@pytest.mark.parametrize("policy", ["evict_random", "evict_least_used", "evict_oldest"])
def test_overflow_prunes_partition_to_target(policy: str) -> None:
    tier = HashMapTier(
        config(num_partitions=4, overflow_margin=50, overflow_resolution_target=0.8,
               overflow_policy=policy),
        seed=1,
    )
    tier.create_table(T, 2)
    keys = keys_in_partition(2, 4, 51)
    tier.insert(T, keys[:50], vectors_of(keys[:50], 2))
    assert tier.partition_sizes(T).tolist() == [0, 0, 50, 0]
    tier.insert(T, keys[50:], vectors_of(keys[50:], 2))
    assert tier.partition_sizes(T).tolist() == [0, 0, 40, 0]
    assert tier.size(T) == 40
    got, found = tier.fetch(T, keys)
    assert found.sum() == 40
    assert np.array_equal(got[found], vectors_of(keys[found], 2))


@pytest.mark.parametrize("policy", ["evict_random", "evict_least_used", "evict_oldest"])
def test_overflow_keeps_every_partition_within_margin(policy: str) -> None:
    tier = HashMapTier(
        config(num_partitions=8, overflow_margin=100, overflow_policy=policy), seed=2
    )
    tier.create_table(T, 2)
    rng = np.random.default_rng(5)
    for _ in range(30):
        keys = rng.integers(0, 1 << 40, 300)
        tier.insert(T, keys, vectors_of(keys, 2))
        sizes = tier.partition_sizes(T)
        assert sizes.max() <= 100
        assert sizes.sum() == tier.size(T)
    # every key still held answers with its own vector
    held = tier.size(T)
    assert 8 * 80 <= held <= 8 * 100


def test_evict_random_really_evicts_at_random() -> None:
    tier = HashMapTier(config(num_partitions=1, overflow_margin=1000,
                              overflow_resolution_target=0.5), seed=3)
    tier.create_table(T, 1)
    old, new = np.arange(0, 600), np.arange(600, 1001)
    tier.insert(T, old, np.zeros((600, 1)))
    tier.insert(T, new, np.zeros((401, 1)))
    assert tier.size(T) == 500
    kept_old = tier.fetch(T, old)[1].mean()
    kept_new = tier.fetch(T, new)[1].mean()
    assert 0.35 < kept_old < 0.65 and 0.35 < kept_new < 0.65


def test_evict_least_used_keeps_hot_keys() -> None:
    tier = HashMapTier(config(num_partitions=1, overflow_margin=100,
                              overflow_policy="evict_least_used",
                              overflow_resolution_target=0.5))
    tier.create_table(T, 2)
    keys = np.arange(100)
    tier.insert(T, keys, vectors_of(keys, 2))
    hot = keys[::3][:30]
    for _ in range(3):
        tier.fetch(T, hot)
    tier.fetch(T, np.repeat(keys[1:20:3], 1))  # lukewarm: one hit each
    tier.insert(T, np.array([1000]), vectors_of(np.array([1000]), 2))
    assert tier.size(T) == 50
    assert tier.fetch(T, hot)[1].all()


def test_evict_oldest_keeps_recent_keys() -> None:
    tier = HashMapTier(config(num_partitions=1, overflow_margin=100,
                              overflow_policy="evict_oldest",
                              overflow_resolution_target=0.5))
    tier.create_table(T, 2)
    old, mid, new = np.arange(0, 40), np.arange(40, 80), np.arange(80, 101)
    for batch in (old, mid, new):
        tier.insert(T, batch, vectors_of(batch, 2))
    tier.fetch(T, old)  # fetches do not refresh the stamp by default (as in HugeCTR)
    assert tier.size(T) == 50
    assert tier.fetch(T, new)[1].all()
    assert tier.fetch(T, mid)[1].sum() == 29
    assert not tier.fetch(T, old)[1].any()


def test_evict_oldest_with_refresh_time_after_fetch() -> None:
    tier = HashMapTier(config(num_partitions=1, overflow_margin=100,
                              overflow_policy="evict_oldest", overflow_resolution_target=0.5,
                              refresh_time_after_fetch=True))
    tier.create_table(T, 2)
    old, new = np.arange(0, 60), np.arange(60, 100)
    tier.insert(T, old, vectors_of(old, 2))
    tier.insert(T, new, vectors_of(new, 2))
    tier.fetch(T, old[:20])
    tier.insert(T, np.array([500]), vectors_of(np.array([500]), 2))
    assert tier.size(T) == 50
    assert tier.fetch(T, old[:20])[1].all()
    assert tier.fetch(T, np.array([500]))[1].all()


# -- memory ----------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("margin", [None, 10**9])
def test_memory_bound(dim: int, margin: int | None) -> None:
    """At most 1.5 × the raw key + vector bytes, whatever the fill of the slot array."""
    cfg = config() if margin is None else config(overflow_margin=margin,
                                                  overflow_policy="evict_oldest")
    tier = HashMapTier(cfg)
    tier.create_table(T, dim)
    rng = np.random.default_rng(dim)
    total = 0
    worst = 0.0
    for _ in range(40):
        keys = rng.integers(0, 2**62, 2500)
        tier.insert(T, keys, np.zeros((keys.size, dim), np.float32))
        total = tier.size(T)
        worst = max(worst, tier.memory_bytes(T) / (total * (8 + 4 * dim)))
    assert total > 99_000
    assert worst <= 1.5, worst


# -- threads ---------------------------------------------------------------------------


def test_threads_insert_fetch_remove() -> None:
    tier = HashMapTier(config())
    tier.create_table(T, 8)
    errors: list[BaseException] = []
    per_writer = 40_000

    def writer(w: int) -> None:
        try:
            keys = np.arange(w * per_writer, (w + 1) * per_writer)
            for chunk in np.array_split(keys, 20):
                tier.insert(T, chunk, vectors_of(chunk, 8))
                tier.remove(T, chunk[::10])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def reader(r: int) -> None:
        try:
            rng = np.random.default_rng(r)
            for _ in range(60):
                q = rng.integers(0, 3 * per_writer, 3000)
                got, found = tier.fetch(T, q)
                assert np.array_equal(got[found], vectors_of(q[found], 8))
                assert not got[~found].any()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    keys = np.arange(3 * per_writer)
    removed = np.concatenate(
        [c[::10] for w in range(3)
         for c in np.array_split(np.arange(w * per_writer, (w + 1) * per_writer), 20)]
    )
    got, found = tier.fetch(T, keys)
    assert found.sum() == keys.size - removed.size
    assert not found[removed].any()
    assert np.array_equal(got[found], vectors_of(keys[found], 8))


def test_concurrent_fetches_count_every_hit() -> None:
    tier = HashMapTier(config(num_partitions=1, overflow_margin=100,
                              overflow_policy="evict_least_used",
                              overflow_resolution_target=0.5))
    tier.create_table(T, 2)
    keys = np.arange(100)
    tier.insert(T, keys, vectors_of(keys, 2))
    hot, warm = keys[:40], keys[40:60]

    def fetcher() -> None:
        for _ in range(25):
            tier.fetch(T, hot)
            tier.fetch(T, warm[:1])

    threads = [threading.Thread(target=fetcher) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.fetch(T, np.repeat(warm, 99))  # 99 hits each: still fewer than the hot keys' 100
    tier.insert(T, np.array([1000]), vectors_of(np.array([1000]), 2))
    assert tier.size(T) == 50
    assert tier.fetch(T, hot)[1].all()  # 100 hits each, none lost between threads
