"""The in-process hash map's compact storage (float16, bfloat16, int8): what it serves is
exactly the NumPy reference decode (hps/rows/storage_types.py) of what was inserted, within each
type's error bound of it, through every path that moves rows (insert, overwrite, remove,
growth, parallel fetch, export), and it refuses what the type cannot hold."""

from __future__ import annotations

import numpy as np
import pytest

from hps.config import VolatileDBConfig
from hps.errors import ConfigError, LookupInputError
from hps.rows.storage_types import decode, encode, error_bound, storage_type
from hps.tiers.hash_map import HashMapTier
from hps.tiers.hash_map.table import RESERVE_LOAD_MIN
from hps.tiers.hash_map.tier import PARALLEL_KEYS

T = "hps_et.m.t"
COMPACT = ("float16", "bfloat16", "int8")
ALL = ("float32", *COMPACT)


def _tier(storage: str, dim: int, **config: object) -> HashMapTier:
    tier = HashMapTier(VolatileDBConfig.model_validate({"num_partitions": 4, **config}))
    tier.create_table(T, dim, storage)
    return tier


def _reference(storage: str, rows: np.ndarray) -> np.ndarray:
    return decode(storage, encode(storage, rows), rows.shape[1])


def _rows(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    scale = 10.0 ** rng.uniform(-4, 3, size=(n, 1))
    return (rng.standard_normal((n, dim)) * scale).astype(np.float32)


def _adversarial(storage: str, dim: int) -> np.ndarray:
    big = np.float32(min(storage_type(storage).max_magnitude, 1e30)) / np.float32(1.01)
    rows = np.zeros((6, dim), np.float32)
    rows[0] = 3.25  # constant
    rows[1] = -0.0  # negative zero
    rows[2, ::2], rows[2, 1::2] = big, -big  # the widest range the type holds
    rows[3] = np.float32(2.0**-130) * np.arange(dim)  # subnormals
    rows[4] = 1000 + np.arange(dim, dtype=np.float32) * np.float32(6.1e-5)  # narrow range
    rows[5] = np.geomspace(1e-20, 1e3, dim, dtype=np.float32) * (-1) ** np.arange(dim)
    return rows


@pytest.mark.parametrize("storage", ALL)
@pytest.mark.parametrize("dim", [1, 7, 64])
def test_fetch_is_the_reference_decode_within_the_bound(storage: str, dim: int) -> None:
    rng = np.random.default_rng()
    rows = np.vstack([_rows(rng, 3000, dim), _adversarial(storage, dim)])
    keys = rng.choice(2**40, rows.shape[0], replace=False).astype(np.int64) - 2**39
    tier = _tier(storage, dim)
    tier.insert(T, keys, rows)
    # duplicates, absent keys, any order
    query = np.concatenate([keys[::-1], keys[:5], [2**50, -(2**50)], keys[-6:]])
    got, found = tier.fetch(T, query)
    expected = np.zeros((query.size, dim), np.float32)
    where = {int(k): i for i, k in enumerate(keys)}
    present = np.array([int(k) in where for k in query])
    rows_of = np.array([where.get(int(k), 0) for k in query])
    expected[present] = _reference(storage, rows[rows_of[present]])
    np.testing.assert_array_equal(found, present)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))  # bits
    error = np.abs(got[present].astype(np.float64) - rows[rows_of[present]])
    assert (error <= error_bound(storage, rows[rows_of[present]])).all()


@pytest.mark.parametrize("storage", COMPACT)
def test_rows_moved_by_overwrite_remove_growth_and_export_stay_exact(storage: str) -> None:
    rng = np.random.default_rng()
    dim = 24
    tier = _tier(storage, dim)
    keys = np.arange(20_000, dtype=np.int64)
    rows = _rows(rng, keys.size, dim)
    for start in range(0, keys.size, 1000):  # many inserts: rows and slots grow
        tier.insert(T, keys[start:start + 1000], rows[start:start + 1000])
    rows[::3] = _rows(rng, rows[::3].shape[0], dim)  # overwrite a third
    tier.insert(T, keys[::3], rows[::3])
    gone = keys[1::4]
    assert tier.remove(T, gone) == gone.size  # removal moves the last rows into the holes
    kept = np.setdiff1d(keys, gone)
    got, found = tier.fetch(T, kept)
    assert found.all()
    np.testing.assert_array_equal(got, _reference(storage, rows[kept]))
    assert not tier.fetch(T, gone)[1].any()
    exported = list(tier.export(T, lambda k: np.argsort(k), 4096))
    out_keys = np.concatenate([k for k, _ in exported])
    out_rows = np.concatenate([v for _, v in exported])
    assert out_rows.dtype == np.float32
    np.testing.assert_array_equal(out_keys, kept)
    np.testing.assert_array_equal(out_rows, _reference(storage, rows[kept]))


@pytest.mark.parametrize("storage", COMPACT)
def test_a_fetch_split_over_the_cores_is_the_same(storage: str) -> None:
    rng = np.random.default_rng()
    tier = _tier(storage, 8)
    keys = np.arange(50_000, dtype=np.int64)
    rows = _rows(rng, keys.size, 8)
    tier.insert(T, keys, rows)
    query = rng.integers(0, 60_000, size=4 * PARALLEL_KEYS)  # absent keys too
    got, found = tier.fetch(T, query)
    assert found.tolist() == (query < 50_000).tolist()
    expected = np.zeros((query.size, 8), np.float32)
    expected[found] = _reference(storage, rows[query[found]])
    np.testing.assert_array_equal(got, expected)


def test_every_float16_value_widens_exactly() -> None:
    """The compiled widening (LLVM's half → float) against NumPy for every finite
    float16, subnormals and both zeros included."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    halves = bits.view(np.float16)
    finite = halves[np.isfinite(halves)]
    tier = _tier("float16", finite.size)
    tier.insert(T, np.array([1]), finite.astype(np.float32)[None, :])
    got, _ = tier.fetch(T, np.array([1]))
    np.testing.assert_array_equal(got[0].view(np.uint32),
                                  finite.astype(np.float32).view(np.uint32))
    out = np.empty((1, finite.size), np.float16)
    tier.fetch_into(T, np.array([1]), out)
    np.testing.assert_array_equal(out[0].view(np.uint16), finite.view(np.uint16))


@pytest.mark.parametrize(("storage", "narrow"), [("float16", np.float16),
                                                 ("bfloat16", np.uint16)])
def test_16_bit_outputs_get_the_stored_bits(storage: str, narrow: type) -> None:
    rng = np.random.default_rng()
    rows = _rows(rng, 100, 16)
    tier = _tier(storage, 16)
    tier.insert(T, np.arange(100), rows)
    query = np.array([3, 500, 3, 99])
    out = np.full((4, 16), 7, narrow)
    found = tier.fetch_into(T, query, out)
    assert found.tolist() == [True, False, True, True]
    stored = encode(storage, rows[[3, 3, 99]])
    np.testing.assert_array_equal(out[[0, 2, 3]].view(np.uint16), stored.view(np.uint16))
    assert not out[1].view(np.uint16).any()  # absent: +0.0


@pytest.mark.parametrize(("storage", "bad"), [
    ("float32", np.float16), ("int8", np.float16), ("float16", np.uint16),
    ("bfloat16", np.float16), ("float16", np.float64)])
def test_other_output_dtypes_are_refused(storage: str, bad: type) -> None:
    tier = _tier(storage, 4)
    tier.insert(T, np.arange(3), np.ones((3, 4), np.float32))
    out = np.zeros((3, 4), bad)
    with pytest.raises(LookupInputError, match="fetch_into needs a writable C-contiguous "
                                               "float32"):
        tier.fetch_into(T, np.arange(3), out)
    assert not out.any()


@pytest.mark.parametrize("storage", COMPACT)
def test_rows_the_type_cannot_hold_are_refused_and_nothing_is_written(storage: str) -> None:
    tier = _tier(storage, 4)
    tier.insert(T, np.arange(3), np.ones((3, 4), np.float32))
    limit = storage_type(storage).max_magnitude
    for value in (np.nan, np.inf, -np.inf, limit, -limit * 1.001):
        rows = np.full((3, 4), 2.0, np.float32)
        rows[1, 2] = value
        with pytest.raises(LookupInputError, match=f"stores {storage} rows.*row 1 holds"):
            tier.insert(T, np.array([0, 7, 8]), rows)
        assert tier.size(T) == 3
        np.testing.assert_array_equal(tier.fetch(T, np.arange(3))[0], np.ones((3, 4)))


def test_float32_tables_store_anything() -> None:
    tier = _tier("float32", 2)
    rows = np.array([[np.nan, np.inf], [3e38, -0.0]], np.float32)
    tier.insert(T, np.arange(2), rows)
    np.testing.assert_array_equal(tier.fetch(T, np.arange(2))[0].view(np.uint32),
                                  rows.view(np.uint32))


def test_a_table_keeps_its_storage_type() -> None:
    tier = _tier("int8", 4)
    assert tier.storage(T).name == "int8"
    tier.create_table(T, 4, "int8")  # the same: kept
    with pytest.raises(ConfigError, match="stores int8 rows, not float16: drop it first"):
        tier.create_table(T, 4, "float16")
    with pytest.raises(ConfigError, match="expected one of float32, float16"):
        tier.create_table("hps_et.m.u", 4, "fp8")


@pytest.mark.parametrize("storage", ALL)
def test_memory_bytes_follow_the_storage_type(storage: str) -> None:
    n, dim = 100_000, 64
    tier = _tier(storage, dim)
    tier.reserve(T, n)
    tier.insert(T, np.arange(n), np.ones((n, dim), np.float32))
    held = tier.memory_bytes(T)
    assert held == HashMapTier.memory_required(n, dim, storage, num_partitions=4)
    vector_bytes = {"float32": 4 * dim, "float16": 2 * dim, "bfloat16": 2 * dim,
                    "int8": dim + 8}[storage]
    rows = n * (8 + vector_bytes)
    # keys and vectors, and 4-byte slots at a load of at least RESERVE_LOAD_MIN
    assert rows <= held <= rows + 4 * n / RESERVE_LOAD_MIN + 1024
    assert tier.stats()["memory_bytes"] == held


@pytest.mark.parametrize("storage", COMPACT)
def test_bounded_tables_evict_compact_rows_exactly(storage: str) -> None:
    rng = np.random.default_rng()
    tier = _tier(storage, 8, overflow_margin=500, overflow_policy="evict_least_used",
                 overflow_resolution_target=0.5)
    rows = _rows(rng, 4000, 8)
    for start in range(0, 4000, 400):
        tier.insert(T, np.arange(start, start + 400), rows[start:start + 400])
        tier.fetch(T, np.arange(0, start + 400, 3))
    got, found = tier.fetch(T, np.arange(4000))
    assert 0 < found.sum() <= 4 * 500
    np.testing.assert_array_equal(got[found], _reference(storage, rows[found]))
