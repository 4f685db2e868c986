"""`python -m hps.tools.bench.refusals`: every lookup of its client is refused (a 503,
or its client fails), each answered by the connection itself, and both sides' costs are
reported."""

from __future__ import annotations

from hps.tools.bench.refusals import bench_refusals
from tests.tools.test_cli import hps


def test_every_lookup_is_refused_by_the_connection() -> None:
    result = bench_refusals(count=300, dim=8)
    assert result["count"] == 300
    assert result["refused_directly"] == 300 + 500  # the counted ones and the warm-up
    assert result["server_cpu_us_per_refusal"] > 0
    assert result["client_wall_us_per_refusal"] > 0


def test_the_command_prints_the_cost_of_a_refusal() -> None:
    result = hps("bench", "http", "--refusals")
    assert result.returncode == 0, result.stderr
    assert "20,000 refusals: server CPU" in result.stdout
    assert "answered by the connection: 20,500 of 20,500" in result.stdout
