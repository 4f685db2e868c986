"""Partition of a key: Pelle Evensen's rrxmrrxmsx_0 mixer, as HugeCTR used it.

`partition_of(key) = rrxmrrxmsx_0(uint64(key)) % num_partitions` (HugeCTR's Redis layout). The
volatile tiers share it: the hash map counts its overflow margin per partition, the Redis
tier names its hashes by it, so a Redis filled by HugeCTR is read as it is.

Both functions are vectorized over a whole key array; uint64 arithmetic wraps, as in C.
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xA24BAED4963EE407)
_M2 = np.uint64(0x9FB21C651E98DF25)


def rrxmrrxmsx_0(keys: np.ndarray) -> np.ndarray:
    """rrxmrrxmsx_0 of each key, read as uint64 (int64 -1 is 2**64-1).

    Takes any integer array; returns a new uint64 array of the same length (1-D).
    """
    x = np.array(keys, dtype=np.int64, copy=True).reshape(-1).view(np.uint64)
    a = np.empty_like(x)
    b = np.empty_like(x)
    # ror(x, r) = (x >> r) | (x << 64 - r); the two halves share no bit, so | is ^.
    _xor_rotations(x, 25, 50, a, b)
    x *= _M1
    _xor_rotations(x, 24, 49, a, b)
    x *= _M2
    np.right_shift(x, 28, out=a)
    x ^= a
    return x


def _xor_rotations(x: np.ndarray, r1: int, r2: int, a: np.ndarray, b: np.ndarray) -> None:
    """x ^= ror(x, r1) ^ ror(x, r2), in place, with `a` and `b` as scratch."""
    np.right_shift(x, r1, out=a)
    np.left_shift(x, 64 - r1, out=b)
    a ^= b
    np.right_shift(x, r2, out=b)
    a ^= b
    np.left_shift(x, 64 - r2, out=b)
    a ^= b
    x ^= a


def partition_of(keys: np.ndarray, num_partitions: int) -> np.ndarray:
    """Partition index (int64, in [0, num_partitions)) of each key."""
    return partition_of_mixed(rrxmrrxmsx_0(keys), num_partitions)


def partition_of_mixed(mixed: np.ndarray, num_partitions: int) -> np.ndarray:
    """Partition index of keys whose `rrxmrrxmsx_0` is already computed (saves hashing twice)."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be at least 1, got {num_partitions}")
    p = np.uint64(num_partitions)
    if num_partitions & (num_partitions - 1) == 0:
        return (mixed & (p - np.uint64(1))).astype(np.int64)
    return (mixed % p).astype(np.int64)
