"""The panels of the hps dashboard: titles, units and PromQL, in one place.

scripts/grafana_dashboard.py builds the Grafana dashboard from them (with Grafana's own
Python SDK); scripts/plot_metrics.py draws the same panels from Prometheus's query_range
API with matplotlib. Metric names are those of `GET /metrics` (README, "Metrics").
"""

from __future__ import annotations

from dataclasses import dataclass

#: `$__rate_interval` is Grafana's; plot_metrics.py puts a fixed window in its place
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str  # Grafana's legend format: {{label}} is the label's value


@dataclass(frozen=True)
class Panel:
    row: str
    title: str
    description: str
    unit: str  # Grafana's unit id: "short", "s", "percentunit", ...
    queries: tuple[Query, ...]


def _quantile(q: float, metric: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket[{RATE}])))"


PANELS: tuple[Panel, ...] = (
    Panel("Lookups", "Lookup rate per table",
          "Keys looked up per second, per model and table (all replicas).", "short", (
              Query(f"sum by (model, table) (rate(hps_lookup_keys_total[{RATE}]))",
                    "{{model}}/{{table}} keys/s"),
          )),
    Panel("Lookups", "Lookup latency per table",
          "Percentiles of the lookup routes' lookups, per model and table.", "s", (
              Query(_quantile(0.5, "hps_lookup_duration_seconds", "model, table"),
                    "p50 {{model}}/{{table}}"),
              Query(_quantile(0.99, "hps_lookup_duration_seconds", "model, table"),
                    "p99 {{model}}/{{table}}"),
          )),
    Panel("Lookups", "Lookup rate per replica",
          "Keys looked up per second by each hps service.", "short", (
              Query(f"sum by (instance) (rate(hps_lookup_keys_total[{RATE}]))",
                    "{{instance}}"),
          )),
    Panel("Lookups", "Latency p99 per route",
          "99th percentile of every route's answer time, HTTP routes and gRPC methods "
          "(label protocol).", "s", (
              Query(_quantile(0.99, "hps_http_request_duration_seconds", "route, protocol"),
                    "{{protocol}} {{route}}"),
          )),
    Panel("Tiers", "Hit rate per tier",
          "Share of the looked-up keys each database tier served; 'default' is the "
          "share found in no tier.", "percentunit", (
              Query(f"sum by (tier) (rate(hps_tier_hits_total[{RATE}])) / ignoring(tier) "
                    f"group_left sum(rate(hps_lookup_keys_total[{RATE}]))", "{{tier}}"),
              Query(f"sum(rate(hps_default_keys_total[{RATE}])) / "
                    f"sum(rate(hps_lookup_keys_total[{RATE}]))", "default"),
          )),
    Panel("Tiers", "GPU cache hit rate per device",
          "Hits over queries of each GPU embedding cache, per table and device.",
          "percentunit", (
              Query(f'sum by (model, table, device) (rate(hps_gpu_cache{{stat="hits"}}[{RATE}]))'
                    f" / sum by (model, table, device) "
                    f'(rate(hps_gpu_cache{{stat=~"hits|misses"}}[{RATE}]))',
                    "{{model}}/{{table}} GPU {{device}}"),
          )),
    Panel("Tiers", "Tier failures",
          "Failed calls of each tier by kind, and lookups that fell through a failing "
          "volatile tier to the next one.", "short", (
              Query(f'sum by (tier, kind) (rate(hps_tier_failures_total{{tier!=""}}[{RATE}]))',
                    "{{tier}} {{kind}}/s"),
              Query(f'sum(rate(hps_tier_failures_total{{table!=""}}[{RATE}]))',
                    "lookups fallen through/s"),
          )),
    Panel("Tiers", "Keys found in no tier",
          "Share of looked-up keys no tier holds (they get the default value), per table, "
          "since its version loaded; GET /v1/models/{m}/tables/{t}/keys?kind=missing says "
          "which.", "percentunit", (
              Query("max by (model, table) (hps_missing_rate)", "{{model}}/{{table}}"),
          )),
    Panel("Tiers", "Hot keys' share",
          "Share of the sampled lookups that went to each table's 100 hottest keys: how "
          "skewed the traffic is, and how small a cache could serve it.", "percentunit", (
              Query("max by (model, table) (hps_hot_keys_share)", "{{model}}/{{table}}"),
          )),
    Panel("Tiers", "Tier available",
          "1 while a tier answers, 0 while it is down, per hps service.", "short", (
              Query("hps_tier_available", "{{instance}} {{tier}}"),
          )),
    Panel("Models", "Loads and reloads",
          "Model versions that became served, and loads that failed.", "short", (
              Query(f"sum by (model) (increase(hps_model_loads_total[{RATE}]))",
                    "{{model}} loaded"),
              Query(f"sum by (model, kind) (increase(hps_load_failures_total[{RATE}]))",
                    "{{model}} failed ({{kind}})"),
          )),
    Panel("Models", "Load rate",
          "Keys written to the tiers per second by loads and reloads.", "short", (
              Query(f"sum by (instance) (rate(hps_load_keys_total[{RATE}]))", "{{instance}}"),
          )),
    Panel("Models", "Load gate",
          "Versions the load gate refused (the old version kept serving), and drifts it let "
          "serve with a warning, by check.", "short", (
              Query(f"sum by (model, table, check) "
                    f"(increase(hps_load_gate_refusals_total[{RATE}]))",
                    "{{model}}/{{table}} refused ({{check}})"),
              Query(f"sum by (model, table, check) "
                    f"(increase(hps_load_gate_warnings_total[{RATE}]))",
                    "{{model}}/{{table}} warned ({{check}})"),
          )),
    Panel("Models", "Reload drift",
          "The last reload's row-norm ratio (new over old, on a sample of shared keys) and "
          "share of keys added or removed.", "short", (
              Query('max by (model, table) (hps_load_gate_drift{figure="norm_ratio"})',
                    "{{model}}/{{table}} norm ratio"),
              Query('max by (model, table) (hps_load_gate_drift{figure="key_churn"})',
                    "{{model}}/{{table}} key churn"),
          )),
    Panel("Models", "Model ready",
          "1 when the model is loaded and served by the hps service.", "short", (
              Query("hps_model_ready", "{{instance}} {{model}}"),
          )),
    Panel("Updates", "Updates applied",
          "Online updates: rows applied per second, per table (hps_et.<model>.<table>), "
          "and rows skipped as bad. Empty without an update source (Kafka, Redis Streams).",
          "short", (
              Query(f"sum by (table) (rate(hps_update_rows_total[{RATE}]))",
                    "{{table}} rows/s"),
              Query(f"sum by (table, reason) (rate(hps_update_rejected_total[{RATE}]))",
                    "{{table}} rejected ({{reason}})/s"),
          )),
    Panel("Updates", "Update lag",
          "Online updates: messages published but not applied yet, per table, on the "
          "slowest replica.", "short", (
              Query("max by (table) (hps_update_lag_messages)", "{{table}} messages"),
          )),
    Panel("Updates", "Update lag (seconds)",
          "While messages wait: age of the newest one applied, per table, on the slowest "
          "replica (0 when none waits).", "s", (
              Query("max by (table) (hps_update_lag_seconds)", "{{table}}"),
          )),
    Panel("Updates", "Update source up",
          "1 while each replica's update source answers, 0 while it is down (lookups go on).",
          "short", (
              Query("hps_update_source_up", "{{instance}} {{source}}"),
          )),
)
