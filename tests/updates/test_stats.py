"""UpdateStats: counters, lag and the rate window (the consumer's bookkeeping)."""

from __future__ import annotations

import logging

import pytest

from hps.updates import stats as stats_module
from hps.updates.stats import UpdateStats


def test_applied_rows_rejections_and_lag_by_table() -> None:
    stats = UpdateStats("redis_stream")
    stats.applied("hps_et.m.t", 100, 2, "5-0", None, 1000.0)
    stats.applied("hps_et.m.t", 50, 1, "6-0", None, 1001.0)
    stats.rejected("hps_et.m.t", "magic", "bad")
    stats.rejected("hps_et.m.t", "magic", "bad")
    stats.lag({"hps_et.m.t": 0, "hps_et.m.u": 3})
    out = stats.as_dict()
    t = out["tables"]["hps_et.m.t"]
    assert (t["rows"], t["messages"], t["rejected"]) == (150, 3, {"magic": 2})
    assert (t["last_position"], t["last_published"], t["lag_seconds"]) == ("6-0", 1001.0, 0.0)
    u = out["tables"]["hps_et.m.u"]
    assert u["lag_messages"] == 3 and u["lag_seconds"] is None  # nothing applied yet
    assert out["rows_per_second"] == pytest.approx(150 / stats_module.RATE_WINDOW)


def test_the_rate_window_stays_short_when_nobody_reads_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(stats_module.time, "monotonic", lambda: clock[0])
    stats = UpdateStats("kafka")
    for second in range(1000):
        clock[0] = float(second)
        stats.applied("hps_et.m.t", 10, 1, f"0:{second}", second, 0.0)
    assert len(stats._applied) <= stats_module.RATE_WINDOW + 1
    assert stats.rows_per_second() == pytest.approx(10 * 6 / stats_module.RATE_WINDOW)


def test_a_rejection_is_logged_once_then_held_back(caplog: pytest.LogCaptureFixture) -> None:
    stats = UpdateStats("kafka")
    with caplog.at_level(logging.WARNING, logger="hps.updates"):
        for _ in range(5):
            stats.rejected("hps_et.m.t", "truncated", "short")
        stats.rejected("hps_et.m.t", "magic", "wrong")
    lines = [r.getMessage() for r in caplog.records]
    assert sum("(truncated)" in line for line in lines) == 1
    assert sum("(magic)" in line for line in lines) == 1
    assert stats.as_dict()["tables"]["hps_et.m.t"]["rejected"] == {"truncated": 5, "magic": 1}


def test_state_changes_are_recorded_with_the_error() -> None:
    stats = UpdateStats("redis_stream")
    stats.set_state("down", ConnectionError("refused"))
    stats.set_state("down", ConnectionError("refused again"))
    stats.set_state("running")
    out = stats.as_dict()
    assert out["state"] == "running" and out["retries"] == 2
    assert out["last_error"] == "ConnectionError: refused again"
