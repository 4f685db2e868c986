"""The RocksDB persistent tier, through rocksdict.

Layout (HugeCTR's, so a database HugeCTR filled is served as it is):

    column family `hps_et.<model>.<table>`   one per table
        key     the raw 8-byte little-endian int64
        value   the raw float32 bytes of the row (4 × dim bytes)
    column family `hps_meta`                 small JSON per table (source, sizes, load
                                             time), so a reopened store knows what it holds
    column family `hps_changes`              the keys written to each table since its
                                             load (hps.tiers.rocksdb.changes)

RocksDB orders keys bytewise, i.e. by the least significant byte first; "bytewise order"
below means that order (the numeric order of the byte-swapped keys).

Fetch deduplicates the keys, sorts them in bytewise order (neighbouring keys share blocks)
and reads them with `multi_get` in slices of `max_batch_size`, spread over a small thread
pool (rocksdict releases the GIL while RocksDB reads). Keys become byte strings through a
NumPy `V8` view and rows come back through one `b"".join` and `np.frombuffer`; the only
per-key work left is inside rocksdict's C extension (rocksdict has no bulk put either:
writes call it once per key, driven by `map`, never by a Python loop).

Bulk loads (the `BulkLoadTier` contract) write table files (SST) of their own and have
RocksDB ingest them into its bottom level (no WAL, no memtable, no compaction): one sorted
run, so a read touches one file (`hps.tiers.rocksdb.bulk`, `hps.tiers.rocksdb.sst`). Rows
in any order are spilled by key range and sorted a range at a time (`load`), with memory
bounded by `load_run_bytes`; a load that is one chunk within that bound (a round of
online updates) is sorted in memory; rows already in bytewise order (`load_ordered`, from
a tier that holds the table) go straight to the files. Loads are durable when they
return. Values are stored uncompressed (float rows do not compress), table files are read
through mmap, and tables written through `insert` carry a bloom filter (bulk-loaded files
have none: a lookup of an absent key reads one data block of the one file whose range
holds it): the store's options and its opening are `hps.tiers.rocksdb.store`'s.

Thread safety: RocksDB is thread-safe; the tier's column-family handles change under a lock.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import rocksdict

from hps.config import PersistentDBConfig
from hps.errors import (
    ConfigError,
    LookupInputError,
    TierSetupError,
    UnknownTableError,
)
from hps.rows.storage_types import StorageType
from hps.rows.stored_values import decode_rows
from hps.runtime.background import PeriodicTask
from hps.runtime.cores import usable_cores
from hps.runtime.throttled_log import ThrottledLog
from hps.tiers.bulk_load import BulkLoadTier
from hps.tiers.contract import as_keys, as_rows
from hps.tiers.rocksdb.bulk import (
    FILE_BYTES,
    BucketSpill,
    SstSink,
    WriterPool,
    bytewise_order,
    bytewise_sorted,
    compile_bulk_writes,
    last_of_each,
)
from hps.tiers.rocksdb.encoding import consume, key_bytes, row_bytes
from hps.tiers.rocksdb.records import LoadRecords
from hps.tiers.rocksdb.scan import SCAN_CHUNK_ROWS, scan_rows
from hps.tiers.rocksdb.secondary import (
    FOLLOW_SECONDS,
    FollowsPrimary,
    changing_store,
    leads_a_run,
    open_secondary,
    secondary_folder,
)
from hps.tiers.rocksdb.store import (
    CHANGES_CF,
    DEFAULT_CF,
    INGEST_PREFIX,
    META_CF,
    open_store,
    remove_stale_loads,
    store_options,
    stored_dim,
)

log = logging.getLogger("hps.tiers.rocksdb.tier")

#: RocksDB block cache shared by all tables of one store
DEFAULT_BLOCK_CACHE_BYTES = 256 << 20
#: keys per multi_get call handed to one worker thread
_MIN_SLICE = 2048
#: vector bytes a bulk load sorts at once (a few load chunks: memory stays bounded)
DEFAULT_LOAD_RUN_BYTES = 256 << 20
#: key ranges a bulk load spills to when it was not told the table's size
_DEFAULT_BUCKETS = 64
_MIN_FILE_BYTES = 64 << 10
#: RocksDB property: keys a column family holds, estimated from its metadata
_ESTIMATED_KEYS = "rocksdb.estimate-num-keys"


class RocksDBTier(FollowsPrimary, LoadRecords, BulkLoadTier):
    """The persistent tier (`persistent_db.type` "rocks_db").

    `RocksDBTier(config: PersistentDBConfig, *, block_cache_bytes=256 MiB,
    load_run_bytes=256 MiB)`; reads `path`, `num_threads`,
    `read_only`, `max_batch_size`. `load_run_bytes` bounds the vector bytes `load` sorts
    at once (default: four 64 MiB load chunks), so a load's memory stays a few chunks
    whatever the table size; what a table holds beyond one run is written in batches.
    Opening creates the store if missing (unless read-only) and finds its column families;
    in a follower worker of `hps serve --workers N` it opens a read-only secondary
    instance of the leader's store instead, kept up with it (`catch_up`).
    Raises TierSetupError when the store cannot be opened (locked by another process,
    missing while read-only, not a RocksDB directory).
    """

    name = "rocksdb"
    can_scan = True

    def __init__(
        self,
        config: PersistentDBConfig | None = None,
        *,
        block_cache_bytes: int = DEFAULT_BLOCK_CACHE_BYTES,
        load_run_bytes: int = DEFAULT_LOAD_RUN_BYTES,
    ) -> None:
        super().__init__()
        self.config = config if config is not None else PersistentDBConfig.model_validate({})
        self.path = str(self.config.path)
        #: set in a follower worker of a run: a secondary instance of the leader's store
        self.secondary = secondary_folder(self.path)
        self.read_only = bool(self.config.read_only) or self.secondary is not None
        self.max_batch_size = int(self.config.max_batch_size)
        self.load_run_bytes = load_run_bytes
        self._lock = threading.Lock()
        self._aliases, self._whole = {}, set()  # a worker's: see read_as
        self._follow_lock = threading.Lock()
        self._failures: dict[str, int] = {}
        self._bad_log = ThrottledLog(log)
        self._options = store_options(self.config, block_cache_bytes)
        self._leads = leads_a_run()
        if self._leads:  # a MANIFEST a follower opens holds no drops (secondary.py)
            self._options.set_max_manifest_file_size(1)
        self._read_options = rocksdict.ReadOptions()
        self._read_options.set_verify_checksums(False)
        if self.secondary is None:
            with changing_store(self.path):  # its recovery rewrites the MANIFEST
                self._db, self._families = open_store(self.path, self._options, self.read_only)
        else:
            self._folder = self.secondary / "0"
            self._db, self._families = open_secondary(self.path, self._options, self._folder)
        if not self.read_only:
            remove_stale_loads(self.path)
        self._cfs: dict[str, Any] = {}
        self._handles: dict[str, Any] = {}
        # exact counts, each with the write generation it was taken at
        self._sizes: dict[str, tuple[int, int]] = {}
        self._generations: dict[str, int] = {}
        workers = max(1, min(int(self.config.num_threads), usable_cores()))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="hps-rocksdb")
        self._workers = workers
        self._expected_keys: dict[str, int] = {}  # reserve() hints for the next load
        # the encode buffers of loads sorted in memory, kept for the next one (`trim`)
        self._writers = WriterPool()
        self._meta = self._column_family(META_CF, create=not self.read_only)
        self._changes = self._change_log()
        for cf_name in self.stored_tables():
            dim = stored_dim(self._column_family(cf_name, create=False), self._read_options)
            if dim is not None:
                self._dims[cf_name] = dim
        self._follow = None if self.secondary is None else PeriodicTask(
            "hps-rocksdb-follow", FOLLOW_SECONDS, self.catch_up, log=log)

    # -- column families ----------------------------------------------------------------

    def stored_tables(self) -> list[str]:
        """Names of the tables the store holds (its column families, less `hps_meta`)."""
        with self._lock:
            return sorted(n for n in self._families
                          if n not in (DEFAULT_CF, META_CF, CHANGES_CF))

    def _column_family(self, name: str, create: bool) -> Any:
        if create and self.stored_name(name) not in self._families:
            self._flush_for_followers()
        with self._lock:
            cf = self._cfs.get(name)
            if cf is not None:
                return cf
            try:
                cf = self._db.get_column_family(self.stored_name(name))
            except Exception:
                if not create:
                    return None
                cf = self._db.create_column_family(self.stored_name(name), self._options)
                self._families.add(self.stored_name(name))
            self._cfs[name] = cf
            self._handles[name] = self._db.get_column_family_handle(self.stored_name(name))
            return cf

    # -- tables -------------------------------------------------------------------------

    def create_table(self, table: str, dim: int, storage: StorageType | str = "float32"
                     ) -> None:
        """Make `table` known with rows of width `dim`; creates its column family if missing.
        Rows stay float32 whatever `storage` says (HugeCTR's layout: shared stores stay
        readable by every server).

        Keeps existing contents. Read-only: raises TierSetupError if the store lacks it.
        """
        dim = int(dim)
        if dim < 1:
            raise ConfigError(f"table {table!r}: width must be positive, got {dim}")
        if self._column_family(table, create=not self.read_only) is None:
            raise TierSetupError(
                f"RocksDB at {self.path!r} is open read-only and has no table {table!r} "
                f"(it holds: {', '.join(self.stored_tables()) or 'nothing'})"
            )
        super().create_table(table, dim, storage)

    def drop_table(self, table: str) -> None:
        """Delete `table`'s column family and metadata (unless another name reads it)."""
        self._writable("drop", table)
        if self.read_elsewhere(table):
            return
        with changing_store(self.path):
            if self._leads:  # see _flush_for_followers
                self._flush_every_table()
            self._drop(table)
        super().drop_table(table)

    def _drop(self, table: str) -> None:
        with self._lock:
            self._cfs.pop(table, None)
            self._handles.pop(table, None)
            self._sizes.pop(table, None)
            self._generations[table] = self._generations.get(table, 0) + 1
            self._changes.clear(self.stored_name(table))  # a new load notes anew
            self._meta.delete(self.stored_name(table).encode())
            if self.stored_name(table) in self._families:
                self._db.drop_column_family(self.stored_name(table))
                self._families.discard(self.stored_name(table))
                self._meta.flush(True)  # one more edit: a MANIFEST without the drop

    def _cf(self, table: str) -> Any:
        self.dim(table)  # UnknownTableError for tables never created
        cf = self._cfs.get(table)
        if cf is None and self.secondary is not None:  # one the leader made again since
            cf = self._column_family(table, create=False)
        if cf is None:
            raise UnknownTableError(f"rocksdb tier has no table {table!r}")
        return cf

    def raw_table(self, table: str) -> Any:
        """The rocksdict handle of `table`'s column family (for tools and benchmarks)."""
        return self._cf(table)

    def _writable(self, what: str, table: str) -> None:
        if self.read_only:
            raise TierSetupError(
                f"cannot {what} {table!r}: RocksDB at {self.path!r} is open read-only "
                "(persistent_db.read_only is true)"
            )

    # -- data ---------------------------------------------------------------------------

    def fetch(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectors (float32[n, dim], zero rows where absent) and found (bool[n]).

        A stored value that is not `dim` float32 wide (a store written with another
        embedding_vecsize) answers "not found" for its key, is counted in `stats()`'s
        failures ("bad_row") and logged once per minute.
        """
        cf = self._cf(table)
        dim = self.dim(table)
        k = as_keys(keys)
        swapped = k.byteswap().view(np.uint64)
        unique_swapped, inverse = np.unique(swapped, return_inverse=True)
        wanted = key_bytes(unique_swapped.byteswap().view(np.int64))
        values = self._multi_get(cf, wanted)
        rows, good, bad = decode_rows(values, dim)
        if bad:
            self._count_bad_rows(table, dim, bad)
        if rows.shape[0] < len(values):
            full = np.zeros((len(values), dim), np.float32)
            full[good] = rows
            return full[inverse], good[inverse]
        return rows[inverse], np.ones(k.size, bool)

    def _count_bad_rows(self, table: str, dim: int, bad: int) -> None:
        with self._lock:
            self._failures["bad_row"] = self._failures.get("bad_row", 0) + bad
        self._bad_log.warning(
            "bad_row", "rocksdb table %r holds %d value(s) that are not %d float32 wide "
            "(written with another embedding_vecsize?); their keys get the default value",
            table, bad, dim)

    def _multi_get(self, cf: Any, wanted: list[bytes]) -> list[bytes | None]:
        """multi_get in slices of max_batch_size, spread over the worker threads."""
        n = len(wanted)
        per_worker = -(-n // self._workers)
        step = min(self.max_batch_size, max(_MIN_SLICE, per_worker))
        if n <= step:
            values: list[bytes | None] = cf.get(wanted, read_opt=self._read_options)
            return values
        slices = [wanted[i : i + step] for i in range(0, n, step)]
        parts = self._pool.map(lambda s: cf.get(s, read_opt=self._read_options), slices)
        return list(itertools.chain.from_iterable(parts))

    def insert(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Write rows through one WriteBatch (atomic); the last of duplicate keys wins."""
        self._writable("insert into", table)
        cf = self._cf(table)
        k, v = as_rows(keys, vectors, self.dim(table))
        if not k.size:
            return
        batch = rocksdict.WriteBatch(raw_mode=True)
        handle = self._handles[table]
        consume(map(batch.put, key_bytes(k), row_bytes(v), itertools.repeat(handle)))
        del cf
        noted = self._changes.add(batch, self.stored_name(table), k)  # the same batch
        self._db.write(batch)
        self._changed(table, noted)

    def remove(self, table: str, keys: np.ndarray) -> int:
        """Delete `keys`; returns how many distinct keys were present."""
        self._writable("remove from", table)
        cf = self._cf(table)
        distinct = np.unique(as_keys(keys))
        wanted = key_bytes(distinct)
        present = list(itertools.compress(wanted, self._multi_get(cf, wanted)))
        if present:
            batch = rocksdict.WriteBatch(raw_mode=True)
            consume(map(batch.delete, present, itertools.repeat(self._handles[table])))
            # all the keys asked for: noting absent ones too costs a restart a read each
            noted = self._changes.add(batch, self.stored_name(table), distinct)
            self._db.write(batch)
            self._changed(table, noted)
        return len(present)

    def size(self, table: str) -> int:
        """Exact number of keys. O(n): iterates the keys unless unchanged since last count."""
        cf = self._cf(table)
        generation = self._generations.get(table, 0)
        known = self._sizes.get(table)
        if known is not None and known[0] == generation:
            return known[1]
        options = rocksdict.ReadOptions()
        options.set_verify_checksums(False)
        counted = collections.deque(enumerate(cf.keys(read_opt=options), 1), maxlen=1)
        count = counted[0][0] if counted else 0
        self._sizes[table] = (generation, count)
        return count

    def _changed(self, table: str, noted: bool = False) -> None:
        """Note a completed write: counts taken before it are stale; `noted`: its keys
        are in the change log, which now covers it."""
        if noted:
            self._changes.written(self.stored_name(table))
        with self._lock:
            self._generations[table] = self._generations.get(table, 0) + 1

    # -- bulk loads ---------------------------------------------------------------------

    def reserve(self, table: str, num_keys: int) -> None:
        """Note that the next load of `table` brings about `num_keys` keys: it then
        spills to as many key ranges as keep each within `load_run_bytes`."""
        self._expected_keys[table] = int(num_keys)

    def bulk_order(self, keys: np.ndarray) -> np.ndarray:
        """The permutation that puts `keys` in RocksDB's bytewise order: `load_ordered`
        takes rows in this order straight to table files."""
        return bytewise_order(keys)

    def bulk_sorted(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(`keys` in bytewise order, that permutation): `load_sorted` takes them so,
        sorted on every usable core."""
        return bytewise_sorted(keys)

    def load_sorted(self, table: str, keys: np.ndarray, rows: np.ndarray,
                    positions: np.ndarray | None) -> int:
        """Bulk-load a whole table of distinct keys in bytewise order (`bulk_sorted`),
        the row of `keys[i]` at `rows[positions[i]]`: the table files are encoded from
        `rows` where they lie, on the worker threads.
        Raises TierError, ingesting nothing, when the keys are out of order. Durable on
        return."""
        self._writable("load", table)
        dim = self.dim(table)
        self._expected_keys.pop(table, None)
        k = np.ascontiguousarray(keys, np.int64)
        if rows.ndim != 2 or rows.shape[1] != dim or rows.dtype != np.float32 or (
                positions is None and rows.shape[0] != k.size) or (
                positions is not None and positions.shape != k.shape):
            raise LookupInputError(
                f"load_sorted of {table!r} needs float32 rows of width {dim} and a row "
                f"(or a position) per key, got rows {rows.dtype} {rows.shape} for "
                f"{k.size} keys")
        self._writers.clear()  # a large load: what updates kept goes back first
        # no batches to hold in memory: files as large as keeps every worker busy
        file_bytes = max(_MIN_FILE_BYTES, min(FILE_BYTES, -(-k.size * 4 * dim // (
            2 * self._workers))))
        return self._bulk_write(table, lambda work: [(k, rows, positions)],
                                file_bytes=file_bytes)

    def load(self, table: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
        """Bulk-load `(keys, vectors)` chunks in any order; returns the keys read
        (repeats included; of a repeated key the last one read is stored).

        A load that is one chunk of at most `load_run_bytes` of vectors (a round of
        online updates, a small table) is sorted where it lies, in memory. Otherwise the
        rows are spilled into key ranges in a folder of the store; then each range is
        read back and sorted. Either way the sorted rows are written as table files that
        RocksDB ingests in one go: no WAL, no memtable, no compaction (into the bottom
        level when the table held nothing overlapping; newer than what it holds in any
        case). Memory: about `load_run_bytes` for the range being sorted, whatever the
        table size. Durable on return.
        """
        self._writable("load", table)
        dim = self.dim(table)
        expected = self._expected_keys.pop(table, None)
        chunks = iter(chunks)
        head = list(itertools.islice(chunks, 2))
        if len(head) == 1:
            k, v = as_rows(*head[0], dim)
            if v.nbytes <= self.load_run_bytes:
                return self._load_in_memory(table, k, v)
        chunks = itertools.chain(head, chunks)
        self._writers.clear()  # a large load: what updates kept goes back first
        buckets = _DEFAULT_BUCKETS if expected is None else max(
            1, math.ceil(expected * 4 * dim / self._range_bytes()))
        total = 0

        def sorted_runs(work: str) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
            nonlocal total
            spill = BucketSpill(work, dim, buckets)
            try:
                for keys, vectors in chunks:
                    k, v = as_rows(keys, vectors, dim)
                    total += k.size
                    spill.add(k, v)
                yield from spill.runs()
            finally:
                spill.close()

        self._bulk_write(table, sorted_runs)
        return total

    def _load_in_memory(self, table: str, keys: np.ndarray, vectors: np.ndarray) -> int:
        """`load` of one chunk: sorted where it lies (its rows are not copied: the table
        files are written from them through the positions of the sort)."""
        if keys.size:
            distinct, positions = last_of_each(keys)
            self._bulk_write(table, lambda work: [(distinct, vectors, positions)],
                             self._writers)
        return int(keys.size)

    def load_ordered(self, table: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]]
                     ) -> int:
        """Bulk-load chunks whose keys are distinct and in `bulk_order`, each chunk after
        the one before: they go straight to table files (nothing is spilled or sorted).

        Returns the keys written. Raises TierError, ingesting nothing, when a chunk is out
        of order. Durable on return.
        """
        self._writable("load", table)
        dim = self.dim(table)
        self._expected_keys.pop(table, None)

        def runs(work: str) -> Iterator[tuple[np.ndarray, np.ndarray, None]]:
            for keys, vectors in chunks:
                k, v = as_rows(keys, vectors, dim)
                yield k, v, None

        return self._bulk_write(table, runs)

    def _bulk_write(self, table: str, runs: Any, writers: WriterPool | None = None,
                    file_bytes: int | None = None) -> int:
        """Write what `runs(work)` yields — (keys, rows, positions) in bytewise order — as
        table files in a folder of the store, and ingest them; returns the keys written.
        The files' encode buffers come from `writers` and stay there (else they are
        made for this write and unmapped after it); files hold `file_bytes` of values
        (`_file_bytes()` by default)."""
        cf = self._cf(table)
        start_generation = self._generations.get(table, 0)
        was_empty = self._is_empty(cf)
        stored = self.stored_name(table)
        noted: list[np.ndarray] | None = [] if self._changes.noting(stored) else None
        # Inside the store: same file system, so ingestion links the files, never copies.
        with tempfile.TemporaryDirectory(dir=self.path, prefix=INGEST_PREFIX) as work:
            sink = SstSink(work, self._workers, file_bytes or self._file_bytes(), writers)
            try:
                for keys, rows, positions in runs(work):
                    sink.add(keys, rows, positions)
                    if noted is not None:
                        noted.append(keys)
                paths = sink.finish()
            finally:
                sink.close()
            if paths:
                # the keys before the rows: a crash between leaves keys noted, not rows
                # unnoted (changes.py)
                logged = noted is not None and self._changes.add_synced(
                    stored, np.concatenate(noted))
                self._ingest(cf, table, paths, logged)
        written = sink.keys_written
        with self._lock:
            generation = self._generations.get(table, 0)
            if was_empty and generation == start_generation + (1 if paths else 0):
                # Into an empty table, no other writer meanwhile: the count is known.
                self._sizes[table] = (generation, written)
        return written

    def _file_bytes(self) -> int:
        """Values per table file: a file per worker and one batch being prepared fit in
        `load_run_bytes` (fewer, larger files ingest faster)."""
        share = self.load_run_bytes // (self._workers + 1)
        return max(_MIN_FILE_BYTES, min(FILE_BYTES, share))

    def _range_bytes(self) -> int:
        """Values per key range a spilled load sorts at once: with a file being written
        per worker and the range's sort buffers, twice over within `load_run_bytes`."""
        share = self.load_run_bytes // (2 * (self._workers + 1))
        return max(_MIN_FILE_BYTES, min(FILE_BYTES, share))

    def _ingest(self, cf: Any, table: str, paths: list[str], noted: bool) -> None:
        options = rocksdict.IngestExternalFileOptions()
        options.set_move_files(True)
        self._flush_for_followers()
        cf.ingest_external_file(paths, options)
        self._changed(table, noted)

    def warm_writes(self, table: str) -> None:
        """Compile the bulk path (any table's), writing nothing; not on a read-only store."""
        if not self.read_only:
            compile_bulk_writes()

    def trim(self) -> None:
        """Unmap the encode buffers kept between loads sorted in memory."""
        self._writers.clear()

    def _is_empty(self, cf: Any) -> bool:
        it = cf.iter(self._read_options)
        it.seek_to_first()
        empty = not it.valid()
        del it
        return empty

    def scan(self, table: str, chunk_rows: int = SCAN_CHUNK_ROWS
             ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every row of `table` in bytewise order (hps.tiers.rocksdb.scan.scan_rows)."""
        dim = self.dim(table)
        for keys, rows, bad in scan_rows(self._cf(table), dim, chunk_rows):
            if bad:
                self._count_bad_rows(table, dim, bad)
            yield keys, rows

    # -- health -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The contract's health and counters, plus RocksDB's estimate of the keys its
        tables hold (`estimated_keys`: from SST and memtable metadata, no scan)."""
        with self._lock:
            families = [cf for name, cf in self._cfs.items() if name in self._dims]
        estimated = sum(int(cf.property_int_value(_ESTIMATED_KEYS) or 0) for cf in families)
        with self._lock:
            failures = dict(self._failures)
        return {**super().stats(), "failures": failures, "estimated_keys": estimated}

    def close(self) -> None:
        """Flush and close the store; further calls are undefined."""
        if self._follow is not None:
            self._follow.close(timeout=5.0)
        self._pool.shutdown(wait=True)
        self._writers.clear()
        with self._lock:
            self._cfs.clear()
            self._handles.clear()
            self._meta = None
            self._changes.close()  # its handles too: rocksdict closes the last one
            if self._db is not None:
                if not self.read_only:
                    self._db.flush(True)
                self._db.close()
                self._db = None
        if self.secondary is not None:  # its instances' folders (info logs)
            shutil.rmtree(self.secondary, ignore_errors=True)
