"""Saying that a compile runs, when it starts, but only when it really compiles.

A compile listener (`compile_on_use.compile_events`) hears a compile start, and whether
numba's disk cache lists the function (`from_cache`: a read of milliseconds, up to a
second or two on a loaded machine) or it must compile (seconds, the first run on a
machine). `CompileNotice` calls `say()` once, as soon as a compile that is no read has
run for `after` seconds: a first run is announced half a second into its first compile,
a run from the cache is never called compiling. Reads that run on (a loaded machine)
call `reading()` once instead, when one is given. It also keeps how many compiles are
done, how many of them were reads, and which function runs now, for a progress line.

`CompileLines` says the same as lines: `what` when the first compile has run half a
second, then a line every 2 s while compiles go on (functions compiled, read from the
cache, the one running), for `hps serve` and the `hps` command where stderr is no
terminal.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hps.runtime.background import PeriodicTask
from hps.runtime.compile_on_use import CompileEvent

#: seconds a compile runs before it is announced
AFTER_S = 0.5
#: seconds between two of CompileLines' lines
EVERY_S = 2.0
#: what is said of reads from numba's cache that take a while (never "compiling")
READING = "reading compiled code from numba's cache"


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


class CompileLines:
    """A compile listener saying through `say`, as lines: `what` once a compile has run
    `after` seconds (READING for reads from numba's cache that run as long), then every
    `every` seconds while one runs how many functions are done and which one runs.
    `close()` when the compiles of interest are over."""

    def __init__(self, say: Callable[[str], None], what: str, every: float = EVERY_S,
                 after: float = AFTER_S) -> None:
        self.say, self.what = say, what
        self.notice = CompileNotice(lambda: say(f"{what} …"), after,
                                    reading=lambda: say(f"{READING} …"))
        self._ticker = PeriodicTask("hps-compile-lines", every, self._tick)

    def __call__(self, event: CompileEvent) -> None:
        self.notice(event)

    def line(self) -> str:
        """How far the compiles are: `what` (or READING while only reads ran on), the
        functions done, the one running."""
        notice = self.notice
        running = notice.running or "…"
        if notice.said:
            return (f"{self.what}: {notice.done - notice.read:,} functions compiled, "
                    f"{notice.read:,} read from the cache, now {running}")
        return f"{READING}: {notice.read:,} functions read, now {running}"

    def _tick(self) -> None:
        notice = self.notice
        if (notice.said or notice.said_reading) and notice.running is not None:
            self.say(f"{self.line()} …")

    def close(self) -> None:
        self._ticker.close(timeout=10.0)
