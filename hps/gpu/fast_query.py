"""A table's query in one compiled call: the launch, its event and the wait for the miss
count (DeviceTable.query_ptr's common case, and GpuEmbeddingTable.lookup_contiguous's
before any device switch).

Why. The locked path spends Python on every query: the workspace's checks, the table's
lock, the write-event check, six launch parameters set one by one, the in-flight record,
the overlap task, the spin. Here the locked path binds a workspace's launch once and every
later query of it is one call that writes its parameters, launches, records the event and
spins on the count. Queries of up to HELD_KEYS keys keep the GIL through it, as the locked
path's spin does: released, each call became a GIL hand-off that convoyed the other caller
threads (measured and dropped: docs/gpu-latency.md, "Many callers"). H100, one device
call taking turns with the tree before it: `lookup_fromdlpack` p50 20.7 / 21.9 against
22.7 / 27.5 µs (floor 14.9-18.6), `HPS.lookup` with NumPy keys 50.2 / 53.5 against 58.3 /
75.5 µs; the threads profile's median over the floor 0.72 / 0.69 against 0.69 / 0.59
(streams set once) and 1.18 / 1.37 against 0.96 / 1.19 (a stream switch per call);
HugeCTR's profile unchanged within its noise.

How. The table's gate (three int64 words in host memory) counts the fast queries in
flight and is closed while a write is queued or pending:

- a fast query adds itself to `entered` (an atomic add: a full fence), then reads
  `closed`; if set, it leaves and the caller takes the locked path (which orders it after
  the write on the GPU and reopens the gate once the write is done). Otherwise it writes
  its keys, count and output into its workspace's bound launch, launches, records the
  workspace's event, and spins on the miss count; it leaves once the count has landed,
  when no block of its kernel reads the table any more (the kernel's last block publishes
  the count after a system-scope fence);
- a writer (DeviceTable._writing and the other write paths, under the table's lock)
  sets `closed` (an atomic exchange: a full fence), then waits for `entered` to reach 0.
  Either the query sees the gate closed, or the writer sees the query and waits for it:
  no query of the fast path reads rows that a write changes under it.

A workspace's fast launch is bound by the locked path (`bind`, from the launch it just
made); the caller checks that it is of the table's current kernels (generation), that the
batch fits it, that no earlier miss path still reads the workspace, and that the default
value is the one bound. The dynamic cache's LRU tick is the gate's third word, shared by
both paths.
"""

from __future__ import annotations

import ctypes
import time
from functools import lru_cache
from typing import Any

import numpy as np

from hps.gpu import kernels, overlap

# gate words: the LRU tick, which every dynamic cache's query adds to, on a cache line of
# its own (8 words on): on the line that every query reads `closed` from, 8 processes'
# ticks would keep taking that line from each other
ENTERED, CLOSED, TICK = 0, 1, 8
# a fast launch's block of int64 words
(FN, PARAMS, KEYS_CELL, N_CELL, OUT_CELL, VEC_CELL, TICK_CELL, KEYS_PER_BLOCK, MAX_BLOCKS,
 VEC_OK, COUNT_AT, EVENT, GATE, SPINS, THREADS, RANK_SHIFT, CONTEXT, CURRENT,
 ENTERED_AT) = range(19)
WORDS = 19
#: results besides a miss count (>= 0): the gate was closed (take the locked path); the
#: count had not landed after SPINS reads (wait on the event, then `leave`); below
#: FALLBACK, a launch error (FALLBACK - result is the CUDA status)
TIMED_OUT, FALLBACK = -1, -2
_NO_COUNT = -1


@lru_cache(maxsize=1)
def compiled() -> tuple[Any, Any, Any, Any] | None:
    """(query, launch, wait, held query) compiled against this process's libcuda, or
    None where libcuda or numba cannot give them (every query then takes the locked path).

    query(block, keys_ptr, n, out_ptr, stream) -> result: launch then wait;
    launch(block, keys_ptr, n, out_ptr, stream) -> 0 or FALLBACK or an error;
    wait(block) -> miss count or TIMED_OUT. These three release the GIL; the held query
    is `query` keeping it."""
    lib = kernels.driver()
    if lib is None:
        return None
    try:
        return compile_calls(lib.cuLaunchKernel, lib.cuEventRecord, lib.cuCtxGetCurrent)
    except ImportError:  # no numba
        return None


def compile_calls(cu_launch: Any, cu_record: Any, cu_context: Any
                  ) -> tuple[Any, Any, Any, Any]:
    """compiled()'s calls over these cuLaunchKernel, cuEventRecord and cuCtxGetCurrent
    (ctypes functions of the driver's signatures, 64-bit integers for pointers)."""
    from hps.runtime.compiled import numba, types
    from hps.runtime.raw_memory import (
        _atomic_add64,
        _store32,
        _store64,
        _u32_acquire,
        _u64,
        _u64_acquire,
    )

    i64 = types.int64

    @numba.njit(inline="always")
    def word(block: int, index: int) -> int:
        return np.int64(_u64(block + index * 8))

    def launch(block: int, keys_ptr: int, n: int, out_ptr: int, stream: int) -> int:
        # the caller's current context must be the table's (its device current): else the
        # locked path switches devices
        if cu_context(np.uint64(block + CURRENT * 8)) != 0 or word(block, CURRENT) != word(
                block, CONTEXT):
            return FALLBACK
        gate = word(block, GATE)
        entered = word(block, ENTERED_AT)
        _atomic_add64(entered, np.int64(1))
        if np.int64(_u64_acquire(gate + CLOSED * 8)) != 0:
            _atomic_add64(entered, np.int64(-1))
            return FALLBACK
        _store64(word(block, KEYS_CELL), keys_ptr)
        _store64(word(block, N_CELL), n)
        _store64(word(block, OUT_CELL), out_ptr)
        aligned = word(block, VEC_OK) != 0 and out_ptr % 16 == 0
        _store32(word(block, VEC_CELL), np.int64(1 if aligned else 0))
        tick_cell = word(block, TICK_CELL)
        if tick_cell != 0:
            tick = _atomic_add64(gate + TICK * 8, np.int64(1)) + 1
            _store64(tick_cell, tick << word(block, RANK_SHIFT))
        per = word(block, KEYS_PER_BLOCK)
        blocks = (n + per - 1) // per
        most = word(block, MAX_BLOCKS)
        if most > 0 and blocks > most:
            blocks = most
        _store32(word(block, COUNT_AT), np.int64(_NO_COUNT))
        one = np.uint32(1)
        status = cu_launch(np.uint64(word(block, FN)), np.uint32(blocks), one, one,
                           np.uint32(word(block, THREADS)), one, one, np.uint32(0),
                           np.uint64(stream), np.uint64(word(block, PARAMS)), np.uint64(0))
        if status == 0:
            status = cu_record(np.uint64(word(block, EVENT)), np.uint64(stream))
        if status != 0:
            _atomic_add64(entered, np.int64(-1))
            return FALLBACK - np.int64(status)
        return 0

    def wait(block: int) -> int:
        count_at = word(block, COUNT_AT)
        for _ in range(word(block, SPINS)):
            count = np.int64(np.int32(_u32_acquire(count_at)))
            if count != _NO_COUNT:
                _atomic_add64(word(block, ENTERED_AT), np.int64(-1))
                return count
        return TIMED_OUT

    # not cached: they call through addresses of this process (as kernels._held_launcher)
    launch_c = numba.njit(i64(i64, i64, i64, i64, i64), nogil=True)(launch)
    wait_c = numba.njit(i64(i64), nogil=True)(wait)

    def query(block: int, keys_ptr: int, n: int, out_ptr: int, stream: int) -> int:
        status = launch_c(block, keys_ptr, n, out_ptr, stream)
        if status != 0:
            return status
        return wait_c(block)

    query_c = numba.njit(i64(i64, i64, i64, i64, i64), nogil=True)(query)
    # the same call keeping the GIL throughout, for small queries (see `run`)
    held_c = numba.njit(i64(i64, i64, i64, i64, i64))(query)
    return query_c, launch_c, wait_c, held_c


class FastGate:
    """A table's gate: fast queries in flight, closed or open, and the LRU tick (see the
    module docstring). The words live in a NumPy array the compiled calls reach by
    address. One process's gate; hps/gpu/shared_gate.py's SharedGate is the same gate in
    shared memory, for a table that several processes query."""

    #: whether other processes query the table through this gate (SharedGate)
    shared = False

    def __init__(self) -> None:
        self.words = np.zeros(16, np.int64)
        self.words[CLOSED] = 1  # opened by the locked path once the table is ready
        self.address = int(self.words.ctypes.data)
        #: where this process's queries count themselves in (here: the gate's own word)
        self.entered_address = self.address + ENTERED * 8
        self._calls = _gate_calls()

    def close(self) -> None:
        """Closes the gate and waits until no fast query reads the table (the table's
        lock held: the locked path reopens it)."""
        close, drain = self._calls[0], self._calls[1]
        close(self.address)
        if self.words[ENTERED]:  # a query still spins on its count: a few µs, or longer
            while drain(self.address) != 0:  # behind other work on its stream
                time.sleep(0)  # with the GIL released: a timed-out query leaves in Python

    def open(self) -> None:
        """Lets fast queries in again (the table's lock held, no write pending)."""
        self.words[CLOSED] = 0

    def write_queued(self, rt: Any, event_ptr: int) -> None:
        """A write was queued and recorded `event_ptr`: nothing to do in one process (the
        table's queries wait for it on the GPU; the locked path reopens the gate)."""

    def enter(self) -> None:
        """A locked-path query begins (its write order is the table's lock and events)."""

    def leave_locked(self) -> None:
        """A locked-path query's miss count landed."""

    def leave(self) -> None:
        """Ends a fast query whose count was read after its event (TIMED_OUT)."""
        self._calls[2](self.entered_address)

    def next_tick(self) -> int:
        """The next LRU tick, shared with the fast queries (which add to it atomically)."""
        return int(self._calls[3](self.address))


@lru_cache(maxsize=1)
def _gate_calls() -> tuple[Any, Any, Any, Any]:
    """(close, drain, leave, tick) on a gate's address (leave: on the address of a count
    of queries in flight): compiled, and keeping the GIL
    (each is a few instructions on the locked path, where a release would be a point for
    another thread to take the GIL) but drain, which spins."""
    from hps.runtime.compiled import numba, types
    from hps.runtime.raw_memory import _atomic_add64, _atomic_xchg64, _u64_acquire

    def close(gate: int) -> None:
        _atomic_xchg64(gate + CLOSED * 8, np.int64(1))

    def drain(gate: int) -> int:
        for _ in range(1 << 16):
            if np.int64(_u64_acquire(gate + ENTERED * 8)) == 0:
                return 0
        return 1

    def leave(entered: int) -> None:
        _atomic_add64(entered, np.int64(-1))

    def tick(gate: int) -> int:
        return _atomic_add64(gate + TICK * 8, np.int64(1)) + 1

    held = numba.njit([types.void(types.int64)], cache=True)
    return (held(close), numba.njit([types.int64(types.int64)], cache=True, nogil=True)(drain),
            held(leave), numba.njit([types.int64(types.int64)], cache=True)(tick))


class FastLaunch:
    """One workspace's fast launch for one output type (see `bind`)."""

    __slots__ = ("block", "address", "limit", "generation", "default", "launch")

    def __init__(self, block: np.ndarray, limit: int, generation: int, default: float,
                 launch: Any) -> None:
        self.block = block
        self.launch = launch  # its parameter block and cells, which `block` points into
        self.address = int(block.ctypes.data)
        self.limit = limit
        self.generation = generation
        self.default = default


def bind(gate: FastGate, launch: Any, cells: tuple[Any, ...], limit: int, keys_per_block: int,
         max_blocks: int, vec_ok: bool, ws: Any, threads: int, spins: int, rank_bits: int,
         generation: int, default: float, context: int) -> FastLaunch:
    """The fast launch of a workspace's bound query launch (kernels.Launch) whose cells
    are (keys, n, out, out_vec4, default, tick or None), for batches of up to `limit`
    keys: `keys_per_block` keys a block, at most `max_blocks` blocks (0: no cap), in CUDA
    context `context` (the table's device's)."""
    k, c, o, v, _, tick = cells
    block = np.zeros(WORDS, np.int64)
    block[FN], block[PARAMS] = launch.function_address, launch.params_address
    block[KEYS_CELL], block[N_CELL] = ctypes.addressof(k), ctypes.addressof(c)
    block[OUT_CELL], block[VEC_CELL] = ctypes.addressof(o), ctypes.addressof(v)
    block[TICK_CELL] = ctypes.addressof(tick) if tick is not None else 0
    block[KEYS_PER_BLOCK], block[MAX_BLOCKS], block[VEC_OK] = keys_per_block, max_blocks, vec_ok
    block[COUNT_AT], block[EVENT], block[GATE] = ws.host_ptr, ws.event_ptr, gate.address
    block[ENTERED_AT] = gate.entered_address
    block[SPINS], block[THREADS], block[RANK_SHIFT] = spins, threads, rank_bits
    block[CONTEXT] = context
    return FastLaunch(block, min(limit, ws.capacity), generation, default, launch)


#: queries of at most this many keys keep the GIL through their launch and wait, on both
#: paths (they end within tens of µs; a release there hands the GIL to another caller
#: thread and the wait's end then waits for that thread's next release: the measurements
#: are at hps/gpu/device_table.py's _HELD_SPIN_KEYS)
HELD_KEYS = 1 << 14


def run(calls: tuple[Any, Any, Any, Any], fast: FastLaunch, keys_ptr: int, n: int,
        out_ptr: int, stream_ptr: int, ws: Any, gate: FastGate) -> int:
    """A fast query (the checks done by the caller): its miss count, or FALLBACK when the
    gate was closed or the caller's device is not the table's. A caller's overlap task
    (hps/gpu/overlap.py) runs between the launch and the wait; a launch error raises as
    CuPy's driver errors do."""
    query, launch, wait, held = calls
    if overlap.has_task():
        result = launch(fast.address, keys_ptr, n, out_ptr, stream_ptr)
        if result == 0:
            overlap.run_task()
            result = wait(fast.address)
    else:
        result = (held if n <= HELD_KEYS else query)(fast.address, keys_ptr, n, out_ptr,
                                                     stream_ptr)
    if result >= 0 or result == FALLBACK:
        return int(result)
    if result == TIMED_OUT:  # a long kernel, or one queued behind other work
        try:
            kernels.cupy_module().cuda.runtime.eventSynchronize(ws.event_ptr)
            return int(ws.host_count[0])
        finally:
            gate.leave()
    kernels.cupy_module().cuda.driver.check_status(int(FALLBACK - result))
    raise RuntimeError(f"cuLaunchKernel failed with status {int(FALLBACK - result)}")
