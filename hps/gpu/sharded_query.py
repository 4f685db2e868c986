"""A sharded table's lookup in one pass on the caller's device (`gpu_sharding: row_wise`).

Why. The copy path of hps/gpu/sharded.py partitions the batch by shard, waits on the host
for the run sizes, looks each run up on its shard's device (a peer copy of its keys there
and of its rows back) and scatters the rows into place: on two H100s a 2,000-key batch ran
at 0.10-0.15x the same table whole on one GPU. Here every device maps its peers' shards
(peer access within the process: NVLink on these machines) and one kernel on the caller's
device finds each key's shard by its hash, probes that shard's index and reads its row
where it lives straight into the caller's output (cuda/embedding_cache.cu
cache_query_sharded, cuda/static_table.cu static_query_sharded; WholeMemory's one-kernel
gather is the model): no partition pass, no launch per shard, and no host wait but the
miss count's, as for a table on one device.

Order against writes: the query holds every shard table's lock (in shard order) with its
stream ordered after each shard's last write, launches, records its event and enters it
among each shard's queries in flight, so a write to any shard waits for it on the GPU, as
the locked path of one table does (hps/gpu/write_order.py hold_for_query).

Misses: the kernel writes the missed positions and keys into the caller's workspace;
dynamic-cache shards serve them as one table serves its own, fetched once for all shards
(hps/gpu/sharded_misses.py); other kinds send the missed keys alone through the copy
path (each to its owning shard, which fetches and inserts it) and scatter their rows.

Where it does not apply, the copy path serves: more than HPS_MAX_SHARDS shards, uvm
shards (refused by the config anyway), outputs other than float32, or two devices without
peer access.
"""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.gpu import kernels
from hps.gpu.fast_query import HELD_KEYS
from hps.gpu.launch_shape import BLOCK
from hps.gpu.workspace import QueryWorkspace
from hps.runtime.raw_memory import wait_while, wait_while_held

if TYPE_CHECKING:
    from hps.gpu.table import GpuEmbeddingTable

#: most shards one pass reads (cuda/hps_common.cuh HPS_MAX_SHARDS)
MAX_SHARDS = 8
_NO_COUNT = -1
_SPINS = 1 << 16
_WAVES = 16  # blocks per SM at most: the kernel's warps loop over the rest


def peers_reachable(cupy: Any, device: int, others: set[int]) -> bool:
    """Whether `device` can read every device of `others` (itself or a peer with access,
    enabled here once per pair)."""
    return all(enable_peer_access(cupy, device, other) for other in sorted(others - {device}))


def enable_peer_access(cupy: Any, device: int, other: int) -> bool:
    """Lets `device` read `other`'s memory (once per pair in the process); False where the
    two cannot reach each other."""
    rt = cupy.cuda.runtime
    if not rt.deviceCanAccessPeer(device, other):
        return False
    with _PEERS_LOCK:
        if (device, other) not in _PEERS:
            with cupy.cuda.Device(device):
                try:
                    rt.deviceEnablePeerAccess(other)
                except rt.CUDARuntimeError:  # enabled already (by another part of the process)
                    pass
            _PEERS.add((device, other))
    return True


_PEERS: set[tuple[int, int]] = set()
_PEERS_LOCK = threading.Lock()


class OnePassQuery:
    """The one-pass query of a sharded table from device `device_id` (see the module
    docstring). Thread-safe: each thread has its own workspace and launch."""

    def __init__(self, cupy: Any, device_id: int, shards: list[GpuEmbeddingTable]) -> None:
        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self.device_id = device_id
        self._tables = [shard._table for shard in shards]
        first = self._tables[0]
        self._dynamic = first._kind == "embedding cache"
        self._kernel = "cache_query_sharded" if self._dynamic else "static_query_sharded"
        rows = []
        for t in self._tables:
            stamps = getattr(t, "_stamps_ptr", 0) if self._dynamic else 0
            rows.append([t._keys_ptr, stamps, t._vecs_ptr, t.num_sets, t._flags_ptr, 0])
        with cupy.cuda.Device(device_id):
            self._shards = cupy.asarray(np.array(rows, np.int64))
            self._fn = kernels.function(first._source, self._kernel, device_id,
                                        **{**first._defines, "UNROLL": 1})
        self._shards_ptr = int(self._shards.data.ptr)
        self._keys_per_block = (32 // first._group) * (BLOCK // 32)
        self._max_blocks = kernels.multiprocessors(device_id) * _WAVES
        self._tls = threading.local()

    @staticmethod
    def applies(shards: list[GpuEmbeddingTable]) -> bool:
        """Whether one pass can serve these shards (their tables' kinds and count)."""
        kinds = {shard._table._kind for shard in shards}
        return (len(shards) <= MAX_SHARDS and len(kinds) == 1
                and kinds <= {"embedding cache", "static table"})

    def query(self, keys_ptr: int, n: int, out_ptr: int, stream: int,
              default_value: float) -> tuple[int, QueryWorkspace]:
        """Rows of the n int64 keys at `keys_ptr` into the float32 [n, dim] output at
        `out_ptr` (both contiguous on this device), default_value for keys no shard
        holds, queued on `stream`; returns the miss count and the workspace holding the
        missed positions (device) and keys (host) until this thread's next query."""
        ws, launch = self._thread(n)
        ws.wait_released(stream)
        ws.host_count[0] = _NO_COUNT  # the kernel's last block overwrites it
        cells = launch.cells
        cells[3].value, cells[4].value, cells[5].value = keys_ptr, n, out_ptr
        cells[6].value = self._tables[0]._dim4 and out_ptr % 16 == 0
        cells[11].value = default_value
        blocks = min(-(-n // self._keys_per_block), self._max_blocks)
        event = ws.event_ptr
        held = []
        try:
            for i, t in enumerate(self._tables):
                t.hold_for_query(stream)
                held.append(t)
                if self._dynamic:
                    launch.ticks[i] = t._next_tick()
            status = launch.driver(launch.fn, blocks, 1, 1, BLOCK, 1, 1, 0, stream,
                                   launch.params, 0)
            if status == 0:
                status = launch.record(event, stream)
            if status:
                self._cp.cuda.driver.check_status(status)
        except BaseException:
            for t in held:
                t.release_after_query(stream, 0)
            raise
        for t in held:
            t.release_after_query(stream, event)
        try:
            # small batches keep the GIL through their short wait, as a table's own
            # queries do (hps/gpu/device_table.py _HELD_SPIN_KEYS says why)
            spin = wait_while_held if n <= HELD_KEYS else wait_while
            count = int(spin(ws.host_ptr, _NO_COUNT, _SPINS))
            if count == _NO_COUNT:
                self._rt.eventSynchronize(event)
                count = int(ws.host_count[0])
        finally:
            for t in self._tables:
                t.query_done(event)
        return count, ws

    def _thread(self, n: int) -> tuple[QueryWorkspace, _Launch]:
        state = getattr(self._tls, "state", None)
        if state is None:
            state = self._tls.state = (QueryWorkspace(self._cp, self.device_id), None)
        ws, launch = state
        if n > ws.capacity or launch is None:
            ws.reserve(n)
            launch = _Launch(self._fn, self._shards_ptr, len(self._tables), ws)
            self._tls.state = (ws, launch)
        return ws, launch


class _Launch:
    """One thread's parameter block of the one-pass kernel: the shards' array and count,
    the ticks by value, then the batch's keys, count, output, vec4 flag, the workspace's
    counters and miss buffers, the default value."""

    def __init__(self, fn: Any, shards_ptr: int, num_shards: int, ws: QueryWorkspace) -> None:
        u64, i64, i32, f32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
        self.ticks = np.zeros(MAX_SHARDS, np.uint64)
        self.cells: list[Any] = [u64(shards_ptr), i64(num_shards), None, u64(), i64(), u64(),
                                 i32(), u64(ws.ctl_ptr), u64(ws.host_ptr),
                                 u64(ws.positions_ptr), u64(ws.keys_ptr), f32()]
        addresses = [int(self.ticks.ctypes.data) if c is None else ctypes.addressof(c)
                     for c in self.cells]
        self._pointers = (ctypes.c_void_p * len(addresses))(*addresses)
        self.params = ctypes.addressof(self._pointers)
        self.fn = int(fn.kernel.ptr)
        lib = kernels.driver()  # present wherever CuPy runs kernels
        self.driver, self.record = lib.cuLaunchKernel, lib.cuEventRecord
