"""`hps serve` with a GPU model, driven by client processes, beside its floors.

`bench_http_gpu()` writes one table (`num_keys` keys, width `dim`) and serves it three
ways, one after the other in the same run:

- `hps serve` with a GPU cache of the whole table on device 0 (dynamic, `gpucacheper`
  1.0, filled at load: every lookup hits), its lookups on the server's lookup threads
  (`lookup_threads`, default the server's own choice: 2 with a GPU);
- `hps serve` of the same table without a GPU cache (the in-process hash map alone);
- the floor: the bare ASGI app (hps.tools.bench.bare_asgi) on uvicorn, one process as
  `hps serve` is, answering as many bytes.

Each is driven by P client *processes* for every P of `client_processes` (1, 2, 4, 8):
one keep-alive connection each, binary v1 lookups of `batch` keys drawn from a power law
(alpha 1.1, hot keys spread over the table), closed loop, `seconds` each after `warmup`
(hps.tools.bench.overload's client, `client`: "raw" prepared request bytes, the least
CPU taken from the server, or "http.client"). One process's threads would measure the
client's GIL, not the server. Before timing, every body is sent once to each hps server
and its answer compared with the table's rows (`wrong_rows`).

With `workers` N > 1 every server runs N worker processes on its port (`hps serve
--workers N`: each worker its own GPU cache; the floor: N uvicorn workers accepting as
hps serve's do, hps.tools.bench.bare_workers), and a
fourth server shares one GPU cache among its workers (gpu_cache_scope host). Beside the
rows: the GPU memory in use while each GPU server is up (the device's, and nvidia-smi's
per process) and whether an MPS control daemon runs.

Per server and P: keys/s, p50 and p99 of the answers, the server's CPU and minor page
faults per request (its processes together: memory mapped and unmapped per request shows
in both); per P the GPU server over the floor (keys/s and p99) and over the server without a GPU.
`hps bench http --gpu` (or `python -m hps.tools.bench.http_gpu`) prints them; it needs
CUDA and CuPy (without them, `gpu=False` runs the other two: what the CPU tests check).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench import cpus as placement
from hps.tools.bench.cpus import cpu_seconds
from hps.tools.bench.gpu_processes import gpu_memory_by_process
from hps.tools.bench.gpu_threads import draws
from hps.tools.bench.http import (
    MODEL,
    TABLE,
    _bare_server,
    _free_port,
    _subprocess_server,
    one_table_config,
    print_rows,
    run_folders,
    serve_argv,
)
from hps.tools.bench.interleave import interleaved
from hps.tools.bench.overload import PATH, _level

HEADERS = {"Content-Type": "application/octet-stream"}
GPU, CPU, FLOOR = "hps serve, GPU cache", "hps serve, no GPU cache", "bare uvicorn (floor)"
#: with several workers: one GPU cache for all of them (gpu_cache_scope host)
SHARED = "hps serve, one GPU cache for all workers"
#: a second server without a GPU cache, the same as the first: its ratio to that one is
#: the measure's own spread (two servers doing the same work)
CONTROL = "hps serve, no GPU cache, again (control)"
#: keys a request and client processes, unless asked otherwise (the GPU benches' batch,
#: the thread counts of the threads profile)
BATCH, CLIENT_PROCESSES = 2000, (1, 2, 4, 8)
#: seconds each server's idle CPU is counted over, once it is up
IDLE_S = 2.0


def _power_law_bodies(keys: np.ndarray, batch: int, bodies: int, alpha: float,
                      rng: np.random.Generator) -> tuple[list[bytes], list[np.ndarray]]:
    """`bodies` request bodies of `batch` keys each (little-endian int64), drawn as the
    threads profile draws its power-law batches (over a random order of the table); and
    each body's rows (indices into keys)."""
    picks = draws(rng, keys.size, batch, bodies, alpha, uniform=False)
    return [keys[p].astype("<i8").tobytes() for p in picks], picks


def _wrong_rows(url: str, bodies: list[bytes], picks: list[np.ndarray],
                vectors: np.ndarray) -> int:
    """Rows of the answers to every body that differ from the table's (a non-200 answer
    counts all of its rows)."""
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    wrong = 0
    try:
        for body, pick in zip(bodies, picks, strict=True):
            conn.request("POST", PATH, body, HEADERS)
            answer = conn.getresponse()
            data = answer.read()
            if answer.status != 200:
                wrong += pick.size
                continue
            rows = np.frombuffer(data, dtype="<f4").reshape(pick.size, -1)
            wrong += int((rows != vectors[pick]).any(axis=1).sum())
    finally:
        conn.close()
    return wrong


def gpu_table_config(dim: int, batch: int, http_lookup_path: str = "auto"
                     ) -> dict[str, Any]:
    """The benches' one-table config with a dynamic GPU cache of the whole table on device
    0, filled at load, its HTTP lookups' path `http_lookup_path` (auto: as measured)."""
    config = one_table_config(dim, batch)
    config["models"][0].update(gpucache=True, gpucacheper=1.0, embedding_cache_type="dynamic",
                               cache_refresh_percentage_per_iteration=1.0,
                               http_lookup_path=http_lookup_path)
    return config


def bench_http_gpu(num_keys: int = 1_000_000, dim: int = 64, batch: int = BATCH,
                   client_processes: tuple[int, ...] = CLIENT_PROCESSES, *,
                   seconds: float = 3.0, warmup: float = 1.0, alpha: float = 1.1,
                   lookup_threads: int | None = None, client: str = "raw",
                   gpu: bool = True, seed: int = 0, workers: int = 1,
                   rounds: int = 1, http_lookup_path: str = "auto", pin: bool = False,
                   slice_s: float | None = None, control: bool = False
                   ) -> dict[str, Any]:
    """The figures of the module's docstring as a dict: `rows` (server, P, keys/s, p50,
    p99, server CPU per request, failed: the median of `rounds`), `ratios` (per P, of the
    medians; `rounds` > 1 adds each round's own), `wrong_rows` (per hps server).

    With `rounds` > 1 every server is up at once and each round times them all in turn,
    the order rotated a place each round: a machine that drifts (other tenants, clocks,
    the clients' own start) drifts under every server alike, and a ratio of two servers
    timed apart by minutes does not carry it (one-at-a-time runs of one server doing the
    same work as another read 0.92x to 1.22x of it).

    `slice_s`: every server up at once, and one set of client processes switching among
    them every `slice_s` seconds, each round giving each server `seconds`
    (hps/tools/bench/interleave.py): the drift of seconds falls on every server alike.
    `control`: a second server without a GPU cache beside the first, whose ratio to it
    (`control_keys_per_s_vs_cpu`, per round with rounds) is the measure's own spread.

    `pin`: every server's processes on one half of the physical cores, the clients on the
    other (hps/tools/bench/cpus.py), so that no server shares a core with a
    client and every server gets the same cores."""
    from hps.modelfiles.formats.sparse_folder import write_sparse_model
    from hps.tools.bench.tiers import make_table

    keys, vectors = make_table(num_keys, dim, seed=seed)
    bodies, picks = _power_law_bodies(keys, batch, 128, alpha, np.random.default_rng(seed + 1))
    tmp = Path(tempfile.mkdtemp(prefix="hps-bench-http-gpu-"))
    timed: list[dict[str, Any]] = []
    wrong: dict[str, int] = {}
    memory: dict[str, tuple[int, list[int]]] = {}
    idle: dict[str, float] = {}
    paths: dict[str, dict[str, Any]] = {}
    split = placement.split_cpus() if pin else None
    together = rounds > 1 or slice_s is not None  # every server up at once
    server_cpus, client_cpus = split if split else (None, None)
    own_cpus = os.sched_getaffinity(0) if split else None
    try:
        placement.pin(0, client_cpus)  # the client processes fork from this one
        write_sparse_model(tmp / TABLE, keys, vectors)
        servers: list[tuple[str, dict[str, Any] | None]] = []
        if gpu:
            servers.append((GPU, gpu_table_config(dim, batch, http_lookup_path)))
            if workers > 1:
                shared = gpu_table_config(dim, batch, http_lookup_path)
                shared["models"][0]["gpu_cache_scope"] = "host"
                servers.append((SHARED, shared))
        servers.append((CPU, one_table_config(dim, batch)))
        if control:
            servers.append((CONTROL, one_table_config(dim, batch)))
        servers.append((FLOOR, None))

        def record(name: str, p: int, round_: int, level: dict[str, Any]) -> None:
            timed.append({"server": name, "clients": p, "round": round_,
                          "keys_per_s": level["served_per_s"] * batch,
                          "p50_ms": level["p50_ms"], "p99_ms": level["p99_ms"],
                          "server_cpu_us": level["server_cpu_us"],
                          "server_loop_cpu_us": level["server_loop_cpu_us"],
                          "server_minor_faults": level["server_minor_faults"],
                          "failed": level["failed"]})

        def measure(name: str, url: str, pid: int, round_: int) -> None:
            for p in client_processes:
                level = _level(url, p, bodies, HEADERS, seconds, warmup, 0.0, client, pid)
                level["failed"] = level["shed"] + level["expired"] + level["other"]
                record(name, p, round_, level)

        def bring_up(stack: contextlib.ExitStack, index: int) -> tuple[str, str, int]:
            """Server `index` up in `stack`, its answers checked, its memory and idle CPU
            taken: (name, host:port, the pid whose CPU counts)."""
            name, config = servers[index]
            # with other servers up, its memory is what the device gained; alone, all
            before = gpu_memory_by_process() if _has_gpu(config) and together else (0, {})
            url, pid = stack.enter_context(
                _start(tmp, index, config, dim, lookup_threads, workers, server_cpus))
            _after_start(name, config, url, bodies, picks, vectors, wrong, memory, before)
            idle[name] = _idle_cpu(pid)
            return name, url, pid

        def path_taken(up: list[tuple[str, str, int]]) -> None:
            for name, url, _ in up:  # after the timing: serving's choice too
                if _has_gpu(dict(servers)[name]):
                    paths[name] = _http_lookup(url)

        # with every server up at once, the floor starts first: of servers started one
        # after another, the first reads slower for as long as it runs (three identical
        # servers without a GPU cache, 2 workers each, timed in turns on the 2-core
        # machine: the first 0.90-0.99x the others, slower than both in 10 rounds of 11,
        # also when started 40 s earlier or second in the clients' order; with the floor
        # started before them, within 0.95-1.02x of each other), and the floor is not
        # read to a percent
        start_order = sorted(range(len(servers)), key=lambda i: servers[i][0] != FLOOR)
        if not together:  # one server up at a time, timed as soon as it is up
            for index in range(len(servers)):
                with contextlib.ExitStack() as stack:
                    up = [bring_up(stack, index)]
                    measure(*up[0], 0)
                    path_taken(up)
        else:
            with contextlib.ExitStack() as stack:
                up = [bring_up(stack, index) for index in start_order]
                if slice_s is not None:  # timed in turns of slice_s by one set of clients
                    for p in client_processes:
                        table = interleaved([u for _, u, _ in up], [pid for _, _, pid in up],
                                            p, bodies, HEADERS, seconds, rounds, warmup,
                                            slice_s, client)
                        for round_, row in enumerate(table):
                            for (name, _, _), level in zip(up, row, strict=True):
                                record(name, p, round_, level)
                else:  # each round timing them in turn, the order rotated a place
                    for round_ in range(rounds):
                        shift = round_ % len(up)
                        for server in up[shift:] + up[:shift]:
                            measure(*server, round_)
                path_taken(up)
    finally:
        placement.pin(0, own_cpus)
        shutil.rmtree(tmp, ignore_errors=True)

    rows = [_median_row(name, p, [t for t in timed
                                  if t["server"] == name and t["clients"] == p])
            for name, _ in servers for p in client_processes]

    def ratio(a: str, b: str, p: int, key: str, in_round: int | None = None) -> float:
        pick = timed if in_round is not None else rows
        mine, other = (next(r for r in pick if r["server"] == s and r["clients"] == p
                            and (in_round is None or r["round"] == in_round))
                       for s in (a, b))
        return mine[key] / max(other[key], 1e-9)

    served = GPU if gpu else CPU
    ratios = []
    for p in client_processes:
        ratios.append({"clients": p,
                       "keys_per_s_vs_floor": ratio(served, FLOOR, p, "keys_per_s"),
                       "p99_vs_floor": ratio(served, FLOOR, p, "p99_ms"),
                       "keys_per_s_vs_cpu": ratio(served, CPU, p, "keys_per_s"),
                       "p99_vs_cpu": ratio(served, CPU, p, "p99_ms")})
        mine = [served] + ([SHARED] if gpu and workers > 1 else []) + (
            [CONTROL] if control else [])
        if rounds > 1:  # each round's own pair: how far the medians' ratio can be trusted
            for name in mine:
                ratios[-1][f"{_prefix(name)}rounds_keys_per_s_vs_cpu"] = [
                    ratio(name, CPU, p, "keys_per_s", r) for r in range(rounds)]
                ratios[-1][f"{_prefix(name)}rounds_p99_vs_cpu"] = [
                    ratio(name, CPU, p, "p99_ms", r) for r in range(rounds)]
        if gpu and workers > 1:
            ratios[-1]["shared_keys_per_s_vs_cpu"] = ratio(SHARED, CPU, p, "keys_per_s")
            ratios[-1]["shared_p99_vs_cpu"] = ratio(SHARED, CPU, p, "p99_ms")
        if control:
            ratios[-1]["control_keys_per_s_vs_cpu"] = ratio(CONTROL, CPU, p, "keys_per_s")
            ratios[-1]["control_p99_vs_cpu"] = ratio(CONTROL, CPU, p, "p99_ms")
    return {"rows": rows, "rounds": rounds, "slice_s": slice_s,
            "timed": timed if rounds > 1 else [],
            "ratios": ratios, "wrong_rows": wrong, "num_keys": num_keys,
            "dim": dim, "batch": batch, "alpha": alpha, "seconds": seconds, "gpu": gpu,
            "lookup_threads": lookup_threads, "workers": workers,
            "http_lookup_path": http_lookup_path,
            "cpus": None if split is None else {"servers": sorted(server_cpus or ()),
                                                "clients": sorted(client_cpus or ())},
            "gpu_memory": {k: {"device_mib": u, "per_process_mib": per}
                           for k, (u, per) in memory.items()},
            "mps": _mps_found() if gpu else None, "http_lookup": paths,
            "idle_cpu_cores": idle,
            "client": f"one process per client, {client} keep-alive"}


def _prefix(name: str) -> str:
    return {SHARED: "shared_", CONTROL: "control_"}.get(name, "")


def _has_gpu(config: dict[str, Any] | None) -> bool:
    return config is not None and bool(config["models"][0].get("gpucache"))


def _start(tmp: Path, index: int, config: dict[str, Any] | None, dim: int,
           lookup_threads: int | None, workers: int, cpus: set[int] | None = None) -> Any:
    """Server `index` of the run (a config, or None: the floor) as a context manager
    yielding (host:port, the process id whose CPU is counted), with a config and a log of
    its own (several may be up at once)."""
    port, pids = _free_port(), []
    several = ["--workers", str(workers)] if workers > 1 else []
    if config is None:
        server = _bare_server(tmp, port, dim, cpus, pids, workers)
    else:
        path = tmp / f"ps-{index}.json"
        path.write_text(json.dumps(config))
        threads = [] if lookup_threads is None else ["--lookup-threads", str(lookup_threads)]
        server = _subprocess_server(
            serve_argv(path, "--port", str(port), *threads, *several),
            tmp / f"serve-{index}.log", port, "/readyz", cpus, 600.0,
            {"HPS_SHM_DIR": str(tmp)} if several else None, pids,
            (workers, run_folders(tmp)))

    @contextlib.contextmanager
    def with_pid() -> Any:
        with server as url:
            yield url, pids[0]

    return with_pid()


def _after_start(name: str, config: dict[str, Any] | None, url: str, bodies: list[bytes],
                 picks: list[np.ndarray], vectors: np.ndarray, wrong: dict[str, int],
                 memory: dict[str, tuple[int, list[int]]],
                 before: tuple[int, dict[int, int]]) -> None:
    """Once a server is up: its answers checked, and a GPU server's memory (what the
    device and nvidia-smi's processes hold past `before`, taken before it started)."""
    if config is None:
        return
    wrong[name] = _wrong_rows(url, bodies, picks, vectors)
    if _has_gpu(config):  # every worker loaded: what each holds
        used, per = gpu_memory_by_process()
        memory[name] = (used - before[0],
                        [mib for pid, mib in sorted(per.items()) if pid not in before[1]])


def _idle_cpu(pid: int, seconds: float = IDLE_S) -> float:
    """CPU a server's processes together use with no request, in cores, over `seconds`
    (its background threads: what it takes from the requests of a busy machine)."""
    before = cpu_seconds(pid)
    time.sleep(seconds)
    after = cpu_seconds(pid)
    return float("nan") if before is None or after is None else (after - before) / seconds


def _median_row(name: str, p: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's row at P clients: the median of its rounds (keys/s, p50, p99, CPU),
    the failures summed."""
    row: dict[str, Any] = {"server": name, "clients": p}
    for key in ("keys_per_s", "p50_ms", "p99_ms", "server_cpu_us", "server_loop_cpu_us",
                "server_minor_faults"):
        row[key] = float(np.median([r[key] for r in runs]))
    row["failed"] = sum(r["failed"] for r in runs)
    return row


def print_http_gpu(num_keys: int, dim: int, batch: int, client_processes: list[int],
                   seconds: float, lookup_threads: int | None, client: str,
                   table: Callable[[list[dict[str, Any]], str], None],
                   say: Callable[[str], None] = print, gpu: bool = True,
                   workers: int = 1, rounds: int = 1, http_lookup_path: str = "auto",
                   pin: bool = False, slice_s: float | None = None,
                   control: bool = False) -> dict[str, Any]:
    """Run `bench_http_gpu` and print its figures through `table(rows, title)` and
    `say(line)`; returns them."""
    say(f"table of {num_keys:,} keys, width {dim}; {batch:,} power-law keys per request; "
        f"client processes {', '.join(map(str, client_processes))}; {seconds:g} s each; "
        f"every server (the floor too) with {workers} worker process(es)"
        + (f"; {rounds} rounds, every server up at once, timed in turn (medians below)"
           if rounds > 1 and slice_s is None else "")
        + (f"; {rounds} round(s), every server up at once, the clients turning to the next "
           f"every {slice_s:g} s" if slice_s is not None else "")
        + ("; a second server without a GPU cache as the control" if control else "")
        + " …")
    result = bench_http_gpu(num_keys, dim, batch, tuple(client_processes), seconds=seconds,
                            lookup_threads=lookup_threads, client=client, gpu=gpu,
                            workers=workers, rounds=rounds, http_lookup_path=http_lookup_path,
                            pin=pin, slice_s=slice_s, control=control)
    if result["cpus"]:
        say(f"servers on CPUs {result['cpus']['servers']}, clients on "
            f"{result['cpus']['clients']} (whole cores each side)")
    for p in client_processes:
        table([{"name": r["server"], "keys/s": r["keys_per_s"], "p50 ms": r["p50_ms"],
                "p99 ms": r["p99_ms"], "server CPU µs/req": r["server_cpu_us"],
                "of which event loops": r["server_loop_cpu_us"],
                "page faults/req": r["server_minor_faults"], "failed": r["failed"]}
               for r in result["rows"] if r["clients"] == p],
              f"{p} client processes, {batch:,} keys per request")
    served = GPU if gpu else CPU
    for r in result["ratios"]:
        say(f"{r['clients']} client processes: {served} / floor: keys/s "
            f"{r['keys_per_s_vs_floor']:.2f}×, p99 {r['p99_vs_floor']:.2f}×; over no GPU "
            f"cache: keys/s {r['keys_per_s_vs_cpu']:.2f}×, p99 {r['p99_vs_cpu']:.2f}×")
        if "shared_keys_per_s_vs_cpu" in r:
            say(f"{r['clients']} client processes: {SHARED} over no GPU cache: keys/s "
                f"{r['shared_keys_per_s_vs_cpu']:.2f}×, p99 {r['shared_p99_vs_cpu']:.2f}×")
        if "control_keys_per_s_vs_cpu" in r:
            say(f"{r['clients']} client processes: {CONTROL} over the first (the measure's "
                f"spread): keys/s {r['control_keys_per_s_vs_cpu']:.2f}×, p99 "
                f"{r['control_p99_vs_cpu']:.2f}×")
        for name in (served, SHARED, CONTROL):
            each = r.get(f"{_prefix(name)}rounds_keys_per_s_vs_cpu")
            if each:
                p99 = r[f"{_prefix(name)}rounds_p99_vs_cpu"]
                say(f"{r['clients']} client processes: {name} over no GPU cache, round by "
                    f"round: keys/s {' '.join(f'{x:.2f}×' for x in each)}; p99 "
                    f"{' '.join(f'{x:.2f}×' for x in p99)}")
    for name, shown in result["http_lookup"].items():  # the answering worker's
        say(f"{name}: HTTP lookups took {shown.get('path')} ({shown.get('reason')}; "
            f"per size {shown.get('sizes')}: {shown.get('paths')}, load µs GPU "
            f"{shown.get('gpu_us')} host {shown.get('host_us')}, serving µs "
            f"{shown.get('served_us')}, serving CPU µs {shown.get('served_cpu_us')}; "
            f"answered {shown.get('answered')}; one worker's)")
    say("idle CPU of each server's processes together, cores: " + ", ".join(
        f"{k} {v:.3f}" for k, v in result["idle_cpu_cores"].items()))
    say("wrong rows: " + ", ".join(f"{k} {v}" for k, v in result["wrong_rows"].items()))
    for name, used in result["gpu_memory"].items():
        say(f"{name}: {used['device_mib']} MiB in use on the device; per process (nvidia-smi)"
            f" {' '.join(map(str, used['per_process_mib']))} MiB")
    if gpu:
        say(f"MPS control daemon: {'on' if result['mps'] else 'off'}")
    say(f"client: {result['client']}; model {MODEL}, table {TABLE}")
    return result


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--client-processes", default=",".join(map(str, CLIENT_PROCESSES)))
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--lookup-threads", type=int, default=None)
    parser.add_argument("--client", default="raw", choices=("raw", "http.client"))
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes of every server, the floor too")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of every server in turn, all up at once (medians)")
    parser.add_argument("--http-lookup-path", default="auto", choices=("auto", "gpu", "host"),
                        help="the GPU servers' http_lookup_path (auto: as measured)")
    parser.add_argument("--pin", action="store_true",
                        help="servers on half the physical cores, clients on the others")
    parser.add_argument("--interleave", type=float, default=None, metavar="SLICE_S",
                        help="every server up at once, the clients turning to the next "
                        "every SLICE_S seconds (each round: --seconds a server)")
    parser.add_argument("--control", action="store_true",
                        help="a second server without a GPU cache: the measure's spread")
    args = parser.parse_args(argv)

    result = print_http_gpu(args.keys, args.dim, args.batch,
                            [int(c) for c in args.client_processes.split(",")],
                            args.seconds, args.lookup_threads, args.client, print_rows,
                            workers=args.workers, rounds=args.rounds,
                            http_lookup_path=args.http_lookup_path, pin=args.pin,
                            slice_s=args.interleave, control=args.control)
    print(json.dumps(result))



def _http_lookup(url: str) -> dict[str, Any]:
    """The table's `http_lookup` in GET /v1/models (the path its HTTP lookups take,
    hps/server/http_path.py), as the worker that answers says it ({} if none)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", f"/v1/models/{MODEL}")
        answer = conn.getresponse()
        body = answer.read()
    finally:
        conn.close()
    if answer.status != 200:
        return {}
    shown: dict[str, Any] = json.loads(body)["tables"][0].get("http_lookup") or {}
    return shown


def _mps_found() -> bool:
    from hps.runtime.mps import daemon_found

    return daemon_found()


if __name__ == "__main__":
    main()
