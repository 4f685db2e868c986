"""What `hps_http_requests_total` counts a request under when no handler answered it: a
body its client abandoned is 499 (client closed request), never 500, whichever path read
it (the hot routes' ASGI path, the direct answer, the gate of every other route); the
gate's own refusals (403 host_not_allowed, 401, 413) are counted under their route like
FastAPI's answers. Real uvicorn over a socket, raw sockets for the abandoned bodies; one
process and `hps serve --workers 2` (whose /metrics sums the workers)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.http.conftest import MODEL, Live, ModelFiles, metric_value, start, wait_until
from tests.support.raw_http import connect

LOOKUP = (f"/v1/models/{MODEL}/tables/0/lookup", "/v1/models/{model}/tables/{table}/lookup")
INFER = (f"/v2/models/{MODEL}/infer", "/v2/models/{model}/infer")
RELOAD = (f"/v1/models/{MODEL}/reload", "/v1/models/{model}/reload")
TOKEN = "s3cret"


def abandon(url: str, path: str, chunked: bool) -> None:
    """A POST to `path` whose body stops after its first 8 bytes: the client closes."""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    if chunked:
        data = (head + "Transfer-Encoding: chunked\r\n\r\n8\r\n").encode() + b"[1,2,3,4\r\n"
    else:
        data = (head + "Content-Length: 800\r\n\r\n").encode() + b"[1,2,3,4"
    with connect(url) as sock:
        sock.sendall(data)
        time.sleep(0.05)  # (the head is read before the close: a request was begun)


def count(url: str, route: str, code: str, method: str = "POST",
          headers: dict[str, str] | None = None) -> float:
    """hps_http_requests_total of (route, method, code), read on a fresh connection (under
    --workers 2 either worker answers: the sum of both)."""
    with httpx.Client(base_url=url, timeout=30, headers=headers) as client:
        return metric_value(client.get("/metrics").text, "hps_http_requests_total",
                            route=route, method=method, code=code)


def counts_moved(url: str, route: str, code: str, before: float, by: int, method: str = "POST",
                 headers: dict[str, str] | None = None) -> Callable[[], bool]:
    return lambda: count(url, route, code, method, headers) >= before + by


@pytest.fixture(scope="module")
def live_direct(model_files: ModelFiles) -> Iterator[Live]:
    """Lookups on the event loop (`lookup_threads` 0): Content-Length bodies are
    answered directly by the connection (hps/http/direct.py)."""
    yield from start(model_files, lookup_threads=0)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
@pytest.mark.parametrize(("path", "route"), [LOOKUP, INFER, RELOAD],
                         ids=["lookup", "v2 infer", "admin route"])
def test_an_abandoned_body_is_counted_499_never_500(
        live: Live, path: str, route: str, chunked: bool) -> None:
    before = {code: count(live.url, route, code) for code in ("499", "500")}
    abandon(live.url, path, chunked)
    wait_until(counts_moved(live.url, route, "499", before["499"], 1))
    keys = live.model.keys[0][:3]  # the server answers on: the next lookup is exact
    assert live.lookup_binary(0, keys).content == live.model.expected(0, keys).tobytes()
    assert count(live.url, route, "499") == before["499"] + 1
    assert count(live.url, route, "500") == before["500"]


@pytest.mark.parametrize(("path", "route"), [LOOKUP, INFER], ids=["lookup", "v2 infer"])
def test_an_abandoned_body_of_a_direct_answer_is_counted_499(
        live_direct: Live, path: str, route: str) -> None:
    live = live_direct
    before = {code: count(live.url, route, code) for code in ("499", "500")}
    direct = live.app.hot_routes.answered_directly
    abandon(live.url, path, chunked=False)
    wait_until(counts_moved(live.url, route, "499", before["499"], 1))
    keys = live.model.keys[0][:3]
    assert live.lookup_binary(0, keys).content == live.model.expected(0, keys).tobytes()
    assert live.app.hot_routes.answered_directly == direct + 1  # the lookup, not the other
    assert count(live.url, route, "499") == before["499"] + 1
    assert count(live.url, route, "500") == before["500"]


def test_abandoned_bodies_are_counted_499_by_two_workers(live_workers: Live) -> None:
    live = live_workers
    routes = [LOOKUP, INFER]
    before = {(route, code): count(live.url, route, code)
              for _, route in routes for code in ("499", "500")}
    for _ in range(4):  # fresh connections: both workers
        for path, _ in routes:
            abandon(live.url, path, chunked=True)
    for _, route in routes:  # (a peer's counts reach /metrics within a second)
        wait_until(counts_moved(live.url, route, "499", before[route, "499"], 4))
    time.sleep(1.5)  # every worker's last figures in: nothing more comes
    for _, route in routes:
        assert count(live.url, route, "499") == before[route, "499"] + 4
        assert count(live.url, route, "500") == before[route, "500"]


#: (method, path, route template, headers): refused 403 host_not_allowed by the gate
FOREIGN_HOST = [
    ("GET", "/v1/models", "/v1/models", {"Host": "evil.example"}),
    ("POST", RELOAD[0], RELOAD[1], {"Host": "evil.example"}),
    ("POST", RELOAD[0], RELOAD[1], {"Origin": "http://localhost:1"}),
    ("GET", "/openapi.json", "/openapi.json", {"Host": "evil.example"}),
]


def _refuse_all(url: str, cases: list[tuple[str, str, str, dict[str, str]]], status: int,
                times: int = 1) -> None:
    for _ in range(times):
        for method, path, _, headers in cases:
            with httpx.Client(base_url=url, timeout=30) as client:  # fresh connections
                answer = client.request(method, path, headers=headers)
            assert answer.status_code == status, (path, answer.text)


def test_the_gates_403s_are_counted(live: Live) -> None:
    before = {(m, r): count(live.url, r, "403", m) for m, _, r, _ in FOREIGN_HOST}
    _refuse_all(live.url, FOREIGN_HOST, 403)
    added: dict[tuple[str, str], int] = {}
    for method, _, route, _ in FOREIGN_HOST:
        added[method, route] = added.get((method, route), 0) + 1
    for (method, route), n in added.items():
        assert count(live.url, route, "403", method) == before[method, route] + n, route


def test_the_gates_401s_are_counted(live_token: Live) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cases = [("GET", "/v1/models", "/v1/models", {}),
             ("POST", RELOAD[0], RELOAD[1], {}),
             ("GET", "/metrics", "/metrics", {"Authorization": "Bearer wrong"})]
    before = [count(live_token.url, r, "401", m, auth) for m, _, r, _ in cases]
    _refuse_all(live_token.url, cases, 401)
    after = [count(live_token.url, r, "401", m, auth) for m, _, r, _ in cases]
    assert after == [b + 1 for b in before]


def test_the_gates_413s_are_counted(live: Live) -> None:
    """A body declared beyond the limit, refused before it is read."""
    before = count(live.url, RELOAD[1], "413")
    with connect(live.url) as sock:
        sock.sendall(f"POST {RELOAD[0]} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {1 << 40}\r\n\r\n{{".encode())
        assert sock.recv(64).startswith(b"HTTP/1.1 413 ")
    assert count(live.url, RELOAD[1], "413") == before + 1


def test_the_gates_refusals_are_counted_by_two_workers(live_workers: Live) -> None:
    live = live_workers
    before = count(live.url, "/v1/models", "403", "GET")
    _refuse_all(live.url, FOREIGN_HOST[:1], 403, times=6)  # fresh connections: both workers
    wait_until(counts_moved(live.url, "/v1/models", "403", before, 6, "GET"))
    time.sleep(1.5)  # every worker's last figures in: nothing more comes
    assert count(live.url, "/v1/models", "403", "GET") == before + 6
