"""What fills a GPU table besides its misses: the warm-up and the refresh.

- `warm_up(table, chunks, capacity)`: the model file's (keys, vectors) chunks, in file
  order (HugeCTR's warm-up order), until the table holds what it promises;
- `refresh(table, fetch, fraction)`: the rows of the keys the table holds, read again
  from the tiers (`fetch`) and written in place, window by window of its sets, so a
  model's tiers and its GPU copy meet again (`cache_refresh_percentage_per_iteration`).

Both write through the table's own checked calls (insert, build, update), on its own
stream; the lookup path's miss fill is hps/gpu/table.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from hps.gpu.dynamic_cache import EmbeddingCache
from hps.gpu.kernels import SET_SIZE
from hps.gpu.static_table import StaticEmbeddingTable


def warm_up(table: EmbeddingCache | StaticEmbeddingTable,
            chunks: Iterable[tuple[np.ndarray, np.ndarray]], capacity: int | None = None
            ) -> int:
    """Inserts (keys int64 [n], vectors float32 [n, dim]) chunks in order until the
    cache holds `capacity` keys' worth (default: its slots), the last chunk included (cut
    to fit); the static and uvm tables take every chunk (an open-addressing cache, up to
    `capacity`). Returns the keys inserted."""
    inserted = 0
    if isinstance(table, StaticEmbeddingTable) and capacity is None:
        for keys, vectors in chunks:
            table.build(keys, vectors)
            inserted += int(keys.shape[0])
        return inserted
    limit = table.capacity if capacity is None else capacity
    for keys, vectors in chunks:
        room = limit - inserted
        if room <= 0:
            break
        keys, vectors = keys[:room], vectors[:room]
        if isinstance(table, StaticEmbeddingTable):
            table.build(keys, vectors)
        else:
            table.insert(keys, vectors)
        inserted += int(keys.shape[0])
    return inserted


def refresh(table: EmbeddingCache | StaticEmbeddingTable,
            fetch: Callable[[np.ndarray], np.ndarray], fraction: float) -> int:
    """Re-reads the rows of the keys `table` holds through `fetch` (host int64 keys →
    float32 [n, dim] rows) and overwrites them in place, in windows of `fraction` × its
    slots (the whole table at once when `fraction` is 0); LRU order is untouched. Call
    with the table's device current. Returns the keys refreshed."""
    window = table.num_sets
    if fraction > 0:
        window = max(1, math.ceil(min(fraction, 1.0) * table.num_slots / SET_SIZE))
    total = 0
    for start in range(0, table.num_sets, window):
        keys = table.dump(start, start + window)
        if keys.size == 0:
            continue
        total += table.update(keys, fetch(keys.get()))
    return total
