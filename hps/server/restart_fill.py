"""The volatile tier's rows on a restart over a persistent tier that holds the files.

When the persistent tier already holds a table's files (the loader's fingerprint check:
the same files, sizes and modification times), the loader skips rewriting it, but the
volatile tier (the in-process hash map) starts empty and takes its `initial_cache_rate`
share again. Its rows come from one of two places, chosen per table (`choose_source`):

- **the files**, when the store holds exactly what the load wrote: the table's
  `stored_version` (RocksDB: its table files) is the one recorded right after the load
  (no online update, nor anything else, wrote to it since) and the files repeat no key (a
  share of a chunk may hold a repeated key's earlier row, where the store serves its
  last). The files are read as the load read them, at their speed; the load gate checked
  these same files when they were loaded, so their rows are not checked again.
- **the store** otherwise (online updates since, a record without the mark: written by
  an older `hps` or another program, repeated keys): where the volatile tier takes the
  whole table, the table is scanned in bulk (`BulkLoadTier.scan`: RocksDB's iterators, one
  snapshot); where it takes a share, the share's keys are the files' and their rows are
  fetched from the store chunk by chunk.

The persistent tier is only read, never written, either way. Each table's log line says
which source filled it, why, and at what rate; `advance` is told the keys filled so far,
chunk by chunk (the load's progress).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hps.modelfiles.formats import ModelReader
from hps.modelfiles.read_ahead import read_ahead
from hps.server.volatile_share import shares, stored_rows
from hps.tiers.bulk_load import BulkLoadTier
from hps.tiers.contract import Tier

log = logging.getLogger("hps.server.loader")

#: the load record's key for the persistent tier's `stored_version` right after the load
STORED_VERSION = "stored_version"
#: rows a scan of the store hands over at once (a progress count every few 0.1 s)
_SCAN_ROWS = 1 << 17


@dataclass(frozen=True)
class FillSource:
    """Where a restart's volatile rows come from: `source` "files" or "store", and why."""

    source: str
    why: str


def choose_source(persistent: BulkLoadTier, name: str, stored: dict[str, Any] | None
                  ) -> FillSource:
    """The files when the persistent tier holds exactly the rows its load record says it
    loaded from them, else the store (see the module's docstring)."""
    if stored is None:
        return FillSource("store", "the store holds no load record of it")
    if int(stored.get("duplicate_keys", 0) or 0):
        return FillSource("store", "its files repeat keys, whose served rows the store holds")
    recorded = str(stored.get(STORED_VERSION, "") or "")
    if not recorded:
        return FillSource("store", "its load record does not say what the store held "
                                   "after the load")
    if persistent.stored_version(name) != recorded:
        return FillSource("store", "the store was written since the load (online updates)")
    return FillSource("files", "the store holds the files' rows, unchanged since the load")


def refill_volatile(name: str, reader: ModelReader, volatile: Tier,
                    persistent: BulkLoadTier, stored: dict[str, Any] | None, rate: float,
                    advance: Callable[[int, int], None]) -> FillSource:
    """Write the volatile tier's `rate` share of a table the persistent tier holds, from
    the source `choose_source` names; returns it. `advance(keys, file_bytes)` after each
    chunk written. Raises TierError when the volatile tier cannot take the rows (the
    persistent tier is only read)."""
    started = time.perf_counter()
    choice = choose_source(persistent, name, stored)
    bytes_per_row = reader.num_bytes / max(1, reader.num_keys)
    parts: Iterator[tuple[np.ndarray, np.ndarray]]
    if choice.source == "files":
        parts = shares(read_ahead(reader.chunks()), rate)  # the next chunk read meanwhile
    elif rate >= 1.0 and persistent.can_scan:
        parts = persistent.scan(name, _SCAN_ROWS)
    else:  # the files' share of each chunk, its rows as the store holds them
        parts = ((keys, stored_rows(persistent, name, keys, rows))
                 for keys, rows in shares(reader.chunks(), rate))
    written = 0
    for keys, rows in parts:
        volatile.insert(name, keys, rows)
        written += len(keys)
        advance(len(keys), int(len(keys) * bytes_per_row))
    seconds = time.perf_counter() - started
    log.info("%s: the %s tier took %d keys from the %s in %.2fs (%.0f keys/s): %s", name,
             volatile.name, written, choice.source, seconds, written / max(seconds, 1e-9),
             choice.why)
    return choice
