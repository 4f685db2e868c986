"""One GPU table per device for every process of a host (`gpu_cache_scope: host`): the
first process that opens a table allocates it and exports its memory through CUDA IPC;
every other process that serves the same table on that device maps it and queries it in
place, on its own stream, with no copy.

A shared table is met through its record, a small file in shared memory
(`<shm>/hps-gpu-cache-<uid>/<key>.table`, shm: `$HPS_SHM_DIR` or /dev/shm; its file, the
checks it passes before it is mapped and the wait for its owner: hps/gpu/shared_record.py)
whose key names the model, the table, the device, the table's shape and the model files'
version (see `table_key`: a reload of new files makes a new table, which the processes
swap to as each reloads). The record holds:

- its state (building, ready, retired) and its owner's PID: the process that created the
  file (linked into place: one wins) allocates, warms up, then marks it ready; the others
  wait for that while its progress word moves (an owner that dies first leaves the file to
  be taken over; one that stops making progress is refused);
- the table's parameters, which an attaching process checks against its own config;
- the IPC handles of the table's allocations, in the order the table makes them
  (DeviceTable._alloc): an attaching process opens each in turn instead of allocating;
- the gate (hps/gpu/shared_gate.py): how writes from any process are ordered against
  every process's queries.

Lifetime: an attached process closes its mappings when its version retires. The owner's
retired table stays allocated until no live process is attached (a thread watches), then
is freed and its record removed. A version of the same files loaded again in the owner's
process (a reload) uses the owner's allocations directly (a process cannot open its own
IPC handles) and inherits them when the owner's version retires.

The owner's death. The driver keeps an exported allocation for the processes that mapped
it, until the last of them closes it (measured with SIGKILL, with and without MPS, H100:
the mapped rows stayed intact while another process filled 90% of the device's free
memory), but nobody can open its handles any more. So the processes attached keep serving
from the table, writes included (the gate is in the record, which they keep mapped), and
log the death once; a process that loads the table from then on finds the owner dead,
removes the record and becomes the owner of a new table. The old table's memory goes
back to the device when the last process that maps it retires it (see
docs/gpu-cache.md "One cache for every process").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from hps.errors import ConfigError, DeviceError
from hps.gpu import shared_record
from hps.gpu.kernels import EMPTY_KEY
from hps.gpu.shared_gate import REGION_BYTES, SharedGate, lock_within
from hps.gpu.shared_record import (
    BUILDING,
    GATE_AT,
    HANDLE_BYTES,
    HANDLES,
    HANDLES_AT,
    MAX_HANDLES,
    OWNER,
    PARAM_WORDS,
    PARAMS,
    PROGRESS,
    READY,
    RECORD_BYTES,
    RETIRED,
    STATE,
    Damaged,
    create,
    open_existing,
    owner_alive,
    shared_dir,
    wait_ready,
)
from hps.runtime.background import WeakTicker
from hps.runtime.shm_files import NotOurs

log = logging.getLogger("hps")

_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
#: shared allocations are whole 2 MiB pages (the GPU's large page). The rows' allocation,
#: (slots + 1) rows, was not, and its readers slowed each other down as processes were
#: added: H200 under MPS, 1M-key table, 8 processes each looking up 2,000 power-law keys,
#: query kernel p50 (CUDA events) 94-98 µs against 25-30 µs rounded up (24 with caches of
#: their own). Copied into each process's own memory the same rows ran as fast; read on
#: other load paths (ld.global.nc, .cg) they did not; the index's allocation, whole pages,
#: never slowed. Our reading: a mapping of a partial last page is made of small pages.
_PAGE = 2 << 20
#: how often an attached process asks whether the table's owner is alive (to say so once)
_OWNER_CHECK_S = 1.0

#: this process's records of the tables it owns, by key: the owner's first, then those of
#: the versions of the same table loaded again here (a reload of the same files), which use
#: its allocations (a process cannot open its own IPC handles); when the first retires, the
#: next inherits them
_LOCAL: dict[str, list[SharedTableRecord]] = {}
_LOCAL_LOCK = threading.Lock()


def table_key(model: str, table: str, device_id: int, params: dict[str, int],
              files: str) -> str:
    """The record name of a model's table on a device: the same for every process that
    serves the same files with the same table shape, another one for new files (their
    sizes and modification times) or another shape."""
    stamp: list[Any] = [model, table, device_id, sorted(params.items()), files]
    path = Path(files)
    with contextlib.suppress(OSError):
        entries = [path, *sorted(path.iterdir())] if path.is_dir() else [path]
        stamp.append([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in entries])
    digest = hashlib.sha256(json.dumps(stamp, default=str).encode()).hexdigest()[:24]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{model}.{table}")
    return f"{safe[:80]}.d{device_id}.{digest}"


class SharedTableRecord:
    """This process's side of one shared table's record (see the module docstring):
    `owner` says whether it allocates (and must `publish` once the table is warm) or maps.
    `params` (small ints) must match between processes. Raises ConfigError when they do
    not, DeviceError when the record is not this user's (hps/gpu/shared_record.py), its
    owner is stuck or another user's, or it could not be made or joined in three tries."""

    def __init__(self, key: str, params: dict[str, int]) -> None:
        if len(params) > PARAM_WORDS:
            raise ValueError("too many shared table parameters")
        self.key = key
        self.params = params
        self.path = shared_dir() / f"{key}.table"
        self._fd = -1
        self._mm: mmap.mmap | None = None
        self._handles_used = 0
        self._mapped: list[int] = []  # pointers this process opened from handles
        self._own: list[Any] = []  # allocations of the owner, kept until freed
        self._same_process = False  # a version of a table this process owns (_LOCAL)
        self._closed = False
        self.owner = self._open()
        self.gate = SharedGate(self._words[GATE_AT // 8:(GATE_AT + REGION_BYTES) // 8],
                               self._address + GATE_AT, self._fd,
                               name=f"the shared GPU table {key}")
        if self.owner:
            threading.Thread(target=self._tick_while_building, daemon=True,
                             name=f"hps-gpu-shared-build-{key[:40]}").start()
            with _LOCAL_LOCK:
                _LOCAL[key] = [self]
        elif not self._same_process:
            _watch_owner(self)

    # -- meeting --------------------------------------------------------------------------

    def _open(self) -> bool:
        for _ in range(3):  # an owner that died before the table was ready: take over
            fd = create(self.path, self.params)
            if fd is not None:
                self._map(fd)
                return True
            try:
                fd = open_existing(self.path)
            except FileNotFoundError:
                continue  # removed meanwhile (its owner retired it): make it
            except Damaged as exc:  # nobody's (see shared_record.py): made anew
                log.warning("the shared GPU table %s: %s, left by no live process: replaced",
                            self.key, exc)
                self._remove_record(exc.inode)
                continue
            except NotOurs as exc:
                raise DeviceError(f"the shared GPU table {self.key} is refused: {exc} (only "
                                  "records of this user's are mapped; remove it)") from None
            self._map(fd)
            if wait_ready(self._words, self.key):
                self._check_params()
                self._join_own_process()
                return False
            self._take_over()
        raise DeviceError(f"the shared GPU table {self.key}: could not be made or joined in "
                          "three tries (its owner died before it was ready, each time)")

    def _tick_while_building(self) -> None:
        """The owner's progress word advances while it builds (shared_record.py): waiters
        tell this live process from a stuck one by it."""
        while not self._closed:
            words = self._words
            if words.size == 0 or int(words[STATE]) != BUILDING:
                return
            words[PROGRESS] += 1
            del words  # no reference to the mapping while asleep (it may be unmapped)
            time.sleep(shared_record.PROGRESS_TICK_S)

    def _map(self, fd: int) -> None:
        self._fd = fd
        self._mm = mmap.mmap(fd, RECORD_BYTES)
        self._words = np.frombuffer(self._mm, np.int64)
        self._address = int(self._words.ctypes.data)

    def _unmap(self) -> None:
        self._words = np.empty(0, np.int64)
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _take_over(self) -> None:
        """Removes the mapped record (its owner died, or retired it) so that this process
        can make the table anew (see _remove_record)."""
        inode = os.fstat(self._fd).st_ino
        self._unmap()
        self._remove_record(inode)

    def _remove_record(self, inode: int) -> None:
        """Removes the record of inode `inode` unless another process already replaced it,
        under a lock of the folder (two processes taking over remove one record, not each
        other's)."""
        folder = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            if not lock_within(folder):
                raise DeviceError(f"the shared GPU table {self.key}: the lock of its folder "
                                  f"{self.path.parent} was held by another process too long")
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path, follow_symlinks=False).st_ino == inode:
                    os.unlink(self.path)
        finally:
            os.close(folder)  # the lock with it

    def _join_own_process(self) -> None:
        """A table this process owns under another record (a version loaded again): its
        allocations are the owner's, used directly."""
        if int(self._words[OWNER]) != os.getpid():
            return
        with _LOCAL_LOCK:
            records = _LOCAL.get(self.key)
            if not records:
                raise DeviceError(f"the shared GPU table {self.key} is this process's, but "
                                  "this process no longer holds it")
            records.append(self)
            self._same_process = True

    def _check_params(self) -> None:
        theirs = [int(v) for v in self._words[PARAMS:PARAMS + len(self.params)]]
        mine = [int(v) for v in self.params.values()]
        if theirs != mine:
            names = list(self.params)
            diff = ", ".join(f"{n}: theirs {t}, ours {m}"
                             for n, t, m in zip(names, theirs, mine, strict=True) if t != m)
            raise ConfigError(f"the shared GPU table {self.key} was made by process "
                              f"{int(self._words[OWNER])} with other parameters ({diff})")

    # -- memory ---------------------------------------------------------------------------

    def memory(self, cp: Any, nbytes: int) -> Any:
        """The next allocation of the table (the device current): the owner allocates and
        exports it; another process maps the owner's allocation of the same place."""
        index = self._handles_used
        if index >= MAX_HANDLES:
            raise DeviceError("a shared GPU table has too many allocations")
        self._handles_used += 1
        at = HANDLES_AT + index * HANDLE_BYTES
        assert self._mm is not None
        if self.owner:
            rt = cp.cuda.runtime
            mem = cp.cuda.memory.Memory(-(-max(nbytes, 1) // _PAGE) * _PAGE)
            handle = bytes(rt.ipcGetMemHandle(int(mem.ptr)))
            self._mm[at:at + HANDLE_BYTES] = handle.ljust(HANDLE_BYTES, b"\0")
            self._words[HANDLES] = index + 1
            self._own.append(mem)
            return mem
        if index >= int(self._words[HANDLES]):
            raise DeviceError(f"the shared GPU table {self.key} has fewer allocations than "
                              "this process's table needs")
        if self._same_process:
            with _LOCAL_LOCK:
                return _LOCAL[self.key][0]._own[index]
        rt = cp.cuda.runtime
        ptr = int(rt.ipcOpenMemHandle(bytes(self._mm[at:at + HANDLE_BYTES]),
                                      _LAZY_PEER_ACCESS))
        self._mapped.append(ptr)
        return cp.cuda.memory.UnownedMemory(ptr, max(nbytes, 1), self)

    def publish(self) -> None:
        """The owner's table is ready (built and warmed up): other processes may map it."""
        if self.owner and self._mm is not None:
            self._words[STATE] = READY

    # -- the end --------------------------------------------------------------------------

    def close(self, cp: Any, device: Any, free: Any) -> None:
        """This process is done with the table (its queries drained by the caller). A
        mapping process closes its mappings; the owner marks the table retired and frees
        it (`free()`) once no other live process is attached."""
        if self._closed:
            return
        self._closed = True
        self.gate.drain_own()
        self.gate.release_slot()
        if not self.owner:
            if self._same_process:
                with _LOCAL_LOCK:
                    _LOCAL[self.key].remove(self)
            with device:
                for ptr in self._mapped:
                    with contextlib.suppress(Exception):
                        cp.cuda.runtime.ipcCloseMemHandle(ptr)
            self._mapped.clear()
            self._unmap()
            return
        if self._hand_over():
            free()  # this version's references: the heir keeps the allocations
            self._unmap()
            return
        self._words[STATE] = RETIRED
        if not self.gate.processes():
            self._free(free)
            return
        threading.Thread(target=self._free_when_alone, args=(free,), daemon=True,
                         name=f"hps-gpu-shared-retire-{self.key[:40]}").start()

    def _hand_over(self) -> bool:
        """The owner's version retires while another version of this process uses the
        table: that one becomes the owner (the table is not retired). False if none."""
        with _LOCAL_LOCK:
            records = [r for r in _LOCAL.pop(self.key, ()) if r is not self]
            if not records:
                return False
            heir = records[0]
            heir.owner, heir._same_process, heir._own = True, False, self._own
            _LOCAL[self.key] = records
            self._own = []
            return True

    def _free_when_alone(self, free: Any) -> None:
        while self.gate.processes():
            time.sleep(0.2)
        self._free(free)

    def _free(self, free: Any) -> None:
        free()
        self._own.clear()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._unmap()

    def attached(self) -> list[int]:
        """PIDs of the live processes attached to the table, this one included."""
        return self.gate.processes()

    def owner_gone(self) -> bool:
        """Whether the process that allocated the table died: its PID is gone, or another
        process took it since (one that started later than the record says the owner did);
        False once this process unmapped the record."""
        words = self._words  # kept mapped while read here, whatever a close does meanwhile
        return words.size > 0 and not owner_alive(words)

    def owner_pid(self) -> int:
        """The PID of the process that allocated the table."""
        return int(self._words[OWNER]) if self._words.size else 0


def _watch_owner(record: SharedTableRecord) -> None:
    """Says once, in a process that maps `record`'s table, that its owner died (the
    table keeps serving here: see the module docstring). One thread for every record of
    the process, started with the first."""
    _OWNERS.add(record)


def _warn_gone_owners(records: list[SharedTableRecord]) -> None:
    for record in records:
        owner = record.owner_pid()
        if owner and record.owner_gone():
            log.warning(
                "process %d, which allocated the shared GPU table %s, died: this process "
                "keeps serving from the table it maps (the driver keeps the memory until "
                "the last process that maps it lets go); a process that loads the table "
                "from now on allocates a new one", owner, record.key)
            _OWNERS.discard(record)  # said once


#: every _OWNER_CHECK_S, the records of this process still open
_OWNERS: WeakTicker[SharedTableRecord] = WeakTicker(
    "hps-gpu-shared-owners", lambda: _OWNER_CHECK_S, _warn_gone_owners,
    keep=lambda record: not record._closed)


class SharedParts:
    """What a DeviceTable (hps/gpu/device_table.py) does differently when it is shared by
    the host's processes: its close, its publication once ready, its emptying after a
    writer died. Uses the table's `_shared`, `_lock`, `_closed`, `_device`, `_stream`,
    `_cp`, `_keys`, `_vecs`, `_flags`, `_finish_work` and `_free_extra`."""

    _shared: SharedTableRecord | None
    _lock: Any
    _closed: bool
    _device: Any
    _stream: Any
    _cp: Any
    _keys: Any
    _vecs: Any
    _flags: Any

    def _free_extra(self) -> None:
        raise NotImplementedError

    def _finish_work(self) -> None:
        raise NotImplementedError

    def _close_shared(self) -> None:
        """close() of a shared table: this process's queries drained, its mappings closed;
        the owner's memory freed when the last process is done (shared_cache.py)."""
        shared = self._shared
        assert shared is not None
        with self._lock:
            if self._closed:
                return
            self._closed = True  # the locked path raises from now on, the fast path falls back
            self._finish_work()

        def free() -> None:
            self._keys = self._vecs = None
            self._free_extra()

        shared.close(self._cp, self._device, free)
        if not shared.owner:
            free()

    def publish(self) -> None:
        """A shared table this process owns is ready for the other processes (built and
        warmed up); nothing for a table of its own or one it mapped."""
        if self._shared is not None:
            self._shared.publish()

    @property
    def shared(self) -> SharedTableRecord | None:
        """The record of a table shared by the host's processes (None: this process's)."""
        return self._shared

    def _empty(self) -> None:
        """Forgets every key (a shared table whose writer died mid-write: its rows cannot
        be trusted); called with the writers' lock held and the gate closed."""
        with self._device, self._stream:
            self._keys.fill(EMPTY_KEY)
            self._flags.fill(0)
            self._empty_extra()
        self._stream.synchronize()

    def _empty_extra(self) -> None:
        pass
