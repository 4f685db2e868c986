"""hps/gpu/fast_query.py's gate between fast queries and writers, on the CPU: the compiled
calls over stand-ins of cuLaunchKernel and cuEventRecord (numba cfuncs) driven by real
threads, the GIL released as on the GPU machine. The stand-in launch "runs" for some µs,
reading the writer's flag all along, then writes the miss count where the query waits for
it; a launch that saw the flag set counts as a violation (a gate that closes without
waiting for the queries in flight makes some). The GPU path itself: tests/gpu and the
threads profile."""

from __future__ import annotations

import ctypes
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from numba import cfunc, types

from hps.gpu import fast_query
from hps.runtime.raw_memory import _atomic_add64, _store32, _store64, _u64, _u64_acquire

# the stand-in kernel's parameter block: where to write the count, where the shared words
# are: the writer's flag, the launches made during a write, all launches
COUNT_AT, SHARED = 0, 1
WRITING, VIOLATIONS, LAUNCHES = range(3)
RUN_READS = 4000  # how long a stand-in kernel "runs": some µs of reads of the flag
_LAUNCH_ARGS = (types.uint64, *([types.uint32] * 7), types.uint64, types.uint64, types.uint64)


@cfunc(types.int32(*_LAUNCH_ARGS))
def _launch(fn: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
            stream: int, params: int, extra: int) -> int:
    p = np.int64(params)
    shared = np.int64(_u64(p + SHARED * 8))
    writing = np.int64(0)
    for _ in range(RUN_READS):  # the "kernel" reads the table for a while
        writing |= np.int64(_u64_acquire(shared + WRITING * 8))
    if writing != 0:
        _atomic_add64(shared + VIOLATIONS * 8, np.int64(1))
    _atomic_add64(shared + LAUNCHES * 8, np.int64(1))
    _store32(np.int64(_u64(p + COUNT_AT * 8)), np.int64(gx))  # the "miss count": the grid
    return 0


@cfunc(types.int32(types.uint64, types.uint64))
def _record(event: int, stream: int) -> int:
    return 0


CONTEXT = 7  # the stand-in context every thread has current


@cfunc(types.int32(types.uint64))
def _context(where: int) -> int:
    _store64(np.int64(where), np.int64(CONTEXT))
    return 0


def _driver() -> tuple[Any, Any, Any]:
    u64, u32, i32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32
    launch = ctypes.CFUNCTYPE(i32, u64, u32, u32, u32, u32, u32, u32, u32, u64, u64, u64)(
        _launch.address)
    record = ctypes.CFUNCTYPE(i32, u64, u64)(_record.address)
    context = ctypes.CFUNCTYPE(i32, u64)(_context.address)
    return launch, record, context


@pytest.fixture(scope="module")
def calls() -> tuple[Any, Any, Any, Any]:
    return fast_query.compile_calls(*_driver())


def _fast_launch(gate: fast_query.FastGate, shared: np.ndarray, tick: bool = True,
                 context: int = CONTEXT
                 ) -> tuple[fast_query.FastLaunch, tuple[Any, ...], np.ndarray]:
    """A fast launch of its own count and parameter block (kept alive by the launch's
    stand-in), over the shared words."""
    count = np.zeros(2, np.int32)
    params = np.array([count.ctypes.data, shared.ctypes.data], np.int64)
    cells = (ctypes.c_uint64(), ctypes.c_int64(), ctypes.c_uint64(), ctypes.c_int32(),
             ctypes.c_float(), ctypes.c_uint64() if tick else None)
    launch = SimpleNamespace(function_address=1, params_address=params.ctypes.data,
                             keep=(params, count))
    ws = SimpleNamespace(host_ptr=count.ctypes.data, event_ptr=0, capacity=4096)
    fast = fast_query.bind(gate, launch, cells, 16384, 256, 0, True, ws, 256, 1 << 16, 8,
                           0, 0.0, context)
    return fast, cells, count


def test_a_query_fills_its_launch_and_returns_the_count(calls: Any) -> None:
    query = calls[0]
    gate = fast_query.FastGate()
    shared = np.zeros(3, np.int64)
    fast, cells, _ = _fast_launch(gate, shared)
    assert query(fast.address, 111, 1000, 4096, 0) == fast_query.FALLBACK  # closed at first
    gate.open()
    assert query(fast.address, 111, 1000, 4096, 0) == 4  # ceil(1000 / 256) blocks
    assert cells[0].value == 111 and cells[1].value == 1000 and cells[2].value == 4096
    assert cells[3].value == 1  # 16-byte aligned output
    assert query(fast.address, 111, 600, 4100, 0) == 3
    assert cells[3].value == 0 and cells[1].value == 600
    assert cells[5].value == 2 << 8  # the second query's tick, shifted by RANK_SHIFT
    assert gate.next_tick() == 3  # the locked path's ticks follow the fast ones
    assert gate.words[fast_query.ENTERED] == 0 and shared[LAUNCHES] == 2
    # another device current: the locked path switches devices, nothing is queued here
    other, _, _ = _fast_launch(gate, shared, context=CONTEXT + 1)
    assert query(other.address, 111, 1000, 4096, 0) == fast_query.FALLBACK
    assert shared[LAUNCHES] == 2 and gate.words[fast_query.ENTERED] == 0


def test_no_launch_while_a_writer_holds_the_table(calls: Any) -> None:
    query = calls[0]
    gate = fast_query.FastGate()
    gate.open()
    shared = np.zeros(3, np.int64)
    launches = [_fast_launch(gate, shared) for _ in range(4)]
    results: list[dict[str, int]] = [{"served": 0, "fallback": 0, "other": 0}
                                     for _ in launches]
    stop = threading.Event()

    def caller(i: int) -> None:
        fast = launches[i][0]
        while not stop.is_set():
            for _ in range(200):  # the GIL released in each call
                r = query(fast.address, 8, 512, 0, 0)
                kind = {2: "served", fast_query.FALLBACK: "fallback"}.get(r, "other")
                results[i][kind] += 1

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(launches))]
    for t in threads:
        t.start()
    writes = 0
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and writes < 300:
        gate.close()  # every query in flight has left when this returns
        shared[WRITING] = 1
        end = time.perf_counter() + 50e-6  # the "write": queries keep trying meanwhile
        while time.perf_counter() < end:
            pass
        shared[WRITING] = 0
        gate.open()
        writes += 1
        time.sleep(100e-6)
    stop.set()
    for t in threads:
        t.join()
    assert shared[VIOLATIONS] == 0
    assert sum(r["other"] for r in results) == 0  # every count landed; no launch failed
    served = sum(r["served"] for r in results)
    assert served == shared[LAUNCHES] and served > 0
    assert sum(r["fallback"] for r in results) > 0  # the gate was met closed
    assert gate.words[fast_query.ENTERED] == 0
