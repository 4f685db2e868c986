"""Background threads of the package: one bounded-queue worker, one periodic task, one
process-wide ticker over the objects that need it.

    writes = BackgroundWorker("hps-redis-insert", 1024, handle, log=log)
    if not writes.submit(item):      # never blocks: False when the queue is full
        count_the_drop()
    writes.wait_idle(timeout=5.0)    # everything submitted so far is handled
    writes.close(timeout=5.0)        # handle what is queued, then stop

The request path hands work to a worker and moves on; a full queue means the work is
dropped (and the caller counts it), never that a lookup waits. Exceptions a handler raises
are logged on the worker's logger with the thread's name, and the worker goes on.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

_log = logging.getLogger("hps.runtime.background")


class BackgroundWorker(Generic[T]):
    """One daemon thread (started on the first submit) handling a bounded queue in order.

    `handle` receives a list of 1 to `max_batch` items, in submission order: the items
    queued when the thread comes round, so a handler that can merge work (one fetch for
    several batches of keys) gets it merged, and one with `max_batch=1` gets one at a time.
    Thread safety: every method may be called from any thread.
    """

    def __init__(
        self,
        name: str,
        capacity: int,
        handle: Callable[[list[T]], None],
        *,
        max_batch: int = 1,
        log: logging.Logger = _log,
    ) -> None:
        if capacity < 1 or max_batch < 1:
            raise ValueError(f"{name}: capacity and max_batch must be >= 1, "
                             f"got {capacity} and {max_batch}")
        self.name = name
        self.capacity = int(capacity)
        self.max_batch = int(max_batch)
        #: submits refused because the queue was full or the worker closed
        self.dropped = 0
        self._handle = handle
        self._log = log
        self._items: deque[T] = deque()
        self._busy = 0  # items taken off the queue and not yet handled
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, item: T) -> bool:
        """Queue `item`; False (and `dropped` counts it) when full or closed. Never blocks
        on the handler."""
        with self._cond:
            if self._closed or len(self._items) >= self.capacity:
                self.dropped += 1
                return False
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def pending(self) -> int:
        """Items submitted and not yet handled."""
        with self._cond:
            return len(self._items) + self._busy

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every item submitted so far is handled; False if `timeout` (seconds)
        passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._busy, timeout)

    def discard(self) -> int:
        """Drop the queued items that no handler took yet; returns how many."""
        with self._cond:
            count = len(self._items)
            self._items.clear()
            self._cond.notify_all()
            return count

    def close(self, timeout: float) -> bool:
        """Refuse new items, handle the queued ones, stop the thread; True when it stopped
        within `timeout` seconds. Items still queued then are dropped (and logged).
        Idempotent."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is None:
            return True
        thread.join(timeout)
        if not thread.is_alive():
            return True
        left = self.discard()
        if left:
            self._log.warning("%s: %d queued items dropped at close", self.name, left)
        return False

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._items or self._closed)
                if not self._items:
                    return  # closed and drained
                batch = [self._items.popleft()
                         for _ in range(min(self.max_batch, len(self._items)))]
                self._busy = len(batch)
            try:
                self._handle(batch)
            except Exception:  # noqa: BLE001 - a background thread must not die
                self._log.exception("%s: background work failed", self.name)
            finally:
                with self._cond:
                    self._busy = 0
                    self._cond.notify_all()


class PeriodicTask:
    """Call `run()` every `interval` seconds on a daemon thread, the first time after
    `delay` seconds, until `close`. Errors are logged and the next round comes anyway."""

    def __init__(
        self,
        name: str,
        interval: float,
        run: Callable[[], object],
        *,
        delay: float = 0.0,
        log: logging.Logger = _log,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"{name}: interval must be > 0, got {interval}")
        self.name = name
        self._interval = float(interval)
        self._delay = float(delay)
        self._run = run
        self._log = log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self._stop.wait(self._delay):
            return
        while not self._stop.wait(self._interval):
            try:
                self._run()
            except Exception:  # noqa: BLE001 - a background thread must not die
                if self._stop.is_set():
                    return
                self._log.exception("%s: periodic run failed", self.name)

    def close(self, timeout: float) -> bool:
        """Stop; True when the thread ended within `timeout` seconds (a run under way is
        finished first). Idempotent."""
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()


class WeakTicker(Generic[T]):
    """One daemon thread for the process calling `tick(items)` every `interval()` seconds
    over the items `add`ed (held weakly: one nobody else holds drops out) that `keep`
    keeps. It starts with the first item and ends once none is left; the next `add` starts
    another. `interval` is read before each sleep (a module's setting, which tests shorten).
    Errors are logged and the next round comes anyway."""

    def __init__(self, name: str, interval: Callable[[], float],
                 tick: Callable[[list[T]], object], *,
                 keep: Callable[[T], bool] = lambda _: True,
                 log: logging.Logger = _log) -> None:
        self.name = name
        self._interval, self._tick, self._keep, self._log = interval, tick, keep, log
        self._items: weakref.WeakSet[T] = weakref.WeakSet()  # type: ignore[type-var]
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, item: T) -> None:
        with self._lock:
            self._items.add(item)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    def discard(self, item: T) -> None:
        with self._lock:
            self._items.discard(item)

    def _loop(self) -> None:
        while True:
            time.sleep(self._interval())
            with self._lock:
                items = [item for item in self._items if self._keep(item)]
                if not items:
                    self._thread = None
                    return
            try:
                self._tick(items)
            except Exception:  # noqa: BLE001 - a background thread must not die
                # the text only: a record carrying the traceback would keep the items its
                # frames hold alive for as long as a handler keeps the record
                self._log.error("%s: tick failed\n%s", self.name, traceback.format_exc())
            del items  # none kept alive while asleep
