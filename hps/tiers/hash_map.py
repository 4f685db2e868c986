"""The in-process volatile tier: one open-addressing hash table per table, compiled.

A table is a handful of flat arrays, never a per-key Python object:

    slots    int32[capacity]          row of each slot with a tag of its key's hash in the
                                      bits the row does not need, or EMPTY (-1) /
                                      TOMBSTONE (-2); rows + tombstones stay <= MAX_LOAD
                                      of the capacity
    keys     int64[row_capacity]      key of each row; rows [0, size) are live and dense
    vectors  [row_capacity, width]    rows in the table's storage type (hps/rows/storage_types.py):
                                      float32 [., dim]; uint16 [., dim] bits of float16 or
                                      bfloat16; uint8 [., align4(dim) + 8] int8 rows
    stats    uint32[row_capacity]     fetch-hit counts (evict_least_used) or access stamps
                                      (evict_oldest); empty unless the margin is bounded

A key's home slot is `rrxmrrxmsx_0(key) % capacity` (the mixer that picks its partition);
collisions probe linearly, comparing tags before keys (so a fetch finds a key's row from
the slots alone and prefetches it). The loops over keys (probe, fetch, insert, remove,
rebuild) are numba kernels in `hps.tiers.hash_map_loops` that release the GIL, compiled or
loaded from numba's on-disk cache when this module is first imported, never inside a
lookup. Removal
leaves a tombstone in the slot and moves the last row into the freed row, so the row store
stays dense; tombstones go when the slot array is rebuilt.

Storage types (`create_table(..., storage=)`, the model's `embedding_storage_dtype`):
inserts encode float32 rows outside the table lock (hps.rows.storage_types.encode; a row the type
cannot hold, NaN, infinity or out of its range, is a LookupInputError and nothing is
written); fetches decode in the compiled copy, into float32 outputs, or write the stored
bits as they are into an output of the storage's own 16-bit type. A float16 or bfloat16
table takes half the vector bytes of float32, an int8 table a quarter plus 8 bytes a row.

Memory: row arrays are allocated for twice the rows they must hold (or exactly the rows a
load announced through `reserve`), but `np.empty` pages stay untouched, hence not
resident, until rows are written; so a table occupies its raw key + vector bytes plus
4 bytes per slot (6-11 bytes per key: a table sized for a load gives its slots about 4%
of its row bytes, at a load of 0.35 to 0.65), and growing copies each row about once.
`memory_bytes` counts exactly that (`memory_required` tells it ahead). HugeCTR's hash map took ~10×.

Overflow: `overflow_margin` bounds the entries of each partition (`partition_of(key,
num_partitions)`). When an insert takes a partition past it, that partition is pruned to
`int(overflow_margin × overflow_resolution_target)` entries: random victims
(`evict_random`), the fewest fetch hits (`evict_least_used`) or the oldest stamp
(`evict_oldest`: insert/overwrite time, also fetch time when `refresh_time_after_fetch`,
as in HugeCTR).

Thread safety: one readers-writer lock per table around the kernels; input checks run
outside it. Fetches share the lock and the kernels release the GIL, so fetches from
several threads run in parallel, and a fetch of many keys is split over the machine's
cores; inserts and removals take the lock alone. The per-row stats that fetches update
have a small lock of their own.

Limits: at most 2**31 - 1 rows per table (int32 slots).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

from hps.config import UNBOUNDED, VolatileDBConfig
from hps.runtime.cores import usable_cores
from hps.tiers import hash_map_loops as kernels
from hps.tiers.contract import Tier, as_keys, as_rows
from hps.errors import ConfigError, LookupInputError, TierError
from hps.rows.storage_types import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    INT8,
    StorageType,
    decode,
    encode,
    first_unencodable_row,
    storage_type,
)

EMPTY = kernels.EMPTY
TOMBSTONE = kernels.TOMBSTONE

#: a slot array is rebuilt larger once live + tombstones would pass this share of it...
MAX_LOAD = 0.7
#: ...and is rebuilt to the size that puts the load at this share
REBUILD_LOAD = 0.5
#: a slot array sized by `reserve` for a whole table (a load knows its size) takes at most
#: this share of the table's row bytes...
RESERVE_SLOT_SHARE = 0.04
#: ...at a load between these: lower means fewer collisions (a collision costs a random
#: read of a row's key, and a mispredicted branch), higher means fewer bytes per key
RESERVE_LOAD_MIN, RESERVE_LOAD_MAX = 0.35, 0.65
MIN_SLOTS = 16
MIN_ROWS = 16
#: a fetch of at least this many keys per core is split over the cores
PARALLEL_KEYS = 1 << 15
#: an insert is split only over this many cores or more: the split does about 2.6× the
#: work of the one-thread insert (grouping the keys by region, a second pass that places
#: the new rows; 10M keys of width 64, one core: 0.9 s against 0.35 s), and on 2 cores
#: two threads took twice the time of one (the row copy is bound by memory bandwidth)
SPLIT_INSERT_PARTS = 4


def reserve_load(row_bytes: int) -> float:
    """The slot load a table sized for a whole load of rows of `row_bytes` (key and
    stored vector) gets: its slots take at most RESERVE_SLOT_SHARE of the row bytes."""
    return min(RESERVE_LOAD_MAX, max(RESERVE_LOAD_MIN, np.dtype(np.int32).itemsize / (
        RESERVE_SLOT_SHARE * row_bytes)))

_U32_MAX = np.iinfo(np.uint32).max
#: least-used counts are halved when one passes this (each op adds < 2**28 between checks)
_COUNT_LIMIT = 1 << 31
_COUNT_CHECK_EVERY = 4096
_NO_ROWS = np.empty(0, np.int64)
_NO_FLOATS = np.empty((0, 2), np.float32)  # the kernels' `floats` of tables not int8
_INT64 = np.dtype(np.int64)
_FLOAT32 = np.dtype(np.float32)
_FLOAT16 = np.dtype(np.float16)
_UINT16 = np.dtype(np.uint16)


def _kernel_dtype(storage: StorageType) -> np.dtype:
    """The element type the kernels store rows as (numba has no float16 on the CPU: its
    bits go as uint16)."""
    return _UINT16 if storage is FLOAT16 else storage.stored_dtype


def _as_keys(keys: np.ndarray) -> np.ndarray:
    """`as_keys`, without its cost for what the lookup path hands over: a C-contiguous
    1-D int64 array is taken as it is."""
    if (type(keys) is np.ndarray and keys.dtype is _INT64 and keys.ndim == 1
            and keys.flags.c_contiguous):
        return keys
    return as_keys(keys)
_NO_STATS = np.empty(0, np.uint32)


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


def _narrow_output(storage: StorageType) -> np.dtype | None:
    """The output dtype other than float32 that a table of `storage` fills with its stored
    bits as they are (float16; bfloat16 as uint16 bits), None when there is none."""
    if storage is FLOAT16:
        return _FLOAT16
    if storage is BFLOAT16:
        return _UINT16
    return None


def _kernel_out(t: _Table, out: np.ndarray) -> np.ndarray:
    """`out` as the fetch kernel's decode takes it for table `t` (hps.rows.decode_loops):
    float16 outputs as their bits; float32 outputs of bfloat16 rows as uint32 bits."""
    if out.dtype is _FLOAT32 or out.dtype == _FLOAT32:
        return out.view(np.uint32) if t.storage is BFLOAT16 else out
    return out.view(np.uint16)


def _encoded(storage: StorageType, vectors: np.ndarray, table: str) -> np.ndarray:
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


class _ReadWriteLock:
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


class _Table:
    """The arrays of one table and the locks that guard them."""

    def __init__(self, dim: int, num_partitions: int, policy: str | None,
                 storage: StorageType = FLOAT32) -> None:
        """`policy`: the overflow policy whose per-row stats to keep, or None for none."""
        self.dim = dim
        self.storage = storage
        self.width = storage.row_width(dim)
        self.row_dtype = _kernel_dtype(storage)
        self.stamped = policy == "evict_oldest"
        self.lock = _ReadWriteLock()
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
        """Rows and slots for `total` keys in all, allocated once (a load's size)."""
        if total > self.keys.size:
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


class HashMapTier(Tier):
    """The in-process volatile tier (`volatile_db.type` "hash_map" / "parallel_hash_map").

    `HashMapTier(config: VolatileDBConfig)`; reads `num_partitions`, `overflow_margin`,
    `overflow_policy`, `overflow_resolution_target` and `refresh_time_after_fetch`.
    """

    name = "hash_map"
    in_process = True
    compact_storage = True

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
        self._workers = usable_cores()
        self._pool: ThreadPoolExecutor | None = None
        # a bounded table may have evicted rows it was given: it cannot stand for a file
        self.can_export = not self._bounded

    # -- tables -------------------------------------------------------------------------

    def create_table(self, table: str, dim: int, storage: StorageType | str = FLOAT32
                     ) -> None:
        """Make `table` known with rows of width `dim` stored as `storage`; keeps existing
        contents.

        Raises ConfigError if the table exists with another width or storage type.
        """
        dim = int(dim)
        if dim < 1:
            raise ConfigError(f"table {table!r}: width must be positive, got {dim}")
        try:
            kind = storage_type(storage)
        except ValueError as exc:
            raise ConfigError(f"table {table!r}: {exc}") from None
        with self._tables_lock:
            existing = self._tables.get(table)
            if existing is not None:
                if existing.dim != dim:
                    raise ConfigError(
                        f"hash_map table {table!r} holds rows of width {existing.dim}, "
                        f"not {dim}: drop it first"
                    )
                if existing.storage is not kind:
                    raise ConfigError(
                        f"hash_map table {table!r} stores {existing.storage.name} rows, "
                        f"not {kind.name}: drop it first"
                    )
                return
            policy = self.overflow_policy if self._bounded else None
            self._tables[table] = _Table(dim, self.num_partitions, policy, kind)
            super().create_table(table, dim, kind)

    def storage(self, table: str) -> StorageType:
        """The type `table` stores its rows in (hps/rows/storage_types.py)."""
        return self._table(table).storage

    @staticmethod
    def memory_required(num_keys: int, dim: int, storage: StorageType | str = FLOAT32, *,
                        num_partitions: int = 16) -> int:
        """Bytes a table of `num_keys` rows of width `dim` stored as `storage` takes once a
        load has filled it (slots sized by `reserve`, no overflow stats)."""
        row_bytes = 8 + storage_type(storage).row_bytes(dim)
        slots = max(MIN_SLOTS, math.ceil(num_keys / reserve_load(row_bytes)) + 1)
        return 4 * slots + 8 * num_partitions + max(num_keys, MIN_ROWS) * row_bytes

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
        t = self._tables.get(table) or self._table(table)
        k = _as_keys(keys)
        out = np.empty((k.size, t.dim), np.float32)
        found = np.empty(k.size, np.bool_)
        self._fetch(t, k, _kernel_out(t, out), found)
        return out, found

    def fetch_into(self, table: str, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Write the vectors of `keys` (int64[n]) into `out` (C-contiguous, writable, shape
        [n, dim], e.g. a pinned staging buffer); rows of absent keys become zeros.

        `out` is float32 (rows decoded), or, for a table stored as float16, float16, and
        for one stored as bfloat16, uint16 bfloat16 bits: the stored rows as they are.
        Returns found (bool[n]). Raises LookupInputError for an `out` of another dtype,
        shape or layout (nothing is written then).
        """
        t = self._tables.get(table) or self._table(table)
        k = _as_keys(keys)
        flags = getattr(out, "flags", None)
        narrow = _narrow_output(t.storage)
        if (type(out) is not np.ndarray or out.shape != (k.size, t.dim)
                or not flags.c_contiguous  # type: ignore[union-attr]
                or not flags.writeable  # type: ignore[union-attr]
                or not (out.dtype is _FLOAT32 or (narrow is not None and out.dtype == narrow))):
            also = f" (or {narrow.name}: the stored {t.storage.name} bits)" if narrow else ""
            raise LookupInputError(
                f"fetch_into needs a writable C-contiguous float32{also} array of shape "
                f"({k.size}, {t.dim}), got {type(out).__name__} "
                f"{getattr(out, 'dtype', '')} {getattr(out, 'shape', '')}"
            )
        found = np.empty(k.size, np.bool_)
        self._fetch(t, k, _kernel_out(t, out), found)
        return found

    def _fetch(self, t: _Table, keys: np.ndarray, out: np.ndarray, found: np.ndarray) -> None:
        """The fetch kernel over `keys` into `out` (as `_kernel_out` gives it)."""
        rows = np.empty(keys.size, np.int64) if t.has_stats else _NO_ROWS
        t.lock.acquire_read()
        try:
            parts = min(self._workers, keys.size // PARALLEL_KEYS)
            if parts > 1:
                self._fetch_parallel(t, keys, out, found, rows, parts)
            else:
                kernels.fetch(t.slots, t.keys, t.vectors, t.floats, t.row_bits, keys, out,
                              found, rows)
            if t.has_stats:
                with t.stats_lock:
                    self._note_fetch(t, rows)
        finally:
            t.lock.release_read()

    def _fetch_parallel(self, t: _Table, keys: np.ndarray, out: np.ndarray,
                        found: np.ndarray, rows: np.ndarray, parts: int) -> None:
        """One slice of the keys per core."""
        bounds = np.linspace(0, keys.size, parts + 1).astype(np.int64).tolist()

        def run(part: int) -> None:
            s = slice(bounds[part], bounds[part + 1])
            kernels.fetch(t.slots, t.keys, t.vectors, t.floats, t.row_bits, keys[s], out[s],
                          found[s], rows[s] if rows.size else _NO_ROWS)

        self._split(run, parts)

    def _split(self, run: Callable[[int], None], parts: int) -> None:
        """run(0) … run(parts - 1) at once, on the tier's worker threads and this one
        (which takes the last); returns when all are done, raising the first error."""
        if self._pool is None:
            with self._tables_lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._workers - 1,
                                                    thread_name_prefix="hps-hash-map")
        futures = [self._pool.submit(run, part) for part in range(parts - 1)]
        try:
            run(parts - 1)
        finally:
            for future in futures:
                future.result()

    def _note_fetch(self, t: _Table, rows: np.ndarray) -> None:
        clock = t.tick()
        if self.overflow_policy == "evict_least_used":
            kernels.count_hits(t.stats, rows)
            if clock % _COUNT_CHECK_EVERY == 0 and t.stats[: t.size].max(initial=0) > _COUNT_LIMIT:
                t.stats[: t.size] >>= 1
        elif self.refresh_time_after_fetch:
            kernels.stamp_rows(t.stats, rows, np.uint32(clock))

    def insert(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Insert or overwrite rows (float32 vectors, stored in the table's storage type);
        the last of duplicate keys wins. Prunes on overflow.

        Raises LookupInputError, writing nothing, when keys and vectors disagree in count
        or width, or a row holds what the storage type cannot (NaN, infinity, out of its
        range: hps/rows/storage_types.py).
        """
        t = self._tables.get(table) or self._table(table)
        k, v = as_rows(keys, vectors, t.dim)
        if not k.size:
            return
        if t.storage.compact:
            v = _encoded(t.storage, v, table)
        t.lock.acquire_write()
        try:
            stamp = t.tick() if t.has_stats else 0
            oldest = self.overflow_policy == "evict_oldest"
            before = t.size
            done = 0
            parts = min(self._workers, k.size // PARALLEL_KEYS)
            if (parts >= SPLIT_INSERT_PARTS and not t.has_stats and t.size + k.size <= t.keys.size
                    and t.size + int(t.state[1]) + k.size <= t.max_used):
                # room for every key without growing: split over the cores; the keys
                # left at the regions' seams are inserted below as any others
                k, v = self._insert_parallel(t, k, v, parts)
            while True:
                done = kernels.insert(t.slots, t.keys, t.vectors, t.stats, t.partition_sizes,
                                      t.state, t.row_bits, k, v, done, t.max_used,
                                      stamp if oldest else 0, stamp if oldest else -1)
                if done == k.size:
                    break
                t.grow(k.size - done)
            t.written = max(t.written, t.size)
            t.version += 1
            if self._bounded and t.size > before:
                self._prune(t)
        finally:
            t.lock.release_write()

    def _insert_parallel(self, t: _Table, keys: np.ndarray, vectors: np.ndarray,
                         parts: int) -> tuple[np.ndarray, np.ndarray]:
        """Insert `keys` (stored-form `vectors`) on `parts` threads, each owning a region
        of the slot array (hash_map_kernels: insert_region, place_new); the table has
        room for all of them. Returns the keys (and rows) left at the regions' seams, in
        batch order, for the one-thread insert. Holds the write lock (the caller's)."""
        n, capacity = keys.size, t.slots.size
        region = -(-capacity // parts)
        bounds = np.linspace(0, n, parts + 1).astype(np.int64).tolist()
        homes = np.empty(n, np.int64)
        counts = np.zeros((parts, parts), np.int64)  # [key slice, region]
        self._split(lambda p: kernels.homes_by_region(
            keys, bounds[p], bounds[p + 1], capacity, region, homes, counts[p]), parts)
        flat = counts.T.reshape(-1)  # regions in order, the slices in order within each
        cursors = np.ascontiguousarray((np.cumsum(flat) - flat).reshape(parts, parts).T)
        members = np.empty(n, np.int64)
        self._split(lambda p: kernels.group_by_region(
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

        self._split(probe, parts)
        firsts = (t.size + np.cumsum(counters[:, 0]) - counters[:, 0]).tolist()
        partition_sizes = np.zeros((parts, t.partition_sizes.size), np.int64)

        def place(r: int) -> None:
            a, b = ends[r], ends[r + 1]
            kernels.place_new(t.slots, t.keys, t.vectors, t.row_bits, keys, vectors,
                              new_slots[a:b], new_index[a:b], int(counters[r, 0]), firsts[r],
                              partition_sizes[r])

        self._split(place, parts)
        t.state[0] += int(counters[:, 0].sum())
        t.state[1] -= int(counters[:, 2].sum())
        t.partition_sizes += partition_sizes.sum(axis=0)
        seams = np.concatenate([deferred[ends[r] : ends[r] + counters[r, 1]]
                                for r in range(parts)])  # a loop over regions
        seams.sort()
        return keys[seams], vectors[seams]

    @contextmanager
    def sorted_rows(self, table: str,
                    order: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray] | None]
                    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """Every row of `table` where it lies: `(keys, rows, positions)` with `order`
        (a persistent tier's `bulk_sorted`) applied to the keys, the row of `keys[i]` at
        `rows[positions[i]]`. The table's read lock is held until the context ends
        (fetches go on; writes wait), so the rows stay where they are while a bulk load
        reads them. Raises TierError for a table of compact rows (export decodes them)."""
        t = self._tables.get(table) or self._table(table)
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

    def reserve(self, table: str, num_keys: int) -> None:
        """Allocate rows and slots for `num_keys` keys in all, ahead of a load of that many
        (one allocation instead of growing by doubling). A hint: never shrinks."""
        t = self._tables.get(table) or self._table(table)
        t.lock.acquire_write()
        try:
            t.reserve(int(num_keys))
        finally:
            t.lock.release_write()

    def export(self, table: str, order: Callable[[np.ndarray], np.ndarray | None],
               chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every row of `table` as `(keys, vectors)` copies, `chunk_rows` at a time, in
        the order `order(keys)` gives (row order for None). Vectors are float32: a compact
        table's rows decoded (within its storage type's error bound of what was inserted).

        Raises TierError when the table is written to while the export runs.
        """
        t = self._tables.get(table) or self._table(table)
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

    def _prune(self, t: _Table) -> None:
        """Prune every partition past the margin down to the resolution target."""
        over = np.flatnonzero(t.partition_sizes > self.overflow_margin)
        if not over.size:
            return
        parts = np.empty(t.size, np.int64)
        kernels.partitions(t.keys, t.size, self.num_partitions, parts)
        # Rows of the overflowing partitions only, grouped by partition.
        rows_over = np.flatnonzero(np.isin(parts, over))
        rows_over = rows_over[np.argsort(parts[rows_over], kind="stable")]
        starts = np.concatenate([[0], np.cumsum(t.partition_sizes[over])])
        victims = []
        for i in range(over.size):  # a loop over partitions, not keys
            members = rows_over[starts[i] : starts[i + 1]]
            excess = members.size - self.prune_target
            victims.append(members[self._victims(t, members, excess)])
        # by key: removing a row moves another into its place
        victim_keys = t.keys[np.concatenate(victims)]
        kernels.remove(t.slots, t.keys, t.vectors, t.stats, t.partition_sizes, t.state,
                       t.row_bits, victim_keys)
        t.shrink()

    def _victims(self, t: _Table, members: np.ndarray, excess: int) -> np.ndarray:
        """Positions in `members` of the `excess` rows the policy evicts."""
        if excess >= members.size:
            return np.arange(members.size)
        if self.overflow_policy == "evict_random":
            return self._rng.choice(members.size, excess, replace=False)
        return np.argpartition(t.stats[members], excess - 1)[:excess]

    def remove(self, table: str, keys: np.ndarray) -> int:
        """Delete `keys`; returns how many distinct keys were present."""
        t = self._tables.get(table) or self._table(table)
        k = _as_keys(keys)
        if not k.size:
            return 0
        t.lock.acquire_write()
        try:
            removed = kernels.remove(t.slots, t.keys, t.vectors, t.stats, t.partition_sizes,
                                     t.state, t.row_bits, k)
            t.version += 1
            t.shrink()
        finally:
            t.lock.release_write()
        return int(removed)

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
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

