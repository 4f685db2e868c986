"""Several servers timed in turns a fraction of a second long, by one set of clients.

Why: timed one after the other (fresh client processes, seconds each), two `hps serve`
processes doing the same work read 0.80x to 1.08x of each other in single rounds (8
workers, 16 client processes, an H200 machine's 32 cores, issue 74): the machine drifts
over seconds (other tenants, clocks, memory), and whichever server is timed in a slow
stretch reads slow. A ratio asked to settle a few percent needs the drift to fall on both
servers alike.

How (`interleaved`): the client processes each hold a keep-alive connection to every
server and switch servers together every `slice_s`, all reading one clock
(CLOCK_MONOTONIC, system-wide) from a start this process sets. Slices go round the
servers in a fixed order rotated one place every cycle (no server always follows the
same one), `cycles` = `seconds` / `slice_s` cycles a round, so each server gets `seconds`
of every round. A request counts for the server of the slice it was sent in. This process
reads a server's CPU counters at its own slices' edges (hps/tools/bench/cpus.py
`counters`), so a server's CPU per request is what it took in its own slices: not its idle
CPU while the others were timed, which is not a request's.

What a slice edge costs: each client finishes the request it has in flight (a millisecond
at most here) before it turns to the next server, whose CPU counters started at the edge:
the same for every server, the order rotating.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections import Counter
from typing import Any

import numpy as np

from hps.tools.bench.cpus import counters
from hps.tools.bench.overload import _connection

#: seconds a server is timed before the clients turn to the next, by default
SLICE_S = 0.5
#: seconds the client processes have to start and connect before the first slice
_START_S = 0.5


def slice_server(s: int, servers: int) -> int:
    """The server of slice `s` (counted from the first timed slice; negative in the
    warm-up): slice j of cycle c goes to server (j + c) mod `servers`."""
    cycle, j = divmod(s, servers)
    return (j + cycle) % servers


def interleaved(urls: list[str], pids: list[int], clients: int, bodies: list[bytes],
                headers: dict[str, str], seconds: float, rounds: int, warmup: float,
                slice_s: float = SLICE_S, client: str = "raw") -> list[list[dict[str, Any]]]:
    """`clients` closed-loop client processes over the servers at `urls` (host:port;
    `pids` the process whose CPU counts for each) in turns of `slice_s` (see the module),
    `warmup` seconds untimed, then `rounds` rounds giving each server about `seconds`.

    Returns [round][server] dicts: `served_per_s` (answers with 200 a second of the
    server's own slices), `p50_ms`, `p99_ms` (of those), `failed` (any other answer or a
    failed exchange), `server_cpu_us`, `server_loop_cpu_us` (its processes' main
    threads), `server_minor_faults` (per answer, over its slices), `failed_statuses`
    (failures by status; -1: the exchange failed twice, see `_exchange`)."""
    if not urls or len(urls) != len(pids):
        raise ValueError("one pid a server, and at least one server")
    if slice_s <= 0 or seconds < slice_s or rounds < 1:
        raise ValueError("slice_s > 0, seconds of at least one slice, rounds >= 1")
    n = len(urls)
    cycles = max(1, round(seconds / slice_s))
    slices = rounds * cycles * n
    context = multiprocessing.get_context("fork")
    start = context.Event()
    timed_from = context.Value("d", 0.0)
    out = context.Queue()
    procs = [context.Process(target=_client, daemon=True,
                             args=(urls, bodies, headers, timed_from, start, slice_s,
                                   slices, cycles, rounds, client, out))
             for _ in range(clients)]
    for proc in procs:
        proc.start()
    first = time.monotonic() + _START_S + warmup
    timed_from.value = first
    start.set()
    cpu = np.zeros((rounds, n, 3))  # CPU s, minor faults, main threads' CPU s
    began = None  # the counters of the slice under way's server, read at its start
    for edge in range(slices + 1):  # at each edge, the two servers it parts
        _sleep_until(first + edge * slice_s)
        if edge:
            k = slice_server(edge - 1, n)
            ended = counters(pids[k])
            if ended is not None and began is not None:
                cpu[(edge - 1) // (cycles * n), k] += np.subtract(ended, began)
        began = counters(pids[slice_server(edge, n)]) if edge < slices else None
    results = [out.get(timeout=slices * slice_s + warmup + 120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    timed_s = cycles * slice_s
    table: list[list[dict[str, Any]]] = []
    for r in range(rounds):
        row = []
        for k in range(n):
            latencies = np.concatenate([np.frombuffer(res[0][r][k], dtype=np.float64)
                                        for res in results]) * 1e3
            statuses = sum((Counter(res[1][r][k]) for res in results), Counter())
            failed = sum(statuses.values())
            answered = max(latencies.size + failed, 1)
            row.append({
                "served_per_s": latencies.size / timed_s,
                "p50_ms": float(np.percentile(latencies, 50)) if latencies.size else math.nan,
                "p99_ms": float(np.percentile(latencies, 99)) if latencies.size else math.nan,
                "failed": failed,
                "failed_statuses": dict(statuses),
                "server_cpu_us": float(cpu[r, k, 0]) / answered * 1e6,
                "server_loop_cpu_us": float(cpu[r, k, 2]) / answered * 1e6,
                "server_minor_faults": float(cpu[r, k, 1]) / answered,
            })
        table.append(row)
    return table


def _sleep_until(when: float) -> None:
    left = when - time.monotonic()
    if left > 0:
        time.sleep(left)


def _client(urls: list[str], bodies: list[bytes], headers: dict[str, str],
            timed_from: Any, start: Any, slice_s: float, slices: int, cycles: int,
            rounds: int, client: str, out: Any) -> None:
    """One client process: a connection to every server, closed loop, each request to
    the server of the slice it is sent in; puts ([round][server] latencies in s as
    float64 bytes, [round][server] failures by status, -1 an exchange that failed) on
    `out`."""
    n = len(urls)
    conns = []
    for url in urls:
        host, port = url.split(":")
        conns.append(_connection(client, host, int(port), bodies, headers))
    served: list[list[list[float]]] = [[[] for _ in urls] for _ in range(rounds)]
    failed: list[list[dict[int, int]]] = [[{} for _ in urls] for _ in range(rounds)]
    start.wait()
    first = timed_from.value
    end = first + slices * slice_s
    i = 0
    while True:
        now = time.monotonic()
        if now >= end:
            break
        s = math.floor((now - first) / slice_s)
        k = slice_server(s, n)
        t0 = time.perf_counter()
        status = _exchange(conns[k], i % len(bodies))
        took = time.perf_counter() - t0
        i += 1
        if s < 0:  # the warm-up
            continue
        r = s // (cycles * n)
        if status == 200:
            served[r][k].append(took)
        else:
            failed[r][k][status] = failed[r][k].get(status, 0) + 1
    for conn in conns:
        conn.close()
    out.put(([[np.asarray(t, dtype=np.float64).tobytes() for t in row] for row in served],
             failed))


def _exchange(conn: Any, i: int) -> int:
    """The status of request `i` on `conn`, or -1 where the exchange failed twice: a
    connection idle through the other servers' slices may have been closed by its server
    meanwhile, and is opened again once, as a client's pool does."""
    for _ in range(2):
        try:
            return int(conn.exchange(i)[0])
        except OSError:
            continue
    return -1
