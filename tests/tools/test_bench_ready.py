"""`hps bench ready` at a tiny size: real `hps serve` processes started cold, warm and
with a worker killed; the table's columns are checked, never its timings."""

from __future__ import annotations

import math
from pathlib import Path

from hps.tools.bench.ready import COLUMNS, _said, bench_ready, default_checkout, format_ready
from tests.tools.test_cli import ROOT, hps


def test_the_command_prints_every_column_for_both_models_under_two_workers() -> None:
    result = hps("bench", "ready", "--demo-scale", "0.005", "--keys", "2k", "--dim", "8",
                 "--workers", "2", "--folder", "other", "--first", "5", "--later", "10",
                 "--timeout", "240", columns=400)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if "ready cold s" in line)
    assert [h for _, h in COLUMNS if h not in header] == []
    rows = [line.split() for line in lines if line.lstrip().startswith(str(ROOT))]
    assert [(r[1], r[2], r[3]) for r in rows] == [("demo", "2", "other"), ("big", "2", "other")]
    for row in rows:
        assert len(row) == len(COLUMNS)
        assert row[-1] != "-"  # a worker was killed and came back
    assert "load average before:" in result.stdout and "load average after:" in result.stdout
    assert "first: lookups 1-5 after ready; later: lookups 11-15" in result.stdout


def test_one_process_from_the_checkout_folder() -> None:
    result = bench_ready([default_checkout()], demo_scale=0, keys=500, dim=8, workers=(1,),
                         folders=("checkout",), first=5, later=10, timeout=240)
    [row] = result["rows"]
    assert set(row) == {key for key, _ in COLUMNS} | {"non_200_said"}
    # what each answer other than 200 was, by start: the cold start's count every
    # lookup, the two windows' among them
    said = row["non_200_said"]
    assert set(said) == {"cold", "warm"}
    assert sum(said["cold"].values()) >= row["first_non_200"] + row["later_non_200"]
    assert sum(said["warm"].values()) == row["warm_first_non_200"]
    assert (Path(row["checkout"]), row["model"], row["workers"], row["folder"]) == (
        ROOT, "big", 1, "checkout")
    assert row["worker_back_s"] is None  # one process: no worker to kill
    assert row["ready_cold_s"] > 0 and row["ready_warm_s"] > 0
    assert not any(math.isnan(row[k]) for k in ("first_p50_ms", "first_p99_ms",
                                                 "later_p50_ms", "later_p99_ms",
                                                 "warm_first_p99_ms"))
    assert all(isinstance(row[k], int) for k in ("first_non_200", "later_non_200",
                                                 "warm_first_non_200"))


def test_answers_other_than_200_are_said_by_status_and_kind() -> None:
    assert _said(503, b'{"kind": "model_loading", "message": "m is loading"}') == \
        "503 model_loading"
    assert _said(502, b"<html>bad gateway</html>") == "502"
    row = {k: 0 for k, _ in COLUMNS} | {"checkout": "/c", "model": "big", "workers": 2,
                                        "folder": "other", "worker_back_s": None,
                                        "non_200_said": {"cold": {}, "warm": {
                                            "503 model_loading": 70,
                                            "connection failed (RemoteDisconnected)": 3}}}
    text = format_ready({"rows": [row], "first": 5, "later": 10, "batch": 16, "gpu": False,
                         "load_before": (0.1, 0.2, 0.3), "load_after": (0.1, 0.2, 0.3)})
    assert "/c big 2 worker(s) other, warm start: answers other than 200: 70 × 503 " \
        "model_loading, 3 × connection failed (RemoteDisconnected)" in text
    assert "cold start" not in text  # a start whose answers were all 200 says nothing
