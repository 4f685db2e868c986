"""What the GPU tables share: device memory, streams, query workspaces and kernel launches.

`DeviceTable` holds one table's slots on one device (keys int64 [num_sets * SET_SIZE], rows in the
table's storage type (float32 padded to float4, float16, bfloat16 or int8 rows:
hps/rows/gpu_layout.py), a few int32 flags), its own stream, the per-thread query workspaces
(hps/gpu/workspace.py), and the launches of the query, update and dump kernels (their shape:
hps/gpu/launch_shape.py). Rows come in as float32 and are encoded on the device; a query writes
float32 or, from 16-bit storage, that same 16-bit type (its output type, picked per call). The
tables built on it (`EmbeddingCache` in dynamic_cache.py, `StaticEmbeddingTable` in
static_table.py, `UvmEmbeddingTable` in uvm_table.py) say which kernels and which arguments; this
module says where the memory lives and how work is ordered.

Streams: queries run on the caller's current CuPy stream, so they overlap with the caller's own
work and with each other; the only host wait of a query is the read of its miss count. Inserts,
updates and removes run on the table's own stream. The two are ordered with CUDA events: a write
waits for the queries in flight and for the caller's stream (whose arrays it reads); a query waits
for the writes before it. No device-wide synchronize is ever used. All methods are thread-safe.

Keys and outputs are checked by hps/intake/keys.py (`key_view`, `device_output_view`), keys and
rows brought to the device by hps/gpu/device_arrays.py; the methods here that take raw pointers
(`query_ptr`, `insert_staged`) or set codes (`insert_by_set`) take arguments already checked.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.errors import DeviceError, LookupInputError
from hps.gpu import fast_query, kernels, overlap
from hps.gpu.device_arrays import device_keys, device_rows
from hps.gpu.host_updates import HostRowUpdates
from hps.gpu.kernels import EMPTY_KEY, RANK_BITS, SET_SIZE
from hps.gpu.launch_shape import BLOCK, PIPELINED_AFTER, PIPELINED_ROW_BYTES, default_hints
from hps.gpu.shared_cache import SharedParts
from hps.gpu.streams import stream_key
from hps.gpu.workspace import QueryWorkspace
from hps.gpu.write_order import WriteOrder
from hps.intake.keys import device_output_view
from hps.rows.gpu_layout import (
    OUT_FLOAT32,
    OUTPUT_CODES,
    STORAGE_CODES,
    row_unit_bytes,
    stored_row_bytes,
    table_storage,
)
from hps.rows.storage_types import FLOAT32, StorageType, decode
from hps.runtime.raw_memory import wait_while, wait_while_held

if TYPE_CHECKING:
    from hps.gpu.shared_cache import SharedTableRecord

# The miss count's place holds this until the query kernel writes the count; the host reads
# it this many times (GIL released, well under a millisecond), then waits on the query's event.
_NO_COUNT = -1
_SPINS = 1 << 16
# A query of at most _HELD_SPIN_KEYS keys ends within tens of µs: its caller reads the
# count with the GIL kept (at most _SPINS reads, ~0.1 ms). Released there, the GIL went to
# another caller thread, and the spin's end then waited for that thread's next release
# (a futex wake each time). 8 threads on their own streams, 2,000 power-law keys, H100,
# `hps bench gpu --profile threads`, same run: 14.2 -> 34.4 M keys/s, p99 12,247 ->
# 250 µs. Keeping it only while another thread's query was in flight (a lone caller
# unchanged) measured far worse tails at 8 threads (p99 3.2-6.2 ms against 0.08-0.16 ms
# with the GIL always kept, two runs). Larger queries spin with the GIL released; a count
# still missing after the spin is waited for on the query's event.
_HELD_SPIN_KEYS = fast_query.HELD_KEYS


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


class DeviceTable(WriteOrder, HostRowUpdates, SharedParts):
    """What the dynamic cache and the static table share: memory, streams, ordering,
    argument checks, the query launch, dump and stats. Not used directly."""

    #: whether small queries may take the fast path (hps/gpu/fast_query.py): the uvm table,
    #: whose moves follow its queries by their events, keeps every query on the locked path
    _fast_queries = True

    _kind = "table"
    _source = ""
    _query_kernel = ""
    _query_signature = ""
    _dump_kernel = ""
    _update_kernel = ""

    def __init__(self, dim: int, device_id: int, num_sets: int, *, group: int, unroll: int,
                 special_flags: int, storage: str | StorageType = FLOAT32,
                 shared: SharedTableRecord | None = None) -> None:
        self.storage = table_storage(storage)
        # a table every process of the host shares (hps/gpu/shared_cache.py): its memory
        # mapped from the owner's, unless this process is the owner; its gate in the record
        self._shared = shared
        self._fresh = shared is None or shared.owner  # memory this process must initialize
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
        # the fast path's gate and the dynamic cache's LRU tick (hps/gpu/fast_query.py)
        self._gate: Any = fast_query.FastGate() if shared is None else shared.gate
        if shared is not None:
            shared.gate.recover = self._empty
        self._fast = fast_query.compiled() if self._fast_queries else None
        # queries in flight: their workspace's event (recorded after the query) → its
        # stream's key (hps/gpu/streams.py: queries come from every device's streams)
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
            if self._fresh:
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
            mem = (cp.cuda.memory.Memory(max(nbytes, 1)) if self._shared is None
                   else self._shared.memory(cp, nbytes))
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
        if self._fresh:
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
            self._gate.close()  # fast queries take the locked path, which rebinds them
            self._group, self._unroll, self._waves, self._hints = group, unroll, waves, hints
            self._defines = {**self._defines, "GROUP": group, "UNROLL": unroll,
                             "HINTS": hints}
            self._fn = {}
            self._generation += 1
            self._gate.write_queued(self._rt, 0)  # a shared gate: nothing written, reopen

    def _kernel(self, name: str, out_type: int = OUT_FLOAT32, device: int | None = None
                ) -> Any:
        """Kernel `name` of the table's source for its defines and, for queries, output
        type `out_type`; of its device, or of a peer `device` that reaches its memory."""
        device = self.device_id if device is None else device
        fn = self._fn.get((name, out_type, device))
        if fn is None:
            fn = kernels.function(self._source, name, device,
                                  **self._out_defines(self._defines, out_type))
            self._fn[(name, out_type, device)] = fn
        return fn

    @staticmethod
    def _out_defines(defines: dict[str, int], out_type: int) -> dict[str, int]:
        """`defines` for queries writing `out_type` (float32 adds nothing: one module)."""
        return defines if out_type == OUT_FLOAT32 else {**defines, "OUT_TYPE": out_type}

    # -- argument checks ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DeviceError(f"the {self._kind} on device {self.device_id} is closed")

    def _device_keys(self, keys: Any) -> Any:
        """int64 1-D keys on this device (hps/gpu/device_arrays.py device_keys)."""
        return device_keys(self._cp, keys, self._device, self.device_id)

    def _device_rows(self, vectors: Any, n: int) -> Any:
        """float32 [n, dim] C-contiguous rows on this device that its storage holds
        (hps/gpu/device_arrays.py device_rows)."""
        return device_rows(self._cp, vectors, n, self.dim, self._device, self.device_id,
                           self.storage, self._kind)

    def _vec4(self, array: Any) -> np.int32:
        return np.int32(self.dim % 4 == 0 and array.data.ptr % 16 == 0)

    @property
    def stream(self) -> Any:
        """The table's own CuPy stream, where its writes run."""
        return self._stream

    # -- queries --------------------------------------------------------------------------

    def workspace(self) -> QueryWorkspace:
        """This thread's query workspace for this table."""
        ws: QueryWorkspace | None = getattr(self._tls, "ws", None)
        if ws is None:
            ws = QueryWorkspace(self._cp, self.device_id)
            self._tls.ws = ws
        return ws

    def bind(self, ws: QueryWorkspace) -> None:
        """Binds the float32 query launches to `ws` before its first query (a spare's)."""
        with self._device:
            self._bind_query(ws, OUT_FLOAT32)

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
                 ws: QueryWorkspace, stream_ptr: int, out_type: int, event_ptr: int) -> None:
        """Queues the query kernel writing `out_type`, then records `event_ptr` after it
        (the lock held, the device current, ws reserved)."""
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
            tick.value = self._gate.next_tick() << RANK_BITS
        blocks = -(-n // (keys_per_warp * (BLOCK // 32)))
        caps = [cap for cap in (self._sms * self._waves, most_blocks) if cap]
        if caps:
            blocks = min(blocks, *caps)
        launch.go_recorded(blocks, BLOCK, stream_ptr, event_ptr)
        if chosen is launches[0] and self._fast is not None:  # the fast path's launch
            known = ws.fast.get(out_type)
            if (known is None or known.generation != self._generation
                    or known.default != default) and launch.function_address is not None:
                ws.fast[out_type] = fast_query.bind(
                    self._gate, launch, chosen[3], chosen[0], keys_per_warp * (BLOCK // 32),
                    min(caps, default=0), self._out_dim_vec[out_type], ws, BLOCK, _SPINS,
                    RANK_BITS, self._generation, default,
                    self._cp.cuda.driver.ctxGetCurrent())

    def query(self, keys: Any, out: Any, default_value: float = 0.0) -> tuple[Any, int]:
        """Writes the rows of held keys into `out` (device, [n, dim], C-contiguous; float32
        widens compact rows, a 16-bit output of the storage's own type copies them:
        float16, or uint16 holding bfloat16) and `default_value` into the rows of the
        others, on the caller's current stream. Returns (miss_positions, miss_count): the
        positions (cupy int32, in no particular order) of the keys not held. Raises
        KeyTypeError, OutputBufferError or DeviceError for arguments hps/intake/keys.py
        refuses. Waits on the host only for the miss count."""
        keys = self._device_keys(keys)
        n = int(keys.shape[0])
        device_output_view(out, n, self.dim, self.device_id, self.storage)
        ws = self.workspace()
        with self._device:
            stream = self._cp.cuda.get_current_stream().ptr
            count = self.query_ptr(int(keys.data.ptr), n, int(out.data.ptr),
                                   float(default_value), ws, stream, self.out_type(out))
            ws.reserve(max(count, 1))
            positions = ws.positions[:count].copy()
            ws.release(stream)
        return positions, count

    # The lookup path's query (hps/gpu/table.py): it skips query()'s checks of the keys
    # and the output (hps/intake/keys.py read them once for the whole lookup), the device
    # switch and the copy of the miss positions (the miss path reads them in `ws`), and
    # waits on the host for the miss count alone. H100, 2,000 held keys at dim 64, p50 of
    # the call, five rounds taking turns in one process: static table 15.4-15.8 µs against
    # query()'s 25.5-26.5, dynamic cache 13.3-14.1 against 23.6-28.0.
    def query_ptr(self, keys_ptr: int, n: int, out_ptr: int, default_value: float,
                  ws: QueryWorkspace, stream_ptr: int, out_type: int = OUT_FLOAT32) -> int:
        """query() on raw pointers: keys int64 [n] and out [n, dim] of output type
        `out_type` (float32, or the table's own 16-bit storage type: see
        hps/rows/gpu_layout.py, not checked here), both C-contiguous on this table's device
        (current), on stream `stream_ptr`. Writes the rows of held keys and
        `default_value` into the others; returns the miss count, the misses being in `ws`
        (positions on the device, keys in host memory) until its next query."""
        if n == 0:
            return 0
        count = self.fast_query(keys_ptr, n, out_ptr, default_value, ws, stream_ptr, out_type)
        if count != fast_query.FALLBACK:
            return count
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
            if self._write_event is None and self._fast is not None:
                self._gate.open()  # no write pending: fast queries may run again
            if self._shared is not None:
                self._gate.enter()  # counted among the host's queries (shared_gate.py)
            # the event recorded after the kernel is kept on the lookup path although the
            # spin below does not need it: without it the HugeCTR profile's mean went from
            # 82-87 to 127-172 µs in the same run (our reading: the driver defers
            # submitting a launch queued behind busy work until the next driver call, and
            # a host spinning on memory makes none)
            try:
                self._enqueue(keys_ptr, n, out_ptr, default_value, ws, stream_ptr, out_type,
                              event)
            except BaseException:
                if self._shared is not None:
                    self._gate.leave_locked()
                raise
            self._inflight[event] = stream_key(stream_ptr, self.device_id)
        try:
            overlap.run_task()  # the caller's host work, while the kernel runs
            # the count lands (after a system-scope fence: the missed keys are in host
            # memory too, and no block reads the table any more) before the kernel
            # retires and its event completes; long kernels end in the event wait
            spin = wait_while_held if n <= _HELD_SPIN_KEYS else wait_while
            count = int(spin(ws.host_ptr, _NO_COUNT, _SPINS))
            if count == _NO_COUNT:
                rt.eventSynchronize(event)
                count = int(host_count[0])
        finally:
            self._inflight.pop(event, None)
            if self._shared is not None:
                self._gate.leave_locked()
        return count

    def fast_query(self, keys_ptr: int, n: int, out_ptr: int, default_value: float,
                   ws: QueryWorkspace, stream_ptr: int, out_type: int = OUT_FLOAT32) -> int:
        """query_ptr()'s fast path (hps/gpu/fast_query.py): the miss count, or
        fast_query.FALLBACK (nothing queued) where the locked path must serve it. Needs no
        current device: the fast path checks the context. The locked path binds the fast
        launch of a workspace and output type on its first query of them."""
        fast, calls = ws.fast.get(out_type), self._fast
        if (fast is None or calls is None or n > fast.limit or n == 0
                or fast.generation != self._generation or fast.default != default_value
                or ws.pending or self._gate.words[fast_query.CLOSED] or self._closed):
            return fast_query.FALLBACK  # (a closed gate: a write pending, read first here)
        return fast_query.run(calls, fast, keys_ptr, n, out_ptr, stream_ptr, ws, self._gate)

    def out_type(self, out: Any) -> int:
        """The output type (hps/rows/gpu_layout.py OUTPUT_CODES) of a CuPy output checked
        by hps/intake/keys.py device_output_view for this table's storage: float32,
        float16 or uint16 (the bit patterns of bfloat16, which CuPy lacks)."""
        if out.dtype == np.float32:
            return OUT_FLOAT32
        return OUTPUT_CODES[self.storage.name]

    # -- reads on the table's stream ------------------------------------------------------

    def _dump_args(self, start: int, stop: int, count: Any, out: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def update(self, keys: Any, vectors: Any) -> int:
        """Overwrites the rows of the keys held (others are skipped); a cache's LRU order
        is left as it was. Returns how many keys were held. Keys should be unique."""
        if isinstance(keys, np.ndarray) and isinstance(vectors, np.ndarray):
            return self._update_host(keys, vectors)  # online updates: host_updates.py
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
        shared = self._shared  # and who uses it: this process, or the host's (shared_cache.py)
        return {"memory_bytes": self._memory_bytes(), "scope": "host" if shared else "process",
                "processes": len(shared.attached()) if shared else 1}

    def close(self) -> None:
        """Waits for work in flight and frees the device memory (a shared table: this
        process's mappings; the owner's memory once no process is attached). Idempotent."""
        if self._shared is not None:
            self._close_shared()
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._gate.close()  # for good: the locked path raises from now on
            self._finish_work()
            self._keys = self._vecs = None
            self._free_extra()

    def _finish_work(self) -> None:
        """Waits for this process's queries in flight and the table's writes, and drops
        the inputs the writes kept alive (the lock held, the table marked closed)."""
        with self._device:
            for ev_ptr in tuple(self._inflight):
                self._rt.eventSynchronize(ev_ptr)
            self._stream.synchronize()
        self._retire.clear()
        self._write_event = None

    def _free_extra(self) -> None:
        pass

    def __enter__(self) -> DeviceTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
