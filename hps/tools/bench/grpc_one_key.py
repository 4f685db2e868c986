"""1-key latency of the v2 protocol over gRPC beside HTTP, each with its floor: what the
issue's "1 key p50 <= the HTTP route's" is measured with.

    python -m hps.tools.bench.grpc_one_key --variants sync,sync-latency --tritonclient

`one_key` times 1-key requests with the lightest client of each protocol, each path's
client in a process of its own, the paths taking turns for `--rounds` rounds of
`--seconds` (after 200 calls of warm-up each), one path at a time:

- `v2 binary infer (HTTP)`: `hps serve`'s v2 route; http.client, one keep-alive
  connection (TCP_NODELAY), a binary request body built before timing;
- `v2 gRPC infer`: the same server's gRPC service; `grpc.Channel.unary_unary` with no
  (de)serialisers, a ModelInferRequest serialised before timing;
- `bare uvicorn (HTTP floor)`: `bare_asgi` on uvicorn, the same client as HTTP;
- `bare grpcio <variant> (gRPC floor)`: the floor of `grpc_paths.py` in each
  `--variants` server form, the same client as gRPC;
- with `--tritonclient`, `tritonclient.grpc` (`InferenceServerClient.infer`) against
  the service, for what a user's client adds.

It prints p50 and p99 of all rounds per path, each round's p50 (the spread) and the
median of the per-round ratios of gRPC to HTTP and of each gRPC floor to HTTP (the
rounds ran back to back, so a busy spell of the machine hits both alike).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from hps.modelfiles.formats.sparse_folder import write_sparse_model
from hps.tools.bench.grpc_paths import METHOD, bare_grpc_server, infer_request
from hps.tools.bench.http import (
    MODEL,
    TABLE,
    V2_PATH,
    _bare_server,
    _free_port,
    _http_server,
    one_table_config,
    v2_body,
)
from hps.tools.bench.tiers import make_table

HTTP, GRPC, HTTP_FLOOR = "v2 binary infer (HTTP)", "v2 gRPC infer", "bare uvicorn (HTTP floor)"
TRITONCLIENT = "v2 gRPC infer, tritonclient.grpc"


def grpc_floor(variant: str) -> str:
    """The name of the gRPC floor `variant`'s path."""
    return f"bare grpcio {variant} (gRPC floor)"


def _one_call(kind: str, address: str, key: int) -> Callable[[], object]:
    """One request of `key` to `address` by the client `kind`: http (the v2 route),
    bare (the HTTP floor), grpc (raw unary_unary) or tritonclient."""
    keys = np.array([key], dtype=np.int64)
    if kind == "grpc":
        call = grpc.insecure_channel(address).unary_unary(METHOD)
        request = infer_request(MODEL, keys)
        return lambda: call(request, timeout=60)
    if kind == "tritonclient":
        import tritonclient.grpc as triton

        client = triton.InferenceServerClient(address)
        inputs = [triton.InferInput("KEYS", [1], "INT64"),
                  triton.InferInput("NUMKEYS", [1], "INT32")]
        inputs[0].set_data_from_numpy(keys)
        inputs[1].set_data_from_numpy(np.array([1], np.int32))
        return lambda: client.infer(MODEL, inputs)
    body, headers = v2_body(keys) if kind == "http" else (
        keys.astype("<i8").tobytes(), {"Content-Type": "application/octet-stream"})
    path = V2_PATH if kind == "http" else "/"
    conn = http.client.HTTPConnection(address, timeout=60)
    conn.connect()
    assert conn.sock is not None  # without TCP_NODELAY the body waits for a delayed ACK
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def post() -> bytes:
        conn.request("POST", path, body, headers)
        answer = conn.getresponse()
        data = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"{path} answered {answer.status}: {data[:200]!r}")
        return data
    return post


def _client(kind: str, address: str, key: int) -> None:
    """A client process: for each `run SECONDS` line on stdin, a fresh connection (a
    server closes one idle for 5 s), 200 calls of warm-up and then calls for SECONDS;
    prints their latencies (s) as one JSON line."""
    for line in sys.stdin:
        seconds = float(line.split()[1])
        call = _one_call(kind, address, key)
        for _ in range(200):
            call()
        latencies = []
        ends = time.perf_counter() + seconds
        while (started := time.perf_counter()) < ends:
            call()
            latencies.append(time.perf_counter() - started)
        print(json.dumps(latencies), flush=True)


def one_key(variants: list[str], rounds: int = 5, seconds: float = 1.5,
            tritonclient: bool = False, num_keys: int = 100_000, dim: int = 64
            ) -> dict[str, Any]:
    """1-key latencies of every path (see the module), the paths taking turns."""
    keys, vectors = make_table(num_keys, dim, seed=0)
    key = int(keys[num_keys // 2])
    tmp = Path(tempfile.mkdtemp(prefix="hps-bench-grpc-"))
    clients: dict[str, subprocess.Popen[str]] = {}
    try:
        write_sparse_model(tmp / TABLE, keys, vectors)
        (tmp / "ps.json").write_text(json.dumps(one_table_config(dim, 1024)))
        grpc_port = _free_port()
        with contextlib.ExitStack() as stack:
            pids: list[int] = []
            url = stack.enter_context(_http_server(tmp / "ps.json", _free_port(), None,
                                                   None, grpc_port=grpc_port))
            where = {HTTP: ("http", url), GRPC: ("grpc", f"127.0.0.1:{grpc_port}"),
                     HTTP_FLOOR: ("bare", stack.enter_context(
                         _bare_server(tmp, _free_port(), dim, None)))}
            for variant in variants:
                where[grpc_floor(variant)] = ("grpc", stack.enter_context(
                    bare_grpc_server(tmp, _free_port(), dim, pids, variant)))
            if tritonclient:
                where[TRITONCLIENT] = ("tritonclient", f"127.0.0.1:{grpc_port}")
            for name, (kind, address) in where.items():
                clients[name] = subprocess.Popen(
                    [sys.executable, "-m", "hps.tools.bench.grpc_one_key", "--client", kind,
                     address, str(key)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    text=True)
            latencies: dict[str, list[list[float]]] = {name: [] for name in clients}
            for _ in range(rounds):
                for name, proc in clients.items():
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(f"run {seconds}\n")
                    proc.stdin.flush()
                    line = proc.stdout.readline()
                    if not line:
                        raise RuntimeError(f"the client of {name} exited (status "
                                           f"{proc.wait()})")
                    latencies[name].append(json.loads(line))
    finally:
        for proc in clients.values():
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return _one_key_figures(latencies, variants, rounds, seconds)


def _one_key_figures(latencies: dict[str, list[list[float]]], variants: list[str],
                     rounds: int, seconds: float) -> dict[str, Any]:
    def p50(lat: list[float]) -> float:
        return float(np.percentile(lat, 50)) * 1e3

    rows = {name: {"p50_ms": p50([x for r in runs for x in r]),
                   "p99_ms": float(np.percentile([x for r in runs for x in r], 99)) * 1e3,
                   "round_p50_ms": [round(p50(r), 3) for r in runs],
                   "calls": sum(len(r) for r in runs)}
            for name, runs in latencies.items()}

    def ratio(path: str) -> float:  # median of the per-round ratios of p50 to HTTP's
        return statistics.median(p50(a) / p50(b) for a, b in
                                 zip(latencies[path], latencies[HTTP], strict=True))

    ratios = {f"{GRPC} / HTTP": ratio(GRPC)}
    ratios.update({f"{grpc_floor(v)} / HTTP": ratio(grpc_floor(v)) for v in variants})
    return {"paths": rows, "p50_ratios": ratios, "rounds": rounds, "seconds": seconds,
            "cpus": os.cpu_count(), "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="sync",
                        help="comma list of the gRPC floor's server forms")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--tritonclient", action="store_true",
                        help="also time tritonclient.grpc against the service")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--client", nargs=3, metavar=("KIND", "ADDRESS", "KEY"),
                        help=argparse.SUPPRESS)  # a client process of one_key
    args = parser.parse_args(argv)
    if args.client:
        _client(args.client[0], args.client[1], int(args.client[2]))
    else:
        print(json.dumps(one_key(args.variants.split(","), args.rounds, args.seconds,
                                 args.tritonclient, dim=args.dim), indent=2))


if __name__ == "__main__":
    main()
