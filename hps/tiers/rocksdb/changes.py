"""The keys written to a RocksDB table since its load: what a restart reads from the
store instead of the whole table.

A restart over a store that holds a model's files refills the volatile tier
(hps.server.restart_fill). The files give every row the load wrote at their own speed;
what online updates wrote or removed since is in the store only. So once a load has
written a table (`start`), every later write to it through the tier (`insert`, `remove`,
the bulk `load` of a large update round, a reload's carried-over rows) also puts its keys
into the column family `hps_changes`, and a restart reads the files and then those keys'
rows from the store.

Layout: per table, one record per write, `<column family name> NUL 0x01 <id>` holding
the write's keys as raw little-endian int64 (one put a write, whatever its size: a
record per key cost the updates half their write rate), and one record
`<column family name> NUL` holding "<token> <sequence number>". The token names the load
(the load record keeps the same token: a record another load or program wrote since
names another, or none); the sequence number is the store's after the last write this
tier noted. A key written again is noted again: once the keys noted since the last
merge reach the larger of MERGE_KEYS and twice the keys it left, the table's records are
merged into their distinct keys (one WriteBatch: they are deleted and the merged ones
put), so the log stays within a few times the keys changed.

Why the restart may trust it (`keys`), and when it does not:

- a write through `insert` or `remove` puts its keys in the same WriteBatch as its rows:
  both or neither, whatever crashes when;
- a bulk `load` (an ingested table file) puts its keys first, synced to the WAL, then
  ingests: a crash in between leaves keys noted that were not written, which only costs
  their reads;
- a write the tier did not note (another program, an `hps` without this log, a raw
  rocksdict handle) carries a sequence number above the one noted after the tier's
  last write: the table's newest row is then newer than the log (`table_seqno`, from
  its table files), and `keys` answers None. Rows still in a memtable have no file to
  tell: None too (a reopened store has none: RocksDB flushes what its WAL held).
  A compaction keeps sequence numbers (or zeroes them): it changes nothing here;
- a drop clears the table's records (`clear`), so a new load starts with none.

None sends the restart to a scan of the store: slower, never wrong.
"""

from __future__ import annotations

import itertools
import re
import struct
import threading
import time
import uuid
from typing import Any

import numpy as np
import rocksdict

#: one table file in RocksDB's `rocksdb.sstables` listing with its sequence numbers:
#: " <number>:<bytes>[<smallest> .. <largest>]"
_FILE_SEQNOS = re.compile(r"^\s*\d+:\d+\[(\d+) \.\. (\d+)\]", re.MULTILINE)
#: entries written and not yet in table files (the active and the immutable memtables)
_MEMTABLE_ENTRIES = ("rocksdb.num-entries-active-mem-table",
                     "rocksdb.num-entries-imm-mem-tables")
#: keys noted since the last merge of a table's records that start a merge, at least
MERGE_KEYS = 1 << 20
#: keys a merged record holds at most (8 MiB)
_RECORD_KEYS = 1 << 20


def table_seqno(cf: Any) -> int | None:
    """The highest sequence number of the rows column family `cf` holds, from its table
    files; None when rows wait in a memtable (no file tells their numbers)."""
    for entries in _MEMTABLE_ENTRIES:
        if int(cf.property_int_value(entries) or 0):
            return None
    return max((int(top) for _, top in _FILE_SEQNOS.findall(
        cf.property_value("rocksdb.sstables") or "")), default=0)


class ChangeLog:
    """The `hps_changes` column family of one store (see the module).

    `db` the store, `cf` and `handle` its `hps_changes` column family (None in a store
    opened read-only that lacks it: nothing is noted, `keys` answers None).
    Thread safety: any thread; writes to one table come one at a time (the applier's).
    """

    def __init__(self, db: Any, cf: Any, handle: Any) -> None:
        self._db, self._cf, self._handle = db, cf, handle
        self._tokens: dict[str, str | None] = {}  # table → its load's token, None: none
        # table → (keys noted since its last merge, keys that merge left)
        self._noted: dict[str, tuple[int, int]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def close(self) -> None:
        """Let go of the store's handles (it closes when none is held)."""
        self._db = self._cf = self._handle = None

    @staticmethod
    def _head(stored: str) -> bytes:
        return stored.encode() + b"\0"

    def _token(self, stored: str) -> str | None:
        if stored not in self._tokens:
            record = self._cf.get(self._head(stored)) if self._cf is not None else None
            self._tokens[stored] = record.decode().split(" ")[0] if record else None
        return self._tokens[stored]

    def noting(self, stored: str) -> bool:
        """Whether the writes to the table stored as `stored` are noted."""
        return self._token(stored) is not None

    def _record(self, stored: str) -> bytes:
        """A new record's name: the table's, then an id no other write has."""
        return self._head(stored) + b"\1" + struct.pack(">QI", time.time_ns(),
                                                         next(self._ids) & 0xFFFFFFFF)

    def add(self, batch: Any, stored: str, keys: np.ndarray) -> bool:
        """Put `keys` (int64) of a write to the table stored as `stored` into `batch`,
        when its writes are noted; returns whether they are."""
        if not keys.size or self._token(stored) is None:
            return False
        batch.put(self._record(stored), np.ascontiguousarray(keys, "<i8").tobytes(),
                  self._handle)
        with self._lock:
            since, left = self._noted.get(stored, (0, 0))
            self._noted[stored] = (since + keys.size, left)
        return True

    def add_synced(self, stored: str, keys: np.ndarray) -> bool:
        """Note `keys` before a write that is not a WriteBatch (an ingestion), synced to
        the WAL first (an ingested file is durable on return); returns whether noted."""
        batch = rocksdict.WriteBatch(raw_mode=True)
        if not self.add(batch, stored, keys):
            return False
        options = rocksdict.WriteOptions()
        options.sync = True
        self._db.write(batch, options)
        return True

    def written(self, stored: str) -> None:
        """After a noted write: the store's sequence number, which covers it."""
        token = self._token(stored)
        if token is None:
            return
        self._cf.put(self._head(stored), f"{token} {self._db.latest_sequence_number()}"
                     .encode())
        since, left = self._noted.get(stored, (0, 0))
        if since >= max(MERGE_KEYS, 2 * left):
            self._merge(stored)

    def _merge(self, stored: str) -> None:
        """The table's records replaced by records of their distinct keys, atomically."""
        keys = self._read(stored)
        batch = rocksdict.WriteBatch(raw_mode=True)
        batch.delete_range(self._head(stored) + b"\1", stored.encode() + b"\1", self._handle)
        for start in range(0, keys.size, _RECORD_KEYS):  # a loop over records, not keys
            batch.put(self._record(stored), keys[start:start + _RECORD_KEYS].tobytes(),
                      self._handle)
        self._db.write(batch)
        with self._lock:
            self._noted[stored] = (0, keys.size)

    def _read(self, stored: str) -> np.ndarray:
        """The distinct keys of the table's records (numeric order)."""
        options = rocksdict.ReadOptions()
        options.set_iterate_upper_bound(stored.encode() + b"\1")
        options.fill_cache(False)  # type: ignore[call-arg]
        values = list(self._cf.values(from_key=self._head(stored) + b"\1", read_opt=options))
        return np.unique(np.frombuffer(b"".join(values), "<i8"))

    def start(self, stored: str) -> str:
        """Note the writes to `stored` from now on, under a new token (returned), with
        no key noted: right after a load wrote the whole table."""
        token = uuid.uuid4().hex
        self.clear(stored)
        self._cf.put(self._head(stored), f"{token} {self._db.latest_sequence_number()}"
                     .encode())
        self._tokens[stored] = token
        return token

    def clear(self, stored: str) -> None:
        """Forget the table's records (a drop): its writes are noted no more."""
        self._tokens[stored] = None
        self._noted.pop(stored, None)
        if self._cf is None:
            return
        batch = rocksdict.WriteBatch(raw_mode=True)
        head = self._head(stored)
        batch.delete_range(head, stored.encode() + b"\1", self._handle)
        self._db.write(batch)

    def keys(self, stored: str, data: Any, token: str, most: int) -> np.ndarray | None:
        """The keys (int64, distinct, numeric order) written or removed in the table
        stored as `stored` (its column family `data`) since the load that `token` names;
        None when the log cannot tell (see the module) or notes more than `most`."""
        record = self._cf.get(self._head(stored)) if self._cf is not None else None
        if record is None:
            return None
        noted_token, _, covered = record.decode().partition(" ")
        newest = table_seqno(data)
        if noted_token != token or newest is None or newest > int(covered or -1):
            return None
        keys = self._read(stored)
        return None if keys.size > most else keys
