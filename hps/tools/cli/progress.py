"""Progress of what takes seconds (loads, conversions, publishes, compiles), on stderr.

On a terminal, rich's bars and spinner; where stderr is no terminal (a pipe, a file,
CI's log) a plain line every few seconds instead, so `hps demo 2>&1 | tee log` is never
silent for long. A load's progress names each table as `model/table` and says the keys
so far, the rate and what remains; a step that counts other things (the warm-up's
lookups, workers ready: LoadProgress.start_step) shows once it has run EVERY_S seconds,
in its own unit.

- `load_progress()`: a LoadProgress for the time of a `with` block (bars or lines);
- `compile_status(what)`: a compile listener for the time of a `with` block, which says
  `what` when a compile has run for half a second, then how far it is; a read from
  numba's cache is never called compiling (a matter of milliseconds, it says nothing; on
  a loaded machine it may run on, and then says READING: hps/runtime/compile_notice.py).
"""

from __future__ import annotations

import contextlib
import threading
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

from hps.runtime.compile_notice import CompileLines
from hps.server.loader import LoadProgress
from hps.server.progress_lines import EVERY_S, LineProgress, table_label
from hps.tools.cli.root import err_console

if TYPE_CHECKING:
    from hps.runtime.compile_on_use import CompileEvent



def _say(line: str) -> None:
    err_console.print(line, markup=False, highlight=False, soft_wrap=True)


class _KeysPerSecond(ProgressColumn):
    def render(self, task: Any) -> Text:
        if "unit" in task.fields:  # a step: its things come at no steady rate
            return Text("")
        return Text(f"{task.speed:,.0f} keys/s" if task.speed else "")


class _Keys(ProgressColumn):
    """Keys so far of all; before the first are counted, all of them and that they are on
    their way (the bar pulses then: never "0 of N" while work goes on). A step's bar
    the same in its own unit."""

    def render(self, task: Any) -> Text:
        unit = task.fields.get("unit")
        if unit is not None:
            if task.total is None:
                return Text(f"none of {task.fields['count']:,} {unit} yet")
            return Text(f"{task.completed:,.0f} of {task.total:,.0f} {unit}")
        if task.total is None:
            return Text(f"{task.fields.get('keys', 0):,} keys, the first on their way")
        return Text(f"{task.completed:,.0f} of {task.total:,.0f} keys")


class BarProgress(LoadProgress):
    """A rich progress bar per table: keys so far of all, keys/s, time left."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task: TaskID | None = None
        self._total = 0
        self.step_task: TaskID | None = None
        self._step_total = 0

    def start_table(self, table: str, num_keys: int, num_bytes: int) -> None:
        # no total until keys are counted: a pulsing bar, not one sitting at 0
        self.task = self.progress.add_task(table_label(table), total=None, keys=num_keys)
        self._total = num_keys

    def advance(self, keys: int, num_bytes: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, advance=keys, total=self._total or None)

    def finish_table(self, table: str, seconds: float) -> None:
        if self.task is not None:
            self.progress.update(self.task, total=self._total, completed=self._total)

    def start_step(self, what: str, total: int, unit: str) -> None:
        """A bar of its own, shown once the step has run EVERY_S seconds (a step that
        takes less draws nothing); pulsing until the first is done."""
        self._hide_step()
        task = self.progress.add_task(what, total=None, count=total, unit=unit,
                                      visible=False)
        self.step_task, self._step_total = task, total
        show = threading.Timer(EVERY_S, self._show_step, args=(task,))
        show.daemon = True
        show.start()

    def _show_step(self, task: TaskID) -> None:
        if self.step_task == task:
            self.progress.update(task, visible=True)

    def step(self, done: int) -> None:
        if self.step_task is not None:
            self.progress.update(self.step_task, advance=done, total=self._step_total)

    def finish_step(self, seconds: float) -> None:
        task, self.step_task = self.step_task, None
        if task is not None:  # its count as it is: a step that failed ends short
            self.progress.update(task, total=self._step_total)

    def _hide_step(self) -> None:
        """A step replaced before it finished: its bar goes."""
        task, self.step_task = self.step_task, None
        if task is not None:
            self.progress.update(task, visible=False)


def progress_bars() -> Progress:
    """The progress bars of one command, on stderr (stdout keeps its results)."""
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(),
        _Keys(), _KeysPerSecond(),
        TimeRemainingColumn(), TimeElapsedColumn(), console=err_console, transient=False,
    )


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
    lines = LineProgress(_say, verb, quiet=quiet)
    try:
        yield lines
    finally:
        lines.close()


@contextlib.contextmanager
def compile_status(what: str) -> Iterator[Callable[[CompileEvent], None]]:
    """A listener for the compiles of the block (hps.runtime.compile_on_use.
    compile_events): once a compile has run half a second, `what` is said, then how many
    functions are compiled and which one runs; reads from numba's cache that run as long
    (a loaded machine) say READING instead, never `what` (CompileLines). A spinner's
    line on a terminal, plain lines every 2 s elsewhere."""
    status = err_console.status("") if _terminal() else None

    def show(text: str) -> None:
        if status is None:
            _say(text)
            return
        status.update(text)
        status.start()  # at the first thing to say (a no-op after)

    lines = CompileLines(show, what)

    def hear(event: CompileEvent) -> None:
        lines(event)
        if status is not None and (lines.notice.said or lines.notice.said_reading):
            status.update(f"{lines.line()} …")

    try:
        yield hear
    finally:
        lines.close()
        if status is not None:
            status.stop()
