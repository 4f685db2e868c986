"""Whether hps's GPU table scales with callers that hold no GIL (GPU machine; a diagnostic
of issue 39 item 2, not a benchmark of the public call).

`hps bench gpu --profile threads` times Python threads calling `lookup_fromdlpack`; every
such call holds the GIL for its Python, so its threads share one interpreter lock. Here
the same query kernel of the same table (a dynamic cache holding the whole 4M x 64 table,
2,000 keys a call, `--uniform` or power-law keys) is driven by N native threads instead:
POSIX threads started through ctypes, each running a numba `cfunc` that never touches
Python. Each thread has its own stream, keys, output and query workspace (its launch
bound to them as the lookup path binds a thread's), and loops, as HierarchicalKV's C++
`find` benchmark does with its own threads: reset the miss count, cuLaunchKernel the
query, spin until the kernel's last block writes the count, cuStreamSynchronize.

Beside each N: HierarchicalKV's published `find` at that N (issue 39's measurement:
2,000 uniform keys, d64, 16M keys in GPU memory, H100), and, from Python threads with
their streams set once in the same run, the `torch.index_select` floor, the public call,
and the thinnest Python call of the same launch: the thread reads its tensors' pointers
(`data_ptr()`) and calls one numba function that releases the GIL, writes them into its
bound launch, launches and spins for the count (the shape of a torch operator: the GIL
held only to read the arguments), then synchronizes its stream as the floor does; then
the same after hps's own reading of the tensors (`device_pair`: "+ read"), and after
that reading and what any public call resolves first, the model's served version and
its table ("+ lean"), each over the floor. Every
thread's output is compared with the table after its native run.

    python scripts/probe_native_callers.py [--threads 1,2,4,8] [--calls 20000] [--uniform]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# the per-thread block of int64 words a native caller reads (and writes its results into)
FN, GRID, BLOCK, STREAM, PARAMS, COUNT_AT, CALLS, CONTEXT = range(8)
STATUS, DONE, GATE, CLOCK_AT, KEYS_CELL, OUT_CELL, T0, T1 = 8, 9, 10, 11, 12, 13, 14, 15
HEAD = 16  # then one latency (ns) per call


def native_caller() -> Any:
    """The cfunc a native thread runs: `int64 caller(int64 *block)` (see the layout above)."""
    from numba import cfunc, types

    from hps.runtime.raw_memory import _u32_acquire

    cuda = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    libc = ctypes.CDLL(None)
    u64, u32, i32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32
    set_context = cuda.cuCtxSetCurrent
    set_context.argtypes, set_context.restype = [u64], i32
    launch = cuda.cuLaunchKernel
    launch.argtypes = [u64, u32, u32, u32, u32, u32, u32, u32, u64, u64, u64]
    launch.restype = i32
    sync = cuda.cuStreamSynchronize
    sync.argtypes, sync.restype = [u64], i32
    memset = libc.memset
    memset.argtypes, memset.restype = [u64, i32, u64], u64
    clock = libc.clock_gettime
    clock.argtypes, clock.restype = [i32, u64], i32

    @cfunc(types.int64(types.CPointer(types.int64)))
    def caller(b: Any) -> int:
        status = set_context(np.uint64(b[CONTEXT]))
        if status != 0:
            b[STATUS] = status
            return 0
        while _u32_acquire(b[GATE]) == 0:  # every thread starts at once
            pass
        one = np.uint32(1)
        for i in range(b[CALLS]):
            clock(np.int32(1), np.uint64(b[CLOCK_AT]))  # CLOCK_MONOTONIC
            start = b[T0] * 1_000_000_000 + b[T1]
            memset(np.uint64(b[COUNT_AT]), np.int32(-1), np.uint64(4))  # the count's sentinel
            status = launch(np.uint64(b[FN]), np.uint32(b[GRID]), one, one,
                            np.uint32(b[BLOCK]), one, one, np.uint32(0),
                            np.uint64(b[STREAM]), np.uint64(b[PARAMS]), np.uint64(0))
            if status != 0:
                b[STATUS] = status
                return 0
            while np.int32(_u32_acquire(b[COUNT_AT])) == -1:
                pass
            status = sync(np.uint64(b[STREAM]))
            if status != 0:
                b[STATUS] = status
                return 0
            clock(np.int32(1), np.uint64(b[CLOCK_AT]))  # CLOCK_MONOTONIC
            b[HEAD + i] = b[T0] * 1_000_000_000 + b[T1] - start
            b[DONE] = i + 1
        return 0

    return caller


def _store_intrinsic(bits: int) -> Any:
    """store(address, value): a plain store of `bits` bits at an integer address."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def store(typingctx: Any, address: Any, value: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            pointer = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
            builder.store(builder.trunc(args[1], ir.IntType(bits)) if bits < 64 else args[1],
                          pointer)
            return context.get_dummy_value()

        return types.void(address, value), codegen

    return store


def thin_python_call() -> Any:
    """`thin(block_address, keys_ptr, out_ptr) -> miss count`: the launch of a native
    caller's block, from Python, the GIL released throughout."""
    from numba import njit, types

    from hps.runtime.raw_memory import _u32_acquire, _u64

    cuda = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    u64, u32, i32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32
    launch = cuda.cuLaunchKernel
    launch.argtypes = [u64, u32, u32, u32, u32, u32, u32, u32, u64, u64, u64]
    launch.restype = i32
    store64, store32 = _store_intrinsic(64), _store_intrinsic(32)

    @njit(types.int32(types.int64, types.int64, types.int64), nogil=True)
    def thin(b: int, keys_ptr: int, out_ptr: int) -> int:
        store64(np.int64(_u64(b + KEYS_CELL * 8)), keys_ptr)
        store64(np.int64(_u64(b + OUT_CELL * 8)), out_ptr)
        count_at = np.int64(_u64(b + COUNT_AT * 8))
        store32(count_at, np.int64(-1))
        one = np.uint32(1)
        status = launch(np.uint64(_u64(b + FN * 8)), np.uint32(_u64(b + GRID * 8)), one, one,
                        np.uint32(_u64(b + BLOCK * 8)), one, one, np.uint32(0),
                        np.uint64(_u64(b + STREAM * 8)), np.uint64(_u64(b + PARAMS * 8)),
                        np.uint64(0))
        if status != 0:
            return -status
        while True:
            count = np.int32(_u32_acquire(count_at))
            if count != -1:
                return count

    return thin


def run_native(blocks: list[np.ndarray], caller: Any) -> float:
    """Runs one native thread per block from one gate; the seconds from the gate opening
    to the last thread's end."""
    libc = ctypes.CDLL(None)
    create, join = libc.pthread_create, libc.pthread_join
    create.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p]
    join.argtypes = [ctypes.c_uint64, ctypes.c_void_p]
    gate = np.zeros(1, np.int32)
    handles = []
    for b in blocks:
        b[GATE] = gate.ctypes.data
        b[CLOCK_AT] = b.ctypes.data + T0 * 8
        handle = ctypes.c_uint64()
        if create(ctypes.byref(handle), None, caller.address, b.ctypes.data) != 0:
            raise OSError("pthread_create failed")
        handles.append(handle)
    begin = time.perf_counter()
    gate[0] = 1
    for handle in handles:
        join(handle.value, None)  # ctypes releases the GIL while it waits
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2,4,8")
    parser.add_argument("--calls", type=int, default=20000, help="calls per native thread")
    parser.add_argument("--seconds", type=float, default=1.0, help="per Python-threads point")
    parser.add_argument("--table-keys", type=int, default=1 << 22)
    parser.add_argument("--uniform", action="store_true")
    args = parser.parse_args()

    import cupy as cp
    import torch

    from hps import write_sparse_model
    from hps.gpu import kernels
    from hps.gpu.workspace import QueryWorkspace
    from hps.intake.keys import device_pair
    from hps.tools.bench.gpu_public import MODEL, server_over_folder
    from hps.tools.bench.gpu_threads import HKV_FIND, _draws, _drive

    dim, n = 64, 2000
    counts = [int(c) for c in args.threads.split(",")]
    most = max(counts)
    rng = np.random.default_rng(0)
    keys = rng.choice(2**40, args.table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((args.table_keys, dim)).astype(np.float32)
    dense = torch.as_tensor(rows, device="cuda:0")
    all_keys = torch.as_tensor(keys, device="cuda:0")
    streams = [torch.cuda.Stream() for _ in range(most)]
    pos = [torch.as_tensor(p, device="cuda:0")
           for p in _draws(rng, args.table_keys, n, most, 1.1, args.uniform)]
    dkeys = [all_keys[p].contiguous() for p in pos]
    outs = [torch.empty((n, dim), device="cuda:0") for _ in range(most)]
    with tempfile.TemporaryDirectory() as tmp:
        write_sparse_model(Path(tmp) / "t0", keys, rows)
        hps = server_over_folder(Path(tmp), dim, n, 0, embedding_cache_type="dynamic",
                                 gpucacheper=1.0, hit_rate_threshold=1.0)
    try:
        table = hps.server.model(MODEL).tables[0].gpu[0]._table
        for t in range(most):  # every key into the cache before anything is timed
            hps.lookup_fromdlpack(dkeys[t], outs[t], MODEL, 0)
        torch.cuda.synchronize()

        # each native thread's launch, bound to its own workspace as the lookup path binds
        # a thread's: the launch _enqueue makes, captured with its grid
        captured: dict[str, tuple[int, int, int, int]] = {}
        original = kernels.Launch.go_recorded

        def capture(self: Any, grid: int, block: int, stream_ptr: int, event_ptr: int
                    ) -> None:
            captured["launch"] = (int(self._fptr), int(self._params), grid, block)
            original(self, grid, block, stream_ptr, event_ptr)

        context = ctypes.c_uint64()
        cuda = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
        cuda.cuCtxGetCurrent(ctypes.byref(context))
        workspaces, blocks = [], []
        kernels.Launch.go_recorded = capture  # type: ignore[method-assign]
        try:
            for t in range(most):
                ws = QueryWorkspace(cp, 0)
                ws.reserve(n)
                pair = device_pair(dkeys[t], outs[t])
                assert pair is not None
                kp, count, op, _, _, _, out_type = pair
                table._enqueue(kp, count, op, 0.0, ws, streams[t].cuda_stream, out_type, 0)
                streams[t].synchronize()
                fn, params, grid, block = captured["launch"]
                cells = ws.launches[out_type][0][3]  # keys, n, out, ... of the small query
                assert ws.launches[out_type][0][0] >= n
                b = np.zeros(HEAD + args.calls, np.int64)
                b[[FN, GRID, BLOCK, STREAM, PARAMS, COUNT_AT, CALLS, CONTEXT, KEYS_CELL,
                   OUT_CELL]] = (
                    fn, grid, block, streams[t].cuda_stream, params, ws.host_ptr,
                    args.calls, context.value, ctypes.addressof(cells[0]),
                    ctypes.addressof(cells[2]))
                workspaces.append(ws)
                blocks.append(b)
        finally:
            kernels.Launch.go_recorded = original  # type: ignore[method-assign]
        caller = native_caller()

        def floor(t: int, i: int) -> int:
            torch.index_select(dense, 0, pos[t], out=outs[t])
            streams[t].synchronize()
            return n

        def public(t: int, i: int) -> int:
            hps.lookup_fromdlpack(dkeys[t], outs[t], MODEL, 0)
            streams[t].synchronize()
            return n

        thin = thin_python_call()
        addresses = [b.ctypes.data for b in blocks]

        def thin_call(t: int, i: int) -> int:
            if thin(addresses[t], dkeys[t].data_ptr(), outs[t].data_ptr()) < 0:
                raise RuntimeError("the thin call's launch failed")
            streams[t].synchronize()
            return n

        registry = hps.server._registry

        def thin_read(t: int, i: int) -> int:
            # the thin call after hps's own reading of the two tensors (device_pair: dtype,
            # device, contiguity, sizes, the current stream)
            pair = device_pair(dkeys[t], outs[t])
            if thin(addresses[t], pair[0], pair[2]) < 0:
                raise RuntimeError("the thin call's launch failed")
            streams[t].synchronize()
            return n

        def thin_lean(t: int, i: int) -> int:
            # ... and what any public call resolves first: the model's served version
            # (held for the call) and its table
            loaded = registry.acquire(MODEL)
            try:
                loaded.table(0)
                pair = device_pair(dkeys[t], outs[t])
                if thin(addresses[t], pair[0], pair[2]) < 0:
                    raise RuntimeError("the thin call's launch failed")
            finally:
                loaded.refs.release()
            streams[t].synchronize()
            return n

        def set_stream(t: int) -> None:
            torch.cuda.set_stream(streams[t])

        keys_kind = "uniform" if args.uniform else "power law (alpha 1.1)"
        print(f"2,000 {keys_kind} keys a call, dim 64, a dynamic cache holding the whole "
              f"{args.table_keys:,}-key table; M keys/s (p99 us)")
        print(f"{'threads':>7s} {'native hps':>16s} {'HierarchicalKV':>16s} {'x HKV':>6s} "
              f"{'Python floor':>16s} {'x floor':>7s} {'Python hps':>16s} {'Python thin':>16s} "
              f"{'x floor':>7s} {'+ read':>7s} {'+ lean':>7s} {'wrong':>6s}")
        for threads in counts:
            chosen = blocks[:threads]
            for b in chosen:
                b[STATUS] = b[DONE] = 0
            elapsed = run_native(chosen, caller)
            failed = [int(b[STATUS]) for b in chosen if b[STATUS]]
            if failed:
                raise RuntimeError(f"a native caller stopped with CUDA status {failed[0]}")
            latencies = np.concatenate([b[HEAD:HEAD + b[DONE]] for b in chosen]) / 1e3
            rate = threads * args.calls * n / elapsed / 1e6
            p99 = float(np.percentile(latencies, 99))
            wrong = 0
            for t in range(threads):
                want = rows[pos[t].cpu().numpy()]
                wrong += int((outs[t].cpu().numpy() != want).any(axis=1).sum())
            floor_rate, floor_p99 = _drive(threads, args.seconds, floor, set_stream)
            public_rate, public_p99 = _drive(threads, args.seconds, public, set_stream)
            thin_rate, thin_p99 = _drive(threads, args.seconds, thin_call, set_stream)
            read_rate = _drive(threads, args.seconds, thin_read, set_stream)[0]
            lean_rate = _drive(threads, args.seconds, thin_lean, set_stream)[0]
            hkv, hkv_p99 = HKV_FIND.get(threads, (float("nan"), float("nan")))
            print(f"{threads:7d} {rate:9.1f} ({p99:4.0f}) {hkv:9.1f} ({hkv_p99:4.0f}) "
                  f"{rate / hkv:6.2f} {floor_rate / 1e6:9.1f} ({floor_p99:4.0f}) "
                  f"{rate * 1e6 / floor_rate:7.2f} {public_rate / 1e6:9.1f} "
                  f"({public_p99:4.0f}) {thin_rate / 1e6:9.1f} ({thin_p99:4.0f}) "
                  f"{thin_rate / floor_rate:7.2f} {read_rate / floor_rate:7.2f} "
                  f"{lean_rate / floor_rate:7.2f} {wrong:6d}", flush=True)
    finally:
        hps.close()


if __name__ == "__main__":
    main()
