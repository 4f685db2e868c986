"""Bulk loads of the RocksDB tier: rows → sorted table files (SST) → one ingestion.

RocksDB takes a bulk load fastest as table files that it links into its bottom level:
no WAL, no memtable, no compaction, one sorted run that a read searches once. Files
must hold distinct keys in bytewise order and must not overlap each other. Two ways
in:

- `SstSink` takes rows already in that order (each batch sorted, every batch after the
  one before) and writes them as files of about `file_bytes` each, on worker threads:
  `hps.tiers.rocksdb.sst` encodes a file in compiled code without the GIL, and the file is written
  with O_DIRECT (no copy through the page cache; durable once written) where the file
  system allows it, else written and fsynced.
- `BucketSpill` takes rows in any order, with bounded memory: each batch is split by key
  range into buckets (ranges of bytewise order, cut at quantiles of the first batch's
  keys) that are appended to a spill file; afterwards each bucket is read back, sorted,
  its repeated keys reduced to the last one written, and handed to a sink. Buckets are
  disjoint ranges taken in order, so the files never overlap.

Both write only under `work` (a folder inside the store, so ingestion moves files
without copying them) and leave nothing behind when closed.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from hps.errors import TierError
from hps.runtime.compiled import array, compile_declared, inlined, kernel, types
from hps.runtime.cores import usable_cores
from hps.tiers.rocksdb import sst

#: bytes of values per table file
FILE_BYTES = 64 << 20
_ALIGN = 4096


def swapped_keys(keys: np.ndarray) -> np.ndarray:
    """Keys as uint64 whose numeric order is RocksDB's bytewise order of their
    little-endian bytes (the bytes reversed)."""
    return np.ascontiguousarray(keys, "<i8").byteswap().view(np.uint64)


def bytewise_order(keys: np.ndarray) -> np.ndarray:
    """Permutation that sorts int64 keys as RocksDB orders their little-endian bytes
    (stable: repeats keep their order)."""
    return bytewise_sorted(keys)[1]


def last_of_each(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys of `keys` in bytewise order, and for each the position in
    `keys` of its last occurrence (the row a load keeps of a repeated key)."""
    ordered, order = bytewise_sorted(keys)
    last = np.empty(ordered.size, bool)
    last[-1:] = True
    np.not_equal(ordered[1:], ordered[:-1], out=last[:-1])
    return ordered[last], order[last]


#: keys per thread below which a sort runs on one thread
_SORT_KEYS_PER_THREAD = 1 << 18
_BUCKETS = 1 << 16
#: buckets at most this long are sorted in place by insertion
_INSERTION_MAX = 32


def bytewise_sorted(keys: np.ndarray, threads: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(`keys` in RocksDB's bytewise order, the permutation that puts them there), a
    stable sort (repeats keep their order), on up to `threads` threads (the usable
    cores by default).

    A counting sort on the first two bytes of each key (the most significant of the
    order: 65,536 buckets, each thread counting and then placing a slice of the keys),
    then each bucket sorted where it lies (small: in cache), the buckets split among the
    threads by their sizes. Every pass is compiled and runs without the GIL.
    """
    keys = np.ascontiguousarray(keys, np.int64)
    n = keys.size
    workers = max(1, min(threads or usable_cores(), n // _SORT_KEYS_PER_THREAD))
    slices: list[int] = np.linspace(0, n, workers + 1).astype(np.int64).tolist()
    counts = np.zeros((workers, _BUCKETS), np.int64)
    ordered = np.empty(n, np.int64)
    order = np.empty(n, np.int64)

    pool = ThreadPoolExecutor(workers, thread_name_prefix="hps-sort") if workers > 1 else None

    def each(fn: Any) -> None:
        if pool is None:
            fn(0)
        else:
            list(pool.map(fn, range(workers)))

    try:
        each(lambda w: _count_buckets(keys, slices[w], slices[w + 1], counts[w]))
        # a thread's first place in each bucket: the buckets in order, the threads in
        # order within each (which keeps the sort stable)
        flat = counts.T.reshape(-1)
        cursors = np.ascontiguousarray((np.cumsum(flat) - flat).reshape(_BUCKETS, workers).T)
        each(lambda w: _place(keys, slices[w], slices[w + 1], cursors[w], ordered, order))
        bounds = np.zeros(_BUCKETS + 1, np.int64)
        np.cumsum(counts.sum(axis=0), out=bounds[1:])
        split: list[int] = np.searchsorted(bounds, np.linspace(0, n, workers + 1)).tolist()
        split[0], split[-1] = 0, _BUCKETS
        each(lambda w: _sort_buckets(ordered, order, bounds, split[w], split[w + 1]))
    finally:
        if pool is not None:
            pool.shutdown()
    return ordered, order


@inlined
def _bucket(key: int) -> int:
    """The first two bytes of the key's little-endian bytes, as a number (the first most
    significant): its bucket of the bytewise order."""
    k = np.uint64(key)
    return int(((k & np.uint64(0xFF)) << np.uint64(8)) | ((k >> np.uint64(8)) & np.uint64(0xFF)))


@inlined
def _swapped(key: int) -> np.uint64:
    """The key with its bytes reversed: numeric order is then bytewise order."""
    k = np.uint64(key)
    out = np.uint64(0)
    for _ in range(8):
        out = (out << np.uint64(8)) | (k & np.uint64(0xFF))
        k >>= np.uint64(8)
    return out


_KEYS = array(np.int64, readonly=True)
_INTS = array(np.int64)


@kernel([types.void(_KEYS, types.int64, types.int64, _INTS)])
def _count_buckets(keys: np.ndarray, lo: int, hi: int, counts: np.ndarray) -> None:
    for i in range(lo, hi):
        counts[_bucket(keys[i])] += 1


@kernel([types.void(_KEYS, types.int64, types.int64, _INTS, _INTS, _INTS)])
def _place(keys: np.ndarray, lo: int, hi: int, cursors: np.ndarray, ordered: np.ndarray,
           order: np.ndarray) -> None:
    for i in range(lo, hi):
        b = _bucket(keys[i])
        p = cursors[b]
        ordered[p] = keys[i]
        order[p] = i
        cursors[b] = p + 1


@kernel([types.boolean(_KEYS)])
def _ascending(keys: np.ndarray) -> bool:
    """Whether `keys` are distinct and in bytewise order."""
    for i in range(1, keys.size):
        if _swapped(keys[i]) <= _swapped(keys[i - 1]):
            return False
    return True


@inlined
def _stable_order(values: np.ndarray) -> np.ndarray:
    """The positions of `values` (uint64) in stable ascending order (`values` is scratch:
    left reordered).

    Runs of _INSERTION_MAX sorted by insertion, then merged pairwise, values and positions
    moved together. numba's own `np.argsort(kind="mergesort")` took 4 to 7 s to compile
    on a 2-core machine (the largest part of a first load's compile time) against under
    1 s for this, and ran slower: `bytewise_sorted` of 2,000,000 keys that all share
    their first two bytes took 1.7 s against 0.32 s (one thread; random keys 73 against
    75 ms, their buckets being small).
    """
    m = values.size
    by = np.arange(m)
    for lo in range(0, m, _INSERTION_MAX):
        for i in range(lo + 1, min(lo + _INSERTION_MAX, m)):
            value, at = values[i], by[i]
            j = i - 1
            while j >= lo and values[j] > value:
                values[j + 1] = values[j]
                by[j + 1] = by[j]
                j -= 1
            values[j + 1] = value
            by[j + 1] = at
    from_values, from_by = values, by
    to_values, to_by = np.empty_like(values), np.empty_like(by)
    width = _INSERTION_MAX
    while width < m:
        for lo in range(0, m, 2 * width):
            mid, hi = min(lo + width, m), min(lo + 2 * width, m)
            i, j = lo, mid
            for o in range(lo, hi):
                # the left run's value on a tie: equal keys keep their order
                if j < hi and (i >= mid or from_values[j] < from_values[i]):
                    to_values[o], to_by[o] = from_values[j], from_by[j]
                    j += 1
                else:
                    to_values[o], to_by[o] = from_values[i], from_by[i]
                    i += 1
        from_values, from_by, to_values, to_by = to_values, to_by, from_values, from_by
        width *= 2
    return from_by


@kernel([types.void(_INTS, _INTS, _KEYS, types.int64, types.int64)])
def _sort_buckets(ordered: np.ndarray, order: np.ndarray, bounds: np.ndarray, first: int,
                  stop: int) -> None:
    """Sort buckets [first, stop) each where it lies, stably (placing kept arrival
    order within a bucket)."""
    for b in range(first, stop):
        a, e = bounds[b], bounds[b + 1]
        if e - a <= 1:
            continue
        if e - a <= _INSERTION_MAX:
            for i in range(a + 1, e):
                key, row, value = ordered[i], order[i], _swapped(ordered[i])
                j = i - 1
                while j >= a and _swapped(ordered[j]) > value:
                    ordered[j + 1] = ordered[j]
                    order[j + 1] = order[j]
                    j -= 1
                ordered[j + 1] = key
                order[j + 1] = row
            continue
        values = np.empty(e - a, np.uint64)
        for i in range(a, e):
            values[i - a] = _swapped(ordered[i])
        by = _stable_order(values)
        # loops, not `ordered[a:e] = ordered[a:e][by]`: numba's fancy indexing and slice
        # assignment took 2 to 2.5 s more to compile each (2 cores)
        keys = np.empty(e - a, np.int64)
        rows = np.empty(e - a, np.int64)
        for i in range(e - a):
            keys[i] = ordered[a + by[i]]
            rows[i] = order[a + by[i]]
        for i in range(e - a):
            ordered[a + i] = keys[i]
            order[a + i] = rows[i]


def compile_bulk_writes() -> None:
    """Compile (or read from numba's cache) every kernel of a bulk write, sorting and
    encoding included, running none: a restart that found its tables in the store wrote
    no table file, and an online update's round big enough for this path
    (hps/updates/applier.py BULK_ROWS) compiled them after ready, holding the GIL from
    the lookups meanwhile (8.5 s on a 2-core machine, 2026-11-29)."""
    compile_declared(_count_buckets, _place, _ascending, _sort_buckets, sst.encode)


def _write_all(fd: int, data: memoryview, path: str) -> None:
    """Write all of `data`: a full disk makes a write short and the next one fail, which
    raises OSError (ENOSPC) naming `path` and the bytes not written (a short write left
    unchecked made a truncated table file that ingestion then called corrupt)."""
    written, size = 0, len(data)
    try:
        while written < size:
            written += os.write(fd, data[written:])
    except OSError as exc:
        del data  # the traceback keeps this frame: no view of the caller's buffer with it
        raise OSError(exc.errno, f"{exc.strerror}: {size - written} of {size} bytes of a "
                      "table file not written", path) from None


class _FileWriter:
    """One worker's reusable, page-aligned encode buffer and the write of a file."""

    def __init__(self) -> None:
        self._buffer: mmap.mmap | None = None
        self._direct = hasattr(os, "O_DIRECT")

    def _buf(self, size: int) -> np.ndarray:
        size = -(-size // _ALIGN) * _ALIGN
        if self._buffer is None or len(self._buffer) < size:
            if self._buffer is not None:
                self._buffer.close()
            self._buffer = mmap.mmap(-1, size)  # anonymous: page-aligned, as O_DIRECT needs
        return np.frombuffer(self._buffer, np.uint8)

    def write(self, path: str, keys: np.ndarray, rows: np.ndarray, positions: np.ndarray
              ) -> None:
        """Encode and write one table file, durable on return."""
        bound = -(-(sst.max_bytes(keys.size, rows.shape[1]) + 4096) // _ALIGN) * _ALIGN
        scratch_bytes = 4 * 8 * (keys.size + 1)
        # one mapping for the file's bytes and the encoder's scratch: given back whole to
        # the OS when the load ends (heap memory of worker threads would stay resident)
        whole = self._buf(bound + scratch_bytes)
        buf = whole[:bound]
        scratch = whole[bound : bound + scratch_bytes].view(np.int64).reshape(4, -1)
        sizes = np.zeros(6, np.int64)
        body = sst.encode(buf, keys, rows, positions, sizes, scratch)
        del scratch, whole
        end = sst.tail(sizes, keys.size)
        total = body + len(end)
        buf[body:total] = np.frombuffer(end, np.uint8)
        padded = -(-total // _ALIGN) * _ALIGN
        buf[total:padded] = 0
        assert self._buffer is not None  # made by _buf above
        view = memoryview(self._buffer)[:padded]
        try:
            if self._direct and self._write_direct(path, view, total):
                return
            self._direct = False
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, view[:total], path)
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            view.release()
            del buf

    @staticmethod
    def _write_direct(path: str, view: memoryview, size: int) -> bool:
        """Write through O_DIRECT; False where the file system refuses it."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError:
            return False
        try:
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
            os.ftruncate(fd, size)
            os.fsync(fd)  # the size; the data went to the device already
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


class WriterPool:
    """File writers kept from one load to the next (each holds a worker's encode buffer):
    loads that follow each other closely, such as the rounds of online updates, fault
    the buffer's pages in once instead of once per load (about 60 ms of CPU for a 64 MiB
    file here). `clear()` unmaps them. Thread safety: any thread."""

    def __init__(self) -> None:
        self._free: list[_FileWriter] = []
        self._lock = threading.Lock()

    def take(self) -> _FileWriter:
        with self._lock:
            return self._free.pop() if self._free else _FileWriter()

    def give(self, writer: _FileWriter) -> None:
        with self._lock:
            self._free.append(writer)

    def clear(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for writer in free:
            writer.close()


class SstSink:
    """Writes rows given in bytewise key order as table files under `work`.

    `add(keys, rows, positions)` takes distinct keys in bytewise order, each after every
    key added before (TierError otherwise, before anything of the batch is written),
    with the row of key i at `rows[positions[i]]`. Files of at most `file_bytes` of
    values are written on `workers` threads; `add` waits while every worker has a file
    to write, so about `workers + 1` batches are in memory at once. `finish()` returns
    the files' paths in key order. Writers come from `writers` and go back to it on
    `close` when given (else each is made here and unmapped on close).
    """

    def __init__(self, work: str, workers: int, file_bytes: int = FILE_BYTES,
                 writers: WriterPool | None = None) -> None:
        self.work = work
        self.file_bytes = file_bytes
        self.keys_written = 0
        self._paths: list[str] = []
        self._last: int | None = None
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="hps-sst")
        self._slots = threading.BoundedSemaphore(max(1, workers))
        self._futures: list[Future[None]] = []
        self._local = threading.local()
        self._pool_of_writers = writers
        self._writers: list[_FileWriter] = []
        self._writers_lock = threading.Lock()

    def add(self, keys: np.ndarray, rows: np.ndarray, positions: np.ndarray | None = None
            ) -> None:
        if not keys.size:
            return
        keys = np.ascontiguousarray(keys, np.int64)
        if not _ascending(keys) or (self._last is not None and not _ascending(
                np.array([self._last, keys[0]], np.int64))):
            raise TierError("bulk load: keys are not distinct and in bytewise order")
        self._last = int(keys[-1])
        raw = np.ascontiguousarray(rows).view(np.uint8).reshape(rows.shape[0], -1)
        if positions is None:
            positions = np.arange(keys.size, dtype=np.int64)
        per_file = max(1, self.file_bytes // max(1, raw.shape[1]))
        for start in range(0, keys.size, per_file):  # a loop over files, not keys
            stop = min(keys.size, start + per_file)
            path = os.path.join(self.work, f"{len(self._paths):06d}.sst")
            self._paths.append(path)
            self._slots.acquire()
            future = self._pool.submit(self._write, path, np.ascontiguousarray(
                keys[start:stop], np.int64), raw, np.ascontiguousarray(
                positions[start:stop], np.int64))
            future.add_done_callback(lambda _: self._slots.release())
            self._futures.append(future)
            self.keys_written += stop - start
        self._raise_failed()

    def _write(self, path: str, keys: np.ndarray, rows: np.ndarray, positions: np.ndarray
               ) -> None:
        writer = getattr(self._local, "writer", None)
        if writer is None:
            pool = self._pool_of_writers
            writer = self._local.writer = pool.take() if pool is not None else _FileWriter()
            with self._writers_lock:
                self._writers.append(writer)
        writer.write(path, keys, rows, positions)

    def _raise_failed(self) -> None:
        for future in self._futures:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def finish(self) -> list[str]:
        """Wait for every file; returns their paths in key order."""
        for future in self._futures:
            future.result()
        return list(self._paths)

    def close(self) -> None:
        """Stop the workers (waiting for files in flight) and free the buffers."""
        for future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=True)
        for writer in self._writers:
            if self._pool_of_writers is not None:
                self._pool_of_writers.give(writer)
            else:
                writer.close()


class BucketSpill:
    """Rows in any order, spilled to `work` by key range, read back sorted per range.

    `buckets` ranges, cut at quantiles of the first batch's keys, so a bucket holds about
    1/buckets of the table whatever the key distribution (a bucket larger than that is
    still correct, only larger in memory when read back).
    """

    def __init__(self, work: str, dim: int, buckets: int) -> None:
        self.work = work
        self.dim = dim
        self.buckets = max(1, int(buckets))
        self.rows = 0
        self._splits: np.ndarray | None = None
        self._key_path = os.path.join(work, "spill.keys")
        self._row_path = os.path.join(work, "spill.rows")
        self._key_file = open(self._key_path, "wb")  # noqa: SIM115 - closed in runs/close
        self._row_file = open(self._row_path, "wb")  # noqa: SIM115
        # per batch: the first spill row of each bucket's slice, and the slices' lengths
        self._starts: list[np.ndarray] = []
        self._counts: list[np.ndarray] = []

    def add(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Spill one batch: int64[n] keys, float32[n, dim] rows."""
        if not keys.size:
            return
        swapped = swapped_keys(keys)
        if self._splits is None:
            cuts = np.linspace(0, 1, self.buckets + 1)[1:-1]
            self._splits = np.unique(np.quantile(swapped, cuts, method="lower")).astype(
                np.uint64)
        bucket = np.searchsorted(self._splits, swapped, side="right")
        order = np.argsort(bucket, kind="stable")  # keeps arrival order within a bucket
        counts = np.bincount(bucket, minlength=self.buckets)
        starts = self.rows + np.concatenate([[0], np.cumsum(counts)[:-1]])
        np.ascontiguousarray(keys, np.int64)[order].tofile(self._key_file)
        np.ascontiguousarray(vectors, np.float32)[order].tofile(self._row_file)
        self._starts.append(starts)
        self._counts.append(counts)
        self.rows += keys.size

    def runs(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Each bucket in key order: (distinct keys in bytewise order, the bucket's rows,
        position of each key's row), the last-written row of a repeated key."""
        self._key_file.close()
        self._row_file.close()
        if not self.rows:
            return
        keys_map = np.memmap(self._key_path, np.int64, "r", shape=(self.rows,))
        rows_map = np.memmap(self._row_path, np.float32, "r", shape=(self.rows, self.dim))
        starts = np.stack(self._starts)
        counts = np.stack(self._counts)
        try:
            for b in range(self.buckets):  # a loop over buckets, not keys
                spans = [(int(s), int(s + c)) for s, c in zip(starts[:, b], counts[:, b],
                                                               strict=True) if c]
                if not spans:
                    continue
                keys = np.concatenate([keys_map[s:e] for s, e in spans])
                rows = np.concatenate([rows_map[s:e] for s, e in spans])
                distinct, positions = last_of_each(keys)
                yield distinct, rows, positions
        finally:
            del keys_map, rows_map

    def close(self) -> None:
        self._key_file.close()
        self._row_file.close()
