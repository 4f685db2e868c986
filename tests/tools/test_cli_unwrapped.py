"""Output of `hps` that goes to no terminal keeps its lines whole (hps/tools/cli/root.py):
rich would otherwise wrap it at 80 columns, and nothing re-wraps a pipe or a log."""

from __future__ import annotations

import importlib
import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest

cli_app = importlib.import_module("hps.tools.cli.root")  # the root app, consoles, logging

ROOT = Path(__file__).resolve().parents[2]
#: a label of `hps plan`'s table that is split at 80 columns
LABEL = "host query buffers (pinned) ‡"


def _plan(columns: str | None) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": str(ROOT)}
    if columns is not None:
        env["COLUMNS"] = columns
    done = subprocess.run([sys.executable, "-m", "hps.tools.cli", "plan", "--table",
                           "clicks:10M:64"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_table_into_a_pipe_keeps_its_labels_whole() -> None:
    out = _plan(None)
    assert LABEL in out
    assert all(line == line.rstrip() for line in out.splitlines()), "no padding to a width"


def test_columns_asked_for_are_kept() -> None:
    # a terminal's width (here COLUMNS) still wraps, as rich does on a terminal
    assert LABEL not in _plan("80")


def test_log_records_into_a_pipe_are_one_plain_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    stream = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stderr", stream)
    handler = cli_app._log_handler()
    message = "a record longer than any terminal:" + " word" * 40
    handler.emit(logging.LogRecord("hps", logging.WARNING, __file__, 1, message, None, None))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith(message) and "WARNING" in lines[0]
