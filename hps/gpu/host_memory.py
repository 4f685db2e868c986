"""Pinned host memory that kernels read and write directly through a mapped device pointer.

    mem = MappedHostMemory(cupy, nbytes, huge_pages=True)
    mem.device_ptr        # address kernels use (mapped; unified addressing: == host_ptr)
    mem.view(np.float32)  # the same bytes as a NumPy array
    mem.close()

A kernel that reads rows at random from gigabytes of host memory pays an address
translation per page it touches, on the GPU and in the IOMMU; with 4 KiB pages nearly every
row read misses the translation caches. So by default the memory is an anonymous mapping
advised as transparent huge pages (2 MiB), faulted in, then pinned and mapped with
cudaHostRegister (portable, mapped). Where that fails (no CUDA registration of anonymous
memory in this environment), or with huge_pages=False, it is CuPy's PinnedMemory
(cudaHostAlloc, portable and mapped). `kind` says which one it is.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import weakref
from typing import Any

import numpy as np

from hps.errors import DeviceError

_HUGE = 2 << 20
_MAPPED_PORTABLE = 3  # cudaHostAllocPortable | cudaHostAllocMapped (same bits for Register)
# Lookup results in pinned memory: each up to this size, and this much alive at once;
# the rest are NumPy arrays in pageable memory (copied through the driver's staging).
PINNED_RESULT_BYTES = 64 << 20
PINNED_RESULTS_BYTES = 256 << 20


class MappedHostMemory:
    """`nbytes` of pinned, device-mapped host memory, zeroed. Raises DeviceError when the
    memory cannot be pinned. Not thread-safe; close() once nothing reads it."""

    def __init__(self, cupy: Any, nbytes: int, *, huge_pages: bool = True) -> None:
        self._cp = cupy
        self.nbytes = int(nbytes)
        self._map: mmap.mmap | None = None
        self._pinned: Any = None
        self._registered = 0
        self.kind = ""
        if huge_pages:
            self._map_huge()
        if not self.kind:
            self._alloc_pinned()
        self.device_ptr = self.host_ptr
        try:  # the mapped address; the host's own wherever addressing is unified
            attrs = cupy.cuda.runtime.pointerGetAttributes(self.host_ptr)
            self.device_ptr = int(attrs.devicePointer) or self.host_ptr
        except Exception:
            pass

    def _map_huge(self) -> None:
        rt = self._cp.cuda.runtime
        m = mmap.mmap(-1, self.nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anchor = ctypes.c_char.from_buffer(m)
        base = ctypes.addressof(anchor)
        del anchor  # the buffer export ends here; m stays mapped
        offset = (-base) % _HUGE
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            try:
                m.madvise(advice, offset, self.nbytes)
            except OSError:
                pass  # no transparent huge pages here: 4 KiB pages, still registered
        np.frombuffer(m, np.uint8, count=self.nbytes, offset=offset).fill(0)  # fault in
        try:
            rt.hostRegister(base + offset, self.nbytes, _MAPPED_PORTABLE)
        except Exception:
            m.close()
            return
        self._map = m
        self._offset = offset
        self.host_ptr = base + offset
        self._registered = self.host_ptr
        self.kind = "registered huge pages"

    def _alloc_pinned(self) -> None:
        try:
            self._pinned = self._cp.cuda.PinnedMemory(self.nbytes, _MAPPED_PORTABLE)
        except Exception as exc:
            raise DeviceError(
                f"cannot pin {self.nbytes / 2**30:.2f} GiB of host memory: {exc}") from None
        self.host_ptr = int(self._pinned.ptr)
        ctypes.memset(self.host_ptr, 0, self.nbytes)
        self.kind = "cudaHostAlloc"

    def view(self, dtype: Any) -> np.ndarray:
        """The memory as a flat NumPy array of `dtype` (valid until close)."""
        count = self.nbytes // np.dtype(dtype).itemsize
        raw: np.ndarray = np.ctypeslib.as_array(
            (ctypes.c_byte * self.nbytes).from_address(self.host_ptr))
        view: np.ndarray = raw.view(dtype)[:count]
        return view

    def close(self) -> None:
        """Unpins and frees the memory. Idempotent."""
        if self._registered:
            try:
                self._cp.cuda.runtime.hostUnregister(self._registered)
            except Exception:
                pass
            self._registered = 0
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive: the mapping goes with it
                pass
            self._map = None
        self._pinned = None  # cudaFreeHost when the last reference goes

    def __del__(self) -> None:
        self.close()


def mapped_address(cupy: Any, host_ptr: int) -> int:
    """The address kernels write host memory at `host_ptr` through, where it is pinned
    and mapped into the device's address space (with unified addressing, all pinned
    memory CUDA allocated: `pinned_empty`'s, torch's pin_memory), else 0."""
    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(host_ptr)
    except Exception:  # memory CUDA has never seen, on older runtimes
        return 0
    if int(attrs.type) != 1:  # cudaMemoryTypeHost
        return 0
    return int(attrs.devicePointer)


class _PinnedResults:
    """The bytes of the pinned results alive now (see pinned_empty)."""

    def __init__(self) -> None:
        self.alive = 0
        self.lock = threading.Lock()

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.alive -= nbytes


_results = _PinnedResults()


def pinned_empty(cupy: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A new uninitialized C-contiguous host array, in pinned memory from CuPy's pinned
    pool when it fits the limits above (returned to the pool when the array goes),
    else a NumPy array."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)  # np.prod of a tuple costs ~3 µs of a ~50 µs HPS.lookup
    nbytes = count * dtype.itemsize
    if not 0 < nbytes <= PINNED_RESULT_BYTES:
        return np.empty(shape, dtype)
    with _results.lock:
        if _results.alive + nbytes > PINNED_RESULTS_BYTES:
            return np.empty(shape, dtype)
        _results.alive += nbytes
    try:
        memory = cupy.cuda.alloc_pinned_memory(nbytes)
    except Exception:  # no pinned memory to be had: pageable serves the same
        _results.release(nbytes)
        return np.empty(shape, dtype)
    flat = np.frombuffer(memory, dtype, count)
    # on the flat array: every view of the result (NumPy's bases collapse) refers to it
    weakref.finalize(flat, _results.release, nbytes).atexit = False
    return flat.reshape(shape)
