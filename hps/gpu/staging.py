"""Per-thread buffers of the GPU lookup path: what moves between host and device.

- `MissStaging`: the misses of one lookup on their way back to the device. One pinned host
  buffer laid out as [keys int64 | set codes uint64 | inverse int32 | rows float32] is
  filled on the host (dedupe, codes and the tier fetch write straight into it) and sent
  in one host-to-device copy (large batches: the rows in a few chunks, each sent while
  the next is fetched) into its device mirror, which the scatter and insert kernels read.
- `Scratch`: device buffers for keys and outputs that cannot be used in place (host
  arrays, keys narrower than 64 bits, strided arrays) and a pinned buffer for host keys.

Buffers grow (doubling) and are reused by every later lookup of the thread; nothing is
allocated per call once they are large enough. Reuse is ordered with CUDA events: the
pinned buffer is refilled only after its last copy finished, the device buffer is
overwritten only after the kernels that read it (on whatever stream) are done.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hps.gpu.kernels import held_calls

_H2D = 1  # cudaMemcpyHostToDevice
_D2H = 2  # cudaMemcpyDeviceToHost
# Large miss batches send their rows in chunks of this many bytes, each while the host
# fetches the next (the copy engine and the host's cores work at once).
CHUNK_BYTES = 16 << 20


def _align(n: int) -> int:
    return -(-n // 256) * 256


class _RawStream:
    """A CUDA stream handle in the CUDA stream protocol (`__cuda_stream__`)."""

    def __init__(self, ptr: int) -> None:
        self._ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._ptr)


def external_stream(cupy: Any, ptr: int) -> Any:
    """A CuPy stream over the CUDA stream `ptr` (use as a context: CuPy's operations in
    it run on that stream)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_RawStream(ptr))
    return cupy.cuda.ExternalStream(ptr)


def device_view(cupy: Any, ptr: int, shape: tuple[int, ...], dtype: Any, owner: Any) -> Any:
    """A CuPy array over device memory at `ptr` that `owner` keeps alive (no copy)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize  # not np.prod: ~3 µs on the miss path
    mem = cupy.cuda.UnownedMemory(ptr, max(nbytes, 1), owner)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


class MissStaging:
    """One thread's staging of miss batches (see the module docstring).

    The layout is that of a batch of `slots` keys, the next power of two at or above the
    batch (at least 256): the views of each layout are made once and sliced per batch,
    and a batch's used bytes stay within twice its own. One event, recorded by `done`
    after the last kernel that reads the device buffer, orders the reuse of both
    buffers."""

    def __init__(self, cupy: Any) -> None:
        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self.nbytes = 0
        self.host: Any = None
        self._host_ptr = 0
        self._host_bytes: np.ndarray = np.empty(0, np.uint8)
        self.device: Any = None
        self.device_ptr = 0
        self.done_event = cupy.cuda.Event(block=False, disable_timing=True)
        self.done_ptr = int(self.done_event.ptr)
        self._pending = False  # work queued before done_event still uses the buffers
        self._held = held_calls()  # the copy and the record keep the GIL
        self._layouts: dict[tuple[int, int], tuple[tuple[int, int, int, int], tuple[Any, ...]]]
        self._layouts = {}
        self._offsets = (0, 0, 0, 0)
        self._dim = 0

    def prepare(self, m: int, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                  np.ndarray]:
        """Host views (keys int64 [m], codes uint64 [m], inverse int32 [m], rows float32
        [m, dim]) for a batch of m keys, free to write (the last batch's copies and
        kernels are done)."""
        if self._pending:
            self._rt.eventSynchronize(self.done_ptr)
            self._pending = False
        slots = max(256, 1 << (m - 1).bit_length())
        layout = self._layouts.get((slots, dim))
        if layout is None:
            layout = self._layout(slots, dim)
        self._offsets, (keys, codes, inverse, rows) = layout
        self._dim = dim
        return keys[:m], codes[:m], inverse[:m], rows[:m]

    def _layout(self, slots: int, dim: int
                ) -> tuple[tuple[int, int, int, int], tuple[Any, ...]]:
        off_codes = _align(slots * 8)
        off_inv = off_codes + _align(slots * 8)
        off_rows = off_inv + _align(slots * 4)
        total = off_rows + slots * dim * 4
        if total > self.nbytes:
            self.nbytes = max(total, 2 * self.nbytes, 1 << 16)
            self.host = self._cp.cuda.alloc_pinned_memory(self.nbytes)
            self._host_ptr = int(self.host.ptr)
            self._host_bytes = np.frombuffer(self.host, dtype=np.uint8, count=self.nbytes)
            self.device = self._cp.empty(self.nbytes, dtype=np.uint8)
            self.device_ptr = int(self.device.data.ptr)
            self._layouts = {}  # views of the old buffers
        b = self._host_bytes
        views = (b[:slots * 8].view(np.int64), b[off_codes:off_codes + slots * 8].view(np.uint64),
                 b[off_inv:off_inv + slots * 4].view(np.int32),
                 b[off_rows:off_rows + slots * dim * 4].view(np.float32).reshape(slots, dim))
        layout = ((0, off_codes, off_inv, off_rows), views)
        self._layouts[(slots, dim)] = layout
        return layout

    def device_ptrs(self) -> tuple[int, int, int, int]:
        """Device addresses of keys, codes, inverse and rows (as laid out by prepare)."""
        d = self.device_ptr
        o = self._offsets
        return d, d + o[1], d + o[2], d + o[3]

    def send(self, u: int, stream_ptr: int) -> None:
        """Copies keys, codes, inverse and u rows to the device, on the stream, in one
        copy."""
        self._copy(0, self._offsets[3] + u * self._dim * 4, stream_ptr)

    def send_index(self, stream_ptr: int) -> None:
        """Copies keys, codes and inverse (not the rows) to the device."""
        self._copy(0, self._offsets[3], stream_ptr)

    def send_rows(self, first: int, stop: int, stream_ptr: int) -> None:
        """Copies rows [first, stop) to the device."""
        row = self._dim * 4
        self._copy(self._offsets[3] + first * row, (stop - first) * row, stream_ptr)

    def _copy(self, offset: int, nbytes: int, stream_ptr: int) -> None:
        self._held.copy_to_device(self.device_ptr + offset, self._host_ptr + offset, nbytes,
                                  stream_ptr)

    def done(self, stream_ptr: int) -> None:
        """Records that the batch's copies and kernels are queued on the stream up to
        here; the next batch waits for them before it reuses the buffers."""
        self._held.record(self.done_ptr, stream_ptr)
        self._pending = True


class Scratch:
    """One thread's device buffers for keys and outputs that are not usable in place, and
    a pinned buffer for host keys on their way to the device."""

    def __init__(self, cupy: Any, dim: int) -> None:
        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self.dim = dim
        self._keys: Any = None
        self._out: Any = None
        self._pinned: Any = None
        self._pinned_keys: np.ndarray = np.empty(0, np.int64)
        self._pinned_ptr = 0
        self._keys_ptr = 0

    def device_keys(self, n: int) -> Any:
        """A device int64 [n] buffer."""
        self._reserve_keys(n)
        return self._keys[:n]

    def _reserve_keys(self, n: int) -> int:
        """The device address of a buffer of at least n int64 keys."""
        if self._keys is None or self._keys.size < n:
            self._keys = self._cp.empty(max(n, 2 * (0 if self._keys is None else
                                                    self._keys.size), 1024), dtype=np.int64)
            self._keys_ptr = int(self._keys.data.ptr)
        return self._keys_ptr

    def device_out(self, n: int, dtype: Any = np.float32) -> Any:
        """A device [n, dim] buffer of `dtype` (float32 or a 16-bit output type)."""
        dtype = np.dtype(dtype)
        need = n * self.dim * dtype.itemsize
        have = 0 if self._out is None else self._out.size
        if have < need:
            self._out = self._cp.empty(max(need, 2 * have, 1024 * self.dim * 4), dtype=np.uint8)
        return self._out[:need].view(dtype).reshape(n, self.dim)

    def keys_to_device(self, keys: np.ndarray, stream_ptr: int) -> int:
        """Copies host integer keys (any width, any layout) to the device as int64, on the
        stream; returns the device address. The pinned buffer is reused by the next call:
        the query that follows on the stream is waited for, so the copy is done by then."""
        n = keys.size
        if self._pinned_keys.size < n:
            size = max(n, 2 * self._pinned_keys.size, 1024)
            self._pinned = self._cp.cuda.alloc_pinned_memory(size * 8)
            self._pinned_keys = np.frombuffer(self._pinned, dtype=np.int64, count=size)
            self._pinned_ptr = int(self._pinned.ptr)
        staged = self._pinned_keys[:n]
        if keys.dtype == np.uint64:
            keys = keys.view(np.int64)
        np.copyto(staged, keys.reshape(-1), casting="unsafe")
        ptr = self._reserve_keys(n)  # the address alone: no CuPy view made per call
        self._rt.memcpyAsync(ptr, self._pinned_ptr, n * 8, _H2D, stream_ptr)
        return ptr

    def copy_to_host(self, src_ptr: int, dst_ptr: int, nbytes: int, stream_ptr: int) -> None:
        """Copies nbytes of device rows at src_ptr to host memory at dst_ptr (a contiguous
        output) and waits for them."""
        self._rt.memcpyAsync(dst_ptr, src_ptr, nbytes, _D2H, stream_ptr)
        self._rt.streamSynchronize(stream_ptr)

    def out_to_host(self, src_ptr: int, out: np.ndarray, stream_ptr: int) -> None:
        """Copies the device rows at src_ptr into a host [n, dim] array of their dtype
        (contiguous or strided) and waits for them."""
        if out.flags.c_contiguous:
            self.copy_to_host(src_ptr, out.ctypes.data, out.shape[0] * self.dim *
                              out.itemsize, stream_ptr)
            return
        staged = np.empty((out.shape[0], self.dim), out.dtype)
        self.copy_to_host(src_ptr, staged.ctypes.data, staged.nbytes, stream_ptr)
        np.copyto(out, staged)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def fetch_pool() -> ThreadPoolExecutor:
    """The threads that fetch large miss batches' rows, one per core (made on first use)."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(os.cpu_count() or 1,
                                           thread_name_prefix="hps-gpu-fetch")
    return _pool
