"""/healthz answers at once; /readyz is 503 until every model is loaded, then 200."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from hps.http import create_app
from hps.http.serve import ServerThread
from hps.server import HierarchicalParameterServer
from tests.http.conftest import MODEL, READY_WAIT, ModelFiles, metric_value, wait_until


def test_ready_after_background_load(model_files: ModelFiles) -> None:
    server = HierarchicalParameterServer(model_files.config, load=False)
    release = threading.Event()
    load_model = server.load_model

    def held_load(*args: Any, **kwargs: Any) -> Any:  # the load waits for the test
        assert release.wait(10)
        return load_model(*args, **kwargs)

    server.load_model = held_load  # type: ignore[method-assign]
    announced = threading.Event()
    app = create_app(server, on_ready=announced.set)
    try:
        with ServerThread(app) as url, httpx.Client(base_url=url) as client:
            assert client.get("/healthz").json() == {"status": "ok"}
            ready = client.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["status"] == "loading" and ready.json()["loading"] == [MODEL]
            assert ready.json()["error"] == {
                "kind": "not_ready", "message": f"models not served yet: still loading: {MODEL}"}
            answer = client.post(f"/v1/models/{MODEL}/tables/0/lookup", json={"keys": [1]})
            assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
            assert answer.json()["error"]["kind"] == "model_loading"
            assert client.get(f"/v1/models/{MODEL}").status_code == 503
            assert client.get("/v1/models").json()["loading"] == [MODEL]
            assert metric_value(client.get("/metrics").text, "hps_model_ready",
                                model=MODEL) == 0.0
            assert not announced.is_set()

            release.set()
            wait_until(lambda: client.get("/readyz").status_code == 200, timeout=READY_WAIT)
            assert client.get("/readyz").json() == {
                "status": "ready", "loaded": [MODEL], "loading": [], "failed": [],
                "degraded": {}}
            assert announced.wait(5)
            keys = model_files.keys[0][:4]
            got = client.post(f"/v1/models/{MODEL}/tables/0/lookup",
                              json={"keys": keys.tolist()}).json()["vectors"]
            np.testing.assert_array_equal(np.asarray(got, np.float32), model_files.vectors[0][:4])
            metrics = client.get("/metrics").text
            assert metric_value(metrics, "hps_model_ready", model=MODEL) == 1.0
            total = sum(len(k) for k in model_files.keys)
            assert metric_value(metrics, "hps_load_keys_total", model=MODEL) == total
    finally:
        release.set()
        server.close()


def test_failed_load_keeps_readyz_503(tmp_path: Path, model_files: ModelFiles) -> None:
    config = dict(model_files.config)
    config["models"] = [{**config["models"][0],
                         "sparse_files": [str(tmp_path / "missing"), str(tmp_path / "gone")]}]
    server = HierarchicalParameterServer(config, load=False)
    app = create_app(server)
    try:
        with ServerThread(app) as url, httpx.Client(base_url=url) as client:
            wait_until(lambda: client.get("/readyz").json()["status"] == "failed")
            ready = client.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["failed"] == [MODEL]
            assert ready.json()["error"]["message"] == (  # no empty "-" list of loading ones
                f"models not served yet: failed to load: {MODEL} (why: GET /v1/models)")
            assert "missing" not in ready.text  # no paths on an open route
            assert "missing" in client.get("/v1/models").json()["failed"][MODEL]
            assert client.get("/healthz").status_code == 200
            answer = client.post(f"/v1/models/{MODEL}/tables/0/lookup", json={"keys": [1]})
            assert answer.status_code == 503
            assert answer.json()["error"]["kind"] == "model_failed"
            assert metric_value(client.get("/metrics").text, "hps_load_failures_total",
                                model=MODEL) == 1.0
    finally:
        server.close()
