"""hps/gpu/merged_query.py's bookkeeping on the CPU: the compiled merged lookup over
stand-ins of the driver calls (numba cfuncs) driven by real threads, the GIL released as on
the GPU machine. The stand-in launches "run" their kernel inside the call: a caller's own
query writes each row as twice its key and counts the negative keys as misses; the merged
kernel does the same for every batch of its parameters, into each batch's own output,
miss positions and count. Every caller checks its own answer: batches joined, split back,
none lost, none served twice. The GPU path itself: tests/test_every_gpu.py and the threads
profile (`hps bench gpu --profile threads`)."""

from __future__ import annotations

import ctypes
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from numba import cfunc, types

from hps.gpu import fast_query, merged_query
from hps.runtime.raw_memory import _atomic_add64, _store32, _store64, _u64, _u64_acquire

OWN, MERGED = 1, 2  # the stand-in kernels' function handles
# words the stand-ins count in: own launches, merged launches, batches they served
OWN_LAUNCHES, MERGED_LAUNCHES, MERGED_BATCHES = range(3)
RUN_READS = 200_000  # how long an own query "runs" (~0.1 ms): others arrive meanwhile
_LAUNCH_ARGS = (types.uint64, *([types.uint32] * 7), types.uint64, types.uint64, types.uint64)
CONTEXT = 7


@cfunc(types.void(types.int64, types.int64, types.int64, types.int64, types.int64))
def _serve(keys: int, n: int, out: int, miss_pos: int, host_count: int) -> None:
    misses = 0
    for i in range(n):
        key = np.int64(_u64(keys + i * 8))
        _store64(out + i * 8, key * 2)
        if key < 0:
            _store32(miss_pos + misses * 4, np.int64(i))
            misses += 1
    _store32(host_count, np.int64(misses))


@cfunc(types.int32(*_LAUNCH_ARGS))
def _launch(fn: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
            stream: int, params: int, extra: int) -> int:
    p = np.int64(params)
    if fn == OWN:  # the fast launch's parameter block: its cells, then ours
        cell = lambda i: np.int64(_u64(np.int64(_u64(p + i * 8))))  # noqa: E731
        counters = np.int64(_u64(p + 6 * 8))
        spin = np.int64(0)
        for _ in range(RUN_READS):
            spin += np.int64(_u64_acquire(counters))
        _serve(cell(0), cell(1), cell(2), np.int64(_u64(p + 7 * 8)),
               np.int64(_u64(p + 8 * 8)))
        _atomic_add64(counters + OWN_LAUNCHES * 8, np.int64(1) + spin * 0)
        return 0
    batches = np.int64(_u64(p))
    counters = np.int64(_u64(np.int64(_u64(p + 8))))
    count = np.int64(_u64(batches + merged_query.MAX_MERGED * merged_query.BATCH_WORDS * 8))
    for b in range(count):
        at = batches + b * merged_query.BATCH_WORDS * 8
        _serve(np.int64(_u64(at + merged_query.B_KEYS * 8)),
               np.int64(_u64(at + merged_query.B_N * 8)),
               np.int64(_u64(at + merged_query.B_OUT * 8)),
               np.int64(_u64(at + merged_query.B_MISS_POS * 8)),
               np.int64(_u64(at + merged_query.B_HOST_COUNT * 8)))
    _atomic_add64(counters + MERGED_LAUNCHES * 8, np.int64(1))
    _atomic_add64(counters + MERGED_BATCHES * 8, count)
    return 0


@cfunc(types.int32(types.uint64, types.uint64))
def _record(event: int, stream: int) -> int:
    return 0


@cfunc(types.int32(types.uint64, types.uint64, types.uint32))
def _wait(stream: int, event: int, flags: int) -> int:
    return 0


@cfunc(types.int32(types.uint64))
def _context(where: int) -> int:
    _store64(np.int64(where), np.int64(CONTEXT))
    return 0


@pytest.fixture(scope="module")
def lookup() -> Any:
    u64, u32, i32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32
    launch = ctypes.CFUNCTYPE(i32, u64, u32, u32, u32, u32, u32, u32, u32, u64, u64, u64)(
        _launch.address)
    record = ctypes.CFUNCTYPE(i32, u64, u64)(_record.address)
    wait = ctypes.CFUNCTYPE(i32, u64, u64, u32)(_wait.address)
    context = ctypes.CFUNCTYPE(i32, u64)(_context.address)
    libc = ctypes.CDLL(None)
    libc.sched_yield.argtypes, libc.sched_yield.restype = [], i32
    fast = fast_query.compile_calls(launch, record, context)
    return merged_query.compile_call(launch, record, wait, context, libc.sched_yield,
                                     fast[1], fast[2])


class Caller:
    """One thread's workspace: its fast launch over the stand-in's parameter block, its
    count word and miss positions, and the words a posted batch carries."""

    def __init__(self, gate: fast_query.FastGate, counters: np.ndarray, most: int) -> None:
        self.count = np.zeros(2, np.int32)
        self.miss_pos = np.zeros(most, np.int32)
        self.cells = (ctypes.c_uint64(), ctypes.c_int64(), ctypes.c_uint64(), ctypes.c_int32(),
                      ctypes.c_float(), None)
        pointers = [ctypes.addressof(c) for c in self.cells[:5]] + [0]
        self.params = np.array([*pointers, counters.ctypes.data, self.miss_pos.ctypes.data,
                                self.count.ctypes.data], np.int64)
        launch = SimpleNamespace(function_address=OWN, params_address=self.params.ctypes.data)
        ws = SimpleNamespace(host_ptr=self.count.ctypes.data, event_ptr=0, capacity=most,
                             ctl_ptr=0, positions_ptr=self.miss_pos.ctypes.data, keys_ptr=0)
        self.fast = fast_query.bind(gate, launch, self.cells, most, 256, 0, True, ws, 256,
                                    1 << 16, 8, 0, 0.0, CONTEXT)
        self.words = merged_query.workspace_words(ws, True)


def _merger(gate: fast_query.FastGate, counters: np.ndarray) -> merged_query.Merger:
    values = [ctypes.c_uint64(counters.ctypes.data), ctypes.c_float(0.0)]
    launch = SimpleNamespace(function_address=MERGED, values=values)
    return merged_query.Merger(launch, 1, -1, 11, 12, gate, 256, 256, 8)


def test_concurrent_batches_are_joined_and_split_back_exactly(lookup: Any) -> None:
    gate = fast_query.FastGate()
    gate.open()
    counters = np.zeros(3, np.int64)
    merger = _merger(gate, counters)
    threads_n, calls_each, most = 8, 300, 512
    callers = [Caller(gate, counters, most) for _ in range(threads_n)]
    errors: list[str] = []
    results = [{"direct": 0, "fallback": 0} for _ in range(threads_n)]
    start = threading.Barrier(threads_n)

    def run(t: int) -> None:
        c = callers[t]
        rng = np.random.default_rng(t)
        start.wait()
        for call in range(calls_each):
            n = int(rng.integers(1, most))
            keys = rng.integers(-50, 10_000, n).astype(np.int64) + t * 1_000_000
            out = np.zeros(n, np.int64)
            r = lookup(merger.address, c.fast.address, c.words.ctypes.data,
                       keys.ctypes.data, n, out.ctypes.data, 0)
            if r == fast_query.FALLBACK:
                results[t]["fallback"] += 1
                continue
            want = np.flatnonzero(keys < 0)
            if not np.array_equal(out, keys * 2):
                errors.append(f"thread {t}, call {call}: rows not its own")
            if r != want.size or not np.array_equal(np.sort(c.miss_pos[:r]), want):
                errors.append(f"thread {t}, call {call}: misses {r} != {want.size}")
            results[t]["direct"] += 1

    threads = [threading.Thread(target=run, args=(t,)) for t in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a caller never got its answer"
    assert not errors, errors[:5]
    served = sum(r["direct"] for r in results)
    assert sum(r["fallback"] for r in results) == 0  # the gate stayed open
    assert served == threads_n * calls_each
    # every batch served exactly once: by its own launch or in one merged launch
    assert counters[OWN_LAUNCHES] + counters[MERGED_BATCHES] == served
    assert counters[MERGED_BATCHES] > 0, "no batch was ever merged"
    assert counters[MERGED_BATCHES] > counters[MERGED_LAUNCHES], "no launch served two"
    stats = merger.stats()
    assert stats == {"merged_launches": counters[MERGED_LAUNCHES],
                     "merged_batches": counters[MERGED_BATCHES]}
    assert gate.words[fast_query.ENTERED] == 0 and merger.words[merged_query.M_OWNER] == 0
    assert (merger.slots[:, merged_query.S_STATE] == merged_query.FREE).all()


def test_a_closed_gate_sends_every_batch_to_the_locked_path(lookup: Any) -> None:
    gate = fast_query.FastGate()  # closed until opened: a write pending
    counters = np.zeros(3, np.int64)
    merger = _merger(gate, counters)
    caller = Caller(gate, counters, 64)
    keys = np.arange(10, dtype=np.int64)
    out = np.zeros(10, np.int64)
    # as owner (nothing else in flight): its own launch meets the gate
    assert lookup(merger.address, caller.fast.address, caller.words.ctypes.data,
                  keys.ctypes.data, 10, out.ctypes.data, 0) == fast_query.FALLBACK
    # as a posted batch: the owner word held by another caller, which serves it
    merger.words[merged_query.M_OWNER] = 1
    answer: list[int] = []
    t = threading.Thread(target=lambda: answer.append(lookup(
        merger.address, caller.fast.address, caller.words.ctypes.data, keys.ctypes.data, 10,
        out.ctypes.data, 0)))
    t.start()
    while merger.slots[0, merged_query.S_STATE] != merged_query.POSTED:
        pass
    merger.words[merged_query.M_OWNER] = 0  # the owner leaves: the caller serves itself
    t.join(30)
    assert answer == [fast_query.FALLBACK]
    assert (out == 0).all() and counters.sum() == 0  # nothing launched
    gate.open()
    assert lookup(merger.address, caller.fast.address, caller.words.ctypes.data,
                  keys.ctypes.data, 10, out.ctypes.data, 0) == 0
    assert (out == keys * 2).all() and gate.words[fast_query.ENTERED] == 0
