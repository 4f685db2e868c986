"""The key mixer and partition function, against a plain-Python rrxmrrxmsx_0."""

from __future__ import annotations

import numpy as np
import pytest

from hps.tiers.partition import partition_of, partition_of_mixed, rrxmrrxmsx_0

MASK = 2**64 - 1


def _ror(x: int, r: int) -> int:
    return ((x >> r) | (x << (64 - r))) & MASK


def reference_rrxmrrxmsx_0(key: int) -> int:
    """Pelle Evensen's rrxmrrxmsx_0 with Python ints, written out from the definition."""
    x = key & MASK
    x ^= _ror(x, 25) ^ _ror(x, 50)
    x = (x * 0xA24BAED4963EE407) & MASK
    x ^= _ror(x, 24) ^ _ror(x, 49)
    x = (x * 0x9FB21C651E98DF25) & MASK
    return x ^ (x >> 28)


KEYS = [0, 1, -1, 2, 42, 2**31 - 1, 2**32, 2**63 - 1, -(2**63), 0x0123456789ABCDEF, -12345]


def test_rrxmrrxmsx_0_matches_reference() -> None:
    got = rrxmrrxmsx_0(np.array(KEYS, dtype=np.int64))
    assert got.dtype == np.uint64
    assert got.tolist() == [reference_rrxmrrxmsx_0(k) for k in KEYS]


def test_rrxmrrxmsx_0_known_values() -> None:
    # Pinned so that a change of the mixer (and of every Redis layout) cannot pass unseen.
    assert rrxmrrxmsx_0(np.array([0, 1, -1, 2**63 - 1])).tolist() == [
        0,
        985654925471400243,
        16399884477989705468,
        2387706527826741422,
    ]


def test_rrxmrrxmsx_0_random_keys_match_reference() -> None:
    keys = np.random.default_rng(7).integers(-(2**63), 2**63 - 1, 200, dtype=np.int64)
    assert rrxmrrxmsx_0(keys).tolist() == [reference_rrxmrrxmsx_0(int(k)) for k in keys]


def test_rrxmrrxmsx_0_leaves_input_alone_and_takes_narrow_ints() -> None:
    keys = np.array([3, 4, 5], dtype=np.int64)
    rrxmrrxmsx_0(keys)
    assert keys.tolist() == [3, 4, 5]
    unsigned = np.array([3, 4, 5], dtype=np.uint32)
    assert rrxmrrxmsx_0(unsigned).tolist() == rrxmrrxmsx_0(keys).tolist()
    narrow = np.array([-1], dtype=np.int32)
    assert rrxmrrxmsx_0(narrow).tolist() == [reference_rrxmrrxmsx_0(-1)]


@pytest.mark.parametrize("num_partitions", [1, 2, 7, 16, 100, 65536])
def test_partition_of_matches_reference(num_partitions: int) -> None:
    got = partition_of(np.array(KEYS, dtype=np.int64), num_partitions)
    assert got.dtype == np.int64
    assert got.tolist() == [reference_rrxmrrxmsx_0(k) % num_partitions for k in KEYS]


def test_partition_of_mixed_agrees() -> None:
    keys = np.arange(-500, 500, dtype=np.int64)
    for n in (3, 16):
        assert np.array_equal(partition_of_mixed(rrxmrrxmsx_0(keys), n), partition_of(keys, n))


def test_partitions_are_balanced() -> None:
    parts = partition_of(np.arange(160_000, dtype=np.int64), 16)
    counts = np.bincount(parts, minlength=16)
    assert counts.min() > 9_000 and counts.max() < 11_000


def test_bad_partition_count() -> None:
    with pytest.raises(ValueError, match="num_partitions"):
        partition_of(np.array([1]), 0)
