"""Request counters and latency histograms updated on the event loop without locks.

prometheus_client's `Counter` and `Histogram` take a lock on every update, a histogram
observation several (its sum and its bucket): together about 7 µs of the three updates
a lookup request made (requests, request latency, lookup latency), measured on the
2-core machine, where the whole request costs the server a few hundred. The HTTP layer
updates its request metrics from the event loop thread only, so they need no lock:
`LoopCounter` and `LoopHistogram` keep plain Python numbers per label set and turn them
into Prometheus samples when `/metrics` is scraped (each is a collector of the app's
registry). Updated from another thread at the same time, an increment could be lost;
nothing else can go wrong.

    latency = LoopHistogram("hps_x_seconds", "...", ["route"], BUCKETS, registry)
    cells = latency.cells("/v1/...")     # once per label set (cache it)
    latency.observe(cells, 0.0003)       # per request
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class LoopCounter(Collector):
    """A counter family (`<name>_total`), one count per label set."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._cells: dict[tuple[str, ...], list[int]] = {}
        registry.register(self)

    def cells(self, *labels: str) -> list[int]:
        """The count of one label set, as a one-element list to add to in place."""
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labels}")
        return self._cells.setdefault(labels, [0])

    def value(self, *labels: str) -> int:
        """The count of one label set (0 when never counted)."""
        return self._cells.get(labels, [0])[0]

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, cells in list(self._cells.items()):
            family.add_metric(list(labels), cells[0])
        yield family


class LoopHistogram(Collector):
    """A histogram family: per label set, a count per bucket and the sum of the values.

    A label set's cells are `len(buckets) + 2` numbers: the observations in each bucket
    (not cumulative; the one after the last bound holds those beyond every bound), then
    the sum of all observed values."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Sequence[float], registry: CollectorRegistry) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError("buckets must be distinct bounds in increasing order")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = bounds[:-1] if bounds[-1] == float("inf") else bounds
        # "le" labels written as prometheus_client writes them (dashboards match on them)
        self._le = tuple(floatToGoString(b) for b in self.bounds)  # type: ignore[no-untyped-call]
        self._cells: dict[tuple[str, ...], list[float]] = {}
        registry.register(self)

    def cells(self, *labels: str) -> list[float]:
        """The cells of one label set (made on first use)."""
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labels}")
        cells = self._cells.get(labels)
        if cells is None:
            cells = self._cells.setdefault(labels, [0] * (len(self.bounds) + 1) + [0.0])
        return cells

    def forget(self, label: str, value: str) -> None:
        """Drop the label sets whose `label` is `value` (a removed model's, say)."""
        at = self.labelnames.index(label)
        # popped in place: a label set the event loop adds meanwhile is kept, not lost
        # with a replaced dict (this runs on a thread of the admin route)
        for labels in [k for k in list(self._cells) if k[at] == value]:
            self._cells.pop(labels, None)

    def observe(self, cells: list[float], value: float) -> None:
        """Count `value` in `cells` (a label set's, from `cells`)."""
        # Prometheus buckets are "le": a value equal to a bound belongs to that bucket
        cells[bisect_left(self.bounds, value)] += 1
        cells[-1] += value

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, cells in list(self._cells.items()):
            counts = list(cells)  # one copy: the buckets and the sum of the same moment
            total = 0
            buckets: list[tuple[str, float]] = []
            for le, count in zip(self._le, counts, strict=False):
                total += int(count)
                buckets.append((le, total))
            total += int(counts[len(self.bounds)])
            buckets.append(("+Inf", total))
            family.add_metric(list(labels), buckets, counts[-1])
        yield family
