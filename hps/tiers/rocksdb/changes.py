"""The keys written to a RocksDB table since its load: what a restart reads from the
store instead of the whole table.

A restart over a store that holds a model's files refills the volatile tier
(hps.server.restart_fill). The files give every row the load wrote at their own speed;
what online updates wrote or removed since is in the store only. So once a load has
written a table (`start`), every later write to it through the tier (`insert`, `remove`,
the bulk `load` of a large update round, a reload's carried-over rows) also puts its keys
into the column family `hps_changes`, and a restart reads the files and then those keys'
rows from the store.

Layout: one record per key, `<column family name> NUL <8-byte key>` with an empty value,
and one per table, `<column family name> NUL`, holding "<token> <sequence number>". The
token names the load (the load record keeps the same token: a record another load or
program wrote since names another, or none); the sequence number is the store's after
the last write this tier noted.

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
import uuid
from typing import Any

import numpy as np
import rocksdict

from hps.tiers.rocksdb.encoding import consume

#: one table file in RocksDB's `rocksdb.sstables` listing with its sequence numbers:
#: " <number>:<bytes>[<smallest> .. <largest>]"
_FILE_SEQNOS = re.compile(r"^\s*\d+:\d+\[(\d+) \.\. (\d+)\]", re.MULTILINE)
#: entries written and not yet in table files (the active and the immutable memtables)
_MEMTABLE_ENTRIES = ("rocksdb.num-entries-active-mem-table",
                     "rocksdb.num-entries-imm-mem-tables")
#: keys read from the log at once
_READ_KEYS = 1 << 16


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

    def add(self, batch: Any, stored: str, keys: np.ndarray) -> bool:
        """Put `keys` (int64) of a write to the table stored as `stored` into `batch`,
        when its writes are noted; returns whether they are."""
        if not keys.size or self._token(stored) is None:
            return False
        head = self._head(stored)
        records = np.empty((keys.size, len(head) + 8), np.uint8)
        records[:, : len(head)] = np.frombuffer(head, np.uint8)
        records[:, len(head):] = np.ascontiguousarray(keys, "<i8").view(np.uint8).reshape(-1, 8)
        names = records.view(f"V{records.shape[1]}").reshape(-1).tolist()
        consume(map(batch.put, names, itertools.repeat(b""),
                     itertools.repeat(self._handle)))
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
        if token is not None:
            self._cf.put(self._head(stored), f"{token} {self._db.latest_sequence_number()}"
                         .encode())

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
        if self._cf is None:
            return
        batch = rocksdict.WriteBatch(raw_mode=True)
        head = self._head(stored)
        batch.delete_range(head, stored.encode() + b"\1", self._handle)
        self._db.write(batch)

    def keys(self, stored: str, data: Any, token: str, most: int) -> np.ndarray | None:
        """The keys (int64, distinct, bytewise order) written or removed in the table
        stored as `stored` (its column family `data`) since the load that `token` names;
        None when the log cannot tell (see the module) or notes more than `most`."""
        record = self._cf.get(self._head(stored)) if self._cf is not None else None
        if record is None:
            return None
        noted_token, _, covered = record.decode().partition(" ")
        newest = table_seqno(data)
        if noted_token != token or newest is None or newest > int(covered or -1):
            return None
        head = self._head(stored)
        options = rocksdict.ReadOptions()
        options.set_iterate_upper_bound(stored.encode() + b"\1")
        options.fill_cache(False)  # type: ignore[call-arg]
        names = self._cf.keys(from_key=head + b"\0" * 8, read_opt=options)
        parts, count = [], 0
        while True:
            chunk = list(itertools.islice(names, _READ_KEYS))
            if not chunk:
                break
            count += len(chunk)
            if count > most:
                return None
            raw = np.frombuffer(b"".join(chunk), np.uint8).reshape(len(chunk), -1)
            parts.append(np.ascontiguousarray(raw[:, len(head):]).view("<i8").reshape(-1))
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

