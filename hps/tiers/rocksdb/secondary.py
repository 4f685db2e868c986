"""The persistent tier in a follower worker of `hps serve --workers N`: a RocksDB
secondary instance of the store the leader writes.

RocksDB takes one writing process. In a run (hps/runtime/run_dir.py) worker 0, the
leader, opens the store read-write and is its one writer (loads, online updates, drops);
every other worker opens it as a secondary instance (`AccessType.secondary`), which reads
the primary's files and replays its WAL. Each follower has its own secondary folder (the
info log of its instances) in the run folder.

Keeping up: every FOLLOW_SECONDS a follower compares the store's files (names, sizes,
times: one directory scan) with those it last read. When only the WAL changed (rows the
leader wrote: online updates) it catches up (`try_catch_up_with_primary`, about 1 ms);
when the MANIFEST changed (tables made, dropped or ingested: loads, large update rounds),
and before every model change, it opens a new instance (20-30 ms), which also sees the
tables made since (an instance sees only the column families it was opened with). With
rocksdict 0.3.29 a catch-up over the MANIFEST edits of a reload (a column family dropped
and made again, tables dropped) crashed the worker (SIGSEGV): those go through a new
instance. Each instance has a folder of its own; handles of the one before keep working
(rocksdict shares the database between them), so lookups in flight finish on it.

Opening waits up to ATTACH_WAIT seconds for the leader to have made the store (the
workers start together).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import rocksdict

from hps.errors import TierSetupError
from hps.runtime.run_dir import RUN_DIR_ENV
from hps.tiers.rocksdb.store import META_CF

#: the environment variable holding a worker's index in its run (0: the leader)
WORKER_ENV = "HPS_WORKER_INDEX"
#: seconds a follower waits for the leader's store to exist
ATTACH_WAIT = 30.0
#: openings tried while the leader drops tables between the listing and the opening
OPEN_ATTEMPTS = 20
#: seconds between two looks at the leader's store (a directory scan; online updates'
#: visibility target is p50 <= 100 ms)
FOLLOW_SECONDS = 0.05


def secondary_folder(path: str) -> Path | None:
    """The secondary folder of this process for the store at `path` when it is a
    follower worker of a run (it reads the leader's store), else None."""
    run = os.environ.get(RUN_DIR_ENV)
    index = os.environ.get(WORKER_ENV, "0")
    if not run or index == "0":
        return None
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    folder = Path(run) / "rocksdb" / f"{digest}-{index}-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def open_secondary(path: str, options: Any, folder: Path) -> tuple[Any, set[str]]:
    """Open a secondary instance of the store at `path` (made by the leader, waited for)
    with every column family it holds now. Returns `(Rdict, names of its column families
    other than "default")`. Raises TierSetupError when it cannot be opened."""
    folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + ATTACH_WAIT
    while not os.path.exists(os.path.join(path, "CURRENT")):
        if time.monotonic() > deadline:
            raise TierSetupError(
                f"RocksDB at {path!r}: the leader worker did not make the store within "
                f"{ATTACH_WAIT:.0f}s")
        time.sleep(0.05)
    for attempt in range(OPEN_ATTEMPTS):  # a loop over attempts
        try:
            names = [n for n in rocksdict.Rdict.list_cf(path, options) if n != "default"]
            db = rocksdict.Rdict(path, options, column_families={n: options for n in names},
                                 access_type=rocksdict.AccessType.secondary(str(folder)))
            return db, set(names)
        except Exception as exc:  # rocksdict raises plain Exception with RocksDB's text
            # the leader dropped a table between the listing and the opening: list again
            if "Column family not found" in str(exc) and attempt + 1 < OPEN_ATTEMPTS:
                continue
            raise TierSetupError(f"cannot open RocksDB at {path!r} as a secondary instance "
                                 f"(a follower worker): {exc}") from exc
    raise AssertionError("unreachable")


def store_signature(path: str) -> tuple[Any, ...]:
    """`(MANIFEST and CURRENT, WAL)` of the store at `path`: the name, size and
    modification time of those files, which every write changes (the first, a change of
    its tables and table files; the second, of rows written through the WAL)."""
    manifest, wal = [], []
    with os.scandir(path) as entries:
        for entry in entries:  # a loop over the store's files, not keys
            into = wal if entry.name.endswith(".log") else manifest if entry.name.startswith(
                ("MANIFEST", "CURRENT")) else None
            if into is not None:
                st = entry.stat()
                into.append((entry.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(manifest)), tuple(sorted(wal))


class FollowsPrimary:
    """What `RocksDBTier` does as a secondary instance: catching up with the leader's
    writes, and reading a version from where the leader stored it."""

    secondary: Path | None
    path: str
    _options: Any
    _db: Any
    _families: set[str]
    _cfs: dict[str, Any]
    _handles: dict[str, Any]
    _meta: Any
    _dims: dict[str, int]
    _generations: dict[str, int]
    _aliases: dict[str, str]
    _lock: threading.Lock
    _follow_lock: threading.Lock
    _seen: tuple[Any, ...] = ()  # the store's files when last read (store_signature)
    _openings = 0

    def _column_family(self, name: str, create: bool) -> Any:
        raise NotImplementedError

    def catch_up(self, reopen: bool = False) -> None:
        """A secondary instance (`self.secondary`) reads what the leader wrote since it
        last looked, when the leader's store changed; `reopen` opens it again (before a
        model change: the tables the leader created). Nothing for a primary."""
        if self.secondary is None:
            return
        with self._follow_lock:  # one at a time: an instance is not re-entrant here
            seen = store_signature(self.path)
            if self._db is None or (seen == self._seen and not reopen):
                return
            # the MANIFEST changed (tables made, dropped, ingested): a new instance
            reopen = reopen or seen[0] != self._seen[:1]
            if not reopen:
                try:
                    self._db.try_catch_up_with_primary()
                except Exception:  # a table it was not opened with: open it again
                    reopen = True
            if reopen:
                self._openings += 1  # each instance its own folder (see the module)
                db, families = open_secondary(self.path, self._options,
                                              self.secondary / str(self._openings))
                cfs = {n: db.get_column_family(self.stored_name(n)) for n in self._cfs
                       if self.stored_name(n) in families}
                handles = {n: db.get_column_family_handle(self.stored_name(n)) for n in cfs}
                with self._lock:  # lookups in flight finish on the handles they hold
                    self._db, self._families = db, families
                    self._cfs, self._handles = cfs, handles
                self._meta = self._column_family(META_CF, create=False)
            with self._lock:  # counts taken before are stale
                self._generations = {t: self._generations.get(t, 0) + 1 for t in self._dims}
            self._seen = seen

    def read_as(self, table: str, stored: str) -> None:
        """In a follower: serve `table` from the column family the leader stored it
        under (`stored`), which its own name for that version may differ from."""
        with self._lock:
            self._aliases[table] = stored
            self._cfs.pop(table, None)
            self._handles.pop(table, None)

    def stored_name(self, table: str) -> str:
        """The column family of `table` (another one where `read_as` says so)."""
        return self._aliases.get(table, table)
