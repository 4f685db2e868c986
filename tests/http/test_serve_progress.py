"""The supervisor's own step in `hps serve --workers 2`, as a user sees it piped (a line
every 2 s with its own count and unit, never "0 of N" while work goes on): the workers
starting, and a worker started again after a SIGKILL (hps/http/workers_ready.py). Real
processes over the CLI; the start made to run for seconds by a table of 3M keys that
the leader loads, on an empty numba cache (a fresh machine: the loads compile). The
warm-up's own lines are tested in-process (tests/server/test_progress_lines.py): how
long it runs depends on the machine, not on any input."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.http.conftest import write_model
from tests.http.test_workers import start, stop, write_run

WARMING = re.compile(r"warming the lookup paths of model m: (?:none of \d+ lookups run yet|"
                     r"(?P<count>\d+) of \d+ lookups run \(\d+%\)), (?P<seconds>\d+) s so far")
STARTING = re.compile(r"^starting 2 workers: (?:none of 2 workers ready yet|(?P<count>[12]) "
                      r"of 2 workers ready \(\d+%\)), (?P<seconds>\d+) s so far$")
#: keys of the table the leader loads (width 8: 92 MiB of rows)
BIG = 3_000_000
ZERO = re.compile(r"\b0 of [\d,]+|\(0%\)")


def _steps(lines: list[str], pattern: re.Pattern[str]) -> list[tuple[int, int]]:
    """(count, seconds so far) of each line `pattern` matches (count 0 for "none")."""
    found = [m for m in map(pattern.search, lines) if m]
    return [(int(m["count"] or 0), int(m["seconds"])) for m in found]


def _rising(steps: list[tuple[int, int]]) -> None:
    """Counts and seconds that never go back, a line every 2 s or so."""
    assert [c for c, _ in steps] == sorted(c for c, _ in steps), steps
    assert [s for _, s in steps] == sorted(s for _, s in steps), steps
    assert len({s for _, s in steps}) == len(steps), steps  # each line later than the last


def test_workers_starting_and_one_started_again_say_how_far_they_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))  # seconds of compiles
    model = write_model(tmp_path / "model", sizes=(BIG, 2_000))  # seconds of loading
    served = start(*write_run(tmp_path, model.config))
    try:
        served.wait_for("every model is loaded in every worker", timeout=240)
        before = [line.rstrip("\n") for line in served.seen]
        starting = _steps(before, STARTING)
        assert starting, "\n".join(before)
        _rising(starting)
        assert any(re.fullmatch(r"starting 2 workers: done in [\d.]+ s, 2 of 2 workers "
                                r"ready", line) for line in before), "\n".join(before)
        # each worker's own warm-up, in its own lines, when it runs seconds
        for index in (0, 1):
            _rising(_steps([line for line in before if line.startswith(
                f"hps worker {index}: ")], WARMING))
        killed = served.worker_pids()[1]
        os.kill(killed, signal.SIGKILL)
        served.wait_for("hps: worker 1 is back: ready ", timeout=120)
        after = [line.rstrip("\n") for line in served.seen[len(before):]]
        assert any(f"worker 1 (pid {killed}) exited" in line for line in after), after
        back = [line for line in after if line.startswith("worker 1 coming back: ")]
        assert all(re.fullmatch(r"worker 1 coming back: (none of 1 workers ready yet, \d+ s "
                                r"so far|done in [\d.]+ s, 1 of 1 workers ready)", line)
                   for line in back), back
        assert not [line for line in served.seen if ZERO.search(line)], served.seen
    finally:
        assert stop(served) == 0
