"""The gate of a GPU table that several processes query: hps/gpu/fast_query.py's gate in
shared memory, with one writer at a time across the processes.

One process's table orders its writes after its queries with the table's lock and CUDA
events (hps/gpu/write_order.py). Another process's queries and events are out of its
reach, so a table shared through CUDA IPC (hps/gpu/shared_cache.py) orders them on the
host, through words in the shared record every process maps:

- `closed` and the LRU `tick` sit where fast_query's gate has them, so the compiled fast
  query runs unchanged; each process counts its queries in flight in a slot of its own
  (pid, entered, when it started, its progress), so a process that dies mid-query is
  found and its count dropped (and a later process that took its PID is not taken for it);
- a writer takes the record's file lock (flock: the kernel drops it when its holder dies),
  sets `closed` and `writer` to its PID, waits until every live process's slot is 0,
  queues the write, waits on the host for it to finish, then clears `closed` and
  unlocks. A query enters its
  slot, then reads `closed`: either the writer sees the query and waits for it, or the
  query sees the gate closed, leaves and waits. So no query in any process reads a row a
  write is changing, and a query that enters after the gate reopens sees the whole write;
- every wait on another process goes on while that process shows progress (see `_lock`:
  a thread of each process advances its slot's progress word, and the gate's while it
  writes), and is refused once it showed none for LOCK_WAIT_S (stopped, stuck, or a
  process that is not this server's): a writer's wait for the lock, or for a reader's
  query in flight, and a query's wait for a write;
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
from pathlib import Path
from typing import Any

import numpy as np

from hps.errors import DeviceError
from hps.gpu.fast_query import CLOSED, ENTERED, TICK, _gate_calls
from hps.runtime.background import WeakTicker
from hps.runtime.run_dir import alive_since, process_started
from hps.runtime.shm_files import user_name

#: the gate's words in its region (int64): fast_query's (entered, closed; the tick on the
#: next cache line), the writer's PID (`closed` holds it too), how many times a dead
#: writer was recovered, when the writer's process started (run_dir.process_started) and
#: the writer's progress, which its process advances while it holds the lock (words a
#: release before them left 0: a writer of such a release shows no progress)
WRITER, RECOVERIES, WRITER_STARTED, WRITER_PROGRESS = 3, 4, 5, 6
GATE_WORDS = 16
#: process slots after the gate words: (pid, entered, when the process started, its
#: progress), each on a cache line of its own (a query adds to its process's count twice:
#: processes sharing a line would take it from each other on every query)
SLOTS = 128
SLOT_WORDS = 8
_SLOT_STARTED, _SLOT_PROGRESS = 2, 3
REGION_BYTES = (GATE_WORDS + SLOTS * SLOT_WORDS) * 8
#: how long a query waits on a closed gate before it asks whether the writer is alive
_WRITER_SUSPECT_S = 0.02
#: how long a writer waits on a slot's count before it asks whether its process is alive
_READER_SUSPECT_S = 0.002
#: how long another process may show no progress before a wait on it is refused: for the
#: record's lock (to attach or to write: SharedGate._lock), for its query in flight (a
#: writer), for its write (a query)
LOCK_WAIT_S = 20.0
#: how often a process advances its progress words (LOCK_WAIT_S is 20 of these: a process
#: whose threads are starved for seconds is not stuck)
PROGRESS_TICK_S = 1.0
#: how long a waiter for the lock spins (yielding) before it polls it every _LOCK_POLL_S:
#: writes of the lookup path's misses take microseconds, and a wait for them is on the
#: lookup's latency
_LOCK_SPIN_S = 0.002
_LOCK_POLL_S = 0.0002


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
        self._attached = False
        self._pid = os.getpid()
        self._started = process_started(self._pid) or 0
        self._slot = self._claim_slot()
        self._slot_word = GATE_WORDS + self._slot * SLOT_WORDS
        self.entered_address = address + (self._slot_word + 1) * 8
        self._warned = threading.Event()
        self._attached = True
        _tick_progress(self)

    # -- process slots --------------------------------------------------------------------

    def _claim_slot(self) -> int:
        """A free slot (unused, or of a dead process) for this process, under the lock.
        Raises DeviceError when the lock's holder shows no progress (see _lock)."""
        self._lock("attach")
        try:
            for slot in range(SLOTS):  # a loop over process slots, at attach only
                word = GATE_WORDS + slot * SLOT_WORDS
                pid = int(self.words[word])
                if pid == 0 or (pid != self._pid and not self._slot_alive(word)):
                    self.words[word + 1] = 0
                    self.words[word + _SLOT_STARTED] = self._started  # before its PID
                    self.words[word] = self._pid
                    return slot
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        raise GateFullError(f"all {SLOTS} process slots of the shared GPU cache are in use")

    def _slot_alive(self, word: int) -> bool:
        """Whether the process of the slot at `word` runs: its PID, and not a later process
        that took the PID (the slot keeps when its process started; 0 from a release
        before it: the PID alone decides)."""
        pid = int(self.words[word])
        return pid != 0 and alive_since(pid, int(self.words[word + _SLOT_STARTED]))

    def release_slot(self) -> None:
        """This process queries the table no more (its queries are done)."""
        self._attached = False  # its progress ticks no more: the slot may be another's
        self.words[self._slot_word + 1] = 0
        self.words[self._slot_word + _SLOT_STARTED] = 0  # before its PID: a process that
        self.words[self._slot_word] = 0  # claims the free slot then keeps its own

    def processes(self) -> list[int]:
        """PIDs of the live processes attached to the table."""
        pids = self.words[GATE_WORDS:GATE_WORDS + SLOTS * SLOT_WORDS:SLOT_WORDS]
        words = GATE_WORDS + np.flatnonzero(pids) * SLOT_WORDS
        return [int(self.words[w]) for w in words.tolist() if self._slot_alive(w)]

    # -- the lock ---------------------------------------------------------------------------

    def _lock(self, doing: str) -> None:
        """Takes the record's lock (to attach, or to write: `doing` says which in errors).

        Its holder holds it a few µs to attach, or for a whole write: from closing the
        gate to the write done on the GPU. Most writes take microseconds (a lookup's misses
        inserted), but nothing bounds a legit one: an update batch of millions of rows, a
        write on a caller's stream behind that caller's own queued work, a GPU shared by
        many processes under MPS. So no fixed bound fits every write: a wait goes on while
        the holder shows progress, as the wait for a table's owner does
        (hps/gpu/shared_record.py): a writer's process advances WRITER_PROGRESS every
        PROGRESS_TICK_S while it holds the lock (_tick_progress); a holder whose word
        stood still, or that names none (a process attaching: µs), for LOCK_WAIT_S is
        refused (a stopped or stuck writer, a process that is not this server's, a writer
        of a release that does not tick) with a DeviceError that names the record, the
        holder where the kernel says and the wait. A holder that dies frees the lock."""
        fd = self._fd
        if _try_lock(fd):
            return
        begun = time.monotonic()
        still = _Stillness()
        while not _try_lock(fd):
            now = time.monotonic()
            if now - begun < _LOCK_SPIN_S:
                time.sleep(0)
                continue
            mark = self._writer_mark()  # moves with another write, or this one's progress
            if still.seconds(mark, now) > LOCK_WAIT_S:
                raise DeviceError(
                    f"{self.name}: this process waited {now - begun:.0f} s for its lock "
                    f"(to {doing}), held by {self._holder(mark[0])} with no progress for "
                    f"{LOCK_WAIT_S:g} s: a writer stopped or stuck, or a process that is not "
                    "this server's; end it, or remove the record")
            time.sleep(_LOCK_POLL_S)

    def _writer_mark(self) -> tuple[int, int, int]:
        """(writer PID, when it started, its progress): changes while writers progress."""
        w = self.words
        return int(w[WRITER]), int(w[WRITER_STARTED]), int(w[WRITER_PROGRESS])

    def _holder(self, writer: int) -> str:
        """Who holds the lock, in words: the process the kernel names (/proc/locks), else
        the writer the gate names, else 'another process'."""
        pid = lock_holder(self._fd) or writer
        if not pid:
            return "another process"
        try:
            return f"process {pid} of user {user_name(os.stat(f'/proc/{pid}').st_uid)}"
        except OSError:
            return f"process {pid}"

    # -- writers --------------------------------------------------------------------------

    def close(self) -> None:
        """Takes the writers' lock (recovering a dead writer's table first), closes the
        gate and waits until no process's query reads the table. `write_queued` ends it."""
        if self._held:
            self._drain()
            return
        self._lock("write")
        try:
            if self.words[CLOSED]:
                self._recover()
            self._calls[0](self.address)  # closed ← 1 (an atomic exchange: a full fence)
            self.words[WRITER_STARTED] = self._started  # before its PID: read with it
            self.words[CLOSED] = self.words[WRITER] = self._pid
            self._held = True
            self._drain()
        except BaseException:
            self._reopen()
            raise

    def _drain(self) -> None:
        """Waits until every slot's count is 0; a slot whose process died is emptied.
        Raises DeviceError when a process with a query in flight showed no progress for
        LOCK_WAIT_S (a query holds its count while its caller's host work runs: seconds
        are legit, a stopped process is not)."""
        drain = self._shared_calls[1]
        base = self.address + GATE_WORDS * 8
        since = time.monotonic()
        still = _Stillness()
        while True:
            busy = int(drain(base, SLOTS))
            if busy < 0:
                return
            now = time.monotonic()
            word = GATE_WORDS + busy * SLOT_WORDS
            pid = int(self.words[word])
            if now - since > _READER_SUSPECT_S and pid != self._pid:
                if not self._slot_alive(word):
                    self.words[word + 1] = 0  # a query of a dead process reads nothing
                    self.words[word] = 0
                    continue
                if still.seconds((pid, int(self.words[word + _SLOT_PROGRESS])),
                                 now) > LOCK_WAIT_S:
                    raise DeviceError(
                        f"{self.name}: a write waited {now - since:.0f} s for a query in "
                        f"flight of process {pid}, which made no progress for "
                        f"{LOCK_WAIT_S:g} s (stopped or stuck); end it")
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
        self.words[WRITER_STARTED] = 0
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
        recovering the table of a writer that died). Raises DeviceError when the writer
        showed no progress for LOCK_WAIT_S."""
        enter = self._shared_calls[0]
        begun = since = 0.0
        still = _Stillness()
        while enter(self.address, self.entered_address) != 0:
            now = time.monotonic()
            begun = begun or now
            since = since or now
            if now - since > _WRITER_SUSPECT_S:
                self._recover_if_writer_died()
                since = now
                mark = self._writer_mark()
                if still.seconds(mark, now) > LOCK_WAIT_S:
                    raise DeviceError(
                        f"{self.name}: a query waited {now - begun:.0f} s for the write of "
                        f"{self._holder(mark[0])}, which made no progress for "
                        f"{LOCK_WAIT_S:g} s (a writer stopped or stuck); end it")
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


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def lock_holder(fd: int) -> int | None:
    """The PID that /proc/locks names as holding the flock of `fd`'s file; None where it
    names none (no /proc; 0: a holder outside this process's PID namespace)."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # a loop over the host's locks, for an error's message only
        fields = line.split()  # "1: FLOCK ADVISORY WRITE <pid> <maj:min:inode> 0 EOF"
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == ident:
            return int(fields[4]) or None
    return None


class _Stillness:
    """How long the words another process changes while it makes progress (its mark)
    stood still, as seen by a wait that looks at them now and then."""

    def __init__(self) -> None:
        self.mark: tuple[int, ...] = ()
        self.since = 0.0

    def seconds(self, mark: tuple[int, ...], now: float) -> float:
        if mark != self.mark:
            self.mark, self.since = mark, now
        return now - self.since


def _tick_progress(gate: SharedGate) -> None:
    """Counts `gate` among those this process's ticker shows progress in (one thread for
    the process, started with its first gate)."""
    _PROGRESS.add(gate)


def _tick(gates: list[SharedGate]) -> None:
    """Advances the progress word of this process's slot in each gate it is attached to,
    and WRITER_PROGRESS of each it holds for a write: the processes that wait on it (for
    the lock, its query, its write) see it alive and its threads running. A process
    stopped or frozen ticks no more. A tick just after its write ended lands on the next
    writer's word: one tick more, harmless."""
    for gate in gates:  # a loop over this process's shared tables
        if gate._attached:
            gate.words[gate._slot_word + _SLOT_PROGRESS] += 1
        if gate._held:
            gate.words[WRITER_PROGRESS] += 1


#: the process's progress ticker, every PROGRESS_TICK_S over its gates
_PROGRESS: WeakTicker[SharedGate] = WeakTicker("hps-gpu-shared-progress",
                                               lambda: PROGRESS_TICK_S, _tick)


def lock_within(fd: int, seconds: float = LOCK_WAIT_S) -> bool:
    """Takes the flock of `fd` (exclusive), waiting at most `seconds`; False when it stayed
    held (flock has no timeout of its own: polled, a millisecond apart)."""
    deadline = time.monotonic() + seconds
    while not _try_lock(fd):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


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
