"""The gate ahead of FastAPI (hps/http/gate.py): every route's guard runs before any of
its body is read, every body is bounded while it streams in, and an Origin must be one of
the server's own (scheme, host and port). Real uvicorn over a socket."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.http.conftest import MODEL, Live, ModelFiles, start, write_model

LIMIT = 64 << 10


@pytest.fixture
def own(tmp_path: Path) -> Iterator[Live]:
    """A model of the test's own, served on loopback without a token (admin open)."""
    yield from start(write_model(tmp_path / "srv" / "v1", seed=3), max_body_bytes=LIMIT)


@pytest.fixture
def guarded(model_files: ModelFiles) -> Iterator[Live]:
    yield from start(model_files, token="s3cret", max_body_bytes=LIMIT)


def raw_request(live: Live, head: str, body: bytes = b"", timeout: float = 5.0
                ) -> tuple[int, dict[str, str], bytes]:
    """Send `head` (request line and headers) and `body` over a fresh socket; (status,
    headers, body) of the answer, which must come within `timeout` seconds."""
    url = urlsplit(live.url)
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed without an answer: {data!r}"
            data += chunk
        header_part, rest = data.split(b"\r\n\r\n", 1)
        lines = header_part.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip()
                   for k, v in (line.split(":", 1) for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return int(lines[0].split()[1]), headers, rest


def post_head(live: Live, path: str, length: int, extra: str = "") -> str:
    host = urlsplit(live.url).netloc
    return (f"POST {path} HTTP/1.1\nHost: {host}\nContent-Type: application/json\n"
            f"Content-Length: {length}\n{extra}")


@pytest.mark.parametrize("path", ["/v1/models", f"/v1/models/{MODEL}/reload",
                                  f"/v1/models/{MODEL}/prefetch"])
def test_admin_token_is_checked_before_the_body_is_read(guarded: Live, path: str) -> None:
    """A 256 MiB body is declared and never sent: the 401 comes without waiting for it
    (it used to come after FastAPI had read and parsed the whole body)."""
    status, headers, body = raw_request(guarded, post_head(guarded, path, 256 << 20), b"{")
    assert status == 401
    assert json.loads(body)["error"]["kind"] == "unauthorized"
    assert headers.get("connection") == "close"  # the body left unread ends the connection


@pytest.mark.parametrize("path", ["/metrics", "/v2", "/v1/models"])
def test_token_routes_refuse_before_the_body(guarded: Live, path: str) -> None:
    head = post_head(guarded, path, 1 << 30).replace("POST", "GET", 1)
    status, _, _ = raw_request(guarded, head, b"{")
    assert status == 401


@pytest.mark.parametrize("path", ["/v1/models", f"/v1/models/{MODEL}/reload",
                                  "/v1/models/nope/reload", "/nowhere"])
def test_every_body_is_bounded_without_a_token(own: Live, path: str) -> None:
    """Admin routes (and unknown paths) have the body limit too: 413 on the declared
    length before reading, and 413 on a body without a length once it passes the limit
    (it used to be 422, after reading the whole body)."""
    status, _, body = raw_request(own, post_head(own, path, LIMIT + 1), b"{")
    assert status == 413, body
    assert json.loads(body)["error"]["kind"] == "body_too_large"

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "'
        for _ in range(4 * LIMIT // 4096):
            yield b"a" * 4096

    answer = own.client.post(path, content=chunks(),
                             headers={"Content-Type": "application/json"})
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["kind"] == "body_too_large"
    assert own.client.get("/readyz").status_code == 200


def test_bodies_within_the_limit_still_reach_the_routes(own: Live) -> None:
    answer = own.client.post(f"/v1/models/{MODEL}/reload", json={})
    assert answer.status_code == 200, answer.text
    answer = own.client.post("/v1/models", json={"model": "x"})
    assert answer.status_code == 422, answer.text  # read and judged by the route


def test_origin_must_match_scheme_host_and_port(own: Live) -> None:
    """Any page on the same machine (another port) could post a form: refused now."""
    port = urlsplit(own.url).port
    reload = f"/v1/models/{MODEL}/reload"
    for origin in ("http://localhost:3000", f"https://127.0.0.1:{port}",
                   f"http://127.0.0.1:{port + 1}", "http://127.0.0.1", "file://",
                   f"http://evil.example:{port}", "localhost"):
        answer = own.client.post(reload, headers={"Origin": origin})
        assert answer.status_code == 403, origin
        assert answer.json()["error"]["kind"] == "host_not_allowed"
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}",
                   f"http://[::1]:{port}", f"HTTP://LOCALHOST:{port}"):
        answer = own.client.post(reload, headers={"Origin": origin})
        assert answer.status_code == 200, (origin, answer.text)


def test_origins_listed_in_the_config(tmp_path: Path) -> None:
    """Behind a proxy the page's origin is the proxy's: listed as an origin, it passes."""
    model = write_model(tmp_path / "v1")
    model.config["http"] = {"allowed_hosts": ["https://hps.example"]}
    for live in start(model):
        reload = f"/v1/models/{MODEL}/reload"
        ok = live.client.post(reload, headers={"Origin": "https://hps.example"})
        assert ok.status_code == 200, ok.text
        for origin in ("http://hps.example", "https://hps.example:8443"):
            assert live.client.post(reload, headers={"Origin": origin}).status_code == 403


def test_every_answer_says_nosniff(own: Live) -> None:
    keys = own.model.keys[0][:4]
    answers = [own.client.get("/healthz"), own.client.get("/nowhere"),
               own.lookup_binary(0, keys), own.lookup_json(0, keys.tolist()),
               own.lookup_binary("nope", keys),
               own.client.post(f"/v2/models/{MODEL}/infer", content=b"{"),
               own.client.post("/v1/models", content=b"x" * (LIMIT + 1),
                               headers={"Content-Type": "application/json"})]
    for answer in answers:
        assert answer.headers.get("x-content-type-options") == "nosniff", answer.request.url
