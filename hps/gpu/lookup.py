"""The GPU tier of one table on one device, as the server uses it.

    table = GpuEmbeddingTable(model_config, table_id, num_keys, device_id, fetch_host)
    table.warm_up(chunks)      # (keys, vectors) chunks of the model file, in file order
    table.lookup(keys, out)    # vectors of keys into out, in place
    table.refresh()            # re-read the cached keys' vectors through fetch_host
    table.close()

The lookup path (DESIGN.md): query the cache on the caller's stream (hits land in `out`
directly, misses are compacted on the device; the miss count is the one host wait);
when nothing missed, that is all. Otherwise the missed keys go to the host, are
deduplicated, and
- when the hit rate (1 − missed keys / keys, counting repeats) is below the model's
  `hit_rate_threshold`, or the table is static: their vectors are fetched with
  `fetch_host` (volatile → persistent → default), copied to the device in one copy and
  scattered into `out` by one kernel, and (dynamic cache) inserted;
- otherwise (HugeCTR's semantics): their rows keep the table's default value, which the
  query already wrote, and a background thread fetches and inserts them.

Modes: "dynamic" (an LRU cache of gpucacheper × num_keys slots; "uvm" is served the same
way) or "static" (embedding_cache_type "static" or use_static_table: the whole table on
the GPU, built by warm_up, read-only, misses served from the host and never inserted).

Without CuPy or a CUDA device this module still imports; `cuda_available()` is False and
creating a GpuEmbeddingTable raises MissingExtraError or DeviceError.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.background import BackgroundWorker, PeriodicTask
from hps.errors import DeviceError
from hps.gpu import kernels
from hps.gpu.cache import (
    DEFAULT_LRU_SAMPLE_SHIFT,
    SET_SIZE,
    EmbeddingCache,
    cache_mode,
    open_device_table,
    set_codes,
    warm_up,
)
from hps.gpu.static_table import StaticEmbeddingTable
from hps.keys import key_view, output_view

if TYPE_CHECKING:
    from hps.config import ModelConfig

log = logging.getLogger("hps.gpu")

_H2D = 1  # cudaMemcpyHostToDevice
_BACKGROUND_QUEUE = 64  # pending background inserts; more are dropped (counted)
_COUNTERS = ("lookups", "keys", "hits", "misses", "sync_fetches", "async_inserts",
             "dropped_inserts", "refreshed", "background_errors")


def cuda_available() -> bool:
    """Whether CuPy imports and at least one CUDA device is present. Never raises."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def _align(n: int) -> int:
    return -(-n // 16) * 16


class _Staging:
    """One thread's buffers for moving fetched rows to the device in one copy:
    [unique keys int64 | their set codes uint64 | the misses' index into them int32 |
    rows float32], pinned on the host and mirrored on the device."""

    def __init__(self, cupy: Any) -> None:
        self._cp = cupy
        self.nbytes = 0
        self.host: Any = None
        self.device: Any = None
        self.copied = cupy.cuda.Event(block=False, disable_timing=True)  # H2D done
        self.used = cupy.cuda.Event(block=False, disable_timing=True)  # last device read
        self._has_copy = False
        self._has_use = False

    def load(self, keys: np.ndarray, codes: np.ndarray | None, inverse: np.ndarray,
             rows: np.ndarray, stream: Any) -> tuple[Any, Any, Any, Any]:
        """Copies the arrays to the device with one H2D copy on `stream`; returns their
        device views (codes: None when not given)."""
        cp = self._cp
        u, m, dim = keys.size, inverse.size, rows.shape[1]
        n_codes = u if codes is not None else 0
        off_codes = _align(u * 8)
        off_inv = off_codes + _align(n_codes * 8)
        off_rows = off_inv + _align(m * 4)
        total = off_rows + u * dim * 4
        if self._has_copy:
            self.copied.synchronize()  # the pinned buffer is free again
        if total > self.nbytes:
            if self._has_use:
                self.used.synchronize()
            self.nbytes = max(total, 2 * self.nbytes, 1 << 16)
            self.host = cp.cuda.alloc_pinned_memory(self.nbytes)
            self.device = cp.empty(self.nbytes, dtype=np.uint8)
            self._has_use = False
        host = np.frombuffer(self.host, dtype=np.uint8, count=total)
        host[:off_codes].view(np.int64)[:u] = keys
        if codes is not None:
            host[off_codes:off_inv].view(np.uint64)[:u] = codes
        host[off_inv:off_rows].view(np.int32)[:m] = inverse
        host[off_rows:total].view(np.float32).reshape(u, dim)[:] = rows
        if self._has_use:  # earlier kernels on another stream may still read the buffer
            cp.cuda.runtime.streamWaitEvent(stream.ptr, self.used.ptr, 0)
        cp.cuda.runtime.memcpyAsync(self.device.data.ptr, host.ctypes.data, total, _H2D,
                                    stream.ptr)
        self.copied.record(stream)
        self._has_copy = True
        d = self.device
        d_codes = d[off_codes: off_codes + u * 8].view(np.uint64) if codes is not None else None
        return (d[: u * 8].view(np.int64), d_codes, d[off_inv: off_inv + m * 4].view(np.int32),
                d[off_rows:total].view(np.float32).reshape(u, dim))

    def mark_used(self, stream: Any) -> None:
        self.used.record(stream)
        self._has_use = True


class GpuEmbeddingTable:
    """The GPU cache (dynamic) or table (static) of one model table on one device.

    Thread-safe: lookups may come from many threads at once, with background inserts
    and a refresh running.
    """

    def __init__(self, model: ModelConfig, table_id: int, num_keys: int, device_id: int,
                 fetch_host: Callable[[np.ndarray], np.ndarray], *, dedupe: bool = False,
                 lru_sample_shift: int = DEFAULT_LRU_SAMPLE_SHIFT) -> None:
        self._cp = kernels.cupy_module()
        if not cuda_available():
            raise DeviceError("no CUDA device is available for the GPU embedding cache")
        self.model_name = model.model
        self.table_id = int(table_id)
        self.dim = int(model.embedding_vecsize_per_table[table_id])
        self.default_value = float(model.default_value_for_each_table[table_id])
        self.hit_rate_threshold = float(model.hit_rate_threshold)
        self.refresh_fraction = float(model.cache_refresh_percentage_per_iteration)
        self.device_id = int(device_id)
        self.mode = cache_mode(model)
        self.dedupe = dedupe
        self._fetch_host = fetch_host
        self._table: EmbeddingCache | StaticEmbeddingTable = open_device_table(
            model, self.mode, num_keys, self.dim, self.device_id,
            lru_sample_shift=lru_sample_shift)
        self.capacity = int(self._table.capacity)
        self._device = self._cp.cuda.Device(self.device_id)
        self._several_devices = self._cp.cuda.runtime.getDeviceCount() > 1
        self._tls = threading.local()
        self._stats_lock = threading.Lock()
        self._all_counts: list[dict[str, int]] = []
        self._refresh_lock = threading.Lock()
        self._closing = threading.Event()
        self._inserts: BackgroundWorker[np.ndarray] = BackgroundWorker(
            f"hps-gpu-insert-{self.model_name}-{table_id}-{device_id}", _BACKGROUND_QUEUE,
            self._background_inserts, max_batch=_BACKGROUND_QUEUE, log=log)
        self._refresher: PeriodicTask | None = None
        if model.refresh_interval > 0:
            self._refresher = PeriodicTask(
                f"hps-gpu-refresh-{self.model_name}-{table_id}-{device_id}",
                float(model.refresh_interval), self.refresh,
                delay=float(model.refresh_delay), log=log)

    # -- loading --------------------------------------------------------------------------

    def warm_up(self, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
        """Inserts (keys int64 [n], vectors float32 [n, dim]) chunks in order until the
        cache holds `capacity` keys' worth, the last chunk included (cut to fit); the
        static table takes every chunk. Returns the keys inserted (see cache.warm_up)."""
        return warm_up(self._table, chunks)

    # -- lookups --------------------------------------------------------------------------

    def lookup(self, keys: Any, out: Any) -> None:
        """Writes the vectors of `keys` into `out` in place.

        keys: int64 [n], CuPy on this table's device or NumPy; out: float32 [n, dim],
        C-contiguous, CuPy on this device or NumPy. Device work runs on CuPy's current
        stream; `out` is complete in that stream's order (host `out`: on return).
        Raises KeyTypeError, BatchTooLargeError, OutputBufferError or DeviceError for bad
        arguments (checked by hps/keys.py).
        """
        # with one device there is no other device to be on: the check's cost is spared
        device = self.device_id if self._several_devices else None
        keys = key_view(keys, device)
        n = int(keys.shape[0])
        output_view(out, n, self.dim, device)
        if n == 0:
            return
        if self._cp.cuda.runtime.getDevice() == self.device_id:
            self._lookup_here(keys, out, n)
        else:
            with self._device:
                self._lookup_here(keys, out, n)

    def _lookup_here(self, keys: Any, out: Any, n: int) -> None:
        """lookup() with this table's device current."""
        cp = self._cp
        dkeys = cp.asarray(keys) if isinstance(keys, np.ndarray) else keys  # contiguous
        if isinstance(out, np.ndarray):
            dout = self._host_out_buffer(n)
            self._lookup_device(dkeys, dout)
            dout.get(out=out)
        else:
            self._lookup_device(dkeys, out)

    def _host_out_buffer(self, n: int) -> Any:
        buf = getattr(self._tls, "out", None)
        if buf is None or buf.shape[0] < n:
            buf = self._cp.empty((max(n, 1024), self.dim), dtype=np.float32)
            self._tls.out = buf
        return buf[:n]

    def _staging(self) -> _Staging:
        st: _Staging | None = getattr(self._tls, "staging", None)
        if st is None:
            st = _Staging(self._cp)
            self._tls.staging = st
        return st

    def _lookup_device(self, keys: Any, out: Any) -> None:
        cp = self._cp
        n = int(keys.shape[0])
        if self.dedupe:
            unique, inverse = cp.unique(keys, return_inverse=True)
            if unique.size < n:
                rows = cp.empty((unique.size, self.dim), dtype=np.float32)
                self._lookup_unique(unique, rows, n)
                cp.take(rows, inverse.reshape(-1), axis=0, out=out)
                return
        self._lookup_unique(keys, out, n)

    def _lookup_unique(self, keys: Any, out: Any, n_requested: int) -> None:
        ws = self._table.workspace()
        misses = self._table.query_checked(keys, out, self.default_value, ws)
        n = int(keys.shape[0])
        if misses.count == 0:
            self._count(n_requested, n, 0)
            return
        missed_keys = misses.keys.get()
        unique, inverse = np.unique(missed_keys, return_inverse=True)
        self._count(n_requested, n - misses.count, misses.count)
        hit_rate = 1.0 - misses.count / n
        if self.mode == "dynamic" and hit_rate >= self.hit_rate_threshold:
            self._submit(unique)  # this request keeps the default rows the query wrote
            return
        rows = self._fetch(unique)
        stream = self._cp.cuda.get_current_stream()
        staging = self._staging()
        cache = self._table if isinstance(self._table, EmbeddingCache) else None
        codes = set_codes(unique, cache.num_sets) if cache is not None else None
        d_keys, d_codes, d_inverse, d_rows = staging.load(
            unique, codes, inverse.astype(np.int32, copy=False), rows, stream)
        kernels.function("rows.cu", "scatter_rows", self.device_id, DIM=self.dim)(
            (kernels.grid(self.device_id, misses.count * self.dim),), (256,),
            (misses.positions, d_inverse, np.int64(misses.count), d_rows, out),
        )
        ws.release(stream)
        staging.mark_used(stream)
        self._counts()["sync_fetches"] += int(unique.size)
        if cache is not None:
            cache.insert_by_set(d_keys, d_rows, d_codes)

    def _fetch(self, keys: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(self._fetch_host(keys), dtype=np.float32)
        if rows.shape != (keys.size, self.dim):
            raise DeviceError(
                f"fetch_host returned shape {rows.shape} for {keys.size} keys; expected "
                f"({keys.size}, {self.dim})"
            )
        return rows

    def _counts(self) -> dict[str, int]:
        """This thread's counters (summed by stats(); no lock on the lookup path)."""
        counts: dict[str, int] | None = getattr(self._tls, "counts", None)
        if counts is None:
            counts = dict.fromkeys(_COUNTERS, 0)
            self._tls.counts = counts
            with self._stats_lock:
                self._all_counts.append(counts)
        return counts

    def _count(self, requested: int, hits: int, misses: int) -> None:
        c = self._counts()
        c["lookups"] += 1
        c["keys"] += requested
        c["hits"] += hits
        c["misses"] += misses

    # -- background inserts and refresh -------------------------------------------------

    def _submit(self, keys: np.ndarray) -> None:
        if not self._inserts.submit(keys):
            self._counts()["dropped_inserts"] += int(keys.size)

    def _background_inserts(self, batch: list[np.ndarray]) -> None:
        """Fetches and inserts the keys of asynchronous misses; what queued up while it
        worked is merged into one fetch and one insert."""
        self._insert_fetched(np.unique(np.concatenate(batch)))

    def _insert_fetched(self, keys: np.ndarray) -> None:
        try:
            rows = self._fetch(keys)
            with self._device:
                self._table.insert(keys, rows)  # type: ignore[union-attr]
            self._counts()["async_inserts"] += int(keys.size)
        except Exception:
            if self._closing.is_set():
                return
            log.exception("background insert into the GPU cache of %s table %d failed",
                          self.model_name, self.table_id)
            self._counts()["background_errors"] += 1

    def refresh(self) -> int:
        """Re-reads the vectors of the cached keys through fetch_host and overwrites them
        in place, in windows of cache_refresh_percentage_per_iteration × capacity slots
        (the whole cache at once when that is 0). LRU order is untouched. Returns the
        keys refreshed."""
        table = self._table
        fraction = self.refresh_fraction
        window = table.num_sets
        if fraction > 0:
            window = max(1, math.ceil(min(fraction, 1.0) * table.num_slots / SET_SIZE))
        total = 0
        with self._refresh_lock, self._device:
            for start in range(0, table.num_sets, window):
                keys = table.dump(start, start + window)
                if keys.size == 0:
                    continue
                total += table.update(keys, self._fetch(keys.get()))
        self._counts()["refreshed"] += total
        return total

    # -- state ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """mode, capacity, size (keys held), hits, misses, hit_rate, memory_bytes, …"""
        counts = dict.fromkeys(_COUNTERS, 0)
        with self._stats_lock:
            for part in self._all_counts:
                for k in _COUNTERS:
                    counts[k] += part[k]
        looked = counts["hits"] + counts["misses"]
        return {
            "mode": self.mode,
            "device_id": self.device_id,
            "dim": self.dim,
            "capacity": self.capacity,
            "slots": self._table.num_slots,
            "size": self._table.size(),
            "memory_bytes": self._table.memory_bytes(),
            "hit_rate": counts["hits"] / looked if looked else None,
            **counts,
        }

    def close(self) -> None:
        """Stops the background threads and frees the device memory. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._inserts.discard()  # pending inserts are dropped: the cache is going away
        self._inserts.close(timeout=30)
        if self._refresher is not None:
            self._refresher.close(timeout=30)
        self._table.close()

    def __enter__(self) -> GpuEmbeddingTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
