"""Benchmark of the HTTP lookup service beside the same keys fetched straight from Redis.

`bench_http()` builds one table (`num_keys` keys, width `dim`) and serves it two ways:

- HTTP: `hps serve` in a subprocess (its own process and GIL, as in production), the
  table in the in-process hash map tier; clients POST `batch` keys per request to the
  binary endpoint (little-endian int64 in, float32 rows out) and, separately, to the JSON
  endpoint (`{"keys": [...]}` in, `{"vectors": [[...]]}` out);
- direct Redis: the same rows in a local `redis-server` started by the bench, in
  HugeCTR's layout (`hps_et{<table>/p<N>}v` hashes, written by the Redis tier); the client
  sends a redis-py pipeline of one `HMGET` per partition hash, over byte fields prepared
  (converted and grouped by partition) outside the timing, and decodes the replies into
  float32 rows in key order.

The same client process runs `clients` threads, each with its own keep-alive connection,
each sending the same pre-drawn uniform random batches, closed loop (next request when the
answer is in). Every answer is decoded to a float32 [batch, dim] array: binary with
`np.frombuffer`, JSON with `json.loads`, Redis with `b"".join` + `np.frombuffer` + one
scatter. Answers of all three are checked against the table before timing.

The three paths take turns for `rounds` rounds of `seconds` each, after `warmup`
seconds of each; the figures are the median over rounds of requests/s and keys/s, and
p50/p99 of the per-request latencies of all rounds. The ratios to direct Redis are the
medians of the per-round ratios. Each path also reports its server's CPU time per
request answered (the serving process: `hps serve`, `redis-server` or the floor; Linux
/proc, median over rounds): keys/s and latencies move with whatever else runs on
the machine and, with 8 clients, with how much CPU the client gets (the floor is bound
by its client), while CPU per request is what a request costs the server itself.
`python -m hps.tools.bench.http` or `hps bench http` prints them.
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
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench import cpus as placement
from hps.tools.bench.bare_workers import every_worker_accepting, stop
from hps.tools.bench.cpus import cpu_seconds

MODEL = "bench"
TABLE = "table0"
STORAGE_NAME = f"hps_et.{MODEL}.{TABLE}"

#: one client's fetch of batch i → float32 [batch, dim]
Fetch = Callable[[int], np.ndarray]


def one_table_config(dim: int, batch: int, **volatile_db: Any) -> dict[str, Any]:
    """The ps.json of the benches' one model: table TABLE (a sparse folder of that name
    beside the config) of width `dim`, lookups of up to `batch` keys, no GPU cache, the
    in-process hash map with `volatile_db`'s keys."""
    return {
        "supportlonglong": True,
        "models": [{
            "model": MODEL, "sparse_files": [TABLE], "embedding_table_names": [TABLE],
            "embedding_vecsize_per_table": [dim],
            "maxnum_catfeature_query_per_table_per_sample": [batch],
            "default_value_for_each_table": [0.0], "deployed_device_list": [0],
            "max_batch_size": 1, "gpucache": False,
        }],
        "volatile_db": {"type": "hash_map", **volatile_db},
    }


#: `hps serve` as the benches start it (hps.http.serve), without the command line's
#: packages (typer, rich: the GPU machine carries only the server's); options after the
#: config as pairs: --port (required), --workers, --lookup-threads
_SERVE = """
import sys
from hps.http.serve import serve
args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
threads = args.get("--lookup-threads")
serve(sys.argv[1], port=int(args["--port"]), workers=args.get("--workers", "1"),
      lookup_threads=None if threads is None else int(threads), log_level="warning",
      echo=lambda line: print(line, flush=True))
"""


def serve_argv(config: Path, *options: str) -> list[str]:
    """The command that serves `config` as `hps serve` does, with `options` (pairs, see
    _SERVE); add "--port", N."""
    return [sys.executable, "-c", _SERVE, str(config), *options]


def print_rows(rows: list[dict[str, Any]], title: str) -> None:
    """The plain-text table of a bench module's `main`: the title, then one line a row."""
    print(f"\n{title}")
    for row in rows:
        print("  " + "; ".join(f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in row.items()))


def _free_port() -> int:
    from hps.tools.bench.redis_servers import free_port

    return free_port()


@contextlib.contextmanager
def _http_server(config: Path, port: int, lookup_threads: int | None, cpus: set[int] | None,
                 timeout: float = 300.0, pids: list[int] | None = None,
                 grpc_port: int | None = None) -> Iterator[str]:
    """`hps serve config` in a subprocess (on `cpus`); yields its URL once /readyz is 200.
    The process id is appended to `pids` when given; `grpc_port`: gRPC served there too."""
    argv = [sys.executable, "-m", "hps.tools.cli", "serve", str(config), "--port", str(port)]
    if grpc_port is not None:
        argv += ["--grpc-port", str(grpc_port)]
    if lookup_threads is not None:
        argv += ["--lookup-threads", str(lookup_threads)]
    with _subprocess_server(argv, config.parent / "serve.log", port, "/readyz", cpus,
                            timeout, pids=pids) as url:
        yield url


@contextlib.contextmanager
def _bare_server(folder: Path, port: int, dim: int, cpus: set[int] | None,
                 pids: list[int] | None = None, workers: int = 1) -> Iterator[str]:
    """The floor: `bare_asgi.app` on uvicorn, served as `hps serve` serves (`workers` > 1:
    as `hps serve --workers N` serves, bare_workers.py). The process id is appended to
    `pids` when given."""
    argv = [*_floor_argv(workers), "--port", str(port)]
    env = {"HPS_BARE_DIM": str(dim)}
    board = bare_board(folder, port)  # whose heartbeats say every worker accepts
    if workers > 1:
        env["HPS_BARE_FOLDER"] = str(board)
        board.mkdir()
    with _subprocess_server(argv, folder / "bare.log", port, "/", cpus, 60.0, env, pids,
                            (workers, lambda pid: board)) as url:
        yield url


def bare_board(folder: Path, port: int) -> Path:
    """Where the floor started by `_bare_server(folder, port, ..., workers > 1)` keeps the
    connection board of its workers."""
    return folder / f"bare-board-{port}"


def run_folders(shm: Path) -> Callable[[int], Path]:
    """Where the connection board of `hps serve --workers N` started with `HPS_SHM_DIR`
    `shm` lies, given the supervisor's process id: its run folder."""
    from hps.runtime.run_dir import PREFIX

    return lambda pid: shm / f"{PREFIX}{pid}"


def _floor_argv(workers: int = 1) -> list[str]:
    """The command line of the floor (its `--port` to be added): uvicorn with the bare
    app, or with `workers` > 1 the bare app's workers accepting as `hps serve --workers
    N` does (bare_workers.py)."""
    if workers > 1:
        return [sys.executable, "-m", "hps.tools.bench.bare_workers", "--workers", str(workers)]
    return [sys.executable, "-m", "uvicorn", "hps.tools.bench.bare_asgi:app", "--log-level",
            "warning", "--no-access-log"]


@contextlib.contextmanager
def _subprocess_server(argv: list[str], log_path: Path, port: int, ready_path: str,
                       cpus: set[int] | None, timeout: float,
                       env: dict[str, str] | None = None,
                       pids: list[int] | None = None,
                       board: tuple[int, Callable[[int], Path]] | None = None
                       ) -> Iterator[str]:
    """A server process (on `cpus`); yields host:port once GET `ready_path` answers 200
    and, with `board` (N workers, the folder of their connection board given the process
    id) and N > 1, once every worker accepts."""
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    if pids is not None:
        pids.append(proc.pid)
    placement.pin(proc.pid, cpus)
    url = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[2]} exited: " + log_path.read_text()[-2000:])
            conn = http.client.HTTPConnection(url, timeout=2)
            try:
                conn.request("GET", ready_path)
                if conn.getresponse().status == 200:
                    break
            except OSError:  # not listening yet, or a worker reset the connection
                pass
            finally:
                conn.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{argv[2]} not ready within {timeout} s")
            time.sleep(0.1)
        if board is not None and board[0] > 1:
            every_worker_accepting(board[1](proc.pid), board[0], timeout)
        yield url
    finally:
        stop(proc, 15.0)
        log.close()


# -- clients ------------------------------------------------------------------------------

#: the client every HTTP figure uses (httpx adds about 0.45 ms a request of its own)
CLIENT = "http.client, one keep-alive connection per thread (TCP_NODELAY)"
#: turns an answer (body, response) into float32 rows
Decode = Callable[[bytes, http.client.HTTPResponse], np.ndarray]


class _HTTPClient:
    """One keep-alive connection POSTing prepared bodies; `decode` turns answers to rows."""

    def __init__(self, url: str, path: str, bodies: list[bytes], headers: list[dict[str, str]],
                 decode: Decode) -> None:
        self.url = url
        self.path = path
        self.bodies = bodies
        self.headers = headers  # one per body, or one for all
        self.decode = decode
        self.conn = self._connect()

    def _connect(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.url, timeout=60)
        conn.connect()
        # http.client writes headers and body separately: without TCP_NODELAY the body
        # waits for the server's delayed ACK (redis-py and httpx set it too)
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def start_round(self) -> None:
        """A fresh connection: the server closes keep-alive connections idle for 5 s."""
        self.conn.close()
        self.conn = self._connect()

    def __call__(self, i: int) -> np.ndarray:
        self.conn.request("POST", self.path, self.bodies[i],
                          self.headers[i % len(self.headers)])
        answer = self.conn.getresponse()
        data = answer.read()
        if answer.status != 200:
            raise RuntimeError(f"{self.path} answered {answer.status}: {data[:200]!r}")
        return self.decode(data, answer)


V1_PATH = f"/v1/models/{MODEL}/tables/{TABLE}/lookup"
V2_PATH = f"/v2/models/{MODEL}/infer"
_OCTET = [{"Content-Type": "application/octet-stream"}]


def _binary_client(url: str, bodies: list[bytes], dim: int) -> _HTTPClient:
    return _HTTPClient(url, V1_PATH, bodies, _OCTET,
                       lambda data, _: np.frombuffer(data, dtype="<f4").reshape(-1, dim))


def _json_client(url: str, bodies: list[bytes]) -> _HTTPClient:
    return _HTTPClient(url, V1_PATH, bodies, [{"Content-Type": "application/json"}],
                       lambda data, _: np.asarray(json.loads(data)["vectors"],
                                                  dtype=np.float32))


def v2_body(keys: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """A binary v2 infer request for one table's keys: (body, headers)."""
    k = keys.astype("<i8").tobytes()
    head = json.dumps({"inputs": [
        {"name": "KEYS", "shape": [keys.size], "datatype": "INT64",
         "parameters": {"binary_data_size": len(k)}},
        {"name": "NUMKEYS", "shape": [1], "datatype": "INT32",
         "parameters": {"binary_data_size": 4}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    return (head + k + np.array([keys.size], "<i4").tobytes(),
            {"Inference-Header-Content-Length": str(len(head))})


def _v2_client(url: str, requests: list[tuple[bytes, dict[str, str]]], dim: int
               ) -> _HTTPClient:
    def decode(data: bytes, answer: http.client.HTTPResponse) -> np.ndarray:
        start = int(answer.getheader("Inference-Header-Content-Length") or 0)
        return np.frombuffer(data, dtype="<f4", offset=start).reshape(-1, dim)

    return _HTTPClient(url, V2_PATH, [b for b, _ in requests], [h for _, h in requests],
                       decode)


def _bare_client(url: str, bodies: list[bytes], dim: int) -> _HTTPClient:
    return _HTTPClient(url, "/", bodies, _OCTET,
                       lambda data, _: np.frombuffer(data, dtype="<f4").reshape(-1, dim))


Prepared = list[tuple[list[tuple[str, list[bytes]]], np.ndarray]]


def _prepare_hmget(queries: list[np.ndarray], num_partitions: int) -> Prepared:
    """Per query: (HMGET hash name and byte fields per partition, the rows' key order)."""
    from hps.tiers.partition import partition_of
    from hps.tiers.redis import value_hash

    names = [value_hash(STORAGE_NAME, p) for p in range(num_partitions)]
    prepared: Prepared = []
    for q in queries:
        parts = partition_of(q, num_partitions)
        order = np.argsort(parts, kind="stable")  # rows arrive grouped by partition
        grouped = q[order].astype("<i8").view("V8").tolist()
        counts = np.bincount(parts, minlength=num_partitions)
        commands, start = [], 0
        for p, n in enumerate(counts.tolist()):
            if n:
                commands.append((names[p], grouped[start:start + n]))
            start += n
        prepared.append((commands, order))
    return prepared


class _RedisHMGET:
    """One redis-py connection: pipelined HMGET per partition hash, prepared byte fields."""

    def __init__(self, address: str, prepared: Prepared, dim: int) -> None:
        import redis

        host, port = address.rsplit(":", 1)
        self.client = redis.Redis(host=host, port=int(port), single_connection_client=True)
        self.prepared = prepared
        self.dim = dim

    def start_round(self) -> None:
        """Nothing to do: redis-py keeps its connection and reconnects by itself."""

    def __call__(self, i: int) -> np.ndarray:
        commands, order = self.prepared[i]
        pipe = self.client.pipeline(transaction=False)
        for name, fields in commands:
            pipe.execute_command("HMGET", name, *fields)  # type: ignore[no-untyped-call]
        replies = pipe.execute()
        rows = np.frombuffer(b"".join(v for r in replies for v in r), dtype="<f4")
        out = np.empty((order.size, self.dim), dtype=np.float32)
        out[order] = rows.reshape(-1, self.dim)
        return out


# -- the closed-loop driver ---------------------------------------------------------------

def _drive(fetches: list[Fetch], num_queries: int, warmup: float, seconds: float,
           server_pid: int | None = None) -> tuple[int, list[float], float | None]:
    """Each fetch in its own thread, closed loop; (requests done in the window, their
    latencies, the CPU seconds process `server_pid` ran in the window, when known)."""
    start_at = time.perf_counter() + warmup
    stop_at = start_at + seconds
    latencies: list[list[float]] = [[] for _ in fetches]
    errors: list[BaseException] = []

    def client(c: int) -> None:
        i = c * 7919
        mine = latencies[c]
        try:
            while True:
                t0 = time.perf_counter()
                if t0 >= stop_at:
                    return
                fetches[c](i % num_queries)
                t1 = time.perf_counter()
                if t0 >= start_at and t1 <= stop_at:
                    mine.append(t1 - t0)
                i += 1
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(len(fetches))]
    for t in threads:
        t.start()
    cpu_before = cpu_after = None
    if server_pid is not None:  # this thread only waits: it reads the server's CPU time
        time.sleep(max(0.0, start_at - time.perf_counter()))
        cpu_before = cpu_seconds(server_pid)
        time.sleep(max(0.0, stop_at - time.perf_counter()))
        cpu_after = cpu_seconds(server_pid)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    flat = [x for lat in latencies for x in lat]
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return len(flat), flat, cpu


Round = tuple[int, list[float], float | None]


def _figures(name: str, batch: int, seconds: float, rounds: list[Round]) -> dict[str, Any]:
    rates = [n / seconds for n, _, _ in rounds]
    latencies = np.array([x for _, lat, _ in rounds for x in lat]) * 1e3
    req_s = statistics.median(rates)
    cpu = [c / n * 1e6 for n, _, c in rounds if c is not None and n]
    return {
        "path": name,
        "requests_per_s": req_s,
        "keys_per_s": req_s * batch,
        "p50_ms": float(np.percentile(latencies, 50)) if latencies.size else float("nan"),
        "p99_ms": float(np.percentile(latencies, 99)) if latencies.size else float("nan"),
        # the serving process's CPU time per request answered (median of rounds): what a
        # request costs the server, whatever share of its CPU it got from other work
        "server_cpu_us": statistics.median(cpu) if cpu else float("nan"),
    }


# -- the benchmark ------------------------------------------------------------------------

V1_BINARY, V2_BINARY, V1_JSON = "v1 binary lookup", "v2 binary infer", "v1 JSON lookup"
REDIS, FLOOR = "redis HMGET (direct)", "bare uvicorn (floor)"
GRPC, GRPC_FLOOR = "v2 gRPC infer", "bare grpcio (gRPC floor)"


def bench_http(
    num_keys: int = 1_000_000,
    dim: int = 64,
    batch: int = 1024,
    clients: int = 8,
    *,
    seconds: float = 5.0,
    warmup: float = 1.0,
    rounds: int = 3,
    num_queries: int = 512,
    num_partitions: int = 16,
    lookup_threads: int | None = None,
    pin: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """HTTP lookups (v1 binary and JSON, v2 binary infer) and v2 gRPC infer beside direct
    Redis HMGET, a bare uvicorn app answering bodies of the same size and a bare grpcio
    server answering messages of the same size; returns the figures as a dict.

    Keys: `rows` (one dict per path: requests/s, keys/s, p50/p99 ms and the server's
    CPU µs per request with `clients` clients), `single` (the same of one client alone,
    per HTTP path), the ratios of
    keys/s (medians of per-round ratios): v1 binary and v2 binary over direct Redis, and
    over the bare floor; gRPC over v2 binary and over its floor; the setup, the client
    (`CLIENT`) and the CPU count. `pin`: the
    servers run on one half of the CPUs and the clients on the other, as when they are
    different machines; the split is restored at the end.
    """
    from hps.config import VolatileDBConfig
    from hps.modelfiles.formats.sparse_folder import write_sparse_model
    from hps.tiers.redis import RedisTier
    from hps.tools.bench.grpc_paths import GrpcClient, bare_grpc_server, infer_request
    from hps.tools.bench.redis_servers import RedisServer
    from hps.tools.bench.tiers import make_table

    keys, vectors = make_table(num_keys, dim, seed=seed)
    rng = np.random.default_rng(seed + 1)
    picks = [rng.integers(0, num_keys, batch) for _ in range(num_queries)]
    queries = [keys[p] for p in picks]
    tmp = Path(tempfile.mkdtemp(prefix="hps-bench-http-"))
    split = placement.split_cpus() if pin else None
    server_cpus, client_cpus = split if split else (None, None)
    own_cpus = os.sched_getaffinity(0) if split else None
    try:
        write_sparse_model(tmp / TABLE, keys, vectors)
        config = one_table_config(dim, batch, num_partitions=num_partitions)
        (tmp / "ps.json").write_text(json.dumps(config))
        started = time.perf_counter()
        pids: list[int] = []
        grpc_port = _free_port()
        with RedisServer(tmp / "redis") as redis_server, \
                _http_server(tmp / "ps.json", _free_port(), lookup_threads,
                             server_cpus, pids=pids, grpc_port=grpc_port) as url, \
                _bare_server(tmp, _free_port(), dim, server_cpus, pids) as bare_url, \
                bare_grpc_server(tmp, _free_port(), dim, pids) as bare_grpc:
            placement.pin(pids[2], server_cpus)
            assert redis_server.proc is not None
            placement.pin(redis_server.proc.pid, server_cpus)
            placement.pin(0, client_cpus)
            tier = RedisTier(VolatileDBConfig.model_validate({
                "type": "redis_cluster", "address": redis_server.address,
                "num_partitions": num_partitions, "socket_timeout": 30.0}))
            tier.create_table(STORAGE_NAME, dim)
            step = 1 << 17
            for a in range(0, num_keys, step):
                tier.insert(STORAGE_NAME, keys[a:a + step], vectors[a:a + step])
            tier.close()
            setup_s = time.perf_counter() - started

            binary = [q.astype("<i8").tobytes() for q in queries]
            as_json = [json.dumps({"keys": q.tolist()}).encode() for q in queries]
            as_v2 = [v2_body(q) for q in queries]
            hmget = _prepare_hmget(queries, num_partitions)
            as_grpc = [infer_request(MODEL, q) for q in queries]
            makers: dict[str, Callable[[], Any]] = {
                V1_BINARY: lambda: _binary_client(url, binary, dim),
                V2_BINARY: lambda: _v2_client(url, as_v2, dim),
                V1_JSON: lambda: _json_client(url, as_json),
                REDIS: lambda: _RedisHMGET(redis_server.address, hmget, dim),
                FLOOR: lambda: _bare_client(bare_url, binary, dim),
                GRPC: lambda: GrpcClient(f"127.0.0.1:{grpc_port}", as_grpc, dim),
                GRPC_FLOOR: lambda: GrpcClient(bare_grpc, as_grpc, dim),
            }
            fetches = {name: [make() for _ in range(clients)] for name, make in makers.items()}
            serving = {V1_BINARY: pids[0], V2_BINARY: pids[0], V1_JSON: pids[0],
                       REDIS: redis_server.proc.pid, FLOOR: pids[1], GRPC: pids[0],
                       GRPC_FLOOR: pids[2]}
            for name, per_client in fetches.items():  # same answers, checked before timing
                for i in (0, 1):
                    got = per_client[0](i)
                    floor = name in (FLOOR, GRPC_FLOOR)
                    want = np.zeros_like(got) if floor else vectors[picks[i]]
                    if got.shape != (batch, dim) or not np.array_equal(got, want):
                        raise AssertionError(f"{name} answered wrong vectors")
            results: dict[str, list[Round]] = {n: [] for n in fetches}
            single: dict[str, list[Round]] = {
                n: [] for n in (V1_BINARY, V2_BINARY, FLOOR, GRPC, GRPC_FLOOR)}
            for _ in range(rounds):
                for name, per_client in fetches.items():
                    for client in per_client:
                        client.start_round()
                    results[name].append(_drive(per_client, num_queries, warmup, seconds,
                                                serving[name]))
                for name in single:  # one client alone: the latency of one request
                    fetches[name][0].start_round()
                    single[name].append(_drive(fetches[name][:1], num_queries, warmup,
                                               seconds, serving[name]))
    finally:
        placement.pin(0, own_cpus)
        shutil.rmtree(tmp, ignore_errors=True)

    rows = [_figures(name, batch, seconds, r) for name, r in results.items()]

    def ratio(path: str, base: str) -> float:
        # median of the per-round ratios: the paths of one round ran back to back, so a
        # busy spell of the machine hits both sides of a ratio alike
        return statistics.median(a[0] / max(b[0], 1)
                                 for a, b in zip(results[path], results[base], strict=True))

    return {
        "rows": rows,
        "single": [_figures(name, batch, seconds, r) for name, r in single.items()],
        "ratios": {
            "v1 binary / redis": ratio(V1_BINARY, REDIS),
            "v2 binary / redis": ratio(V2_BINARY, REDIS),
            "v1 JSON / redis": ratio(V1_JSON, REDIS),
            "v1 binary / bare floor": ratio(V1_BINARY, FLOOR),
            "v2 binary / bare floor": ratio(V2_BINARY, FLOOR),
            "grpc / v2 binary": ratio(GRPC, V2_BINARY),
            "grpc / grpc floor": ratio(GRPC, GRPC_FLOOR),
        },
        "latencies_ms": {name: [x * 1e3 for _, lat, _ in r for x in lat]
                         for name, r in {**results,
                                         **{f"{n}, 1 client": v for n, v in single.items()}
                                         }.items()},
        "client": CLIENT,
        "num_keys": num_keys, "dim": dim, "batch": batch, "clients": clients,
        "seconds": seconds, "rounds": rounds, "cpus": os.cpu_count(),
        "lookup_threads": lookup_threads,
        "pinned": f"servers on CPUs {sorted(server_cpus)}, clients on {sorted(client_cpus)}"
        if server_cpus and client_cpus else "no",
        "setup_s": setup_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lookup-threads", type=int, default=None)
    parser.add_argument("--no-pin", action="store_true")
    args = parser.parse_args(argv)
    result = bench_http(args.keys, args.dim, args.batch, args.clients,
                        seconds=args.seconds, rounds=args.rounds,
                        lookup_threads=args.lookup_threads, pin=not args.no_pin)
    result.pop("latencies_ms")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
