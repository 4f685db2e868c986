"""The keys the leader's online updates wrote, for the GPU caches of the other workers.

With `hps serve --workers N` every worker keeps GPU caches of its own (hps/http/workers.py),
but only the leader consumes online updates: it writes the tiers (the shared table,
Redis, RocksDB) and its own caches. The other workers' caches would go on serving the
rows they hold. So the leader appends the keys of every update it applied to a ring, one
file per table in the run folder (`gpu-updates/`), and each other worker's `CacheFollower`
reads the keys appended since its last look, fetches their rows from its own tiers (which
the leader wrote before appending) and overwrites them in its caches (inserting them too
under `update_source.gpu_cache_insert`): as the leader's caches do, at most a poll later.
It looks every POLL seconds while updates come, and after a look that found none waits
twice as long as before, up to IDLE_POLL. Looking every POLL whatever came took 0.054
cores of 8 GPU-cache workers, idle or serving, where an HTTP server without them took 0.19
cores in all (one H200, 2026-11-29): a thread that wakes takes the GIL from the worker's
event loop. So that the first update after a quiet spell does not wait out that backoff,
the leader rings the followers' bells as it appends (`UpdateJournal(on_append=...)`, at
most once a POLL) and a follower given a bell (`Bell`: the workers' doorbell,
hps/http/workers_wake.py, on a channel of its own) rests on it: woken by the ring, it
looks at once. Without a bell a follower rests on a timer, and the first update after a
quiet spell reaches it up to IDLE_POLL later.

A ring holds the last CAPACITY keys of its table. A follower more than that behind (a
burst of updates while it was busy) refreshes its caches of the table whole from the
tiers instead, which gives the same rows.

Ordering: the leader writes the keys into the ring, then the head (the count of keys ever
appended; one writer per file, under a lock). A follower reads the head, copies the keys
below it, and reads the head again: if the writer lapped the copied part meanwhile the
copy may be torn, and the follower refreshes instead. Keys are read as of the tiers, so a
key appended twice, or read after a later update of it, gives the latest row either way.
"""

from __future__ import annotations

import base64
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

log = logging.getLogger("hps")

#: keys a table's ring holds (8 MiB a table)
CAPACITY = 1 << 20
#: seconds between a follower's looks at the rings while updates come
POLL = 0.02
#: the longest wait between looks after a quiet spell (seconds)
IDLE_POLL = 0.32
#: the folder of the rings in the run folder
FOLDER = "gpu-updates"
#: most keys one refetch reads from the tiers and writes to the caches at once
CHUNK = 65_536

_MAGIC = 0x4C4E524A55535048  # b"HPSUJRNL", little-endian
_H_MAGIC, _H_CAPACITY, _H_HEAD = 0, 1, 2
_HEADER = 8  # int64 words: 64 bytes, the keys start on their own cache line


def ring_path(folder: Path, model: str, table: str) -> Path:
    """The ring file of `table` of `model` in run folder `folder` (names of any
    characters: encoded)."""
    name = base64.urlsafe_b64encode(f"{model}\0{table}".encode()).decode().rstrip("=")
    return folder / FOLDER / f"{name}.keys"


class KeyRing:
    """One table's ring of updated keys, mapped from its file."""

    def __init__(self, path: Path, fd: int) -> None:
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER * 8:
                raise ValueError(f"{path} is not a key ring (too short)")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        header = np.frombuffer(self._mm, np.int64, _HEADER)
        capacity = int(header[_H_CAPACITY])
        if header[_H_MAGIC] != _MAGIC or capacity <= 0 or size < (_HEADER + capacity) * 8:
            raise ValueError(f"{path} is not a key ring")
        self.path = path
        self.capacity = capacity
        self._head = header[_H_HEAD:_H_HEAD + 1]
        self._keys = np.frombuffer(self._mm, np.int64, capacity, _HEADER * 8)
        self._lock = threading.Lock()  # one append at a time (the head has one writer)

    @classmethod
    def create(cls, path: Path, capacity: int = CAPACITY) -> KeyRing:
        """The ring at `path`, made empty if there is none (written whole under another
        name, then renamed: a follower never maps a half-made file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            staging = path.with_suffix(f".{os.getpid()}.new")
            header = np.zeros(_HEADER, np.int64)
            header[_H_MAGIC], header[_H_CAPACITY] = _MAGIC, capacity
            with open(staging, "wb") as f:
                f.write(header.tobytes())
                f.truncate((_HEADER + capacity) * 8)
            os.replace(staging, path)
        return cls(path, os.open(path, os.O_RDWR))

    @classmethod
    def open(cls, path: Path) -> KeyRing | None:
        """The ring at `path`, None while there is none."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        return cls(path, fd)

    @property
    def head(self) -> int:
        """Keys ever appended."""
        return int(self._head[0])

    def append(self, keys: np.ndarray) -> None:
        """Appends `keys` (int64 [n]); of more than the capacity only the last ones stay,
        and followers that had not read the rest refresh."""
        keys = np.asarray(keys, np.int64).reshape(-1)
        with self._lock:
            head = int(self._head[0])
            n = keys.size
            kept = keys[-self.capacity:]
            start = (head + n - kept.size) % self.capacity
            first = min(kept.size, self.capacity - start)
            self._keys[start:start + first] = kept[:first]
            self._keys[:kept.size - first] = kept[first:]
            self._head[0] = head + n  # after the keys: a follower reads the head first

    def read(self, since: int) -> tuple[np.ndarray | None, int]:
        """(the keys appended from count `since` on, the head they end at); the keys are
        None where some of them were overwritten before or while they were read."""
        head = int(self._head[0])
        if head - since > self.capacity or since > head:
            return None, head
        if head == since:
            return np.empty(0, np.int64), head
        start, stop = since % self.capacity, head % self.capacity
        if start < stop:
            keys = self._keys[start:stop].copy()
        else:
            keys = np.concatenate((self._keys[start:], self._keys[:stop]))
        if int(self._head[0]) - since > self.capacity:  # lapped while copying
            return None, head
        return keys, head

    def close(self) -> None:
        self._keys = self._head = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a copy in flight still views it: the mapping goes with it
            pass


class UpdateJournal:
    """The leader's side: `append(model, table, keys)` after an update is applied;
    `on_append()` runs after each append (the followers' bells)."""

    def __init__(self, folder: Path, on_append: Callable[[], None] = lambda: None) -> None:
        self.folder = folder
        self._on_append = on_append
        self._rings: dict[tuple[str, str], KeyRing] = {}
        self._lock = threading.Lock()

    def append(self, model: str, table: str, keys: np.ndarray) -> None:
        ring = self._rings.get((model, table))
        if ring is None:
            with self._lock:
                ring = self._rings.get((model, table))
                if ring is None:
                    ring = KeyRing.create(ring_path(self.folder, model, table))
                    self._rings[(model, table)] = ring
        ring.append(keys)
        self._on_append()

    def close(self) -> None:
        with self._lock:
            for ring in self._rings.values():  # a loop over tables, not keys
                ring.close()
            self._rings.clear()


#: what a follower is given for each table it follows: (model, table name, the table)
Followed = tuple[str, str, Any]


class Bell(Protocol):
    """What a follower rests on between looks (hps/http/workers_wake.py's Doorbell)."""

    def rest(self, busy: bool) -> None:
        """Wait POLL after a look that found work, longer after one that found none;
        a ring, `wake` or `close` ends the wait."""

    def wake(self) -> None:
        """End the rest in progress (or the next one) at once."""

    def close(self) -> None:
        """End every rest from now on at once."""

    def release(self) -> None:
        """Free the bell (after the follower's thread stopped)."""


class _Timer:
    """The Bell of a follower given none: a wait of POLL after a look that found work,
    twice the last after one that found none, up to IDLE_POLL; no ring reaches it."""

    def __init__(self) -> None:
        self._wait = POLL
        self._now = threading.Event()  # `wake` or `close`: a look now

    def rest(self, busy: bool) -> None:
        self._wait = POLL if busy else min(self._wait * 2, IDLE_POLL)
        self._now.wait(self._wait)
        self._now.clear()

    def wake(self) -> None:
        self._now.set()

    close = wake  # the follower's stop flag ends the loop after the look this starts

    def release(self) -> None:
        pass


class CacheFollower:
    """A follower worker's side: a thread that applies the keys the leader appended to
    this worker's caches.

    `tables()` lists the tables with GPU caches served here now; `refetch(table, keys)`
    overwrites the keys' rows in the table's caches with the tiers' rows;
    `refresh(table)` re-reads everything the table's caches hold; `before_read()` runs
    before each round that read keys (a RocksDB secondary catching up with the leader's
    writes). It rests between looks on `bell` (freed as it closes), or on a timer."""

    def __init__(self, folder: Path, tables: Callable[[], Iterable[Followed]],
                 refetch: Callable[[Any, np.ndarray], None],
                 refresh: Callable[[Any], None],
                 before_read: Callable[[], None] = lambda: None,
                 bell: Bell | None = None) -> None:
        self.folder = folder
        self._bell: Bell = bell if bell is not None else _Timer()
        self._tables = tables
        self._refetch = refetch
        self._refresh = refresh
        self._before_read = before_read
        self._rings: dict[tuple[str, str], KeyRing] = {}
        self._read: dict[tuple[str, str], int] = {}  # keys read (and applied) of each ring
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hps-gpu-follower",
                                        daemon=True)
        self.applied = 0  # keys refetched

    def start(self) -> None:
        self._thread.start()

    def reset(self, model: str) -> None:
        """Apply every key the rings of `model`'s tables hold again (or refresh the tables
        whose rings overflowed): after a version of `model` loaded here, whose caches were
        warmed from its files, which lack the updates made since."""
        with self._lock:
            for key in self._read:  # a loop over tables
                if key[0] == model:
                    self._read[key] = 0
        self._bell.wake()

    def step(self) -> int:
        """One look at every followed table's ring; returns the keys applied."""
        return self._look()[0]

    def _look(self) -> tuple[int, bool]:
        """step(), and whether any ring had moved since the last look."""
        applied = 0
        ready = moved = False
        for model, name, table in self._tables():
            key = (model, name)
            ring = self._rings.get(key)
            if ring is None:
                ring = KeyRing.open(ring_path(self.folder, model, name))
                if ring is None:
                    continue
                with self._lock:
                    self._rings[key] = ring
            with self._lock:
                since = self._read.get(key, 0)
            if ring.head == since:
                continue
            moved = True
            if not ready:
                self._before_read()
                ready = True
            keys, head = ring.read(since)
            if keys is None:
                self._refresh(table)
            else:
                keys = np.unique(keys)
                for start in range(0, keys.size, CHUNK):  # chunks of keys, not keys
                    self._refetch(table, keys[start:start + CHUNK])
                applied += keys.size
            with self._lock:
                if self._read.get(key, 0) == since:  # not reset meanwhile
                    self._read[key] = head
        self.applied += applied
        return applied, moved

    def _run(self) -> None:
        moved = True
        while True:
            self._bell.rest(moved)
            if self._stop.is_set():
                return
            try:
                moved = self._look()[1]
            except Exception:  # the next round tries again; a worker keeps serving
                log.exception("applying the leader's updates to this worker's GPU caches")
                moved = True

    def close(self) -> None:
        self._stop.set()
        self._bell.close()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._bell.release()
        with self._lock:
            for ring in self._rings.values():
                ring.close()
            self._rings.clear()
