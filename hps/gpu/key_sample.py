"""Samples of a GPU table's looked-up keys, taken on the device for its hot-key sketch.

The keys of a GPU lookup stay on the device; only the cache's misses come to the host. So
that a table's hot keys are the keys it is looked up with (what a replica warmed from its
hot set needs in its cache), the server hands each GPU lookup's keys to the table's
`KeySampler` after the lookup is queued:

    sampler = KeySampler(sketch.feed_sample, every=16, most=64, devices=[0])
    if not next(sampler.calls) & sampler.mask:      # every 16th call of the table
        sampler.device_keys(keys_ptr, n, device, stream)   # or sampler.take(ref, ...)

A sampled call copies at most `most` of its keys, every stride-th from a start that
rotates from call to call (stride = ceil(n / most)), in one cudaMemcpy2DAsync (source
pitch: the stride; keys strided in memory: their stride times it) on the caller's
stream into a free slot of a small ring of pinned host buffers, and records an event
after it (a window of m neighbouring keys in one cudaMemcpyAsync measured no cheaper on
the H100, and samples a batch's positions less evenly). Nothing waits for the copy: the
samples whose event has completed (queried, not waited for) are fed to the sketch at the
next sampled call, or when the sketch is read (`drain`, the sketch's `pending` hook), each
key weighted as the host path weights its samples (every × stride, key_sketch.py).
Host keys (HPS.lookup of NumPy keys on a GPU table) are sampled the same way and fed at
once.

Cost on the lookup path: an unsampled call pays one counter increment and a bit test
(the caller's); a sampled one a copy launch, an event record, the event queries of the
slots in flight and the feed of a ready sample, and the caller's next sync waits for
the small copy too. On the H100 (`lookup_fromdlpack` of 2,000 torch keys, a static table
of width 64, sampling on and off in turns in one process): p50 +2.3%, mean +10% (the
1 call in 16 that samples: ~17 µs of host time queuing the copy and event, ~20 µs
feeding the previous sample; the GPU's part is under 1 µs): docs/operating.md#what-it-costs.
Feeding on a thread of its own instead measured worse in the same setting (p50 +10%,
mean +22%): that thread's wake-ups take the GIL from the callers.

What is skipped rather than waited for: a sampled call that finds the sampler busy
(another thread in it) or every slot of its device's ring still in flight (the GPU far
behind), and keys that are strided in more than one dimension. Each is counted in
`skipped`; the weights of the samples fed stay right, fewer of them are taken.

The ring's pinned memory is cudaHostAlloc'd for the sampler alone (portable; never a
pool's, which could hand it to another user while a copy into it is in flight) and freed
with it: a version's sampler goes with its tables, once its last lookup is done.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from hps.gpu.host_memory import MappedHostMemory
from hps.intake.array_ref import ArrayRef

#: slots of a device's ring: samples in flight at once (each `most` int64 keys)
SLOTS = 8
_D2H = 2  # cudaMemcpyDeviceToHost
_INT64 = np.dtype(np.int64)
_UINT64 = np.dtype(np.uint64)


class KeySampler:
    """Takes 1 GPU lookup in `every` (a power of two) of one table, at most `most` keys
    of it, for `feed(keys, stride)` (KeySketch.feed_sample); see the module docstring.
    Thread-safe. `calls` and `mask` are read by the caller: a call whose
    `next(calls) & mask` is 0 is sampled."""

    def __init__(self, feed: Callable[[np.ndarray, int], None], every: int, most: int,
                 devices: Iterable[int] = ()) -> None:
        import cupy

        if every < 1 or every & (every - 1):
            raise ValueError(f"every must be a power of two >= 1, got {every}")
        self._cp = cupy
        self._feed = feed
        self.mask = every - 1
        self.calls = itertools.count(1)
        self._most = most
        self._turn = 0
        self._lock = threading.Lock()
        # device → (pinned memory, its int64 [SLOTS, most] view, each slot's address (read
        # once: ndarray.ctypes costs microseconds), events, slots in flight: None or
        # (keys, dtype, stride) per slot)
        self._rings: dict[int, tuple[Any, np.ndarray, list[int], list[Any], list[Any]]] = {}
        #: sampled calls not taken (busy, ring full, keys strided in several dimensions)
        self.skipped = 0
        #: samples fed to the sketch
        self.fed = 0
        for device in devices:
            self._ring(device)

    def device_keys(self, ptr: int, n: int, device: int, stream: int) -> None:
        """Sample n > 0 C-contiguous int64 keys at device address `ptr` on `device`,
        copied on `stream` (the caller's, after its lookup)."""
        self._copy(ptr, n, 8, 8, _INT64, device, stream)

    def take(self, keys: ArrayRef, stream: int | None) -> None:
        """Sample the keys of a lookup's general path, as the server read them (checked
        integers, host or device; `stream`: the lookup's, None for CuPy's current one)."""
        n = keys.size
        if n == 0:
            return
        if keys.on_host:
            self._host(keys.host_array().reshape(-1))
            return
        itemsize = keys.dtype.itemsize
        if keys.contiguous:
            pitch = itemsize
        elif len(keys.shape) == 1 and keys.strides is not None and keys.strides[0] > 0:
            pitch = keys.strides[0]
        else:
            self.skipped += 1
            return
        if stream is None:
            with self._cp.cuda.Device(keys.device):
                stream = self._cp.cuda.get_current_stream().ptr
        self._copy(keys.ptr, n, itemsize, pitch, keys.dtype, keys.device, stream)

    def drain(self) -> None:
        """Feed the samples whose copies are done (none waited for)."""
        with self._lock:
            self._drain()

    # -- inside --------------------------------------------------------------------------

    def _stride(self, n: int) -> tuple[int, int, int]:
        """(start, stride, count) of the keys a batch of n gives."""
        stride = (n + self._most - 1) // self._most
        start = self._turn % stride
        self._turn += 1
        return start, stride, (n - start + stride - 1) // stride

    def _host(self, flat: np.ndarray) -> None:
        if not self._lock.acquire(False):
            self.skipped += 1
            return
        try:
            start, stride, _ = self._stride(flat.size)
            sample = np.ascontiguousarray(flat[start::stride])
            sample = sample.view(np.int64) if sample.dtype == _UINT64 else sample
            self._feed(sample.astype(np.int64, copy=False), stride)
            self.fed += 1
        finally:
            self._lock.release()

    def _copy(self, ptr: int, n: int, itemsize: int, pitch: int, dtype: np.dtype[Any],
              device: int, stream: int) -> None:
        if not self._lock.acquire(False):
            self.skipped += 1
            return
        try:
            self._drain()
            _, _, addresses, events, flight = self._rings.get(device) or self._ring(device)
            try:
                slot = flight.index(None)
            except ValueError:  # every slot in flight: this sample is dropped, not waited for
                self.skipped += 1
                return
            start, stride, m = self._stride(n)
            rt = self._cp.cuda.runtime
            previous = rt.getDevice()
            if previous != device:
                rt.setDevice(device)
            try:
                rt.memcpy2DAsync(addresses[slot], itemsize, ptr + start * pitch,
                                 stride * pitch, itemsize, m, _D2H, stream)
                rt.eventRecord(events[slot].ptr, stream)
            finally:
                if previous != device:
                    rt.setDevice(previous)
            flight[slot] = (m, dtype, stride)
        finally:
            self._lock.release()

    def _drain(self) -> None:
        """Feed the ready samples (the lock held)."""
        for _, slots, _, events, flight in self._rings.values():
            for slot, held in enumerate(flight):
                if held is None or not events[slot].done:
                    continue
                m, dtype, stride = held
                keys = slots[slot].view(dtype)[:m]
                if dtype == _UINT64:
                    keys = keys.view(np.int64)
                elif dtype != _INT64:
                    keys = keys.astype(np.int64)
                self._feed(keys, stride)
                self.fed += 1
                flight[slot] = None

    def _ring(self, device: int) -> tuple[Any, np.ndarray, list[int], list[Any], list[Any]]:
        cp = self._cp
        with cp.cuda.Device(device):
            memory = MappedHostMemory(cp, SLOTS * self._most * 8, huge_pages=False)
            events = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(SLOTS)]
        slots = memory.view(np.int64).reshape(SLOTS, self._most)
        addresses = [memory.host_ptr + i * self._most * 8 for i in range(SLOTS)]
        ring = (memory, slots, addresses, events, [None] * SLOTS)
        self._rings[device] = ring
        return ring
