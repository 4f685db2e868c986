"""The GPU tier of one table on one device, as the server uses it.

    table = GpuEmbeddingTable(model_config, table_id, num_keys, device_id, fetch_host)
    table.warm_up(chunks)        # (keys, vectors) chunks of the model file, in file order
    table.lookup(keys, out)      # vectors of keys into out, in place: arrays of any producer
                                 # or ArrayRefs (hps/intake/array_ref.py) read by the caller
    table.lookup_contiguous(keys_ptr, n, out_ptr, stream, out_type)  # the common case's
                                 # shortcut, read by hps/intake/keys.py device_pair
    table.host_output(n)         # a host [n, dim] array for lookup() to fill (pinned)
    table.refresh()              # re-read the cached keys' vectors through fetch_host
    table.update(keys, rows)     # online updates: overwrite the rows held, in place
    table.close()

The lookup path (docs/architecture.md), on the caller's stream (the one its keys or output
were made on: hps/intake/array_ref.py), the table's device current whatever the thread's:
- the query kernel writes the rows of held keys into `out` directly and the default value
  into the others, compacts the misses' positions on the device and writes the missed
  keys straight into mapped pinned host memory; the miss count is the one host wait;
- when nothing missed, that is all. Otherwise, when the hit rate (1 − missed keys / keys,
  counting repeats) is below the model's `hit_rate_threshold`, or the table is static or
  uvm: the missed keys are deduplicated (compiled, hps/gpu/host_loops.py), their vectors
  fetched through the host path (volatile → persistent → default) straight into a pinned
  staging buffer, sent back in one copy (large batches: in chunks, each sent while the
  next is fetched), scattered into `out` by one kernel which (dynamic cache) also inserts
  them, queued on the same stream: the call does not wait for the insert; later
  queries on any stream are ordered after it with an event;
- otherwise (HugeCTR's semantics): their rows keep the default value the query wrote,
  and a background thread fetches and inserts them.

Keys and outputs that cannot be used in place (host arrays but pinned outputs, keys
narrower than 64 bits, strided arrays) go through per-thread buffers (hps/gpu/staging.py).
Storage (the model's embedding_storage_dtype): rows kept as float32, float16, bfloat16 or
int8, written out as float32 or the storage's own 16-bit type (hps/rows/gpu_layout.py).

Modes: "dynamic" (an LRU cache of gpucacheper × num_keys slots), "static" (the whole
table on the GPU, read-only: misses served from the host, never inserted) or "uvm" (its
hottest rows on the GPU, the others in mapped host memory: hps/gpu/uvm_table.py);
hps/gpu/open.py picks and sizes the table of each mode.

Without CuPy or a CUDA device this module still imports; `cuda_available()` is False and
creating a GpuEmbeddingTable raises MissingExtraError or DeviceError.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.errors import DeviceError
from hps.gpu import host_loops, kernels
from hps.gpu.device_arrays import lookup_refs
from hps.gpu.dynamic_cache import DEFAULT_LRU_SAMPLE_SHIFT, EmbeddingCache
from hps.gpu.fill import refresh, warm_up
from hps.gpu.host_memory import mapped_address, pinned_empty
from hps.gpu.kernels import cuda_available  # where callers have long imported it from
from hps.gpu.open import cache_capacity, cache_mode, holds_whole_table, open_device_table
from hps.gpu.staging import (
    CHUNK_BYTES,
    MissStaging,
    Scratch,
    device_view,
    external_stream,
    fetch_pool,
)
from hps.gpu.static_table import StaticEmbeddingTable
from hps.gpu.threshold import HitRateThreshold
from hps.gpu.update_log import UpdateLog
from hps.gpu.workspace import SPARE_RESERVE, SPARE_STATES, QueryWorkspace, SpareStates, ThreadState
from hps.intake.array_ref import ArrayRef
from hps.intake.keys import is_wide
from hps.rows.gpu_layout import OUT_FLOAT32, OUTPUT_CUPY_DTYPE, STORAGE_CODES
from hps.runtime.background import BackgroundWorker, PeriodicTask

if TYPE_CHECKING:
    from hps.config import ModelConfig

log = logging.getLogger("hps.gpu")

_BACKGROUND_QUEUE = 64  # pending background inserts; more are dropped (counted)
# Misses up to this many are deduplicated and get their set codes on the host (compiled,
# microseconds); larger batches skip the dedupe (the insert takes repeated keys, the
# fetch serves them twice) and sort their set codes on the device.
HOST_MISSES = 1 << 16
_COUNTERS = ("lookups", "keys", "hits", "misses", "sync_fetches", "async_inserts",
             "dropped_inserts", "refreshed", "background_errors")


class GpuEmbeddingTable:
    """The GPU cache (dynamic) or table (static) of one model table on one device.
    Thread-safe: lookups may come from many threads at once, with background inserts
    and a refresh running."""

    def __init__(self, model: ModelConfig, table_id: int, num_keys: int, device_id: int,
                 fetch_host: Callable[[np.ndarray], np.ndarray], *,
                 lru_sample_shift: int = DEFAULT_LRU_SAMPLE_SHIFT,
                 fetch_into: Callable[[np.ndarray, np.ndarray], None] | None = None,
                 shared_as: tuple[str, str] | None = None) -> None:
        self._cp = kernels.cupy_module()
        if not cuda_available():
            raise DeviceError("no CUDA device is available for the GPU embedding cache")
        self.model_name = model.model
        self.table_id = int(table_id)
        self.dim = int(model.embedding_vecsize_per_table[table_id])
        self.default_value = float(model.default_value_for_each_table[table_id])
        self.hit_rate_threshold = float(model.hit_rate_threshold)
        self._threshold = HitRateThreshold(self.hit_rate_threshold)
        self.refresh_fraction = float(model.cache_refresh_percentage_per_iteration)
        self.device_id = int(device_id)
        self.mode = cache_mode(model)
        self._fetch_host = fetch_host
        # writes the host path's vectors of keys into a float32 [n, dim] array in place
        # (without one: fetch_host's rows copied there)
        self._fetch_into = fetch_into or (lambda keys, out: np.copyto(out, self._fetch(keys)))
        self._table: EmbeddingCache | StaticEmbeddingTable = open_device_table(
            model, self.mode, num_keys, self.dim, self.device_id,
            lru_sample_shift=lru_sample_shift, shared_as=shared_as)
        #: whether this process maps a table another process allocated (shared_cache.py)
        self.attached = self._table.shared is not None and not self._table.shared.owner
        # keys it promises to hold (a dynamic cache: gpucacheper × keys; it has more slots)
        self.capacity = (cache_capacity(model, num_keys) if self.mode == "dynamic"
                         else int(self._table.capacity))
        self._device = self._cp.cuda.Device(self.device_id)
        self._rt = self._cp.cuda.runtime
        self._cache = self._table if isinstance(self._table, EmbeddingCache) else None
        # a dynamic cache that holds the whole table (gpucacheper ≥ 1, open.WHOLE_TABLE): an
        # open-addressing table that misses are inserted into until it holds `capacity`
        self._whole: StaticEmbeddingTable | None = (
            self._table if holds_whole_table(model)
            and isinstance(self._table, StaticEmbeddingTable) else None)
        self._whole_inserted = 0  # keys sent to it so far (it takes `capacity`)
        self.storage = self._table.storage
        # the scatter of host-fetched rows, by output type (see _scatter_kernel)
        self._scatters: dict[int, Any] = {}
        self._scatter_kernel(OUT_FLOAT32)
        self._dim4 = self.dim % 4 == 0
        self._row4 = self.dim // 4
        self._tls = threading.local()
        self._stats_lock = threading.Lock()
        self._all_counts: list[dict[str, int]] = []
        # states for the first threads that look up, built now (workspace.py SpareStates)
        self._spares = SpareStates(self._new_state, SPARE_STATES, SPARE_RESERVE, self._rt)
        self._refresh_lock = threading.Lock()
        # the online updates' keys: a miss fill drops the rows an update overtook
        self._updates = UpdateLog()
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

    def warm_up(self, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
        """Inserts (keys int64 [n], vectors float32 [n, dim]) chunks in order until the
        cache holds `capacity` keys' worth, the last chunk included (cut to fit); the
        static table takes every chunk. Returns the keys inserted (see hps/gpu/fill.py). The
        chunks' device copies are freed when it returns; nothing where `attached`."""
        if self.attached:
            return 0
        if self.mode != "dynamic":
            inserted = warm_up(self._table, chunks)
        else:
            inserted = warm_up(self._table, chunks, self.capacity)
            self._whole_inserted += inserted
        self._table.settle()
        return inserted

    def lookup(self, keys: Any, out: Any) -> None:
        """Writes the vectors of `keys` into `out` in place.

        keys: integer [n]; out: [n, dim] float32 (or the table's own 16-bit storage type:
        storage.output_dtypes); each a host or CUDA array of a producer
        hps/intake/array_ref.py reads (NumPy, CuPy, torch; strided allowed), CUDA arrays on
        this table's device. Or both as ArrayRefs the caller read and checked
        (hps/intake/keys.py key_ref, output_ref: the server, which reads them to pick the
        device): then `out` is any buffer of n × dim values or more. Device work runs on
        the arrays' stream (CuPy's current one by default); `out` is complete in that
        stream's order (host `out`: on return). Raises KeyTypeError or OutputBufferError
        for bad arguments (checked by hps/intake/keys.py), DeviceError for arrays on
        another device.
        """
        kref, oref, out_type = lookup_refs(keys, out, self.dim, self.storage, self.device_id)
        n = kref.size
        dev = self.device_id
        if n == 0:
            return
        rt = self._rt
        previous = rt.getDevice()
        if previous != dev:
            rt.setDevice(dev)
        try:
            stream = kref.stream if kref.stream is not None else oref.stream
            if stream is None:
                stream = self._cp.cuda.get_current_stream().ptr
            state = self._state()
            if kref.device == dev and is_wide(kref):
                keys_ptr = kref.ptr
            else:
                keys_ptr = self._keys_to_device(kref, state.scratch, stream)
            if oref.device == dev and oref.contiguous:
                self._lookup_ptr(keys_ptr, n, oref.ptr, stream, state, out_type)
                return
            mapped = mapped_address(self._cp, oref.ptr) if oref.on_host and oref.contiguous else 0
            # pinned host memory: the kernels write the rows there, no copy after (HPS.lookup,
            # 2,000 keys dim 64, H100: p50 89 µs, against 120 copied and 170 pageable)
            if mapped:
                self._lookup_ptr(keys_ptr, n, mapped, stream, state, out_type)
                rt.streamSynchronize(stream)
                return
            scratch_out = state.scratch.device_out(n, OUTPUT_CUPY_DTYPE[out_type])
            self._lookup_ptr(keys_ptr, n, int(scratch_out.data.ptr), stream, state, out_type)
            self._out_from_scratch(scratch_out, oref, stream, state.scratch)
        finally:
            if previous != dev:
                rt.setDevice(previous)

    def lookup_contiguous(self, keys_ptr: int, n: int, out_ptr: int, stream: int,
                          out_type: int = OUT_FLOAT32) -> None:
        """lookup() of n > 0 int64 keys at `keys_ptr` into an output of at least n × dim
        elements of type `out_type` (hps/rows/gpu_layout.py: float32, or the storage's own
        16-bit type) at `out_ptr`, both C-contiguous on this table's device, already read
        and checked by the caller (keys.py device_pair); work queued on `stream`."""
        state = self._state()
        misses = self._table.fast_query(keys_ptr, n, out_ptr, self.default_value, state.ws,
                                        stream, out_type)
        if misses == 0:  # every key held, the device current: no device switch
            self._count(state.counts, n, 0)
            return
        rt = self._rt
        dev = self.device_id
        previous = rt.getDevice()
        if previous != dev:
            rt.setDevice(dev)
        try:
            self._lookup_ptr(keys_ptr, n, out_ptr, stream, state, out_type,
                             misses if misses > 0 else None)
        finally:
            if previous != dev:
                rt.setDevice(previous)

    def host_output(self, n: int) -> np.ndarray:
        """A new float32 [n, dim] host array for lookup() to fill (HPS.lookup's result):
        pinned where it fits (hps/gpu/host_memory.py pinned_empty), written in place."""
        return pinned_empty(self._cp, (n, self.dim), np.float32)

    def _keys_to_device(self, keys: ArrayRef, scratch: Scratch, stream: int) -> int:
        """Device address of the keys as contiguous int64 (host keys copied over, narrow
        or strided device keys converted into scratch)."""
        if keys.on_host:
            return scratch.keys_to_device(keys.host_array(), stream)
        cp = self._cp
        dst = scratch.device_keys(keys.size)
        src = keys.device_array().reshape(-1)
        if src.dtype == np.uint64:
            src = src.view(np.int64)
        with external_stream(cp, stream):
            cp.copyto(dst, src, casting="unsafe")
        return int(dst.data.ptr)

    def _out_from_scratch(self, rows: Any, out: ArrayRef, stream: int, scratch: Scratch
                          ) -> None:
        """Moves rows looked up into scratch to the caller's output (a bfloat16 output,
        which NumPy and CuPy cannot view, is contiguous: output_code checked it)."""
        if out.on_host:
            if out.contiguous:
                scratch.copy_to_host(int(rows.data.ptr), out.ptr, rows.nbytes, stream)
                return
            scratch.out_to_host(int(rows.data.ptr), out.host_array(), stream)
            return
        cp = self._cp
        with external_stream(cp, stream):  # a strided output on this device
            cp.copyto(out.device_array(), rows)

    def _lookup_ptr(self, keys_ptr: int, n: int, out_ptr: int, stream: int,
                    state: ThreadState, out_type: int = OUT_FLOAT32,
                    misses: int | None = None) -> None:
        """The lookup on device addresses (contiguous keys, [n, dim] out of `out_type`),
        the device current: the query (unless made, with `misses`), then its misses."""
        ws = state.ws
        if misses is None:
            misses = self._table.query_ptr(keys_ptr, n, out_ptr, self.default_value, ws,
                                           stream, out_type)
        self._count(state.counts, n, misses)
        if misses:
            self._serve_misses(ws, misses, n, out_ptr, stream, state, out_type)

    @staticmethod
    def _count(counts: dict[str, int], n: int, misses: int) -> None:
        counts["lookups"] += 1
        counts["keys"] += n
        counts["hits"] += n - misses
        counts["misses"] += misses

    def _serve_misses(self, ws: QueryWorkspace, m: int, n: int, out_ptr: int, stream: int,
                      state: ThreadState, out_type: int) -> None:
        """The misses of the query just made: background or fetched, scattered, inserted."""
        missed = ws.host_keys[:m]
        cache = self._cache
        whole = self._whole
        if (cache is not None or whole is not None) and not self._threshold.synchronous(m, n):
            self._submit(missed.copy())  # this request keeps the default rows the query wrote
            return
        staging = state.staging
        keys, codes, inverse, rows = staging.prepare(m, self.dim)
        updates = self._updates.mark()  # rows an update overtakes are not kept
        small = m <= HOST_MISSES
        if small:
            u = int(host_loops.stage(missed, 0 if cache is None else cache.num_sets, keys,
                                     inverse, codes))
            self._fetch_into(keys[:u], rows[:u])
            staging.send(u, stream)
        else:
            u = m
            keys[:] = missed
            staging.send_index(stream)
            self._fetch_and_send(keys, rows, staging, stream)
        d_keys, d_codes, d_inverse, d_rows = staging.device_ptrs()
        inverse_ptr = d_inverse if small else 0
        state.counts["sync_fetches"] += u
        if cache is not None:
            if not small:
                self._device_codes(d_keys, d_codes, u, stream)
            # the insert scatters the rows into out in the same launch
            cache.insert_staged(d_keys, d_rows, d_codes, u, ws, stream,
                                scatter=(ws.positions_ptr, inverse_ptr, m, out_ptr),
                                out_type=out_type)
            self._drop_raced(updates, keys[:u])
        else:
            self._scatter_rows(ws, m, inverse_ptr, d_rows, out_ptr, stream, out_type)
            if whole is not None and self._whole_inserted + u <= self.capacity:
                self._whole_inserted += u
                whole.insert_staged(d_keys, d_rows, u, ws, stream)
                self._drop_raced(updates, keys[:u])
        staging.done(stream)
        ws.released_by(staging.done_ptr)

    def _fetch_and_send(self, keys: np.ndarray, rows: np.ndarray, staging: MissStaging,
                        stream: int) -> None:
        """A large batch: its rows fetched in chunks on the fetch threads (the tiers'
        compiled fetches release the GIL), each chunk sent to the device as soon as it and
        those before it are in, while the later ones are still being fetched."""
        step = max(1, CHUNK_BYTES // (self.dim * 4))
        bounds = [(a, min(keys.size, a + step)) for a in range(0, keys.size, step)]
        pool = fetch_pool()
        fetches = [pool.submit(self._fetch_into, keys[a:b], rows[a:b]) for a, b in bounds]
        for (a, b), fetch in zip(bounds, fetches, strict=True):
            fetch.result()
            staging.send_rows(a, b, stream)

    def _scatter_kernel(self, out_type: int) -> Any:
        """The scatter_rows kernel (cuda/rows.cu) writing `out_type`, compiled once."""
        fn = self._scatters.get(out_type)
        if fn is None:
            defines = {"DIM": self.dim}
            if out_type != OUT_FLOAT32:  # float32 output: the one module of every storage
                defines |= {"OUT_TYPE": out_type, "STORAGE": STORAGE_CODES[self.storage.name]}
            fn = kernels.function("rows.cu", "scatter_rows", self.device_id, **defines)
            self._scatters[out_type] = fn
        return fn

    def _scatter_rows(self, ws: QueryWorkspace, m: int, inverse_ptr: int, rows_ptr: int,
                      out_ptr: int, stream: int, out_type: int) -> None:
        """out[positions[j]] = rows[inverse[j]] (inverse 0: rows[j]) for the m misses,
        float32 rows written as `out_type`."""
        cells = ws.scatter_cells
        if cells is None or ws.scatter_launch is None or ws.scatter_type != out_type:
            ws.scatter_launch = kernels.Launch(self._scatter_kernel(out_type),
                                               "ptr ptr i64 ptr ptr i32")
            ws.scatter_type = out_type
            cells = ws.scatter_cells = ws.scatter_launch.values
        vec4 = self._dim4 and out_ptr % 16 == 0
        cells[0].value = ws.positions_ptr
        cells[1].value = inverse_ptr
        cells[2].value = m
        cells[3].value = rows_ptr
        cells[4].value = out_ptr
        cells[5].value = vec4
        ws.scatter_launch.go(kernels.grid(self.device_id, m * (self._row4 if vec4 else self.dim)),
                             256, stream)

    def _device_codes(self, keys_ptr: int, codes_ptr: int, u: int, stream: int) -> None:
        """Sorted set codes of u device keys, computed and sorted on the device."""
        cp = self._cp
        cache = self._cache
        assert cache is not None
        with external_stream(cp, stream):
            codes = device_view(cp, codes_ptr, (u,), np.uint64, None)
            cache.codes_on_device(keys_ptr, u, codes_ptr, stream)
            codes.sort()

    def _state(self) -> ThreadState:
        state: ThreadState | None = getattr(self._tls, "state", None)
        if state is None:
            state = self._spares.take() or self._new_state(0)
            self._tls.state, self._tls.counts = state, state.counts
        return state

    def _new_state(self, reserve: int) -> ThreadState:
        """A thread's lookup state: workspace reserved for `reserve` keys, own counters."""
        with self._device:
            ws, staging = QueryWorkspace(self._cp, self.device_id), MissStaging(self._cp)
            if reserve:  # a spare: its buffers and launches made now, not in a lookup
                ws.reserve(reserve)
                self._table.bind(ws)
                staging.prepare(reserve // 8, self.dim)
        counts = dict.fromkeys(_COUNTERS, 0)
        with self._stats_lock:
            self._all_counts.append(counts)
        return ThreadState(ws, staging, Scratch(self._cp, self.dim), counts)

    def _drop_raced(self, mark: int, keys: np.ndarray) -> None:
        """After a miss fill of `keys` fetched since `mark` (hps/gpu/update_log.py): the
        rows of those an online update overtook are not kept in a cache, and made current
        in a whole-table cache (which keeps every key it was given). With no update since
        `mark` (every miss fill in steady state) `raced` asks nothing."""
        stale = self._updates.raced(mark, keys)
        if stale.size:
            with self._device:
                if self._cache is not None:
                    self._cache.remove(stale)
                elif self._whole is not None:
                    self._whole.update(stale, self._fetch(stale))

    def _fetch(self, keys: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(self._fetch_host(keys), dtype=np.float32)
        if rows.shape != (keys.size, self.dim):
            raise DeviceError(f"fetch_host returned shape {rows.shape} for {keys.size} keys; "
                              f"expected ({keys.size}, {self.dim})")
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
            updates = self._updates.mark()
            rows = self._fetch(keys)
            with self._device:
                if self._whole is not None:
                    self._build_whole(keys, rows, updates)
                else:
                    self._table.insert(keys, rows)  # type: ignore[union-attr]
                    stale = self._updates.raced(updates, keys)
                    if stale.size:  # fetched before an update of theirs: not kept
                        self._table.remove(stale)  # type: ignore[union-attr]
            self._counts()["async_inserts"] += int(keys.size)
        except Exception:
            if self._closing.is_set():
                return
            log.exception("background insert into the GPU cache of %s table %d failed",
                          self.model_name, self.table_id)
            self._counts()["background_errors"] += 1

    def _build_whole(self, keys: np.ndarray, rows: np.ndarray, updates: int) -> None:
        """Keys into the whole-table cache, as long as it has room for them."""
        whole = self._whole
        assert whole is not None
        if self._whole_inserted + keys.size > self.capacity:
            self._counts()["dropped_inserts"] += int(keys.size)
            return
        self._whole_inserted += int(keys.size)
        whole.build(keys, rows)
        stale = self._updates.raced(updates, keys)
        if stale.size:  # fetched before an update of theirs: made current
            whole.update(stale, self._fetch(stale))

    def refresh(self) -> int:
        """Re-reads the vectors of the cached keys through fetch_host and overwrites them
        in place, in windows of cache_refresh_percentage_per_iteration × capacity slots
        (the whole cache at once when that is 0). LRU order is untouched. Returns the
        keys refreshed."""
        with self._refresh_lock, self._device:
            total = refresh(self._table, self._fetch, self.refresh_fraction)
        self._counts()["refreshed"] += total
        return total

    # -- online updates -------------------------------------------------------------------

    def update(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Overwrites the rows of the `keys` this table holds with `vectors`, in place;
        keys it does not hold are skipped, LRU order is untouched. keys: unique host int64
        [n]; vectors: host float32 [n, dim]. Called after the update reached the tiers, so
        a later miss fetches the new row. A lookup sees each row old or new, never a mix
        (the write is ordered after the queries in flight, later queries after it).
        Returns the keys held."""
        # host rows copied on the table's own stream: the write then waits for no caller's
        # stream (on the legacy default stream, that is all of every caller's work)
        with self._refresh_lock, self._device, self._table.stream:
            self._updates.wrote(keys)
            return int(self._table.update(keys, vectors))

    def insert(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """`update`, and the keys not held are inserted too (evicting as a miss does);
        a static or uvm table only updates (it holds its whole table already)."""
        if self._cache is None and self._whole is None:
            self.update(keys, vectors)
            return
        with self._refresh_lock, self._device, self._table.stream:  # as update()'s
            self._updates.wrote(keys)
            if self._cache is not None:
                self._cache.insert(keys, vectors)
            else:
                self._build_whole(np.asarray(keys, np.int64), vectors, self._updates.mark())

    # -- state ----------------------------------------------------------------------------

    def held_keys(self, most: int) -> np.ndarray:
        """Up to `most` keys held, newest first (none: a static or uvm table holds all)."""
        with self._device:
            if self._cache is not None:
                return self._cache.held_keys(most)
            if self._whole is not None:
                return self._whole.dump(0, self._whole.num_sets)[:most].get()
        return np.empty(0, np.int64)

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        """The block's lookups on this thread are a warm-up's (hps/server/warm_paths.py),
        of keys the cache holds (the warm-up sends it no other: their inserts would evict
        rows the load put there, so nothing is left to remove after): a whole-table cache
        keeps its room for the table's keys; the thread's buffers are handed back
        (SpareStates) once the inserts it queued are done."""
        inserted, self._whole_inserted = self._whole_inserted, self.capacity
        try:
            yield
        finally:
            self._inserts.wait_idle(timeout=30)
            self._whole_inserted = inserted
            self._spares.hand_back(self._tls)

    def publish(self) -> None:
        """Lets the host's other processes map this table (gpu_cache_scope: host)."""
        self._table.publish()

    def stats(self) -> dict[str, Any]:
        """mode, storage_dtype, capacity, size (keys held), hits, misses, hit_rate,
        memory_bytes (the device bytes the table's rows and index take, in its storage
        type), …"""
        counts = dict.fromkeys(_COUNTERS, 0)
        with self._stats_lock:
            for part in self._all_counts:
                for k in _COUNTERS:
                    counts[k] += part[k]
        looked = counts["hits"] + counts["misses"]
        return {
            "mode": self.mode,
            "storage_dtype": self.storage.name,
            "device_id": self.device_id,
            "dim": self.dim,
            "capacity": self.capacity,
            "slots": self._table.num_slots,
            "size": self._table.size(),
            **self._table.memory_stats(),
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
        self._spares.clear()  # their pinned and device buffers go now, not with the object

    def __enter__(self) -> GpuEmbeddingTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
