"""`python -m hps.tools.bench.refusals`: every lookup of its client is refused (a 503,
or its client fails), each answered by the connection itself, and both sides' costs are
reported."""

from __future__ import annotations

from hps.tools.bench.refusals import bench_refusals


def test_every_lookup_is_refused_by_the_connection() -> None:
    result = bench_refusals(count=300, dim=8)
    assert result["count"] == 300
    assert result["refused_directly"] == 300 + 500  # the counted ones and the warm-up
    assert result["server_cpu_us_per_refusal"] > 0
    assert result["client_wall_us_per_refusal"] > 0
