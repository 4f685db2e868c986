"""Counters and state of one update consumer, read by metrics, `/readyz` and the CLI.

Per table (labelled by its topic, `hps_et.<model>.<table>`): rows, messages and writes applied,
messages set aside by reason and the id of the last one (the dead letter), the last
applied position and publish time, the lag (messages not yet delivered, and how old the
newest applied message is while some are), and whether its source is broken (`failing`:
a stream key of another type, say), which never stops the other tables.
For the consumer: the state ("starting", "running", "down": the source cannot be read,
"retrying": a tier cannot take the writes, "stopped"), rows applied per second over the
last few seconds, and retries.

Rejections are logged once per (table, reason) at once, then at most once a minute with
the count since, so a stream of bad messages cannot flood the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hps.runtime.throttled_log import ThrottledLog
from hps.tiers.contract import TABLE_PREFIX

log = logging.getLogger("hps.updates")

#: seconds over which `rows_per_second` is measured
RATE_WINDOW = 5.0


@dataclass
class TableUpdates:
    """What one table (topic) received."""

    rows: int = 0
    messages: int = 0
    #: the writes (rounds) that brought them: messages per write shows the batching
    writes: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    last_position: str | None = None
    last_offset: int | None = None
    last_published: float | None = None
    lag_messages: int | None = None
    lag_seconds: float | None = None
    #: id (stream id, partition:offset) of the last message set aside: the dead letter
    last_rejected: str | None = None
    #: why the table's updates cannot be read now (its source is broken), else None
    failing: str | None = None
    #: rows of new keys a full shared hash map table left out: the persistent tier keeps
    #: them (`not_cached`, lookups read them there), or no tier does (`dropped`)
    not_cached: int = 0
    dropped: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "rejected": dict(self.rejected)}


class UpdateStats:
    """Thread-safe counters of one consumer (written by its thread, read by any)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.state = "starting"
        self.state_since = time.time()
        self.last_error: str | None = None
        self.retries = 0
        self._tables: dict[str, TableUpdates] = {}
        self._applied: deque[tuple[float, int]] = deque()  # (monotonic time, rows)
        self._lock = threading.Lock()
        self._rejections = ThrottledLog(log)  # per (table, reason)

    def _table(self, topic: str) -> TableUpdates:
        table = self._tables.get(topic)
        if table is None:
            table = self._tables[topic] = TableUpdates()
        return table

    # -- written by the consumer ----------------------------------------------------------

    def set_state(self, state: str, error: BaseException | None = None) -> None:
        """Record the source's state; a change to "down" is logged once."""
        with self._lock:
            changed = state != self.state
            if changed:
                self.state, self.state_since = state, time.time()
            if error is not None:
                self.last_error = f"{type(error).__name__}: {error}"
                self.retries += 1
        if changed and state == "down":
            log.warning("update source %s is down (%s); retrying with backoff, lookups go on",
                        self.source, self.last_error)
        elif changed and state == "retrying":
            log.warning("updates from %s wait for a tier (%s); retrying with backoff, lookups "
                        "go on", self.source, self.last_error)
        elif changed and state == "running" and error is None:
            log.info("update source %s is running", self.source)

    def applied(self, topic: str, rows: int, messages: int, position: str,
                offset: int | None, published: float) -> None:
        with self._lock:
            t = self._table(topic)
            t.rows += rows
            t.messages += messages
            t.writes += 1
            t.last_position, t.last_offset, t.last_published = position, offset, published
            now = time.monotonic()
            self._applied.append((now, rows))
            self._forget_before(now - RATE_WINDOW)

    def rejected(self, topic: str, reason: str, detail: str,
                 position: str | None = None) -> None:
        """Count one message set aside, keep its id (`position`) as the table's last, and
        log it (once a minute per table and reason)."""
        with self._lock:
            t = self._table(topic)
            t.rejected[reason] = t.rejected.get(reason, 0) + 1
            if position is not None:
                t.last_rejected = position
        self._rejections.warning(f"{topic}/{reason}", "update message of %s skipped (%s): %s",
                                 topic, reason, detail)

    def left_out(self, topic: str, rows: int, kept: bool) -> None:
        """Count `rows` of new keys the volatile tier had no room for (a shared hash map
        table at its capacity), `kept` by the persistent tier or by none; logged once a
        minute per table."""
        with self._lock:
            t = self._table(topic)
            if kept:
                t.not_cached += rows
            else:
                t.dropped += rows
        where = ("kept by the persistent tier, which lookups read them from" if kept else
                 "dropped: no persistent tier takes them")
        self._rejections.warning(
            f"{topic}/left_out", "update rows of %s: %d row(s) of new keys did not fit the "
            "shared hash map table (its capacity is fixed while workers map it: raise "
            "volatile_db.shared_headroom), %s; rows of keys it holds were written",
            topic, rows, where)

    def faults(self, failing: dict[str, str]) -> None:
        """Record which tables' sources are broken now (topic → why); the others are not.
        A table that turns failing is logged once, and once more when it recovers."""
        changes = []
        with self._lock:
            for topic in set(failing) | {k for k, v in self._tables.items() if v.failing}:
                t = self._table(topic)
                why = failing.get(topic)
                if why != t.failing:
                    changes.append((topic, why))
                    t.failing = why
        for topic, why in changes:
            if why is None:
                log.info("updates of %s are read again", topic)
            else:
                log.warning("updates of %s cannot be read (%s); the other tables' go on",
                            topic, why)

    def forget(self, models: Iterable[str]) -> None:
        """Drop the figures of every table of `models` (no longer followed)."""
        prefixes = tuple(f"{TABLE_PREFIX}.{m}." for m in models)
        if not prefixes:
            return
        with self._lock:
            for topic in [t for t in self._tables if t.startswith(prefixes)]:
                del self._tables[topic]

    def lag(self, backlog: dict[str, int]) -> None:
        """Record each table's backlog (messages not delivered yet)."""
        now = time.time()
        with self._lock:
            for topic, waiting in backlog.items():
                t = self._table(topic)
                t.lag_messages = int(waiting)
                if waiting == 0:
                    t.lag_seconds = 0.0
                elif t.last_published is not None:
                    t.lag_seconds = max(0.0, now - t.last_published)

    # -- read by anyone -------------------------------------------------------------------

    def rows_per_second(self) -> float:
        """Rows applied per second over the last RATE_WINDOW seconds."""
        with self._lock:
            self._forget_before(time.monotonic() - RATE_WINDOW)
            rows = sum(r for _, r in self._applied)
        return rows / RATE_WINDOW

    def _forget_before(self, moment: float) -> None:
        # with the lock held: the window stays a few seconds long whether read or not
        while self._applied and self._applied[0][0] < moment:
            self._applied.popleft()

    def as_dict(self) -> dict[str, Any]:
        """State, rate and per-table figures (the `updates` field of `/readyz`)."""
        rate = self.rows_per_second()
        with self._lock:
            return {
                "source": self.source,
                "state": self.state,
                "state_since": self.state_since,
                "last_error": self.last_error,
                "retries": self.retries,
                "rows_per_second": rate,
                "tables": {k: v.as_dict() for k, v in sorted(self._tables.items())},
            }
