"""Tables the leader worker drops from a tier every worker reads (Redis, RocksDB), held
until no worker serves them: `HeldDrops`.

A reload swaps the new version in and drops the old one's tables; an unload drops its
model's. One process does it once its own lookups are done with them. With workers, the
leader (worker 0) applies a model change first and every other worker after it, so the
others still serve the old tables for a moment after the leader swapped: a drop from a
tier they all read (a Redis or a RocksDB the leader writes for them) must wait until every
live worker applied the change too (its ack in the op log, hps/http/workers_ops.py).
Tables in the run's shared memory need no wait: a follower keeps the file it maps.

The leader's drops of the tables the workers served when the current op began are held,
tagged with that op, and made once every live worker acked it: on each poll of the op
log, and at the latest before the leader applies the next op (whose load may write those
names again). Any other drop (a failed load's tables, leftovers under a staging name) is
made at once: no worker serves them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from hps.errors import TierUnavailableError

log = logging.getLogger("hps.http.workers")


class HeldDrops:
    """The leader's drops from the tiers every worker reads (see the module).

    `HeldDrops(tiers, lowest_ack, wait)`: `tiers` are the tiers whose `drop_table` is
    held (wrapped here), `lowest_ack()` the last op every live worker applied, `wait` the
    most seconds `before_op` waits for the others (then it drops anyway, logged).
    """

    def __init__(self, tiers: Iterable[object], lowest_ack: Callable[[], int], wait: float
                 ) -> None:
        self._lowest_ack = lowest_ack
        self._wait = wait
        self._lock = threading.Lock()
        self._serving: set[str] = set()  # names the workers served when the op began
        self._op = 0
        self._held: list[tuple[int, Callable[[str], None], str]] = []
        for tier in tiers:
            drop = tier.drop_table  # type: ignore[attr-defined]
            tier.drop_table = self._dropper(drop)  # type: ignore[attr-defined]

    @property
    def held(self) -> bool:
        """Whether drops wait for the other workers' acks."""
        return bool(self._held)

    def _dropper(self, drop: Callable[[str], None]) -> Callable[[str], None]:
        def held_drop(table: str) -> None:
            with self._lock:
                if table in self._serving:
                    self._held.append((self._op, drop, table))
                    return
            drop(table)

        return held_drop

    def before_op(self, seq: int, serving: Iterable[str]) -> None:
        """Op `seq` is about to be applied here while the workers serve the tables
        `serving`: every drop held for an earlier op is made first (waiting for the other
        workers' acks)."""
        deadline = time.monotonic() + self._wait
        while self._held and self._lowest_ack() < max(op for op, _, _ in self._held):
            if time.monotonic() > deadline:
                log.warning("dropping %d table(s) before every worker acked the op that "
                            "replaced them (waited %.0fs)", len(self._held), self._wait)
                break
            time.sleep(0.01)
        self.flush(everything=True)
        with self._lock:
            self._op = seq
            self._serving = set(serving)

    def release(self) -> None:
        """The server stops: every held drop is made now, and later ones at once."""
        with self._lock:
            self._serving = set()
        self.flush(everything=True)

    def flush(self, everything: bool = False) -> None:
        """Make the held drops every live worker is past (all of them: `everything`)."""
        if not self._held:
            return
        acked = self._lowest_ack()
        with self._lock:
            due = [h for h in self._held if everything or h[0] <= acked]
            self._held = [h for h in self._held if h not in due]
        for _, drop, table in due:  # a loop over tables
            try:
                drop(table)
            except TierUnavailableError:
                log.warning("could not drop %s (its tier is unavailable)", table)
