"""Raw HTTP/1.1 over a socket for the server tests that need what a client library
hides: a request sent in parts, pipelined requests, a connection's own fate after an
answer. Answers are read whole (Content-Length framed)."""

from __future__ import annotations

import socket


def connect(url: str) -> socket.socket:
    """A TCP_NODELAY connection to the server at `url` (http://host:port)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def raw_request(path: str, body: bytes, headers: dict[str, str] | None = None,
                version: str = "1.1", chunked: bool = False, host: str = "127.0.0.1"
                ) -> bytes:
    """The bytes of one POST of `body` to `path` (binary lookups' content type unless
    `headers` are given) for `host`, framed by Content-Length or, `chunked`, in one
    chunk."""
    lines = [f"POST {path} HTTP/{version}", f"Host: {host}"]
    lines += [f"{k}: {v}" for k, v in (headers or {
        "Content-Type": "application/octet-stream"}).items()]
    if chunked:  # no Content-Length: the ASGI path reads it
        lines.append("Transfer-Encoding: chunked")
        payload = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    else:
        lines.append(f"Content-Length: {len(body)}")
        payload = body
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class ResponseReader:
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
