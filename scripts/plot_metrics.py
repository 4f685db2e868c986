"""Draw the dashboard's panels from Prometheus's query_range API (matplotlib), as a PNG.

    python scripts/plot_metrics.py http://127.0.0.1:9090 [--since UNIX_TIME] --out docs/metrics.png

The panels and their PromQL are scripts/dashboard_panels.py's, the ones the Grafana
dashboard shows; Grafana's `$__rate_interval` becomes a fixed window (--rate). This is a
picture of the same queries, not a Grafana screenshot (Grafana itself is not available
where scripts/compose_check.sh runs); the figure says so in its title. Panels whose
queries return nothing say "no data". Prints one line per panel: series and points.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from dashboard_panels import PANELS, RATE, Panel  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import PercentFormatter  # noqa: E402

Series = tuple[str, list[float], list[float]]  # (legend, unix times, values)


def query_range(base: str, expr: str, start: float, end: float, step: float
                ) -> list[dict[str, Any]]:
    """The matrix result of one range query; raises on an API error."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{base.rstrip('/')}/api/v1/query_range?{params}",
                                timeout=30) as answer:
        body = json.load(answer)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error')}")
    return list(body["data"]["result"])


def legend(template: str, labels: dict[str, str]) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def panel_series(base: str, panel: Panel, rate: str, start: float, end: float,
                 step: float) -> list[Series]:
    series = []
    for query in panel.queries:
        for result in query_range(base, query.expr.replace(RATE, rate), start, end, step):
            points = [(float(t), float(v)) for t, v in result["values"] if v not in ("NaN",)]
            if points:
                times, values = zip(*points, strict=True)
                series.append((legend(query.legend, result["metric"]), list(times),
                               list(values)))
    return series


def draw(ax: Axes, panel: Panel, series: list[Series], start: float, end: float,
         marks: list[tuple[str, float]]) -> None:
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.grid(True, alpha=0.3)
    if not series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                color="gray")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    for name, times, values in series:
        ax.plot([(t - start) / 60 for t in times], values, label=name, linewidth=1.2)
    for i, (label, when) in enumerate(marks):
        ax.axvline((when - start) / 60, color="gray", linestyle=":", linewidth=0.8)
        ax.text((when - start) / 60, 1.0 - 0.09 * (i % 3), f" {label}", fontsize=6,
                color="dimgray", transform=ax.get_xaxis_transform(), va="top")
    ax.set_xlabel("minutes since Prometheus started", fontsize=8)
    ax.tick_params(labelsize=8)
    if panel.unit == "percentunit":
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    elif panel.unit == "s":
        ax.set_ylabel("seconds", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.set_xlim(0, (end - start) / 60)
    ax.legend(fontsize=6, loc="best")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prometheus", help="base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--since", type=float, default=0.0,
                        help="start of the window drawn, unix seconds (default: 10 min ago)")
    parser.add_argument("--step", type=float, default=5.0, help="seconds between points")
    parser.add_argument("--rate", default="30s", help="window of rate() and increase()")
    parser.add_argument("--out", type=Path, default=Path("docs/metrics.png"))
    parser.add_argument("--mark", action="append", default=[], metavar="LABEL=UNIX_TIME",
                        help="an event drawn as a dotted line on every panel (repeatable)")
    args = parser.parse_args(argv)
    end = time.time()
    start = args.since or end - 600
    columns = 2
    rows = (len(PANELS) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(13, 2.7 * rows), squeeze=False)
    marks = [(label, float(when)) for label, when in (m.rsplit("=", 1) for m in args.mark)]
    for ax, panel in zip(axes.flat, PANELS, strict=False):
        series = panel_series(args.prometheus, panel, args.rate, start, end, args.step)
        draw(ax, panel, series, start, end, marks)
        points = sum(len(s[1]) for s in series)
        print(f"{panel.title}: {len(series)} series, {points} points", flush=True)
    for ax in list(axes.flat)[len(PANELS):]:
        ax.set_visible(False)
    when = datetime.fromtimestamp(end, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fig.suptitle("hps dashboard panels drawn with matplotlib from Prometheus query_range "
                 f"(scripts/plot_metrics.py, {when}): not a Grafana screenshot", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
