"""Many callers as processes on one GPU (`hps bench gpu --profile processes`).

An inference node's callers are processes (HTTP workers, a model server's instances).
Here N processes (1, 2, 4, 8) each loop the public call, `HPS.lookup_fromdlpack(keys, out,
model, 0)` with torch tensors, 2,000 keys a call, each process on its own torch stream
(made current once) with a sync after each call, for `seconds` per point; the host clock
around call and sync gives each call's latency. Eight processes are started and loaded once
per row family; the first N of them run at each point. Families, side by side:

- floor: `torch.index_select` from ONE dense [table_keys, dim] table that the bench
  process made and every process maps through CUDA IPC (torch.multiprocessing);
- own caches: each process loads the model with its own GPU cache (gpu_cache_scope
  process);
- shared cache: every process serves the model from one GPU cache per device
  (gpu_cache_scope host, hps/gpu/shared_cache.py): the first allocates and warms it up,
  the others map it;
- threads: N threads of one process instead, each on its own stream (the threads
  profile, hps/tools/bench/gpu_threads.py, run in a process of its own), for comparison.

Workloads: "all hits" (power-law keys, alpha 1.1, the whole table cached: gpucacheper 1)
and "cache 25%" (the same keys, a dynamic cache of a quarter of the table, misses fetched
from the in-process tier and inserted). Every process checks its last output against the
model files. Beside each row: whether an MPS control daemon answers (hps/runtime/mps.py),
the GPU memory in use on the device while the eight processes are loaded, and what
nvidia-smi lists per process (MiB). `targets` reads issue 59's targets off the rows.

`--mps both` runs the whole profile twice, each time in a child process: with an MPS
control daemon this bench starts in a temporary pipe directory, and with none (an empty
one): the rows of both, MPS on and off, in one table.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench.gpu_public import folder_config
from hps.tools.bench.gpu_threads import draws

PROCESS_COUNTS = (1, 2, 4, 8)
FAMILIES = ("floor", "threads", "own caches", "shared cache")
MPS_MODES = ("as-is", "on", "off", "both")
WORKLOADS = ("all hits", "cache 25%")
#: HierarchicalKV's C++ find from 8 threads on one H100 (issue 39's measurement)
HKV_AT_8 = 205.0
MODEL = "bench"


def process_config(folder: Path, dim: int, n: int, device_id: int, cached: float,
            scope: str) -> dict[str, Any]:
    return folder_config(folder, dim, n, device_id, model=MODEL, gpucacheper=cached,
                         hit_rate_threshold=1.0, embedding_cache_type="dynamic",
                         cache_refresh_percentage_per_iteration=1.0 if cached >= 1 else 0.0,
                         gpu_cache_scope=scope)


def caller(index: int, family: str, setup: dict[str, Any], dense: Any, ready: Any,
            go: Any, results: Any) -> None:
    """One process: load (or map), warm its workspaces, then at each `go` signal run the
    point it is part of and put (index, keys, seconds, latencies, wrong rows)."""
    import torch

    device = setup["device"]
    torch.cuda.set_device(device)
    folder, n, dim = Path(setup["folder"]), setup["n"], setup["dim"]
    keys_file = np.memmap(folder / "t0" / "key", np.int64, "r")
    rows_file = np.memmap(folder / "t0" / "emb_vector", np.float32, "r").reshape(-1, dim)
    rng = np.random.default_rng(setup["seed"] + index)
    positions = draws(rng, keys_file.size, n, 8, setup["alpha"], False)
    stream = torch.cuda.Stream(device=device)
    torch.cuda.set_stream(stream)
    out = torch.empty((n, dim), device=f"cuda:{device}")
    if family == "floor":
        pos = [torch.as_tensor(p, device=f"cuda:{device}") for p in positions]
        if isinstance(dense, dict):  # a table on each device (the node bench's floor)
            dense = dense[device]

        def call(i: int) -> None:
            torch.index_select(dense, 0, pos[i % 8], out=out)
        hps = None
    else:
        from hps.api import HPS

        hps = HPS(setup["config"])
        keys = [torch.as_tensor(np.ascontiguousarray(keys_file[p]), device=f"cuda:{device}")
                for p in positions]

        def call(i: int) -> None:
            hps.lookup_fromdlpack(keys[i % 8], out, MODEL, 0)
    for i in range(8 * (4 if setup["cached"] < 1 else 1)):  # workspaces, and a cache's misses
        call(i)
        stream.synchronize()
    ready.put(index)
    while True:
        item = go.get()
        if item is None:
            break
        seconds = float(item)
        lat: list[float] = []
        clock = time.perf_counter
        stop = clock() + seconds
        done = i = 0
        begin = clock()
        while True:
            start = clock()
            call(i)
            stream.synchronize()
            end = clock()
            lat.append(end - start)
            done += n
            i += 1
            if end >= stop:
                break
        elapsed = clock() - begin
        call(0)
        stream.synchronize()
        wrong = int((out.cpu().numpy() != rows_file[positions[0]]).any(axis=1).sum())
        hit_rate = (hps.server.model(MODEL).tables[0].gpu[device].stats()["hit_rate"]
                    if hps is not None else 1.0)
        results.put((index, done, elapsed, lat[::4], wrong, hit_rate))
    if hps is not None:
        hps.close()


def gpu_memory() -> tuple[int, list[int]]:
    """(MiB in use on device 0, MiB nvidia-smi lists per process)."""
    used, per = gpu_memory_by_process()
    return used, list(per.values())


def gpu_memory_by_process() -> tuple[int, dict[int, int]]:
    """(MiB in use on device 0, MiB per process as nvidia-smi lists them, by process id;
    a process whose id it cannot say under a negative key of its own); (-1, {}) where
    nvidia-smi does not answer."""
    used, per = -1, {}
    with contextlib.suppress(Exception):
        used = int(nvidia_smi("--query-gpu=memory.used", "-i", "0").split()[0])
        per = per_process_mib(nvidia_smi("--query-compute-apps=pid,used_memory"))
    return used, per


def nvidia_smi(*query: str) -> str:
    """What `nvidia-smi QUERY... --format=csv,noheader,nounits` prints."""
    return subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=20).stdout


def per_process_mib(listing: str) -> dict[int, int]:
    """nvidia-smi's `pid, used_memory` lines (csv, no header, no units) as MiB by process
    id; a process whose id it cannot say (a container's) under a negative key of its own."""
    per: dict[int, int] = {}
    for line in listing.splitlines():
        pid, _, mib = (part.strip() for part in line.partition(","))
        if mib.isdigit():
            per[int(pid) if pid.isdigit() else -1 - len(per)] = int(mib)
    return per


class Callers:
    """`caller` processes, one per setup, each loaded and then told to run the points it
    is part of (`point`: the first `count` of them at once; `run`: the ones named); `stop`
    ends them. The `owners` (indices) load one at a time before the others start (a
    shared cache: each allocates and warms up its device's, the others map it)."""

    def __init__(self, family: str, setups: list[dict[str, Any]], dense: Any = None,
                 owners: tuple[int, ...] = ()) -> None:
        ctx = mp.get_context("spawn")
        self._ready, self._results = ctx.Queue(), ctx.Queue()
        self._gos = [ctx.Queue() for _ in setups]
        self._procs = [ctx.Process(target=caller, daemon=True,
                                   args=(index, family, setup, dense, self._ready,
                                         self._gos[index], self._results))
                       for index, setup in enumerate(setups)]
        try:
            for index in owners:
                self._procs[index].start()
                self._ready.get(timeout=900)
            rest = [p for i, p in enumerate(self._procs) if i not in owners]
            for p in rest:
                p.start()
            for _ in rest:
                self._ready.get(timeout=900)
        except BaseException:
            self.stop()
            raise

    def point(self, count: int, seconds: float) -> list[tuple[Any, ...]]:
        """Each of the first `count` callers' (index, keys, seconds, latencies, wrong rows,
        hit rate) of `seconds` run at once."""
        return self.run(range(count), seconds)

    def run(self, indices: Iterable[int], seconds: float) -> list[tuple[Any, ...]]:
        """`point` of the callers `indices`."""
        chosen = list(indices)
        for index in chosen:
            self._gos[index].put(seconds)
        return [self._results.get(timeout=seconds * 10 + 300) for _ in chosen]

    def stop(self) -> None:
        for q, p in zip(self._gos, self._procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            if p.pid is None:  # never started
                continue
            p.join(60)
            if p.is_alive():
                p.kill()


def _family(family: str, workload: str, setup: dict[str, Any], dense: Any,
            seconds: float) -> list[dict[str, Any]]:
    cached = 0.25 if "25%" in workload else 1.0
    scope = "host" if family == "shared cache" else "process"
    setup = {**setup, "cached": cached,
             "config": process_config(Path(setup["folder"]), setup["dim"], setup["n"],
                                      setup["device"], cached, scope)}
    # only the floor maps the dense table
    callers = Callers(family, [setup] * max(PROCESS_COUNTS),
                      dense if family == "floor" else None,
                      owners=(0,) if family == "shared cache" else ())
    used, per = gpu_memory()
    from hps.runtime.mps import daemon_found

    mps = daemon_found()
    rows = []
    try:
        for count in PROCESS_COUNTS:
            got = callers.point(count, seconds)
            keys = sum(g[1] for g in got)
            elapsed = max(g[2] for g in got)
            lat = [s for g in got for s in g[3]]
            rows.append({
                "bench": "processes", "family": family, "workload": workload,
                "processes": count, "mkeys_s": keys / elapsed / 1e6,
                "p50_us": float(np.percentile(lat, 50)) * 1e6,
                "p99_us": float(np.percentile(lat, 99)) * 1e6,
                "wrong_rows": sum(g[4] for g in got), "mps": mps,
                "each_mkeys_s": [round(g[1] / g[2] / 1e6, 1) for g in sorted(got)],
                "hit_rate": min(g[5] or 0.0 for g in got),
                "gpu_used_mib": used, "per_process_mib": per})
    finally:
        callers.stop()
    return rows


def _threads_child(table_keys: int, seconds: float, workload: str, results: Any) -> None:
    from hps.tools.bench.gpu_threads import bench_threads

    results.put(bench_threads(table_keys=table_keys, seconds=seconds, workloads=(workload,),
                              stream_per_thread=True))


def _threads(workload: str, setup: dict[str, Any], seconds: float) -> list[dict[str, Any]]:
    """The threads profile's rows for `workload`, from a process of their own, as rows of
    this profile (threads in place of processes)."""
    from hps.runtime.mps import daemon_found

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    name = "all hits, power law" if workload == "all hits" else "cache 25%, power law"
    p = ctx.Process(target=_threads_child, daemon=True,
                    args=(setup["table_keys"], seconds, name, results))
    p.start()
    try:
        got = results.get(timeout=900)
    finally:
        p.join(60)
    return [{"bench": "processes", "family": "threads", "workload": workload,
             "processes": r["threads"], "mkeys_s": r["mkeys_s"], "p50_us": float("nan"),
             "p99_us": r["p99_us"], "vs_threads_floor": r["vs_floor"],
             "wrong_rows": r["wrong_rows"], "mps": daemon_found(), "each_mkeys_s": [],
             "hit_rate": float("nan"), "gpu_used_mib": -1, "per_process_mib": []}
            for r in got]


def bench_processes(dim: int = 64, n: int = 2000, table_keys: int = 1 << 22,
                    alpha: float = 1.1, seconds: float = 3.0, device_id: int = 0,
                    seed: int = 0, workloads: tuple[str, ...] = WORKLOADS,
                    families: tuple[str, ...] = FAMILIES) -> list[dict[str, Any]]:
    """The rows of the processes profile (see the module docstring)."""
    import torch

    from hps import write_sparse_model

    rng = np.random.default_rng(seed)
    keys = rng.choice(2**40, table_keys, replace=False).astype(np.int64)
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_sparse_model(folder / "t0", keys, rows)
        dense = torch.as_tensor(rows, device=f"cuda:{device_id}")
        del rows
        setup = {"folder": str(folder), "n": n, "dim": dim, "device": device_id,
                 "alpha": alpha, "seed": seed, "table_keys": table_keys}
        for workload in workloads:
            for family in families:
                if family == "floor" and workload != WORKLOADS[0]:
                    continue  # the floor has no misses: one family of rows
                if family == "threads":
                    out += _threads(workload, setup, seconds)
                    continue
                out += _family(family, workload, setup, dense, seconds)
        del dense
    return out


def format_processes(rows: list[dict[str, Any]]) -> str:
    """The rows as the profile's table, each beside the floor and the own caches at N."""
    floor = {(r["mps"], r["processes"]): r["mkeys_s"] for r in rows if r["family"] == "floor"}
    own = {(r["mps"], r["workload"], r["processes"]): r["mkeys_s"] for r in rows
           if r["family"] == "own caches"}
    lines = [f"{'family, workload':30s} {'N':>2s} {'M keys/s':>9s} {'p50 us':>7s} "
             f"{'p99 us':>7s} {'x floor':>8s} {'x own':>6s} {'wrong':>6s} {'MPS':>4s} "
             f"{'GPU MiB':>8s}  per process MiB"]
    for r in rows:
        f = floor.get((r["mps"], r["processes"]))
        o = own.get((r["mps"], r["workload"], r["processes"]))
        lines.append(
            f"{r['family'] + ', ' + r['workload']:30s} {r['processes']:2d} "
            f"{r['mkeys_s']:9.1f} {r['p50_us']:7.0f} {r['p99_us']:7.0f} "
            f"{r['mkeys_s'] / f if f else float('nan'):8.2f} "
            f"{r['mkeys_s'] / o if o else float('nan'):6.2f} {r['wrong_rows']:6d} "
            f"{'on' if r['mps'] else 'off':>4s} {r['gpu_used_mib']:8d}  "
            f"{' '.join(map(str, r['per_process_mib']))}  "
            f"(each: {' '.join(map(str, r['each_mkeys_s']))}; hit rate >= {r['hit_rate']:.3f})")
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 59's targets of the processes profile (of the rows with MPS on, where there
    are such): the shared cache >= 0.9x the own caches at each N (with misses: >= 1.0x),
    >= 2x HierarchicalKV at 8 with all hits, p99 <= 100 us at 8; threads >= their floor
    (index_select from the same threads) at 2, 4 and 8, p99 <= 1 ms at 8; every vector
    exact."""
    rows = [r for r in rows if r.get("bench") == "processes"]
    if any(r["mps"] for r in rows):
        rows = [r for r in rows if r["mps"]]
    own = {(r["workload"], r["processes"]): r for r in rows if r["family"] == "own caches"}
    out = []

    def add(target: str, measured: float, ok: bool) -> None:
        out.append({"target": target, "measured": measured, "met": "yes" if ok else "NO"})

    for r in rows:
        name = f"{r['family']}, {r['workload']}, {r['processes']} processes"
        add(f"{name}: every vector exact", r["wrong_rows"], r["wrong_rows"] == 0)
        if r["family"] == "threads" and r["processes"] > 1:
            name = f"threads, {r['workload']}, {r['processes']} threads"
            add(f"{name}: >= their floor", r["vs_threads_floor"], r["vs_threads_floor"] >= 1.0)
            if r["processes"] == max(PROCESS_COUNTS):
                add(f"{name}: p99 <= 1 ms", r["p99_us"], r["p99_us"] <= 1000.0)
        if r["family"] != "shared cache":
            continue
        o = own.get((r["workload"], r["processes"]))
        share = 1.0 if "25%" in r["workload"] else 0.9
        if o is not None:
            add(f"{name}: >= {share} x own caches", r["mkeys_s"] / o["mkeys_s"],
                r["mkeys_s"] >= share * o["mkeys_s"])
        if r["processes"] == max(PROCESS_COUNTS):
            add(f"{name}: p99 <= 100 us", r["p99_us"], r["p99_us"] <= 100.0)
            if "25%" not in r["workload"]:
                add(f"{name}: >= 2 x HierarchicalKV ({2 * HKV_AT_8:g} M keys/s)",
                    r["mkeys_s"], r["mkeys_s"] >= 2 * HKV_AT_8)
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--table-keys", type=int, default=1 << 22)
    parser.add_argument("--workload", action="append", choices=WORKLOADS)
    parser.add_argument("--family", action="append", choices=FAMILIES)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--mps", choices=MPS_MODES, default="as-is",
                        help="as-is: whatever daemon the environment has; on / off / both: "
                             "the profile in a child process with a daemon this bench "
                             "starts, with none, or each in turn")
    args = parser.parse_args()
    if args.mps == "as-is":
        rows = bench_processes(seconds=args.seconds, table_keys=args.table_keys,
                               workloads=tuple(args.workload or WORKLOADS),
                               families=tuple(args.family or FAMILIES))
    else:
        argv = _without_option(_without_option(sys.argv[1:], "--json"), "--mps")
        rows = [r for mode in (("on", "off") if args.mps == "both" else (args.mps,))
                for r in _with_mps(mode, argv)]
    print(format_processes(rows), flush=True)
    found = targets(rows)
    unmet = [t for t in found if t["met"] != "yes"]
    print(f"issue 59's targets: {len(found) - len(unmet)} of {len(found)} met"
          + "".join(f"\n  NO  {t['target']} ({t['measured']:.2f})" for t in unmet),
          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _without_option(argv: list[str], option: str) -> list[str]:
    """argv less `option` and its value (as `--option value` or `--option=value`)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def _with_mps(mode: str, argv: list[str]) -> list[dict[str, Any]]:
    """The profile's rows from a child process run with an MPS control daemon started
    here in a temporary pipe directory (mode "on"), or with an empty one ("off")."""
    from hps.errors import HPSError
    from hps.runtime import mps

    with tempfile.TemporaryDirectory(prefix="hps-mps-") as tmp:
        pipes, logs = Path(tmp) / "pipe", Path(tmp) / "log"
        pipes.mkdir()
        logs.mkdir()
        if mode == "on":
            mps.start(pipes, logs)
        try:
            out = Path(tmp) / "rows.json"
            env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipes),
                   "CUDA_MPS_LOG_DIRECTORY": str(logs)}
            print(f"-- MPS {mode}", flush=True)
            subprocess.run([sys.executable, "-m", "hps.tools.bench.gpu_processes", *argv,
                            "--json", str(out)], env=env, check=True)
            return list(json.loads(out.read_text()))
        finally:
            if mode == "on":
                with contextlib.suppress(HPSError):
                    mps.stop(pipes, 10.0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
