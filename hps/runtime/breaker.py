"""A circuit breaker for a network tier: fail fast while it is down, reconnect behind.

Closed: calls go to the network. The first failure of an episode opens it (logged once);
while it is open every call raises `TierUnavailableError` at once, without touching the
network, and a background thread probes with the package's `Backoff` policy until a probe
succeeds, which closes it (logged once, with how long it lasted).
`backoff` must be endless (attempts None): the breaker reconnects until it is closed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hps.errors import TierSetupError, TierUnavailableError
from hps.runtime.backoff import Backoff


class CircuitBreaker:
    """The breaker of one tier named `name` ("redis": messages say "redis tier …").

    `failures` is the tier's counter dict (kind → count), updated under the breaker's
    lock; "rejected" counts calls failed fast while open. `probe()` reconnects or raises.
    Thread safety: every method may be called from any thread.
    """

    def __init__(
        self,
        name: str,
        failures: dict[str, int],
        probe: Callable[[], None],
        backoff: Backoff,
        log: logging.Logger,
    ) -> None:
        if backoff.attempts is not None:
            raise ValueError("a circuit breaker reconnects until closed: backoff.attempts "
                             f"must be None, got {backoff.attempts}")
        self.name = name
        self._failures = failures
        self._probe = probe
        self._backoff = backoff
        self._log = log
        self._lock = threading.Lock()
        self._open = False
        self._since = 0.0
        self._reason = ""
        self._rejected = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        #: how many times the breaker opened
        self.episodes = 0

    @property
    def is_open(self) -> bool:
        return self._open

    def count(self, kind: str, n: int = 1) -> None:
        """Count `n` failures that do not mean the tier is down (a saturated pool, bad
        rows…)."""
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + int(n)

    def check(self) -> None:
        """Raise TierUnavailableError, without network, while the breaker is open."""
        if not self._open:
            return
        with self._lock:
            if not self._open:
                return
            self._failures["rejected"] = self._failures.get("rejected", 0) + 1
            self._rejected += 1
            age = time.monotonic() - self._since
            reason = self._reason
        raise TierUnavailableError(
            f"{self.name} tier unavailable for {age:.1f} s ({reason}); "
            "reconnecting in the background"
        )

    def trip(self, kind: str, exc: BaseException) -> None:
        """Count a failure; the first of an episode opens the breaker and is logged."""
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1
            if self._open or self._stop.is_set():
                return
            self._open = True
            self._since = time.monotonic()
            self._reason = f"{kind}: {exc}"
            self._rejected = 0
            self.episodes += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._reconnect, name=f"hps-{self.name}-reconnect", daemon=True
                )
                self._thread.start()
        self._log.warning(
            "%s tier unavailable (%s: %s); lookups fall through to the next tier, "
            "reconnecting with backoff", self.name, kind, exc,
        )

    def _reconnect(self) -> None:
        last = ""
        for delay in self._backoff.delays():
            if self._stop.wait(delay):
                break
            try:
                self._probe()
            except Exception as exc:  # noqa: BLE001 - any failure means: try again later
                if isinstance(exc, TierSetupError) and str(exc) != last:
                    self._log.error("%s tier cannot reconnect: %s", self.name, exc)
                last = str(exc)
                self._log.debug("%s reconnect failed (%s)", self.name, exc)
                continue
            with self._lock:
                self._open = False
                self._thread = None
                age = time.monotonic() - self._since
                rejected = self._rejected
            self._log.info("%s tier is back after %.1f s (%d calls failed fast meanwhile)",
                           self.name, age, rejected)
            return
        with self._lock:
            self._thread = None

    def close(self) -> None:
        """Stop reconnecting (within a few seconds); the breaker stays as it is."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)
