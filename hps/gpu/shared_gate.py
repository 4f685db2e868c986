"""The gate of a GPU table that several processes query: hps/gpu/fast_query.py's gate in
shared memory, with one writer at a time across the processes.

One process's table orders its writes after its queries with the table's lock and CUDA
events (hps/gpu/write_order.py). Another process's queries and events are out of its
reach, so a table shared through CUDA IPC (hps/gpu/shared_cache.py) orders them on the
host, through words in the shared record every process maps:

- `closed` and the LRU `tick` sit where fast_query's gate has them, so the compiled fast
  query runs unchanged; each process counts its queries in flight in a slot of its own
  (pid, entered), so a process that dies mid-query is found and its count dropped;
- a writer takes the record's file lock (flock: the kernel drops it when its holder dies),
  sets `closed` to its PID, waits until every live process's slot is 0, queues the write,
  waits on the host for it to finish, then clears `closed` and unlocks. A query enters its
  slot, then reads `closed`: either the writer sees the query and waits for it, or the
  query sees the gate closed, leaves and waits. So no query in any process reads a row a
  write is changing, and a query that enters after the gate reopens sees the whole write;
- a writer killed mid-write leaves `closed` set and the lock free: whoever next takes the
  lock with `closed` set cannot know how far the write got, so it empties the table
  (`recover`, the table's) before reopening: lookups miss and refill from the host tiers,
  never read a torn row.

Why host waits and not interprocess events: a write already waits for the miss count of
the lookup that caused it, and the writes are short (an insert of a lookup's misses); a
write's event would have to reach every process's later queries, each of which would then
wait on it on the GPU, and a dead writer's event can never complete.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np

from hps.errors import DeviceError
from hps.gpu.fast_query import CLOSED, ENTERED, TICK, _gate_calls
from hps.runtime.run_dir import pid_alive

#: the gate's words in its region (int64): fast_query's (entered, closed; the tick on the
#: next cache line), the writer's PID (informational: `closed` holds it too) and how many
#: times a dead writer was recovered
WRITER, RECOVERIES = 3, 4
GATE_WORDS = 16
#: process slots after the gate words: (pid, entered), each on a cache line of its own (a
#: query adds to its process's count twice: processes sharing a line would take it from
#: each other on every query)
SLOTS = 128
SLOT_WORDS = 8
REGION_BYTES = (GATE_WORDS + SLOTS * SLOT_WORDS) * 8
#: how long a query waits on a closed gate before it asks whether the writer is alive
_WRITER_SUSPECT_S = 0.02
#: how long a writer waits on a slot's count before it asks whether its process is alive
_READER_SUSPECT_S = 0.002
#: how long a process that attaches waits for the record's lock (held a few µs by a
#: process that attaches or a writer's short write; longer is a process stuck or not ours)
LOCK_WAIT_S = 20.0


class GateFullError(RuntimeError):
    """Every process slot of a shared gate is held by a live process."""


class SharedGate:
    """The gate of one shared table, on `words` (an int64 view of REGION_BYTES of shared
    memory, at address `address`) with `lock_fd` (an open file of the record: its flock is
    the writers' lock), `name` saying whose gate it is in errors. `recover` empties the
    table after a writer died mid-write (called with the lock held and the gate closed).

    Has FastGate's interface (hps/gpu/fast_query.py) plus the cross-process parts; every
    method but the fast path's runs under the table's own lock, as FastGate's do."""

    shared = True

    def __init__(self, words: np.ndarray, address: int, lock_fd: int,
                 recover: Callable[[], None] | None = None,
                 name: str = "the shared GPU cache") -> None:
        self.name = name
        self.words = words
        self.address = address
        self._fd = lock_fd
        self.recover = recover
        self._calls = _gate_calls()
        self._shared_calls = _shared_calls()
        self._held = False
        self._pid = os.getpid()
        self._slot = self._claim_slot()
        self._slot_word = GATE_WORDS + self._slot * SLOT_WORDS
        self.entered_address = address + (self._slot_word + 1) * 8
        self._warned = threading.Event()

    # -- process slots --------------------------------------------------------------------

    def _claim_slot(self) -> int:
        """A free slot (unused, or of a dead process) for this process, under the lock.
        Raises DeviceError when the lock stays held LOCK_WAIT_S."""
        if not lock_within(self._fd, LOCK_WAIT_S):
            raise DeviceError(f"{self.name}: its lock was held by another process for "
                              f"{LOCK_WAIT_S:g} s while this process attached (a writer "
                              "stuck, or a process that is not this server's)")
        try:
            for slot in range(SLOTS):  # a loop over process slots, at attach only
                word = GATE_WORDS + slot * SLOT_WORDS
                pid = int(self.words[word])
                if pid == 0 or (pid != self._pid and not pid_alive(pid)):
                    self.words[word + 1] = 0
                    self.words[word] = self._pid
                    return slot
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        raise GateFullError(f"all {SLOTS} process slots of the shared GPU cache are in use")

    def release_slot(self) -> None:
        """This process queries the table no more (its queries are done)."""
        self.words[self._slot_word + 1] = 0
        self.words[self._slot_word] = 0

    def processes(self) -> list[int]:
        """PIDs of the live processes attached to the table."""
        pids = self.words[GATE_WORDS::SLOT_WORDS][:SLOTS]
        return [int(p) for p in pids if p and pid_alive(int(p))]

    # -- writers --------------------------------------------------------------------------

    def close(self) -> None:
        """Takes the writers' lock (recovering a dead writer's table first), closes the
        gate and waits until no process's query reads the table. `write_queued` ends it."""
        if self._held:
            self._drain()
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # CPython releases the GIL while it waits
        try:
            if self.words[CLOSED]:
                self._recover()
            self._calls[0](self.address)  # closed ← 1 (an atomic exchange: a full fence)
            self.words[CLOSED] = self.words[WRITER] = self._pid
            self._held = True
            self._drain()
        except BaseException:
            self._reopen()
            raise

    def _drain(self) -> None:
        """Waits until every slot's count is 0; a slot whose process died is emptied."""
        drain = self._shared_calls[1]
        base = self.address + GATE_WORDS * 8
        since = time.monotonic()
        while True:
            busy = int(drain(base, SLOTS))
            if busy < 0:
                return
            if time.monotonic() - since > _READER_SUSPECT_S:
                word = GATE_WORDS + busy * SLOT_WORDS
                pid = int(self.words[word])
                if pid != self._pid and not pid_alive(pid):
                    self.words[word + 1] = 0  # a query of a dead process reads nothing
                    self.words[word] = 0
                    continue
            time.sleep(0)

    def write_queued(self, rt: Any, event_ptr: int) -> None:
        """The write that `close` began was queued and recorded `event_ptr` (0: nothing
        queued): waits for it on the host, then reopens the gate and unlocks."""
        if not self._held:
            return
        try:
            if event_ptr:
                rt.eventSynchronize(event_ptr)
        finally:
            self._reopen()

    def _reopen(self) -> None:
        self.words[WRITER] = 0
        self.words[CLOSED] = 0
        self._held = False
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _recover(self) -> None:
        """A writer died between closing the gate and reopening it (the lock held here)."""
        writer = int(self.words[WRITER])
        if self.recover is not None:
            self.recover()
        self.words[RECOVERIES] += 1
        self.words[CLOSED] = self.words[WRITER] = 0
        import logging

        logging.getLogger("hps").warning(
            "the shared GPU cache's writer (pid %d) died mid-write: the cache was emptied "
            "and refills from the host tiers", writer)

    def open(self) -> None:
        """FastGate's reopening by the locked path: here the writer reopens, after its
        write is done, so nothing is left to do."""

    # -- queries --------------------------------------------------------------------------

    def enter(self) -> None:
        """Counts a locked-path query in, waiting while another process writes (and
        recovering the table of a writer that died)."""
        enter = self._shared_calls[0]
        since = 0.0
        while enter(self.address, self.entered_address) != 0:
            now = time.monotonic()
            since = since or now
            if now - since > _WRITER_SUSPECT_S:
                self._recover_if_writer_died()
                since = now
            time.sleep(0)

    def _recover_if_writer_died(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # the writer lives: it holds the lock until its write is done
        try:
            if self.words[CLOSED]:
                self._recover()
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def leave_locked(self) -> None:
        """A locked-path query's miss count landed: it reads the table no more."""
        self._calls[2](self.entered_address)

    def leave(self) -> None:
        """Ends a fast query whose count was read after its event (TIMED_OUT)."""
        self._calls[2](self.entered_address)

    def drain_own(self) -> None:
        """Waits until this process's queries are done (before it unmaps the table)."""
        while self.words[self._slot_word + 1] > 0:
            time.sleep(0)

    def next_tick(self) -> int:
        """The next LRU tick, shared by every process's queries and inserts."""
        return int(self._calls[3](self.address))


def lock_within(fd: int, seconds: float = LOCK_WAIT_S) -> bool:
    """Takes the flock of `fd` (exclusive), waiting at most `seconds`; False when it stayed
    held (flock has no timeout of its own: polled, a millisecond apart)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)


@lru_cache(maxsize=1)
def _shared_calls() -> tuple[Any, Any]:
    """(enter, drain), compiled: enter(gate, entered) counts a query in unless the gate is
    closed (0), else counts it out again (1); drain(slots, count) spins until every
    slot's count is 0 (-1), or returns a slot still busy."""
    from hps.runtime.compiled import numba, types
    from hps.runtime.raw_memory import _atomic_add64, _u64_acquire

    def enter(gate: int, entered: int) -> int:
        _atomic_add64(entered, np.int64(1))
        if np.int64(_u64_acquire(gate + CLOSED * 8)) == 0:
            return 0
        _atomic_add64(entered, np.int64(-1))
        return 1

    def drain(slots: int, count: int) -> int:
        for _ in range(1 << 12):
            busy = -1
            for slot in range(count):
                if np.int64(_u64_acquire(slots + (slot * SLOT_WORDS + 1) * 8)) > 0:
                    busy = slot
                    break
            if busy < 0:
                return -1
        return busy

    sig = numba.njit([types.int64(types.int64, types.int64)], cache=True)
    return sig(enter), numba.njit([types.int64(types.int64, types.int64)], cache=True,
                                  nogil=True)(drain)


assert ENTERED == 0 and CLOSED == 1 and TICK == 8  # the words fast_query's query reads
