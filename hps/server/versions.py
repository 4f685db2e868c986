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
    take no lock while the version is served: a hold is one element of a list, and
    list.append / list.pop are atomic (the lookup path pays them on every call, where two
    uncontended locks cost about 1.4 µs on the GPU machines). The lock orders only a
    retirement against the last release.

    Why no hold is lost: `acquire` appends first and checks `retired` after, and `retire`
    sets `retired` first and counts the holds after (under the lock). So either the
    acquire sees the version retired and gives its hold back (False), or `retire` sees
    the hold and leaves the clean-up to the last release.
    """

    __slots__ = ("_holds", "_lock", "_on_idle", "_retired")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: list[None] = []
        self._retired = False
        self._on_idle: Callable[[], None] | None = None

    def acquire(self) -> bool:
        """Hold the version for one lookup; False (nothing held) once it is retired."""
        self._holds.append(None)
        if self._retired:
            self.release()
            return False
        return True

    def release(self) -> None:
        """End one `acquire`; the last release of a retired version runs its `on_idle`."""
        try:
            self._holds.pop()
        except IndexError:
            raise RuntimeError("VersionRefs.release without a matching acquire") from None
        if self._retired:
            with self._lock:
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
            if not self._holds:
                return True
            self._on_idle = on_idle
            return False

    @property
    def in_flight(self) -> int:
        """Lookups holding the version now."""
        return len(self._holds)

    @property
    def retired(self) -> bool:
        return self._retired

    def _take_idle_callback(self) -> Callable[[], None] | None:
        # called with the lock held: the callback is taken once and run outside the lock
        if not self._holds and self._on_idle is not None:
            run, self._on_idle = self._on_idle, None
            return run
        return None
