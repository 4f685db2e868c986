"""Samples of a GPU table's looked-up keys, taken on the device for its hot-key sketch.

The keys of a GPU lookup stay on the device; only the cache's misses come to the host. So
that a table's hot keys are the keys it is looked up with (what a replica warmed from its
hot set needs in its cache), the server hands each GPU lookup's keys to the table's
`KeySampler` after the lookup is queued:

    sampler = KeySampler(sketch.feed_sample, every=16, most=64, devices=[0])
    if not next(sampler.calls) & sampler.mask:      # every 16th call of the table
        sampler.device_keys(keys_ptr, n, device, stream)   # or sampler.take(ref, ...)

A sampled call copies at most `most` of its keys, every stride-th from a start that
rotates from call to call (stride = ceil(n / most)): one tiny kernel (cuda/key_sample.cu)
on the caller's stream, launched through the driver with the GIL held, packs them into a
free slot of a small ring of mapped pinned host memory and then writes the slot's ticket.
Nothing waits for it: one thread of the process (`_Feeder`) feeds every sampler's
arrived samples (a ticket is a word read, no CUDA call) to their sketches every
FEED_INTERVAL while any is in flight, in one pass, and so does a read of the sketch
(`drain`, the sketch's `pending` hook), and a sampled call that finds its ring full; each
key weighted as the host path weights its samples (every × stride, key_sketch.py). Host
keys (HPS.lookup of NumPy keys on a GPU table, an HTTP lookup that the host tiers answer)
are sampled the same way and fed at once.

Cost on the lookup path: an unsampled call pays one counter increment and a bit test
(the caller's); a sampled one a launch, and the caller's next sync waits for the small
kernel too. Before, the copy was a cudaMemcpy2DAsync and an event record through CuPy's
runtime (each releasing the GIL), and each sampled call fed the sample before it: on the
H100 (`lookup_fromdlpack` of 2,000 torch keys, a static table of width 64, 1 in 16
sampled) a sampled call took 22-29 µs more than a call with no sampler. Feeding on a
thread that woke for each sample measured worse still (p50 +10%, mean +22%): its wake-ups
took the GIL from the callers. The feeder wakes 100 times a second while device samples
are in flight, and sleeps while none is: an HTTP worker whose lookups the host tiers answer
(hps/server/http_path.py) launches none, and a feeder that woke 100 times a second anyway
took 0.037 cores of its 8 workers, idle or loaded (one H200, 2026-11-29).
`python -m hps.tools.bench.gpu_sampling` measures the cost.

What is skipped rather than waited for: a sampled call that finds every slot of its
device's ring still in flight (the GPU far behind), keys that are strided in more than
one dimension, and keys of neither 4 nor 8 bytes (the kernel moves those two widths).
Each is counted in `skipped`; the weights of the samples fed stay right, fewer of them
are taken. Threads wait for one another only over the slots (a launch, a pass over
them: microseconds); the sketch is fed by one thread at a time, outside that lock.

The ring's pinned memory is cudaHostAlloc'd for the sampler alone (portable, mapped;
never a pool's, which could hand it to another user while a kernel writes it) and freed
with it: a version's sampler goes with its tables, once its last lookup is done.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from hps.gpu import kernels
from hps.gpu.host_memory import MappedHostMemory
from hps.intake.array_ref import ArrayRef

#: slots of a device's ring: samples in flight at once (each `most` int64 keys), enough
#: for the samples of one FEED_INTERVAL at tens of thousands of lookups a second
SLOTS = 64
#: how often the feeder thread feeds the samples that have arrived (seconds), while any
#: is in flight
FEED_INTERVAL = 0.01
#: how long the feeder sleeps with no sample in flight before it looks whether any
#: sampler is left (seconds): it ends once none is
IDLE_CHECK = 1.0
_SIGNATURE = "ptr i64 i32 i32 ptr ptr u64"  # cuda/key_sample.cu sample_keys
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
        self._lock = threading.Lock()  # the rings' slots and the stride's turn
        self._feeding = threading.Lock()  # the sketch's feed, one thread at a time
        self._tickets = itertools.count(1)
        # device → its _Ring
        self._rings: dict[int, _Ring] = {}
        #: sampled calls not taken (ring full, keys strided in several dimensions or
        #: neither 4 nor 8 bytes wide)
        self.skipped = 0
        #: samples fed to the sketch
        self.fed = 0
        for device in devices:
            self._ring(device)
        _FEEDER.add(self)

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
        """Feed the samples that have arrived (none waited for), after any feed another
        thread is making: what the sketch shows next includes every sample that arrived."""
        with self._feeding:
            with self._lock:
                ready = self._arrived()
            self._feed_all(ready)

    def feed_arrived(self) -> bool:
        """drain() for the feeder: nothing at all while no sample is in flight (read
        without the lock: one queued meanwhile has woken the feeder again). Whether some
        were in flight as it began: they were fed now, or are still on their way."""
        if not any(ring.busy for ring in self._rings.values()):
            return False
        self.drain()
        return True

    # -- inside --------------------------------------------------------------------------

    def _stride(self, n: int) -> tuple[int, int, int]:
        """(start, stride, count) of the keys a batch of n gives."""
        stride = (n + self._most - 1) // self._most
        start = self._turn % stride
        self._turn += 1
        return start, stride, (n - start + stride - 1) // stride

    def _host(self, flat: np.ndarray) -> None:
        with self._lock:
            start, stride, _ = self._stride(flat.size)
        sample = np.ascontiguousarray(flat[start::stride])
        sample = sample.view(np.int64) if sample.dtype == _UINT64 else sample
        with self._feeding:
            self._feed_all([(sample.astype(np.int64, copy=False), stride)])

    def _copy(self, ptr: int, n: int, itemsize: int, pitch: int, dtype: np.dtype[Any],
              device: int, stream: int) -> None:
        if itemsize not in (4, 8):
            self.skipped += 1
            return
        with self._lock:  # held for a few µs by anyone: a launch, or a pass over the slots
            ring = self._rings.get(device) or self._ring(device)
            if ring.free:
                self._launch(ring, ring.free.pop(), ptr, n, itemsize, pitch, dtype, device,
                             stream)
                return
        self.drain()  # every slot taken: feed the arrived ones here
        with self._lock:
            if ring.free:
                self._launch(ring, ring.free.pop(), ptr, n, itemsize, pitch, dtype, device,
                             stream)
            else:  # none arrived: this sample is dropped, not waited for
                self.skipped += 1

    def _launch(self, ring: _Ring, slot: int, ptr: int, n: int, itemsize: int, pitch: int,
                dtype: np.dtype[Any], device: int, stream: int) -> None:
        """Queue the copy of a sample into `slot` on `stream` (the lock held)."""
        start, stride, m = self._stride(n)
        ticket = next(self._tickets)
        cells = ring.cells
        cells[0].value = ptr + start * pitch
        cells[1].value = stride * pitch
        cells[2].value = itemsize
        cells[3].value = m
        cells[4].value = ring.device_ptrs[slot]
        cells[5].value = ring.ticket_ptrs[slot]
        cells[6].value = ticket
        rt = self._cp.cuda.runtime
        previous = rt.getDevice()
        if previous != device:
            rt.setDevice(device)
        try:
            ring.launch.go_recorded(1, self._most, stream, 0)
        finally:
            if previous != device:
                rt.setDevice(previous)
        ring.flight[slot] = (m, dtype, stride, ticket)
        ring.busy.append(slot)
        _FEEDER.wake()

    def _arrived(self) -> list[tuple[np.ndarray, int]]:
        """The samples whose ticket has arrived, copied out as int64 with their stride,
        their slots freed (the lock held)."""
        ready = []
        for ring in self._rings.values():
            flight, tickets, waiting = ring.flight, ring.tickets, []
            for slot in ring.busy:
                m, dtype, stride, ticket = flight[slot]
                if tickets[slot] != ticket:
                    waiting.append(slot)
                    continue
                keys = ring.slots[slot].view(dtype)[:m]
                if dtype == _UINT64:
                    keys = keys.view(np.int64)
                ready.append((keys.astype(np.int64), stride))  # a copy: the slot is free
                flight[slot] = None
                ring.free.append(slot)
            ring.busy = waiting
        return ready

    def _feed_all(self, ready: list[tuple[np.ndarray, int]]) -> None:
        """Feed samples to the sketch (the feeding lock held: one feeder at a time, so
        the sketch never skips one as busy)."""
        for keys, stride in ready:
            self._feed(keys, stride)
            self.fed += 1

    def _ring(self, device: int) -> _Ring:
        ring = _Ring(self._cp, device, self._most)
        self._rings[device] = ring
        return ring


class _Ring:
    """One device's slots: `slots` int64 [SLOTS, most] and `tickets` uint64 [SLOTS] views
    of one mapped pinned allocation, their device addresses (read once: ndarray.ctypes
    costs microseconds), the bound launch of the copy kernel, the samples in flight (None
    or (keys, dtype, stride, ticket) per slot), and which slots are free and which busy
    (so a pass reads only the slots in flight)."""

    def __init__(self, cupy: Any, device: int, most: int) -> None:
        with cupy.cuda.Device(device):
            self.memory = MappedHostMemory(cupy, SLOTS * (most + 1) * 8, huge_pages=False)
            fn = kernels.function("key_sample.cu", "sample_keys", device)
        words = self.memory.view(np.int64)
        self.slots = words[:SLOTS * most].reshape(SLOTS, most)
        self.tickets = words[SLOTS * most:].view(np.uint64)
        base = self.memory.device_ptr
        self.device_ptrs = [base + i * most * 8 for i in range(SLOTS)]
        self.ticket_ptrs = [base + (SLOTS * most + i) * 8 for i in range(SLOTS)]
        self.launch = kernels.Launch(fn, _SIGNATURE)
        self.cells = self.launch.values
        self.flight: list[Any] = [None] * SLOTS
        self.free = list(range(SLOTS))  # slots to take
        self.busy: list[int] = []  # slots in flight, oldest first


class _Feeder:
    """The one thread that feeds every live sampler's arrived samples, every FEED_INTERVAL
    while samples come (started with the first sampler; it ends once none is left). After
    an interval that fed none and left none in flight it sleeps until a launch wakes it
    (`wake`), looking at most IDLE_CHECK later whether any sampler is left. Samplers are
    held weakly: a retired version's sampler goes with its tables."""

    def __init__(self) -> None:
        self._samplers: weakref.WeakSet[KeySampler] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._in_flight = threading.Event()

    def wake(self) -> None:
        """A sample was launched: fed within about FEED_INTERVAL (an attribute read while
        the feeder is awake and the event set)."""
        if not self._in_flight.is_set():
            self._in_flight.set()

    def add(self, sampler: KeySampler) -> None:
        with self._lock:
            self._samplers.add(sampler)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hps-hot-key-feeder",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(FEED_INTERVAL)  # the samples of an interval fed in one pass
            self._in_flight.clear()  # before the pass: a launch from here on sets it
            with self._lock:
                samplers = list(self._samplers)
                if not samplers:
                    self._thread = None
                    return
            busy = False
            for sampler in samplers:
                busy = sampler.feed_arrived() or busy
            del samplers, sampler  # none kept alive while asleep
            if not busy:
                # an interval with nothing fed and nothing in flight: asleep until a
                # launch. Under load every pass feeds, and the thread wakes once an
                # interval, not twice (for the launch, then after the interval).
                self._in_flight.wait(IDLE_CHECK)


_FEEDER = _Feeder()
