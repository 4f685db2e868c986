"""The Grafana dashboard: reproduced by its script, and it queries metrics hps exports."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.http.conftest import start, write_model
from tests.support.redis_servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "hps.json"
_SUFFIX = re.compile(r"_(total|bucket|count|sum)$")


def _panels() -> tuple[object, ...]:
    sys.path.insert(0, str(SCRIPTS))
    try:
        import dashboard_panels
    finally:
        sys.path.remove(str(SCRIPTS))
    return dashboard_panels.PANELS


def test_script_reproduces_the_committed_dashboard() -> None:
    done = subprocess.run([sys.executable, str(SCRIPTS / "grafana_dashboard.py"), "--stdout"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == DASHBOARD.read_text(), \
        "deploy/grafana/dashboards/hps.json is stale: run python scripts/grafana_dashboard.py"


def test_dashboard_queries_metrics_hps_exports(tmp_path: Path) -> None:
    """A server with an update source (a real redis-server's streams) exports them all."""
    panels = _panels()
    queried = {_SUFFIX.sub("", name) for p in panels for q in p.queries  # type: ignore[attr-defined]
               for name in re.findall(r"\bhps_\w+", q.expr)}
    assert len(queried) > 10
    model = write_model(tmp_path / "model")
    config = copy.deepcopy(model.config)
    with RedisServer(tmp_path / "streams") as streams:
        config["update_source"] = {"type": "redis_stream", "address": streams.address,
                                   "poll_timeout_ms": 100}
        for live in start(replace(model, config=config)):
            live.lookup_binary(0, live.model.keys[0][:10])
            text = live.client.get("/metrics").text
            exported = {f.name for f in text_string_to_metric_families(text)}
    missing = queried - exported
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"
