"""The load gate as the service shows it: a refused version's answer, and its metrics.

A load or reload the gate refuses (hps/gate/) is answered 422 with the usual error body,
its `error` naming the model, table, check, figure and limit beside kind and message:

    {"error": {"kind": "load_gate", "message": "...", "model": "m", "table": "users",
               "check": "norm_ratio", "figure": 10.0, "limit": 2.0}}

`LoadGateCollector` reads the registry's `GateLedger` at scrape time:
`hps_load_gate_refusals_total{model,table,check}`,
`hps_load_gate_warnings_total{model,table,check}`, `hps_load_gate_passed{model,table}`
(1 when the table's last verdict passed) and `hps_load_gate_drift{model,table,figure}`
(the last measured norm_ratio, keys_added, keys_removed, key_churn, and the norms'
mean / p50 / p99 of both versions).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hps.gate.verdict import LoadGateError
from hps.http.errors import ErrorBody, error_body

if TYPE_CHECKING:
    from hps.server import HierarchicalParameterServer

#: the drift figures exported as gauges (the rest of a verdict's drift is in JSON)
_DRIFT = ("norm_ratio", "keys_added", "keys_removed", "key_churn")


def detailed_body(exc: Exception, body: ErrorBody) -> ErrorBody:
    """`body`, with a refused version's check, figure and limit added to /v1's error
    object; any other error or protocol keeps `body` as it is."""
    if not isinstance(exc, LoadGateError) or body is not error_body:
        return body
    details = exc.details()

    def with_details(kind: str, message: str) -> dict[str, Any]:
        return {"error": {**error_body(kind, message)["error"], **details}}

    return with_details


class LoadGateCollector(Collector):
    """The load gate's counts and last figures, read from the registry at scrape time."""

    def __init__(self, server: HierarchicalParameterServer) -> None:
        self.server = server

    def describe(self) -> list[Any]:
        return []  # the tables are not known before the models load

    def collect(self) -> Iterator[Any]:
        ledger = self.server.registry.gate_ledger
        labels = ["model", "table", "check"]
        refusals = CounterMetricFamily(
            "hps_load_gate_refusals", "Versions the load gate refused, by the check that "
            "refused them.", labels=labels)
        warnings = CounterMetricFamily(
            "hps_load_gate_warnings", "Drifts past a limit the load gate let serve "
            "(validation.drift: warn).", labels=labels)
        for (model, table, check), count in sorted(ledger.refusals().items()):
            refusals.add_metric([model, table, check], count)
        for (model, table, check), count in sorted(ledger.warnings().items()):
            warnings.add_metric([model, table, check], count)
        passed = GaugeMetricFamily(
            "hps_load_gate_passed", "1 when the table's last load passed the gate, 0 when "
            "it was refused.", labels=["model", "table"])
        drift = GaugeMetricFamily(
            "hps_load_gate_drift", "The last measured drift of a reload against the served "
            "version: norm_ratio, keys_added, keys_removed, key_churn, norm_{new,old}_"
            "{mean,p50,p99}.", labels=["model", "table", "figure"])
        for (model, table), verdict in sorted(ledger.last().items()):
            passed.add_metric([model, table], 1.0 if verdict.passed else 0.0)
        for (model, table), figures in sorted(ledger.last_drift().items()):
            for figure, value in _drift_figures(figures):
                drift.add_metric([model, table, figure], value)
        yield from (refusals, warnings, passed, drift)


def _drift_figures(drift: dict[str, Any] | None) -> Iterator[tuple[str, float]]:
    if not drift:
        return
    for name in _DRIFT:
        if drift.get(name) is not None:
            yield name, float(drift[name])
    for side in ("new", "old"):
        for stat, value in (drift.get(f"norm_{side}") or {}).items():
            yield f"norm_{side}_{stat}", float(value)
