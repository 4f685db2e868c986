"""Opening a RocksDB store for the persistent tier: its options, read-write or read-only.

A store is opened with every column family it holds (RocksDB refuses to open one
without them), with the options the tier's reads and bulk loads are tuned for: no
compression (float rows do not compress), table files read through mmap, a bloom filter
on files written through inserts, one block cache shared by all tables. A store opened
read-write also loses the spill and SST folders that a load cut short (a crash) left in
it; a read-only store must exist and is never written, not even touched: rocksdict
writes its settings file (`rocksdict-config.json`) into the folder it opens, whatever
the access, so a read-only open goes through a folder of links of its own
(`open_read_only`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import rocksdict

from hps.config import PersistentDBConfig
from hps.errors import StoreInUseError, TierSetupError
from hps.runtime.cores import usable_cores

#: column family RocksDB always has; the tier keeps nothing in it
DEFAULT_CF = "default"
#: column family of the tables' load records (small JSON per table)
META_CF = "hps_meta"
#: column family of the keys written to each table since its load (changes.py)
CHANGES_CF = "hps_changes"
#: folders of a store's bulk loads in progress start with this (`remove_stale_loads`)
INGEST_PREFIX = "hps_ingest_"


def store_options(config: PersistentDBConfig, block_cache_bytes: int) -> Any:
    """The rocksdict Options of a store opened for `config` (`read_only`, `num_threads`),
    with a block cache of `block_cache_bytes` shared by all its tables."""
    read_only = bool(config.read_only)
    opt = rocksdict.Options(raw_mode=True)
    opt.create_if_missing(not read_only)
    opt.create_missing_column_families(not read_only)
    opt.increase_parallelism(max(2, int(config.num_threads)))
    opt.set_max_subcompactions(max(1, min(int(config.num_threads), usable_cores())))
    opt.set_compression_type(rocksdict.DBCompressionType.none())
    # The write-ahead log is replayed, with the GIL held, by every new secondary instance
    # (a follower worker opens one at each change of the store's table files: flushes,
    # compactions, ingestions) and by a restart after a crash. RocksDB deletes a log
    # file once every table's rows in it are flushed, and a table written little (the
    # keys of each write in `hps_changes`: 8 bytes a row) kept the busy tables' logs:
    # 1.3 GiB after 15 minutes of small update rounds, a follower's lookups stopped 10 s
    # at each flush. So every table is flushed together (nothing left for a new instance
    # to replay after a flush), and a flush starts once the log passes `max_wal_mb`.
    opt.set_atomic_flush(True)
    opt.set_max_total_wal_size(int(config.max_wal_mb) << 20)
    # Reads map the table files: no pread call and no copy per block (half the time
    # of a random read where the files sit in the page cache).
    opt.set_allow_mmap_reads(True)
    # every table file opened at the opening and kept open (RocksDB's default, said here
    # because a read-only open relies on it: `open_read_only`)
    opt.set_max_open_files(-1)
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    table.set_block_cache(rocksdict.Cache(block_cache_bytes))
    opt.set_block_based_table_factory(table)
    return opt


_HELD_HERE = (
    "cannot open {where}: this process already has it open for writing (an HPS, a "
    "framework layer or a HierarchicalParameterServer not closed yet). Build them all from "
    "the same config file (one server per config is shared in a process), or close the "
    "other first")
# the ways to read it meanwhile name the config and its models, which only the server
# opening the store knows: it adds them (hps/server/store_in_use.py)
_HELD_ELSEWHERE = (
    "cannot open {where}: {who} (a running `hps serve`?) has it open for writing; a "
    "read-only open (persistent_db.read_only: true) reads it meanwhile")


def open_store(path: str, options: Any, read_only: bool) -> tuple[Any, set[str]]:
    """Open the store at `path` with `options` (`store_options`) and every column family
    it holds. Returns `(Rdict, names of its column families other than "default")`.

    Raises TierSetupError when it cannot be opened: missing while `read_only`, open for
    writing in this process (by another server), not a RocksDB directory; StoreInUseError
    when another process has it open for writing.
    """
    where = f"RocksDB at {path!r}"
    if read_only and not os.path.isdir(path):
        raise TierSetupError(
            f"{where} does not exist; persistent_db.read_only needs an existing store"
        )
    writer = None if read_only else writer_of(path)
    if writer == os.getpid():
        raise TierSetupError(_HELD_HERE.format(where=where))
    if writer is not None:  # refused before RocksDB touches the writer's files
        raise StoreInUseError(_HELD_ELSEWHERE.format(where=where, who=f"process {writer}"))
    try:
        families = {n: options for n in column_families(path, options) if n != DEFAULT_CF}
        if read_only:
            db = open_read_only(path, options, families)
        else:
            db = rocksdict.Rdict(path, options, column_families=families)
        return db, set(families)
    except Exception as exc:  # rocksdict raises plain Exception with RocksDB's text
        if "hold by current process" in str(exc):  # RocksDB's own words for its lock table
            raise TierSetupError(_HELD_HERE.format(where=where)) from exc
        if "lock" in str(exc).lower():
            raise StoreInUseError(_HELD_ELSEWHERE.format(
                where=where, who="another process")) from exc
        raise TierSetupError(f"cannot open {where}: {exc}") from exc


#: what a read-only open reads of a store, by name: all but rocksdict's settings file
#: (rewritten at every open), RocksDB's lock and info logs (a writer's), and loads in
#: progress
ROCKSDICT_SETTINGS = "rocksdict-config.json"
#: openings tried while a writer rolls its MANIFEST or writes table files between the
#: links and the opening
READ_ONLY_ATTEMPTS = 20


def _read_by_a_read_only_open(name: str) -> bool:
    return name not in (ROCKSDICT_SETTINGS, LOCK_FILE) and not name.startswith(
        ("LOG", INGEST_PREFIX))


def open_read_only(path: str, options: Any, families: dict[str, Any]) -> Any:
    """The store at `path` opened read-only with `families`, leaving every file of it and
    the folder itself as they were (contents and times).

    rocksdict writes its settings file into the folder it opens, also read-only (and
    fails where that folder is not writable), so the store is opened through a temporary
    folder holding a link to each of its files but that one. The folder goes once the
    store is open: with max_open_files -1 (`store_options`) RocksDB opens every table
    file at the opening and reads nothing by name afterwards (a read-only instance never
    sees new files). A writer at work may roll its MANIFEST or add table files between
    the links and the opening: linked again, up to READ_ONLY_ATTEMPTS times.
    """
    source = os.path.abspath(path)
    for attempt in range(READ_ONLY_ATTEMPTS):  # a loop over attempts, not keys
        links = tempfile.mkdtemp(prefix="hps-rocksdb-read-")
        try:
            for name in filter(_read_by_a_read_only_open, os.listdir(source)):
                os.symlink(os.path.join(source, name), os.path.join(links, name))
            return rocksdict.Rdict(links, options, column_families=families,
                                   access_type=rocksdict.AccessType.read_only(False))
        except Exception as exc:  # rocksdict raises plain Exception with RocksDB's text
            if "No such file" not in str(exc) or attempt + 1 == READ_ONLY_ATTEMPTS:
                # RocksDB names the file it could not read: the store's, not the link's
                raise Exception(str(exc).replace(links, source)) from None
        finally:
            shutil.rmtree(links, ignore_errors=True)
    raise AssertionError("unreachable")


#: the lock file RocksDB holds (a POSIX record lock) while a process has a store open
#: for writing
LOCK_FILE = "LOCK"


def writer_of(path: str) -> int | None:
    """The id of the process that has the store at `path` open for writing (this one
    too), or None: no store there, or no writer.

    Read from the kernel's table of file locks (/proc/locks) by the lock file's device
    and inode, without opening anything: opening the store to find out rotates its
    writer's info log (RocksDB opens that before it takes the lock), and closing any
    descriptor of the lock file in the writing process would drop its lock. None where
    the table cannot be read (not Linux): RocksDB's own refusal at open is then the check.
    """
    try:
        info = os.stat(os.path.join(path, LOCK_FILE))
    except FileNotFoundError:
        return None
    where = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii") as table:
            rows = table.read().split("\n")
    except OSError:
        return None
    for row in rows:
        # "1: POSIX  ADVISORY  WRITE 20583 fe:00:2146414 0 EOF"
        fields = row.split()
        if len(fields) >= 6 and fields[1] == "POSIX" and fields[3] == "WRITE" \
                and fields[5] == where:
            return int(fields[4])
    return None


def column_families(path: str, options: Any) -> list[str]:
    """Names of the column families of the store at `path`; none where there is no store
    yet."""
    if not os.path.exists(os.path.join(path, "CURRENT")):
        return []
    names: list[str] = rocksdict.Rdict.list_cf(path, options)
    return names


def remove_stale_loads(path: str) -> None:
    """Delete spill and SST folders that a load cut short (a crash) left in the store at
    `path`."""
    for entry in os.scandir(path):
        if entry.name.startswith(INGEST_PREFIX) and entry.is_dir():
            shutil.rmtree(entry.path, ignore_errors=True)


def stored_dim(cf: Any, read_options: Any) -> int | None:
    """Width of the rows a stored column family `cf` holds, from its first value (None
    if it is empty or None)."""
    if cf is None:
        return None
    it = cf.iter(read_options)
    it.seek_to_first()
    if not it.valid():
        return None
    size = len(it.value())
    del it
    return size // 4 if size % 4 == 0 and size else None
