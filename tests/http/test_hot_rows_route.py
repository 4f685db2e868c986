"""`POST /v1/models/{model}/hot-rows` and `hps models hot-rows` (hps/http/keys_routes.py,
hps/tools/cli/models.py) on servers without GPUs: real uvicorn on loopback, one process
and `hps serve --workers 2`. No table keeps hot copies there (they need a static table
sharded over several GPUs: tests/gpu/test_hot_rows.py fills them), so a fill is refused
with a 409 that says so, and bad requests get their 4xx, as for the other admin routes."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import httpx
import pytest

from tests.http.conftest import MODEL, Live


def _hps(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HPS_URL", "HPS_TOKEN")}
    return subprocess.run([sys.executable, "-m", "hps.tools.cli", *args], capture_output=True,
                          text=True, env={**env, "COLUMNS": "200"}, timeout=300)


@pytest.mark.parametrize("body", [None, {}, {"table": "users"}, {"table": 1}])
def test_a_fill_of_a_server_without_gpus_is_a_409_that_says_why(
        live: Live, body: dict[str, Any] | None) -> None:
    answer = live.client.post(f"/v1/models/{MODEL}/hot-rows", json=body)
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert error["kind"] == "no_hot_copies"
    assert "hot copies" in error["message"] and "sharded over several GPUs" in error["message"]
    if body and "table" in body:
        assert "users" in error["message"] or "items" in error["message"]


@pytest.mark.parametrize("model,body,status", [
    ("nope", {}, 404),
    (MODEL, {"table": "nope"}, 404),
    (MODEL, {"table": 7}, 404),
    (MODEL, {"table": False}, 422),
    (MODEL, {"table": "users", "keys": [1]}, 422),
])
def test_bad_fills_get_4xx_json(live: Live, model: str, body: dict[str, Any],
                                status: int) -> None:
    answer = live.client.post(f"/v1/models/{model}/hot-rows", json=body)
    assert answer.status_code == status, answer.text
    assert "kind" in answer.json()["error"]


def test_the_route_is_an_admin_route(live_token: Live) -> None:
    answer = live_token.client.post(f"/v1/models/{MODEL}/hot-rows", json={})
    assert answer.status_code == 401, answer.text


def test_hps_models_hot_rows_says_why_no_copies_were_filled(live: Live) -> None:
    done = _hps("models", "hot-rows", MODEL, "--url", live.url)
    assert done.returncode != 0
    assert "409" in done.stderr and "hot copies" in done.stderr
    one = _hps("models", "hot-rows", MODEL, "--table", "users", "--url", live.url)
    assert one.returncode != 0 and "'users'" in one.stderr
    unknown = _hps("models", "hot-rows", MODEL, "--table", "nope", "--url", live.url)
    assert unknown.returncode != 0 and "no table" in unknown.stderr


def test_every_worker_answers_a_fill_alike(live_workers: Live) -> None:
    """Under --workers 2 the route is each worker's (hps/http/workers_hot_rows.py): with
    no hot copies, either worker refuses it the same way and asks no other worker."""
    # clients of a connection each, held open together: each worker accepts while it
    # holds no more than the other (hps/http/accept_share.py), so both answer
    clients = [httpx.Client(base_url=live_workers.url, timeout=30) for _ in range(4)]
    try:
        for client in clients:
            answer = client.post(f"/v1/models/{MODEL}/hot-rows", json={})
            assert answer.status_code == 409, answer.text
            assert answer.json()["error"]["kind"] == "no_hot_copies"
    finally:
        for client in clients:
            client.close()
