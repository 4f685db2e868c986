"""Bearer token on every route but health; admin routes only with a token or on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.http.conftest import MODEL, Live, ModelFiles, start

BEARER = {"Authorization": "Bearer s3cret"}
ROUTES = [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("GET", "/metrics"),
          ("POST", f"/v1/models/{MODEL}/tables/0/lookup"), ("POST", f"/v1/models/{MODEL}/reload")]


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic czNjcmV0", "s3cret"])
def test_token_required(live_token: Live, method: str, path: str, auth: str | None) -> None:
    headers = {"Authorization": auth} if auth else {}
    answer = live_token.client.request(method, path, headers=headers, json={"keys": [1]})
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["kind"] == "unauthorized"
    assert answer.headers["www-authenticate"] == "Bearer"


def test_health_needs_no_token(live_token: Live) -> None:
    assert live_token.client.get("/healthz").status_code == 200
    assert live_token.client.get("/readyz").status_code == 200


def test_right_token_passes(live_token: Live) -> None:
    keys = live_token.model.keys[0][:5]
    answer = live_token.lookup_binary(0, keys, headers=BEARER)
    assert answer.status_code == 200
    np.testing.assert_array_equal(np.frombuffer(answer.content, "<f4").reshape(5, -1),
                                  live_token.model.vectors[0][:5])
    assert live_token.client.get("/v1/models", headers=BEARER).status_code == 200
    assert "hps_lookups_total" in live_token.client.get("/metrics", headers=BEARER).text
    assert live_token.client.post(f"/v1/models/{MODEL}/reload", headers=BEARER).status_code == 200


@pytest.fixture(scope="module")
def live_public(model_files: ModelFiles) -> Iterator[Live]:
    """A server that believes it is bound to every interface, without a token."""
    yield from start(model_files, host="0.0.0.0")


def test_admin_refused_without_token_off_loopback(live_public: Live) -> None:
    answer = live_public.client.post(f"/v1/models/{MODEL}/reload")
    assert answer.status_code == 403
    assert answer.json()["error"]["kind"] == "forbidden"
    assert "--token" in answer.json()["error"]["message"]
    assert live_public.lookup_json(0, live_public.model.keys[0][:2]).status_code == 200


def test_admin_open_on_loopback_without_token(live: Live) -> None:
    assert live.client.post(f"/v1/models/{MODEL}/reload").status_code == 200


def test_docs_describe_both_bodies(live_token: Live) -> None:
    schema = httpx.get(live_token.url + "/openapi.json").json()
    op = schema["paths"]["/v1/models/{model}/tables/{table}/lookup"]["post"]
    assert set(op["requestBody"]["content"]) == {"application/octet-stream", "application/json"}
    assert set(op["responses"]["200"]["content"]) == {"application/octet-stream",
                                                       "application/json"}
    assert {"X-HPS-Keys", "X-HPS-Width"} <= set(op["responses"]["200"]["headers"])
    assert {"400", "404", "413", "415"} <= set(op["responses"])
    assert op["security"]  # the token is documented
    assert httpx.get(live_token.url + "/docs").status_code == 200
