"""The load-test client of hps/tools/bench/raw_http.py against a real HTTP server on
loopback (the standard library's): statuses, Retry-After, bodies larger than one read,
keep-alive, and a server that closes the connection."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hps.tools.bench.raw_http import RawConnection, prepare


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless an answer says otherwise
    connections: set[tuple[str, int]] = set()  # the clients' (host, port)

    def do_POST(self) -> None:  # noqa: N802 - the standard library's name
        _Handler.connections.add(self.client_address)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/shed":
            self._answer(503, b'{"error":"overloaded"}', {"Retry-After": "3"})
        elif self.path == "/close":
            self._answer(200, b"bye", {"Connection": "close"})
        else:  # echo the body 1,000 times: an answer that takes many reads
            self._answer(200, body * 1000, {"X-Deadline-Seen": self.headers["X-Deadline"]})

    def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, int]]:
    _Handler.connections.clear()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield "127.0.0.1", httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_answers_over_one_keep_alive_connection(server: tuple[str, int]) -> None:
    host, port = server
    conn = RawConnection(host, port)
    echo = prepare(f"{host}:{port}", "/echo", b"0123456789abcdef", {"X-Deadline": "10"})
    shed = prepare(f"{host}:{port}", "/shed", b"", {})
    first = conn.exchange(echo)
    assert first.status == 200 and first.retry_after is None
    assert first.body == b"0123456789abcdef" * 1000
    refused = conn.exchange(shed)
    assert refused.status == 503 and refused.retry_after == "3"
    assert refused.body == b'{"error":"overloaded"}'
    assert conn.exchange(echo).body == first.body
    assert len(_Handler.connections) == 1  # one connection served all three
    conn.close()


def test_a_connection_the_server_closes_is_opened_again(server: tuple[str, int]) -> None:
    host, port = server
    conn = RawConnection(host, port)
    closing = conn.exchange(prepare(f"{host}:{port}", "/close", b"x", {}))
    assert closing.status == 200 and closing.body == b"bye"
    assert conn.sock is None  # the answer said Connection: close
    again = conn.exchange(prepare(f"{host}:{port}", "/echo", b"y", {"X-Deadline": "1"}))
    assert again.status == 200 and again.body == b"y" * 1000
    assert len(_Handler.connections) == 2
    conn.close()


def test_a_server_that_is_gone_raises_oserror() -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    conn = RawConnection("127.0.0.1", port, timeout=2)
    with pytest.raises(OSError):
        conn.exchange(prepare(f"127.0.0.1:{port}", "/echo", b"", {}))
    assert conn.sock is None
