"""The persistent tier in a follower worker of `hps serve --workers N`: a RocksDB
secondary instance of the store the leader writes.

RocksDB takes one writing process. In a run (hps/runtime/run_dir.py) worker 0, the
leader, opens the store read-write and is its one writer (loads, online updates, drops);
every other worker opens it as a secondary instance (`AccessType.secondary`), which reads
the primary's files and replays its WAL. Each follower has its own secondary folder (the
info log of its instances) in the run folder.

Keeping up: every FOLLOW_SECONDS a follower compares the store's files (names, sizes,
times: one directory scan) with those it last read. When only the WAL changed (rows the
leader wrote: online updates) it catches up (`try_catch_up_with_primary`, about 1 ms) on
the instance it has: one instance a follower while the MANIFEST is unchanged. When the
MANIFEST changed (tables made, dropped or ingested: loads, large update rounds; flushes,
compactions), and before every model change, it opens a new instance, which also sees the
tables made since (an instance sees only the column families it was opened with; a
catch-up over a column family made or dropped fails for good: "MANIFEST record
referencing unknown column family"), and never reads a row its memtable replayed over a
newer ingested one (a catch-up past an ingestion did: test_rocksdb.py). Opening takes
20-200 ms plus the replay of the leader's WAL, with the GIL held (rocksdict): the leader's
store options keep that log short (store.py), and the leader flushes every table before
it makes one or ingests (`_flush_for_followers` in tier.py), so the instances a reload
opens replay next to nothing. The instance before is closed at once and its folder
removed: handles of it that lookups in flight hold keep working (rocksdict
shares the database between them, and RocksDB writes only its info log there), so those
lookups finish on it.

Never while the MANIFEST holds a drop: opening a secondary instance replays the MANIFEST,
and with the RocksDB of rocksdict 0.3.29 replaying the drop of a column family whose table
files the primary already deleted crashes the process (SIGSEGV in `Version::~Version` under
`VersionEditHandlerPointInTime::DestroyCfAndCleanup`; reproduced with a primary dropping,
making and ingesting column families while another process opens instances). So in a run
the leader (1) writes a new MANIFEST on every edit (`max_manifest_file_size` of one byte:
each starts with a snapshot of the store, which holds no history of drops), (2) makes
each drop under an exclusive lock of the store (`changing_store`) and writes one more edit
before it lets go (the load record's column family flushed), so the MANIFEST a follower
reads after it is a snapshot, and (3) opens its store under that lock too (its recovery
rewrites the MANIFEST); a follower opens and catches up only under the shared lock
(`reading_store`). The lock is a flock in the run folder: a leader killed holding it lets
go with its death.

Opening waits up to ATTACH_WAIT seconds for the leader to have made the store (the
workers start together).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
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
#: bytes of a secondary instance's info log before it rolls (the last two are kept)
INFO_LOG_BYTES = 256 << 10
#: seconds between two looks at the leader's store (a directory scan; online updates'
#: visibility target is p50 <= 100 ms)
FOLLOW_SECONDS = 0.05


def _store_key(path: str) -> tuple[Path, str] | None:
    """(the run's folder of RocksDB stores, a short name of the store at `path`) in a
    worker of a run, else None."""
    run = os.environ.get(RUN_DIR_ENV)
    if not run:
        return None
    return Path(run) / "rocksdb", hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]


def secondary_folder(path: str) -> Path | None:
    """The secondary folder of this process for the store at `path` when it is a
    follower worker of a run (it reads the leader's store), else None. Named
    `<store>-<worker>-<pid>`: the supervisor removes a dead worker's (run_dir.py)."""
    key = _store_key(path)
    index = os.environ.get(WORKER_ENV, "0")
    if key is None or index == "0":
        return None
    folder = key[0] / f"{key[1]}-{index}-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def leads_a_run() -> bool:
    """Whether this process is the leader worker of a run (the writer of its stores)."""
    return bool(os.environ.get(RUN_DIR_ENV)) and os.environ.get(WORKER_ENV, "0") == "0"


@contextlib.contextmanager
def _store_lock(path: str, mode: int) -> Iterator[None]:
    key = _store_key(path)
    if key is None:  # no run: no secondary instance reads this store
        yield
        return
    key[0].mkdir(parents=True, exist_ok=True)
    with open(key[0] / f"{key[1]}.lock", "a") as lock:
        fcntl.flock(lock, mode)
        yield


def changing_store(path: str) -> contextlib.AbstractContextManager[None]:
    """Held by the leader while it opens the store at `path`, drops a column family or
    flushes every one: no follower opens an instance or catches up meanwhile (see the
    module)."""
    return _store_lock(path, fcntl.LOCK_EX)


def reading_store(path: str) -> contextlib.AbstractContextManager[None]:
    """Held by a follower while it opens an instance or catches up (see the module)."""
    return _store_lock(path, fcntl.LOCK_SH)


def open_secondary(path: str, options: Any, folder: Path) -> tuple[Any, set[str]]:
    """Open a secondary instance of the store at `path` (made by the leader, waited for)
    with every column family it holds now. Returns `(Rdict, names of its column families
    other than "default")`. Raises TierSetupError when it cannot be opened."""
    folder.mkdir(parents=True, exist_ok=True)
    # its info log (a few lines each catch-up, 20 a second while updates come) rolls
    # within a bound in the run folder's tmpfs
    options.set_max_log_file_size(INFO_LOG_BYTES)
    options.set_keep_log_file_num(2)
    deadline = time.monotonic() + ATTACH_WAIT
    while not os.path.exists(os.path.join(path, "CURRENT")):
        if time.monotonic() > deadline:
            raise TierSetupError(
                f"RocksDB at {path!r}: the leader worker did not make the store within "
                f"{ATTACH_WAIT:.0f}s")
        time.sleep(0.05)
    for attempt in range(OPEN_ATTEMPTS):  # a loop over attempts
        try:
            with reading_store(path):  # never while the leader drops a table (the module)
                names = [n for n in rocksdict.Rdict.list_cf(path, options) if n != "default"]
                db = rocksdict.Rdict(path, options,
                                     column_families={n: options for n in names},
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
                try:
                    st = entry.stat()
                except FileNotFoundError:  # a WAL the leader deleted after the listing
                    continue
                into.append((entry.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(manifest)), tuple(sorted(wal))


class FollowsPrimary:
    """What `RocksDBTier` does as a secondary instance: catching up with the leader's
    writes, and reading a version from where the leader stored it; and as the leader,
    keeping its followers' new instances cheap."""

    secondary: Path | None
    path: str
    _leads: bool  # the leader of a run (leads_a_run)
    _options: Any
    _db: Any
    _families: set[str]
    _cfs: dict[str, Any]
    _handles: dict[str, Any]
    _meta: Any
    _changes: Any
    _change_log: Callable[[], Any]
    _dims: dict[str, int]
    _generations: dict[str, int]
    _aliases: dict[str, str]
    _whole: set[str]
    _lock: threading.Lock
    _follow_lock: threading.Lock
    _seen: tuple[Any, ...] = ()  # the store's files when last read (store_signature)
    _openings = 0
    _folder: Path | None = None  # the folder of the instance open now

    def _column_family(self, name: str, create: bool) -> Any:
        raise NotImplementedError

    def _flush_for_followers(self) -> None:
        """In a run's leader, before an edit of the store's table files (a table made, an
        ingestion): every table's rows written so far go into table files first.

        Each follower opens a new secondary instance at such an edit, which replays the
        log kept, holding the GIL: up to `max_wal_mb` of online updates (0.5-0.6 s for
        50 MiB on a busy 2-core box, several times a reload). After this it replays what
        was written since. Under the store's lock: followers open after the last table's
        flush, not between two (RocksDB deletes a log once every table in it is flushed).
        """
        if self._leads and self._db is not None:
            with changing_store(self.path):
                self._flush_every_table()

    def _flush_every_table(self) -> None:
        # rocksdict flushes one column family a call (atomic_flush: that one only); each
        # call leaves the GIL to the leader's lookups
        with self._lock:
            names = sorted(self._families)
        self._db.flush(True)  # "default"
        for name in names:  # a loop over column families
            self._db.get_column_family(name).flush(True)

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
            # the MANIFEST changed (tables made, dropped, ingested): a new instance (on
            # the first look, a catch-up tells: it fails over such a change)
            reopen = reopen or bool(self._seen) and seen[0] != self._seen[0]
            if not reopen:
                try:
                    with reading_store(self.path):
                        self._db.try_catch_up_with_primary()
                except Exception:  # a table it was not opened with: open it again
                    reopen = True
            if reopen:
                self._reopen()
            with self._lock:  # counts taken before are stale
                self._generations = {t: self._generations.get(t, 0) + 1 for t in self._dims}
            self._seen = seen

    def _reopen(self) -> None:
        """A new secondary instance in a folder of its own in place of the one before,
        which is closed and its folder removed (see the module)."""
        self._openings += 1
        folder = self.secondary / str(self._openings)  # type: ignore[operator]
        db, families = open_secondary(self.path, self._options, folder)
        # every table it knows, not only those it had handles of: one whose column family
        # was being made again when the instance before was opened has none there
        cfs = {n: db.get_column_family(self.stored_name(n))
               for n in set(self._cfs) | set(self._dims) if self.stored_name(n) in families}
        handles = {n: db.get_column_family_handle(self.stored_name(n)) for n in cfs}
        with self._lock:  # lookups in flight finish on the handles they hold
            old, self._db, self._families = self._db, db, families
            self._cfs, self._handles = cfs, handles
            old_folder, self._folder = self._folder, folder
        self._meta = self._column_family(META_CF, create=False)
        self._changes = self._change_log()
        # this handle only: the database lives on while a lookup in flight holds one of
        # its own; a close refused (the handle busy) leaves it to the garbage collector
        with contextlib.suppress(Exception):
            old.close()
        if old_folder is not None:
            shutil.rmtree(old_folder, ignore_errors=True)

    def read_as(self, table: str, stored: str, whole: bool = False) -> None:
        """In a worker of a run: serve `table` from the column family the leader stored
        it under (`stored`), which its own name for that version may differ from;
        `whole`: the op log says a leader wrote it whole (a replay), so a load of it
        writes nothing (`loaded_elsewhere`): followers read it meanwhile."""
        with self._lock:
            self._aliases[table] = stored
            (self._whole.add if whole else self._whole.discard)(table)
            self._cfs.pop(table, None)
            self._handles.pop(table, None)

    def loaded_elsewhere(self, table: str) -> bool:
        """Whether a leader before this process wrote `table` whole (`read_as`)."""
        return table in self._whole

    def read_elsewhere(self, table: str) -> bool:
        """Whether the column family of `table` is where another name reads a version
        from (`read_as`). A leader started again replays the version every worker
        serves under its own name, read from where the op log says it lies, which may
        be the staging name of the model's next version: the staging leftovers a first
        load drops (hps/server/registry.py) are then no leftovers."""
        with self._lock:
            stored = self._aliases.get(table, table)
            return any(k != table and v == stored for k, v in self._aliases.items())

    def stored_name(self, table: str) -> str:
        """The column family of `table` (another one where `read_as` says so)."""
        return self._aliases.get(table, table)
