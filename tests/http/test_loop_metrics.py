"""LoopCounter and LoopHistogram expose what prometheus_client's own Counter and Histogram
expose for the same observations."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from hps.http.loop_metrics import LoopCounter, LoopHistogram
from hps.http.metrics import LATENCY_BUCKETS


def _samples(registry: CollectorRegistry) -> list[str]:
    """The exposition's sample lines, without the `_created` ones only the library writes."""
    return sorted(line for line in generate_latest(registry).decode().splitlines()
                  if line and not line.startswith("#") and "_created" not in line)


def test_histogram_and_counter_expose_as_prometheus_client_does() -> None:
    rng = np.random.default_rng(3)
    # every bound itself (a value equal to a bound is in that bucket), values beyond the
    # last bound, and a spread in between
    values = [*LATENCY_BUCKETS, 11.0, 99.0, *rng.exponential(0.002, 500).tolist()]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    histogram = LoopHistogram("t_seconds", "doc", ["route", "method"], LATENCY_BUCKETS, ours)
    counter = LoopCounter("t_requests", "doc", ["code"], ours)
    reference = Histogram("t_seconds", "doc", ["route", "method"], buckets=LATENCY_BUCKETS,
                          registry=theirs)
    reference_counter = Counter("t_requests", "doc", ["code"], registry=theirs)
    for i, value in enumerate(values):
        route = "/a" if i % 3 else "/b"
        histogram.observe(histogram.cells(route, "POST"), value)
        reference.labels(route, "POST").observe(value)
        code = "200" if i % 5 else "404"
        counter.cells(code)[0] += 1
        reference_counter.labels(code).inc()
    assert _samples(ours) == _samples(theirs)
    assert counter.value("404") == sum(1 for i in range(len(values)) if i % 5 == 0)
    assert counter.value("500") == 0


def test_labels_and_buckets_are_checked() -> None:
    registry = CollectorRegistry()
    histogram = LoopHistogram("h_seconds", "doc", ["route"], (0.1, 1.0), registry)
    with pytest.raises(ValueError, match="takes labels"):
        histogram.cells("/a", "POST")
    with pytest.raises(ValueError, match="takes labels"):
        LoopCounter("c", "doc", ["a", "b"], registry).cells("x")
    with pytest.raises(ValueError, match="increasing"):
        LoopHistogram("bad", "doc", [], (1.0, 0.1), registry)
    with pytest.raises(ValueError, match="Duplicated"):
        LoopHistogram("h_seconds", "doc", ["route"], (0.1,), registry)  # name taken
