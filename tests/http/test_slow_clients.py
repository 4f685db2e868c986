"""Slow and idle clients against `hps serve` (a real process): header, body and
keep-alive deadlines close them; 2,000 slowloris connections leave a normal client
answered and the server's file descriptors bounded (without the deadlines, 1,100
half-header connections held 1,123 descriptors 30 s later and, under a 1,024 limit,
stopped the server answering anyone). A client that half-closes after its request is
answered on every GET route."""

from __future__ import annotations

import http.client
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hps.tools.bench.slow_clients import (
    PARTIAL_HEADER,
    Slowloris,
    open_fds,
    raise_fd_limit,
    slow_model_server,
)
from tests.http.conftest import MODEL, TABLE_NAMES, Live
from tests.support.raw_http import connect

MAX_CONNECTIONS = 128
SETTINGS = {"max_connections": MAX_CONNECTIONS, "header_timeout": 1.0, "body_timeout": 1.0,
            "keep_alive_timeout": 1.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    with slow_model_server(tmp_path_factory.mktemp("slow"), SETTINGS) as port_pid:
        yield port_pid


def closed_by_server(sock: socket.socket) -> bool:
    """Read until the server closes the connection (True); False if it sent data or the
    30 s socket timeout passed."""
    sock.settimeout(30)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_half_a_header_is_closed(server: tuple[int, int]) -> None:
    with socket.create_connection(("127.0.0.1", server[0])) as sock:
        sock.sendall(PARTIAL_HEADER)
        assert closed_by_server(sock)


def test_a_silent_connection_is_closed(server: tuple[int, int]) -> None:
    with socket.create_connection(("127.0.0.1", server[0])) as sock:
        assert closed_by_server(sock)


def test_a_slow_body_is_closed(server: tuple[int, int]) -> None:
    head = (b"POST /v1/models/slow/tables/0/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/octet-stream\r\nContent-Length: 800\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server[0])) as sock:
        sock.sendall(head + b"\0" * 8)  # 8 of 800 bytes, then nothing
        assert closed_by_server(sock)


def test_an_idle_keep_alive_connection_is_closed(server: tuple[int, int]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server[0], timeout=30)
    conn.request("GET", "/healthz")
    answer = conn.getresponse()
    assert answer.status == 200 and answer.read()
    assert conn.sock is not None
    assert closed_by_server(conn.sock)
    conn.close()


def test_slowloris_leaves_a_normal_client_answered(server: tuple[int, int]) -> None:
    port, pid = server
    raise_fd_limit(4096)
    keys = np.arange(0, 2000, 7, dtype="<i8")
    crowd = Slowloris(port, 2000)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        answered = 0
        for _ in range(40):
            try:
                conn.request("POST", "/v1/models/slow/tables/0/lookup", keys.tobytes(),
                             {"Content-Type": "application/octet-stream"})
                answer = conn.getresponse()
            except (ConnectionError, http.client.HTTPException):
                conn.close()  # an idle keep-alive connection may be closed: a new one
                conn.request("POST", "/v1/models/slow/tables/0/lookup", keys.tobytes(),
                             {"Content-Type": "application/octet-stream"})
                answer = conn.getresponse()
            rows = np.frombuffer(answer.read(), "<f4")
            assert answer.status == 200 and rows.size == keys.size * 16
            answered += 1
        fds = open_fds(pid)
        conn.close()
    finally:
        crowd.close()
    assert answered == 40
    # the listening socket, RocksDB/log files and the pool's own: a few dozen beyond
    # 2,000 connections were opened and held: the server closed all but its bound
    assert fds <= MAX_CONNECTIONS + 48, f"{fds} descriptors open"


def test_settings_are_checked(tmp_path: Path) -> None:
    from hps import ConfigError, load_config

    with pytest.raises(ConfigError, match="max_connections"):
        load_config({"models": [{"model": "m", "sparse_files": ["/x"],
                                 "embedding_vecsize_per_table": [1],
                                 "maxnum_catfeature_query_per_table_per_sample": [1]}],
                     "http": {"max_connections": 0}})


# -- clients that half-close ----------------------------------------------------------------


def _get_paths(live: Live) -> list[tuple[str, int]]:
    """(path, status expected) of every GET route the OpenAPI document lists, and the
    docs' own, with the served model's names in their parameters."""
    doc = live.client.get("/openapi.json").json()
    values = {"model": MODEL, "table": TABLE_NAMES[0], "version": "1", "job": "nope"}
    paths = [("/openapi.json", 200), ("/docs", 200)]
    for template, operations in doc["paths"].items():
        if "get" in operations:
            path = re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], template)
            paths.append((path, 404 if "{job}" in template else 200))
    return paths


def test_a_half_closed_client_gets_its_answer_on_every_get_route(live: Live) -> None:
    """A client that sends its request and shuts down its sending side (SHUT_WR, as
    some clients and proxies do) is answered, then closed (with Connection: close where
    the end came before the answer). uvicorn took the end of its input for a disconnect: /v1/models,
    /v1/models/{model} and /metrics, whose handlers wait once, answered nothing."""
    paths = _get_paths(live)
    assert len(paths) > 15
    unanswered = []
    for path, status in paths:
        with connect(live.url) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            sock.shutdown(socket.SHUT_WR)
            received = b""
            while chunk := sock.recv(1 << 16):  # to the server's close
                received += chunk
        head, _, body = received.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        if not received or lines[0].split()[1] != str(status):
            unanswered.append((path, received[:80]))
            continue
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        assert len(body) == int(headers["content-length"]), path  # whole, then closed
    assert not unanswered, unanswered


def test_a_half_closed_client_with_half_a_body_is_closed(live: Live) -> None:
    """A body that stops short and then the client's end: it can never complete, so
    the connection closes at once (as before), nothing answered."""
    head = (f"POST /v1/models/{MODEL}/tables/0/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/octet-stream\r\nContent-Length: 80\r\n\r\n").encode()
    with connect(live.url) as sock:
        sock.sendall(head + b"\0" * 8)
        sock.shutdown(socket.SHUT_WR)
        assert closed_by_server(sock)
