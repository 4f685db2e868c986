"""One thread's query buffers of one GPU table: where a query's misses land.

`QueryWorkspace` holds what a query writes besides the caller's output: the misses'
positions in the batch (device), the missed keys (mapped pinned host memory the query
kernel writes directly, so the miss path reads them with no copy), the kernels' counters
and the miss count's landing place, the query launches bound to these buffers
(hps/gpu/device_table.py binds them) and the events that order this thread's queries and
writes. A table keeps one per thread (`DeviceTable.workspace`, for its own `query`; the
lookup path's ThreadStates hold theirs); the lookup path's miss handling
(hps/gpu/table.py) reads the misses from it until the thread's next query.
`ThreadState` is all one thread's lookups of one table keep: the workspace, the miss
staging and scratch buffers (hps/gpu/staging.py) and the thread's counters. `SpareStates`
holds a few built at load for the first threads that look up: a thread's first lookup
otherwise pays the workspace's pinned allocations and its buffers (H100, HugeCTR's
profile: 0.8-0.9 ms for that first call against ~0.1 ms for the next ones), which a
replica warmed from a peer would pay in its first lookups.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.gpu import kernels

if TYPE_CHECKING:
    from hps.gpu.staging import MissStaging, Scratch

_MAPPED_PINNED = 3  # cudaHostAllocPortable | cudaHostAllocMapped
#: ThreadStates a GPU table builds at load for its first lookup threads (a server's
#: lookup threads, a caller's few): more threads build their own on their first call
SPARE_STATES = 4
#: the keys a spare's workspace is reserved for (a larger lookup grows it, as any does)
SPARE_RESERVE = 1 << 12


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
        self.pending = False
        self._released_ptr = 0
        self._held = kernels.held_calls()  # the record and the wait keep the GIL
        self.capacity = 0
        self.positions: Any = None
        self.host_keys: np.ndarray = np.empty(0, np.int64)
        self.positions_ptr = 0
        self.keys_ptr = 0
        self._keys_finalizer: Any = None
        # the query launches bound to these buffers (see DeviceTable._bind_query),
        # by output type (hps/rows/gpu_layout.py OUTPUT_CODES)
        self.launches: dict[int, list[tuple[int, kernels.Launch, int, Any, int]]] = {}
        # the fast path's launches (hps/gpu/fast_query.py), bound by the locked path, by
        # output type
        self.fast: dict[int, Any] = {}
        self.generation = -1
        self.insert_launch: kernels.Launch | None = None
        self.insert_cells: list[Any] | None = None
        self.scatter_launch: kernels.Launch | None = None
        self.scatter_cells: list[Any] | None = None
        self.scatter_type = 0  # the output type scatter_launch writes
        self.insert_type = 0  # the output type insert_launch scatters into
        # the table generation insert_launch is of (its own: `generation` is the query
        # launches', which a workspace that only inserts never binds)
        self.insert_generation = -1

    def reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        if self.pending:  # queued work may still read the buffers about to be freed
            self._rt.eventSynchronize(self._released_ptr)
            self.pending = False
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
        self.fast = {}

    def release(self, stream_ptr: int) -> None:
        """Work queued on the stream still reads the miss positions."""
        self._held.record(int(self._released.ptr), stream_ptr)
        self.released_by(int(self._released.ptr))

    def released_by(self, event_ptr: int) -> None:
        """Work before `event_ptr` (an event just recorded by the caller) still reads the
        miss positions."""
        self._released_ptr = event_ptr
        self.pending = True

    def wait_released(self, stream_ptr: int) -> None:
        """Orders a query on `stream_ptr` after the work that still reads the miss
        positions. Also on that work's own stream, where the order is already the
        stream's: skipping these driver calls there measured no faster, and seemingly
        slower, on the HugeCTR profile (see DeviceTable.query_ptr)."""
        if self.pending:
            self._held.wait(stream_ptr, self._released_ptr)
            self.pending = False


class ThreadState:
    """One thread's query workspace, staging, scratch and counters for one table."""

    __slots__ = ("ws", "staging", "scratch", "counts")

    def __init__(self, ws: QueryWorkspace, staging: MissStaging, scratch: Scratch,
                 counts: dict[str, int]) -> None:
        self.ws = ws
        self.staging = staging
        self.scratch = scratch
        self.counts = counts


class SpareStates:
    """`count` ThreadStates built ahead by `build(reserve)` (off the lookup path: at load),
    each handed whole to one thread by `take()` (None once all are taken). Thread-safe:
    list.pop is atomic."""

    def __init__(self, build: Callable[[int], ThreadState], count: int, reserve: int,
                 runtime: Any) -> None:
        self._rt = runtime
        self._spares = [build(reserve) for _ in range(count)]

    def clear(self) -> None:
        """Drop the spares not taken (their table closes)."""
        self._spares = []

    def hand_back(self, tls: Any) -> None:
        """The state of the calling thread (`tls.state`, a table's thread-local) back
        among the spares, its counters zeroed, for the next thread that looks up: a
        warm-up's lookups (hps/server/warm_paths.py) leave the stats to clients' and the
        buffers they built to the first lookup thread."""
        state: ThreadState | None = getattr(tls, "state", None)
        if state is None:
            return
        tls.state = tls.counts = None
        for name in state.counts:
            state.counts[name] = 0
        self._spares.append(state)

    def take(self) -> ThreadState | None:
        """A spare, with its device's context made current in the calling thread, as
        building a state there would: the lookup path launches through the driver, which
        needs one (a thread's first launch failed with CUDA_ERROR_INVALID_CONTEXT without)."""
        try:
            state = self._spares.pop()
        except IndexError:
            return None
        self._rt.setDevice(state.ws.device_id)
        return state
