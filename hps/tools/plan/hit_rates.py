"""The hit rate a table's dynamic GPU cache would have on a key log, at several sizes.

`hit_rate(keys, num_keys, share, batch)` replays the log in lookups of `batch` keys through
the cache a model of `num_keys` keys at `gpucacheper = share` gets (hps/gpu/open.py):

- share < 1: the set-associative cache, sized as open_device_table sizes it (capacity
  ceil(share × num_keys) keys in cache_slots(capacity) slots), modelled by
  hps.gpu.cache_model.ReferenceCache with the cache's default LRU sampling. Each lookup
  is one query; its missed keys, deduplicated in the order they first came, are then one
  insert: what a lookup below `hit_rate_threshold` does (the GPU path fetches its misses
  and inserts them before the next lookup on the stream). At or above the threshold the
  server inserts in the background instead, a little later: the prediction is then a
  touch optimistic.
- share ≥ 1 (WHOLE_TABLE): the open-addressing table that evicts nothing: a key hits once
  an earlier lookup inserted it; a lookup's missed keys are inserted while the table has room
  for all of them (hps/gpu/table.py's rule), so the count is exact, told without a model.

The cache starts empty, as a server's does with cache_refresh_percentage_per_iteration 0
(the default; a warm-up from the files would hold the files' first keys instead). Two
rates come back: over the whole log (what the server's counters would show), and over its
second half, once the first half has warmed the cache (the steady state).

Each lookup is whole-array NumPy work; Python runs once per lookup, never per key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hps.errors import ConfigError
from hps.gpu.cache_model import ReferenceCache
from hps.gpu.dynamic_cache import DEFAULT_LRU_SAMPLE_SHIFT
from hps.gpu.open import WHOLE_TABLE, cache_slots

#: cache sizes replayed when none are asked for, as gpucacheper
DEFAULT_SHARES = (0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
#: keys a replayed lookup takes when none is asked for
DEFAULT_BATCH = 4096


@dataclass(frozen=True)
class HitRate:
    """The predicted hit rates of one cache size (see the module docstring)."""

    share: float  # gpucacheper
    capacity: int  # keys the cache promises to hold
    slots: int  # slots it has (the set-associative sizing's extra included)
    lookups: int  # lookups replayed
    hit_rate: float  # over the whole log, from an empty cache
    warm_hit_rate: float  # over the log's second half

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_shares(shares: Sequence[float]) -> list[float]:
    """The cache sizes, sorted and distinct; ConfigError for one outside (0, 1]."""
    bad = [s for s in shares if not (0.0 < s <= 1.0) or math.isnan(s)]
    if bad or not shares:
        raise ConfigError(f"cache sizes must be shares of the table in (0, 1] (gpucacheper; "
                          f"1% to 100%), got {list(shares)}")
    return sorted(set(shares))


def hit_rate(keys: np.ndarray, num_keys: int, share: float, batch: int = DEFAULT_BATCH,
             *, lru_sample_shift: int = DEFAULT_LRU_SAMPLE_SHIFT) -> HitRate:
    """The predicted hit rates of the cache of a `num_keys`-key table at gpucacheper
    `share`, on the log `keys` (int64 [n], n ≥ 1) replayed in lookups of `batch` keys."""
    keys = np.asarray(keys, dtype=np.int64)
    if keys.size == 0:
        raise ConfigError("the key log holds no keys")
    if batch < 1:
        raise ConfigError(f"the replay's lookup size must be positive, got {batch}")
    share = check_shares([share])[0]
    capacity = max(1, math.ceil(share * int(num_keys)))
    if share >= WHOLE_TABLE:
        hits, slots = _whole_table_hits(keys, capacity, batch), capacity
    else:
        slots = cache_slots(capacity)
        hits = _cache_hits(keys, ReferenceCache(slots, 1, lru_sample_shift), batch)
    sizes = np.diff(np.r_[np.arange(0, keys.size, batch), keys.size])
    half = sizes.size // 2
    warm_keys = int(sizes[half:].sum())
    return HitRate(share=share, capacity=capacity, slots=slots, lookups=int(sizes.size),
                   hit_rate=float(hits.sum() / keys.size),
                   warm_hit_rate=float(hits[half:].sum() / warm_keys))


def hit_rate_curve(keys: np.ndarray, num_keys: int, shares: Sequence[float] = DEFAULT_SHARES,
                   batch: int = DEFAULT_BATCH) -> list[HitRate]:
    """hit_rate at each of `shares` (sorted, distinct)."""
    return [hit_rate(keys, num_keys, s, batch) for s in check_shares(shares)]


def _cache_hits(keys: np.ndarray, cache: ReferenceCache, batch: int) -> np.ndarray:
    """Hits of each lookup of the log through the set-associative model."""
    hits = np.empty(-(-keys.size // batch), np.int64)
    no_rows = np.zeros((batch, 1), np.float32)  # the model's rows: only hits are counted
    for i, start in enumerate(range(0, keys.size, batch)):
        lookup = np.asarray(keys[start:start + batch])
        _, missed = cache.query(lookup)
        hits[i] = lookup.size - int(np.count_nonzero(missed))
        if hits[i] < lookup.size:
            missed_keys = lookup[missed]
            _, first = np.unique(missed_keys, return_index=True)
            new = missed_keys[np.sort(first)]  # deduplicated, in the order they came
            cache.insert(new, no_rows[:new.size])
    return hits


def _whole_table_hits(keys: np.ndarray, capacity: int, batch: int) -> np.ndarray:
    """Hits of each lookup of the log through the open-addressing table that evicts
    nothing and takes a lookup's missed keys while it has room for all of them."""
    _, inverse = np.unique(keys, return_inverse=True)  # each key as a distinct-key index
    held = np.zeros(int(inverse.max()) + 1, bool)
    hits = np.empty(-(-keys.size // batch), np.int64)
    count = 0
    for i, start in enumerate(range(0, keys.size, batch)):
        lookup = inverse[start:start + batch]
        found = held[lookup]
        hits[i] = int(np.count_nonzero(found))
        missed = np.unique(lookup[~found])
        if missed.size and count + missed.size <= capacity:
            held[missed] = True
            count += missed.size
    return hits
