"""The supervisor's own progress while workers start: `hps serve --workers N` shows the
workers starting (and one started again after it died) as a step of its own, counted in
workers ready, until each is.

A worker is ready once the process the supervisor started registered (its PID in the run
folder's `workers/`), replayed the op log and takes requests (`serving/`), and acked the
ops that were in the log when it was started (`acks/`): the first loads for the workers
started together, every op so far for one started again (hps/http/workers_oplog.py).
The serving note is written after the register that sets the ack back to 0, so the ack
read then is the new process's, never its predecessor's.

The step goes through a `LoadProgress` (`start_step`: a bar on a terminal, a line every
2 s where stderr is no terminal, nothing for a step that takes less), from a context
entered when workers start and left once they are ready; a worker started again is also
one line when it is ready, saying how long it took.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager

from hps.http.workers_oplog import OpLog
from hps.server.loader import LoadProgress

#: what a step's count is read as ("1 of 2 workers ready")
UNIT = "workers ready"


class WorkersComing:
    """The workers started and not ready yet, as one step of a LoadProgress that
    `progress()` makes (a context, entered while workers are pending): `start(indices,
    what, ops)` when the supervisor starts them, `poll(procs)` on each turn of its loop
    (True once none is pending), `close()` at the end. `say` gets the line of a worker
    started again."""

    def __init__(self, oplog: OpLog,
                 progress: Callable[[], AbstractContextManager[LoadProgress]],
                 say: Callable[[str], None]) -> None:
        self.oplog, self.say = oplog, say
        self._open = progress
        self._held = contextlib.ExitStack()
        self.progress = LoadProgress()
        self._pending: dict[int, tuple[int, float, bool]] = {}  # index → ops, since, again
        self._total = self._ready = 0
        self._what = ""
        self._started = 0.0

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def start(self, indices: list[int], what: str, ops: int, again: bool = False) -> None:
        """Workers `indices` were started (`again`: after one died), to be ready once
        they acked `ops` ops. Joins the step under way, if any (its count kept)."""
        now = time.monotonic()
        fresh = [i for i in indices if i not in self._pending]
        if not fresh:  # died while it started: the step under way counts it already
            return
        if not self._pending:
            self._total = self._ready = 0
            self._started = now
            self.progress = self._held.enter_context(self._open())
            self._what = what
        else:  # one more while others start: one step for all of them
            self._what = f"{self._total + len(fresh)} workers starting"
        self._pending.update({i: (ops, now, again) for i in fresh})
        self._total += len(fresh)
        self.progress.start_step(self._what, self._total, UNIT)
        if self._ready:
            self.progress.step(self._ready)

    def poll(self, procs: Mapping[int, subprocess.Popen[bytes]]) -> bool:
        """Count the pending workers that are ready now; True once none is pending."""
        for index, (ops, since, again) in list(self._pending.items()):
            proc = procs.get(index)
            if proc is None or not self._is_ready(index, proc.pid, ops):
                continue
            del self._pending[index]
            self._ready += 1
            self.progress.step(1)
            if again:
                self.say(f"worker {index} is back: ready {time.monotonic() - since:.1f} s "
                         "after it was started again")
        if not self._pending and self._total:
            self.progress.finish_step(time.monotonic() - self._started)
            self._total = 0
            self.close()
        return not self._pending

    def close(self) -> None:
        """Leave the progress's context (its bars or lines end)."""
        self.progress = LoadProgress()
        self._held.close()

    def _is_ready(self, index: int, pid: int, ops: int) -> bool:
        return self.oplog.served(index, pid) and self.oplog.acked(index) >= ops
