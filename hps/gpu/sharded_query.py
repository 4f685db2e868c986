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

Large batches are pushed rather than pulled: the same kernel runs once
on each device for the shards it holds (bit mask `mine`), reads its own sets and rows and
writes the rows into the caller's output over NVLink, while the caller's device serves its
own shards; the peer launches follow the caller's stream through an event and the
caller's stream waits for theirs. A pulled row costs two round trips over the link (its
set, then the row) and its bytes in flight; a pushed row one posted write. Batches of more
than LARGE_AFTER keys, pushed or pulled, take the kernel's large-batch build, and read
the devices' hot copies of their peers' heaviest rows (hps/gpu/hot_rows.py).
`PUSH_AFTER`, `SHAPE` and docs/gpu-cache.md give the measurements that chose them.

Misses: the kernels write the missed positions and keys into the caller's workspace;
hps/gpu/sharded_misses.py serves them as one table serves its own, fetched once for all
shards; shards of mixed kinds (which it does not take) send the missed keys alone
through the copy path (each to its owning shard, which fetches and inserts it) and
scatter their rows.

The fast path: as one table's fast query (hps/gpu/fast_query.py), the one pass is one
compiled call when every shard's gate is open. Each thread binds its launch once (`bind`:
the words saying where the batch's cells are and what else the call needs), and the call
checks that the bound device's CUDA context is current (so the view calls it before any
device switch: `fast`), counts itself into each gate (and backs out of all if any is
closed. A write closed it: where every such write is done, the gates reopen and the call
is tried once more, which a lookup after one with misses finds, its inserts done; else the
locked path below orders the query after the writes and reopens the gates once they are
done), takes each dynamic shard's LRU tick, fills the batch's cells, launches, records the
event, spins on the miss count and leaves the gates. A writer to any shard closes its gate
and waits for the queries counted in, so no row changes under the kernel. It saves the
locked path's Python: a lock, a write check and an in-flight entry per shard, and the
cells set one by one (about 8 µs of a 33 µs 2,000-key call, two H200s; docs/gpu-cache.md
"What sharding costs and what it wins" has the rates).

Where it does not apply, the copy path serves: more than HPS_MAX_SHARDS shards, uvm
shards (refused by the config anyway), outputs other than float32, or two devices without
peer access.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.gpu import fast_query, kernels
from hps.gpu.fast_query import CLOSED, FALLBACK, HELD_KEYS, TICK, TIMED_OUT
from hps.gpu.launch_shape import BLOCK
from hps.gpu.workspace import QueryWorkspace
from hps.gpu.write_order import reopen_for_one_pass
from hps.runtime.raw_memory import wait_while, wait_while_held

if TYPE_CHECKING:
    from hps.gpu.hot_rows import HotRows
    from hps.gpu.table import GpuEmbeddingTable

#: most shards one pass reads (cuda/hps_common.cuh HPS_MAX_SHARDS)
MAX_SHARDS = 8
#: the one pass's launch shape: (lanes per key, keys per lane group and round). One GPU's
#: own at dim 64; two H200s, `hps bench gpu --profile sharded --sweep`: 8 lanes and 1, 2 or
#: 4 keys, or 4 lanes and 2, moved the pulled 1M-key rate by 3% (uniform) to 8%
#: (power-law), the 2,000-key rate by up to 9%, with (8, 2) first or within 1-2% of it on
#: every pulled and pushed row but the 2,000-key power-law one (0.96x)
SHAPE = (8, 2)
#: batches of more keys than this are pushed (the module docstring), where they can be.
#: Same sweep: pushed 1M uniform keys ran 1.20x pulled; 1M power-law 0.93x (pulled hot
#: rows are read again and again, pushed ones each cross the link); 2,000 keys 0.57-0.70x
#: (a second launch and two events across devices)
PUSH_AFTER = 1 << 16
#: batches of more keys than this take the kernel's large-batch build (static shards:
#: cuda/static_table.cu says what it leaves out), through the locked path
LARGE_AFTER = 1 << 16
LARGE_BUILD = {"PROBE_AHEAD_KEYS": 0, "PROBE_STEP": 1, "SHARDED_MIN_BLOCKS": 3}
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


@functools.lru_cache(maxsize=None)
def peer_atomics(device: int, other: int) -> bool:
    """Whether kernels on `device` may use atomics on `other`'s memory (NVLink: native
    peer atomics; over PCIe they are not atomic): what a pushed query's shared miss count
    and an insert into another device's shard need. The device itself: True."""
    if device == other:
        return True
    lib = kernels.driver()
    if lib is None:
        return False
    handles = [ctypes.c_int32(), ctypes.c_int32()]
    for handle, ordinal in zip(handles, (device, other), strict=True):
        if lib.cuDeviceGet(ctypes.addressof(handle), ordinal) != 0:
            return False
    value = ctypes.c_int32()
    status = lib.cuDeviceGetP2PAttribute(ctypes.addressof(value), _NATIVE_ATOMICS,
                                         handles[0].value, handles[1].value)
    return status == 0 and value.value == 1


#: cuDeviceGetP2PAttribute's CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED (cuda.h)
_NATIVE_ATOMICS = 3


class OnePassQuery:
    """The one-pass query of a sharded table from device `device_id` (see the module
    docstring). Thread-safe: each thread has its own workspace and launch."""

    def __init__(self, cupy: Any, device_id: int, shards: list[GpuEmbeddingTable],
                 hot: HotRows | None = None) -> None:
        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self.device_id = device_id
        self._tables = [shard._table for shard in shards]
        #: the tables a query reads and holds: the shards' and this device's hot copy's
        self._held = self._tables + ([hot.table] if hot is not None else [])
        first = self._tables[0]
        self._dynamic = first._kind == "embedding cache"
        self._kernel = "cache_query_sharded" if self._dynamic else "static_query_sharded"
        self._device_of = [shard.device_id for shard in shards]
        self._devices = sorted(set(self._device_of))
        # which device serves which shards (a bit mask): pulled, the caller's every one;
        # pushed, each device the shards it holds, the caller's device last (_launch)
        self._all = (1 << len(shards)) - 1
        mine = {d: sum(1 << s for s, on in enumerate(self._device_of) if on == d)
                for d in self._devices}
        self._pulled = [(device_id, self._all)]
        self._pushed = [(d, mine[d]) for d in sorted(mine, key=lambda d: d == device_id)]
        self._max_blocks = {d: kernels.multiprocessors(d) * _WAVES
                            for d in set(self._devices) | {device_id}}
        #: whether large batches can be pushed (the module docstring): every shard's
        #: device reaches this one, with atomics (the shared miss count)
        self.can_push = all(
            enable_peer_access(cupy, d, device_id) and peer_atomics(d, device_id)
            for d in self._devices if d != device_id)
        #: batches of more keys than this are pushed; None: none are
        self.push_after: int | None = PUSH_AFTER if self.can_push else None
        # the shards' array (cuda/hps_common.cuh hps_shard) on every device launched on,
        # made once, with this device's hot copy after the shards (hps/gpu/hot_rows.py;
        # on a peer the mirror of its index, for the peer's pushed launches): the miss
        # path's one-launch insert reads the caller device's too
        self._arrays: dict[int, Any] = {}
        for device in set(self._devices if self.can_push else []) | {device_id}:
            rows = [[t._keys_ptr, getattr(t, "_stamps_ptr", 0) if self._dynamic else 0,
                     t._vecs_ptr, t.num_sets, t._flags_ptr, int(on != device)]
                    for t, on in zip(self._tables, self._device_of, strict=True)]
            rows.append(hot.entry(device) if hot is not None else [0] * 6)
            with cupy.cuda.Device(device):
                self._arrays[device] = cupy.asarray(np.array(rows, np.int64))
        if hot is not None:
            hot.attach(self._arrays)
        #: the address of the shards' array on this device
        self.shards_ptr = int(self._arrays[device_id].data.ptr)
        # device: (the shards' array's address there, the kernel's address, the address
        # of its large-batch build)
        self._on: dict[int, tuple[int, int, int]] = {}
        self._driver = kernels.driver()
        #: the queries pushed (for tests and the bench: which way a batch went)
        self.pushed = 0
        self.set_shape(*SHAPE)
        # the fast path's gates (one process's: a shared table's gate is not for it) and
        # the compiled calls, None where they cannot be had
        gates = [t._gate for t in self._held]
        self._gates = np.array([g.address for g in gates], np.int64)
        self._leave = fast_query._gate_calls()[2]
        self._fast = None if any(g.shared for g in gates) else _compiled()
        from hps.gpu.dynamic_cache import RANK_BITS

        self._rank_shift = RANK_BITS if self._dynamic else -1

    def set_shape(self, group: int, unroll: int) -> None:
        """The launch shape (SHAPE; for tuning, `hps bench gpu --profile sharded
        --sweep`). Call it with no query in flight."""
        defines = {**self._tables[0]._defines, "GROUP": group, "UNROLL": unroll}
        source = self._tables[0]._source
        for device, shards in self._arrays.items():
            fn = kernels.function(source, self._kernel, device, **defines)
            large = fn if self._dynamic else kernels.function(
                source, self._kernel, device, **defines, **LARGE_BUILD)
            self._on[device] = (int(shards.data.ptr), int(fn.kernel.ptr),
                                int(large.kernel.ptr))
        self._keys_per_block = (32 // defines["GROUP"]) * defines["UNROLL"] * (BLOCK // 32)
        self.shape = (group, unroll)
        self._tls = threading.local()  # every thread's launch is bound to the old kernels

    @staticmethod
    def applies(shards: list[GpuEmbeddingTable]) -> bool:
        """Whether one pass can serve these shards (their tables' kinds and count)."""
        kinds = {shard._table._kind for shard in shards}
        return (len(shards) <= MAX_SHARDS and len(kinds) == 1
                and kinds <= {"embedding cache", "static table"})

    def fast(self, keys_ptr: int, n: int, out_ptr: int, stream: int,
             default_value: float) -> int:
        """query()'s fast path alone, with any device current (the compiled call checks
        the context): the miss count (the misses in workspace()), or FALLBACK where query()
        must serve it (a gate closed, another device current, a batch this thread's
        bound launch does not take, a miss path still reading its workspace)."""
        state = getattr(self._tls, "state", None)
        if state is None:
            return FALLBACK
        ws, launch = state
        after = self.push_after  # _pushes(n), inlined: this is every small lookup's path
        if (launch.block is None or n > ws.capacity or (after is not None and n > after)
                or n > LARGE_AFTER or ws.pending or default_value != launch.default):
            return FALLBACK
        return self._run(launch, keys_ptr, n, out_ptr, stream)

    def workspace(self) -> QueryWorkspace:
        """This thread's workspace: the misses of its last query."""
        return self._tls.state[0]  # type: ignore[no-any-return]

    def query(self, keys_ptr: int, n: int, out_ptr: int, stream: int,
              default_value: float, tried_fast: bool = False) -> tuple[int, QueryWorkspace]:
        """Rows of the n int64 keys at `keys_ptr` into the float32 [n, dim] output at
        `out_ptr` (both contiguous on this device, current), default_value for keys no
        shard holds, queued on `stream`; returns the miss count and the workspace holding
        the missed positions (device) and keys (host) until this thread's next query.
        `tried_fast`: fast() just gave FALLBACK, so the gates are first reopened where
        their writes are done (the compiled call is not tried again before that)."""
        ws, launch = self._thread(n)
        ws.wait_released(stream)
        if (launch.block is not None and not self._pushes(n) and n <= LARGE_AFTER
                and default_value == launch.default):
            count = FALLBACK if tried_fast else self._run(launch, keys_ptr, n, out_ptr, stream)
            if count == FALLBACK and reopen_for_one_pass(self._held):
                count = self._run(launch, keys_ptr, n, out_ptr, stream)  # writes done
            if count != FALLBACK:
                return count, ws
        cells = launch.cells
        cells[3].value, cells[4].value, cells[5].value = keys_ptr, n, out_ptr
        cells[6].value = self._tables[0]._dim4 and out_ptr % 16 == 0
        cells[11].value = default_value
        launch.default = default_value
        push = self._pushes(n) and self._peers_write(keys_ptr, out_ptr)
        grids = self._grids(n, push)
        self.pushed += push
        cells[13].value = sum(blocks for _, _, blocks in grids)
        event = ws.event_ptr
        ws.host_count[0] = _NO_COUNT  # the kernel's last block overwrites it
        held = []
        try:
            for i, t in enumerate(self._held):
                t.hold_for_query(stream)
                held.append(t)
                if self._dynamic:  # (a cache's shards take no hot copy)
                    launch.ticks[i] = t._next_tick()
            self._launch(launch, grids, stream, n > LARGE_AFTER)
            status = launch.record(event, stream)
            if status:
                self._cp.cuda.driver.check_status(status)
        except BaseException:
            for t in held:
                t.release_after_query(stream, 0, self.device_id)
            raise
        for t in held:
            t.release_after_query(stream, event, self.device_id)
        try:
            # small batches keep the GIL through their short wait, as a table's own
            # queries do (hps/gpu/device_table.py _HELD_SPIN_KEYS says why)
            spin = wait_while_held if n <= HELD_KEYS else wait_while
            count = int(spin(ws.host_ptr, _NO_COUNT, _SPINS))
            if count == _NO_COUNT:
                self._rt.eventSynchronize(event)
                count = int(ws.host_count[0])
        finally:
            for t in self._held:
                t.query_done(event)
        return count, ws

    def _pushes(self, n: int) -> bool:
        """Whether a batch of n keys is pushed where it can be: never the fast path's
        pulled launch. Asked at each call: the bench changes push_after (0: every batch)."""
        return self.push_after is not None and n > self.push_after

    def _grids(self, n: int, push: bool) -> list[tuple[int, int, int]]:
        """(device, shards it serves, blocks) of each launch of a query of n keys."""
        return [(d, mine, min(-(-n // self._keys_per_block), self._max_blocks[d]))
                for d, mine in (self._pushed if push else self._pulled)]

    def _launch(self, launch: _Launch, grids: list[tuple[int, int, int]], stream: int,
                large: bool) -> None:
        """Queues the query's launches: each peer's on this thread's stream there, after
        `stream`'s work so far, then the caller's device's on `stream`, which then waits
        for the peers'; `large`: the kernels' large-batch builds. (Two H200s, 1M pushed
        keys: each peer's kernel ran as long as the caller's or longer, 400 against 265 us
        uniform, and launched after the caller's it started a device switch later.)"""
        cells, rt = launch.cells, self._rt
        peers = [g for g in grids if g[0] != self.device_id]
        if peers:
            ready = self._peer_events(self.device_id)[1]
            rt.eventRecord(ready, stream)
        launched = []  # the peers' done events
        for device, mine, blocks in grids:  # the peers' first: theirs are the longer kernels
            cells[0].value, small, big = self._on[device]
            fn = big if large else small
            cells[12].value = mine
            if device == self.device_id:
                status = launch.driver(fn, blocks, 1, 1, BLOCK, 1, 1, 0, stream,
                                       launch.params, 0)
            else:
                peer_stream, done = self._peer_events(device)
                rt.setDevice(device)
                try:
                    rt.streamWaitEvent(peer_stream, ready, 0)
                    status = launch.driver(fn, blocks, 1, 1, BLOCK, 1, 1, 0, peer_stream,
                                           launch.params, 0)
                    if status == 0:
                        rt.eventRecord(done, peer_stream)
                        launched.append(done)
                finally:
                    rt.setDevice(self.device_id)
            if status:
                for done in launched:
                    rt.streamWaitEvent(stream, done, 0)
                if len(grids) > 1:  # the grids launched count into ctl: let them end, reset it
                    rt.streamSynchronize(stream)  # it waits for the peers launched so far
                    launch.ws.ctl.fill(0)
                self._cp.cuda.driver.check_status(status)
        for done in launched:  # after the caller's launch, which must not wait for them
            rt.streamWaitEvent(stream, done, 0)

    def _peers_write(self, *pointers: int) -> bool:
        """Whether every shard's device may read and write the caller's memory at
        `pointers` (the keys and the output): memory of cudaMalloc (the kind legacy IPC
        takes, from no pool), which peer access opens. Other memory is pulled: a
        stream-ordered pool's grants peers nothing unless asked, and its access flags
        said read-write from a peer that then faulted on it (2 H200s, CuPy's
        MemoryAsyncPool); a virtual mapping's (torch's expandable segments) likewise."""
        if self._driver is None:
            return False
        attribute = self._driver.cuPointerGetAttribute
        flag, pool = ctypes.c_int32(), ctypes.c_uint64()
        flag_at, pool_at = ctypes.addressof(flag), ctypes.addressof(pool)
        for ptr in pointers:
            if (attribute(flag_at, _LEGACY_IPC, ptr) != 0 or flag.value != 1
                    or attribute(pool_at, _MEMPOOL, ptr) != 0 or pool.value):
                return False
        return True

    def _peer_events(self, device: int) -> tuple[int, int]:
        """This thread's (stream, event) on a peer `device` for its pushed launches; on the
        caller's device (0, the event the peers wait on)."""
        peers = getattr(self._tls, "peers", None)
        if peers is None:
            peers = self._tls.peers = {}
        got = peers.get(device)
        if got is None:
            with self._cp.cuda.Device(device):
                keep = (self._cp.cuda.Stream(non_blocking=True) if device != self.device_id
                        else None, self._cp.cuda.Event(block=False, disable_timing=True))
            peers[device] = keep
            got = keep
        stream, ev = got
        return (int(stream.ptr) if stream is not None else 0), int(ev.ptr)

    def _run(self, launch: _Launch, keys_ptr: int, n: int, out_ptr: int, stream: int) -> int:
        """The one pass in one compiled call (the module docstring's fast path) of this
        thread's bound launch: the miss count, or FALLBACK when a gate was closed or
        another device is current."""
        call = self._fast[1] if n <= HELD_KEYS else self._fast[0]  # type: ignore[index]
        result = int(call(launch.block_address, keys_ptr, n, out_ptr, stream))
        if result >= 0 or result == FALLBACK:
            return result
        if result == TIMED_OUT:  # a long kernel, or one queued behind other work
            try:
                self._rt.eventSynchronize(launch.ws.event_ptr)
                return int(launch.ws.host_count[0])
            finally:
                for gate in self._gates:  # a process's gate counts its queries at word 0
                    self._leave(int(gate))
        self._cp.cuda.driver.check_status(FALLBACK - result)
        raise RuntimeError(f"cuLaunchKernel failed with status {FALLBACK - result}")

    def _thread(self, n: int) -> tuple[QueryWorkspace, _Launch]:
        """This thread's workspace and launch (made again for a larger batch), with the
        fast path's words bound where it has one (this device current)."""
        state = getattr(self._tls, "state", None)
        if state is not None and n <= state[0].capacity:
            return state  # type: ignore[no-any-return]
        ws = state[0] if state is not None else QueryWorkspace(self._cp, self.device_id)
        ws.reserve(n)
        shards, fn, _ = self._on[self.device_id]
        launch = _Launch(fn, len(self._tables), ws)
        if self._fast is not None:
            launch.bind(self, shards, self._cp.cuda.driver.ctxGetCurrent())
        self._tls.state = (ws, launch)
        return ws, launch


class _Launch:
    """One thread's parameter block of the one-pass kernel: the shards' array (of the
    device launched on) and count, the ticks by value, then the batch's keys, count,
    output, vec4 flag, the workspace's counters and miss buffers, the default value, the
    shards this launch serves and the blocks of every launch of the query. A launch copies
    the values, so one block serves each launch of a query in turn.

    `block`: the fast path's words (`bind`), which the compiled call reads to fill the
    cells of a pulled query of up to its workspace's capacity and launch it; None where
    there is no fast path."""

    def __init__(self, fn: int, num_shards: int, ws: QueryWorkspace) -> None:
        u64, i64, i32, f32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
        u32 = ctypes.c_uint32
        self.ws = ws
        self.ticks = np.zeros(MAX_SHARDS, np.uint64)
        self.ticks_ptr = int(self.ticks.ctypes.data)
        self.cells: list[Any] = [u64(), i64(num_shards), None, u64(), i64(), u64(),
                                 i32(), u64(ws.ctl_ptr), u64(ws.host_ptr),
                                 u64(ws.positions_ptr), u64(ws.keys_ptr), f32(), u32(), u32()]
        addresses = [int(self.ticks.ctypes.data) if c is None else ctypes.addressof(c)
                     for c in self.cells]
        self._pointers = (ctypes.c_void_p * len(addresses))(*addresses)
        self.params = ctypes.addressof(self._pointers)
        self.fn = fn  # the caller's device's kernel
        lib = kernels.driver()  # present wherever CuPy runs kernels
        self.driver, self.record = lib.cuLaunchKernel, lib.cuEventRecord
        self.block: np.ndarray | None = None
        self.block_address = 0
        self.default: float | None = None  # the default value cells[11] holds

    def bind(self, query: OnePassQuery, shards: int, context: int) -> None:
        """The fast path's words for `query`'s pulled launches from its device, whose
        shards' array is at `shards` and CUDA context is `context`."""
        cells = self.cells
        at = ctypes.addressof
        words = {W_FN: self.fn, W_PARAMS: self.params, W_GATES: int(query._gates.ctypes.data),
                 W_GATE_COUNT: query._gates.size, W_TICKS: self.ticks_ptr,
                 W_RANK_SHIFT: query._rank_shift, W_KEYS_CELL: at(cells[3]),
                 W_N_CELL: at(cells[4]), W_OUT_CELL: at(cells[5]), W_VEC_CELL: at(cells[6]),
                 W_VEC_OK: int(query._tables[0]._dim4), W_BLOCKS_CELL: at(cells[13]),
                 W_KEYS_PER_BLOCK: query._keys_per_block,
                 W_MAX_BLOCKS: query._max_blocks[query.device_id],
                 W_SHARDS_CELL: at(cells[0]), W_SHARDS: shards, W_MINE_CELL: at(cells[12]),
                 W_MINE: query._all, W_COUNT_AT: self.ws.host_ptr, W_EVENT: self.ws.event_ptr,
                 W_SPINS: _SPINS, W_THREADS: BLOCK, W_CONTEXT: context}
        block = np.zeros(WORDS, np.int64)
        for index, value in words.items():
            block[index] = value
        self.block, self.block_address = block, int(block.ctypes.data)


#: the words of a thread's bound launch (_Launch.bind) that the fast path's compiled call
#: reads: where to write the batch's cells and what, the gates, the launch and the wait
(W_FN, W_PARAMS, W_GATES, W_GATE_COUNT, W_TICKS, W_RANK_SHIFT, W_KEYS_CELL, W_N_CELL,
 W_OUT_CELL, W_VEC_CELL, W_VEC_OK, W_BLOCKS_CELL, W_KEYS_PER_BLOCK, W_MAX_BLOCKS,
 W_SHARDS_CELL, W_SHARDS, W_MINE_CELL, W_MINE, W_COUNT_AT, W_EVENT, W_SPINS, W_THREADS,
 W_CONTEXT, W_CURRENT) = range(24)
WORDS = 24


#: cuPointerGetAttribute's CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE (an int) and
#: CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE (a pointer; cuda.h)
_LEGACY_IPC, _MEMPOOL = 10, 17


@functools.lru_cache(maxsize=1)
def _compiled() -> tuple[Any, Any] | None:
    """(query, held query): the fast path's compiled call, releasing the GIL and keeping
    it (as fast_query's), or None where libcuda or numba cannot give it.

    query(block, keys, n, out, stream) -> the miss count, FALLBACK (a gate was closed, or
    the current context is not the bound device's: nothing launched), TIMED_OUT (the
    count had not landed after the bound spins: wait on the event, then leave every
    gate), or below FALLBACK a launch error. `block`: a _Launch's bound words."""
    lib = kernels.driver()
    if lib is None:
        return None
    try:
        from hps.runtime.compiled import numba, types
    except ImportError:
        return None
    from hps.runtime.raw_memory import (
        _atomic_add64,
        _store32,
        _store64,
        _u32_acquire,
        _u64,
        _u64_acquire,
    )

    cu_launch, cu_record, cu_context = lib.cuLaunchKernel, lib.cuEventRecord, lib.cuCtxGetCurrent

    @numba.njit(inline="always")
    def word(block: int, index: int) -> int:
        return np.int64(_u64(block + index * 8))

    @numba.njit(inline="always")
    def leave(gates: int, count: int) -> None:
        for j in range(count):
            _atomic_add64(np.int64(_u64(gates + j * 8)), np.int64(-1))  # ENTERED is word 0

    def query(block: int, keys_ptr: int, n: int, out_ptr: int, stream: int) -> int:
        # the bound kernel is of the caller's device: its context must be current
        if cu_context(np.uint64(block + W_CURRENT * 8)) != 0 or word(block, W_CURRENT) != word(
                block, W_CONTEXT):
            return FALLBACK
        gates, count = word(block, W_GATES), word(block, W_GATE_COUNT)
        for i in range(count):
            gate = np.int64(_u64(gates + i * 8))
            _atomic_add64(gate, np.int64(1))
            if np.int64(_u64_acquire(gate + CLOSED * 8)) != 0:
                leave(gates, i + 1)
                return FALLBACK
        rank_shift, ticks = word(block, W_RANK_SHIFT), word(block, W_TICKS)
        if rank_shift >= 0:
            for i in range(count):
                gate = np.int64(_u64(gates + i * 8))
                tick = _atomic_add64(gate + TICK * 8, np.int64(1)) + 1
                _store64(ticks + i * 8, tick << rank_shift)
        per, most = word(block, W_KEYS_PER_BLOCK), word(block, W_MAX_BLOCKS)
        blocks = min((n + per - 1) // per, most)
        _store64(word(block, W_KEYS_CELL), keys_ptr)
        _store64(word(block, W_N_CELL), n)
        _store64(word(block, W_OUT_CELL), out_ptr)
        aligned = word(block, W_VEC_OK) != 0 and out_ptr % 16 == 0
        _store32(word(block, W_VEC_CELL), np.int64(1 if aligned else 0))
        _store64(word(block, W_SHARDS_CELL), word(block, W_SHARDS))  # the locked path's
        _store32(word(block, W_MINE_CELL), word(block, W_MINE))  # pushes change them
        _store32(word(block, W_BLOCKS_CELL), blocks)
        count_at = word(block, W_COUNT_AT)
        _store32(count_at, np.int64(_NO_COUNT))
        one = np.uint32(1)
        stream_u = np.uint64(stream)
        status = cu_launch(np.uint64(word(block, W_FN)), np.uint32(blocks), one, one,
                           np.uint32(word(block, W_THREADS)), one, one, np.uint32(0), stream_u,
                           np.uint64(word(block, W_PARAMS)), np.uint64(0))
        if status == 0:
            status = cu_record(np.uint64(word(block, W_EVENT)), stream_u)
        if status != 0:
            leave(gates, count)
            return FALLBACK - np.int64(status)
        for _ in range(word(block, W_SPINS)):
            missed = np.int64(np.int32(_u32_acquire(count_at)))
            if missed != _NO_COUNT:
                leave(gates, count)
                return missed
        return TIMED_OUT

    i64 = types.int64
    signature = i64(i64, i64, i64, i64, i64)
    # not cached: they call through addresses of this process (as fast_query's)
    return numba.njit(signature, nogil=True)(query), numba.njit(signature)(query)
