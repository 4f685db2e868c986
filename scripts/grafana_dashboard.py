"""Write the Grafana dashboard of hps (deploy/grafana/dashboards/hps.json).

    python scripts/grafana_dashboard.py            # writes the file
    python scripts/grafana_dashboard.py --stdout   # prints it instead

The dashboard is built with Grafana's own Python SDK (`grafana-foundation-sdk`, in the
test extra): typed builders, so what it writes is a valid dashboard by construction. The
panels (titles, units, PromQL) come from scripts/dashboard_panels.py, which
scripts/plot_metrics.py draws as well. The compose file's `monitoring` profile provisions
the JSON into Grafana, on a Prometheus data source of uid "prometheus".
tests/test_dashboard.py checks that this script reproduces the committed file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dashboard_panels import PANELS, Panel
from grafana_foundation_sdk.builders.common import VizLegendOptions
from grafana_foundation_sdk.builders.dashboard import Dashboard, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery as PrometheusQuery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import DataSourceRef

OUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "hps.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="prometheus")
UID = "hps-overview"


def timeseries(panel: Panel) -> Timeseries:
    """One panel as a Grafana time series, its queries on the Prometheus data source."""
    built = (Timeseries()
             .title(panel.title)
             .description(panel.description)
             .unit(panel.unit)
             .datasource(DATASOURCE)
             .height(8)
             .span(12)
             .min(0)
             .legend(VizLegendOptions()
                     .display_mode(LegendDisplayMode.LIST)
                     .placement(LegendPlacement.BOTTOM)
                     .show_legend(True)))
    for i, query in enumerate(panel.queries):
        built = built.with_target(PrometheusQuery()
                                  .expr(query.expr)
                                  .legend_format(query.legend)
                                  .ref_id(chr(ord("A") + i))
                                  .datasource(DATASOURCE))
    return built


def build_dashboard() -> Dashboard:
    """The whole dashboard: one row per group of panels, two panels a line."""
    board = (Dashboard("hps: hierarchical parameter server")
             .uid(UID)
             .description("Lookups, tiers and model loads of every hps service Prometheus "
                          "scrapes (deploy/docker-compose.yml, profile monitoring).")
             .tags(["hps", "embeddings"])
             .refresh("10s")
             .time("now-30m", "now")
             .timezone("browser"))
    row = None
    for panel in PANELS:
        if panel.row != row:
            row = panel.row
            board = board.with_row(Row(row))
        board = board.with_panel(timeseries(panel))
    return board


def render() -> str:
    """The dashboard as the JSON text the file holds."""
    return JSONEncoder(sort_keys=True, indent=2).encode(build_dashboard().build()) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stdout", action="store_true", help="print instead of writing")
    args = parser.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
    else:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(text)
        print(f"wrote {OUT} ({len(PANELS)} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
