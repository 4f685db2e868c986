"""One table of the in-process hash map: flat arrays, sized as it grows, and their lock.

A table is a handful of flat arrays, never a per-key Python object:

    slots    int32[capacity]          row of each slot with a tag of its key's hash in the
                                      bits the row does not need, or EMPTY (-1) /
                                      TOMBSTONE (-2); rows + tombstones stay <= MAX_LOAD
                                      of the capacity
    keys     int64[row_capacity]      key of each row; rows [0, size) are live and dense
    vectors  [row_capacity, width]    rows in the table's storage type
                                      (hps/rows/storage_types.py): float32 [., dim]; uint16
                                      [., dim] bits of float16 or bfloat16; uint8
                                      [., align4(dim) + 8] int8 rows
    stats    uint32[row_capacity]     fetch-hit counts (evict_least_used) or access stamps
                                      (evict_oldest); empty unless the margin is bounded

The loops over them are `hps.tiers.hash_map.loops`. Removal leaves a tombstone in the slot
and moves the last row into the freed row, so the row store stays dense; tombstones go
when the slot array is rebuilt.

Memory: row arrays are allocated for twice the rows they must hold (or the rows a load
announced through `reserve` and a quarter more for keys updates add), but `np.empty`
pages stay untouched, hence not resident, until rows are written; so a table occupies
its raw key + vector bytes plus 4 bytes per slot (7-11 bytes per key: a table sized for
a load gives its slots about 4% of its row bytes, at a load of 0.35 to 0.56), and
growing copies each row about once.
`Table.nbytes` counts exactly that (the tier's `memory_bytes`; `HashMapTier.memory_required`
tells it ahead). HugeCTR's hash map took ~10×.

Rows of a compact storage type go into the arrays encoded (`encoded`, outside the lock)
and come out of the fetch kernel decoded into float32, or as the stored 16-bit bits into
an output of that type (`narrow_output`, `kernel_out`).

Limits: at most 2**31 - 1 rows per table (int32 slots).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from hps.errors import LookupInputError
from hps.rows.storage_types import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    INT8,
    StorageType,
    encode,
    first_unencodable_row,
)
from hps.tiers.hash_map import loops as kernels

EMPTY = kernels.EMPTY
TOMBSTONE = kernels.TOMBSTONE

#: a slot array is rebuilt larger once live + tombstones would pass this share of it...
MAX_LOAD = 0.7
#: ...and is rebuilt to the size that puts the load at this share
REBUILD_LOAD = 0.5
#: rows `reserve` allocates beyond a load's, for keys online updates add later: pages
#: never written are not resident, and without them the first new key after a load
#: copied every row under the table's write lock (10M rows of width 64: 4.8 s of every
#: lookup of the table waiting, 2-core machine, 2026-11-29), and doubled its memory
RESERVE_ROW_HEADROOM = 0.25
#: a slot array sized by `reserve` for a whole table (a load knows its size) takes at most
#: this share of the table's row bytes...
RESERVE_SLOT_SHARE = 0.04
#: ...at a load between these: lower means fewer collisions (a collision costs a random
#: read of a row's key, and a mispredicted branch), higher means fewer bytes per key. The
#: highest leaves the slots room for the rows' headroom: at 0.65 the slot rebuild after
#: 7.7% more keys held a 10M-key width-8 table's writes and lookups 833 ms (2-core machine)
RESERVE_LOAD_MIN, RESERVE_LOAD_MAX = 0.35, MAX_LOAD / (1.0 + RESERVE_ROW_HEADROOM)
MIN_SLOTS = 16
MIN_ROWS = 16


def reserve_load(row_bytes: int) -> float:
    """The slot load a table sized for a whole load of rows of `row_bytes` (key and
    stored vector) gets: its slots take at most RESERVE_SLOT_SHARE of the row bytes."""
    return min(RESERVE_LOAD_MAX, max(RESERVE_LOAD_MIN, np.dtype(np.int32).itemsize / (
        RESERVE_SLOT_SHARE * row_bytes)))


_U32_MAX = np.iinfo(np.uint32).max
_NO_STATS = np.empty(0, np.uint32)
_NO_FLOATS = np.empty((0, 2), np.float32)  # the kernels' `floats` of tables not int8
_FLOAT32 = np.dtype(np.float32)
_FLOAT16 = np.dtype(np.float16)
_UINT16 = np.dtype(np.uint16)


def _kernel_dtype(storage: StorageType) -> np.dtype:
    """The element type the kernels store rows as (numba has no float16 on the CPU: its
    bits go as uint16)."""
    return _UINT16 if storage is FLOAT16 else storage.stored_dtype


#: rows start on a cache line: a row of 64·k bytes then takes k lines, not k + 1 (large
#: NumPy arrays start 16 bytes into a page), and the fetch prefetches each of them
_ROW_ALIGN = 64


def _row_array(rows: int, width: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous [rows, width] array whose first row starts on a
    cache line (its pages untouched, hence not resident, until written)."""
    size = rows * width * dtype.itemsize
    raw = np.empty(size + _ROW_ALIGN, np.uint8)
    start = -raw.ctypes.data % _ROW_ALIGN
    return raw[start:start + size].view(dtype).reshape(rows, width)


def narrow_output(storage: StorageType) -> np.dtype | None:
    """The output dtype other than float32 that a table of `storage` fills with its stored
    bits as they are (float16; bfloat16 as uint16 bits), None when there is none."""
    if storage is FLOAT16:
        return _FLOAT16
    if storage is BFLOAT16:
        return _UINT16
    return None


def kernel_out(t: Table, out: np.ndarray) -> np.ndarray:
    """`out` as the fetch kernel's decode takes it for table `t` (hps.rows.decode_loops):
    float16 outputs as their bits; float32 outputs of bfloat16 rows as uint32 bits."""
    if out.dtype is _FLOAT32 or out.dtype == _FLOAT32:
        return out.view(np.uint32) if t.storage is BFLOAT16 else out
    return out.view(np.uint16)


def encoded(storage: StorageType, vectors: np.ndarray, table: str) -> np.ndarray:
    """float32 rows in `storage`'s stored form, as the kernels take them. Raises
    LookupInputError naming the first row the type cannot hold."""
    bad = first_unencodable_row(storage, vectors)
    if bad is not None:
        raise LookupInputError(
            f"table {table!r} stores {storage.name} rows, which hold finite values of "
            f"magnitude below {storage.max_magnitude:g}; row {bad} holds "
            f"{_worst(vectors[bad])}: nothing was written")
    stored = encode(storage, vectors)
    return stored.view(np.uint16) if storage is FLOAT16 else stored


def _worst(row: np.ndarray) -> str:
    """The value of `row` that is furthest out of every range, for messages."""
    with np.errstate(invalid="ignore"):
        bad = row[~np.isfinite(row)]
    return repr(float(bad[0])) if bad.size else repr(float(row[np.argmax(np.abs(row))]))


class ReadWriteLock:
    """Many readers or one writer; a waiting writer holds off new readers.

    `acquire_read`/`release_read` are plain calls (no context manager) because a one-key
    fetch takes them on its path.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    def acquire_read(self) -> None:
        with self._mutex:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._mutex:
            self._readers -= 1
            if not self._readers and self._writers_waiting:
                self._cond.notify_all()

    def acquire_write(self) -> None:
        with self._mutex:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writing = True

    def release_write(self) -> None:
        with self._mutex:
            self._writing = False
            self._cond.notify_all()

    @contextmanager
    def read(self) -> Iterator[None]:
        self.acquire_read()
        try:
            yield
        finally:
            self.release_read()

    @contextmanager
    def write(self) -> Iterator[None]:
        self.acquire_write()
        try:
            yield
        finally:
            self.release_write()


class Table:
    """The arrays of one table and the locks that guard them."""

    def __init__(self, dim: int, num_partitions: int, policy: str | None,
                 storage: StorageType = FLOAT32) -> None:
        """`policy`: the overflow policy whose per-row stats to keep, or None for none."""
        self.dim = dim
        self.storage = storage
        self.width = storage.row_width(dim)
        self.row_dtype = _kernel_dtype(storage)
        self.stamped = policy == "evict_oldest"
        self.lock = ReadWriteLock()
        self.stats_lock = threading.Lock()  # fetches (readers) update stats and the clock
        self.state = np.zeros(2, np.int64)  # rows in use, tombstones (the kernels keep it)
        self.clock = 0  # ops seen; stamps of evict_oldest
        self.keys = np.zeros(MIN_ROWS, np.int64)
        self._set_vectors(_row_array(MIN_ROWS, self.width, self.row_dtype))
        self.vectors[:] = 0
        self.has_stats = policy in ("evict_oldest", "evict_least_used")
        self.stats = np.zeros(MIN_ROWS, np.uint32) if self.has_stats else _NO_STATS
        self.written = 0  # rows ever written to the current row arrays (their resident part)
        self.partition_sizes = np.zeros(num_partitions, np.int64)
        self.version = 0  # inserts and removals so far: an export checks it is unchanged
        self._set_slots(MIN_SLOTS)

    @property
    def size(self) -> int:
        return int(self.state[0])

    def _set_vectors(self, vectors: np.ndarray) -> None:
        self.vectors = vectors
        # an int8 row's scale and bias, read as float32 by the fetch kernel
        self.floats = vectors.view(np.float32) if self.storage is INT8 else _NO_FLOATS

    def row_bytes(self) -> int:
        """Bytes of one row: key, stored vector, stat."""
        stat = self.stats.itemsize if self.has_stats else 0
        return self.keys.itemsize + self.vectors.itemsize * self.width + stat

    def _set_slots(self, capacity: int) -> None:
        self.slots = np.full(capacity, EMPTY, np.int32)
        self.row_bits = kernels.row_bits(capacity)
        # one slot always stays EMPTY: it ends every probe
        self.max_used = min(capacity - 1, int(capacity * MAX_LOAD))
        self.state[1] = 0

    def nbytes(self) -> int:
        """Bytes of memory the arrays occupy: all of the slots, the written rows.

        The row arrays may reserve more rows than they hold, but pages never written are
        not backed by memory (the benchmark checks this against the process RSS), so
        they are not counted; rows freed by removals are, until the arrays shrink.
        """
        rows = max(self.written, MIN_ROWS)
        return self.slots.nbytes + self.partition_sizes.nbytes + rows * self.row_bytes()

    # -- sizing -------------------------------------------------------------------------

    def rebuild(self, extra: int, load: float = REBUILD_LOAD) -> None:
        """New slot array for size + extra keys at `load`, without tombstones."""
        capacity = max(MIN_SLOTS, math.ceil((self.size + extra) / load) + 1)
        self._set_slots(capacity)
        kernels.place_rows(self.slots, self.keys, self.size, self.row_bits)

    def grow(self, extra: int) -> None:
        """Room for `extra` more keys than the table holds: rows, slots, or both."""
        if self.size + 1 > self.keys.size:
            self._move_rows(max(2 * (self.size + extra), MIN_ROWS))
        if self.size + int(self.state[1]) + 1 > self.max_used:
            self.rebuild(extra)

    def reserve(self, total: int) -> None:
        """Rows and slots for `total` keys in all, allocated once (a load's size), and
        rows for RESERVE_ROW_HEADROOM more (exactly `total` where the allocator refuses)."""
        if total > self.keys.size:
            try:
                self._move_rows(math.ceil(total * (1.0 + RESERVE_ROW_HEADROOM)))
            except MemoryError:  # a commit limit that counts pages never written
                self._move_rows(total)
        load = reserve_load(self.keys.itemsize + self.vectors.itemsize * self.width)
        if math.ceil(total / load) + 1 > self.slots.size:
            self.rebuild(total - self.size, load)

    def trim_rows(self) -> None:
        """Move to arrays of 2 × size rows after a large removal (frees the old pages)."""
        self._move_rows(max(2 * self.size, MIN_ROWS))

    def _move_rows(self, capacity: int) -> None:
        # np.empty leaves pages untouched (not resident) until rows are written, and NumPy
        # asks for huge pages on large arrays: random row reads then miss the TLB less.
        n = self.size
        keys = np.empty(capacity, np.int64)
        keys[:n] = self.keys[:n]
        vectors = _row_array(capacity, self.width, self.row_dtype)
        vectors[:n] = self.vectors[:n]
        self.keys = keys
        self._set_vectors(vectors)
        if self.has_stats:
            stats = np.empty(capacity, np.uint32)
            stats[:n] = self.stats[:n]
            self.stats = stats
        self.written = n

    def shrink(self) -> None:
        """Give memory back after removals left the table much smaller than its arrays."""
        if self.size < self.keys.size // 8 and self.keys.size > 8 * MIN_ROWS:
            self.trim_rows()
        if self.slots.size > MIN_SLOTS and self.size < self.slots.size * REBUILD_LOAD / 8:
            self.rebuild(0)

    def tick(self) -> int:
        """Advance the op clock; renumbers stamps before they would pass uint32."""
        self.clock += 1
        if self.clock >= _U32_MAX and self.stamped:
            _, ranks = np.unique(self.stats[: self.size], return_inverse=True)
            self.stats[: self.size] = ranks
            self.clock = int(ranks.max(initial=0)) + 1
        return self.clock
