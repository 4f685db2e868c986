"""Progress of what takes seconds (loads, conversions, publishes, compiles), on stderr.

On a terminal, rich's bars and spinner; where stderr is no terminal (a pipe, a file,
CI's log) a plain line every few seconds instead, so `hps demo 2>&1 | tee log` is never
silent for long. A load's progress names each table as `model/table` and says the keys
so far, the rate and what remains.

- `load_progress()`: a LoadProgress for the time of a `with` block (bars or lines);
- `compile_status(what)`: a compile listener for the time of a `with` block, which says
  `what` when a compile has run for half a second, then how far it is; a read from
  numba's cache is never called compiling (a matter of milliseconds, it says nothing; on
  a loaded machine it may run on, and then says READING: hps/runtime/compile_notice.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from hps.runtime.compile_notice import CompileNotice
from hps.server.loader import LoadProgress
from hps.tiers.contract import TABLE_PREFIX
from hps.tools.cli.app import err_console

if TYPE_CHECKING:
    from hps.runtime.compile_on_use import CompileEvent

#: seconds between two plain progress lines
EVERY_S = 2.0
#: what `compile_status` says of reads from numba's cache that take a while
READING = "reading compiled code from numba's cache"


def table_label(name: str) -> str:
    """`model/table` for a table's storage name (`hps_et.model.table`, maybe with a
    reload's staging suffix); any other name as it is."""
    if name.startswith(TABLE_PREFIX + "."):
        model, _, table = name[len(TABLE_PREFIX) + 1:].partition(".")
        return f"{model}/{table.split('~', 1)[0]}"
    return name


def _say(line: str) -> None:
    err_console.print(line, markup=False, highlight=False, soft_wrap=True)


class _Ticker:
    """Calls `tick()` every `every` seconds on a daemon thread until `stop()`."""

    def __init__(self, tick: Callable[[], None], every: float = EVERY_S) -> None:
        self._stop = threading.Event()
        self._tick, self._every = tick, every
        self._thread = threading.Thread(target=self._run, name="hps-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._tick()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _KeysPerSecond(ProgressColumn):
    def render(self, task: Any) -> Text:
        return Text(f"{task.speed:,.0f} keys/s" if task.speed else "")


class BarProgress(LoadProgress):
    """A rich progress bar per table: keys so far of all, keys/s, time left."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task: TaskID | None = None

    def start_table(self, table: str, num_keys: int, num_bytes: int) -> None:
        self.task = self.progress.add_task(table_label(table), total=num_keys or None)

    def advance(self, keys: int, num_bytes: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, advance=keys)

    def finish_table(self, table: str, seconds: float) -> None:
        if self.task is not None:
            task = self.progress.tasks[self.task]
            self.progress.update(self.task, completed=task.total or task.completed)


def progress_bars() -> Progress:
    """The progress bars of one command, on stderr (stdout keeps its results)."""
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(),
        TextColumn("{task.completed:,.0f} of {task.total:,.0f} keys"), _KeysPerSecond(),
        TimeRemainingColumn(), TimeElapsedColumn(), console=err_console, transient=False,
    )


class LineProgress(LoadProgress):
    """A plain line per table when it starts and ends, and every EVERY_S seconds while
    it loads: keys so far of all, keys/s, time left (or that every key is read and the
    tiers are being written). `quiet`: a table says nothing until it has loaded for
    EVERY_S seconds (a lookup's small or stored tables stay silent)."""

    def __init__(self, verb: str = "loading", say: Callable[[str], None] = _say,
                 every: float = EVERY_S, quiet: bool = False) -> None:
        self.verb = f"{verb} " if verb else ""
        self.say = say
        self.quiet = quiet
        self._said = False  # about the table loading now
        self._lock = threading.Lock()
        self._table: str | None = None
        self._total = self._keys = 0
        self._started = 0.0
        self._ticker = _Ticker(self._tick, every)

    def start_table(self, table: str, num_keys: int, num_bytes: int) -> None:
        with self._lock:
            self._table, self._total, self._keys = self.verb + table_label(table), num_keys, 0
            self._started = time.perf_counter()
            self._said = not self.quiet
        if not self.quiet:
            self.say(f"{self._table}: {num_keys:,} keys, {num_bytes / 2**20:,.0f} MiB …")

    def advance(self, keys: int, num_bytes: int) -> None:
        with self._lock:
            self._keys += keys

    def finish_table(self, table: str, seconds: float) -> None:
        with self._lock:
            self._table = None
            if not self._said:
                return
        rate = f" ({self._total / seconds:,.0f} keys/s)" if seconds > 0 else ""
        self.say(f"{self.verb}{table_label(table)}: done, {self._total:,} keys in "
                 f"{seconds:.1f} s{rate}")

    def _tick(self) -> None:
        with self._lock:
            if self._table is None:
                return
            table, keys, total = self._table, self._keys, self._total
            seconds = time.perf_counter() - self._started
            self._said = True
        if keys >= total:
            self.say(f"{table}: all {total:,} keys read, writing them; {seconds:.0f} s so far")
            return
        rate = keys / seconds if seconds > 0 else 0.0
        left = f", about {(total - keys) / rate:,.0f} s left" if rate > 0 else ""
        self.say(f"{table}: {keys:,} of {total:,} keys ({keys / max(total, 1):.0%}), "
                 f"{rate:,.0f} keys/s{left}")

    def close(self) -> None:
        self._ticker.stop()


def _terminal() -> bool:
    return bool(err_console.is_terminal)


@contextlib.contextmanager
def load_progress(verb: str = "loading", quiet: bool = False) -> Iterator[LoadProgress]:
    """The progress of the loads made in the block: bars on a terminal, else lines
    (`verb` before each table's name; `quiet`: only for a table that takes a while)."""
    if _terminal():
        with progress_bars() as bars:
            yield BarProgress(bars)
        return
    lines = LineProgress(verb, quiet=quiet)
    try:
        yield lines
    finally:
        lines.close()


@contextlib.contextmanager
def compile_status(what: str) -> Iterator[Callable[[CompileEvent], None]]:
    """A listener for the compiles of the block (hps.runtime.compile_on_use.
    compile_events): once a compile has run half a second (CompileNotice), `what` is said,
    then how many functions are compiled and which one runs; reads from numba's cache
    that run as long (a loaded machine) say READING instead, never `what`. A spinner's
    line on a terminal, plain lines every EVERY_S seconds elsewhere."""
    status = err_console.status("") if _terminal() else None

    def line() -> str:
        running = notice.running or "…"
        if notice.said:
            return (f"{what}: {notice.done - notice.read:,} functions compiled, "
                    f"{notice.read:,} read from the cache, now {running}")
        return f"{READING}: {notice.read:,} functions read, now {running}"

    def begin(text: str) -> None:
        if status is None:
            _say(f"{text} …")
            return
        status.update(f"{text} …")
        status.start()

    notice = CompileNotice(lambda: begin(what), reading=lambda: begin(READING))

    def hear(event: CompileEvent) -> None:
        notice(event)
        if status is not None and (notice.said or notice.said_reading):
            status.update(f"{line()} …")

    def tick() -> None:
        if (notice.said or notice.said_reading) and notice.running is not None:
            _say(f"{line()} …")

    ticker = None if status is not None else _Ticker(tick)
    try:
        yield hear
    finally:
        if ticker is not None:
            ticker.stop()
        if status is not None and (notice.said or notice.said_reading):
            status.stop()
