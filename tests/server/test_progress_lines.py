"""A load's progress as lines (hps/server/progress_lines.py), heard from real loads into
the in-process tier over real RocksDB files: a line while each table loads, with a count
that advances as keys are written, never "0 of N (0%)" while work goes on; the restart
over the filled store (the volatile tier filled from it) the same; the warm-up of the
lookup paths after it in lines of its own, counted in lookups; and `HPS(...)` logs the
lines through `logging` instead of printing them."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.api import HPS
from hps.server import HierarchicalParameterServer, progress_lines
from hps.server.loader import BothProgress, LoadProgress
from hps.server.progress_lines import LineProgress
from tests.conftest import model_config, write_table

KEYS, DIM = 10_240, 16
#: 512 rows a chunk: 20 chunks, each counted as it is written
CHUNK_BYTES = 512 * DIM * 4
COUNT = re.compile(r"loading m/sparse_embedding0: ([\d,]+) of 10,240 keys \(\d+%\)")


class _Lines:
    """The lines said, and a wait for the next one."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.heard = threading.Condition()

    def say(self, line: str) -> None:
        with self.heard:
            self.lines.append(line)
            self.heard.notify_all()

    def wait_after(self, seen: int, timeout: float = 30.0) -> None:
        with self.heard:
            assert self.heard.wait_for(lambda: len(self.lines) > seen, timeout=timeout)


class _OneLinePerChunk(LoadProgress):
    """Holds each advance of the load until a progress line came after it: the load goes
    on at the pace of the lines, so each chunk's count is seen, on any machine."""

    def __init__(self, said: _Lines) -> None:
        self.said = said

    def advance(self, keys: int, num_bytes: int) -> None:
        self.said.wait_after(len(self.said.lines))


def _config(tmp_path: Path) -> dict[str, Any]:
    keys = np.arange(KEYS, dtype=np.int64) * 7 - 5000
    vectors = np.random.default_rng(3).standard_normal((KEYS, DIM)).astype(np.float32)
    write_table(tmp_path / "t0", keys, vectors)
    return {"models": [model_config([str(tmp_path / "t0")], [DIM])],
            "volatile_db": {"type": "hash_map"},
            "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocks")}}


def _load(config: dict[str, Any]) -> list[str]:
    """The lines of one load of `config` (a table line every 0.02 s)."""
    said = _Lines()
    lines = LineProgress(said.say, every=0.02)
    try:
        progress = BothProgress(lines, _OneLinePerChunk(said))
        with HierarchicalParameterServer(config, progress=progress,
                                         chunk_bytes=CHUNK_BYTES) as server:
            assert server.lookup("m", 0, [-5000]).shape == (1, DIM)
    finally:
        lines.close()
    return said.lines


def _counts(lines: list[str]) -> list[int]:
    return [int(m.group(1).replace(",", "")) for m in map(COUNT.search, lines) if m]


def test_a_load_says_its_count_as_it_advances_never_zero_percent(tmp_path: Path) -> None:
    config = _config(tmp_path)
    for run in ("first load", "restart over the filled store"):
        lines = _load(config)
        assert lines[0] == "loading m/sparse_embedding0: 10,240 keys, 1 MiB …", run
        loads = [line for line in lines if line.startswith("loading ")]  # then the warm-up
        assert re.fullmatch(r"loading m/sparse_embedding0: done, 10,240 keys in .*", loads[-1])
        counts = _counts(lines)
        # the count advances with the chunks written (20 of them), and never goes back
        assert len(set(counts)) >= 10, (run, lines)
        assert counts == sorted(counts), (run, lines)
        assert not [line for line in lines if re.search(r"\b0 of [\d,]+ keys|\(0%\)", line)]


def test_a_line_before_the_first_keys_says_they_are_on_their_way() -> None:
    said = _Lines()
    lines = LineProgress(said.say, every=0.02)
    try:
        lines.start_table("hps_et.m.t", 600_000, 4 << 20)
        said.wait_after(1)
        lines.finish_table("hps_et.m.t", 1.0)
    finally:
        lines.close()
    assert re.fullmatch(r"loading m/t: 600,000 keys, the first of them on their way; \d+ s "
                        r"so far", said.lines[1])


def test_hps_logs_its_progress_and_prints_nothing(tmp_path: Path, monkeypatch: Any,
                                                 caplog: pytest.LogCaptureFixture,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(progress_lines, "EVERY_S", 0.01)  # a line for every table
    config = _config(tmp_path)
    with caplog.at_level(logging.INFO, logger="hps.progress"):
        hps = HPS(config)
        try:
            assert hps.lookup([-5000], "m", 0).shape == (1, DIM)
        finally:
            hps.close()
    said = [r.getMessage() for r in caplog.records if r.name == "hps.progress"]
    assert [r.levelno for r in caplog.records if r.name == "hps.progress"] == \
        [logging.INFO] * len(said)
    assert any(re.fullmatch(r"loading m/sparse_embedding0: done, 10,240 keys in .*", s)
               for s in said), said
    out, err = capfd.readouterr()
    assert out == "" and err == ""


class _OneLinePerLookup(LoadProgress):
    """Holds each lookup of the warm-up until a progress line came after it, as
    _OneLinePerChunk does for the load's chunks."""

    def __init__(self, said: _Lines) -> None:
        self.said = said

    def step(self, done: int) -> None:
        self.said.wait_after(len(self.said.lines))


WARMING = re.compile(r"warming the lookup paths of model m: (?:none of 16 lookups run yet|"
                     r"(\d+) of 16 lookups run \(\d+%\)), \d+ s so far")


def test_the_warm_up_says_its_own_count_of_lookups(tmp_path: Path) -> None:
    """The warm-up after the load (hps/server/warm_paths.py) is a step of its own,
    counted in lookups run (16: two batch sizes, four key dtypes, two entry points)."""
    said = _Lines()
    lines = LineProgress(said.say, every=0.02)
    try:
        progress = BothProgress(lines, _OneLinePerLookup(said))
        with HierarchicalParameterServer(_config(tmp_path), progress=progress,
                                         chunk_bytes=CHUNK_BYTES):
            pass
    finally:
        lines.close()
    warm = [line for line in said.lines if line.startswith("warming ")]
    counts = [int(m.group(1) or 0) for m in map(WARMING.fullmatch, warm[:-1]) if m]
    assert len(counts) == len(warm) - 1, warm  # every line but the last says how far
    assert counts == sorted(counts) and set(range(1, 16)) <= set(counts), warm
    assert re.fullmatch(r"warming the lookup paths of model m: done in [\d.]+ s, 16 of 16 "
                        r"lookups run", warm[-1])
    assert not [line for line in said.lines if re.search(r"\b0 of [\d,]+|\(0%\)", line)]


def test_a_step_that_ends_short_says_it_stopped() -> None:
    """A step whose work failed (a warm lookup that raises) ends with its count as it
    was, not "done"."""
    said = _Lines()
    lines = LineProgress(said.say, every=0.02)
    try:
        lines.start_step("warming the lookup paths of model m", 16, "lookups run")
        said.wait_after(0)
        assert said.lines[0].startswith("warming the lookup paths of model m: none of 16 "
                                        "lookups run yet, ")
        lines.step(3)
        said.wait_after(len(said.lines))
        lines.finish_step(1.0)
    finally:
        lines.close()
    assert re.fullmatch(r"warming the lookup paths of model m: 3 of 16 lookups run \(19%\), "
                        r"\d+ s so far", said.lines[-2])
    assert said.lines[-1] == "warming the lookup paths of model m: stopped in 1.0 s, 3 of 16 " \
        "lookups run"
