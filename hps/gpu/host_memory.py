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
import mmap
from typing import Any

import numpy as np

from hps.errors import DeviceError

_HUGE = 2 << 20
_MAPPED_PORTABLE = 3  # cudaHostAllocPortable | cudaHostAllocMapped (same bits for Register)


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
