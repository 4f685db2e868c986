"""The bars `hps` draws on a terminal (hps/tools/cli/progress.py), rendered as a terminal
shows them while a real load runs (the in-process tier over RocksDB files): before the
first keys are counted a table's bar says they are on their way (never "0 of N"), then
its count advances with each chunk written; a step's bar (not keys) in its own unit."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest
from rich.console import Console
from rich.progress import Progress

from hps.server import HierarchicalParameterServer
from hps.server.loader import BothProgress, LoadProgress
from hps.tools.cli import progress as cli_progress
from hps.tools.cli.progress import BarProgress, progress_bars
from tests.server.test_progress_lines import CHUNK_BYTES, _config


class _Screens(LoadProgress):
    """What the bars show after each event of the load (told after the bars are)."""

    def __init__(self, bars: Progress) -> None:
        self.bars = bars
        self.screens: list[str] = []

    def _shot(self) -> None:
        screen = Console(file=io.StringIO(), width=160, color_system=None)
        screen.print(self.bars.get_renderable())
        self.screens.append(screen.file.getvalue())  # type: ignore[attr-defined]

    def start_table(self, table: str, num_keys: int, num_bytes: int) -> None:
        self._shot()

    def advance(self, keys: int, num_bytes: int) -> None:
        self._shot()

    def finish_table(self, table: str, seconds: float) -> None:
        self._shot()


def test_a_bar_never_sits_at_zero_and_counts_each_chunk(tmp_path: Path) -> None:
    bars = Progress(*progress_bars().columns, auto_refresh=False)
    screens = _Screens(bars)
    config = _config(tmp_path)
    for _ in ("first load", "restart over the filled store"):
        progress = BothProgress(BarProgress(bars), screens)  # drawn, not started: no live
        with HierarchicalParameterServer(config, progress=progress, chunk_bytes=CHUNK_BYTES):
            pass
        shown = screens.screens
        assert "10,240 keys, the first on their way" in shown[0], shown[0]
        assert not [s for s in shown if re.search(r"\b0 of 10,240", s)]
        counts = [int(m.group(1).replace(",", "")) for s in shown
                  for m in [re.search(r"([\d,]+) of 10,240 keys", s)] if m]
        assert counts[0] > 0 and counts == sorted(counts) and counts[-1] == 10_240
        assert len(set(counts)) >= 10
        screens.screens = []
        bars = Progress(*progress_bars().columns, auto_refresh=False)
        screens.bars = bars


def _screen(bars: Progress) -> str:
    screen = Console(file=io.StringIO(), width=160, color_system=None)
    screen.print(bars.get_renderable())
    return screen.file.getvalue()  # type: ignore[attr-defined]


def test_a_step_bar_shows_once_it_runs_a_while_in_its_own_unit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step (the warm-up's lookups, workers starting) draws nothing for its first
    EVERY_S seconds, then a bar in its own unit that pulses before the first is done."""
    monkeypatch.setattr(cli_progress, "EVERY_S", 0.05)
    bars = Progress(*progress_bars().columns, auto_refresh=False)
    shown = BarProgress(bars)
    shown.start_step("starting 2 workers", 2, "workers ready")
    assert "starting 2 workers" not in _screen(bars)  # hidden until it runs a while
    deadline = time.monotonic() + 30
    while "starting 2 workers" not in _screen(bars) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "none of 2 workers ready yet" in _screen(bars)
    shown.step(1)
    assert "1 of 2 workers ready" in _screen(bars) and "keys" not in _screen(bars)
    shown.step(1)
    shown.finish_step(1.0)
    assert "2 of 2 workers ready" in _screen(bars)
