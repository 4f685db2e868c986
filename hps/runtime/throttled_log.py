"""Warnings that repeat on every call (a full Redis, bad rows in a tier) logged once per
kind per interval, with how many were held back meanwhile: counters say how often,
the log says what.

    bad_rows = ThrottledLog(log, interval=60.0)
    bad_rows.warning("wrong_type", "redis holds %s under %s", what, name)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class ThrottledLog:
    """Logs a message of a given `kind` at most once per `interval` seconds.

    Thread safety: `warning` may be called from any thread.
    """

    def __init__(self, log: logging.Logger, interval: float = 60.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._interval = float(interval)
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> bool:
        """Log `message % args` as a warning unless `kind` was logged within the
        interval; True when it was logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        if held:
            message += " (%d more like it in the last %.0f s not logged)"
            args = (*args, held, self._interval)
        self._log.warning(message, *args)
        return True
