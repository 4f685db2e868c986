"""What the GPU caches share: device memory, streams, query workspaces and kernel launches.

`DeviceTable` holds one table's slots on one device (keys int64 [num_sets * SET_SIZE],
rows float32 padded to float4, a few int32 flags), its own stream, the per-thread query
workspaces, and the launches of the query, update and dump kernels. The policies built
on it (`EmbeddingCache` in cache.py, `StaticEmbeddingTable` in static_table.py) say which
kernels and which arguments; this module says where the memory lives and how work is
ordered.

Streams: queries run on the caller's current CuPy stream, so they overlap with the
caller's own work and with each other; the only host wait of a query is the read of its
miss count. Inserts, updates and removes run on the table's own stream. The two are
ordered with CUDA events: a write waits for the queries in flight and for the caller's
stream (whose arrays it reads); a query waits for the writes before it. No device-wide
synchronize is ever used. All methods are thread-safe.

Keys and outputs are checked by hps/keys.py (`key_view`, `device_output_view`); the
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
from hps.gpu import kernels
from hps.gpu.kernels import EMPTY_KEY, SET_SIZE
from hps.keys import as_key_array, device_output_view, key_view

BLOCK = 256
_MAPPED_PINNED = 3  # cudaHostAllocPortable | cudaHostAllocMapped


def _is_cupy(array: Any) -> bool:
    return type(array).__module__.startswith("cupy")


def default_group(dim: int) -> int:
    """Lanes that serve one key (measured on an H100, hps/bench/gpu.py --sweep)."""
    return 2 if dim <= 32 else 8


def default_unroll(dim: int) -> int:
    """Keys a lane group has in flight at once (measured likewise)."""
    return 2


def row_floats(dim: int) -> int:
    """Floats per stored row: rows are padded to whole float4 (16 bytes)."""
    return -(-dim // 4) * 4


@dataclass
class Misses:
    """The misses of one query: `count` positions into the batch and their keys (device)."""

    positions: Any  # cupy int32 [count]
    keys: Any  # cupy int64 [count]
    count: int


class QueryWorkspace:
    """Reusable buffers of one thread's queries: miss lists, the kernels' counters
    (ctl: miss count, blocks done; reset by each query kernel itself) and the miss
    count's landing place in mapped pinned host memory.

    One per thread (they are reused by every query of that thread). `release(stream)`
    marks that work still queued on `stream` reads the miss lists; the next query waits
    for it before it overwrites them.
    """

    def __init__(self, cupy: Any, device_id: int) -> None:
        self._cp = cupy
        rt = cupy.cuda.runtime
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            self.ctl = cupy.zeros(2, dtype=np.int32)
            cupy.cuda.get_current_stream().synchronize()
            self.event = cupy.cuda.Event(block=False, disable_timing=True)
            self._released = cupy.cuda.Event(block=False, disable_timing=True)
            # mapped pinned memory: with unified addressing the kernel writes it directly
            self.host_ptr = int(rt.hostAlloc(8, _MAPPED_PINNED))
        weakref.finalize(self, rt.freeHost, self.host_ptr).atexit = False
        self.host_count = np.ctypeslib.as_array((ctypes.c_int32 * 2).from_address(self.host_ptr))
        self.host_count[:] = 0
        self.ctl_ptr = int(self.ctl.data.ptr)
        self.event_ptr = int(self.event.ptr)
        self._pending = False
        self.capacity = 0
        self.positions: Any = None
        self.keys: Any = None
        self.positions_ptr = 0
        self.keys_ptr = 0
        self._none: Misses | None = None

    def reserve(self, n: int) -> None:
        if n > self.capacity:
            if self._pending:  # queued work may still read the buffers about to be freed
                self._released.synchronize()
                self._pending = False
            cap = max(n, 2 * self.capacity, 1024)
            self.positions = self._cp.empty(cap, dtype=np.int32)
            self.keys = self._cp.empty(cap, dtype=np.int64)
            self.positions_ptr = int(self.positions.data.ptr)
            self.keys_ptr = int(self.keys.data.ptr)
            self.capacity = cap
            self._none = None

    def no_misses(self) -> Misses:
        """The (shared, empty) result of a query that missed nothing."""
        if self._none is None:
            self.reserve(1)
            self._none = Misses(self.positions[:0], self.keys[:0], 0)
        return self._none

    def release(self, stream: Any) -> None:
        """Work queued on `stream` still reads the miss lists."""
        self._released.record(stream)
        self._pending = True

    def wait_released(self, stream_ptr: int) -> None:
        if self._pending:
            self._cp.cuda.runtime.streamWaitEvent(stream_ptr, self._released.ptr, 0)
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
                 special_flags: int) -> None:
        cp = kernels.cupy_module()
        self._cp = cp
        self.dim = int(dim)
        self.device_id = int(device_id)
        self.num_sets = int(num_sets)
        self.num_slots = self.num_sets * SET_SIZE
        self._row = row_floats(self.dim)
        self._dim4 = self.dim % 4 == 0  # rows may use float4 stores where 16-byte aligned
        self._group = group
        self._unroll = unroll
        self._waves = 0
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._tick = 0
        self._inflight: set[int] = set()
        self._write_event: Any = None
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
                         "HINTS": 0}
        with self._device:
            self._stream = cp.cuda.Stream(non_blocking=True)
            self._check_room(self._memory_bytes())
            self._keys = self._alloc((self.num_slots,), np.int64)
            self._vecs = self._alloc((self.num_slots + 1, self._row), np.float32)
            self._flags = self._alloc((special_flags,), np.int32)
            with self._stream:
                self._keys.fill(EMPTY_KEY)
                self._vecs.fill(0)
                self._flags.fill(0)
            self._stream.synchronize()
        self._fn: dict[str, Any] = {}
        self._launcher: kernels.Launch | None = None
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

    def set_launch(self, group: int, unroll: int, waves: int = 0, hints: int = 0) -> None:
        """Kernel launch shape: lanes per key (a power of two dividing SET_SIZE), keys
        per lane group in flight, the grid cap in blocks per SM (0: no cap), streaming
        cache hints (1) or not (0). The layout is unchanged; this is for tuning
        (hps/bench/gpu.py)."""
        if group not in (1, 2, 4, 8) or SET_SIZE % group or unroll not in (1, 2, 4):
            raise LookupInputError(f"unsupported launch shape group={group} unroll={unroll}")
        with self._lock:
            self._group, self._unroll, self._waves = group, unroll, waves
            self._defines = {**self._defines, "GROUP": group, "UNROLL": unroll,
                             "HINTS": hints}
            self._fn = {}
            self._launcher = None

    def _kernel(self, name: str) -> Any:
        fn = self._fn.get(name)
        if fn is None:
            fn = kernels.function(self._source, name, self.device_id, **self._defines)
            self._fn[name] = fn
        return fn

    # -- argument checks ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DeviceError(f"the {self._kind} on device {self.device_id} is closed")

    @staticmethod
    def _host_keys(keys: np.ndarray) -> np.ndarray:
        """Host keys of any integer width and shape, widened and flattened to int64 [n]
        (checked by hps/keys.py)."""
        return key_view(as_key_array(keys))  # type: ignore[no-any-return]

    def _device_keys(self, keys: Any) -> Any:
        """int64 1-D keys on this device, checked by hps/keys.py (host arrays: see
        _host_keys, then copied over)."""
        if isinstance(keys, np.ndarray):
            host = self._host_keys(keys)
            with self._device:
                return self._cp.asarray(host)
        return key_view(keys, self.device_id)

    def _device_rows(self, vectors: Any, n: int) -> Any:
        """float32 [n, dim] C-contiguous rows on this device (host arrays copied over)."""
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
        ev = self._write_event
        if ev is not None:
            if ev.done:
                self._write_event = None
            else:
                self._cp.cuda.runtime.streamWaitEvent(stream_ptr, ev.ptr, 0)

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
            for ev_ptr in self._inflight:
                cp.cuda.runtime.streamWaitEvent(self._stream.ptr, ev_ptr, 0)
            yield
            done = cp.cuda.Event(block=False, disable_timing=True)
            done.record(self._stream)
            self._write_event = done
            self._retire.append((done, refs))
            while self._retire and self._retire[0][0].done:
                self._retire.popleft()

    # -- queries --------------------------------------------------------------------------

    def workspace(self) -> QueryWorkspace:
        """This thread's query workspace for this table."""
        ws: QueryWorkspace | None = getattr(self._tls, "ws", None)
        if ws is None:
            ws = QueryWorkspace(self._cp, self.device_id)
            self._tls.ws = ws
        return ws

    def _query_args(self, keys: Any, n: int, out: Any, ws: QueryWorkspace,
                    default: float) -> tuple[float, ...]:
        raise NotImplementedError



    def query_misses(self, keys: Any, out: Any, default_value: float = 0.0,
                     workspace: QueryWorkspace | None = None) -> Misses:
        """Writes the rows of held keys into `out` (device, float32 [n, dim], C-contiguous)
        and `default_value` into the rows of the others, on the caller's current stream.

        Returns the misses as views into `workspace` (this thread's by default), valid
        until the workspace's next query. Waits on the host only for the miss count.
        """
        keys = self._device_keys(keys)
        device_output_view(out, int(keys.shape[0]), self.dim, self.device_id)
        ws = workspace if workspace is not None else self.workspace()
        with self._device:
            return self.query_checked(keys, out, float(default_value), ws)

    def query_checked(self, keys: Any, out: Any, default_value: float,
                      ws: QueryWorkspace) -> Misses:
        """query_misses for arguments already checked, with this table's device current."""
        n = int(keys.shape[0])
        if n == 0:
            return ws.no_misses()
        rt = self._cp.cuda.runtime
        sptr = self._cp.cuda.get_current_stream().ptr
        ws.reserve(n)
        ws.wait_released(sptr)
        with self._lock:
            self._check_open()
            self._wait_for_writes(sptr)
            self.enqueue_query(keys, n, out, default_value, ws, sptr)
            rt.eventRecord(ws.event_ptr, sptr)
            self._inflight.add(ws.event_ptr)
        try:
            rt.eventSynchronize(ws.event_ptr)
        finally:
            with self._lock:
                self._inflight.discard(ws.event_ptr)
        count = int(ws.host_count[0])
        if count == 0:
            return ws.no_misses()
        return Misses(ws.positions[:count], ws.keys[:count], count)

    def enqueue_query(self, keys: Any, n: int, out: Any, default_value: float,
                      ws: QueryWorkspace, stream_ptr: int) -> None:
        """Queues the query kernel on the stream, nothing else (the benchmark times
        this). Call with the lock held and the device current."""
        launch, unroll = self._query_launch(n)
        threads = -(-n // (unroll * (32 // self._group))) * 32
        launch(kernels.grid(self.device_id, threads, BLOCK, self._waves), BLOCK, stream_ptr,
               *self._query_args(keys, n, out, ws, default_value))

    def _query_launch(self, n: int) -> tuple[kernels.Launch, int]:
        """The query kernel for a batch of n keys and its keys per lane group."""
        launch = self._launcher
        if launch is None:
            launch = kernels.Launch(self._kernel(self._query_kernel), self._query_signature)
            self._launcher = launch
        return launch, self._unroll

    def query(self, keys: Any, out: Any, default_value: float = 0.0) -> tuple[Any, int]:
        """(miss_positions, miss_count): positions (cupy int32, in no particular order) of
        the keys not held; their rows of `out` get `default_value`. See query_misses."""
        ws = self.workspace()
        misses = self.query_misses(keys, out, default_value, ws)
        with self._device:
            positions = misses.positions.copy()
            ws.release(self._cp.cuda.get_current_stream())
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
                (keys, np.int64(n), vectors, self._vec4(vectors), self._keys, self._vecs,
                 np.uint32(self.num_sets), self._flags, updated),
            )
        return int(updated.get(stream=self._stream)[0])

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

    def size(self) -> int:
        """Keys held."""
        with self._lock:
            self._check_open()
            with self._device:
                return int(self._flags[1:2].get(stream=self._stream)[0])

    def memory_bytes(self) -> int:
        """Device memory the table holds."""
        return self._memory_bytes()

    def close(self) -> None:
        """Waits for work in flight and frees the device memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with self._device:
                for ev_ptr in list(self._inflight):
                    self._cp.cuda.runtime.eventSynchronize(ev_ptr)
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
