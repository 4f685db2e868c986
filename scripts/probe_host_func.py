"""Could a lookup leave its miss count to the stream? Three ways a caller thread can learn
what a kernel found, timed from 1, 2, 4 and 8 threads on their own streams.

A query today waits on the host for its miss count, spinning with the GIL kept
(hps/gpu/device_table.py query_ptr), so its caller threads take turns for the GPU's round
trip, where `torch.index_select` callers, which wait only in their stream sync with the
GIL released, overlap theirs (docs/gpu-latency.md, "Streams set once per thread"). The
lever that note names is a call that queues the miss handling behind the query (a host
function that reads the count on the driver's thread, then a kernel that uses what it
wrote) and returns without waiting. This probe times its skeleton beside the two others,
with a one-warp kernel standing for the query, launched as the query is (GIL kept), each
call then a stream sync (GIL released):

- `sync`: the kernel, then the stream sync (the floor's shape);
- `spin`: the kernel writes a word of mapped host memory after a system fence, and the
  thread spins on it with the GIL kept, then syncs (today's shape);
- `host_func`: the kernel, a host function (`cuLaunchHostFunc`, a numba cfunc: no GIL, no
  CUDA call) that reads the word and writes another, a second kernel that reads that one,
  then the sync (the proposed shape: nothing waits in the call).

Per variant and thread count: calls/s of all threads and the p99 of one call (launches
through hps/gpu/kernels.py Launch, the lookup's own launcher). Needs CuPy and a CUDA device.

    python scripts/probe_host_func.py [--seconds 1.5]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hps.gpu.kernels import Launch  # noqa: E402
from hps.runtime.raw_memory import wait_while_held  # noqa: E402
from hps.tools.bench.gpu_threads import _drive  # noqa: E402

_SOURCE = r"""
extern "C" __global__ void mark(int* word, int value) {
    if (threadIdx.x == 0) { __threadfence_system(); *(volatile int*)word = value; }
}
extern "C" __global__ void after(const int* word, int* sink) {
    if (threadIdx.x == 0) { sink[0] = *(volatile const int*)word; }
}
"""
_NO_WORD = -1


def _host_fn() -> Any:
    """The host function: word[1] = word[0] + 1, compiled, run on the driver's thread."""
    from numba import cfunc, types

    @cfunc(types.void(types.CPointer(types.int32)), nopython=True)
    def copy_word(word: Any) -> None:
        word[1] = word[0] + 1

    return copy_word


def _timed(threads: int, seconds: float, make_call: Any) -> tuple[float, float]:
    """calls/s and p99 (µs) of `threads` threads, each looping a call `make_call()` made on
    it and warmed up there (the threads profile's driver, one "key" a call)."""
    calls: list[Any] = [None] * threads

    def setup(t: int) -> None:
        call = calls[t] = make_call()
        for _ in range(200):  # warm-up: launches, the context on this thread
            call()

    def one(t: int, i: int) -> int:
        calls[t]()
        return 1

    return _drive(threads, seconds, one, setup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args()
    import cupy

    module = cupy.RawModule(code=_SOURCE)
    mark_fn, after_fn = module.get_function("mark"), module.get_function("after")
    driver = ctypes.PyDLL("libcuda.so.1")  # a PyDLL keeps the GIL: a short driver call
    driver.cuLaunchHostFunc.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    driver.cuLaunchHostFunc.restype = ctypes.c_int
    host_fn = _host_fn().address
    rt = cupy.cuda.runtime

    def make(variant: str) -> Any:
        def make_call() -> Any:
            rt.setDevice(0)
            stream = cupy.cuda.Stream(non_blocking=True)
            s = stream.ptr
            pinned = cupy.cuda.alloc_pinned_memory(64)  # mapped: unified addressing
            word = np.frombuffer(pinned, np.int32, 16)
            ptr = pinned.ptr
            sink = cupy.zeros(16, np.int32)
            mark, after = Launch(mark_fn, "ptr i32"), Launch(after_fn, "ptr ptr")
            mark.set(0, ptr)
            mark.set(1, 7)
            after.set(0, ptr + 4)
            after.set(1, int(sink.data.ptr))
            keep = (stream, pinned, sink)  # alive while the thread runs

            def sync_call() -> None:
                mark.go_recorded(1, 32, s, 0)
                rt.streamSynchronize(s)

            def spin_call() -> None:
                word[0] = _NO_WORD
                mark.go_recorded(1, 32, s, 0)
                if wait_while_held(ptr, _NO_WORD, 1 << 20) == _NO_WORD:
                    raise RuntimeError("the kernel's word never landed")
                rt.streamSynchronize(s)

            def host_func_call() -> None:
                mark.go_recorded(1, 32, s, 0)
                status = driver.cuLaunchHostFunc(s, host_fn, ptr)
                if status:
                    raise RuntimeError(f"cuLaunchHostFunc: CUDA error {status}")
                after.go_recorded(1, 32, s, 0)
                rt.streamSynchronize(s)

            call = {"sync": sync_call, "spin": spin_call, "host_func": host_func_call}[variant]
            call.keep = keep  # type: ignore[attr-defined]
            return call

        return make_call

    print(f"{'variant':10s} {'threads':>7s} {'calls/s':>10s} {'p99 us':>8s}")
    for threads in (1, 2, 4, 8):
        for variant in ("sync", "spin", "host_func"):
            rate, p99 = _timed(threads, args.seconds, make(variant))
            print(f"{variant:10s} {threads:7d} {rate:10.0f} {p99:8.1f}", flush=True)


if __name__ == "__main__":
    main()
