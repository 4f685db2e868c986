"""Requests that are not HTTP, down to their framing (a chunk size that is not hex, a
header without a colon, a Content-Length beside Transfer-Encoding): the connection itself
answers a JSON 400 `bad_http` in the route's protocol form and closes, after the answers
still due to earlier requests; `/metrics` counts the request under code 400, never 500.
Real uvicorn over a socket: what the parser refuses never reaches an HTTP client
library's request."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from hps.http.connections import ConnectionGuard, guarded_protocol
from hps.http.serve import ServerThread
from hps.server import HierarchicalParameterServer
from tests.http.conftest import MODEL, READY_WAIT, Live, ModelFiles, wait_until
from tests.support.raw_http import ResponseReader, connect

LOOKUP = f"/v1/models/{MODEL}/tables/0/lookup"
LOOKUP_ROUTE = "/v1/models/{model}/tables/{table}/lookup"
INFER = f"/v2/models/{MODEL}/infer"
RELOAD = f"/v1/models/{MODEL}/reload"


def chunked_head(path: str, content_type: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()


#: (id, request bytes, the route it is counted under, the method label, v2 error form)
MALFORMED: list[tuple[str, bytes, str, str, bool]] = [
    ("chunk size not hex on a lookup", chunked_head(LOOKUP) + b"zz\r\n", LOOKUP_ROUTE,
     "POST", False),
    ("chunk size not hex after a chunk", chunked_head(LOOKUP, "application/octet-stream")
     + b"8\r\n" + b"\0" * 8 + b"\r\nq\r\n", LOOKUP_ROUTE, "POST", False),
    ("chunk size not hex on v2 infer", chunked_head(INFER) + b"zz\r\n",
     "/v2/models/{model}/infer", "POST", True),
    ("chunk size not hex on an admin route", chunked_head(RELOAD) + b"zz\r\n",
     "/v1/models/{model}/reload", "POST", False),
    ("chunk without its CRLF", chunked_head(LOOKUP) + b"2\r\n{}XX", LOOKUP_ROUTE, "POST",
     False),
    ("Content-Length not a number", f"POST {LOOKUP} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
     "Content-Length: 1x\r\n\r\n".encode(), "unmatched", "POST", False),
    ("Content-Length beside Transfer-Encoding", f"POST {LOOKUP} HTTP/1.1\r\nHost: "
     "127.0.0.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n".encode(),
     "unmatched", "POST", False),
    ("header without a colon", b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
     b"no colon here\r\n\r\n", "unmatched", "GET", False),
    ("header without a colon under /v2", b"GET /v2/models HTTP/1.1\r\nBad Header\r\n\r\n",
     "unmatched", "GET", True),
    ("request line not HTTP", b"HELLO THERE\r\n\r\n", "unmatched", "other", False),
    # (the line is refused whole: its method is not counted as read)
    ("path not ASCII", b"GET /v1/models/\xff HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
     "unmatched", "other", False),
]


def refused(sock: socket.socket) -> dict[str, object]:
    """The 400 the connection answers, checked whole; then the connection is closed."""
    reader = ResponseReader(sock)
    status, headers, body = reader.response()
    assert status == 400, body
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    assert headers["x-content-type-options"] == "nosniff"
    assert reader.closed()
    return json.loads(body)  # type: ignore[no-any-return]


def check_form(answer: dict[str, object], v2: bool) -> None:
    if v2:  # the KServe v2 protocol's form
        assert set(answer) == {"error"} and isinstance(answer["error"], str)
        assert "not HTTP/1.1" in answer["error"]
    else:
        assert set(answer) == {"error"}
        error = answer["error"]
        assert isinstance(error, dict) and set(error) == {"kind", "message"}
        assert error["kind"] == "bad_http" and "not HTTP/1.1" in error["message"]


@pytest.mark.parametrize(("data", "route", "method", "v2"),
                         [case[1:] for case in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_requests_get_a_json_400_counted_as_such(
        live: Live, data: bytes, route: str, method: str, v2: bool) -> None:
    count = {"route": route, "method": method, "code": "400"}
    before = live.metric("hps_http_requests_total", **count)
    errors = live.metric("hps_http_errors_total", kind="bad_http", code="400")
    fives = live.metric("hps_http_requests_total", route=route, method=method, code="500")
    with connect(live.url) as sock:
        sock.sendall(data)
        check_form(refused(sock), v2)
    # a whole request on another connection: whatever the refused one's handler did
    # (it saw a disconnect) is done by now
    keys = live.model.keys[0][:3]
    assert live.lookup_binary(0, keys).content == live.model.expected(0, keys).tobytes()
    assert live.metric("hps_http_requests_total", **count) == before + 1
    assert live.metric("hps_http_errors_total", kind="bad_http", code="400") == errors + 1
    assert live.metric("hps_http_requests_total", route=route, method=method,
                       code="500") == fives


def test_earlier_answers_go_out_before_the_400(live: Live) -> None:
    """Pipelined: a whole lookup, then one whose chunked body is malformed, in one write:
    the first gets its vectors, then the second its 400 (responses keep their order)."""
    keys = live.model.keys[0][:5]
    body = np.asarray(keys, "<i8").tobytes()
    good = (f"POST {LOOKUP} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    for second in (chunked_head(LOOKUP) + b"zz\r\n", b"NOT HTTP AT ALL\r\n\r\n"):
        with connect(live.url) as sock:
            sock.sendall(good + body + second)
            reader = ResponseReader(sock)
            status, _, answer = reader.response()
            assert status == 200 and answer == live.model.expected(0, keys).tobytes()
            status, headers, answer = reader.response()
            assert status == 400 and json.loads(answer)["error"]["kind"] == "bad_http"
            assert reader.closed()


@pytest.fixture(scope="module")
def live_h11(model_files: ModelFiles) -> Iterator[str]:
    """The app on uvicorn's h11 protocol (the server's own without httptools)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from hps.http.app import create_app

    server = HierarchicalParameterServer(model_files.config, load=False)
    app = create_app(server)
    http = server.config.http
    guard = ConnectionGuard(http.max_connections, http.header_timeout, http.body_timeout)
    thread = ServerThread(app, http=guarded_protocol(guard, H11Protocol))
    url = thread.start()
    try:
        yield url
    finally:
        thread.stop()
        server.close()


def test_the_h11_protocol_answers_the_same(live_h11: str) -> None:
    import httpx

    with httpx.Client(base_url=live_h11, timeout=30) as client:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=READY_WAIT)
    for path, v2 in ((LOOKUP, False), (INFER, True)):
        with connect(live_h11) as sock:
            sock.sendall(chunked_head(path) + b"zz\r\n")
            check_form(refused(sock), v2)


def test_two_workers_answer_the_same(live_workers: Live) -> None:
    """`hps serve --workers 2` serves through the same protocol (run_app): either
    worker answers the JSON 400."""
    # held open together: each worker accepts while it holds no more than the other
    # (hps/http/accept_share.py), so both get some
    socks = [connect(live_workers.url) for _ in range(4)]
    try:
        for sock in socks:
            sock.sendall(chunked_head(LOOKUP) + b"zz\r\n")
            check_form(refused(sock), False)
    finally:
        for sock in socks:
            sock.close()
