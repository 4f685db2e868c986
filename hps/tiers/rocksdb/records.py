"""The RocksDB tier's records of its tables' loads: the load record (`hps_meta`), the
mark of the table files a load left (`stored_version`), and the change log that notes
what was written since (hps.tiers.rocksdb.changes). A restart reads them to tell where
the volatile tier's rows come from (hps.server.restart_fill)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import rocksdict

from hps.tiers.rocksdb.changes import ChangeLog
from hps.tiers.rocksdb.scan import table_files_mark
from hps.tiers.rocksdb.store import CHANGES_CF


class LoadRecords:
    """What `RocksDBTier` keeps of its loads (see the module)."""

    read_only: bool
    _db: Any
    _meta: Any
    _changes: ChangeLog
    _handles: dict[str, Any]

    def _cf(self, table: str) -> Any:
        raise NotImplementedError

    def _column_family(self, name: str, create: bool) -> Any:
        raise NotImplementedError

    def _writable(self, what: str, table: str) -> None:
        raise NotImplementedError

    def stored_name(self, table: str) -> str:
        raise NotImplementedError

    def stored_version(self, table: str) -> str:
        """The table's files (hps.tiers.rocksdb.scan.table_files_mark)."""
        return table_files_mark(self._cf(table))

    def note_changes(self, table: str) -> str:
        """Note the keys of every write to `table` from now on (hps.tiers.rocksdb.changes);
        returns the token that names this load."""
        self._writable("note the changes of", table)
        return self._changes.start(self.stored_name(table))

    def changes(self, table: str, token: str, most: int) -> np.ndarray | None:
        """The keys written or removed since the load `token` names (ChangeLog.keys)."""
        return self._changes.keys(self.stored_name(table), self._cf(table), token, most)

    def _change_log(self) -> ChangeLog:
        cf = self._column_family(CHANGES_CF, create=not self.read_only)
        return ChangeLog(self._db, cf, self._handles.get(CHANGES_CF))

    def metadata(self, table: str) -> dict[str, Any] | None:
        """The JSON record stored for `table` by `set_metadata`, or None."""
        if self._meta is None:
            return None
        raw = self._meta.get(self.stored_name(table).encode())
        if raw is None:
            return None
        record: dict[str, Any] = json.loads(raw)
        return record

    def set_metadata(self, table: str, record: dict[str, Any]) -> None:
        """Store a small JSON-serializable record for `table` (durable: synced WAL)."""
        self._writable("set metadata of", table)
        options = rocksdict.WriteOptions()
        options.sync = True
        self._meta.put(self.stored_name(table).encode(),
                       json.dumps(record, sort_keys=True).encode(), options)
