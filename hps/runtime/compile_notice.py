"""Saying that a compile runs, when it starts, but only when it really compiles.

A compile listener (`compile_on_use.compile_events`) hears a compile start before it
knows whether numba's disk cache holds the function (a read of milliseconds) or it must
compile (seconds, the first run on a machine). `CompileNotice` calls `say()` once, as
soon as a compile has run for `after` seconds: a first run is announced half a second
into its first compile, a run from the cache is never announced. It also keeps how many
compiles are done and which function runs now, for a progress line.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hps.runtime.compile_on_use import CompileEvent

#: seconds a compile runs before it is announced
AFTER_S = 0.5


class CompileNotice:
    """Calls `say()` once, `after` seconds into the first compile still running then."""

    def __init__(self, say: Callable[[], None], after: float = AFTER_S) -> None:
        self.say, self.after = say, after
        self.said = False
        self.done = 0
        #: the function compiling now (its name without module), None between compiles
        self.running: str | None = None
        self._lock = threading.Lock()
        self._started: object | None = None

    def __call__(self, event: CompileEvent) -> None:
        with self._lock:
            if event.seconds is not None:
                self._started, self.running = None, None
                self.done += 1
                return
            self._started = started = object()
            self.running = event.function.rpartition(".")[2]
            if self.said:
                return
        timer = threading.Timer(self.after, self._announce, args=(started,))
        timer.daemon = True
        timer.start()

    def _announce(self, started: object) -> None:
        with self._lock:
            if self.said or self._started is not started:
                return  # that compile ended (a read from the cache), or said already
            self.said = True
        self.say()
