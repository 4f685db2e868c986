"""The in-process volatile tier: one open-addressing hash table per table, compiled.

Each table is flat arrays (`hps.tiers.hash_map.table`: slots, keys, rows, per-row stats;
how they are sized and how much memory they take). A key's home slot is
`rrxmrrxmsx_0(key) % capacity` (the mixer that picks its partition); collisions probe
linearly, comparing tags before keys (so a fetch finds a key's row from the slots alone
and prefetches it). The loops over keys (probe, fetch, insert, remove, rebuild) are numba
kernels in `hps.tiers.hash_map.loops` that release the GIL, compiled or loaded from
numba's on-disk cache when this package is first imported, never inside a lookup.

Storage types (`create_table(..., storage=)`, the model's `embedding_storage_dtype`):
inserts encode float32 rows outside the table lock (hps.rows.storage_types.encode; a row
the type cannot hold, NaN, infinity or out of its range, is a LookupInputError and nothing
is written); fetches decode in the compiled copy, into float32 outputs, or write the
stored bits as they are into an output of the storage's own 16-bit type. A float16 or
bfloat16 table takes half the vector bytes of float32, an int8 table a quarter plus 8
bytes a row.

Overflow: a bounded `overflow_margin` prunes each partition past it by `overflow_policy`
(`hps.tiers.hash_map.overflow`). Bulk loads: `reserve` allocates a load's rows once;
`sorted_rows` and `export` read a whole table back (`hps.tiers.hash_map.bulk`).

Thread safety: one readers-writer lock per table around the kernels; input checks run
outside it. Fetches share the lock and the kernels release the GIL, so fetches from
several threads run in parallel, and a fetch of many keys is split over the machine's
cores; inserts and removals take the lock alone (a large insert into a table with room
for it is split over the cores too). The per-row stats that fetches update have a small
lock of their own.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

from hps.config import VolatileDBConfig
from hps.errors import ConfigError, LookupInputError
from hps.rows.storage_types import FLOAT32, StorageType, storage_type
from hps.runtime.compiled import by_size, compile_declared, numba
from hps.runtime.cores import usable_cores
from hps.tiers.bulk_load import BulkLoadTier
from hps.tiers.contract import as_keys, as_rows
from hps.tiers.hash_map import bulk
from hps.tiers.hash_map import loops as kernels
from hps.tiers.hash_map.overflow import Overflow
from hps.tiers.hash_map.table import (
    MIN_ROWS,
    MIN_SLOTS,
    Table,
    encoded,
    kernel_out,
    narrow_output,
    reserve_load,
)

#: a fetch of at least this many keys per core is split over the cores
PARALLEL_KEYS = 1 << 15
#: an insert is split only over this many cores or more: the split does about 2.6× the
#: work of the one-thread insert (grouping the keys by region, a second pass that places
#: the new rows; 10M keys of width 64, one core: 0.9 s against 0.35 s), and on 2 cores
#: two threads took twice the time of one (the row copy is bound by memory bandwidth)
SPLIT_INSERT_PARTS = 4

_NO_ROWS = np.empty(0, np.int64)
_FLOAT32 = np.dtype(np.float32)


class HashMapTier(BulkLoadTier):
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
        self.overflow = Overflow(self.config, seed)
        self._tables: dict[str, Table] = {}
        self._tables_lock = threading.Lock()
        self._workers = usable_cores()
        self._pool: ThreadPoolExecutor | None = None
        # a bounded table may have evicted rows it was given: it cannot stand for a file
        self.can_export = not self.overflow.bounded

    # -- tables -------------------------------------------------------------------------

    def create_table(self, table: str, dim: int, storage: StorageType | str = FLOAT32
                     ) -> None:
        """Make `table` known with rows of width `dim` stored as `storage`; keeps existing
        contents.

        Raises ConfigError if the table exists with another width or storage type.
        """
        dim, kind = HashMapTier.table_kind(table, dim, storage)
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
            policy = self.overflow.policy if self.overflow.bounded else None
            self._tables[table] = Table(dim, self.overflow.num_partitions, policy, kind)
            super().create_table(table, dim, kind)

    @staticmethod
    def table_kind(table: str, dim: int, storage: StorageType | str) -> tuple[int, StorageType]:
        """The width and StorageType a new `table` is made with; ConfigError for a width
        below 1 or a storage type that is not one."""
        dim = int(dim)
        if dim < 1:
            raise ConfigError(f"table {table!r}: width must be positive, got {dim}")
        try:
            return dim, storage_type(storage)
        except ValueError as exc:
            raise ConfigError(f"table {table!r}: {exc}") from None

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

    def _table(self, table: str) -> Table:
        t = self._tables.get(table)
        if t is None:
            self.dim(table)  # raises UnknownTableError
            raise AssertionError("unreachable")
        return t

    # -- data ---------------------------------------------------------------------------

    def fetch(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectors (float32[n, dim], zero rows where not found) and found (bool[n])."""
        t = self._tables.get(table) or self._table(table)
        k = as_keys(keys)
        out = np.empty((k.size, t.dim), np.float32)
        found = np.empty(k.size, np.bool_)
        self._fetch(t, k, kernel_out(t, out), found)
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
        k = as_keys(keys)
        flags = getattr(out, "flags", None)
        narrow = narrow_output(t.storage)
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
        self._fetch(t, k, kernel_out(t, out), found)
        return found

    def _fetch(self, t: Table, keys: np.ndarray, out: np.ndarray, found: np.ndarray) -> None:
        """The fetch kernel over `keys` into `out` (as `kernel_out` gives it)."""
        rows = np.empty(keys.size, np.int64) if t.has_stats else _NO_ROWS
        t.lock.acquire_read()
        try:
            parts = min(self._workers, keys.size // PARALLEL_KEYS)
            if parts > 1:
                self._fetch_parallel(t, keys, out, found, rows, parts)
            else:
                # a small fetch keeps the GIL: released, a caller's lookup waits for
                # whatever Python another thread runs meanwhile (compiled.HOLD_GIL_BYTES)
                fetch = by_size(out.nbytes, kernels.fetch_held, kernels.fetch)
                fetch(t.slots, t.keys, t.vectors, t.floats, t.row_bits, keys, out, found,
                      rows)
            if t.has_stats:
                with t.stats_lock:
                    self.overflow.note_fetch(t, rows)
        finally:
            t.lock.release_read()

    def _fetch_parallel(self, t: Table, keys: np.ndarray, out: np.ndarray,
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
            v = encoded(t.storage, v, table)
        t.lock.acquire_write()
        try:
            stamp = t.tick() if t.has_stats else 0
            oldest = self.overflow.policy == "evict_oldest"
            before = t.size
            done = 0
            parts = min(self._workers, k.size // PARALLEL_KEYS)
            if (parts >= SPLIT_INSERT_PARTS and not t.has_stats and t.size + k.size <= t.keys.size
                    and t.size + int(t.state[1]) + k.size <= t.max_used):
                # room for every key without growing: split over the cores; the keys
                # left at the regions' seams are inserted below as any others
                k, v = bulk.split_insert(t, k, v, parts, self._split)
            insert = by_size(v.nbytes, kernels.insert_held, kernels.insert)  # as _fetch's
            while True:
                done = insert(t.slots, t.keys, t.vectors, t.stats, t.partition_sizes,
                              t.state, t.row_bits, k, v, done, t.max_used,
                              stamp if oldest else 0, stamp if oldest else -1)
                if done == k.size:
                    break
                t.grow(k.size - done)
            t.written = max(t.written, t.size)
            t.version += 1
            if self.overflow.bounded and t.size > before:
                self.overflow.prune(t)
        finally:
            t.lock.release_write()

    def warm_writes(self, table: str) -> None:
        """Compile both twins of `insert` for `table`'s stored rows (or read them from
        numba's cache), running neither: a load compiles the twin its batches take, and
        the other one's first call after ready (an online update's few rows, a miss
        cached from RocksDB) would compile under the table's write lock, every lookup
        of the table waiting for it (0.15 s on an H200 machine, 2026-11-29). A bounded
        tier's pruning too: the first update past `overflow_margin` compiled it under
        that lock (a lookup waited 2.2 s on a 2-core machine). Nothing is written; a
        table this tier does not hold is skipped."""
        t = self._tables.get(table)
        if t is None:
            return
        held = (t.slots, t.keys, t.vectors, t.stats, t.partition_sizes, t.state, t.row_bits,
                np.empty(0, np.int64))
        args = (*held, np.empty((0, t.dim), t.vectors.dtype), 0, t.max_used, 0, -1)
        signature = tuple(numba.typeof(arg) for arg in args)
        for twin in (kernels.insert_held, kernels.insert):
            twin.compile(signature)
        if self.overflow.bounded:
            compile_declared(kernels.partitions)
            kernels.remove.compile(tuple(numba.typeof(arg) for arg in held))

    def remove(self, table: str, keys: np.ndarray) -> int:
        """Delete `keys`; returns how many distinct keys were present."""
        t = self._tables.get(table) or self._table(table)
        k = as_keys(keys)
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

    # -- bulk loads ---------------------------------------------------------------------

    def reserve(self, table: str, num_keys: int) -> None:
        """Allocate rows and slots for `num_keys` keys in all, ahead of a load of that many
        (one allocation instead of growing by doubling). A hint: never shrinks."""
        t = self._tables.get(table) or self._table(table)
        t.lock.acquire_write()
        try:
            t.reserve(int(num_keys))
        finally:
            t.lock.release_write()

    @contextmanager
    def sorted_rows(self, table: str,
                    order: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray] | None]
                    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """Every row of `table` where it lies: `(keys, rows, positions)` with `order`
        (a persistent tier's `bulk_sorted`) applied to the keys, the row of `keys[i]` at
        `rows[positions[i]]`. The table's read lock is held until the context ends
        (fetches go on; writes wait), so the rows stay where they are while a bulk load
        reads them. Raises TierError for a table of compact rows (export decodes them)."""
        with bulk.sorted_rows(self._tables.get(table) or self._table(table), table,
                              order) as rows:
            yield rows

    def export(self, table: str, order: Callable[[np.ndarray], np.ndarray | None],
               chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every row of `table` as `(keys, vectors)` copies, `chunk_rows` at a time, in
        the order `order(keys)` gives (row order for None). Vectors are float32: a compact
        table's rows decoded (within its storage type's error bound of what was inserted).

        Raises TierError when the table is written to while the export runs.
        """
        yield from bulk.export(self._tables.get(table) or self._table(table), table, order,
                               chunk_rows)

    def close(self) -> None:
        with self._tables_lock:
            self._tables.clear()
            self._dims.clear()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

