"""Reference counts of a served model version: when may its tables be dropped?

A lookup holds its model version for as long as it reads the version's tables
(`acquire` … `release`). A reload swaps a new version in and retires the old one
(`retire(on_idle)`): the old version takes no new lookups, and its clean-up runs exactly
once, as soon as the last lookup that held it is done (at once when none does). No timer is
involved, so a slow lookup can never read a dropped table, and a retired version is never
kept longer than its last reader.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class VersionRefs:
    """Lookups in flight on one model version, and its retirement.

    Thread safety: every method may be called from any thread. `acquire` and `release`
    cost one uncontended lock each (the lookup path takes them once per call).
    """

    __slots__ = ("_lock", "_on_idle", "_refs", "_retired")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refs = 0
        self._retired = False
        self._on_idle: Callable[[], None] | None = None

    def acquire(self) -> bool:
        """Hold the version for one lookup; False (nothing held) once it is retired."""
        with self._lock:
            if self._retired:
                return False
            self._refs += 1
        return True

    def release(self) -> None:
        """End one `acquire`; the last release of a retired version runs its `on_idle`."""
        with self._lock:
            refs = self._refs - 1
            self._refs = refs
            if refs > 0 or self._on_idle is None:  # every lookup but a retired one's last
                if refs < 0:
                    raise RuntimeError("VersionRefs.release without a matching acquire")
                return
            run = self._take_idle_callback()
        if run is not None:
            run()

    def retire(self, on_idle: Callable[[], None]) -> bool:
        """Take no new lookups; returns True when none holds the version now.

        True: the caller does the retired version's clean-up itself, and `on_idle` is
        never called. False: `on_idle` runs once, in the thread of the last `release`, so
        it must be quick (hand the real work to a background worker). Retiring twice is
        an error.
        """
        with self._lock:
            if self._retired:
                raise RuntimeError("version retired twice")
            self._retired = True
            if self._refs == 0:
                return True
            self._on_idle = on_idle
            return False

    @property
    def in_flight(self) -> int:
        """Lookups holding the version now."""
        return self._refs

    @property
    def retired(self) -> bool:
        return self._retired

    def _take_idle_callback(self) -> Callable[[], None] | None:
        # called with the lock held: the callback is taken once and run outside the lock
        if self._refs == 0 and self._on_idle is not None:
            run, self._on_idle = self._on_idle, None
            return run
        return None
