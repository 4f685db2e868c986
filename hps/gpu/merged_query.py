"""Concurrent queries of one table on one device merged into one launch.

Why. Under the GIL one launch per caller cannot pass the torch floor: each caller pays its
launch, its event and its wait while it holds the interpreter, and the GIL's switch
interval sets the tail (docs/gpu-latency.md, "Many callers"). Here a caller that finds a
query of the table in flight does not launch: it hands its batch over and waits with the
GIL released, and the caller that holds the device launches one query over every waiting
batch.

How. A table's merger has an owner word and MAX_MERGED batch slots in host memory, and
every step is a compiled call that releases the GIL (`compiled()`):

- a caller takes the owner word (compare-and-swap 0 -> 1). Alone, it runs today's fast
  query (hps/gpu/fast_query.py: launch on its own stream, spin on the miss count), then
  serves the batches posted meanwhile, then gives the word back;
- a caller that finds the word taken claims a free slot, writes its batch (keys, count,
  output, its workspace's miss buffers and count word), records its workspace's event on
  its stream, posts the slot and spins (GIL released) until the slot is done. If the word
  is given back while its slot is still posted, it takes the word and serves the posted
  batches itself: no batch waits for an owner that has left;
- the owner serves the posted batches in rounds (at most ROUNDS, so no caller serves the
  others for ever): it takes each posted slot, enters the table's gate once for the round
  (a closed gate: every batch of the round answers FALLBACK and takes the locked path),
  makes the table's merge stream wait on each batch's event, launches the table's `_many`
  kernel once over them all (the batches by value in its parameters: no copy of keys or
  descriptors; cuda/hps_common.cuh hps_batches), records the merge event and makes each
  batch's stream wait on it, so the output is ready on the caller's stream when its call
  returns, as on the direct path. It spins until every batch's miss count has landed
  (each batch's count, miss positions and missed keys are written to its own workspace,
  as if it had been launched alone), leaves the gate and marks the slots done with their
  counts. A caller whose batch missed keys serves its misses as today (hps/gpu/table.py).

The owner's batch runs on its own stream (a caller alone takes today's path, at today's
cost); merged batches run on the table's merge stream, so a batch never waits behind
another caller's stream's earlier work.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Any

import numpy as np

from hps.gpu import fast_query, kernels

#: batches one merged launch serves (cuda/hps_common.cuh HPS_MAX_MERGED)
MAX_MERGED = 16
#: rounds of merged launches an owner makes before it hands the device over
ROUNDS = 8
#: int64 words of one batch in the kernel's parameters (HPS_BATCH_WORDS)
BATCH_WORDS = 9
# a batch's words, in cuda/hps_common.cuh hps_batch order
(B_KEYS, B_N, B_OUT, B_VEC4, B_CTL, B_HOST_COUNT, B_MISS_POS, B_MISS_KEYS,
 B_FIRST_BLOCK) = range(BATCH_WORDS)
# a slot: its state, its batch, the caller's event and stream, the answer
S_STATE, S_BATCH = 0, 1
S_EVENT, S_STREAM, S_RESULT = 1 + BATCH_WORDS, 2 + BATCH_WORDS, 3 + BATCH_WORDS
SLOT_WORDS = 16
FREE, CLAIMED, POSTED, TAKEN, DONE = 0, 1, 2, 3, 4
# the merger's words
(M_OWNER, M_FN, M_PARAMS, M_STRUCT, M_STREAM, M_EVENT, M_SLOTS, M_TICK_CELL, M_RANK_SHIFT,
 M_KEYS_PER_BLOCK, M_THREADS, M_GATE, M_LAUNCHES, M_MERGED) = range(14)
MERGER_WORDS = 16
# a workspace's words (Merger.batch_of): what a posted batch carries besides its keys,
# count and output
W_CTL, W_HOST_COUNT, W_MISS_POS, W_MISS_KEYS, W_EVENT, W_VEC_OK = range(6)
WS_WORDS = 8
_NO_COUNT = -1
#: spins of a waiting caller before each one yields its core
_SPIN_BEFORE_YIELD = 1 << 12


@lru_cache(maxsize=1)
def compiled() -> Any | None:
    """The merged lookup call compiled against this process's libcuda (see `compile_call`),
    or None where libcuda or numba cannot give it."""
    lib = kernels.driver()
    fast = fast_query.compiled()
    if lib is None or fast is None:
        return None
    libc = ctypes.CDLL(None)
    libc.sched_yield.argtypes, libc.sched_yield.restype = [], ctypes.c_int32
    return compile_call(lib.cuLaunchKernel, lib.cuEventRecord, lib.cuStreamWaitEvent,
                        lib.cuCtxGetCurrent, libc.sched_yield, fast[1], fast[2])


def compile_call(cu_launch: Any, cu_record: Any, cu_wait: Any, cu_context: Any,
                 sched_yield: Any, fast_launch: Any, fast_wait: Any) -> Any:
    """`lookup(merger, fast, ws_words, keys_ptr, n, out_ptr, stream) -> miss count or
    fast_query.FALLBACK` over these driver calls (ctypes functions of the driver's
    signatures) and fast_query's compiled launch and wait, releasing the GIL throughout."""
    from hps.runtime.compiled import numba, types
    from hps.runtime.raw_memory import (
        _atomic_add64,
        _atomic_cas64,
        _store32,
        _store64,
        _u32_acquire,
        _u64,
        _u64_acquire,
    )

    i64, u32, u64 = types.int64, np.uint32, np.uint64

    @numba.njit(inline="always")
    def word(block: int, index: int) -> int:
        return np.int64(_u64(block + index * 8))

    @numba.njit(inline="always")
    def slot_at(m: int, s: int) -> int:
        return word(m, M_SLOTS) + s * SLOT_WORDS * 8

    @numba.njit(nogil=True)
    def serve_round(m: int) -> int:
        """Launch one merged query over the posted batches and wait for it; the batches
        served (0: none was posted)."""
        taken = np.empty(MAX_MERGED, np.int64)
        k = 0
        for s in range(MAX_MERGED):
            slot = slot_at(m, s)
            if _atomic_cas64(slot + S_STATE * 8, POSTED, TAKEN) == POSTED:
                taken[k] = slot
                k += 1
        if k == 0:
            return 0
        gate = word(m, M_GATE)
        _atomic_add64(gate + fast_query.ENTERED * 8, np.int64(1))
        result = np.int64(0)
        if np.int64(_u64_acquire(gate + fast_query.CLOSED * 8)) != 0:
            result = np.int64(fast_query.FALLBACK)  # a write pending: the locked path
        else:
            batches = word(m, M_STRUCT)
            per = word(m, M_KEYS_PER_BLOCK)
            blocks = np.int64(0)
            stream = word(m, M_STREAM)
            for i in range(k):
                slot = taken[i]
                for w in range(BATCH_WORDS - 1):
                    _store64(batches + (i * BATCH_WORDS + w) * 8, word(slot, S_BATCH + w))
                _store64(batches + (i * BATCH_WORDS + B_FIRST_BLOCK) * 8, blocks)
                blocks += (word(slot, S_BATCH + B_N) + per - 1) // per
                if result == 0:
                    result = np.int64(cu_wait(u64(stream), u64(word(slot, S_EVENT)), u32(0)))
            _store64(batches + MAX_MERGED * BATCH_WORDS * 8, k)
            tick_cell = word(m, M_TICK_CELL)
            if tick_cell != 0:
                tick = _atomic_add64(gate + fast_query.TICK * 8, np.int64(1)) + 1
                _store64(tick_cell, tick << word(m, M_RANK_SHIFT))
            one = u32(1)
            if result == 0:
                result = np.int64(cu_launch(u64(word(m, M_FN)), u32(blocks), one, one,
                                            u32(word(m, M_THREADS)), one, one, u32(0),
                                            u64(stream), u64(word(m, M_PARAMS)), u64(0)))
            event = word(m, M_EVENT)
            if result == 0:
                result = np.int64(cu_record(u64(event), u64(stream)))
            for i in range(k):
                if result == 0:
                    result = np.int64(cu_wait(u64(word(taken[i], S_STREAM)), u64(event),
                                              u32(0)))
            if result != 0:  # a driver error: every batch takes the locked path, which
                result = np.int64(fast_query.FALLBACK)  # raises it there if it persists
            else:  # every batch's count lands after its last block's reads
                for i in range(k):
                    at = word(taken[i], S_BATCH + B_HOST_COUNT)
                    spins = 0
                    while np.int32(_u32_acquire(at)) == _NO_COUNT:
                        spins += 1
                        if spins > _SPIN_BEFORE_YIELD:
                            sched_yield()
                _atomic_add64(m + M_LAUNCHES * 8, np.int64(1))
                _atomic_add64(m + M_MERGED * 8, k)
        _atomic_add64(gate + fast_query.ENTERED * 8, np.int64(-1))
        for i in range(k):
            slot = taken[i]
            answer = result
            if answer == 0:
                answer = np.int64(np.int32(_u32_acquire(word(slot, S_BATCH + B_HOST_COUNT))))
            _store64(slot + S_RESULT * 8, answer)
            _atomic_add64(slot + S_STATE * 8, DONE - TAKEN)  # a full fence, then DONE
        return k

    @numba.njit(nogil=True)
    def serve_posted(m: int) -> None:
        for _ in range(ROUNDS):
            if serve_round(m) == 0:
                return

    @numba.njit(nogil=True)
    def own_query(m: int, fast: int, keys_ptr: int, n: int, out_ptr: int, stream: int) -> int:
        count = fast_launch(fast, keys_ptr, n, out_ptr, stream)
        if count == 0:
            count = fast_wait(fast)
            while count == fast_query.TIMED_OUT:  # queued behind the caller's own work
                sched_yield()
                count = fast_wait(fast)
        serve_posted(m)
        _atomic_add64(m + M_OWNER * 8, np.int64(-1))  # a full fence: the slots first
        return count

    def lookup(m: int, fast: int, ws: int, keys_ptr: int, n: int, out_ptr: int,
               stream: int) -> int:
        # the caller's current context must be the table's (its device current): else
        # the locked path switches devices; every launch below is made in it
        if cu_context(u64(fast + fast_query.CURRENT * 8)) != 0 or word(
                fast, fast_query.CURRENT) != word(fast, fast_query.CONTEXT):
            return np.int64(fast_query.FALLBACK)
        owner = m + M_OWNER * 8
        if _atomic_cas64(owner, 0, 1) == 0:
            return own_query(m, fast, keys_ptr, n, out_ptr, stream)
        slot = np.int64(0)
        for s in range(MAX_MERGED):
            at = slot_at(m, s)
            if _atomic_cas64(at + S_STATE * 8, FREE, CLAIMED) == FREE:
                slot = at
                break
        if slot == 0:  # every slot taken: this caller launches its own query
            count = fast_launch(fast, keys_ptr, n, out_ptr, stream)
            if count == 0:
                count = fast_wait(fast)
                while count == fast_query.TIMED_OUT:
                    sched_yield()
                    count = fast_wait(fast)
            return count
        host_count = word(ws, W_HOST_COUNT)
        _store32(host_count, np.int64(_NO_COUNT))
        batch = slot + S_BATCH * 8
        _store64(batch + B_KEYS * 8, keys_ptr)
        _store64(batch + B_N * 8, n)
        _store64(batch + B_OUT * 8, out_ptr)
        _store64(batch + B_VEC4 * 8, np.int64(1 if word(ws, W_VEC_OK) != 0
                                              and out_ptr % 16 == 0 else 0))
        _store64(batch + B_CTL * 8, word(ws, W_CTL))
        _store64(batch + B_HOST_COUNT * 8, host_count)
        _store64(batch + B_MISS_POS * 8, word(ws, W_MISS_POS))
        _store64(batch + B_MISS_KEYS * 8, word(ws, W_MISS_KEYS))
        event = word(ws, W_EVENT)
        _store64(slot + S_EVENT * 8, event)
        _store64(slot + S_STREAM * 8, stream)
        if cu_record(u64(event), u64(stream)) != 0:
            _store64(slot + S_STATE * 8, np.int64(FREE))
            return np.int64(fast_query.FALLBACK)
        _atomic_add64(slot + S_STATE * 8, POSTED - CLAIMED)  # a full fence, then posted
        spins = 0
        while True:
            state = np.int64(_u64_acquire(slot + S_STATE * 8))
            if state == DONE:
                result = word(slot, S_RESULT)
                _atomic_add64(slot + S_STATE * 8, FREE - DONE)
                return result
            if (state == POSTED and np.int64(_u64_acquire(owner)) == 0
                    and _atomic_cas64(owner, 0, 1) == 0):
                serve_posted(m)  # the owner left: this caller serves the posted batches
                _atomic_add64(owner, np.int64(-1))
                continue
            spins += 1
            if spins > _SPIN_BEFORE_YIELD:
                sched_yield()

    return numba.njit(i64(i64, i64, i64, i64, i64, i64, i64), nogil=True)(lookup)


class Merger:
    """One table's merged queries on one device: its owner word and batch slots, the
    parameters of its `_many` kernel (a struct of batches, then the table's own), its
    merge stream and event. Made by DeviceTable once its query kernels are bound."""

    def __init__(self, launch: Any, default_slot: int, tick_slot: int, stream_ptr: int,
                 event_ptr: int, gate: fast_query.FastGate, keys_per_block: int, threads: int,
                 rank_bits: int) -> None:
        """`launch`: the `_many` kernel's kernels.Launch over the table's own parameters
        (the batches come first, from here), their fixed values set; the merge stream and
        event (the caller keeps them alive)."""
        self.words = np.zeros(MERGER_WORDS, np.int64)
        self.slots = np.zeros((MAX_MERGED, SLOT_WORDS), np.int64)
        self.batches = np.zeros(MAX_MERGED * BATCH_WORDS + 1, np.int64)
        self._launch = launch
        self._default = launch.values[default_slot]
        cells = [ctypes.addressof(c) for c in launch.values]
        self._params = (ctypes.c_void_p * (1 + len(cells)))(
            int(self.batches.ctypes.data), *cells)
        w = self.words
        w[M_FN] = launch.function_address or 0
        w[M_PARAMS] = ctypes.addressof(self._params)
        w[M_STRUCT] = int(self.batches.ctypes.data)
        w[M_STREAM], w[M_EVENT] = stream_ptr, event_ptr
        w[M_SLOTS] = int(self.slots.ctypes.data)
        w[M_TICK_CELL] = ctypes.addressof(launch.values[tick_slot]) if tick_slot >= 0 else 0
        w[M_RANK_SHIFT], w[M_KEYS_PER_BLOCK], w[M_THREADS] = rank_bits, keys_per_block, threads
        w[M_GATE] = gate.address
        self.address = int(w.ctypes.data)

    def usable(self, default: float) -> bool:
        """Whether the merged launch serves a query of this default value (the kernel
        has one default per launch: the table's)."""
        if self.words[M_FN] == 0:
            return False
        if self._default.value != default:
            self._default.value = default
        return True

    def stats(self) -> dict[str, int]:
        """Merged launches made and the batches they served."""
        return {"merged_launches": int(self.words[M_LAUNCHES]),
                "merged_batches": int(self.words[M_MERGED])}


def workspace_words(ws: Any, vec_ok: bool) -> np.ndarray:
    """What a workspace's posted batch carries besides keys, count and output: its miss
    buffers, count word and event (Merger slots; rebuilt when the workspace grows)."""
    words = np.zeros(WS_WORDS, np.int64)
    words[W_CTL], words[W_HOST_COUNT] = ws.ctl_ptr, ws.host_ptr
    words[W_MISS_POS], words[W_MISS_KEYS] = ws.positions_ptr, ws.keys_ptr
    words[W_EVENT], words[W_VEC_OK] = ws.event_ptr, int(vec_ok)
    return words
