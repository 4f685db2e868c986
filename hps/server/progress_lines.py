"""A load's progress as plain lines: one when a table starts and ends, and one every few
seconds while it loads, each with its own count (keys so far of all, keys/s, time left).

Where they go is the caller's: the `hps` command prints them on stderr where it is no
terminal (hps/tools/cli/progress.py draws bars on one); `HPS(...)` logs them through
`logging` at INFO (hps/api.py), so a user's program prints nothing of its own.

A line never reads "0 of N (0%)" while work goes on: before the first keys are counted
(a first chunk read, a restart's fill from the store) it says how long the table has
been at it instead.

A step that counts other things (`LoadProgress.start_step`: a version's lookup paths
warmed, workers started) says nothing unless it runs `every` seconds: then a line every
`every` seconds with its own count and unit, and one when it is done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hps.runtime.background import PeriodicTask
from hps.server.loader import LoadProgress
from hps.tiers.contract import TABLE_PREFIX

#: seconds between two progress lines
EVERY_S = 2.0


def table_label(name: str) -> str:
    """`model/table` for a table's storage name (`hps_et.model.table`, maybe with a
    reload's staging suffix); any other name as it is."""
    if name.startswith(TABLE_PREFIX + "."):
        model, _, table = name[len(TABLE_PREFIX) + 1:].partition(".")
        return f"{model}/{table.split('~', 1)[0]}"
    return name


@dataclass
class _Step:
    """A step under way (LoadProgress.start_step): what, how many of how many."""

    what: str
    total: int
    unit: str
    started: float
    done: int = 0
    said: bool = False
    #: when its last line was said (its start before the first)
    last: float = 0.0

    def how_far(self, seconds: float) -> str:
        if self.done == 0:  # not "0 of N": the first is under way
            return f"none of {self.total:,} {self.unit} yet, {seconds:.0f} s so far"
        return (f"{self.done:,} of {self.total:,} {self.unit} "
                f"({self.done / max(self.total, 1):.0%}), {seconds:.0f} s so far")


class LineProgress(LoadProgress):
    """A line per table when it starts and ends, and every `every` seconds (EVERY_S by
    default) while it loads: keys so far of all, keys/s, time left (or that every key is
    read and the tiers are being written), each through `say`. `quiet`: a table says
    nothing until it has loaded for `every` seconds (small or stored tables stay
    silent); a step (start_step) always so. `close()` when done."""

    def __init__(self, say: Callable[[str], None], verb: str = "loading",
                 every: float | None = None, quiet: bool = False) -> None:
        self.verb = f"{verb} " if verb else ""
        self.say = say
        self.quiet = quiet
        self._said = False  # about the table loading now
        self._lock = threading.Lock()
        self._table: str | None = None
        self._total = self._keys = 0
        self._started = 0.0
        self._step: _Step | None = None
        self._every = EVERY_S if every is None else every
        self._last = 0.0  # when the table loading now last said a line (or started)
        # looked at four times as often as a line is said: each line comes `every`
        # seconds after the one before (or the start), whenever that began
        self._ticker = PeriodicTask("hps-progress", self._every / 4, self._tick)

    def start_table(self, table: str, num_keys: int, num_bytes: int) -> None:
        with self._lock:
            self._table, self._total, self._keys = self.verb + table_label(table), num_keys, 0
            self._started = self._last = time.perf_counter()
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

    def start_step(self, what: str, total: int, unit: str) -> None:
        with self._lock:
            now = time.perf_counter()
            self._step = _Step(what, total, unit, now, last=now)

    def step(self, done: int) -> None:
        with self._lock:
            if self._step is not None:
                self._step.done += done

    def finish_step(self, seconds: float) -> None:
        with self._lock:
            step, self._step = self._step, None
        if step is not None and step.said:
            ended = "done" if step.done >= step.total else "stopped"  # a failure ends short
            self.say(f"{step.what}: {ended} in {seconds:.1f} s, {step.done:,} of "
                     f"{step.total:,} {step.unit}")

    def _tick(self) -> None:
        self._tick_step()
        with self._lock:
            if self._table is None:
                return
            now = time.perf_counter()
            if now - self._last < self._every:
                return
            table, keys, total = self._table, self._keys, self._total
            seconds, self._last = now - self._started, now
            self._said = True
        self.say(f"{table}: {_how_far(keys, total, seconds)}")

    def _tick_step(self) -> None:
        with self._lock:
            step = self._step
            if step is None:
                return
            now = time.perf_counter()
            if now - step.last < self._every:  # a step that takes less says nothing
                return
            seconds, step.last = now - step.started, now
            step.said = True
            line = f"{step.what}: {step.how_far(seconds)}"
        self.say(line)

    def close(self) -> None:
        self._ticker.close(timeout=10.0)


def _how_far(keys: int, total: int, seconds: float) -> str:
    """What a progress line says of a table `seconds` into its load, `keys` of `total`
    counted."""
    if keys >= total:
        return f"all {total:,} keys read, writing them; {seconds:.0f} s so far"
    if keys == 0:  # not "0 of N (0%), 0 keys/s": the first keys are on their way
        return f"{total:,} keys, the first of them on their way; {seconds:.0f} s so far"
    rate = keys / seconds if seconds > 0 else 0.0
    left = f", about {(total - keys) / rate:,.0f} s left" if rate > 0 else ""
    return (f"{keys:,} of {total:,} keys ({keys / max(total, 1):.0%}), {rate:,.0f} keys/s"
            f"{left}")
