"""Online updates of host rows into a device table, with little Python under the GIL.

The update consumer (hps/updates) writes the rows of each batch into every GPU cache of
the table from its own thread, while callers look up. Each stretch of Python that thread
runs is a stretch a caller waits for when it wants the GIL back (after its stream sync,
say). Through CuPy, an update of 100 host rows made two pageable copies, a fill kernel,
two events and a read-back: 620-1,270 µs of the thread's time on the H100, and the slowest
2% of a caller's lookups waited 260-510 µs in their stream sync
(scripts/probe_gpu_tails.py, HugeCTR's profile with 10,000 update rows/s).

Here the rows go through one pinned buffer per table, grown by doubling and reused: two
copies to the device made with the GIL kept (hps/gpu/kernels.py HeldCalls), the count
cleared and read back through runtime calls, the one kernel launch. The host waits for
the count with the GIL released (the stream's sync), which also frees the buffers for the
next update. The rows are checked on the host as `update` checks device rows (shape,
dtype, and what a compact storage type can hold).

    class DeviceTable(HostRowUpdates): ...
    table.update(host_keys, host_rows)   # → _update_host
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from hps.gpu import kernels
from hps.gpu.device_arrays import host_keys, host_rows
from hps.gpu.kernels import held_calls
from hps.gpu.launch_shape import BLOCK

_D2H = 2  # cudaMemcpyDeviceToHost
#: one update at a time uses a table's staging (the update consumer makes one anyway)
_STAGING_LOCK = threading.Lock()
_MIN_ROWS = 256


class _Staging:
    """Pinned host keys and rows, their device mirrors and the update's count, for up to
    `capacity` rows of width `dim`."""

    def __init__(self, cp: Any, dim: int, capacity: int) -> None:
        self.capacity = capacity
        self._pinned = cp.cuda.alloc_pinned_memory(capacity * (8 + dim * 4) + 8)
        raw = np.frombuffer(self._pinned, np.uint8)
        self.host_keys = raw[:capacity * 8].view(np.int64)
        self.host_rows = raw[capacity * 8:capacity * (8 + dim * 4)].view(
            np.float32).reshape(capacity, dim)
        self.host_count = raw[capacity * (8 + dim * 4):].view(np.int32)
        self.keys = cp.empty(capacity, np.int64)
        self.rows = cp.empty((capacity, dim), np.float32)
        self.count = cp.empty(1, np.int32)
        self.host_keys_ptr = self.host_keys.ctypes.data
        self.host_rows_ptr = self.host_rows.ctypes.data
        self.host_count_ptr = self.host_count.ctypes.data


class HostRowUpdates:
    """`_update_host` for DeviceTable (see the module docstring). Uses the table's lock,
    stream, `_writing`, `_kernel`, `_update_kernel` and `_update_args`."""

    _staging: _Staging | None = None

    def _update_host(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """`update` of host keys and rows: the rows of the keys held become `vectors`.
        Returns how many keys were held."""
        table: Any = self
        keys = host_keys(keys)
        n = int(keys.size)
        vectors = host_rows(vectors, n, table.dim, table.storage, table._kind)
        if n == 0:
            return 0
        cp = table._cp
        rt = cp.cuda.runtime
        held = held_calls()
        stream = table._stream.ptr
        with _STAGING_LOCK:
            staging = self._staging
            if staging is None or staging.capacity < n:
                with table._device:
                    staging = self._staging = _Staging(
                        cp, table.dim, max(_MIN_ROWS, 1 << (n - 1).bit_length()))
            staging.host_keys[:n] = keys
            staging.host_rows[:n] = vectors
            with table._writing():  # the table's lock, only while the work is queued
                held.copy_to_device(staging.keys.data.ptr, staging.host_keys_ptr,
                                    n * 8, stream)
                held.copy_to_device(staging.rows.data.ptr, staging.host_rows_ptr,
                                    n * table.dim * 4, stream)
                rt.memsetAsync(staging.count.data.ptr, 0, 4, stream)
                table._kernel(table._update_kernel)(
                    (kernels.grid(table.device_id, n * table._group, BLOCK),), (BLOCK,),
                    table._update_args(staging.keys[:n], n, staging.rows[:n], staging.count))
                rt.memcpyAsync(staging.host_count_ptr, staging.count.data.ptr, 4,
                               _D2H, stream)
            # the GIL and the table's lock are released while the host waits (lookups go
            # on); the buffers are free after it
            rt.streamSynchronize(stream)
            return int(staging.host_count[0])

