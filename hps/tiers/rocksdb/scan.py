"""Reading a whole table of the RocksDB tier back, and telling whether it was written to.

A restart over a store that holds a model's files refills the volatile tier
(hps.server.restart_fill). Two things of the store serve it:

- `stored_version`: the column family's table files (number and size of each) as one
  string. A bulk load ingests its files and nothing else writes them; any later write
  (an online update's `insert`, `remove` or `load`) adds a file (a flush, an ingestion)
  or sits in a memtable (then the mark is "", unknown). So a table whose mark is still
  the one recorded right after its load holds exactly the rows of its files. A compaction
  of its own could change the files without a write: the mark then differs and the
  caller reads the store, which is slower, never wrong. Since the store notes the keys
  written after a load (hps.tiers.rocksdb.changes), the mark decides only for load
  records without that log (a store an older `hps` filled).
- `scan`: every row, in RocksDB's (bytewise) order, in chunks of arrays, read from one
  snapshot by rocksdict's key and value iterators (one C call a row, driven by
  `itertools.islice`, no Python loop). Measured on the demo's tables on the 2-core
  machine: about 0.5-1 M rows/s, loaded; a table whose files are unchanged is read
  from the files instead, which is several times faster.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import rocksdict

from hps.rows.stored_values import decode_rows

#: one table file in RocksDB's `rocksdb.sstables` listing: " <number>:<bytes>[..."
_FILE_LINE = re.compile(r"^\s*(\d+):(\d+)\[", re.MULTILINE)
#: entries written and not yet in table files (the active and the immutable memtables)
_MEMTABLE_ENTRIES = ("rocksdb.num-entries-active-mem-table",
                     "rocksdb.num-entries-imm-mem-tables")
#: rows a scan hands over at once (1 MiB of keys; a progress count every few 0.1 s)
SCAN_CHUNK_ROWS = 1 << 17


def table_files_mark(cf: Any) -> str:
    """The table files of column family `cf` ("<number>:<bytes>" sorted, comma-joined);
    "" when it cannot tell: writes still in a memtable, or no file listed."""
    for entries in _MEMTABLE_ENTRIES:
        if int(cf.property_int_value(entries) or 0):
            return ""
    files = sorted(f"{n}:{size}" for n, size in _FILE_LINE.findall(
        cf.property_value("rocksdb.sstables") or ""))
    return ",".join(files)


def scan_rows(cf: Any, dim: int, chunk_rows: int = SCAN_CHUNK_ROWS
              ) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Every `(keys int64[m], rows float32[m, dim], bad)` chunk of column family `cf`,
    in bytewise key order, read from one snapshot (writes meanwhile are not seen);
    `bad` counts values of another width, whose keys are left out."""
    items = cf.snapshot().items(read_opt=_scan_options())  # one pass over the table
    while True:
        chunk = list(itertools.islice(items, chunk_rows))
        if not chunk:
            return
        keys, values = zip(*chunk, strict=True)  # pairs into two tuples, at C speed
        rows, good, bad = decode_rows(list(values), dim)
        k = np.frombuffer(b"".join(keys), "<i8")
        yield (k if not bad else k[good]), rows, bad


def _scan_options() -> Any:
    options = rocksdict.ReadOptions()
    options.set_verify_checksums(False)
    # a scan's blocks would push the lookups' out of the cache (rocksdict's stub lacks
    # the argument its method takes)
    options.fill_cache(False)  # type: ignore[call-arg]
    options.set_readahead_size(4 << 20)
    return options
