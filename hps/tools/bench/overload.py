"""Overload: many client processes against one `hps serve`, beside its own peak.

`bench_overload()` serves one table (`num_keys` keys, width `dim`, from `tier`: the
in-process hash map, or RocksDB alone as the persistent tier with no volatile one,
`lookup_threads` lookup threads, so lookups pass the server's admission rule,
hps/http/admission.py) with `hps serve` in a subprocess, then runs closed-loop client
*processes* (one keep-alive connection each, binary v1 lookups of `batch` keys, each
request carrying `X-HPS-Deadline-Ms: deadline_ms` unless 0) at every client count of
`levels`, one level after the other in the same run, `seconds` each after `warmup`. The
last level (the overload) runs once per client behaviour of `backoffs`. The client of
each process is `raw` (prepared request bytes on a socket: hps/tools/bench/raw_http.py)
or `http.client`, which on the 2-core machine takes the server measured about three
times the CPU per request (both printed per level: `client_cpu_us`, `server_cpu_us`).
At the end the server's own counters say how many keys each tier served
(`keys_by_tier`), so the figures are known to be the tier's.

What a client does after a 503: `None` honours `Retry-After` (waits the seconds it says,
as a well-behaved client of a shedding server does: urllib3's Retry, the gRPC and AWS
SDKs' retry policies); a number waits that many seconds instead (a client that comes
back at once keeps the load on the server whatever it says). After a 504 (its deadline
passed) a client goes on at once, as after a 200.

Per level: requests served (200) per second, p50 and p99 of the served requests'
latencies, requests shed (503) and expired (504), and any other answer (none expected).
The peak is the highest served rate of the levels below the last; the last level's served
rate over that peak is the figure of merit (>= 0.9 wanted), beside its p99 (<= 10 ms
wanted). Other work on the machine moves these figures: run it on a quiet machine, and
say when it was not. Even a quiet 2-core machine moves one level's rate by a tenth from
run to run, so `rounds` runs every level again (the same server) and the summary is the
round of the median ratio, with every round's beside it. `python -m hps.tools.bench.overload` or
`hps bench http --overload` prints them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import re
import shutil
import socket
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench.cpus import counters
from hps.tools.bench.http import (
    MODEL,
    TABLE,
    _free_port,
    _http_server,
    one_table_config,
)
from hps.tools.bench.raw_http import RawConnection, prepare

#: what a shed client does, by default: honour Retry-After (None), then come back 20 ms
#: after a 503 whatever the server says (a client that keeps the load on)
BACKOFFS: tuple[float | None, ...] = (None, 0.02)
#: the clients a run can use: "raw" sends prepared request bytes and reads the status,
#: two headers and the body (hps/tools/bench/raw_http.py): a third or less of the CPU
#: http.client takes a request, which the 2-core machine takes from the server measured
CLIENTS = ("raw", "http.client")
#: where the served table lives: the in-process hash map, or RocksDB alone
TIERS = ("hash_map", "rocksdb")
PATH = f"/v1/models/{MODEL}/tables/{TABLE}/lookup"


def _client(url: str, bodies: list[bytes], headers: dict[str, str], seconds: float,
            warmup: float, start: Any, backoff_s: float | None, client: str,
            out: Any) -> None:
    """One client process: closed loop until `seconds` after `warmup`; puts (latencies
    of served requests in s, shed, expired, other, its CPU seconds in the timed part) on
    `out`. After a 503 it waits `backoff_s`, or with None what the answer's Retry-After
    says (at most until the end). `client`: one of CLIENTS."""
    host, port = url.split(":")
    conn = _connection(client, host, int(port), bodies, headers)
    served: list[float] = []
    shed = expired = other = 0
    start.wait()
    begin = time.monotonic() + warmup
    end = begin + seconds
    cpu_begin: float | None = None
    i = 0
    while True:
        now = time.monotonic()
        if now >= end:
            break
        if cpu_begin is None and now >= begin:
            cpu_begin = time.process_time()
        t0 = time.perf_counter()
        try:
            status, retry_after = conn.exchange(i % len(bodies))
        except OSError:
            status, retry_after = -1, None
        i += 1
        took = time.perf_counter() - t0
        if status == 503:
            wait = backoff_s if backoff_s is not None else float(retry_after or 1)
            time.sleep(max(0.0, min(wait, end - time.monotonic())))
        if now < begin:
            continue
        if status == 200:
            served.append(took)
        elif status == 503:
            shed += 1
        elif status == 504:
            expired += 1
        else:
            other += 1
    cpu = time.process_time() - (cpu_begin if cpu_begin is not None else time.process_time())
    conn.close()
    out.put((np.asarray(served, dtype=np.float64).tobytes(), shed, expired, other, cpu))


def _connection(client: str, host: str, port: int, bodies: list[bytes],
                headers: dict[str, str]) -> _RawClient | _StdlibClient:
    """One keep-alive connection of kind `client` (one of CLIENTS) POSTing `bodies`."""
    if client == "raw":
        return _RawClient(host, port, bodies, headers)
    return _StdlibClient(host, port, bodies, headers)


class _RawClient:
    """`exchange(i)` POSTs `bodies[i]` from bytes prepared once; (status, Retry-After or
    None); OSError when the connection failed (the next call opens a new one)."""

    def __init__(self, host: str, port: int, bodies: list[bytes],
                 headers: dict[str, str]) -> None:
        self.conn = RawConnection(host, port)
        self.requests = [prepare(f"{host}:{port}", PATH, body, headers) for body in bodies]

    def exchange(self, i: int) -> tuple[int, str | None]:
        answer = self.conn.exchange(self.requests[i])
        return answer.status, answer.retry_after

    def close(self) -> None:
        self.conn.close()


class _StdlibClient:
    """The same exchange through `http.client`."""

    def __init__(self, host: str, port: int, bodies: list[bytes],
                 headers: dict[str, str]) -> None:
        self.host, self.port, self.bodies, self.headers = host, port, bodies, headers
        self.conn: http.client.HTTPConnection | None = None

    def exchange(self, i: int) -> tuple[int, str | None]:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
            self.conn.connect()
            self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.conn.request("POST", PATH, self.bodies[i], self.headers)
            answer = self.conn.getresponse()
            answer.read()
        except OSError:
            self.close()
            raise
        return answer.status, answer.getheader("retry-after")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _level(url: str, clients: int, bodies: list[bytes], headers: dict[str, str],
           seconds: float, warmup: float, backoff_s: float | None, client: str,
           server_pid: int) -> dict[str, Any]:
    context = multiprocessing.get_context("fork")  # 64 interpreters start in a blink
    start = context.Event()
    out = context.Queue()
    procs = [context.Process(target=_client, args=(url, bodies, headers, seconds, warmup,
                                                   start, backoff_s, client, out),
                             daemon=True)
             for _ in range(clients)]
    for proc in procs:
        proc.start()
    start.set()
    # the server's CPU over the timed part (the clients' warm-up excluded, give or take
    # the scheduling of their first request)
    time.sleep(warmup)
    before = counters(server_pid)
    results = [out.get(timeout=seconds + warmup + 120) for _ in procs]
    after = counters(server_pid)
    # the server's (CPU seconds, minor faults, its event loops' CPU seconds) meanwhile
    server = (None if before is None or after is None
              else [a - b for a, b in zip(after, before, strict=True)])
    for proc in procs:
        proc.join(timeout=30)
    latencies = np.concatenate([np.frombuffer(r[0], dtype=np.float64) for r in results])
    ms = latencies * 1e3
    answered = latencies.size + sum(r[1] + r[2] + r[3] for r in results)
    client_cpu = sum(r[4] for r in results)

    def server_per(which: int, scale: float) -> float:
        """The server's counter `which` (of `server`) per answer, times `scale`."""
        return float("nan") if server is None else server[which] / max(answered, 1) * scale

    return {
        "clients": clients,
        "backoff": "Retry-After" if backoff_s is None else f"{backoff_s * 1e3:g} ms",
        "served_per_s": latencies.size / seconds,
        "p50_ms": float(np.percentile(ms, 50)) if ms.size else float("nan"),
        "p99_ms": float(np.percentile(ms, 99)) if ms.size else float("nan"),
        "shed": sum(r[1] for r in results),
        "expired": sum(r[2] for r in results),
        "other": sum(r[3] for r in results),
        # CPU of each side per answer (any status): what the clients take from the
        # server on a machine they share
        "client_cpu_us": client_cpu / max(answered, 1) * 1e6,
        "server_cpu_us": server_per(0, 1e6),
        # of which the main threads' (the event loops'): the rest is other threads'
        "server_loop_cpu_us": server_per(2, 1e6),
        "server_cpu_share": float("nan") if server is None else server[0] / seconds,
        "server_minor_faults": server_per(1, 1.0),
    }


def bench_overload(num_keys: int = 100_000, dim: int = 64, batch: int = 128,
                   levels: tuple[int, ...] = (1, 2, 4, 8, 16, 64), *,
                   seconds: float = 5.0, warmup: float = 1.0, deadline_ms: int = 10,
                   lookup_threads: int = 2,
                   backoffs: tuple[float | None, ...] = BACKOFFS, rounds: int = 1,
                   client: str = "raw", tier: str = "hash_map",
                   seed: int = 0) -> dict[str, Any]:
    """Served rate, p99, shed and expired counts at each client count of `levels`, the
    last once per client behaviour of `backoffs`, all of it `rounds` times against one
    server (see the module's docstring). `summaries` compare the last level with the
    peak below it in the same round, one per behaviour: the round of the median ratio,
    beside every round's ratio and p99 (`summary`: the first behaviour's)."""
    from hps.modelfiles.formats.sparse_folder import write_sparse_model
    from hps.tools.bench.tiers import make_table

    if len(levels) < 2:
        raise ValueError("levels: at least two client counts (the peak, then the overload)")
    if not backoffs:
        raise ValueError("backoffs: at least one client behaviour")
    if rounds < 1:
        raise ValueError("rounds: at least 1")
    if client not in CLIENTS:
        raise ValueError(f"client: one of {', '.join(CLIENTS)}, not {client!r}")
    if tier not in TIERS:
        raise ValueError(f"tier: one of {', '.join(TIERS)}, not {tier!r}")
    keys, vectors = make_table(num_keys, dim, seed=seed)
    rng = np.random.default_rng(seed + 1)
    bodies = [keys[rng.integers(0, num_keys, batch)].astype("<i8").tobytes()
              for _ in range(256)]
    headers = {"Content-Type": "application/octet-stream"}
    if deadline_ms:
        headers["X-HPS-Deadline-Ms"] = str(deadline_ms)
    tmp = Path(tempfile.mkdtemp(prefix="hps-bench-overload-"))
    rows: list[dict[str, Any]] = []
    compared: list[list[dict[str, Any]]] = [[] for _ in backoffs]
    try:
        write_sparse_model(tmp / TABLE, keys, vectors)
        config = one_table_config(dim, batch)
        if tier == "rocksdb":  # the rows in RocksDB (loaded at start), nothing above it
            config["volatile_db"] = {"type": "disabled"}
            config["persistent_db"] = {"type": "rocks_db", "path": str(tmp / "rocksdb")}
        (tmp / "ps.json").write_text(json.dumps(config))
        pids: list[int] = []
        with _http_server(tmp / "ps.json", _free_port(), lookup_threads, None,
                          pids=pids) as url:
            for round_ in range(rounds):
                below = [_level(url, n, bodies, headers, seconds, warmup, backoffs[0],
                                client, pids[0]) for n in levels[:-1]]
                over = [_level(url, levels[-1], bodies, headers, seconds, warmup, backoff,
                               client, pids[0]) for backoff in backoffs]
                for row in below + over:
                    row["round"] = round_
                rows += below + over
                peak = max(below, key=lambda r: r["served_per_s"])
                for i, last in enumerate(over):
                    compared[i].append(_against(last, peak))
            keys_by_tier = _keys_by_tier(url)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summaries = [_median_round(per_round) for per_round in compared]
    return {
        "rows": rows,
        "summary": summaries[0],
        "summaries": summaries,
        "num_keys": num_keys, "dim": dim, "batch": batch, "seconds": seconds,
        "deadline_ms": deadline_ms, "lookup_threads": lookup_threads, "rounds": rounds,
        "tier": tier, "keys_by_tier": keys_by_tier,
        "client": f"one process per client, {client} keep-alive (TCP_NODELAY)",
    }


def print_overload(clients: int, seconds: float, rounds: int, client: str,
                   table: Callable[[list[dict[str, Any]], str], None],
                   say: Callable[[str], None] = print, tier: str = "hash_map"
                   ) -> dict[str, Any]:
    """`bench_overload` at 1, 2, 4, 8, 16 (those below `clients`) and `clients` client
    processes, its figures printed through `table(rows, title)` (a table a round: one
    column a level fits 80 columns, every round's levels did not) and `say(line)`;
    returns them."""
    levels = tuple(n for n in (1, 2, 4, 8, 16) if n < clients) + (clients,)
    say(f"client processes {', '.join(map(str, levels))}, {seconds:g} s each, "
        f"{rounds} rounds, the table in {tier} …")
    result = bench_overload(levels=levels, seconds=seconds, rounds=rounds, client=client,
                            tier=tier)
    for round_ in range(rounds):
        table([{"name": f"{r['clients']}" + ("" if r["backoff"] == "Retry-After"
                                             else f", {r['backoff']}"),
                "served/s": r["served_per_s"], "p50 ms": r["p50_ms"],
                "p99 ms": r["p99_ms"], "shed 503": r["shed"], "expired 504": r["expired"],
                "other": r["other"], "client CPU µs": r["client_cpu_us"],
                "server CPU µs": r["server_cpu_us"]}
               for r in result["rows"] if r["round"] == round_],
              f"round {round_ + 1} of {rounds}: client processes, {result['batch']} keys "
              f"per request, deadline {result['deadline_ms']} ms")
    say(f"clients after a 503 honour Retry-After unless the column says; client: "
        f"{result['client']}")
    say("keys served by tier: " + ", ".join(f"{name} {count:,}" for name, count
                                            in sorted(result["keys_by_tier"].items(),
                                                      reverse=True)))
    for s in result["summaries"]:
        say(f"{s['clients']} clients, backoff {s['backoff']}: {s['served_per_s']:,.0f} "
            f"served/s = {s['vs_peak']:.2f}× the peak ({s['peak_per_s']:,.0f}/s at "
            f"{s['peak_clients']} clients); p99 {s['p99_ms']:.2f} ms; shed {s['shed']}, "
            f"expired {s['expired']} (the round of the median ratio; every round: "
            f"{', '.join(f'{v:.2f}×' for v in s['rounds_vs_peak'])}; p99 "
            f"{', '.join(f'{v:.1f}' for v in s['rounds_p99_ms'])} ms)")
    return result


def _keys_by_tier(url: str) -> dict[str, int]:
    """The keys the server says each tier served over the run (`hps_tier_hits_total` of
    its /metrics, by tier: "volatile", "persistent"): which tier the figures are of."""
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return {tier: int(float(count)) for tier, count in re.findall(
        r'^hps_tier_hits_total\{[^}]*tier="(\w+)"[^}]*\} (\S+)$', text, re.MULTILINE)}


def _against(last: dict[str, Any], peak: dict[str, Any]) -> dict[str, Any]:
    """The overload level `last` beside the `peak` level of its round."""
    return {
        "clients": last["clients"],
        "backoff": last["backoff"],
        "served_per_s": last["served_per_s"],
        "peak_per_s": peak["served_per_s"],
        "peak_clients": peak["clients"],
        "vs_peak": last["served_per_s"] / max(peak["served_per_s"], 1e-9),
        "p99_ms": last["p99_ms"],
        "shed": last["shed"],
        "expired": last["expired"],
        "other": last["other"],
    }


def _median_round(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose ratio to its peak is the median (the lower middle one of an even
    count), with every round's ratio and p99: one round on a shared machine moves by a
    tenth or more, and the peak, the best of several levels, more often up than down."""
    ordered = sorted(per_round, key=lambda s: s["vs_peak"])
    return {**ordered[(len(ordered) - 1) // 2],
            "rounds_vs_peak": [s["vs_peak"] for s in per_round],
            "rounds_p99_ms": [s["p99_ms"] for s in per_round]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--levels", default="1,2,4,8,16,64")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--deadline-ms", type=int, default=10)
    parser.add_argument("--lookup-threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every level this many times; the round of the median "
                             "ratio is the summary")
    parser.add_argument("--backoff", default="retry-after,20",
                        help="what a shed client does, one run of the last level each: "
                             "'retry-after' (wait what the 503 says) or milliseconds")
    parser.add_argument("--client", choices=CLIENTS, default="raw",
                        help="the client of each process (default raw: prepared bytes "
                             "on a socket, the least CPU taken from the server)")
    parser.add_argument("--tier", choices=TIERS, default="hash_map",
                        help="where the served table lives: the in-process hash map, or "
                             "RocksDB alone (no volatile tier)")
    args = parser.parse_args(argv)
    backoffs = tuple(None if b.strip().lower() == "retry-after" else float(b) / 1000
                     for b in args.backoff.split(","))
    result = bench_overload(args.keys, args.dim, args.batch,
                            tuple(int(n) for n in args.levels.split(",")),
                            seconds=args.seconds, deadline_ms=args.deadline_ms,
                            lookup_threads=args.lookup_threads, backoffs=backoffs,
                            rounds=args.rounds, client=args.client, tier=args.tier)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
