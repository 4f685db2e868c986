"""Direct answers (hps/http/direct.py): lookups answered by the HTTP protocol itself say
exactly what the ASGI path says, keep a connection's order, and hand a request to the
ASGI path whenever it needs one. Raw sockets to a real uvicorn server."""

from __future__ import annotations

import json
import socket
import time

import numpy as np

from tests.http.conftest import MODEL, Live

LOOKUP = f"/v1/models/{MODEL}/tables/items/lookup"
LOOKUP_ROUTE = "/v1/models/{model}/tables/{table}/lookup"


def _connect(live: Live) -> socket.socket:
    host, port = live.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _request(path: str, body: bytes, headers: dict[str, str] | None = None,
             version: str = "1.1", chunked: bool = False) -> bytes:
    lines = [f"POST {path} HTTP/{version}", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in (headers or {
        "Content-Type": "application/octet-stream"}).items()]
    if chunked:  # no Content-Length: the ASGI path reads it
        lines.append("Transfer-Encoding: chunked")
        payload = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    else:
        lines.append(f"Content-Length: {len(body)}")
        payload = body
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class _Reader:
    """Reads whole HTTP responses (Content-Length framed) off a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(1 << 20)
        self.buffer += chunk
        return bool(chunk)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(), "connection closed before a response"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            assert name.lower() not in headers, f"header {name} twice"
            headers[name.lower()] = value.strip()
        size = int(headers["content-length"])
        while len(self.buffer) < size:
            assert self._fill(), "connection closed inside a body"
        body, self.buffer = self.buffer[:size], self.buffer[size:]
        return int(status_line.split()[1]), headers, body

    def closed(self) -> bool:
        """Whether the server closed the connection (nothing more comes)."""
        return not self.buffer and not self._fill()


def _keys(live: Live, rng: np.random.Generator) -> tuple[bytes, np.ndarray]:
    keys = live.model.sample_keys(rng, 1, 37, unknown=3)  # 40 keys, 3 unknown
    return keys.astype("<i8").tobytes(), live.model.expected(1, keys)


def test_direct_and_asgi_answers_are_the_same(live: Live, rng: np.random.Generator) -> None:
    """The same requests, once with a Content-Length (answered directly) and once chunked
    (answered by the ASGI path), get the same status, headers and body: lookups, a v2
    infer, and errors of each protocol."""
    body, expected = _keys(live, rng)
    infer_head = json.dumps({"inputs": [
        {"name": "KEYS", "shape": [40], "datatype": "INT64",
         "parameters": {"binary_data_size": len(body)}},
        {"name": "NUMKEYS", "shape": [2], "datatype": "INT32",
         "parameters": {"binary_data_size": 8}}],
        "parameters": {"binary_data_output": True}}).encode()
    infer = infer_head + body + np.array([0, 40], "<i4").tobytes()
    cases = [
        (LOOKUP, body, None),
        (f"/v1/models/{MODEL}/tables/nope/lookup", body, None),  # 404
        (LOOKUP, body[:-1], None),  # 400: not whole keys
        (LOOKUP, body, {"Content-Type": "text/plain"}),  # 415
        (f"/v2/models/{MODEL}/infer", infer,
         {"Inference-Header-Content-Length": str(len(infer_head))}),
        (f"/v2/models/{MODEL}/infer", infer[:-4],
         {"Inference-Header-Content-Length": str(len(infer_head))}),  # 400, v2's form
    ]
    sock = _connect(live)
    reader = _Reader(sock)
    statuses: list[int] = []
    for path, payload, headers in cases:
        direct_before = live.app.hot_routes.answered_directly
        sock.sendall(_request(path, payload, headers))
        direct = reader.response()
        assert live.app.hot_routes.answered_directly == direct_before + 1, path
        sock.sendall(_request(path, payload, headers, chunked=True))
        asgi = reader.response()
        assert live.app.hot_routes.answered_directly == direct_before + 1, path
        assert direct[0] == asgi[0] and direct[2] == asgi[2], (path, direct, asgi)
        statuses.append(direct[0])
        without_date = [{k: v for k, v in a[1].items() if k != "date"} for a in (direct, asgi)]
        assert without_date[0] == without_date[1], path
    sock.close()
    assert statuses == [200, 404, 400, 415, 200, 400]
    sock = _connect(live)  # the first case's answer holds the vectors due
    sock.sendall(_request(LOOKUP, body))
    status, headers, answer = _Reader(sock).response()
    sock.close()
    assert status == 200 and headers["x-hps-keys"] == "40"
    np.testing.assert_array_equal(np.frombuffer(answer, "<f4").reshape(40, -1), expected)


def test_pipelined_requests_are_answered_in_order(live: Live, rng: np.random.Generator
                                                  ) -> None:
    """Requests sent back to back in one write are answered one after another, in their
    order, whether answered directly or by the ASGI path (a chunked one in the middle)."""
    bodies = [_keys(live, rng) for _ in range(4)]
    sock = _connect(live)
    sock.sendall(_request(LOOKUP, bodies[0][0])
                 + _request(LOOKUP, bodies[1][0], chunked=True)
                 + _request(LOOKUP, bodies[2][0])
                 + _request(f"/v1/models/{MODEL}/tables/nope/lookup", bodies[3][0]))
    reader = _Reader(sock)
    for _, expected in bodies[:3]:
        status, _, answer = reader.response()
        assert status == 200
        np.testing.assert_array_equal(np.frombuffer(answer, "<f4").reshape(40, -1), expected)
    status, _, answer = reader.response()
    assert status == 404 and "nope" in json.loads(answer)["error"]["message"]
    sock.close()


def test_a_body_in_parts_and_closing_requests(live: Live, rng: np.random.Generator) -> None:
    """A request whose headers and body come in several reads is answered directly once
    the last part is in; `Connection: close` and HTTP/1.0 requests are answered and the
    connection closed."""
    body, expected = _keys(live, rng)
    sock = _connect(live)
    request = _request(LOOKUP, body)
    direct_before = live.app.hot_routes.answered_directly
    for part in (request[:-len(body)], request[-len(body):-100], request[-100:]):
        sock.sendall(part)  # headers, then the body in two parts
        time.sleep(0.1)  # each read alone
    status, _, answer = _Reader(sock).response()
    assert status == 200 and live.app.hot_routes.answered_directly == direct_before + 1
    np.testing.assert_array_equal(np.frombuffer(answer, "<f4").reshape(40, -1), expected)
    sock.close()

    for request in (_request(LOOKUP, body, {"Content-Type": "application/octet-stream",
                                            "Connection": "close"}),
                    _request(LOOKUP, body, version="1.0")):
        sock = _connect(live)
        sock.sendall(request)
        reader = _Reader(sock)
        status, headers, answer = reader.response()
        assert status == 200 and headers["connection"] == "close"
        np.testing.assert_array_equal(np.frombuffer(answer, "<f4").reshape(40, -1),
                                      expected)
        assert reader.closed()
        sock.close()


def test_direct_answers_are_counted(live: Live, rng: np.random.Generator) -> None:
    """Direct answers count in the request metrics by route and status."""
    body, _ = _keys(live, rng)
    before = {code: live.metric("hps_http_requests_total", route=LOOKUP_ROUTE,
                                method="POST", code=code) for code in ("200", "404")}
    direct_before = live.app.hot_routes.answered_directly
    sock = _connect(live)
    sock.sendall(_request(LOOKUP, body) * 3
                 + _request(f"/v1/models/{MODEL}/tables/nope/lookup", body))
    reader = _Reader(sock)
    assert [reader.response()[0] for _ in range(4)] == [200, 200, 200, 404]
    sock.close()
    assert live.app.hot_routes.answered_directly == direct_before + 4
    assert live.metric("hps_http_requests_total", route=LOOKUP_ROUTE, method="POST",
                       code="200") == before["200"] + 3
    assert live.metric("hps_http_requests_total", route=LOOKUP_ROUTE, method="POST",
                       code="404") == before["404"] + 1
