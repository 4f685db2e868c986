"""Every bad request gets a JSON 4xx naming what was wrong, and changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.http.conftest import MAX_KEYS, MODEL, Live, ModelFiles, start

LOOKUP = f"/v1/models/{MODEL}/tables/0/lookup"
OCTET = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}


def _error(answer: httpx.Response, status: int, kind: str) -> str:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == {"kind", "message"}
    assert body["error"]["kind"] == kind
    assert body["error"]["message"]
    return str(body["error"]["message"])


CASES: list[tuple[str, str, dict[str, Any], int, str, str]] = [
    # (id, path, request kwargs, status, kind, a word the message must contain)
    ("unknown model", "/v1/models/nope/tables/0/lookup",
     {"json": {"keys": [1]}}, 404, "unknown_model", "nope"),
    ("unknown table name", f"/v1/models/{MODEL}/tables/nope/lookup",
     {"json": {"keys": [1]}}, 404, "unknown_table", "users"),
    ("table index out of range", f"/v1/models/{MODEL}/tables/2/lookup",
     {"json": {"keys": [1]}}, 404, "unknown_table", "2"),
    ("wrong content type", LOOKUP,
     {"content": b"keys=1", "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
     415, "unsupported_media_type", "octet-stream"),
    ("no content type", LOOKUP, {"content": b"\0" * 8}, 415, "unsupported_media_type",
     "Content-Type"),
    ("binary body of 7 bytes", LOOKUP, {"content": b"\1" * 7, "headers": OCTET},
     400, "bad_body", "8 bytes"),
    ("binary body of 17 bytes", LOOKUP, {"content": b"\1" * 17, "headers": OCTET},
     400, "bad_body", "17"),
    ("not JSON", LOOKUP, {"content": b"{keys: [1]", "headers": JSON}, 400, "bad_json",
     "JSON"),
    ("empty JSON body", LOOKUP, {"content": b"", "headers": JSON}, 400, "bad_json", "JSON"),
    ("JSON list, not object", LOOKUP, {"json": [1, 2]}, 400, "bad_json", "keys"),
    ("no keys field", LOOKUP, {"json": {"key": [1]}}, 400, "bad_json", "keys"),
    ("extra field", LOOKUP, {"json": {"keys": [1], "table": 0}}, 400, "bad_json", "table"),
    ("float key", LOOKUP, {"json": {"keys": [1, 2.5]}}, 400, "bad_json", "keys.1"),
    ("integral float key", LOOKUP, {"json": {"keys": [3.0]}}, 400, "bad_json", "keys.0"),
    ("string key", LOOKUP, {"json": {"keys": ["7"]}}, 400, "bad_json", "integer"),
    ("bool key", LOOKUP, {"json": {"keys": [True]}}, 400, "bad_json", "integer"),
    ("null key", LOOKUP, {"json": {"keys": [None]}}, 400, "bad_json", "integer"),
    ("key above int64", LOOKUP, {"json": {"keys": [2**63]}}, 400, "bad_json",
     "9223372036854775807"),
    ("key below int64", LOOKUP, {"json": {"keys": [-(2**63) - 1]}}, 400, "bad_json", "keys.0"),
    ("nested keys", LOOKUP, {"json": {"keys": [[1, 2]]}}, 400, "bad_json", "keys.0"),
    ("too many binary keys", LOOKUP,
     {"content": np.zeros(MAX_KEYS + 1, "<i8").tobytes(), "headers": OCTET},
     413, "batch_too_large", str(MAX_KEYS)),
    ("too many JSON keys", LOOKUP, {"json": {"keys": [0] * (MAX_KEYS + 1)}},
     413, "batch_too_large", str(MAX_KEYS)),
    ("unknown route", "/v3/lookup", {"json": {}}, 404, "not_found", "Not Found"),
]


@pytest.mark.parametrize(("path", "kwargs", "status", "kind", "word"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_requests(live: Live, path: str, kwargs: dict[str, Any], status: int, kind: str,
                      word: str) -> None:
    message = _error(live.client.post(path, **kwargs), status, kind)
    assert word in message


def test_wrong_method(live: Live) -> None:
    _error(live.client.get(LOOKUP), 405, "method_not_allowed")
    _error(live.client.delete("/v1/models"), 405, "method_not_allowed")


@pytest.fixture(scope="module")
def live_small_limit(model_files: ModelFiles) -> Iterator[Live]:
    yield from start(model_files, max_body_bytes=800)


def test_body_too_large(live_small_limit: Live) -> None:
    live = live_small_limit
    keys = live.model.keys[0][:100]
    assert live.lookup_binary(0, keys).status_code == 200  # 800 bytes: at the limit
    _error(live.lookup_binary(0, live.model.keys[0][:101]), 413, "body_too_large")
    _error(live.lookup_json(0, live.model.keys[0][:100]), 413, "body_too_large")

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        for _ in range(20):
            yield np.asarray(keys[:10], "<i8").tobytes()

    answer = live.client.post(LOOKUP, content=chunked(), headers=OCTET)
    assert "content-length" not in answer.request.headers
    _error(answer, 413, "body_too_large")
    # the connection and the server are still fine
    got = np.frombuffer(live.lookup_binary(0, keys).content, "<f4").reshape(100, -1)
    np.testing.assert_array_equal(got, live.model.expected(0, keys))


def test_errors_change_nothing(live: Live) -> None:
    keys = live.model.keys[1][:50]
    before = live.lookup_binary(1, keys).content
    for _, path, kwargs, *_ in CASES:
        live.client.post(path, **kwargs)
    assert live.lookup_binary(1, keys).content == before
    assert live.client.get("/healthz").status_code == 200


def test_unknown_model_info(live: Live) -> None:
    _error(live.client.get("/v1/models/nope"), 404, "unknown_model")
    _error(live.client.post("/v1/models/nope/reload"), 404, "unknown_model")


#: bodies JSON cannot decode into values: not UTF-8, nested past the parser's stack,
#: and an integer past Python's digit limit for int() (4,300 digits)
UNDECODABLE = {
    "not utf-8": b'{"keys": [1], "x": "\xff\xfe"}',
    "nested too deep": b'{"keys": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "100,000 digits": b'{"keys": [' + b"7" * 100_000 + b"]}",
}
#: (route, the status and kind it answers a malformed body with)
BODY_ROUTES = [
    (LOOKUP, 400, "bad_json"),
    (f"/v1/models/{MODEL}/reload", 422, "bad_request"),
    (f"/v1/models/{MODEL}/prefetch", 422, "bad_request"),
    ("/v1/models", 422, "bad_request"),
]


@pytest.mark.parametrize("body", list(UNDECODABLE.values()), ids=list(UNDECODABLE))
@pytest.mark.parametrize(("path", "status", "kind"), BODY_ROUTES,
                         ids=[r[0].rsplit("/", 1)[-1] for r in BODY_ROUTES])
def test_undecodable_bodies_get_their_routes_kind(live: Live, body: bytes, path: str,
                                                  status: int, kind: str) -> None:
    """These got 400 `http_error` (FastAPI's own answer to a body it failed to parse) on
    the admin routes: a status and kind in neither the OpenAPI document nor the docs. A
    plain `{` already got the route's kind; these get the same."""
    _error(live.client.post(path, content=body, headers=JSON), status, kind)
    plain = live.client.post(path, content=b"{", headers=JSON)
    assert (plain.status_code, plain.json()["error"]["kind"]) == (status, kind)
    documented = live.client.get("/openapi.json").json()["paths"]
    template = path.replace(f"/{MODEL}/", "/{model}/").replace("/0/", "/{table}/")
    assert str(status) in documented[template]["post"]["responses"], template
    assert live.client.get("/readyz").status_code == 200
