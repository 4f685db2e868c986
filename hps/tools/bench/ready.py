"""Ready means fast: real `hps serve` processes, from their start to their first lookups.

For each checkout of the code measured (`--checkout PATH`, repeatable: the server runs
with `PYTHONPATH=PATH`, so one run prints the code before and after a change), each model
(the demo's, `hps demo`'s two tables, and with `--keys N` a table of N keys of `--dim`
float32), each process count (one process, `--workers 2`) and each working folder (the
checkout's own, where a worker could import the checkout's `hps` instead of the one that
started it, and another folder), the profile starts `hps serve` subprocesses and prints:

- **ready cold**: seconds from the process start to `/readyz` 200, with an empty numba
  cache folder (`NUMBA_CACHE_DIR`; with `--gpu` an empty CuPy cache too) and no store;
- then the **first** `first` lookups (1,000) after that ready: p50 and p99 in ms and the
  answers other than 200, against lookups `later` to `later + first` (10,000-11,000) of
  the same process;
- **ready warm**: the same config started again over the store the cold run filled (the
  same files) and the numba cache it wrote; its first `first` lookups' p99 and non-200;
- **worker back** (`--workers 2` only): in that warm server, one worker killed (SIGKILL);
  seconds until the supervisor has started another and `/readyz` is 200 again.

Lookups are binary POSTs of `batch` int64 keys drawn from the model's tables (the tables
in turn), over `connections` keep-alive `http.client` connections used in turn (several,
so that both workers of `--workers 2` answer); a connection that fails counts as a
non-200 answer and is opened again. httpx would be slower than the server. The load
average is printed before and after: the machine's load moves these figures.

`--gpu` puts the tables in a GPU cache (`gpucache: true`), for the GPU machine.

Run `hps bench ready` or `python3 -m hps.tools.bench.ready`.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hps.errors import HPSError

#: what each row of the profile holds, in print order: (key, heading)
COLUMNS = (
    ("checkout", "checkout"), ("model", "model"), ("workers", "workers"),
    ("folder", "folder"), ("ready_cold_s", "ready cold s"),
    ("first_p50_ms", "first p50 ms"), ("first_p99_ms", "first p99 ms"),
    ("first_non_200", "first non-200"), ("later_p50_ms", "later p50 ms"),
    ("later_p99_ms", "later p99 ms"), ("later_non_200", "later non-200"),
    ("ready_warm_s", "ready warm s"), ("warm_first_p99_ms", "warm first p99 ms"),
    ("warm_first_non_200", "warm first non-200"), ("worker_back_s", "worker back s"),
)
#: seconds between two looks at /readyz
_POLL = 0.05


class BenchServerError(HPSError):
    """A server the profile started exited or did not get ready in time."""


@dataclass
class Model:
    """A model written for the profile: its config block and keys to look up per table."""

    name: str
    block: dict[str, Any]
    keys: list[np.ndarray] = field(default_factory=list)


def write_models(folder: Path, demo_scale: float, keys: int, dim: int) -> list[Model]:
    """The demo's model (`demo_scale` of its size; 0: none) and a table of `keys` keys of
    width `dim` (0 keys: none), written under `folder`."""
    from hps.modelfiles.formats.sparse_folder import SparseModelReader, write_sparse_model
    from hps.tools.bench.tiers import make_table
    from hps.tools.demo import TABLES, write_model

    models = []
    if demo_scale > 0:
        config = json.loads(write_model(folder / "demo", scale=demo_scale).read_text())
        block = config["models"][0]
        block["sparse_files"] = [str(folder / "demo" / f) for f in block["sparse_files"]]
        sample = []
        for name, _, _ in TABLES:
            with SparseModelReader(str(folder / "demo" / name)) as reader:
                sample.append(reader.read_keys(0, min(reader.num_keys, 100_000)))
        models.append(Model("demo", block, sample))
    if keys > 0:
        table_keys, vectors = make_table(keys, dim)
        write_sparse_model(folder / "big" / "table0", table_keys, vectors)
        del vectors
        block = {"model": "big", "sparse_files": [str(folder / "big" / "table0")],
                 "embedding_table_names": ["table0"], "embedding_vecsize_per_table": [dim],
                 "maxnum_catfeature_query_per_table_per_sample": [16],
                 "default_value_for_each_table": [0.0], "deployed_device_list": [0],
                 "max_batch_size": 1024, "gpucacheper": 0.5}
        drawn = np.random.default_rng(0).choice(table_keys, min(keys, 100_000))
        models.append(Model("big", block, [drawn]))
    return models


def _config(model: Model, store: Path, gpu: bool) -> dict[str, Any]:
    block = {**model.block, "gpucache": gpu}
    return {"supportlonglong": True, "models": [block],
            "volatile_db": {"type": "hash_map", "num_partitions": 16},
            "persistent_db": {"type": "rocks_db", "path": str(store)}}


class Server:
    """`hps serve` of one config in a subprocess, timed from its start to ready."""

    def __init__(self, config: Path, workers: int, checkout: Path, cwd: Path,
                 env: dict[str, str], log_path: Path, timeout: float) -> None:
        from hps.tools.bench.redis_servers import free_port

        self.port = free_port()
        self.timeout = timeout
        self.log_path = log_path
        argv = [sys.executable, "-m", "hps.tools.cli", "serve", str(config),
                "--port", str(self.port), "--workers", str(workers)]
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            argv, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
            # the checkout first; what the caller's path held (carried wheels) after it
            env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(
                filter(None, (str(checkout), os.environ.get("PYTHONPATH"))))})
        try:
            self.ready_seconds = self._wait_ready() - self.started
        except BaseException:
            self.stop()  # never left running behind a failed start
            raise

    def _ready(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/readyz")
            return conn.getresponse().status == 200
        except OSError:  # not listening yet, or a worker reset the connection
            return False
        finally:
            conn.close()

    def _wait_ready(self, also: Any = None) -> float:
        """perf_counter() at the first /readyz 200 (and `also()` true)."""
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchServerError(f"hps serve exited ({self.proc.returncode}): "
                                       + self.log_path.read_text()[-2000:])
            if (also is None or also()) and self._ready():
                return time.perf_counter()
            if time.monotonic() > deadline:
                raise BenchServerError(f"hps serve not ready within {self.timeout:.0f} s: "
                                       + self.log_path.read_text()[-2000:])
            time.sleep(_POLL)

    def workers(self) -> list[int]:
        """The process ids of the supervisor's children (its workers)."""
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        with contextlib.suppress(OSError):
            return [int(p) for p in path.read_text().split()]
        return []

    def worker_back(self) -> float:
        """Kill the last worker; seconds until another runs and /readyz is 200 again."""
        before = self.workers()
        if not before:
            raise BenchServerError("no worker process found to kill")
        os.kill(before[-1], signal.SIGKILL)
        killed = time.perf_counter()
        return self._wait_ready(lambda: bool(set(self.workers()) - set(before))) - killed

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@contextlib.contextmanager
def serving(*args: Any) -> Iterator[Server]:
    server = Server(*args)
    try:
        yield server
    finally:
        server.stop()


def lookups(port: int, model: Model, count: int, batch: int, connections: int,
            seed: int, said: Counter[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, status) of `count` binary lookups of `batch` keys, the model's tables in
    turn, over `connections` connections in turn; status 0: the connection failed. Each
    answer other than 200 is counted in `said` by what it was (`_said`)."""
    rng = np.random.default_rng(seed)
    tables = model.block["embedding_table_names"]
    paths = [f"/v1/models/{model.name}/tables/{t}/lookup" for t in tables]
    bodies = [[rng.choice(keys, batch).astype("<i8").tobytes() for _ in range(64)]
              for keys in model.keys]
    headers = {"Content-Type": "application/octet-stream"}
    conns: list[http.client.HTTPConnection | None] = [None] * connections
    seconds, status = np.empty(count), np.zeros(count, np.int32)
    for i in range(count):
        t, c = i % len(tables), i % connections
        body = bodies[t][(i // len(tables)) % 64]
        start = time.perf_counter()
        try:
            conn = conns[c]
            if conn is None:
                conn = conns[c] = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", paths[t], body, headers)
            answer = conn.getresponse()
            data = answer.read()
            status[i] = answer.status
            if answer.status != 200 and said is not None:
                said[_said(answer.status, data)] += 1
        except (OSError, http.client.HTTPException) as exc:
            broken, conns[c] = conns[c], None
            if broken is not None:
                broken.close()
            if said is not None:
                said[f"connection failed ({type(exc).__name__})"] += 1
        seconds[i] = time.perf_counter() - start
    for opened in conns:
        if opened is not None:
            opened.close()
    return seconds, status


def _said(status: int, body: bytes) -> str:
    """What an answer other than 200 was: its status and the error's `kind` where its
    body is hps's JSON error."""
    try:
        kind = json.loads(body).get("kind")
    except (ValueError, AttributeError):
        kind = None
    return f"{status} {kind}" if kind else str(status)


def _window(seconds: np.ndarray, status: np.ndarray) -> tuple[float, float, int]:
    """(p50 ms, p99 ms, answers other than 200) of a window of lookups."""
    if not seconds.size:
        return float("nan"), float("nan"), 0
    return (float(np.percentile(seconds, 50) * 1e3), float(np.percentile(seconds, 99) * 1e3),
            int(np.count_nonzero(status != 200)))


def measure(checkout: Path, model: Model, workers: int, in_checkout: bool, run: Path,
            gpu: bool, first: int, later: int, batch: int, connections: int,
            timeout: float) -> dict[str, Any]:
    """One row: a cold start and its lookups, a warm restart, a worker killed."""
    run.mkdir(parents=True)
    config = run / "ps.json"
    config.write_text(json.dumps(_config(model, run / "rocksdb", gpu), indent=2))
    env = {"NUMBA_CACHE_DIR": str(run / "numba"), "CUPY_CACHE_DIR": str(run / "cupy")}
    cwd = checkout if in_checkout else run
    args = (config, workers, checkout, cwd, env, run / "serve.log", timeout)
    row: dict[str, Any] = {"checkout": str(checkout), "model": model.name, "workers": workers,
                           "folder": "checkout" if in_checkout else "other"}
    said: dict[str, Counter[str]] = {"cold": Counter(), "warm": Counter()}
    row["non_200_said"] = said
    with serving(*args) as server:
        row["ready_cold_s"] = server.ready_seconds
        seconds, status = lookups(server.port, model, later + first, batch, connections, 1,
                                  said["cold"])
    row["first_p50_ms"], row["first_p99_ms"], row["first_non_200"] = _window(
        seconds[:first], status[:first])
    row["later_p50_ms"], row["later_p99_ms"], row["later_non_200"] = _window(
        seconds[later:], status[later:])
    with serving(*args) as server:
        row["ready_warm_s"] = server.ready_seconds
        seconds, status = lookups(server.port, model, first, batch, connections, 2,
                                  said["warm"])
        _, row["warm_first_p99_ms"], row["warm_first_non_200"] = _window(seconds, status)
        row["worker_back_s"] = server.worker_back() if workers > 1 else None
    return row


def bench_ready(checkouts: Sequence[Path], *, demo_scale: float = 1.0, keys: int = 0,
                dim: int = 64, workers: Sequence[int] = (1, 2),
                folders: Sequence[str] = ("checkout", "other"), first: int = 1000,
                later: int = 10_000, batch: int = 16, connections: int = 4,
                gpu: bool = False, timeout: float = 600.0) -> dict[str, Any]:
    """The rows of the module docstring, one per checkout × model × workers × folder,
    with the load average before and after."""
    if not checkouts:
        raise HPSError("no checkout to measure")
    if later < first:
        raise HPSError(f"the later window (from lookup {later:,}) must start after the "
                       f"first {first:,}")
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="hps-bench-ready-"))
    try:
        models = write_models(work / "models", demo_scale, keys, dim)
        rows = []
        for c, checkout in enumerate(checkouts):
            for model in models:
                for n in workers:
                    for folder in folders:
                        run = work / f"{c}-{model.name}-{n}-{folder}"
                        rows.append(measure(Path(checkout).resolve(), model, n,
                                            folder == "checkout", run, gpu, first, later,
                                            batch, connections, timeout))
        return {"rows": rows, "load_before": load_before, "load_after": os.getloadavg(),
                "first": first, "later": later, "batch": batch, "gpu": gpu}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def format_ready(result: dict[str, Any]) -> str:
    """The rows of `bench_ready` as a plain-text table."""
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:,.2f}"
        return str(value)

    table = [[h for _, h in COLUMNS]] + [[cell(r[k]) for k, _ in COLUMNS]
                                         for r in result["rows"]]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    first, later = result["first"], result["later"]
    lines = [f"load average before: {' '.join(f'{x:.2f}' for x in result['load_before'])}"]
    lines += ["  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True))
              for line in table]
    lines.append(f"first: lookups 1-{first:,} after ready; later: lookups {later + 1:,}-"
                 f"{later + first:,}; {result['batch']} keys a lookup"
                 + ("; tables in a GPU cache" if result["gpu"] else ""))
    for r in result["rows"]:  # what the answers other than 200 were, where there were any
        for start, kinds in r.get("non_200_said", {}).items():
            if kinds:
                lines.append(f"{r['checkout']} {r['model']} {r['workers']} worker(s) "
                             f"{r['folder']}, {start} start: answers other than 200: "
                             + ", ".join(f"{n} × {k}" for k, n in sorted(kinds.items())))
    lines.append(f"load average after: {' '.join(f'{x:.2f}' for x in result['load_after'])}")
    return "\n".join(lines)


def default_checkout() -> Path:
    """The checkout this `hps` runs from (the folder holding the `hps` package)."""
    return Path(__file__).resolve().parents[3]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", action="append", type=Path,
                        help="a checkout to measure (PYTHONPATH); repeatable")
    parser.add_argument("--demo-scale", type=float, default=1.0, help="0: no demo model")
    parser.add_argument("--keys", type=int, default=0, help="keys of the big table (0: none)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--workers", type=int, action="append")
    parser.add_argument("--first", type=int, default=1000)
    parser.add_argument("--later", type=int, default=10_000)
    parser.add_argument("--folder", action="append", choices=("checkout", "other"),
                        help="where each server starts (repeatable; default both)")
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args(argv)
    result = bench_ready(args.checkout or [default_checkout()], demo_scale=args.demo_scale,
                         keys=args.keys, dim=args.dim, workers=args.workers or (1, 2),
                         folders=args.folder or ("checkout", "other"), first=args.first,
                         later=args.later, gpu=args.gpu)
    print(format_ready(result))


if __name__ == "__main__":
    main()
