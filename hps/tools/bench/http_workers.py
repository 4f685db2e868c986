"""Lookups through `hps serve --workers N` beside its floor, and the memory of the workers.

`bench_http_workers()` serves one table (`num_keys` keys, width `dim`, the hash map tier)
three ways, one after the other in the same run: `hps serve` (one worker: the
one-process server), `hps serve --workers N` (one table in shared memory), and the floor,
the bare ASGI app (hps.tools.bench.bare_asgi) on uvicorn with the same N workers, which
accept as hps serve's do (hps.tools.bench.bare_workers). Each is
driven by P client *processes* (one keep-alive http.client connection each, binary v1
lookups of `batch` keys, closed loop; hps.tools.bench.overload's client) for every P of
`client_processes`, `seconds` each after `warmup`.

Per server and P: keys/s and p50 / p99 of the answers; per P the N workers' keys/s over
the floor's and their p99 over the floor's (the issue's targets: >= 0.7 and <= 2). Memory
(after the runs, Linux /proc/PID/smaps_rollup): RSS and PSS of every process of each hps
server (the supervisor and each worker) and in total, beside the table's bytes (its files
in shared memory for N workers): every worker maps the same pages, so the table counts
in each worker's RSS but is split between them in PSS. `hps bench http --workers N
--client-processes P,...` prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench.cpus import children
from hps.tools.bench.http import (
    TABLE,
    _bare_server,
    _free_port,
    _subprocess_server,
    one_table_config,
    print_rows,
    run_folders,
    serve_argv,
)
from hps.tools.bench.overload import _level


def smaps(pid: int) -> dict[str, int]:
    """Rss and Pss of process `pid` in bytes (Linux; zeros where it cannot be read)."""
    out = {"rss": 0, "pss": 0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("Rss", "Pss"):
                    out[name.lower()] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _memory(pid: int, shm_table_bytes: int | None) -> dict[str, Any]:
    procs = [("main", pid)] + [(f"worker {i}", p) for i, p in enumerate(children(pid))]
    rows = [{"process": name, **smaps(p)} for name, p in procs]
    total = {"process": "total", "rss": sum(r["rss"] for r in rows),
             "pss": sum(r["pss"] for r in rows)}
    return {"processes": [*rows, total], "table_bytes": shm_table_bytes}


def _shm_folder(tmp: Path, need: int) -> Path:
    """A folder of /dev/shm for the run's shared tables where it has `need` bytes free,
    else one beside the model files (a disk's page cache serves the same mappings)."""
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        free = 0
    folder = Path(tempfile.mkdtemp(prefix="hps-bench-", dir="/dev/shm")) if free > need \
        else tmp / "shm"
    folder.mkdir(exist_ok=True)
    return folder


def _shm_table_bytes(shm: Path) -> int:
    """Bytes the shared tables' files hold in memory (allocated blocks of the tmpfs)."""
    return sum(f.stat().st_blocks * 512 for f in shm.glob("hps-mp-*/tables/*"))


def bench_http_workers(num_keys: int = 1_000_000, dim: int = 64, batch: int = 256,
                       workers: int = 2, client_processes: tuple[int, ...] = (1, 4, 16), *,
                       seconds: float = 4.0, warmup: float = 1.0, one_worker: bool = True,
                       seed: int = 0) -> dict[str, Any]:
    """The figures of the module's docstring as a dict: `rows` (server, P, keys/s, p50,
    p99), `ratios` (per P: N workers over the floor, keys/s and p99), `memory` (per hps
    server: its processes' RSS and PSS, and the table's bytes)."""
    from hps.modelfiles.formats.sparse_folder import write_sparse_model
    from hps.tools.bench.tiers import make_table

    keys, vectors = make_table(num_keys, dim, seed=seed)
    rng = np.random.default_rng(seed + 1)
    bodies = [keys[rng.integers(0, num_keys, batch)].astype("<i8").tobytes()
              for _ in range(256)]
    headers = {"Content-Type": "application/octet-stream"}
    tmp = Path(tempfile.mkdtemp(prefix="hps-bench-workers-"))
    shm = _shm_folder(tmp, 2 * (keys.nbytes + vectors.nbytes))
    try:
        write_sparse_model(tmp / TABLE, keys, vectors)
        config = one_table_config(dim, batch)
        (tmp / "ps.json").write_text(json.dumps(config))
        serve = serve_argv(tmp / "ps.json")
        # (name, argv, path that says ready, workers); the floor's argv is its own
        servers = [("hps serve, 1 worker", serve, "/readyz", 1)] if one_worker else []
        servers += [(f"hps serve, {workers} workers", [*serve, "--workers", str(workers)],
                     "/readyz", workers),
                    (f"bare uvicorn, {workers} workers (floor)", None, "/", workers)]
        rows: list[dict[str, Any]] = []
        memory: dict[str, Any] = {}
        env = {"HPS_BARE_DIM": str(dim), "HPS_SHM_DIR": str(shm)}
        for name, argv, ready, several in servers:
            port = _free_port()
            pids: list[int] = []
            # each waits for every worker to accept (the floor's accept as hps serve's)
            up = (_bare_server(tmp, port, dim, None, pids, several) if argv is None else
                  _subprocess_server([*argv, "--port", str(port)], tmp / "server.log", port,
                                     ready, None, 600.0, env, pids,
                                     (several, run_folders(shm))))
            with up as url:
                for p in client_processes:
                    level = _level(url, p, bodies, headers, seconds, warmup, 0.0, "http.client",
                                   pids[-1])
                    rows.append({"server": name, "clients": p,
                                 "keys_per_s": level["served_per_s"] * batch,
                                 "p50_ms": level["p50_ms"], "p99_ms": level["p99_ms"],
                                 "failed": level["shed"] + level["expired"] + level["other"]})
                if name.startswith("hps"):
                    shared = _shm_table_bytes(shm) if "workers" in name else None
                    memory[name] = _memory(pids[0], shared)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = []
    for p in client_processes:
        mine = next(r for r in rows if r["clients"] == p and "workers" in r["server"]
                    and r["server"].startswith("hps"))
        base = next(r for r in rows if r["clients"] == p and "floor" in r["server"])
        ratios.append({"clients": p,
                       "keys_per_s": mine["keys_per_s"] / max(base["keys_per_s"], 1e-9),
                       "p99": mine["p99_ms"] / max(base["p99_ms"], 1e-9)})
    return {"rows": rows, "ratios": ratios, "memory": memory, "num_keys": num_keys,
            "dim": dim, "batch": batch, "workers": workers, "seconds": seconds,
            "cpus": len(os.sched_getaffinity(0)),
            "table_bytes": int(keys.nbytes + vectors.nbytes),
            "client": "one process per client, http.client keep-alive (TCP_NODELAY)"}


def print_workers(num_keys: int, dim: int, batches: list[int], workers: int,
                  client_processes: list[int], seconds: float,
                  table: Callable[[list[dict[str, Any]], str], None],
                  say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `bench_http_workers` (one batch size: the first of `batches`) and print its
    figures through `table(rows, title)` and `say(line)`; returns them."""
    batch = batches[0]
    say(f"table of {num_keys:,} keys, width {dim}; {batch:,} keys per request; client "
        f"processes {', '.join(map(str, client_processes))}; {seconds:g} s each …")
    result = bench_http_workers(num_keys, dim, batch, workers, tuple(client_processes),
                                seconds=seconds)
    for p in client_processes:
        table([{"name": r["server"], "keys/s": r["keys_per_s"], "p50 ms": r["p50_ms"],
                "p99 ms": r["p99_ms"], "failed": r["failed"]}
               for r in result["rows"] if r["clients"] == p],
              f"{p} client processes, {batch:,} keys per request")
    for r in result["ratios"]:
        say(f"{r['clients']} client processes: {workers} workers / floor: keys/s "
            f"{r['keys_per_s']:.2f}×, p99 {r['p99']:.2f}×")
    mib = 2**20
    for name, mem in result["memory"].items():
        shared = (f"; the shared table's files: {mem['table_bytes'] / mib:,.1f} MiB"
                  if mem["table_bytes"] is not None else "")
        table([{"name": p["process"], "RSS MiB": p["rss"] / mib, "PSS MiB": p["pss"] / mib}
               for p in mem["processes"]],
              f"memory of {name} (table {result['table_bytes'] / mib:,.1f} MiB{shared})")
    say(f"client: {result['client']}; {result['cpus']} CPUs")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--client-processes", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args(argv)
    clients = [int(c) for c in args.client_processes.split(",")]

    result = print_workers(args.keys, args.dim, [args.batch], args.workers, clients,
                           args.seconds, print_rows)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
