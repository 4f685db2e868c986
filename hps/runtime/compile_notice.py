"""Saying that a compile runs, when it starts, but only when it really compiles.

A compile listener (`compile_on_use.compile_events`) hears a compile start, and whether
numba's disk cache lists the function (`from_cache`: a read of milliseconds, up to a
second or two on a loaded machine) or it must compile (seconds, the first run on a
machine). `CompileNotice` calls `say()` once, as soon as a compile that is no read has
run for `after` seconds: a first run is announced half a second into its first compile,
a run from the cache is never called compiling. Reads that run on (a loaded machine)
call `reading()` once instead, when one is given. It also keeps how many compiles are
done, how many of them were reads, and which function runs now, for a progress line.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hps.runtime.compile_on_use import CompileEvent

#: seconds a compile runs before it is announced
AFTER_S = 0.5


class CompileNotice:
    """Calls `say()` once, `after` seconds into the first compile still running then, and
    `reading()` (if given) once, `after` seconds into the first read from numba's cache
    still running then, unless `say()` was called first."""

    def __init__(self, say: Callable[[], None], after: float = AFTER_S,
                 reading: Callable[[], None] | None = None) -> None:
        self.say, self.after, self.reading = say, after, reading
        #: whether `say()` (a compile), and whether `reading()`, was called
        self.said = False
        self.said_reading = False
        self.done = 0
        #: of `done`, how many were read from numba's cache
        self.read = 0
        #: the function compiling now (its name without module), None between compiles
        self.running: str | None = None
        #: whether the one running now is a read from numba's cache
        self.running_read = False
        self._lock = threading.Lock()
        self._started: object | None = None

    def __call__(self, event: CompileEvent) -> None:
        with self._lock:
            if event.seconds is not None:
                self._started, self.running = None, None
                self.done += 1
                self.read += event.from_cache
                return
            self._started = started = object()
            self.running = event.function.rpartition(".")[2]
            self.running_read = event.from_cache
            if self.said or (event.from_cache and (self.said_reading or self.reading is None)):
                return
        timer = threading.Timer(self.after, self._announce, args=(started, event.from_cache))
        timer.daemon = True
        timer.start()

    def _announce(self, started: object, read: bool) -> None:
        with self._lock:
            if self.said or self._started is not started:
                return  # that compile ended (a read from the cache), or said already
            if read:
                if self.said_reading:
                    return
                self.said_reading = True
            else:
                self.said = True
        (self.reading if read else self.say)()  # type: ignore[misc]
