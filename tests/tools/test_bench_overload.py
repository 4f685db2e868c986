"""`hps bench http --overload`: client processes against `hps serve` at each level, every
answer 200, 503 or 504 (no other), the last level compared with the peak below it."""

from __future__ import annotations

import pytest

from hps.tools.bench.overload import bench_overload
from tests.tools.test_cli import hps


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
        # both sides' CPU per answer, read from the processes themselves
        assert row["client_cpu_us"] > 0 and row["server_cpu_us"] > 0
    assert result["client"].startswith("one process per client, raw keep-alive")
    assert result["summary"] == result["summaries"][0]
    for summary in result["summaries"]:
        assert summary["clients"] == 3 and summary["peak_clients"] == 1
        assert summary["vs_peak"] == summary["served_per_s"] / summary["peak_per_s"]
        assert len(summary["rounds_vs_peak"]) == len(summary["rounds_p99_ms"]) == 3
        assert summary["vs_peak"] == sorted(summary["rounds_vs_peak"])[1]
        assert summary["p99_ms"] in summary["rounds_p99_ms"]


def test_the_standard_library_client_gets_the_same_answers() -> None:
    """`client="http.client"`: the same levels and answers as the default raw client."""
    result = bench_overload(num_keys=2000, dim=8, batch=16, levels=(1, 2), seconds=0.5,
                            warmup=0.2, backoffs=(None,), client="http.client")
    assert [r["clients"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["served_per_s"] > 0 and row["other"] == 0
    assert "http.client" in result["client"]


def test_an_unknown_client_is_refused_before_a_server_starts() -> None:
    with pytest.raises(ValueError, match="client: one of raw, http.client"):
        bench_overload(levels=(1, 2), client="httpx")


def test_the_command_refuses_an_unknown_client_before_it_runs() -> None:
    result = hps("bench", "http", "--overload", "--load-client", "httpx")
    assert result.returncode == 2
    assert ("Invalid value for '--load-client': 'httpx' is not one of raw, http.client"
            in " ".join(result.stderr.split()))
    assert "Traceback" not in result.stderr


def test_the_table_served_from_rocksdb_alone() -> None:
    """`tier="rocksdb"`: the same levels and answers, every key read from the model's
    RocksDB database (the server's own counters say so), none from a volatile tier."""
    result = bench_overload(num_keys=2000, dim=8, batch=16, levels=(1, 2), seconds=0.5,
                            warmup=0.2, backoffs=(None,), tier="rocksdb")
    assert result["tier"] == "rocksdb"
    assert [r["clients"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["served_per_s"] > 0 and row["other"] == 0
    assert result["keys_by_tier"]["persistent"] >= 16 * sum(
        r["served_per_s"] * 0.5 for r in result["rows"])
    assert result["keys_by_tier"].get("volatile", 0) == 0


def test_the_hash_map_is_the_default_tier() -> None:
    result = bench_overload(num_keys=2000, dim=8, batch=16, levels=(1, 2), seconds=0.3,
                            warmup=0.1, backoffs=(None,))
    assert result["tier"] == "hash_map"
    assert result["keys_by_tier"]["volatile"] > 0
    assert result["keys_by_tier"].get("persistent", 0) == 0


def test_an_unknown_tier_is_refused_before_a_server_starts() -> None:
    with pytest.raises(ValueError, match="tier: one of hash_map, rocksdb"):
        bench_overload(levels=(1, 2), tier="redis")


def test_the_command_refuses_an_unknown_tier_before_it_runs() -> None:
    result = hps("bench", "http", "--overload", "--tier", "redis")
    assert result.returncode == 2
    assert ("Invalid value for '--tier': 'redis' is not one of hash_map, rocksdb"
            in " ".join(result.stderr.split()))
    assert "Traceback" not in result.stderr
