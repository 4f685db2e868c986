"""Prometheus metrics of one HTTP app, in a registry of its own.

Three sources feed `GET /metrics`:
- request metrics, observed per request by `MetricsMiddleware` (a plain ASGI
  middleware) and, for the hot routes, by `hot_routes.HotRoutes`: requests and latency
  per route template, method and status code, and each lookup's latency per table (kept
  lock-free on the event loop: `loop_metrics.py`);
- errors by kind, counted where an error becomes a JSON answer;
- the server's own counters, read at scrape time by `ServerCollector` from each table's
  `TableStats` (lookups, keys, hits per tier, defaults, tier failures) and from each
  tier's `Tier.stats()` (available, failures and dropped writes by kind, figures such as
  keys held), so the lookup path itself never touches a metric object;
- load progress, written by `MetricsProgress` (a `LoadProgress`) while models load.

Labels are route templates (`/v1/models/{model}/tables/{table}/lookup`), never raw paths,
so a client cannot grow the registry by sending many distinct URLs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hps.http.kserve.stats import InferStats
from hps.http.load_gate import LoadGateCollector
from hps.http.loop_metrics import LoopCounter, LoopHistogram
from hps.server import STAGING_SUFFIX
from hps.server.loader import LoadProgress

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from hps.server import HierarchicalParameterServer

#: latency buckets (seconds): lookups take from tens of microseconds to seconds
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: TableStats counter → (metric name, help)
_TABLE_COUNTERS = {
    "lookups": ("hps_lookups", "Lookups served, per table."),
    "keys": ("hps_lookup_keys", "Keys looked up, per table."),
    "defaults": ("hps_default_keys", "Keys found in no tier (answered with the default)."),
}
#: one family, two label sets: {model,table} counts the lookups of a table that fell
#: through a failing volatile tier (TableStats); {tier,kind} counts the tier's own failed
#: calls by kind (Tier.stats()["failures"]: connection, timeout, rejected, ...)
_TIER_FAILURES = ("hps_tier_failures",
                  "Tier failures: per model and table, lookups that fell through a failing "
                  "volatile tier (Redis down, timeouts); per tier and kind, the tier's "
                  "failed calls.")
_TIER_HITS = {"volatile": "volatile_hits", "persistent": "persistent_hits"}
#: the hot keys whose share of the counted keys `hps_hot_keys_share` reports
_HOT_TOP = 100
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
#: the code a request is counted under when no answer went out because its client left
#: before its body was whole (or its connection was closed for a body too slow to come):
#: nginx's "client closed request". Nothing failed on the server's side, so never 500.
CLIENT_CLOSED = 499
#: the phases of `hps_compiles_total`
COMPILE_PHASES = ("load", "before_ready", "after_ready")
#: set in a request's ASGI scope when its connection answered it (a body that is not
#: HTTP: hps/http/framing.py) and counted it: its handler, which then sees a disconnect,
#: does not count it again
ANSWERED_BY_CONNECTION = "hps.answered_by_connection"


class Metrics:
    """The metric objects of one app; `registry` is what `GET /metrics` renders."""

    def __init__(self, server: HierarchicalParameterServer) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # updated per request on the event loop: lock-free (loop_metrics.py says why)
        # `protocol` "http" or "grpc" (route: the gRPC method's path, method POST, code:
        # the HTTP status its answer maps from, 200 when OK); a label added at the end,
        # so queries that sum or match on the others read both protocols as before
        self.requests = LoopCounter(
            "hps_http_requests", "Requests answered (HTTP, and gRPC by protocol label).",
            ["route", "method", "code", "protocol"], r)
        self.latency = LoopHistogram(
            "hps_http_request_duration_seconds", "Time from request to last byte of answer.",
            ["route", "method", "protocol"], LATENCY_BUCKETS, r)
        self._grpc_lock = threading.Lock()  # gRPC counts from its worker threads
        #: the KServe v2 statistics extension's counters (both protocols)
        self.infer_stats = InferStats()
        self.errors = Counter(
            "hps_http_errors", "Error answers, by kind (as in the JSON error body).",
            ["kind", "code"], registry=r)
        self.shed = Counter(
            "hps_http_shed", "Lookups refused (503) because the admission queue was full.",
            registry=r)
        self.expired = Counter(
            "hps_http_deadline_expired", "Lookups answered 504 because their deadline "
            "(X-HPS-Deadline-Ms) passed before the answer was ready.", registry=r)
        self.load_keys = Counter(
            "hps_load_keys", "Keys written to the tiers by model loads.", ["model"], registry=r)
        self.load_bytes = Counter(
            "hps_load_bytes", "Bytes of model files loaded.", ["model"], registry=r)
        self.load_total_bytes = Gauge(
            "hps_load_table_bytes", "Size of the files of the table being or last loaded.",
            ["model", "table"], registry=r)
        self.load_seconds = Gauge(
            "hps_load_table_seconds", "Time the last load of a table took.",
            ["model", "table"], registry=r)
        self.load_failures = Counter(
            "hps_load_failures", "Model loads and reloads that failed.", ["model", "kind"],
            registry=r)
        self.model_ready = Gauge(
            "hps_model_ready", "1 when the model is loaded and served, else 0.", ["model"],
            registry=r)
        self.model_loads = Counter(
            "hps_model_loads", "Model loads and reloads that completed (a new version "
            "served).", ["model"], registry=r)
        #: compiled functions compiled or read from numba's cache, by phase (counted by
        #: ServiceState.heard_compile): "after_ready" is a lookup path that compiled
        #: after the server said ready, which the load's warm-up is there to prevent
        self.compiles = Counter(
            "hps_compiles", "Compiled functions compiled or read from numba's cache, by "
            "phase: load (while a model loads; its warm-up runs each lookup path), "
            "before_ready, after_ready (outside loads once ready: 0 when ready means "
            "fast).", ["phase"], registry=r)
        for phase in COMPILE_PHASES:
            self.compiles.labels(phase)
        self.lookup_latency = LoopHistogram(
            "hps_lookup_duration_seconds", "Time of a lookup route's lookup, from reading "
            "its body to its vectors (queueing for a lookup thread included), per table.",
            ["model", "table"], LATENCY_BUCKETS, r)
        # the cells of each label set, found once
        self._request_cells: dict[tuple[str, str, int], tuple[list[int], list[float]]] = {}
        self._lookup_cells: dict[tuple[str, str], list[float]] = {}
        r.register(ServerCollector(server))
        r.register(LoadGateCollector(server))

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one HTTP request answered with `status` after `seconds`, by route template
        (`route`) and method (one of the HTTP methods, else "other"). Event loop only."""
        key = (route, method, status)
        cells = self._request_cells.get(key)
        if cells is None:
            cells = self._request_cells[key] = (
                self.requests.cells(route, method, str(status), "http"),
                self.latency.cells(route, method, "http"))
        cells[0][0] += 1
        self.latency.observe(cells[1], seconds)

    def count_request(self, route: str, method: str, status: int) -> None:
        """Count one HTTP request answered with `status` whose time is not known (the
        connection refused it while reading it: no latency sample). Event loop only."""
        self.requests.cells(route, method, str(status), "http")[0] += 1

    def observe_grpc(self, method: str, status: int, seconds: float) -> None:
        """Count one gRPC call of `method` (its path, /inference.GRPCInferenceService/…)
        answered with what maps from HTTP `status` after `seconds`. Any thread."""
        with self._grpc_lock:
            self.requests.cells(method, "POST", str(status), "grpc")[0] += 1
            self.latency.observe(self.latency.cells(method, "POST", "grpc"), seconds)

    def observe_lookup(self, model: str, table: str, seconds: float) -> None:
        """Count one lookup of `model`/`table` that took `seconds` in the latency histogram.
        Event loop only."""
        cells = self._lookup_cells.get((model, table))
        if cells is None:
            cells = self._lookup_cells[(model, table)] = self.lookup_latency.cells(model, table)
        self.lookup_latency.observe(cells, seconds)

    def forget_model(self, model: str) -> None:
        """Drop every series labelled with `model` (removed from the server: a dashboard
        must not keep a gone model's last figures, nor /metrics grow with each model
        added and removed). The figures read at scrape time (`ServerCollector`) go with
        the model by themselves."""
        for metric in (self.load_keys, self.load_bytes, self.load_total_bytes,
                       self.load_seconds, self.load_failures, self.model_ready,
                       self.model_loads):
            _drop_series(metric, model)
        self.lookup_latency.forget("model", model)
        for key in [k for k in list(self._lookup_cells) if k[0] == model]:
            self._lookup_cells.pop(key, None)  # in place, as LoopHistogram.forget says

    def progress(self, model: str) -> MetricsProgress:
        """A LoadProgress that counts the load of `model` in these metrics."""
        return MetricsProgress(self, model)


class MetricsProgress(LoadProgress):
    """Load progress of one model, as metrics."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.metrics = metrics
        self.model = model
        self._keys = metrics.load_keys.labels(model)
        self._bytes = metrics.load_bytes.labels(model)

    def start_table(self, table: str, num_keys: int, num_bytes: int) -> None:
        self.metrics.load_total_bytes.labels(self.model, _table_label(table)).set(num_bytes)

    def advance(self, keys: int, num_bytes: int) -> None:
        self._keys.inc(keys)
        self._bytes.inc(num_bytes)

    def finish_table(self, table: str, seconds: float) -> None:
        self.metrics.load_seconds.labels(self.model, _table_label(table)).set(seconds)


def _drop_series(metric: Any, model: str) -> None:
    """Remove the label sets of `metric` (a labelled prometheus_client metric) whose
    `model` label is `model`, found through its samples (`remove` takes whole label
    sets; `remove_by_labels` is newer than the prometheus-client versions we take)."""
    found = {tuple(sample.labels.values()) for family in metric.collect()
             for sample in family.samples if sample.labels.get("model") == model}
    for labels in found:
        metric.remove(*labels)


def _table_label(storage_name: str) -> str:
    """The table's storage name without the server's staging suffix of a reload."""
    return storage_name.split(STAGING_SUFFIX, 1)[0]


class ServerCollector(Collector):
    """Reads every table's `TableStats` when Prometheus scrapes (no work per lookup)."""

    def __init__(self, server: HierarchicalParameterServer) -> None:
        self.server = server

    def describe(self) -> list[Any]:
        return []  # the tables are not known before the models load

    def collect(self) -> Iterator[Any]:
        labels = ["model", "table"]
        counters = {key: CounterMetricFamily(name, doc, labels=labels)
                    for key, (name, doc) in _TABLE_COUNTERS.items()}
        hits = CounterMetricFamily(
            "hps_tier_hits", "Keys served by each database tier, per table.",
            labels=[*labels, "tier"])
        failures = CounterMetricFamily(*_TIER_FAILURES)
        gpu = GaugeMetricFamily(
            "hps_gpu_cache", "GPU embedding cache figures, per table and device.",
            labels=[*labels, "device", "stat"])
        missing_rate = GaugeMetricFamily(
            "hps_missing_rate", "Share of looked-up keys found in no tier, since the "
            "version loaded (recent: rate of hps_default_keys_total over "
            "hps_lookup_keys_total).", labels=labels)
        hot_share = GaugeMetricFamily(
            "hps_hot_keys_share", f"Share of the keys counted by the hot-key sketch that "
            f"are its top {_HOT_TOP} (docs/operating.md#hot-and-missing-keys).",
            labels=labels)
        paths = CounterMetricFamily(
            "hps_http_lookups", "Lookups with host keys (HTTP, gRPC) per table, by the path "
            "that answered them: gpu (its GPU cache) or host (its host tiers; "
            "docs/workers.md#http-lookups-of-a-gpu-model).", labels=[*labels, "path"])
        for name, loaded in sorted(self.server.models.items()):
            for table in loaded.tables:
                stats = table.stats.as_dict()
                looked = stats.get("keys", 0)
                missing_rate.add_metric([name, table.name],
                                        stats.get("defaults", 0) / looked if looked else 0.0)
                hot = table.keys_seen.hot.top(_HOT_TOP)
                hot_share.add_metric([name, table.name], min(
                    1.0, int(hot["counts"].sum()) / hot["total"]) if hot["total"] else 0.0)
                for key, family in counters.items():
                    family.add_metric([name, table.name], stats.get(key, 0))
                failures.add_sample(failures.name + "_total",
                                    {"model": name, "table": table.name},
                                    stats.get("tier_failures", 0))
                for tier, key in _TIER_HITS.items():
                    hits.add_metric([name, table.name, tier], stats.get(key, 0))
                for device, cache in table.gpu.items():
                    for stat, value in _numbers(cache.stats()):
                        gpu.add_metric([name, table.name, str(device), stat], value)
                if table.http_path is not None:
                    for path, count in table.http_path.answered().items():
                        paths.add_metric([name, table.name, path], count)
        yield from counters.values()
        yield paths
        yield hits
        yield gpu
        yield missing_rate
        yield hot_share
        yield from _tier_metrics(self.server.tiers.stats(), failures)
        status = self.server.update_status()
        if status is not None:
            yield from _update_metrics(status)
        pending = GaugeMetricFamily(
            "hps_tier_tables_pending", "Tables a load could not write to the tier (down, "
            "full or read-only then), filled in the background.", labels=["tier"])
        degraded = self.server.degraded()
        for each in self.server.tiers:
            pending.add_metric([each.name], len(
                degraded.get(each.name, {}).get("tables_pending", [])))
        yield pending


def _tier_metrics(tiers: dict[str, dict[str, Any]], failures: CounterMetricFamily
                  ) -> Iterator[Any]:
    """Each tier's `Tier.stats()` as metrics: the failures by kind join `failures`."""
    available = GaugeMetricFamily(
        "hps_tier_available", "1 while the tier answers calls, 0 while it is down.",
        labels=["tier"])
    dropped = CounterMetricFamily(
        "hps_tier_dropped", "Keys of background writes a tier dropped (queue full, tier down).",
        labels=["tier", "kind"])
    figures = GaugeMetricFamily(
        "hps_tier_stats", "Figures of each tier (tables, keys, memory bytes, outages, ...).",
        labels=["tier", "stat"])
    for tier, stats in sorted(tiers.items()):
        available.add_metric([tier], 1.0 if stats["available"] else 0.0)
        for kind, count in sorted(stats["failures"].items()):
            failures.add_sample(failures.name + "_total", {"tier": tier, "kind": kind}, count)
        for kind, count in sorted(stats["dropped"].items()):
            dropped.add_metric([tier, kind], count)
        for stat, value in _numbers(stats):
            figures.add_metric([tier, stat], value)
    yield failures
    yield available
    yield dropped
    yield figures


def _update_metrics(status: dict[str, Any]) -> Iterator[Any]:
    """The online updates' counters, lag and state (`UpdateStats.as_dict()`), per table
    (labelled by its topic, hps_et.<model>.<table>)."""
    table = ["table"]
    rows = CounterMetricFamily("hps_update_rows", "Rows applied by online updates.", labels=table)
    messages = CounterMetricFamily("hps_update_messages", "Update messages applied.",
                                   labels=table)
    rejected = CounterMetricFamily(
        "hps_update_rejected", "Update messages skipped, by reason (magic, value_size, "
        "truncated, unknown_table, non_finite, key_range; failed, write_failed: set aside "
        "after an error of their own).", labels=[*table, "reason"])
    failing = GaugeMetricFamily(
        "hps_update_table_failing", "1 while the table's updates cannot be read (its "
        "stream key is of another type, say), else 0.", labels=table)
    lag = GaugeMetricFamily("hps_update_lag_messages",
                            "Messages of the table not applied yet.", labels=table)
    lag_seconds = GaugeMetricFamily(
        "hps_update_lag_seconds", "While messages wait: age of the newest applied one; "
        "0 when none waits.", labels=table)
    offset = GaugeMetricFamily("hps_update_last_applied_offset",
                               "Offset of the last applied message (Kafka).", labels=table)
    stamp = GaugeMetricFamily("hps_update_last_applied_timestamp_seconds",
                              "Publish time of the last applied message.", labels=table)
    left_out = CounterMetricFamily(
        "hps_update_rows_left_out", "Rows of new keys a full shared hash map table left "
        "out, by where they are kept (persistent: lookups read them there; none: dropped).",
        labels=[*table, "kept"])
    for topic, t in status["tables"].items():
        rows.add_metric([topic], t["rows"])
        if t["not_cached"] or t["dropped"]:
            left_out.add_metric([topic, "persistent"], t["not_cached"])
            left_out.add_metric([topic, "none"], t["dropped"])
        failing.add_metric([topic], 1.0 if t.get("failing") else 0.0)
        messages.add_metric([topic], t["messages"])
        for reason, count in sorted(t["rejected"].items()):
            rejected.add_metric([topic, reason], count)
        if t["lag_messages"] is not None:
            lag.add_metric([topic], t["lag_messages"])
        if t["lag_seconds"] is not None:
            lag_seconds.add_metric([topic], t["lag_seconds"])
        if t["last_offset"] is not None:
            offset.add_metric([topic], t["last_offset"])
        if t["last_published"] is not None:
            stamp.add_metric([topic], t["last_published"])
    source = [status["source"]]
    up = GaugeMetricFamily("hps_update_source_up",
                           "1 while the update source answers, else 0.", labels=["source"])
    # "retrying": the source answers, a tier does not take the writes
    up.add_metric(source, 1.0 if status["state"] in ("running", "retrying") else 0.0)
    rate = GaugeMetricFamily("hps_update_rows_per_second",
                             "Rows applied per second over the last 5 s.", labels=["source"])
    rate.add_metric(source, status["rows_per_second"])
    retries = CounterMetricFamily("hps_update_retries",
                                  "Polls, writes and commits retried after a failure.",
                                  labels=["source"])
    retries.add_metric(source, status["retries"])
    yield from (rows, messages, rejected, left_out, failing, lag, lag_seconds, offset, stamp,
                up, rate, retries)


def _numbers(stats: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """The entries of a stats dict that are plain numbers (no flags, lists or dicts)."""
    for key, value in stats.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, value


class MetricsMiddleware:
    """Counts and times every HTTP request by route template, method and status: the code
    it was answered with, 500 when it raised before an answer, CLIENT_CLOSED when it
    returned without one (its client had gone).

    The hot routes do not pass through it: `hot_routes.HotRoutes` answers them before the
    middleware stack and counts them itself (`Metrics.observe_request`)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = CLIENT_CLOSED

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        answered = False
        try:
            await self.app(scope, receive, send_status)
            answered = True
        finally:
            if not answered and status == CLIENT_CLOSED:  # it raised before an answer
                status = 500
            route = scope.get("route")
            if ANSWERED_BY_CONNECTION not in scope:
                self.metrics.observe_request(getattr(route, "path", None) or "unmatched",
                                             method_label(scope["method"]), status,
                                             time.perf_counter() - started)


def method_label(method: str) -> str:
    """The method as a metric label: any token is a valid method, so the labels are
    bounded to the HTTP methods and "other"."""
    return method if method in _METHODS else "other"
