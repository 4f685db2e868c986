"""The bars `hps` draws on a terminal (hps/tools/cli/progress.py), rendered as a terminal
shows them while a real load runs (the in-process tier over RocksDB files): before the
first keys are counted a table's bar says they are on their way (never "0 of N"), then
its count advances with each chunk written."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from hps.server import HierarchicalParameterServer
from hps.server.loader import BothProgress, LoadProgress
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
