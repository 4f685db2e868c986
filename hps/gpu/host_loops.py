"""The host side of the GPU miss path, compiled: dedupe of missed keys, set codes.

The misses of one lookup are a few hundred keys; NumPy spends tens of microseconds of
per-call overhead on them (np.unique, a dozen array operations for the set hash) where
the work itself takes one or two. These are numba kernels (hps/runtime/compiled.py), compiled
when this module is first imported (or loaded from numba's on-disk cache), never inside
a lookup; they release the GIL.

- `dedupe(keys, unique, inverse) -> u`: the distinct keys in order of first appearance
  into unique[:u], and inverse[i] = index in unique of keys[i];
- `set_codes(keys, num_sets, codes)`: codes[i] = set(keys[i]) << 32 | i, sorted: the
  insert kernel's input order (hps/gpu/dynamic_cache.py `set_codes` is the NumPy twin and the
  reference of both);
- `stage_misses`: both in one call; `stage` is the lookup path's (it keeps the GIL for
  small batches: hps/runtime/compiled.py HOLD_GIL_BYTES);
- `stage_by_shard` (`stage_sharded` on the lookup path): the same for a sharded table's
  misses, the distinct keys grouped by shard, each shard's set codes over its own group.
"""

from __future__ import annotations

import numpy as np

from hps.runtime.compiled import array, by_size, holding_gil, inlined, kernel, types

uint64 = np.uint64
_M1 = uint64(0xFF51AFD7ED558CCD)
_M2 = uint64(0xC4CEB9FE1A85EC53)
_S33 = uint64(33)
_S32 = uint64(32)
_KEYS = array(np.int64, readonly=True)


@inlined
def _fmix64(k: np.uint64) -> np.uint64:
    k ^= k >> _S33
    k *= _M1
    k ^= k >> _S33
    k *= _M2
    k ^= k >> _S33
    return k


@kernel([types.int64(_KEYS, array(np.int64), array(np.int32))])
def dedupe(keys: np.ndarray, unique: np.ndarray, inverse: np.ndarray) -> int:
    """Distinct keys in order of first appearance (see the module docstring)."""
    n = keys.size
    size = 16
    while size < 2 * n:
        size *= 2
    mask = uint64(size - 1)
    table = np.full(size, -1, np.int32)  # index into unique, -1 free
    u = 0
    for i in range(n):
        key = keys[i]
        h = _fmix64(uint64(key)) & mask
        while True:
            at = table[h]
            if at < 0:
                table[h] = u
                unique[u] = key
                inverse[i] = u
                u += 1
                break
            if unique[at] == key:
                inverse[i] = at
                break
            h = (h + uint64(1)) & mask
    return u


@kernel([types.void(_KEYS, types.uint32, array(np.uint64))])
def set_codes(keys: np.ndarray, num_sets: int, codes: np.ndarray) -> None:
    """Sorted set << 32 | position codes of `keys` (see the module docstring)."""
    sets = uint64(num_sets)
    for i in range(keys.size):
        s = ((_fmix64(uint64(keys[i])) >> _S32) * sets) >> _S32
        codes[i] = (s << _S32) | uint64(i)
    codes.sort()


_STAGE = [types.int64(_KEYS, types.uint32, array(np.int64), array(np.int32),
                     array(np.uint64))]


@kernel(_STAGE)
def stage_misses(missed: np.ndarray, num_sets: int, unique: np.ndarray, inverse: np.ndarray,
                 codes: np.ndarray) -> int:
    """dedupe(missed, unique, inverse), then (num_sets > 0: a dynamic cache) the sorted set
    codes of unique[:u] into codes[:u], in one call. Returns u."""
    u = dedupe(missed, unique, inverse)
    if num_sets > 0:
        set_codes(unique[:u], num_sets, codes[:u])
    return u


@holding_gil(_STAGE)
def stage_misses_held(missed: np.ndarray, num_sets: int, unique: np.ndarray,
                      inverse: np.ndarray, codes: np.ndarray) -> int:
    """`stage_misses` keeping the GIL (see `stage`)."""
    return stage_misses(missed, num_sets, unique, inverse, codes)


def stage(missed: np.ndarray, num_sets: int, unique: np.ndarray, inverse: np.ndarray,
          codes: np.ndarray) -> int:
    """`stage_misses` as the lookup path calls it: keeping the GIL for at most
    2,048 misses (32 bytes each against HOLD_GIL_BYTES: hps/runtime/compiled.py), as their
    tier fetch does."""
    twin = by_size(missed.size * 32, stage_misses_held, stage_misses)
    return int(twin(missed, num_sets, unique, inverse, codes))


_STAGE_SHARDED = [types.int64(_KEYS, types.int64, types.uint32, array(np.int64),
                              array(np.int32), array(np.uint64), array(np.int64))]


@kernel(_STAGE_SHARDED)
def stage_by_shard(missed: np.ndarray, num_shards: int, num_sets: int, unique: np.ndarray,
                   inverse: np.ndarray, codes: np.ndarray, starts: np.ndarray) -> int:
    """stage_misses for a table sharded by key hash (hps/gpu/sharded.py `shard_of`): the
    distinct keys into unique[:u] grouped by shard, shard s's at unique[starts[s]:
    starts[s + 1]] (in order of first appearance); inverse[i] = index in unique of
    missed[i]; each group's sorted set codes (positions within the group) at the same
    place in codes. Returns u."""
    first = np.empty(missed.size, np.int64)
    first_inverse = np.empty(missed.size, np.int32)
    u = dedupe(missed, first, first_inverse)
    shard = np.empty(u, np.int64)
    starts[:] = 0
    for j in range(u):
        low = _fmix64(uint64(first[j])) & uint64(0xFFFFFFFF)
        shard[j] = np.int64((low * uint64(num_shards)) >> _S32)
        starts[shard[j] + 1] += 1
    for s in range(num_shards):
        starts[s + 1] += starts[s]
    place = np.empty(u, np.int32)
    filled = starts[:num_shards].copy()
    for j in range(u):
        place[j] = filled[shard[j]]
        unique[place[j]] = first[j]
        filled[shard[j]] += 1
    for i in range(missed.size):
        inverse[i] = place[first_inverse[i]]
    for s in range(num_shards):
        a, b = starts[s], starts[s + 1]
        if b > a:
            set_codes(unique[a:b], num_sets, codes[a:b])
    return u


@holding_gil(_STAGE_SHARDED)
def stage_by_shard_held(missed: np.ndarray, num_shards: int, num_sets: int,
                        unique: np.ndarray, inverse: np.ndarray, codes: np.ndarray,
                        starts: np.ndarray) -> int:
    """`stage_by_shard` keeping the GIL (see `stage`)."""
    return stage_by_shard(missed, num_shards, num_sets, unique, inverse, codes, starts)


def stage_sharded(missed: np.ndarray, num_shards: int, num_sets: int, unique: np.ndarray,
                  inverse: np.ndarray, codes: np.ndarray, starts: np.ndarray) -> int:
    """`stage_by_shard` as the lookup path calls it (the GIL kept as `stage` keeps it)."""
    twin = by_size(missed.size * 32, stage_by_shard_held, stage_by_shard)
    return int(twin(missed, num_shards, num_sets, unique, inverse, codes, starts))
