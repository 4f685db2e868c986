"""The update consumer: polls a source, applies, then commits, on two threads.

    consumer = UpdateConsumer(source, applier, config, stats, followed)
    consumer.start()
    ...
    consumer.close()

Each round polls at most `max_commit_interval` messages (waiting up to
`poll_timeout_ms`; after a round that got messages, not before `min_round_interval_ms`
has passed: see `_pace`) and decodes them on the consumer's thread, then hands them to the
writer thread, which applies them (applier.py) and only then commits them. The next
round's poll and decode overlap the writer's work on the one before (one batch ahead at
most; batches are written and committed in order), so Redis/Kafka I/O and decoding run
while the tiers are written. A crash re-applies at most two rounds (at-least-once; every
write is an overwrite, so a replay ends in the same rows). A source that cannot be reached (broker
or Redis down) and a tier that cannot be written are retried with the package's backoff
(`hps/runtime/backoff.py`, from `failure_backoff_ms` up to `failure_backoff_max_ms`); the state
("running", "down") is in `UpdateStats`. Lookups never wait for any of this.

The models followed are asked of `followed()` every round, so a model loaded later is
read from then on (from its group's committed position, or the earliest message), and a
model removed is left: the source drops this group's position on its topics where it
can (`UpdateSource.follow`), and its tables' figures leave `UpdateStats`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from hps.config import UpdateSourceConfig
from hps.errors import TierUnavailableError, UpdateSourceUnavailableError
from hps.runtime.backoff import Backoff
from hps.updates.applier import Prepared, UpdateApplier
from hps.updates.contract import UpdateMessage, UpdateSource
from hps.updates.stats import UpdateStats

log = logging.getLogger("hps.updates")

T = TypeVar("T")

#: failures a round waits out and tries again
_RETRIED = (UpdateSourceUnavailableError, TierUnavailableError)
#: the states that a successful call ends, by what it reaches (see `_retried`)
_ENDED_BY = {"source": ("starting", "down"), "tiers": ("starting", "retrying")}
#: seconds between two backlog (lag) readings
LAG_INTERVAL = 1.0


class _Stopped(Exception):
    """The consumer was closed while it waited."""


class UpdateConsumer:
    """Polls `source`, writes through `applier`, commits; one daemon thread."""

    def __init__(self, source: UpdateSource, applier: UpdateApplier,
                 config: UpdateSourceConfig, stats: UpdateStats,
                 followed: Callable[[], Mapping[str, Sequence[str]]]) -> None:
        self.source = source
        self.applier = applier
        self.stats = stats
        self._followed = followed
        self._following: dict[str, tuple[str, ...]] | None = None
        self._max_messages = config.max_commit_interval
        self._timeout = config.poll_timeout_ms / 1000.0
        self._interval = config.min_round_interval_ms / 1000.0
        self._applied_at: float | None = None  # when the last poll that got messages ended
        self._backoff = Backoff(initial=config.failure_backoff_ms / 1000.0,
                                cap=max(config.failure_backoff_max_ms,
                                        config.failure_backoff_ms) / 1000.0)
        self._stop = threading.Event()
        self._next_lag = 0.0
        self._thread = threading.Thread(target=self._run, name="hps-updates", daemon=True)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hps-updates-write")
        self._written: Future[None] | None = None  # the batch handed to the writer last

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> bool:
        """Stop after the round under way (its messages stay uncommitted if it did not
        finish) and close the source; True when the thread ended in time. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        stopped = not self._thread.is_alive()
        if stopped:
            self._writer.shutdown(wait=True)  # a write under way ends (or gives up) first
            self.source.close()
        self.stats.set_state("stopped")
        return stopped

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
            except _Stopped:
                return
            except Exception:  # noqa: BLE001 - a bug must not end the updates for good
                log.exception("update round failed; the next one starts after a pause")
                if self._stop.wait(self._backoff.cap):
                    return

    def _round(self) -> None:
        self._follow()
        self._pace()
        messages = self._retried(
            lambda: self.source.poll(self._max_messages, self._timeout))
        self.stats.faults(self.source.faults())
        if messages:
            # a full round may leave more waiting (a backlog): the next one is not paced
            full = len(messages) >= self._max_messages
            self._applied_at = None if full else time.monotonic()
            prepared = self.applier.prepare(messages)
            self._wait_written()
            self._written = self._writer.submit(self._write, prepared, messages)
        elif self._written is not None:
            self._wait_written()  # idle: let the lag below see the last batch committed
        else:
            self.applier.idle()  # the memory kept for the next round goes back
        self._read_lag()

    def _pace(self) -> None:
        """After a round that got messages but not a full round's, the next poll waits until
        `min_round_interval_ms` has passed since (raises _Stopped if closed meanwhile). A
        message after a quiet spell is read at once, a backlog in full rounds back to back;
        a busy stream is read a few times a second, each round taking all that arrived
        meanwhile. Each round is Python on this thread and the writer's (poll, decode, tier
        and GPU writes, commit), and a lookup that wants the GIL back while it runs waits
        for it: with 10,000 update rows/s in 100 messages a second, rounds at most every
        50 ms took HugeCTR's profile on the H100 from p99 397-520 to 330-339 µs (checked
        between calls) and from 579-796 to 452-491 µs (back to back), in one device call
        (docs/gpu-latency.md, "Background work")."""
        if self._applied_at is None or not self._interval:
            return
        left = self._applied_at + self._interval - time.monotonic()
        if left > 0 and self._stop.wait(left):
            raise _Stopped()

    def _write(self, prepared: Prepared, messages: list[UpdateMessage]) -> None:
        """On the writer thread: apply, then commit (each retried on outages); the rows'
        buffers go back to the applier's pool once every tier has them."""
        try:
            self._retried(lambda: self.applier.write(prepared.batches), reaches="tiers")
        finally:
            prepared.release()
        done = prepared.done(messages)
        if done:
            self._retried(lambda: self.source.commit(done))

    def _wait_written(self) -> None:
        """Wait for the writer's batch; raises _Stopped if it gave up because of close,
        and passes on a failure of its own (the round fails: logged, retried later)."""
        written, self._written = self._written, None
        if written is not None:
            written.result()

    def _follow(self) -> None:
        wanted = {m: tuple(tables) for m, tables in self._followed().items()}
        if wanted != self._following:
            left = [m for m in self._following or () if m not in wanted]
            if left:  # the batch being written counts into their figures: done first
                self._wait_written()
            self._retried(lambda: self.source.follow(wanted))
            self.stats.forget(left)
            self._following = wanted

    def _read_lag(self) -> None:
        if not self.source.reports_backlog or time.monotonic() < self._next_lag:
            return
        self._next_lag = time.monotonic() + LAG_INTERVAL
        try:
            self.stats.lag(self.source.backlog())
        except UpdateSourceUnavailableError:
            pass  # the next poll finds the outage and reports it

    def _retried(self, call: Callable[[], T], reaches: str = "source") -> T:
        """`call()`, retried with backoff on outages; raises _Stopped when closed.

        `reaches` says what the call talks to ("source" or "tiers"): its success ends only
        the outage such a call reports. The writer thread's writes go on while the poll
        finds the source down, and must not report it running again."""
        def on_retry(exc: BaseException, delay: float) -> None:
            # the source itself, or a tier that cannot take the writes (Redis down)
            state = "down" if isinstance(exc, UpdateSourceUnavailableError) else "retrying"
            self.stats.set_state(state, exc)

        try:
            result = self._backoff.retry(call, retry_on=_RETRIED, stop=self._stop,
                                         on_retry=on_retry)
        except _RETRIED:
            raise _Stopped() from None  # stop was set while waiting (attempts are endless)
        if self.stats.state in _ENDED_BY[reaches]:
            self.stats.set_state("running")
        return result
