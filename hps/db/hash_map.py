"""The in-process volatile tier: one open-addressing hash table per table, in NumPy.

A table is a handful of flat arrays, never a per-key Python object:

    slots    int32[capacity]          row of each slot, or EMPTY (-1) / TOMBSTONE (-2);
                                      capacity is a power of two, load kept <= 1/2
    keys     int64[row_capacity]      key of each row; rows [0, size) are live and dense
    vectors  float32[row_capacity, dim]
    stats    uint32[row_capacity]     fetch-hit counts (evict_least_used) or access stamps
                                      (evict_oldest); only held while the margin is bounded

A key's home slot is the top bits of `rrxmrrxmsx_0(key)` (the same mixer that picks its
partition, computed once per batch); collisions probe linearly. Every operation runs over whole
batches: each probe round moves the keys still unresolved one slot on, and once few are
left a round looks at a window of slots per key, so a batch takes a handful of rounds.
Removal leaves a tombstone in the slot and moves the last rows into the freed rows, so the
row store stays dense; tombstones go when the slot array is rebuilt.

Memory: row arrays are allocated for twice the rows they must hold, but `np.empty` pages
stay untouched, hence not resident, until rows are written; so a table occupies its raw
key + vector bytes plus 4 bytes per slot (about 11-21 bytes per key), and growing copies
each row about once. `memory_bytes` counts exactly that. HugeCTR's hash map took ~10×.

Overflow: `overflow_margin` bounds the entries of each partition (`partition_of(key,
num_partitions)`). When an insert takes a partition past it, that partition is pruned to
`int(overflow_margin × overflow_resolution_target)` entries: random victims
(`evict_random`), the fewest fetch hits (`evict_least_used`) or the oldest stamp
(`evict_oldest`: insert/overwrite time, also fetch time when `refresh_time_after_fetch`,
as in HugeCTR).

Thread safety: one readers-writer lock per table around the array work; hashing and
input checks run outside it. Fetches share the lock, so they run in parallel (NumPy
releases the GIL for the gathers; two threads fetch ~1.6× faster than one on 2 cores);
inserts and removals take it alone. The per-row stats that fetches update have a small
lock of their own.

Limits: at most 2**31 - 1 rows per table (int32 slots).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from hps.config import UNBOUNDED, VolatileDBConfig
from hps.db.base import Tier, as_keys, as_rows
from hps.db.partition import partition_of_mixed, rrxmrrxmsx_0
from hps.errors import ConfigError

EMPTY = -1
TOMBSTONE = -2

#: a slot array is rebuilt larger once live + tombstones exceed this share of it...
MAX_LOAD = 0.5
#: ...and is rebuilt to the smallest power of two that keeps the load under this one
REBUILD_LOAD = 0.375
MIN_SLOTS = 16
MIN_ROWS = 16
#: once this few keys are left unresolved, each probe round looks at WINDOW slots per key
SMALL = 64
WINDOW = 32

_U32_MAX = np.iinfo(np.uint32).max
#: least-used counts are halved when one passes this (each op adds < 2**28 between checks)
_COUNT_LIMIT = 1 << 31
_COUNT_CHECK_EVERY = 4096


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


class _ReadWriteLock:
    """Many readers or one writer; a waiting writer holds off new readers."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class _Table:
    """The arrays of one table and the locks that guard them."""

    def __init__(self, dim: int, num_partitions: int, policy: str | None) -> None:
        """`policy`: the overflow policy whose per-row stats to keep, or None for none."""
        self.dim = dim
        self.stamped = policy == "evict_oldest"
        self.lock = _ReadWriteLock()
        self.stats_lock = threading.Lock()  # fetches (readers) update stats and the clock
        self.size = 0
        self.tombstones = 0
        self.clock = 0  # ops seen; stamps of evict_oldest
        self.keys = np.zeros(MIN_ROWS, np.int64)
        self.vectors = np.zeros((MIN_ROWS, dim), np.float32)
        self.stats: np.ndarray | None = None
        if policy in ("evict_oldest", "evict_least_used"):
            self.stats = np.zeros(MIN_ROWS, np.uint32)
        self.written = 0  # rows ever written to the current row arrays (their resident part)
        self.partition_sizes = np.zeros(num_partitions, np.int64)
        self._set_slots(MIN_SLOTS)

    def _set_slots(self, capacity: int) -> None:
        self.slots = np.full(capacity, EMPTY, np.int32)
        self.mask = capacity - 1
        self.shift = np.uint64(64 - (capacity.bit_length() - 1))
        self.tombstones = 0

    def nbytes(self) -> int:
        """Bytes of memory the arrays occupy: all of the slots, the written rows.

        The row arrays reserve twice the rows they hold, but pages never written are not
        backed by memory (the benchmark checks this against the process RSS), so they
        are not counted; rows freed by removals are, until the arrays shrink.
        """
        row_bytes = self.keys.itemsize + self.vectors.itemsize * self.dim
        if self.stats is not None:
            row_bytes += self.stats.itemsize
        rows = max(self.written, MIN_ROWS)
        return self.slots.nbytes + self.partition_sizes.nbytes + rows * row_bytes

    # -- probing ------------------------------------------------------------------------

    def home(self, mixed: np.ndarray) -> np.ndarray:
        return (mixed >> self.shift).astype(np.intp)

    def find(self, keys: np.ndarray, mixed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of `keys` (intp, -1 where absent) and the slots holding them."""
        pos = self.home(mixed)
        first = np.take(self.slots, pos)
        rows = first.astype(np.intp)
        # A negative row clips to row 0; the `rows >= 0` test discards what it reads.
        hit = np.take(self.keys, rows, mode="clip") == keys
        hit &= rows >= 0
        open_ = first != EMPTY
        open_ &= ~hit
        rows[~hit] = -1
        pending = np.flatnonzero(open_)
        while pending.size > SMALL:
            pending = self._find_next(keys, pos, rows, pending)
        step = 1
        while pending.size:
            pending = self._find_window(keys, pos, rows, pending, step)
            step += WINDOW
        return rows, pos

    def _find_next(
        self, keys: np.ndarray, pos: np.ndarray, rows: np.ndarray, pending: np.ndarray
    ) -> np.ndarray:
        """Move each pending key one slot on; returns those still open."""
        p = pos[pending]
        p += 1
        p &= self.mask
        pos[pending] = p
        cand = np.take(self.slots, p)
        r = cand.astype(np.intp)
        match = np.take(self.keys, r, mode="clip") == keys[pending]
        match &= cand >= 0
        rows[pending[match]] = r[match]
        match |= cand == EMPTY
        still: np.ndarray = pending[~match]
        return still

    def _find_window(
        self, keys: np.ndarray, pos: np.ndarray, rows: np.ndarray, pending: np.ndarray,
        step: int,
    ) -> np.ndarray:
        """Look at WINDOW slots from `pos + step` on for each pending key (few keys left).

        Returns the keys still open; writes the row and slot of each key found.
        """
        window = pos[pending, None] + np.arange(step, step + WINDOW)
        window &= self.mask
        cand = np.take(self.slots, window)
        match = np.take(self.keys, cand, mode="clip") == keys[pending, None]
        match &= cand >= 0
        stop = match | (cand == EMPTY)
        first = stop.argmax(axis=1)
        done = stop[np.arange(pending.size), first]
        d = np.flatnonzero(done)
        fd = first[d]
        found = match[d, fd]
        idx = pending[d][found]
        rows[idx] = cand[d, fd][found]
        pos[idx] = window[d, fd][found]
        still: np.ndarray = pending[~done]
        return still

    def claim(self, mixed: np.ndarray, rows: np.ndarray) -> None:
        """Give each of `rows` a slot; their keys are distinct and absent from the table."""
        slots = self.slots
        pos = self.home(mixed)
        ids = rows.astype(np.int32)
        pending = np.arange(ids.size)
        while pending.size:
            p = pos[pending]
            current = slots[p]
            free = current < 0
            fi = pending[free]
            fp = p[free]
            slots[fp] = ids[fi]  # colliding writers: one of them lands, the rest probe on
            won = slots[fp] == ids[fi]
            self.tombstones -= int(np.count_nonzero(current[free][won] == TOMBSTONE))
            pending = np.concatenate([pending[~free], fi[~won]])
            pos[pending] += 1
            pos[pending] &= self.mask

    def rebuild(self, extra: int) -> None:
        """New slot array sized for size + extra keys, without tombstones."""
        capacity = max(MIN_SLOTS, _next_pow2(int(np.ceil((self.size + extra) / REBUILD_LOAD))))
        self._set_slots(capacity)
        if self.size:
            self.claim(rrxmrrxmsx_0(self.keys[: self.size]), np.arange(self.size))

    # -- rows ---------------------------------------------------------------------------

    def reserve_rows(self, n: int) -> None:
        """Make room for `n` rows: a new array of 2n rows, of which only n are written."""
        if n > self.keys.size:
            self._move_rows(max(2 * n, MIN_ROWS))

    def trim_rows(self) -> None:
        """Move to arrays of 2 × size rows after a large removal (frees the old pages)."""
        self._move_rows(max(2 * self.size, MIN_ROWS))

    def _move_rows(self, capacity: int) -> None:
        # np.empty leaves pages untouched (not resident) until rows are written, and NumPy
        # asks for huge pages on large arrays: random row reads then miss the TLB less.
        n = self.size
        keys = np.empty(capacity, np.int64)
        keys[:n] = self.keys[:n]
        vectors = np.empty((capacity, self.dim), np.float32)
        vectors[:n] = self.vectors[:n]
        self.keys, self.vectors = keys, vectors
        if self.stats is not None:
            stats = np.empty(capacity, np.uint32)
            stats[:n] = self.stats[:n]
            self.stats = stats
        self.written = n

    def delete(self, rows: np.ndarray, slot_pos: np.ndarray, mixed: np.ndarray) -> None:
        """Delete live `rows` (distinct) whose slots are `slot_pos`; keeps rows dense."""
        if not rows.size:
            return
        num_parts = self.partition_sizes.size
        self.partition_sizes -= np.bincount(
            partition_of_mixed(mixed, num_parts), minlength=num_parts
        )
        self.slots[slot_pos] = TOMBSTONE
        self.tombstones += rows.size
        new_size = self.size - rows.size
        holes = rows[rows < new_size]
        keep_tail = np.ones(rows.size, bool)
        keep_tail[rows[rows >= new_size] - new_size] = False
        movers = np.arange(new_size, self.size)[keep_tail]
        if movers.size:
            mover_keys = self.keys[movers]
            _, mover_slots = self.find(mover_keys, rrxmrrxmsx_0(mover_keys))
            self.keys[holes] = mover_keys
            self.vectors[holes] = self.vectors[movers]
            if self.stats is not None:
                self.stats[holes] = self.stats[movers]
            self.slots[mover_slots] = holes.astype(np.int32)
        self.size = new_size
        if self.size < self.keys.size // 8 and self.keys.size > 8 * MIN_ROWS:
            self.trim_rows()
        if self.slots.size > MIN_SLOTS and self.size < self.slots.size * REBUILD_LOAD / 8:
            self.rebuild(0)

    def tick(self) -> int:
        """Advance the op clock; renumbers stamps before they would pass uint32."""
        self.clock += 1
        if self.clock >= _U32_MAX and self.stamped and self.stats is not None:
            _, ranks = np.unique(self.stats[: self.size], return_inverse=True)
            self.stats[: self.size] = ranks
            self.clock = int(ranks.max(initial=0)) + 1
        return self.clock


class HashMapTier(Tier):
    """The in-process volatile tier (`volatile_db.type` "hash_map" / "parallel_hash_map").

    `HashMapTier(config: VolatileDBConfig)`; reads `num_partitions`, `overflow_margin`,
    `overflow_policy`, `overflow_resolution_target` and `refresh_time_after_fetch`.
    """

    name = "hash_map"

    def __init__(self, config: VolatileDBConfig | None = None, *, seed: int | None = None):
        super().__init__()
        self.config = config if config is not None else VolatileDBConfig.model_validate({})
        self.num_partitions = int(self.config.num_partitions)
        self.overflow_margin = int(self.config.overflow_margin)
        self.overflow_policy = self.config.overflow_policy
        self.prune_target = int(self.overflow_margin * self.config.overflow_resolution_target)
        self.refresh_time_after_fetch = bool(self.config.refresh_time_after_fetch)
        self._bounded = self.overflow_margin < UNBOUNDED
        self._rng = np.random.default_rng(seed)
        self._tables: dict[str, _Table] = {}
        self._tables_lock = threading.Lock()

    # -- tables -------------------------------------------------------------------------

    def create_table(self, table: str, dim: int) -> None:
        """Make `table` known with rows of width `dim`; keeps existing contents.

        Raises ConfigError if the table exists with another width.
        """
        dim = int(dim)
        if dim < 1:
            raise ConfigError(f"table {table!r}: width must be positive, got {dim}")
        with self._tables_lock:
            existing = self._tables.get(table)
            if existing is not None:
                if existing.dim != dim:
                    raise ConfigError(
                        f"hash_map table {table!r} holds rows of width {existing.dim}, "
                        f"not {dim}: drop it first"
                    )
                return
            policy = self.overflow_policy if self._bounded else None
            self._tables[table] = _Table(dim, self.num_partitions, policy)
            super().create_table(table, dim)

    def drop_table(self, table: str) -> None:
        with self._tables_lock:
            self._tables.pop(table, None)
            super().drop_table(table)

    def _table(self, table: str) -> _Table:
        t = self._tables.get(table)
        if t is None:
            self.dim(table)  # raises UnknownTableError
            raise AssertionError("unreachable")
        return t

    # -- data ---------------------------------------------------------------------------

    def fetch(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectors (float32[n, dim], zero rows where not found) and found (bool[n])."""
        t = self._table(table)
        k = as_keys(keys)
        mixed = rrxmrrxmsx_0(k)
        out = np.empty((k.size, t.dim), np.float32)
        with t.lock.read():
            rows, _ = t.find(k, mixed)
            # Absent keys (-1) clip to row 0 and are zeroed below.
            np.take(t.vectors, rows, axis=0, out=out, mode="clip")
            found = rows >= 0
            if t.stats is not None:
                with t.stats_lock:
                    self._note_fetch(t, rows[found])
        missing = np.flatnonzero(~found)
        if missing.size:
            out[missing] = 0.0
        return out, found

    def _note_fetch(self, t: _Table, hit_rows: np.ndarray) -> None:
        assert t.stats is not None
        clock = t.tick()
        if self.overflow_policy == "evict_least_used":
            np.add.at(t.stats, hit_rows, np.uint32(1))
            if clock % _COUNT_CHECK_EVERY == 0 and t.stats[: t.size].max(initial=0) > _COUNT_LIMIT:
                t.stats[: t.size] >>= 1
        elif self.refresh_time_after_fetch:
            t.stats[hit_rows] = clock

    def insert(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Insert or overwrite rows; the last of duplicate keys wins. Prunes on overflow.

        Raises LookupInputError when keys and vectors disagree in count or width.
        """
        t = self._table(table)
        k, v = _distinct_last(*as_rows(keys, vectors, t.dim))
        if not k.size:
            return
        mixed = rrxmrrxmsx_0(k)
        with t.lock.write():
            rows, _ = t.find(k, mixed)
            old = rows >= 0
            stamp = t.tick() if t.stats is not None else 0
            if old.any():
                t.vectors[rows[old]] = v[old]
                if t.stats is not None and self.overflow_policy == "evict_oldest":
                    t.stats[rows[old]] = stamp
            new = np.flatnonzero(~old)
            if new.size:
                self._append(t, k[new], v[new], mixed[new], stamp)
                if self._bounded:
                    self._prune(t)

    def _append(
        self, t: _Table, keys: np.ndarray, vectors: np.ndarray, mixed: np.ndarray, stamp: int
    ) -> None:
        start, stop = t.size, t.size + keys.size
        t.reserve_rows(stop)
        t.written = max(t.written, stop)
        t.keys[start:stop] = keys
        t.vectors[start:stop] = vectors
        if t.stats is not None:
            t.stats[start:stop] = stamp if self.overflow_policy == "evict_oldest" else 0
        num_parts = t.partition_sizes.size
        t.partition_sizes += np.bincount(partition_of_mixed(mixed, num_parts), minlength=num_parts)
        if stop + t.tombstones > MAX_LOAD * t.slots.size:
            t.size = stop
            t.rebuild(0)
        else:
            t.claim(mixed, np.arange(start, stop))
            t.size = stop

    def _prune(self, t: _Table) -> None:
        """Prune every partition past the margin down to the resolution target."""
        over = np.flatnonzero(t.partition_sizes > self.overflow_margin)
        if not over.size:
            return
        live_mixed = rrxmrrxmsx_0(t.keys[: t.size])
        parts = partition_of_mixed(live_mixed, self.num_partitions)
        # Rows of the overflowing partitions only, grouped by partition.
        rows_over = np.flatnonzero(np.isin(parts, over))
        rows_over = rows_over[np.argsort(parts[rows_over], kind="stable")]
        starts = np.concatenate([[0], np.cumsum(t.partition_sizes[over])])
        victims = []
        for i in range(over.size):
            members = rows_over[starts[i] : starts[i + 1]]
            excess = members.size - self.prune_target
            victims.append(members[self._victims(t, members, excess)])
        rows = np.sort(np.concatenate(victims))
        mixed = live_mixed[rows]
        _, slot_pos = t.find(t.keys[rows], mixed)
        t.delete(rows, slot_pos, mixed)

    def _victims(self, t: _Table, members: np.ndarray, excess: int) -> np.ndarray:
        """Positions in `members` of the `excess` rows the policy evicts."""
        if excess >= members.size:
            return np.arange(members.size)
        if self.overflow_policy == "evict_random":
            return self._rng.choice(members.size, excess, replace=False)
        assert t.stats is not None
        return np.argpartition(t.stats[members], excess - 1)[:excess]

    def remove(self, table: str, keys: np.ndarray) -> int:
        """Delete `keys`; returns how many distinct keys were present."""
        t = self._table(table)
        k = np.unique(as_keys(keys))
        if not k.size:
            return 0
        mixed = rrxmrrxmsx_0(k)
        with t.lock.write():
            rows, slot_pos = t.find(k, mixed)
            hit = np.flatnonzero(rows >= 0)
            order = np.argsort(rows[hit])
            hit = hit[order]
            t.delete(rows[hit], slot_pos[hit], mixed[hit])
        return int(hit.size)

    def size(self, table: str) -> int:
        return self._table(table).size

    def memory_bytes(self, table: str) -> int:
        """Bytes of all arrays the table holds (slots, keys, vectors, stats), capacity included."""
        t = self._table(table)
        with t.lock.read():
            return t.nbytes()

    def stats(self) -> dict[str, Any]:
        """The contract's health and counters, plus the keys and bytes all tables hold."""
        with self._tables_lock:
            tables = list(self._tables.values())
        memory = 0
        for t in tables:
            with t.lock.read():
                memory += t.nbytes()
        return {**super().stats(), "keys": sum(t.size for t in tables), "memory_bytes": memory}

    def partition_sizes(self, table: str) -> np.ndarray:
        """Entries per partition (int64[num_partitions]), a copy."""
        t = self._table(table)
        with t.lock.read():
            return t.partition_sizes.copy()

    def close(self) -> None:
        with self._tables_lock:
            self._tables.clear()
            self._dims.clear()


def _distinct_last(keys: np.ndarray, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keys without repeats, each with the vector of its last occurrence."""
    if keys.size < 2:
        return keys, vectors
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    last = np.empty(keys.size, bool)
    last[-1] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=last[:-1])
    if last.all():
        return keys, vectors
    keep = order[last]
    return keys[keep], vectors[keep]
