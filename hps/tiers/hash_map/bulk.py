"""Many rows of the in-process hash map at once: inserts split over the cores, and a
whole table read back for a bulk load.

- `split_insert`: a large insert into a table with room for every key runs on several
  threads, each owning a region of the slot array (the kernels `homes_by_region`,
  `group_by_region`, `insert_region`, `place_new` in `hps.tiers.hash_map.loops`); the keys
  whose probes run past their region's end are left for the one-thread insert.
- `sorted_rows`: every row of a table where it lies, in a persistent tier's bulk order,
  while the table takes no writes (a model load fills RocksDB from it without a copy).
- `export`: every row of a table copied out in chunks, float32 (compact rows decoded).

Each takes a `Table` (hps/tiers/hash_map/table.py); `HashMapTier` holds the locks and
the threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from hps.errors import TierError
from hps.rows.storage_types import decode
from hps.tiers.hash_map import loops as kernels
from hps.tiers.hash_map.table import Table

#: runs `run(0)` … `run(parts - 1)` at once and returns when all are done (the tier's
#: worker threads)
Split = Callable[[Callable[[int], None], int], None]


def split_insert(t: Table, keys: np.ndarray, vectors: np.ndarray, parts: int, split: Split
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Insert `keys` (stored-form `vectors`) on `parts` threads through `split`, each
    owning a region of the slot array; the table has room for all of them. Returns the
    keys (and rows) left at the regions' seams, in batch order, for the one-thread
    insert. The caller holds the table's write lock."""
    n, capacity = keys.size, t.slots.size
    region = -(-capacity // parts)
    bounds = np.linspace(0, n, parts + 1).astype(np.int64).tolist()
    homes = np.empty(n, np.int64)
    counts = np.zeros((parts, parts), np.int64)  # [key slice, region]
    split(lambda p: kernels.homes_by_region(
        keys, bounds[p], bounds[p + 1], capacity, region, homes, counts[p]), parts)
    flat = counts.T.reshape(-1)  # regions in order, the slices in order within each
    cursors = np.ascontiguousarray((np.cumsum(flat) - flat).reshape(parts, parts).T)
    members = np.empty(n, np.int64)
    split(lambda p: kernels.group_by_region(
        homes, bounds[p], bounds[p + 1], region, cursors[p], members), parts)
    ends = np.concatenate([[0], np.cumsum(counts.sum(axis=0))]).tolist()
    new_slots = np.empty(n, np.int64)
    new_index = np.empty(n, np.int64)
    deferred = np.empty(n, np.int64)
    counters = np.zeros((parts, 3), np.int64)

    def probe(r: int) -> None:
        a, b = ends[r], ends[r + 1]
        kernels.insert_region(t.slots, t.keys, t.vectors, t.row_bits, keys, vectors,
                              homes, members[a:b], min(capacity, (r + 1) * region),
                              new_slots[a:b], new_index[a:b], deferred[a:b], counters[r])

    split(probe, parts)
    firsts = (t.size + np.cumsum(counters[:, 0]) - counters[:, 0]).tolist()
    partition_sizes = np.zeros((parts, t.partition_sizes.size), np.int64)

    def place(r: int) -> None:
        a, b = ends[r], ends[r + 1]
        kernels.place_new(t.slots, t.keys, t.vectors, t.row_bits, keys, vectors,
                          new_slots[a:b], new_index[a:b], int(counters[r, 0]), firsts[r],
                          partition_sizes[r])

    split(place, parts)
    t.state[0] += int(counters[:, 0].sum())
    t.state[1] -= int(counters[:, 2].sum())
    t.partition_sizes += partition_sizes.sum(axis=0)
    seams = np.concatenate([deferred[ends[r] : ends[r] + counters[r, 1]]
                            for r in range(parts)])  # a loop over regions
    seams.sort()
    return keys[seams], vectors[seams]


@contextmanager
def sorted_rows(t: Table, table: str,
                order: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray] | None]
                ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """Every row of `t` (named `table`) where it lies: `(keys, rows, positions)` with
    `order` (a persistent tier's `bulk_sorted`) applied to the keys, the row of `keys[i]`
    at `rows[positions[i]]`. The table's read lock is held until the context ends
    (fetches go on; writes wait), so the rows stay where they are while a bulk load reads
    them. Raises TierError for a table of compact rows (export decodes them)."""
    if t.storage.compact:
        raise TierError(f"hash_map table {table!r} stores {t.storage.name} rows: "
                        "export decodes them")
    t.lock.acquire_read()
    try:
        keys = t.keys[: t.size]
        ordered = order(keys)
        if ordered is None:
            yield keys, t.vectors[: t.size], None
        else:
            yield ordered[0], t.vectors, ordered[1]
    finally:
        t.lock.release_read()


def export(t: Table, table: str, order: Callable[[np.ndarray], np.ndarray | None],
           chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every row of `t` (named `table`) as `(keys, vectors)` copies, `chunk_rows` at a
    time, in the order `order(keys)` gives (row order for None). Vectors are float32: a
    compact table's rows decoded (within its storage type's error bound of what was
    inserted).

    Raises TierError when the table is written to while the export runs.
    """
    t.lock.acquire_read()
    try:
        version, size = t.version, t.size
        permutation = order(t.keys[:size])
    finally:
        t.lock.release_read()
    for start in range(0, size, max(1, int(chunk_rows))):  # a loop over chunks
        stop = min(size, start + chunk_rows)
        t.lock.acquire_read()
        try:
            if t.version != version:
                raise TierError(f"hash_map table {table!r} changed while it was exported")
            if permutation is None:
                keys, vectors = t.keys[start:stop].copy(), t.vectors[start:stop].copy()
            else:
                rows = permutation[start:stop]
                keys, vectors = t.keys[rows], np.take(t.vectors, rows, axis=0)
        finally:
            t.lock.release_read()
        if t.storage.compact:
            vectors = decode(t.storage, vectors.view(t.storage.stored_dtype), t.dim)
        yield keys, vectors
