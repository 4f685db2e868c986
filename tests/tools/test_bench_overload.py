"""`hps bench http --overload`: client processes against `hps serve` at each level, every
answer 200, 503 or 504 (no other), the last level compared with the peak below it."""

from __future__ import annotations

from hps.tools.bench.overload import bench_overload


def test_levels_and_summary() -> None:
    """The last level runs once per client behaviour: honouring Retry-After, then 20 ms;
    every level once per round, and the summary is the round of the median ratio."""
    result = bench_overload(num_keys=2000, dim=8, batch=16, levels=(1, 3), seconds=0.5,
                            warmup=0.2, backoffs=(None, 0.02), rounds=3)
    assert [r["clients"] for r in result["rows"]] == [1, 3, 3] * 3
    assert [r["round"] for r in result["rows"]] == [0] * 3 + [1] * 3 + [2] * 3
    assert [r["backoff"] for r in result["rows"]] == (["Retry-After"] * 2 + ["20 ms"]) * 3
    for row in result["rows"]:
        assert row["served_per_s"] > 0 and row["other"] == 0
        assert row["p99_ms"] >= row["p50_ms"] > 0
    assert result["summary"] == result["summaries"][0]
    for summary in result["summaries"]:
        assert summary["clients"] == 3 and summary["peak_clients"] == 1
        assert summary["vs_peak"] == summary["served_per_s"] / summary["peak_per_s"]
        assert len(summary["rounds_vs_peak"]) == len(summary["rounds_p99_ms"]) == 3
        assert summary["vs_peak"] == sorted(summary["rounds_vs_peak"])[1]
        assert summary["p99_ms"] in summary["rounds_p99_ms"]
