"""A lean HTTP/1.1 client for load tests: prepared request bytes over one keep-alive socket.

`http.client` parses every answer's headers through `email.parser` and writes a request in
several pieces; on the 2-core machine, where the client processes of a load test share the
cores with the server, that client CPU is taken from the server being measured (140-190
µs a request, nearly what the server spends on it; this client 40-55 µs). This client sends a
request prepared once (`prepare`) in one `sendall` and reads back the status line, the
two headers a load test reads (`Content-Length`, `Retry-After`) and the body, so the
figures say more about the server and less about the client. It reads what `hps serve`
and uvicorn send (a `Content-Length` on every answer); a `Connection: close` answer
closes the socket, and the next request opens a new one.
"""

from __future__ import annotations

import socket

_HEADER_END = b"\r\n\r\n"


def prepare(host: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    """The bytes of one POST of `body` to `path` with `headers`, ready to send as is."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Answer:
    """One answer: `status`, `retry_after` (the header's text or None), `body`."""

    __slots__ = ("status", "retry_after", "body")

    def __init__(self, status: int, retry_after: str | None, body: bytes) -> None:
        self.status = status
        self.retry_after = retry_after
        self.body = body


class RawConnection:
    """One keep-alive connection to `host:port` (TCP_NODELAY); `exchange` sends prepared
    request bytes and returns the `Answer`. Raises OSError when the connection fails (the
    caller opens a new one by calling again: a closed connection reconnects)."""

    def __init__(self, host: str, port: int, timeout: float = 30.0) -> None:
        self.address = (host, port)
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self._pending = b""  # bytes read past the last answer (none expected)

    def _open(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self._pending = sock, b""
        return sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def exchange(self, request: bytes) -> Answer:
        sock = self.sock or self._open()
        try:
            sock.sendall(request)
            return self._read(sock)
        except OSError:
            self.close()
            raise

    def _read(self, sock: socket.socket) -> Answer:
        data = self._pending
        end = data.find(_HEADER_END)
        while end < 0:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("the server closed the connection mid-answer")
            data += chunk
            end = data.find(_HEADER_END)
        head = data[:end].lower()
        status = int(head[9:12])
        length = int(_header(head, b"content-length") or 0)
        body_start = end + 4
        missing = body_start + length - len(data)
        if missing > 0:
            rest = bytearray(missing)
            view = memoryview(rest)
            got = 0
            while got < missing:
                n = sock.recv_into(view[got:])
                if not n:
                    raise ConnectionResetError("the server closed the connection mid-body")
                got += n
            body, self._pending = data[body_start:] + bytes(rest), b""
        else:
            body = data[body_start:body_start + length]
            self._pending = data[body_start + length:]
        retry_after = _header(head, b"retry-after")
        if _header(head, b"connection") == b"close":
            self.close()
        return Answer(status, None if retry_after is None else retry_after.decode(), body)


def _header(head: bytes, name: bytes) -> bytes | None:
    """The value of header `name` in the lower-cased header block `head`, or None."""
    at = head.find(b"\r\n" + name + b":")
    if at < 0:
        return None
    start = at + len(name) + 3
    stop = head.find(b"\r\n", start)
    return head[start:stop if stop >= 0 else len(head)].strip()
