"""One table of the in-process hash map in a shared-memory file: `SharedTable`.

The same flat arrays as `hps.tiers.hash_map.table.Table` (slots, keys, rows in the table's
storage type, partition sizes, the kernels' state), laid out in one file of a tmpfs
(/dev/shm) and mapped by every process of a run, so the compiled loops of
`hps.tiers.hash_map.loops` run on the mapped arrays unchanged and the table's memory is
held once however many processes serve it. A file is used rather than
`multiprocessing.shared_memory`: on Python 3.11 its resource tracker unlinks a segment
when any process that attached it exits.

Layout: a header page of int64 fields (`_H_*`: magic, the sequence counter, the kernels'
state, capacities, the type of the rows, counters), then each array on a page of its own:
slots int32[slot_capacity], keys int64[row_capacity], rows [row_capacity, width],
partition sizes int64[num_partitions]. A file is written whole under a temporary name
and renamed into place, so a process that opens it finds it complete.

Writes and reads across processes (a seqlock): one process writes a table (the run's
leader); it makes the sequence counter odd, writes the batch, and makes it even. A
reader in another process reads the counter before and after its fetch into its own
output and fetches again when it changed or was odd, so it never returns a row half
written. The counter is read from Python around the compiled call (two real loads; x86
keeps loads in order, and stores in order), so no compiler can merge the reads. The
writer notes its PID in the header before it makes the counter odd, so a reader never
waits on a write that cannot end: a counter odd for WRITER_CHECK seconds whose writer is
gone (killed in the middle of a write), or odd for READ_WAIT seconds whatever the
writer, fails the read with TableUnreadableError (the next tier answers, or a 503).

Memory: a file's whole size is allocated when it is made (`posix_fallocate`), so a tmpfs
too small fails the load with a TierError rather than a later write with SIGBUS; the
pages count once in the host's memory however many processes map them.

Capacity: fixed once another process maps the table. Until then (the leader loading it)
the table grows like the in-process one; `reserve` sizes it for a load's rows plus
`headroom` of them for keys that online updates add later. An insert that would pass
the capacity is refused whole (`SharedTableFullError`) and counted in the header.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np

from hps.errors import TableUnreadableError, TierError
from hps.rows.storage_types import BFLOAT16, FLOAT16, FLOAT32, INT8, StorageType
from hps.runtime.run_dir import pid_alive
from hps.tiers.hash_map import loops as kernels
from hps.tiers.hash_map.table import (
    EMPTY,
    MAX_LOAD,
    MIN_ROWS,
    MIN_SLOTS,
    REBUILD_LOAD,
    ReadWriteLock,
    Table,
    reserve_load,
)

_MAGIC = 0x3148504D53504824  # "$HPSMPH1"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_PAGE = 4096
_STORAGES = (FLOAT32, FLOAT16, BFLOAT16, INT8)
_NO_STATS = np.empty(0, np.uint32)
_NO_FLOATS = np.empty((0, 2), np.float32)

# header fields (int64 each)
_H_MAGIC, _H_SEQ, _H_SIZE, _H_TOMBSTONES = 0, 1, 2, 3
_H_ROWS, _H_SLOTS, _H_DIM, _H_STORAGE, _H_PARTITIONS = 4, 5, 6, 7, 8
_H_WRITTEN, _H_REFUSED, _H_VERSION, _H_WRITER = 9, 10, 11, 12
_HEADER_FIELDS = 16

#: rows of a table made before its size is known (a load's `reserve` sizes it)
INITIAL_ROWS = 1024
#: seconds a reader finds the counter odd (one write) before it asks whether the writer
#: lives: a batch of updates is written in well under that
WRITER_CHECK = 0.01
#: seconds a reader waits for one write to end, whatever the writer: a lookup answers
#: (or is refused) within seconds, never waits for a writer that stalled
READ_WAIT = 2.0


class SharedTableFullError(TierError):
    """An insert would take a shared table past the capacity it was made with."""

    kind = "tier_full"


def _page(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def _layout(rows: int, slots: int, width: int, itemsize: int, partitions: int
            ) -> tuple[list[int], int]:
    """Offsets of slots, keys, rows and partition sizes, and the file's size."""
    offsets = [_PAGE]
    for nbytes in (4 * slots, 8 * rows, rows * width * itemsize):
        offsets.append(offsets[-1] + _page(nbytes))
    return offsets, offsets[-1] + _page(8 * partitions)


def _kernel_dtype(storage: StorageType) -> np.dtype:
    # numba has no float16 on the CPU: its bits go as uint16 (as table.py stores them)
    return np.dtype(np.uint16) if storage is FLOAT16 else storage.stored_dtype


class SharedTable(Table):
    """A `Table` whose arrays lie in a mapped file; `create` makes one, `attach` maps one
    another process made. Holds the file open (a shared flock while attached) until it
    is dropped; the mapping lives as long as any array of it."""

    def __init__(self, path: Path, fd: int, owner: bool) -> None:
        # not Table.__init__: the arrays come from the file, not from NumPy's heap
        self.path = path
        self.owner = owner  # made here: may grow while no other process maps it
        self.fd = fd
        self.lock = ReadWriteLock()
        self.writer = threading.Lock()  # one write (and its sequence counter) at a time
        self.stats_lock = threading.Lock()
        self.stamped = False
        self.has_stats = False
        self.stats = _NO_STATS
        self.clock = 0
        self._map()

    # -- making and mapping ------------------------------------------------------------

    @classmethod
    def create(cls, path: Path, dim: int, storage: StorageType, num_partitions: int,
               rows: int = INITIAL_ROWS, slots: int | None = None) -> SharedTable:
        """A new, empty table file at `path` with room for `rows` rows (its slots at
        the load a `reserve` gives, or `slots`)."""
        fd = _write_empty(path, dim, storage, num_partitions, rows, slots)
        return cls(path, fd, owner=True)

    @classmethod
    def attach(cls, path: Path, wait: float = 0.0) -> SharedTable:
        """Map the table file another process made, waiting up to `wait` seconds for it
        to appear. Raises TierError when it is absent or not a table file."""
        deadline = time.monotonic() + wait
        while True:
            try:
                fd = os.open(path, os.O_RDWR)
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise TierError(f"shared table {path.name} is not in {path.parent}: "
                                    "the process that loads it has not made it") from None
                time.sleep(0.02)
        fcntl.flock(fd, fcntl.LOCK_SH)  # held while mapped: the owner then never grows it
        try:
            return cls(path, fd, owner=False)
        except BaseException:
            os.close(fd)
            raise

    def _map(self) -> None:
        size = os.fstat(self.fd).st_size
        # every page mapped now: a worker's first lookups would otherwise take a page
        # fault per row (2-core test machine, 1M x 64 rows, 256-key fetches: 187 µs the
        # first pass over a fresh mapping, 148 µs once mapped)
        self._mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED | _POPULATE,
                             mmap.PROT_READ | mmap.PROT_WRITE)
        with contextlib.suppress(AttributeError, OSError):
            # huge pages where the tmpfs gives them (mounted huge=within_size, or
            # shmem_enabled "advise"): the random row reads of a fetch then miss the TLB
            # far less (the same fetch from NumPy's heap, huge pages: 44 µs)
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        header = np.frombuffer(self._mm, np.int64, _HEADER_FIELDS)
        if size < _PAGE or header[_H_MAGIC] != _MAGIC:
            raise TierError(f"{self.path} is not a shared hash map table")
        self.header = header
        self.seq = header[_H_SEQ:_H_SEQ + 1]
        self.state = header[_H_SIZE:_H_TOMBSTONES + 1]  # rows in use, tombstones
        self.dim = int(header[_H_DIM])
        self.storage = _STORAGES[int(header[_H_STORAGE])]
        self.width = self.storage.row_width(self.dim)
        self.row_dtype = _kernel_dtype(self.storage)
        rows, slots = int(header[_H_ROWS]), int(header[_H_SLOTS])
        partitions = int(header[_H_PARTITIONS])
        offsets, _ = _layout(rows, slots, self.width, self.row_dtype.itemsize, partitions)
        self.slots = np.frombuffer(self._mm, np.int32, slots, offsets[0])
        self.keys = np.frombuffer(self._mm, np.int64, rows, offsets[1])
        self.vectors = np.frombuffer(self._mm, self.row_dtype, rows * self.width,
                                     offsets[2]).reshape(rows, self.width)
        self.floats = self.vectors.view(np.float32) if self.storage is INT8 else _NO_FLOATS
        self.partition_sizes = np.frombuffer(self._mm, np.int64, partitions, offsets[3])
        self.row_bits = kernels.row_bits(slots)
        self.max_used = min(slots - 1, int(slots * MAX_LOAD))

    # -- header fields -----------------------------------------------------------------

    @property
    def written(self) -> int:  # type: ignore[override]
        return int(self.header[_H_WRITTEN])

    @written.setter
    def written(self, rows: int) -> None:
        self.header[_H_WRITTEN] = rows

    @property
    def version(self) -> int:  # type: ignore[override]
        return int(self.header[_H_VERSION])

    @version.setter
    def version(self, value: int) -> None:
        self.header[_H_VERSION] = value

    def nbytes(self) -> int:
        """Bytes of memory the table holds: its whole file (allocated when made)."""
        return len(self._mm)

    @property
    def refused(self) -> int:
        """Inserts refused because the table was full."""
        return int(self.header[_H_REFUSED])

    # -- the seqlock -------------------------------------------------------------------

    def begin_write(self) -> None:
        """Readers in other processes retry from here on (the counter is odd)."""
        self.header[_H_WRITER] = os.getpid()  # before the counter: x86 keeps stores in order
        self.seq[0] += 1

    def end_write(self) -> None:
        self.seq[0] += 1

    def read_stable(self, fetch: object) -> None:
        """Run `fetch()` (into the reader's own buffers) until no write overlapped it.
        Raises TableUnreadableError when one write does not end (see the module)."""
        seq = self.seq
        odd, since = -1, 0.0  # the odd count seen last, and since when
        while True:
            before = int(seq[0])
            if before & 1:  # a write is under way: let the writer run
                if before != odd:
                    odd, since = before, time.monotonic()
                else:
                    self._check_writer(time.monotonic() - since)
                time.sleep(0)
                continue
            fetch()  # type: ignore[operator]
            if int(seq[0]) == before:
                return

    def _check_writer(self, waited: float) -> None:
        """TableUnreadableError once one write has kept the counter odd too long."""
        if waited < WRITER_CHECK:
            return
        writer = int(self.header[_H_WRITER])
        if writer and not pid_alive(writer):
            raise TableUnreadableError(
                f"shared table {self.path.name}: process {writer} died in the middle of a "
                "write to it; its rows cannot be read whole until the leader writes it again")
        if waited >= READ_WAIT:
            raise TableUnreadableError(
                f"shared table {self.path.name}: a write by process {writer} has not ended "
                f"in {waited:.1f}s")

    # -- sizing ------------------------------------------------------------------------

    def mapped_elsewhere(self) -> bool:
        """Whether another process maps this table (holds its shared flock)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def room_for(self, new_keys: int) -> bool:
        """Whether `new_keys` more keys fit without growing (tombstones rebuilt away)."""
        return self.size + new_keys <= min(self.keys.size, self.max_used)

    def refuse(self, new_keys: int, table: str) -> SharedTableFullError:
        """Count a refused insert; the error that says why."""
        self.header[_H_REFUSED] += 1
        return SharedTableFullError(
            f"shared table {table!r} is full: it holds {self.size:,} of {self.keys.size:,} "
            f"rows, and the insert adds up to {new_keys:,} keys; its capacity was fixed "
            "when the workers mapped it (the load's rows plus volatile_db."
            "shared_headroom of them): nothing was written")

    def grow(self, extra: int) -> None:
        """Room for `extra` more keys: slots rebuilt in place (tombstones go); rows
        grown only while no other process maps the table, else SharedTableFullError."""
        if self.room_for(extra):
            self.rebuild_in_place()
            return
        if not self.owner or self.mapped_elsewhere():
            raise self.refuse(extra, self.path.name)
        self._move(max(2 * (self.size + extra), MIN_ROWS), REBUILD_LOAD)

    def reserve(self, total: int, headroom: float = 0.0) -> None:
        """Room for `total` keys plus `headroom` of them (a load's size), while no other
        process maps the table; a hint otherwise (it keeps its capacity)."""
        rows = math.ceil(total * (1.0 + headroom))
        if rows <= self.keys.size or not self.owner or self.mapped_elsewhere():
            return
        self._move(rows, reserve_load(self.keys.itemsize + self.vectors.itemsize * self.width))

    def rebuild_in_place(self) -> None:
        """The slots rebuilt without tombstones (the caller holds the write and the
        sequence counter odd)."""
        self.slots[:] = EMPTY
        kernels.place_rows(self.slots, self.keys, self.size, self.row_bits)
        self.state[1] = 0

    def shrink(self) -> None:
        """Tombstones past half the free slots are rebuilt away; rows never move out."""
        if int(self.state[1]) > (self.max_used - self.size) // 2:
            self.rebuild_in_place()

    def _move(self, rows: int, load: float) -> None:
        """A new file of `rows` rows and slots at `load` holding this table's rows,
        renamed over this one's (no other process maps it)."""
        n = self.size
        slots = max(MIN_SLOTS, math.ceil(max(rows, n) / load) + 1)
        tmp_fd = _write_empty(self.path, self.dim, self.storage, self.partition_sizes.size,
                              rows, slots)
        new = SharedTable(self.path, tmp_fd, owner=True)
        new.keys[:n] = self.keys[:n]
        new.vectors[:n] = self.vectors[:n]
        new.partition_sizes[:] = self.partition_sizes
        new.state[0] = n
        kernels.place_rows(new.slots, new.keys, n, new.row_bits)
        new.header[_H_WRITTEN] = n
        new.header[_H_VERSION] = self.header[_H_VERSION]
        new.header[_H_REFUSED] = self.header[_H_REFUSED]
        new.header[_H_WRITER] = self.header[_H_WRITER]
        new.header[_H_SEQ] = self.header[_H_SEQ]  # odd: the write that moved it goes on
        old_fd = self.fd
        self.fd, self._mm = new.fd, new._mm
        self._map()
        os.close(old_fd)

    def rebuild(self, extra: int, load: float = REBUILD_LOAD) -> None:
        """The slots of the in-process table's rebuild: in place here (the file keeps its
        size)."""
        self.rebuild_in_place()

    def trim_rows(self) -> None:
        """Rows never move out of a shared table's file."""

    def close(self) -> None:
        """Close the file (its flock goes); the mapping lives as long as its arrays."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _write_empty(path: Path, dim: int, storage: StorageType, num_partitions: int,
                 rows: int, slots: int | None) -> int:
    """Write an empty table file and rename it to `path`; returns its descriptor."""
    rows = max(int(rows), MIN_ROWS)
    width = storage.row_width(dim)
    itemsize = _kernel_dtype(storage).itemsize
    if slots is None:
        slots = math.ceil(rows / reserve_load(8 + itemsize * width)) + 1
    slots = max(MIN_SLOTS, int(slots))
    offsets, size = _layout(rows, slots, width, itemsize, num_partitions)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            # the whole file taken now: a tmpfs that is full fails here, with a message,
            # instead of killing a process with SIGBUS when it writes a row later
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            raise TierError(
                f"no room for a shared table of {size / 2**20:,.1f} MiB in {path.parent} "
                f"({exc.strerror}): enlarge the tmpfs (/dev/shm; docker --shm-size) or point "
                "HPS_SHM_DIR at a larger one") from None
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            header = np.frombuffer(mm, np.int64, _HEADER_FIELDS)
            header[_H_ROWS], header[_H_SLOTS], header[_H_DIM] = rows, slots, dim
            header[_H_STORAGE] = _STORAGES.index(storage)
            header[_H_PARTITIONS] = num_partitions
            np.frombuffer(mm, np.int32, slots, offsets[0])[:] = EMPTY
            header[_H_MAGIC] = _MAGIC  # last: a file with the magic is whole
            del header
        finally:
            mm.close()
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd
