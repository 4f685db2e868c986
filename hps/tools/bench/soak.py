"""A soak of `hps serve`: lookups from many clients while the model reloads and Redis dies.

`soak(seconds)` serves a two-table model (Redis volatile tier over RocksDB) with
`hps serve` in a subprocess and, for `seconds`:

- `clients` threads look up random batches (known keys and a few unknown) through the
  binary endpoint, each on its own keep-alive connection, and check every answer against
  the model's files: it must be 200 and equal, whole, to one version of the model;
- a reloader swaps the model between two versions of its files (same keys, other
  vectors) every `reload_every` seconds, through `POST /v1/models/{model}/reload`;
- Redis is killed (SIGKILL) and restarted `redis_restarts` times, evenly spread;
- with `update_rows`, online updates through a Redis stream of their own, their rounds
  checked in every worker (soak_updates.py); `workers`: `hps serve --workers N`.

It returns (and `hps bench soak --minutes N` prints) the lookups answered, failed (not
200, or no answer) and wrong (not one version whole), the reloads, the Redis restarts,
latency p50/p99/max and the lookups slower than SLOW_S, the RSS of the server's processes
at the start and the end, and the RocksDB folder and its write-ahead log at the end.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench.cpus import children
from hps.tools.bench.soak_updates import UpdateLoad

MODEL = "soak"
DIMS = (8, 32)
NUM_KEYS = 20_000
DEFAULT = 0.5
BATCH = 256
#: a lookup slower than this is counted (a worker that stood still)
SLOW_S = 0.5


@dataclass
class SoakResult:
    seconds: float
    lookups: int = 0
    failed: int = 0
    wrong: int = 0
    reloads: int = 0
    reloads_failed: int = 0
    redis_restarts: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)
    rss_start_mib: float = 0.0
    rss_end_mib: float = 0.0
    store_mib: float = 0.0  # the RocksDB folder at the end
    wal_mib: float = 0.0  # of it, the write-ahead log
    updates: Any = None  # soak_updates.UpdateResult, with `update_rows`
    errors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No lookup failed or wrong, no reload failed, no update round stale."""
        updates_ok = self.updates is None or not (self.updates.stale or self.updates.errors)
        return not (self.failed or self.wrong or self.reloads_failed) and updates_ok

    def percentile_ms(self, q: float) -> float:
        return 1e3 * float(np.percentile(self.latencies, q)) if self.latencies else 0.0


def _rss_mib(pid: int) -> float:
    """RSS of `pid` and its children (the workers of `hps serve --workers N`)."""
    total = 0.0
    with contextlib.suppress(OSError):  # gone meanwhile
        with open(f"/proc/{pid}/status") as f:
            total = next((int(line.split()[1]) / 1024 for line in f
                          if line.startswith("VmRSS:")), 0.0)
    return total + sum(_rss_mib(c) for c in children(pid))


def _folder_mib(folder: Path, suffix: str = "") -> float:
    total = 0
    for entry in folder.glob(f"*{suffix}"):  # a loop over the store's files
        with contextlib.suppress(OSError):
            total += entry.stat().st_size
    return total / 2**20


def _write_versions(folder: Path) -> tuple[np.ndarray, list[list[np.ndarray]], list[list[str]]]:
    """Keys, the vectors of two versions per table, and each version's sparse_files."""
    from hps.modelfiles.formats.sparse_folder import write_sparse_model

    rng = np.random.default_rng(7)
    keys = rng.choice(2**40, NUM_KEYS, replace=False).astype(np.int64)
    vectors: list[list[np.ndarray]] = []
    files: list[list[str]] = []
    for v in range(2):
        rows = [rng.standard_normal((NUM_KEYS, d)).astype(np.float32) for d in DIMS]
        paths = []
        for t, r in enumerate(rows):
            path = folder / f"v{v}" / f"t{t}"
            write_sparse_model(path, keys, r)
            paths.append(str(path))
        vectors.append(rows)
        files.append(paths)
    return keys, vectors, files


def soak(seconds: float, *, clients: int = 8, reload_every: float = 5.0,
         redis_restarts: int = 2, workers: int = 1, update_rows: int = 0,
         check_every: float = 10.0, log: Callable[[str], None] = lambda _: None
         ) -> SoakResult:
    """Run the soak for `seconds`; see the module docstring. `update_rows`: rows a second
    of online updates (0: none), a round of them checked every `check_every` seconds."""
    from hps.tools.bench.http import _free_port, _http_server
    from hps.tools.bench.redis_servers import RedisServer

    result = SoakResult(seconds)
    log(f"soak of {seconds:g} s: {workers} worker(s), {clients} clients, a reload every "
        f"{reload_every:g} s, {redis_restarts} Redis restarts, {update_rows:,} update rows "
        "a second …")
    with tempfile.TemporaryDirectory(prefix="hps-soak-") as tmp:
        folder = Path(tmp)
        keys, vectors, files = _write_versions(folder / "models")
        order = np.argsort(keys)
        sorted_keys = keys[order]
        redis = RedisServer(folder / "redis").start()
        stream = RedisServer(folder / "stream").start() if update_rows else None
        config = {
            "models": [{"model": MODEL, "sparse_files": files[0],
                        "embedding_vecsize_per_table": list(DIMS),
                        "maxnum_catfeature_query_per_table_per_sample": [BATCH] * 2,
                        "default_value_for_each_table": [DEFAULT] * 2,
                        "max_batch_size": 1, "gpucache": False, "deployed_device_list": [0]}],
            "volatile_db": {"type": "redis_cluster", "address": redis.address,
                            "num_partitions": 8, "reconnect_backoff": 0.05,
                            "reconnect_backoff_max": 0.5, "socket_timeout": 1.0},
            "persistent_db": {"type": "rocks_db", "path": str(folder / "rocksdb")},
            "http": {"workers": workers},
        }
        if stream is not None:
            config["update_source"] = {"type": "redis_stream", "address": stream.address}
        (folder / "ps.json").write_text(json.dumps(config))
        pids: list[int] = []
        try:
            with _http_server(folder / "ps.json", _free_port(), 2, None, pids=pids) as url:
                host, port = url.split(":")
                result.rss_start_mib = _rss_mib(pids[0])
                gate = threading.Lock()  # a reload and an update check, one at a time
                updates = None if stream is None else UpdateLoad(
                    config, MODEL, 0, DIMS[0], host, int(port), workers, update_rows,
                    check_every, gate, log).start()
                try:
                    _run(result, host, int(port), keys, sorted_keys, order, vectors, files,
                         clients, reload_every, redis_restarts, redis, gate, log)
                finally:
                    result.updates = None if updates is None else updates.stop()
                result.rss_end_mib = _rss_mib(pids[0])
                result.store_mib = _folder_mib(folder / "rocksdb")
                result.wal_mib = _folder_mib(folder / "rocksdb", ".log")
        finally:
            redis.close()
            if stream is not None:
                stream.close()
    return result


def _run(result: SoakResult, host: str, port: int, keys: np.ndarray,
         sorted_keys: np.ndarray, order: np.ndarray, vectors: list[list[np.ndarray]],
         files: list[list[str]], clients: int, reload_every: float, redis_restarts: int,
         redis: Any, gate: threading.Lock, log: Callable[[str], None]) -> None:
    stop = threading.Event()
    lock = threading.Lock()

    def expected(version: int, table: int, batch: np.ndarray) -> np.ndarray:
        at = np.minimum(np.searchsorted(sorted_keys, batch), sorted_keys.size - 1)
        hit = sorted_keys[at] == batch
        out = np.full((batch.size, DIMS[table]), DEFAULT, np.float32)
        out[hit] = vectors[version][table][order[at[hit]]]
        return out

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        conn = http.client.HTTPConnection(host, port, timeout=60)
        headers = {"Content-Type": "application/octet-stream"}
        while not stop.is_set():
            table = int(rng.integers(0, 2))
            batch = np.r_[rng.choice(keys, BATCH - 4), rng.integers(2**41, 2**42, 4)]
            started = time.perf_counter()
            try:
                conn.request("POST", f"/v1/models/{MODEL}/tables/{table}/lookup",
                             batch.astype("<i8").tobytes(), headers)
                answer = conn.getresponse()
                body = answer.read()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                with lock:
                    result.failed += 1
                    result.errors.append(f"lookup: {exc!r}")
                continue
            took = time.perf_counter() - started
            ok = answer.status == 200
            right = False
            if ok:
                got = np.frombuffer(body, "<f4").reshape(batch.size, DIMS[table])
                right = any(np.array_equal(got, expected(v, table, batch)) for v in (0, 1))
            with lock:
                result.lookups += 1
                result.latencies.append(took)
                if not ok:
                    result.failed += 1
                    result.errors.append(f"lookup {answer.status}: {body[:200]!r}")
                elif not right:
                    result.wrong += 1
        conn.close()

    def reloader() -> None:
        version = 0
        while not stop.wait(reload_every):
            version = 1 - version
            conn = http.client.HTTPConnection(host, port, timeout=300)
            try:
                with gate:
                    # keys only updates added are not in the files: the version
                    # shrinks by them, which the load gate refuses unless told
                    conn.request("POST", f"/v1/models/{MODEL}/reload",
                                 json.dumps({"sparse_files": files[version],
                                             "allow_shrink": True}),
                                 {"Content-Type": "application/json"})
                    answer = conn.getresponse()
                    body = answer.read()
                good = answer.status == 200
            except (OSError, http.client.HTTPException) as exc:
                good, body = False, repr(exc).encode()
            finally:
                conn.close()
            with lock:
                result.reloads += 1
                if not good:
                    result.reloads_failed += 1
                    result.errors.append(f"reload: {body[:200]!r}")
            log(f"reload {result.reloads} to v{version}: {'ok' if good else 'FAILED'}")

    threads = [threading.Thread(target=client, args=(i,), name=f"soak-client-{i}")
               for i in range(clients)]
    threads.append(threading.Thread(target=reloader, name="soak-reloader"))
    started = time.monotonic()
    for t in threads:
        t.start()
    try:
        # Redis dies at even points of the run, and is back after a fifth of the gap
        gap = result.seconds / (redis_restarts + 1)
        for n in range(1, redis_restarts + 1):
            if stop.wait(max(0.0, started + n * gap - time.monotonic())):
                break
            redis.kill()
            log(f"redis killed ({n}/{redis_restarts})")
            stop.wait(min(gap / 5, 5.0) * random.uniform(0.8, 1.2))
            redis.start()
            result.redis_restarts += 1
            log("redis restarted")
        stop.wait(max(0.0, started + result.seconds - time.monotonic()))
    finally:
        stop.set()
        for t in threads:
            t.join(120)


def print_result(r: SoakResult) -> None:
    print(f"soak of {r.seconds:.0f} s: {r.lookups:,} lookups, {r.failed} failed, "
          f"{r.wrong} wrong; {r.reloads} reloads ({r.reloads_failed} failed); "
          f"{r.redis_restarts} Redis restarts")
    slow = int(np.count_nonzero(np.asarray(r.latencies) > SLOW_S))
    print(f"  latency p50 {r.percentile_ms(50):.2f} ms, p99 {r.percentile_ms(99):.2f} ms, "
          f"max {r.percentile_ms(100):.0f} ms, {slow} over {SLOW_S * 1e3:.0f} ms; server "
          f"RSS (every process) {r.rss_start_mib:.0f} MiB at the start, "
          f"{r.rss_end_mib:.0f} MiB at the end")
    print(f"  RocksDB {r.store_mib:.0f} MiB at the end, {r.wal_mib:.0f} MiB of it "
          "write-ahead log")
    u = r.updates
    if u is not None:
        seen = (f"visible in every worker in p50 {1e3 * np.median(u.visible_s):.0f} ms, "
                f"max {1e3 * max(u.visible_s):.0f} ms" if u.visible_s else "none visible")
        print(f"  updates: {u.rows:,} rows published; {u.checks} rounds checked, "
              f"{u.stale} stale; {seen}")
    for line in (r.errors + ([] if u is None else u.errors))[:10]:
        print(f"  {line}")
