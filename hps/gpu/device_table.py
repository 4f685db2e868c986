"""What the GPU caches share: device memory, streams, query workspaces and kernel launches.

`DeviceTable` holds one table's slots on one device (keys int64 [num_sets * SET_SIZE],
rows in the table's storage type (float32 padded to float4, float16, bfloat16 or int8
rows: hps/rows/gpu_layout.py), a few int32 flags), its own stream, the per-thread query
workspaces, and the launches of the query, update and dump kernels. Rows come in as
float32 and are encoded on the device; a query writes float32 or, from 16-bit storage,
that same 16-bit type (its output type, picked per call). The policies built
on it (`EmbeddingCache` in cache.py, `StaticEmbeddingTable` in static_table.py) say which
kernels and which arguments; this module says where the memory lives and how work is
ordered.

Streams: queries run on the caller's current CuPy stream, so they overlap with the
caller's own work and with each other; the only host wait of a query is the read of its
miss count. Inserts, updates and removes run on the table's own stream. The two are
ordered with CUDA events: a write waits for the queries in flight and for the caller's
stream (whose arrays it reads); a query waits for the writes before it. No device-wide
synchronize is ever used. All methods are thread-safe.

Keys and outputs are checked by hps/intake/keys.py (`key_view`, `device_output_view`); the
methods here that end in `_checked` or take codes (`insert_by_set`) take views already
checked.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps.errors import DeviceError, LookupInputError
from hps.gpu import kernels, overlap
from hps.gpu.kernels import EMPTY_KEY, RANK_BITS, SET_SIZE
from hps.rows.gpu_layout import (
    OUT_FLOAT32,
    OUTPUT_CODES,
    STORAGE_CODES,
    row_unit_bytes,
    stored_row_bytes,
    table_storage,
)
from hps.gpu.streams import same_stream
from hps.intake.keys import as_key_array, device_output_view, key_view
from hps.runtime.raw_memory import wait_while
from hps.rows.storage_types import FLOAT32, StorageType, decode

BLOCK = 256
# Batches of more keys than PIPELINED_AFTER into 16-bit outputs, of rows up to
# PIPELINED_ROW_BYTES, take a table's pipelined query kernel (cuda/static_table.cu
# static_query_pipelined says why). H100, 1M keys, the public call, static table,
# alternating with it off (scripts/pipelined_query_probe.py): float16 / bfloat16 rows at
# dim 32 1.09x / 1.10x, dim 64 1.19x / 1.20x, dim 128 1.13x / 1.05x; at dim 256 (512-byte
# rows) 0.96x / 1.04x, as float32 rows of 512 bytes gained nothing (kernel time 417-424
# against 408 us).
PIPELINED_AFTER = 1 << 16
PIPELINED_ROW_BYTES = 256
_MAPPED_PINNED = 3  # cudaHostAllocPortable | cudaHostAllocMapped
# The miss count's place holds this until the query kernel writes the count; the host
# reads it this many times (GIL released, well under a millisecond) before it waits on
# the query's event instead.
_NO_COUNT = -1
_SPINS = 1 << 16


def _is_cupy(array: Any) -> bool:
    return type(array).__module__.startswith("cupy")


def default_group(dim: int) -> int:
    """Lanes that serve one key (measured on an H100, hps/tools/bench/gpu.py --sweep)."""
    return 2 if dim <= 32 else 8


def default_unroll(dim: int) -> int:
    """Keys a lane group has in flight at once (measured likewise)."""
    return 2


def default_hints(storage: StorageType) -> int:
    """The cache hints of a table's kernels (HINTS, bits; cuda/hps_common.cuh).

    Bit 1, streaming hints on row reads and output writes: compact rows only. H100, 1M
    all-hit keys at dim 128, each pair timed in one block: with compact rows (`hps bench
    gpu --profile storage --sweep`, static table, public call) float16 rows into float16
    outputs 3.83 against 3.48 G keys/s without, into float32 3.08 against 2.83, int8 3.12
    against 2.98; with float32 rows (`--only throughput --sweep`, kernel time) they lose:
    static 2.23 against 2.40, dynamic 1.94 against 2.26.

    Bit 2, queries' reads of the index (the dynamic cache's sets, the static and uvm
    tables' buckets) keep their L2 lines ahead of the streamed rows: every type. H100,
    1M keys at dim 128, 1M uniform keys through the public call, calls alternating with
    and without (`python scripts/index_hint_probe.py [--cache-type dynamic]`): static
    table (three runs) float32 rows 2.50-2.55 against 2.25-2.29 G keys/s, float16 into
    float32 3.18-3.24 against 2.91-2.96, int8 3.20-3.31 against 2.93-3.00, float16 into
    float16 3.67-3.80 against 3.57-3.71; dynamic cache float32 2.43 against 2.20, float16
    into float32 3.10 against 2.83, int8 3.16 against 2.86, float16 into float16 3.48
    against 3.38; every output the same bit for bit. Over 8M keys at dim 64 (an index
    larger than L2) the static table still gained 1-2%."""
    return (1 if storage.compact else 0) | 2


def row_floats(dim: int) -> int:
    """Floats per stored float32 row: rows are padded to whole float4 (16 bytes)."""
    return -(-dim // 4) * 4


def decode_rows(raw: np.ndarray, dim: int, storage: StorageType) -> np.ndarray:
    """Host copies of stored rows (as a table allocates them: float32 [r, row_floats],
    or uint8 [r, stored_row_bytes] for compact storage) as float32 [r, dim]."""
    if not storage.compact:
        return np.ascontiguousarray(raw[:, :dim])
    if storage.name == "int8":
        return decode(storage, raw, dim)
    return decode(storage, raw.view(storage.stored_dtype)[:, :dim], dim)


@dataclass
class Misses:
    """The misses of one query: `count` positions into the batch (device) and their keys
    (host: the query kernel writes them straight into mapped pinned memory)."""

    positions: Any  # cupy int32 [count]
    keys: np.ndarray  # int64 [count], host
    count: int


class QueryWorkspace:
    """Reusable buffers of one thread's queries of one table: the miss positions (device),
    the missed keys (mapped pinned host memory the kernel writes directly), the kernels'
    counters (ctl: miss count, blocks done; reset by each query kernel itself), the miss
    count's landing place (mapped pinned), the query launches bound to these buffers, and
    the events of this thread's queries and writes.

    One per thread and table (reused by every query of that thread). `release(stream)`
    marks that work still queued on `stream` reads the miss positions; the next query
    waits for it before it overwrites them.
    """

    def __init__(self, cupy: Any, device_id: int) -> None:
        self._cp = cupy
        rt = cupy.cuda.runtime
        self._rt = rt
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            self.ctl = cupy.zeros(2, dtype=np.int32)
            cupy.cuda.get_current_stream().synchronize()
            self.event = cupy.cuda.Event(block=False, disable_timing=True)
            self.write_done = cupy.cuda.Event(block=False, disable_timing=True)
            self._released = cupy.cuda.Event(block=False, disable_timing=True)
            # mapped pinned memory: with unified addressing the kernel writes it directly
            self.host_ptr = int(rt.hostAlloc(8, _MAPPED_PINNED))
        weakref.finalize(self, rt.freeHost, self.host_ptr).atexit = False
        self.host_count = np.ctypeslib.as_array((ctypes.c_int32 * 2).from_address(self.host_ptr))
        self.host_count[:] = 0
        self.ctl_ptr = int(self.ctl.data.ptr)
        self.event_ptr = int(self.event.ptr)
        self._pending = False
        self._released_ptr = 0
        self.capacity = 0
        self.positions: Any = None
        self.host_keys: np.ndarray = np.empty(0, np.int64)
        self.positions_ptr = 0
        self.keys_ptr = 0
        self._keys_finalizer: Any = None
        # the query launches bound to these buffers (see DeviceTable._bind_query)
        # by output type (row_format.OUTPUT_CODES)
        self.launches: dict[int, list[tuple[int, kernels.Launch, int, Any, int]]] = {}
        self.generation = -1
        self.insert_launch: kernels.Launch | None = None
        self.insert_cells: list[Any] | None = None
        self.scatter_launch: kernels.Launch | None = None
        self.scatter_cells: list[Any] | None = None
        self.scatter_type = 0  # the output type scatter_launch writes
        self.insert_type = 0  # the output type insert_launch scatters into

    def reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        if self._pending:  # queued work may still read the buffers about to be freed
            self._rt.eventSynchronize(self._released_ptr)
            self._pending = False
        cap = max(n, 2 * self.capacity, 1024)
        with self._cp.cuda.Device(self.device_id):
            self.positions = self._cp.empty(cap, dtype=np.int32)
            keys_ptr = int(self._rt.hostAlloc(cap * 8, _MAPPED_PINNED))
        if self._keys_finalizer is not None:
            self._keys_finalizer()
        self._keys_finalizer = weakref.finalize(self, self._rt.freeHost, keys_ptr)
        self._keys_finalizer.atexit = False
        self.host_keys = np.ctypeslib.as_array((ctypes.c_int64 * cap).from_address(keys_ptr))
        # only the query kernel writes it; read-only, it matches the compiled miss path's
        # signature exactly (numba's dispatch converts a writable array ~0.4 µs slower)
        self.host_keys.flags.writeable = False
        self.positions_ptr = int(self.positions.data.ptr)
        self.keys_ptr = keys_ptr
        self.capacity = cap
        self.launches = {}  # bound to the old buffers

    def misses(self, count: int) -> Misses:
        """The misses of the last query (views, valid until the next one)."""
        if count == 0:
            self.reserve(1)
        return Misses(self.positions[:count], self.host_keys[:count], count)

    def release(self, stream_ptr: int) -> None:
        """Work queued on the stream still reads the miss positions."""
        self._rt.eventRecord(self._released.ptr, stream_ptr)
        self.released_by(int(self._released.ptr))

    def released_by(self, event_ptr: int) -> None:
        """Work before `event_ptr` (an event just recorded by the caller) still reads the
        miss positions."""
        self._released_ptr = event_ptr
        self._pending = True

    def wait_released(self, stream_ptr: int) -> None:
        """Orders a query on `stream_ptr` after the work that still reads the miss
        positions. Also on that work's own stream, where the order is already the
        stream's: skipping these driver calls there measured no faster, and seemingly
        slower, on the HugeCTR profile (see DeviceTable.query_ptr)."""
        if self._pending:
            self._rt.streamWaitEvent(stream_ptr, self._released_ptr, 0)
            self._pending = False


class DeviceTable:
    """What the dynamic cache and the static table share: memory, streams, ordering,
    argument checks, the query launch, dump and stats. Not used directly."""

    _kind = "table"
    _source = ""
    _query_kernel = ""
    _query_signature = ""
    _dump_kernel = ""
    _update_kernel = ""

    def __init__(self, dim: int, device_id: int, num_sets: int, *, group: int, unroll: int,
                 special_flags: int, storage: str | StorageType = FLOAT32) -> None:
        self.storage = table_storage(storage)
        cp = kernels.cupy_module()
        self._cp = cp
        self.dim = int(dim)
        self.device_id = int(device_id)
        self.num_sets = int(num_sets)
        self.num_slots = self.num_sets * SET_SIZE
        self._row = row_floats(self.dim)
        self._row_bytes = stored_row_bytes(self.dim, self.storage)
        self._row_units = self._row_bytes // row_unit_bytes(self.storage)
        # which outputs take 16-byte stores when aligned: by output type, DIM a multiple
        # of the elements one store writes (4 float32; 8 halves from 16-bit storage)
        self._out_dim_vec = tuple(self.dim % (4 if code == OUT_FLOAT32 or not
                                              self.storage.compact else 8) == 0
                                  for code in range(len(OUTPUT_CODES)))
        self._dim4 = self.dim % 4 == 0  # rows may use float4 stores where 16-byte aligned
        self._group = group
        self._unroll = unroll
        self._waves = 0
        self._hints = default_hints(self.storage)
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._tick = 0
        # queries in flight: their workspace's event (recorded after the query) → stream
        self._inflight: dict[int, int] = {}
        self._write_event: Any = None  # the last write; later queries and writes wait for it
        self._retire: deque[tuple[Any, tuple[Any, ...]]] = deque()
        self._closed = False
        try:
            self._device = cp.cuda.Device(self.device_id)
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as exc:  # CUDA driver/runtime missing or broken
            raise DeviceError(f"CUDA is not usable: {exc}") from None
        if not 0 <= self.device_id < count:
            raise DeviceError(
                f"device_id {self.device_id} does not exist: this machine has {count} CUDA "
                f"device(s)"
            )
        self._defines = {"DIM": self.dim, "GROUP": group, "UNROLL": unroll,
                         "HINTS": self._hints, "STORAGE": STORAGE_CODES[self.storage.name]}
        with self._device:
            self._stream = cp.cuda.Stream(non_blocking=True)
            self._check_room(self._memory_bytes())
            self._keys = self._alloc((self.num_slots,), np.int64)
            self._vecs = self._alloc_rows()
            self._flags = self._alloc((special_flags,), np.int32)
            with self._stream:
                self._keys.fill(EMPTY_KEY)
                self._flags.fill(0)
            self._stream.synchronize()
        self._fn: dict[tuple[str, int], Any] = {}
        self._generation = 0  # bumped when kernels change: workspaces rebind their launches
        self._rt = cp.cuda.runtime
        self._sms = kernels.multiprocessors(self.device_id)
        self._keys_ptr = int(self._keys.data.ptr)
        self._vecs_ptr = int(self._vecs.data.ptr)
        self._flags_ptr = int(self._flags.data.ptr)

    # -- memory ---------------------------------------------------------------------------

    def _memory_bytes(self) -> int:
        raise NotImplementedError

    def _check_room(self, need: int) -> None:
        free, total = self._cp.cuda.runtime.memGetInfo()
        if need > free:
            raise DeviceError(
                f"the {self._kind} needs {need / 2**30:.2f} GiB on device {self.device_id} "
                f"but only {free / 2**30:.2f} GiB of {total / 2**30:.2f} GiB are free; lower "
                f"gpucacheper or use another device"
            )

    def _alloc(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A device array on its own cudaMalloc (not the pool: freed when the table is)."""
        cp = self._cp
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        try:
            mem = cp.cuda.memory.Memory(max(nbytes, 1))
        except Exception as exc:
            raise DeviceError(
                f"cannot allocate {nbytes / 2**30:.2f} GiB for the {self._kind} on device "
                f"{self.device_id}: {exc}"
            ) from None
        return cp.ndarray(shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0))

    def _row_array(self, rows: int) -> tuple[tuple[int, int], Any]:
        """(shape, dtype) of `rows` stored rows: float32 [rows, row_floats(dim)], or the
        bytes of compact rows, uint8 [rows, stored_row_bytes(dim)]."""
        if self.storage.compact:
            return (rows, self._row_bytes), np.uint8
        return (rows, self._row), np.float32

    def _alloc_rows(self) -> Any:
        """The rows beside the slots, [num_slots + 1] stored rows (the last: the special
        slot's; see _row_array), zeroed, as an array kernels can address; device memory
        here (the uvm table keeps them in mapped host memory). Called with the device
        current; may queue work on the table's stream (synchronized after)."""
        rows = self._alloc(*self._row_array(self.num_slots + 1))
        with self._stream:
            rows.fill(0)
        return rows

    def set_launch(self, group: int, unroll: int, waves: int = 0, hints: int = 0) -> None:
        """Kernel launch shape: lanes per key (a power of two dividing SET_SIZE), keys
        per lane group in flight, the grid cap in blocks per SM (0: no cap), streaming
        cache hints (1) or not (0). The layout is unchanged; this is for tuning
        (hps/tools/bench/gpu.py)."""
        if group not in (1, 2, 4, 8) or SET_SIZE % group or unroll not in (1, 2, 4):
            raise LookupInputError(f"unsupported launch shape group={group} unroll={unroll}")
        with self._lock:
            self._group, self._unroll, self._waves, self._hints = group, unroll, waves, hints
            self._defines = {**self._defines, "GROUP": group, "UNROLL": unroll,
                             "HINTS": hints}
            self._fn = {}
            self._generation += 1

    def _kernel(self, name: str, out_type: int = OUT_FLOAT32) -> Any:
        """Kernel `name` of the table's source, compiled for its defines and, for query
        kernels, output type `out_type`."""
        fn = self._fn.get((name, out_type))
        if fn is None:
            fn = kernels.function(self._source, name, self.device_id,
                                  **self._out_defines(self._defines, out_type))
            self._fn[(name, out_type)] = fn
        return fn

    @staticmethod
    def _out_defines(defines: dict[str, int], out_type: int) -> dict[str, int]:
        """`defines` for queries writing `out_type` (float32 adds nothing: one module)."""
        return defines if out_type == OUT_FLOAT32 else {**defines, "OUT_TYPE": out_type}

    # -- argument checks ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DeviceError(f"the {self._kind} on device {self.device_id} is closed")

    @staticmethod
    def _host_keys(keys: np.ndarray) -> np.ndarray:
        """Host keys of any integer width and shape, widened and flattened to int64 [n]
        (checked by hps/intake/keys.py)."""
        return key_view(as_key_array(keys))  # type: ignore[no-any-return]

    def _device_keys(self, keys: Any) -> Any:
        """int64 1-D keys on this device, checked by hps/intake/keys.py (host arrays: see
        _host_keys, then copied over)."""
        if isinstance(keys, np.ndarray):
            host = self._host_keys(keys)
            with self._device:
                return self._cp.asarray(host)
        return key_view(keys, self.device_id)

    def _device_rows(self, vectors: Any, n: int) -> Any:
        """float32 [n, dim] C-contiguous rows on this device (host arrays copied over).
        Raises LookupInputError for the wrong shape or dtype and, for compact storage,
        for rows it cannot hold (see hps/rows/storage_types.py)."""
        rows = self._device_rows_unchecked(vectors, n)
        if self.storage.compact and n:
            with self._device:
                limit = np.float32(self.storage.max_magnitude)
                unfit = ~(self._cp.abs(rows) < limit).all(axis=1)  # NaN compares False
                bad = int(self._cp.flatnonzero(unfit)[0]) if bool(unfit.any()) else None
            if bad is not None:
                raise LookupInputError(
                    f"row {bad} holds NaN, infinity or a value of magnitude "
                    f"≥ {self.storage.max_magnitude:g}, which the {self._kind}'s "
                    f"{self.storage.name} storage cannot hold")
        return rows

    def _device_rows_unchecked(self, vectors: Any, n: int) -> Any:
        cp = self._cp
        if isinstance(vectors, np.ndarray):
            vectors = np.ascontiguousarray(vectors, dtype=np.float32)
            if vectors.shape != (n, self.dim):
                raise LookupInputError(
                    f"vectors must have shape ({n}, {self.dim}), got {vectors.shape}"
                )
            with self._device:
                return cp.asarray(vectors)
        if not _is_cupy(vectors):
            raise LookupInputError(
                f"vectors must be a CuPy or NumPy array, got {type(vectors).__name__}"
            )
        if vectors.dtype != np.float32:
            raise LookupInputError(f"vectors must be float32, got dtype {vectors.dtype.name}")
        if tuple(vectors.shape) != (n, self.dim):
            raise LookupInputError(
                f"vectors must have shape ({n}, {self.dim}), got {tuple(vectors.shape)}"
            )
        if vectors.device.id != self.device_id:
            raise DeviceError(
                f"vectors are on device {vectors.device.id}, the {self._kind} on device "
                f"{self.device_id}"
            )
        return vectors if vectors.flags.c_contiguous else cp.ascontiguousarray(vectors)

    def _vec4(self, array: Any) -> np.int32:
        return np.int32(self.dim % 4 == 0 and array.data.ptr % 16 == 0)

    # -- ordering between the caller's streams and the table's stream ---------------------

    def _wait_for_writes(self, stream_ptr: int) -> None:
        """Orders work on `stream_ptr` after the last write (each write is ordered after
        the one before it, so the last one is enough)."""
        ev = self._write_event
        if ev is not None:
            if ev.done:
                self._write_event = None
            else:
                self._rt.streamWaitEvent(stream_ptr, ev.ptr, 0)

    def _after_queries(self, stream_ptr: int, own_event: int = 0) -> None:
        """Orders work on `stream_ptr` after the queries in flight on other streams (the
        lock held)."""
        rt = self._rt
        for ev_ptr, query_stream in tuple(self._inflight.items()):
            if ev_ptr != own_event and not same_stream(query_stream, stream_ptr):
                rt.streamWaitEvent(stream_ptr, ev_ptr, 0)

    @contextmanager
    def _on_table_stream(self) -> Iterator[None]:
        """Runs the body under the lock with the table's stream current, after the work
        the caller has queued on its own stream (whose arrays the body may use)."""
        cp = self._cp
        with self._lock:
            self._check_open()
            with self._device:
                caller = cp.cuda.get_current_stream()
                if caller.ptr != self._stream.ptr:
                    ready = cp.cuda.Event(block=False, disable_timing=True)
                    ready.record(caller)
                    self._stream.wait_event(ready)
                with self._stream:
                    yield

    @contextmanager
    def _writing(self, *refs: Any) -> Iterator[None]:
        """Like _on_table_stream, also after the queries in flight; later queries wait for
        it. Keeps `refs` (the inputs) alive until the write is done."""
        cp = self._cp
        with self._on_table_stream():
            self._after_queries(self._stream.ptr)
            self._wait_for_writes(self._stream.ptr)
            yield
            done = cp.cuda.Event(block=False, disable_timing=True)
            done.record(self._stream)
            self._write_event = done
            self._retire.append((done, refs))
            while self._retire and self._retire[0][0].done:
                self._retire.popleft()

    @contextmanager
    def _writing_on(self, stream_ptr: int, ws: QueryWorkspace) -> Iterator[None]:
        """Runs the body (a write queued on the caller's stream `stream_ptr`, the table's
        device current) under the lock, after the queries in flight on other streams and
        the writes before it; later queries and writes wait for it (ws.write_done)."""
        rt = self._rt
        with self._lock:
            self._check_open()
            self._after_queries(stream_ptr, ws.event_ptr)
            self._wait_for_writes(stream_ptr)
            yield
            rt.eventRecord(ws.write_done.ptr, stream_ptr)
            self._write_event = ws.write_done

    # -- queries --------------------------------------------------------------------------

    def workspace(self) -> QueryWorkspace:
        """This thread's query workspace for this table."""
        ws: QueryWorkspace | None = getattr(self._tls, "ws", None)
        if ws is None:
            ws = QueryWorkspace(self._cp, self.device_id)
            self._tls.ws = ws
        return ws

    # Positions of the varying query parameters in _query_signature: keys, n, out, out_vec4,
    # default value; and the tick (-1: none).
    _query_slots: tuple[int, int, int, int, int] = (0, 1, 0, 0, 0)
    _tick_slot = -1

    def _fixed_query_params(self, ws: QueryWorkspace) -> dict[int, float]:
        """The query parameters that stay fixed for a workspace: position → value."""
        raise NotImplementedError

    # the query kernel for batches of more than PIPELINED_AFTER keys into 16-bit outputs,
    # rows up to PIPELINED_ROW_BYTES (None: none)
    _pipelined_kernel: str | None = None

    def _query_kernels(self, out_type: int) -> list[tuple[int, Any, int, int]]:
        """(most keys, kernel, keys per lane group, most blocks or 0) of the query kernels
        writing `out_type`, by batch size."""
        fn = self._kernel(self._query_kernel, out_type)
        pipelined = self._pipelined_query(out_type)
        if pipelined is None:
            return [(kernels.MAX_BATCH, fn, self._unroll, 0)]
        return [(PIPELINED_AFTER, fn, self._unroll, 0), pipelined]

    def _pipelined_query(self, out_type: int) -> tuple[int, Any, int, int] | None:
        """The _query_kernels entry of the pipelined kernel writing `out_type` (for batches
        past PIPELINED_AFTER keys), or None where it does not apply: one key per lane group
        and round (the kernel's register cap), one wave of blocks."""
        if (out_type == OUT_FLOAT32 or self._pipelined_kernel is None
                or self._row_bytes > PIPELINED_ROW_BYTES):
            return None
        fn = self._fn.get(("pipelined query", out_type))
        if fn is None:
            fn = kernels.function(
                self._source, self._pipelined_kernel, self.device_id,
                **self._out_defines({**self._defines, "UNROLL": 1}, out_type))
            self._fn[("pipelined query", out_type)] = fn
        wave = self._sms * kernels.resident_blocks(fn, BLOCK)
        return (kernels.MAX_BATCH, fn, 1, wave)

    def _bind_query(self, ws: QueryWorkspace, out_type: int
                    ) -> list[tuple[int, kernels.Launch, int, Any, int]]:
        launches = []
        fixed = self._fixed_query_params(ws)
        k, c, o, v, d = self._query_slots
        if ws.generation != self._generation:
            ws.launches = {}
        for limit, fn, unroll, most_blocks in self._query_kernels(out_type):
            launch = kernels.Launch(fn, self._query_signature)
            for i, value in fixed.items():
                launch.set(i, value)
            cells = launch.values
            tick = cells[self._tick_slot] if self._tick_slot >= 0 else None
            launches.append((limit, launch, unroll * (32 // self._group),
                             (cells[k], cells[c], cells[o], cells[v], cells[d], tick),
                             most_blocks))
        ws.launches[out_type] = launches
        ws.generation = self._generation
        return launches

    def _enqueue(self, keys_ptr: int, n: int, out_ptr: int, default: float,
                 ws: QueryWorkspace, stream_ptr: int, out_type: int = OUT_FLOAT32) -> None:
        """Queues the query kernel writing `out_type` (the lock held, the device current,
        ws reserved)."""
        launches = ws.launches.get(out_type)
        if launches is None or ws.generation != self._generation:
            launches = self._bind_query(ws, out_type)
        chosen = launches[-1]
        for entry in launches:
            if n <= entry[0]:
                chosen = entry
                break
        _, launch, keys_per_warp, (k, c, o, v, d, tick), most_blocks = chosen
        k.value = keys_ptr
        c.value = n
        o.value = out_ptr
        v.value = self._out_dim_vec[out_type] and out_ptr % 16 == 0
        d.value = default
        if tick is not None:
            self._tick += 1
            tick.value = self._tick << RANK_BITS
        blocks = -(-n // (keys_per_warp * (BLOCK // 32)))
        if self._waves:
            blocks = min(blocks, self._sms * self._waves)
        if most_blocks:
            blocks = min(blocks, most_blocks)
        launch.go(blocks, BLOCK, stream_ptr)

    def query_ptr(self, keys_ptr: int, n: int, out_ptr: int, default_value: float,
                  ws: QueryWorkspace, stream_ptr: int, out_type: int = OUT_FLOAT32) -> int:
        """The query on raw pointers: keys int64 [n] and out [n, dim] of output type
        `out_type` (float32, or the table's own 16-bit storage type: see
        hps/rows/gpu_layout.py, not checked here), both C-contiguous on this table's device
        (current), on stream `stream_ptr`. Writes the rows of held keys and
        `default_value` into the others; returns the miss count, the misses being in `ws`
        (ws.misses(count)) until its next query. Waits on the host for the miss count
        only."""
        if n == 0:
            return 0
        if n > ws.capacity:
            ws.reserve(n)
        ws.wait_released(stream_ptr)
        host_count = ws.host_count
        host_count[0] = _NO_COUNT  # the query kernel's last block overwrites it
        event = ws.event_ptr
        rt = self._rt
        with self._lock:
            if self._closed:
                self._check_open()
            if self._write_event is not None:
                self._wait_for_writes(stream_ptr)
            self._enqueue(keys_ptr, n, out_ptr, default_value, ws, stream_ptr, out_type)
            # kept on the lookup path although the spin below does not need it: without
            # it the HugeCTR profile's mean went from 82-87 to 127-172 µs in the same run
            # (our reading: the driver defers submitting a launch queued behind busy work
            # until the next driver call, and a host spinning on memory makes none)
            rt.eventRecord(event, stream_ptr)
            self._inflight[event] = stream_ptr
        try:
            overlap.run_task()  # the caller's host work, while the kernel runs
            # the count lands (after a system-scope fence: the missed keys are in host
            # memory too, and no block reads the table any more) before the kernel
            # retires and its event completes; long kernels end in the event wait
            count = int(wait_while(ws.host_ptr, _NO_COUNT, _SPINS))
            if count == _NO_COUNT:
                rt.eventSynchronize(event)
                count = int(host_count[0])
        finally:
            self._inflight.pop(event, None)
        return count

    def out_type(self, out: Any) -> int:
        """The output type (row_format.OUTPUT_CODES) of a CuPy output checked by
        hps/intake/keys.py device_output_view for this table's storage: float32, float16 or
        uint16 (the bit patterns of bfloat16, which CuPy lacks)."""
        if out.dtype == np.float32:
            return OUT_FLOAT32
        return OUTPUT_CODES[self.storage.name]

    def query_misses(self, keys: Any, out: Any, default_value: float = 0.0,
                     workspace: QueryWorkspace | None = None) -> Misses:
        """Writes the rows of held keys into `out` (device, [n, dim], C-contiguous; float32
        widens compact rows, a 16-bit output of the storage's own type copies them:
        float16, or uint16 holding bfloat16) and `default_value` into the rows of the others,
        on the caller's current stream. Raises OutputBufferError for other outputs.

        Returns the misses as views into `workspace` (this thread's by default), valid
        until the workspace's next query. Waits on the host only for the miss count.
        """
        keys = self._device_keys(keys)
        device_output_view(out, int(keys.shape[0]), self.dim, self.device_id, self.storage)
        ws = workspace if workspace is not None else self.workspace()
        with self._device:
            return self.query_checked(keys, out, float(default_value), ws)

    def query_checked(self, keys: Any, out: Any, default_value: float,
                      ws: QueryWorkspace) -> Misses:
        """query_misses for arguments already checked, with this table's device current."""
        n = int(keys.shape[0])
        count = self.query_ptr(int(keys.data.ptr), n, int(out.data.ptr), default_value, ws,
                               self._cp.cuda.get_current_stream().ptr, self.out_type(out))
        return ws.misses(count)

    def enqueue_query(self, keys: Any, n: int, out: Any, default_value: float,
                      ws: QueryWorkspace, stream_ptr: int) -> None:
        """Queues the query kernel on the stream, nothing else (the benchmark times
        this). Call with the lock held and the device current."""
        ws.reserve(n)
        self._enqueue(int(keys.data.ptr), n, int(out.data.ptr), default_value, ws, stream_ptr,
                      self.out_type(out))

    def query(self, keys: Any, out: Any, default_value: float = 0.0) -> tuple[Any, int]:
        """(miss_positions, miss_count): positions (cupy int32, in no particular order) of
        the keys not held; their rows of `out` get `default_value`. See query_misses."""
        ws = self.workspace()
        misses = self.query_misses(keys, out, default_value, ws)
        with self._device:
            positions = misses.positions.copy()
            ws.release(self._cp.cuda.get_current_stream().ptr)
        return positions, misses.count

    # -- reads on the table's stream ------------------------------------------------------

    def _dump_args(self, start: int, stop: int, count: Any, out: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def update(self, keys: Any, vectors: Any) -> int:
        """Overwrites the rows of the keys held (others are skipped); a cache's LRU order
        is left as it was. Returns how many keys were held. Keys should be unique."""
        keys = self._device_keys(keys)
        n = int(keys.shape[0])
        vectors = self._device_rows(vectors, n)
        if n == 0:
            return 0
        cp = self._cp
        with self._writing(keys, vectors):
            updated = cp.zeros(1, dtype=np.int32)
            self._kernel(self._update_kernel)(
                (kernels.grid(self.device_id, n * self._group, BLOCK),), (BLOCK,),
                self._update_args(keys, n, vectors, updated),
            )
        return int(updated.get(stream=self._stream)[0])

    def _update_args(self, keys: Any, n: int, vectors: Any, updated: Any) -> tuple[Any, ...]:
        """The update kernel's arguments: the rows of the n keys held among `keys` become
        `vectors`; `updated` counts them."""
        return (keys, np.int64(n), vectors, self._vec4(vectors), self._keys, self._vecs,
                np.uint32(self.num_sets), self._flags, updated)

    def dump(self, start_set: int, stop_set: int) -> Any:
        """Keys held in sets (buckets) [start_set, stop_set), as a cupy int64 array in no
        particular order. Ordered after every write before it."""
        start, stop = int(start_set), min(int(stop_set), self.num_sets)
        if not 0 <= start <= self.num_sets:
            raise LookupInputError(f"start_set must be in [0, {self.num_sets}], got {start_set}")
        cp = self._cp
        with self._device:
            out = cp.empty(max(stop - start, 0) * SET_SIZE + 1, dtype=np.int64)
        if stop <= start:
            return out[:0]
        with self._on_table_stream():
            count = cp.zeros(1, dtype=np.int32)
            self._kernel(self._dump_kernel)(
                (kernels.grid(self.device_id, (stop - start) * SET_SIZE, BLOCK),), (BLOCK,),
                self._dump_args(start, stop, count, out),
            )
        held = int(count.get(stream=self._stream)[0])
        return out[:held]

    def settle(self) -> None:
        """Waits for the writes queued on the table's stream and drops the inputs they
        kept alive (a write holds its input arrays until it is done, released at a later
        write): after a warm-up, its last chunk does not stay on the device."""
        with self._lock:
            self._check_open()
            self._stream.synchronize()
            self._retire.clear()

    def size(self) -> int:
        """Keys held."""
        with self._lock:
            self._check_open()
            with self._device:
                return int(self._flags[1:2].get(stream=self._stream)[0])

    def memory_bytes(self) -> int:
        """Device memory the table holds."""
        return self._memory_bytes()

    def memory_stats(self) -> dict[str, Any]:
        """What the table holds where: `memory_bytes` (device) and, for tables that keep
        rows elsewhere, their own figures (see UvmEmbeddingTable.memory_stats)."""
        return {"memory_bytes": self._memory_bytes()}

    def close(self) -> None:
        """Waits for work in flight and frees the device memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with self._device:
                for ev_ptr in tuple(self._inflight):
                    self._rt.eventSynchronize(ev_ptr)
                self._stream.synchronize()
            self._retire.clear()
            self._write_event = None
            self._keys = self._vecs = None
            self._free_extra()

    def _free_extra(self) -> None:
        pass

    def __enter__(self) -> DeviceTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
