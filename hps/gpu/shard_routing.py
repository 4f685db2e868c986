"""Which shard holds a key of a table split row-wise (hps/gpu/sharded.py): the host's
twin of the kernels' hps_shard_of (cuda/hps_common.cuh), and a shard's size.

    shard of key = (low 32 bits of murmur3_fmix64(key)) × shards >> 32
"""

from __future__ import annotations

import math

import numpy as np

from hps.gpu.dynamic_cache import murmur3_fmix64

_LOW32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def shard_of(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard (int64) of each host int64 key among `num_shards`; the kernel's twin."""
    low = murmur3_fmix64(keys) & _LOW32
    return ((low * np.uint64(num_shards)) >> _S32).astype(np.int64)


def shard_keys(num_keys: int, num_shards: int) -> int:
    """Keys one shard is sized for: its even share plus the hash's spread (about six
    standard deviations of a binomial share), so a whole-table shard never overflows."""
    share = num_keys / num_shards
    return max(1, math.ceil(share + 6.0 * math.sqrt(share) + 16))


def split_by_shard(keys: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """Positions of `keys` of each shard, in their order (one stable sort, no loop per key)."""
    shards = shard_of(keys, num_shards)
    if num_shards <= 127:  # a stable sort of bytes is a radix sort: 4M keys 0.04 s, not 0.10
        shards = shards.astype(np.int8)
    order = np.argsort(shards, kind="stable")
    bounds = np.searchsorted(shards[order], np.arange(num_shards + 1))
    return [order[bounds[s]:bounds[s + 1]] for s in range(num_shards)]
