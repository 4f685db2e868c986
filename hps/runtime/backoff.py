"""The one retry policy of the package: exponential backoff with jitter, a cap, a stop event.

    policy = Backoff(initial=0.1, cap=5.0)
    for delay in policy.delays():          # 0.1, 0.2, 0.4, … 5.0, 5.0, … (each ± jitter)
        ...
    value = policy.retry(fetch, retry_on=(OSError,), stop=closing)

Every tier's reconnect loop, the loader's remote reads and the update sources use it, so a
retry behaves the same wherever it happens: the n-th delay (n = 0, 1, …) is
`min(cap, initial × factor**n)`, multiplied by a uniform draw from
`[1 − jitter, 1 + jitter]` (so that clients do not retry in lockstep), and never more than
`cap`.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """How long to wait between tries, and how many tries there are.

    initial  first delay, seconds (> 0)
    cap      no delay is longer than this, jitter included (>= initial)
    factor   each delay is this times the one before, before the cap (>= 1)
    jitter   relative spread of each delay, in [0, 1): 0.2 → ±20 %
    attempts tries in all (the first included), None for as many as it takes
    """

    initial: float
    cap: float
    factor: float = 2.0
    jitter: float = 0.2
    attempts: int | None = None

    def __post_init__(self) -> None:
        if not self.initial > 0:
            raise ValueError(f"Backoff.initial must be > 0, got {self.initial}")
        if not self.cap >= self.initial:
            raise ValueError(f"Backoff.cap must be >= initial ({self.initial}), got {self.cap}")
        if not self.factor >= 1:
            raise ValueError(f"Backoff.factor must be >= 1, got {self.factor}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"Backoff.jitter must be in [0, 1), got {self.jitter}")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"Backoff.attempts must be >= 1, got {self.attempts}")

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The waits between tries, in seconds: `attempts - 1` of them, or endless.

        `rng` draws the jitter (the module's shared generator when None).
        """
        draw = rng.uniform if rng is not None else random.uniform
        base = self.initial
        count = 0
        while self.attempts is None or count < self.attempts - 1:
            yield min(self.cap, base * draw(1.0 - self.jitter, 1.0 + self.jitter))
            base = min(self.cap, base * self.factor)
            count += 1

    def retry(
        self,
        call: Callable[[], T],
        *,
        retry_on: tuple[type[BaseException], ...],
        stop: threading.Event | None = None,
        on_retry: Callable[[BaseException, float], None] | None = None,
    ) -> T:
        """`call()`'s result, calling it again after each delay while it raises `retry_on`.

        Raises the last error when the tries are used up or when `stop` is set (checked
        while waiting, so a stop ends the wait at once); errors not in `retry_on` at once.
        `on_retry(error, delay)` is called before each wait (to log it).
        """
        stop = stop or threading.Event()
        delays = self.delays()
        while True:
            try:
                return call()
            except retry_on as exc:
                delay = next(delays, None)
                if delay is None or stop.is_set():
                    raise
                if on_retry is not None:
                    on_retry(exc, delay)
                if stop.wait(delay):
                    raise
