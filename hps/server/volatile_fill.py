"""Filling the volatile tier with tables a load had to leave out of it.

When Redis is down, full or read-only while a model loads, the model loads into the
persistent tier (and the GPU caches) and serves from there; its tables are marked
`volatile_ready = False`, so lookups do not read the volatile tier for them (it may hold
stale rows of an earlier version under the same name). A background worker
(`hps.runtime.background`) then tries, with the package's backoff, until the tier takes them: it
clears what the tier holds under the table's name (`clear_table`), writes the table's
`initial_cache_rate` share from the model files, and only then lets lookups read it.
Lookups never wait for any of this.

The same fill serves a tier that lost tables behind the server's back (a Redis restarted
without persistence, flushed, failed over to an empty replica): the tier notices through
the per-table markers its health probe checks (hps.tiers.redis.tier), lists them in
`stats()["lost_tables"]`, and `watch` marks the served ones not ready and refills them,
logging "redis tier available again, refilling N tables"; `/readyz` lists them as
pending meanwhile. Lookups skip the volatile tier for them until refilled, so answers
stay exact throughout.

A fill reads the files as the load did: those a request named (the version's `roots`)
beneath the same allowed roots (hps.modelfiles.confined), so a file swapped for a link
out of its root after the load is refused, not read; the table then stays served from
the persistent tier.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hps.errors import HPSError, TierError
from hps.modelfiles.confined import confined
from hps.modelfiles.formats import ModelReader
from hps.runtime.background import BackgroundWorker, PeriodicTask
from hps.runtime.backoff import Backoff
from hps.runtime.throttled_log import ThrottledLog
from hps.server.loader import fill_volatile
from hps.server.models import LoadedModel, LoadedTable
from hps.tiers.contract import Tier

log = logging.getLogger("hps")

#: seconds between looks at the tier's lost tables (its own probe runs about as often)
_WATCH_SECONDS = 1.0


@dataclass(eq=False)
class _Fill:
    model: LoadedModel
    table: LoadedTable
    open_reader: Callable[[], ModelReader]  # the table's files, read again for the fill


class VolatileFiller:
    """Fills `volatile` with the tables submitted, one at a time, retrying with `backoff`
    until each is in, or its model version is retired, or the filler closes.

    Thread safety: every method may be called from any thread.
    """

    def __init__(self, volatile: Tier, initial_cache_rate: float, backoff: Backoff, *,
                 stored: Tier | None = None) -> None:
        self.volatile = volatile
        # where the rows come from when it holds them (the persistent tier: it keeps the
        # rows of online updates, which the files do not have)
        self.stored = stored
        self.rate = initial_cache_rate
        self.backoff = backoff
        self._stop = threading.Event()
        self._fill_lock = threading.Lock()  # held while a fill writes
        self._lock = threading.Lock()
        self._pending: list[_Fill] = []
        self._log = ThrottledLog(log)
        self._worker: BackgroundWorker[_Fill] = BackgroundWorker(
            "hps-volatile-fill", 1 << 16, self._fill_each, log=log)
        self._watcher: PeriodicTask | None = None

    def watch(self, served: Callable[[], Iterable[LoadedModel]],
              reopen: Callable[[LoadedModel, LoadedTable], ModelReader]) -> None:
        """From now on, every `_WATCH_SECONDS`, refill the tables of `served()` the tier
        reports lost (`refill_lost`); `reopen(model, table)` opens a table's files."""
        self._watcher = PeriodicTask("hps-volatile-watch", _WATCH_SECONDS,
                                     lambda: self.refill_lost(served(), reopen), log=log)

    def refill_lost(self, served: Iterable[LoadedModel],
                    reopen: Callable[[LoadedModel, LoadedTable], ModelReader]) -> int:
        """Mark the tables of `served` that the tier lists in `stats()["lost_tables"]`
        not ready (lookups skip the tier for them) and fill them again in the
        background; returns how many. Tables already pending are left to their fill."""
        lost = set(self.volatile.stats().get("lost_tables", ()))
        if not lost:
            return 0
        with self._lock:
            pending = {id(f.table) for f in self._pending}
        todo = [(model, table) for model in served for table in model.tables
                if table.storage_name in lost and table.volatile_ready
                and id(table) not in pending and not model.refs.retired]
        if not todo:
            return 0
        log.warning("%s tier available again, refilling %d tables", self.volatile.name,
                    len(todo))
        for model, table in todo:
            table.volatile_ready = False
            self.submit(model, table, functools.partial(reopen, model, table))
        return len(todo)

    def submit(self, model: LoadedModel, table: LoadedTable,
               open_reader: Callable[[], ModelReader]) -> None:
        """Fill `table` (of served version `model`) from `open_reader()` once the tier
        takes it."""
        self.start(self.hold(model, table, open_reader))

    def hold(self, model: LoadedModel, table: LoadedTable,
             open_reader: Callable[[], ModelReader]) -> _Fill:
        """Count `table` as pending before its version is served (so readiness never
        shows a served table as filled), without filling it yet: `start` or `release`.
        The files of a version read beneath allowed roots (a request named them:
        `model.roots`) are reopened beneath the same roots on the fill's thread, whoever
        submits the fill (the load, or the watcher of lost tables)."""
        fill = _Fill(model, table, functools.partial(confined, model.roots, open_reader))
        with self._lock:
            self._pending.append(fill)
        return fill

    def start(self, fill: _Fill) -> None:
        """Fill a held table once the tier takes it."""
        if not self._worker.submit(fill):
            self._done(fill)  # closing: the table stays served from the persistent tier

    def release(self, fill: _Fill) -> None:
        """Forget a held table whose version was never served."""
        self._done(fill)

    def pending(self) -> list[LoadedTable]:
        """The tables not in the volatile tier yet."""
        with self._lock:
            return [f.table for f in self._pending]

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every table submitted so far is filled (or given up)."""
        return self._worker.wait_idle(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop retrying; fills not done by then are left (the tables stay served from
        the persistent tier)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.close(timeout)
        self._worker.close(timeout)

    def _fill_each(self, batch: list[_Fill]) -> None:
        for fill in batch:
            try:
                self._fill(fill)
            finally:
                self._done(fill)

    def _done(self, fill: _Fill) -> None:
        with self._lock:
            if fill in self._pending:
                self._pending.remove(fill)

    def quiesce(self) -> None:
        """Wait for the fill under way, if any, to end. A retired version's tables are
        dropped only after this: a fill checks for retirement before it writes."""
        with self._fill_lock:
            pass

    def _fill(self, fill: _Fill) -> None:
        name = fill.table.storage_name
        delays = self.backoff.delays()
        while not self._stop.is_set():
            with self._fill_lock:
                if fill.model.refs.retired:
                    return  # replaced or unloaded meanwhile: nothing to fill
                try:
                    # stale rows of an earlier version go; the table stays known
                    self.volatile.clear_table(name, fill.table.dim, fill.table.storage)
                    with fill.open_reader() as reader:
                        keys = fill_volatile(name, reader, self.volatile, self.rate,
                                             self.stored)
                except TierError as exc:
                    self._log.warning("fill", "%s: the %s tier still cannot take it (%s); "
                                      "retrying in the background", name, self.volatile.name,
                                      exc)
                except HPSError as exc:  # the files changed or went away since the load
                    log.warning("%s: not filled into the %s tier: %s; it is served from "
                                "the persistent tier", name, self.volatile.name, exc)
                    return
                else:
                    fill.table.volatile_ready = True
                    log.info("%s: %d keys are in the %s tier now", name, keys,
                             self.volatile.name)
                    return
            if self._stop.wait(next(delays)):
                return
