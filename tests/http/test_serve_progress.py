"""The steps of `hps serve` that are no table's load, as a user sees them piped (a line
every 2 s, each with its own count and unit, never "0 of N" while work goes on): the
warm-up of a version's lookup paths (hps/server/warm_paths.py) and, with `--workers 2`,
the supervisor's workers starting and a worker started again after a SIGKILL
(hps/http/workers_ready.py). Real processes over the CLI; each phase made to run for
seconds by an empty numba cache (a fresh machine: the loads and the warm-up compile)."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.http.conftest import write_model
from tests.http.test_serve import ROOT, Process
from tests.http.test_workers import start, stop, write_run
from tests.support.redis_servers import free_port

WARMING = re.compile(r"warming the lookup paths of model m: (?:none of \d+ lookups run yet|"
                     r"(?P<count>\d+) of \d+ lookups run \(\d+%\)), (?P<seconds>\d+) s so far")
WARMED = re.compile(r"warming the lookup paths of model m: done in [\d.]+ s, (\d+) of \1 "
                    r"lookups run")
STARTING = re.compile(r"^starting 2 workers: (?:none of 2 workers ready yet|(?P<count>[12]) "
                      r"of 2 workers ready \(\d+%\)), (?P<seconds>\d+) s so far$")
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


def test_serve_says_how_far_the_warm_up_is(tmp_path: Path) -> None:
    model = write_model(tmp_path / "model")
    config, _ = write_run(tmp_path, model.config)
    env = {k: v for k, v in os.environ.items() if k != "HPS_TOKEN"}
    env.update(PYTHONPATH=str(ROOT), NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    proc = Process([sys.executable, "-m", "hps.tools.cli", "serve", str(config), "--port",
                    str(free_port())], env)
    try:
        proc.wait_for("every model is loaded", timeout=240)
    finally:
        assert proc.interrupt() in (0, 130)
    lines = [line.rstrip("\n") for line in proc.seen]
    warming = _steps(lines, WARMING)
    assert warming, "\n".join(lines)  # it compiles: seconds, so lines every 2 s
    _rising(warming)
    done = [m for m in map(WARMED.search, lines) if m]
    assert len(done) == 1, "\n".join(lines)
    total = int(done[0].group(1))
    assert total == 2 * 2 * 4 * 2  # two tables, two batch sizes, four dtypes, two calls
    assert lines.index(done[0].string) < next(
        i for i, line in enumerate(lines) if "every model is loaded" in line)
    assert not [line for line in lines if ZERO.search(line)], "\n".join(lines)


def test_workers_starting_and_one_started_again_say_how_far_they_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))  # seconds of compiles
    model = write_model(tmp_path / "model")
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
