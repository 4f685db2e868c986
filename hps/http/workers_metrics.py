"""`/metrics` of `hps serve --workers N`: the sum of the workers, whichever one answers.

Each worker writes its own exposition (its app's registry, hps/http/metrics.py) to the run
folder every DUMP_INTERVAL seconds (`MetricsDump`); the worker that answers `/metrics`
renders `MergedRegistry`: its own families, with the counters and histograms of every
other live worker added sample by sample (same name and labels). Gauges are its own:
they describe the server's state (models ready, tier sizes, the shared table's bytes),
which every worker sees alike, so a sum would count them N times; a gauge only another
worker has (the update source's, which only the leader runs) is that worker's. Peers' figures are at
most DUMP_INTERVAL seconds old; a worker that died takes its counts with it (Prometheus
reads the drop as a counter reset). prometheus_client's multiprocess mode was not used:
it gives up custom collectors, which the server's tier and table figures are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("hps.http.workers")

#: seconds between two writes of a worker's own metrics
DUMP_INTERVAL = 1.0
_SUMMED = ("counter", "histogram", "summary")


class MetricsDump:
    """Writes `registry`'s exposition to `folder/<index>.prom` every DUMP_INTERVAL
    seconds, on a daemon thread, until `close` (which writes a last one)."""

    def __init__(self, registry: CollectorRegistry, folder: Path, index: int) -> None:
        self.registry = registry
        self.path = folder / f"{index}.prom"
        folder.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hps-metrics-dump",
                                        daemon=True)
        self._thread.start()

    def write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(generate_latest(self.registry))
        os.replace(tmp, self.path)

    def _run(self) -> None:
        while not self._stop.wait(DUMP_INTERVAL):
            try:
                self.write()
            except Exception as exc:  # a full tmpfs must not stop the worker
                log.warning("could not write this worker's metrics: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self.write()


class MergedRegistry:
    """What `/metrics` renders in a worker: `own` plus the other live workers' counters
    and histograms (`peers()` gives the paths of their expositions)."""

    def __init__(self, own: CollectorRegistry, peers: Callable[[], list[Path]]) -> None:
        self.own = own
        self.peers = peers

    def collect(self) -> Iterator[Metric]:
        families = {family.name: family for family in self.own.collect()}
        sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        extra: dict[str, Metric] = {}
        for path in self.peers():  # a loop over workers
            try:
                text = path.read_text()
            except OSError:
                continue
            for family in text_string_to_metric_families(text):
                if family.type not in _SUMMED:  # a gauge only a peer has (the leader's
                    if family.name not in families:  # update source): the first peer's
                        extra.setdefault(family.name, family)
                    continue
                target = sums.setdefault(family.name, {})
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    target[key] = target.get(key, 0.0) + sample.value
                if family.name not in families:
                    extra.setdefault(family.name, family)
        for name, family in families.items():
            added = sums.get(name)
            yield _summed(family, added) if added else family
        for name, family in extra.items():
            yield _summed(_empty_like(family), sums[name]) if name in sums else family


def _empty_like(family: Any) -> Metric:
    return Metric(family.name, family.documentation, family.type, family.unit)


def _summed(family: Any, added: dict[tuple[str, tuple[tuple[str, str], ...]], float]
            ) -> Metric:
    """A copy of `family` with `added` summed into its samples (new series appended)."""
    out = _empty_like(family)
    left = dict(added)
    for sample in family.samples:
        key = (sample.name, tuple(sorted(sample.labels.items())))
        value = sample.value + left.pop(key, 0.0)
        out.add_sample(sample.name, sample.labels, value, sample.timestamp, sample.exemplar)
    for (name, labels), value in left.items():
        out.add_sample(name, dict(labels), value)
    return out
