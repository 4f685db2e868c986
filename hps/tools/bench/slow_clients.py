"""Slow clients against `hps serve`: a normal client's latency beside a slowloris crowd.

`bench_slowloris()` serves a small table with `hps serve` in a subprocess (its own
process, as in production) and times a normal client (one keep-alive connection, binary
lookups of `batch` keys, closed loop) first alone, then while `connections` other
connections each send half a request header and wait (slowloris), reconnecting when the
server closes them. It prints p50/p99 of both phases, their ratio, and the server's open
file descriptors during the attack: the server closes the connections that wait longest
on their client once it holds `max_connections`, and any whose headers take longer than
`header_timeout`, so the normal client is answered and the descriptors stay bounded.

`python -m hps.tools.bench.slow_clients` or `hps bench slowloris` prints them.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import resource
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

#: what a slowloris client sends, and then nothing more
PARTIAL_HEADER = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's soft descriptor limit towards `wanted`; returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(max(soft, wanted), hard) if hard != resource.RLIM_INFINITY else max(soft,
                                                                                      wanted)
    if target != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def open_fds(pid: int) -> int:
    """Open file descriptors of process `pid` (Linux /proc)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


class Slowloris:
    """`count` connections to `port` that send half a header and wait, reopened when the
    server closes them, from a process of their own (so that they take none of the
    measuring process's time), until `close()`."""

    def __init__(self, port: int, count: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._ready = ctx.Event()
        self._reopened = ctx.Value("q", 0)
        self._proc = ctx.Process(target=_crowd, name="slowloris", daemon=True,
                                 args=(port, count, self._stop, self._ready, self._reopened))
        self._proc.start()
        if not self._ready.wait(120):
            self.close()
            raise RuntimeError(f"the slowloris process did not open {count} connections")

    @property
    def reopened(self) -> int:
        """Connections the server closed and the crowd opened again."""
        return int(self._reopened.value)

    def close(self) -> None:
        self._stop.set()
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def _crowd(port: int, count: int, stop: Any, ready: Any, reopened: Any) -> None:
    raise_fd_limit(count + 64)

    def connect() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        with contextlib.suppress(OSError):  # closed at once when the server is full
            sock.sendall(PARTIAL_HEADER)
        sock.setblocking(False)
        return sock

    socks = [connect() for _ in range(count)]
    ready.set()
    while not stop.wait(0.2):
        for i, sock in enumerate(socks):
            try:
                closed = sock.recv(1) == b""
            except BlockingIOError:
                closed = False
            except OSError:
                closed = True
            if closed and not stop.is_set():
                sock.close()
                with contextlib.suppress(OSError):
                    socks[i] = connect()
                    with reopened.get_lock():
                        reopened.value += 1
    for sock in socks:
        sock.close()


def _latencies(port: int, body: bytes, requests: int) -> np.ndarray:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/octet-stream"}
    out = np.empty(requests)
    try:
        for i in range(requests):
            started = time.perf_counter()
            try:
                conn.request("POST", "/v1/models/slow/tables/0/lookup", body, headers)
                answer = conn.getresponse()
            except (ConnectionError, http.client.HTTPException):
                conn.close()  # the server closed the idle keep-alive connection: reconnect
                conn.request("POST", "/v1/models/slow/tables/0/lookup", body, headers)
                answer = conn.getresponse()
            answer.read()
            if answer.status != 200:
                raise RuntimeError(f"lookup answered {answer.status}")
            out[i] = time.perf_counter() - started
    finally:
        conn.close()
    return out


@contextlib.contextmanager
def slow_model_server(folder: Path, http_settings: dict[str, Any] | None = None,
                      num_keys: int = 10_000, dim: int = 16) -> Iterator[tuple[int, int]]:
    """`hps serve` over a table of `num_keys` keys (model "slow") with `http_settings`
    (the config's `http` block); yields (port, server pid) once it is ready."""
    from hps.modelfiles.formats.sparse_folder import write_sparse_model
    from hps.tools.bench.http import _free_port, _http_server

    keys = np.arange(num_keys, dtype=np.int64)
    vectors = np.random.default_rng(0).standard_normal((num_keys, dim)).astype(np.float32)
    write_sparse_model(folder / "table0", keys, vectors)
    config = {
        "models": [{"model": "slow", "sparse_files": [str(folder / "table0")],
                    "embedding_vecsize_per_table": [dim],
                    "maxnum_catfeature_query_per_table_per_sample": [64],
                    "max_batch_size": 1024, "gpucache": False,
                    "deployed_device_list": [0]}],
        "http": http_settings or {},
    }
    path = folder / "ps.json"
    path.write_text(json.dumps(config))
    port = _free_port()
    pids: list[int] = []
    with _http_server(path, port, 2, None, pids=pids):
        yield port, pids[0]


def bench_slowloris(connections: int = 2000, requests: int = 500, batch: int = 256,
                    max_connections: int = 512) -> dict[str, Any]:
    """Normal-client latency alone and under `connections` slowloris connections."""
    raise_fd_limit(connections + 256)
    body = np.arange(batch, dtype="<i8").tobytes()
    with tempfile.TemporaryDirectory(prefix="hps-bench-slow-") as tmp, \
            slow_model_server(Path(tmp), {"max_connections": max_connections}) as (port, pid):
        _latencies(port, body, 50)  # warm-up
        alone = _latencies(port, body, requests)
        fds_idle = open_fds(pid)
        crowd = Slowloris(port, connections)
        try:
            attacked = _latencies(port, body, requests)
            fds_attacked = open_fds(pid)
        finally:
            crowd.close()
    result = {
        "connections": connections, "max_connections": max_connections,
        "alone_p50_ms": 1e3 * float(np.percentile(alone, 50)),
        "alone_p99_ms": 1e3 * float(np.percentile(alone, 99)),
        "attacked_p50_ms": 1e3 * float(np.percentile(attacked, 50)),
        "attacked_p99_ms": 1e3 * float(np.percentile(attacked, 99)),
        "server_fds_idle": fds_idle, "server_fds_attacked": fds_attacked,
        "slow_connections_reopened": crowd.reopened,
    }
    result["p99_ratio"] = result["attacked_p99_ms"] / result["alone_p99_ms"]
    return result


def print_result(r: dict[str, Any]) -> None:
    print(f"normal client, {r['connections']:,} slowloris connections "
          f"(server limit {r['max_connections']:,}):")
    print(f"  alone:     p50 {r['alone_p50_ms']:.2f} ms, p99 {r['alone_p99_ms']:.2f} ms")
    print(f"  attacked:  p50 {r['attacked_p50_ms']:.2f} ms, p99 {r['attacked_p99_ms']:.2f} ms"
          f"  ({r['p99_ratio']:.2f}× the p99 alone)")
    print(f"  server file descriptors: {r['server_fds_idle']} idle, "
          f"{r['server_fds_attacked']} under attack; slow connections the server closed "
          f"and the attacker reopened: {r['slow_connections_reopened']:,}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--max-connections", type=int, default=512)
    args = parser.parse_args(argv)
    print_result(bench_slowloris(args.connections, args.requests,
                                 max_connections=args.max_connections))


if __name__ == "__main__":
    main()
