"""Benchmark of online updates from Redis Streams: ingest rate and visibility latency,
beside the lookup rate and latency measured in the same run without ingest.

For each tier set (the in-process hash map alone; the hash map over RocksDB) a server
(`HierarchicalParameterServer`, a consumer group of its own) loads a table of
`table_keys` rows of width `dim` and is timed in three phases, with one thread doing
`lookup` calls of `batch` random keys throughout:

1. lookups alone (`lookup_seconds`): the baseline rate and p50;
2. ingest: `rows` update rows, published beforehand as messages of `per_message` rows to
   the stream the server reads (its group created at the stream's end, so the consumer
   idles during phase 1), are drained once the group is moved back to the first entry
   (XGROUP SETID … 0): rows/s from that moment until the server's counters show every
   message applied; lookup rate and p50 meanwhile;
3. visibility: `samples` times, new rows for `probe` keys are published (XADD) and
   lookups of those keys are repeated until they answer the new rows; the time from
   just before the XADD to that answer is one sample (p50, p99).

The Redis server for the streams is started for the run (`hps.tools.bench.redis_servers`),
one stream serves both tier sets (each reads it with a group of its own).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from hps.config import UpdateSourceConfig
from hps.updates import codec
from hps.updates.contract import UpdatePublisher
from hps.updates.open import open_publisher

MODEL = "bench"
TOPIC = f"hps_et.{MODEL}.table0"


class _Lookups:
    """One thread doing lookups of random batches, recording (end time, seconds) each."""

    def __init__(self, server: Any, keys: np.ndarray, batch: int, seed: int) -> None:
        self.server = server
        self.keys = keys
        self.batch = batch
        self.rng = np.random.default_rng(seed)
        self.times: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-lookups", daemon=True)

    def __enter__(self) -> _Lookups:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        batches = [self.rng.choice(self.keys, self.batch) for _ in range(64)]
        i = 0
        while not self._stop.is_set():
            started = time.perf_counter()
            self.server.lookup(MODEL, 0, batches[i % len(batches)])
            ended = time.perf_counter()
            self.times.append((ended, ended - started))
            i += 1

    def window(self, start: float, stop: float) -> dict[str, float]:
        """Lookups/s and p50 (ms) of the lookups that ended in [start, stop]."""
        taken = sorted(s for end, s in list(self.times) if start <= end <= stop)
        if not taken or stop <= start:
            return {"lookups_per_s": 0.0, "p50_ms": float("nan"), "p99_ms": float("nan")}
        return {"lookups_per_s": len(taken) / (stop - start),
                "p50_ms": statistics.median(taken) * 1e3,
                "p99_ms": taken[min(len(taken) - 1, int(0.99 * len(taken)))] * 1e3}


@contextmanager
def _stream_server() -> Iterator[str]:
    from hps.tools.bench.redis_servers import RedisServer

    with RedisServer() as server:
        yield server.address


def _publish_backlog(publisher: UpdatePublisher, rows: int, dim: int, table_keys: int,
                     per_message: int, rng: np.random.Generator) -> int:
    """`rows` rows (half of them keys the table holds, half new) in messages of
    `per_message` rows (the last one full too); returns the messages."""
    messages = -(-rows // per_message)
    for _ in range(messages):
        keys = rng.integers(0, 2 * table_keys, per_message, dtype=np.int64)
        vectors = rng.standard_normal((per_message, dim), dtype=np.float32)
        publisher.publish(TOPIC, [codec.encode(keys, vectors)])
    return messages


def _config(folder: Path, address: str, group: str, dim: int, batch: int,
            rocksdb: bool, per_message: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "models": [{
            "model": MODEL, "sparse_files": [str(folder / "table0")],
            "embedding_table_names": ["table0"], "embedding_vecsize_per_table": [dim],
            "maxnum_catfeature_query_per_table_per_sample": [1], "max_batch_size": batch,
            "default_value_for_each_table": [0.0], "deployed_device_list": [0],
            "gpucache": False,
        }],
        "volatile_db": {"type": "hash_map"},
        "update_source": {"type": "redis_stream", "address": address, "group": group,
                          "poll_timeout_ms": 100, "max_batch_size": per_message},
    }
    if rocksdb:
        config["persistent_db"] = {"type": "rocks_db", "path": str(folder / f"rocks-{group}")}
    return config


def _wait(done: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not end within {seconds} s")
        time.sleep(0.001)


def _lag(server: Any) -> int | None:
    """Messages of the stream the server has not applied (read by it every second)."""
    status = server.update_status()
    table = status["tables"].get(TOPIC) if status else None
    return table["lag_messages"] if table else None


def _applied(server: Any) -> int:
    """Messages of the stream the server has applied."""
    status = server.update_status()
    table = status["tables"].get(TOPIC) if status else None
    return int(table["messages"]) if table else 0


def _run_one(name: str, config: dict[str, Any], address: str, keys: np.ndarray,
             expected: int, publisher: UpdatePublisher, *, dim: int, batch: int,
             per_message: int, lookup_seconds: float, samples: int, probe: int, seed: int
             ) -> dict[str, Any]:
    import redis

    from hps.server import HierarchicalParameterServer

    rng = np.random.default_rng(seed)
    group = config["update_source"]["group"]
    host, port = address.rsplit(":", 1)
    client = redis.Redis(host=host, port=int(port))
    # the group starts at the stream's end: the consumer idles while the baseline is timed
    client.xgroup_create(TOPIC, group, id="$")
    server = HierarchicalParameterServer(config)
    try:
        # a server with an in-process tier alone replays the stream when it starts (its
        # rows died with the last process): the baseline waits until that is done
        _wait(lambda: _lag(server) == 0, 600, f"{name}: the start-up replay")
        with _Lookups(server, keys, batch, seed) as lookups:
            start = time.perf_counter()
            time.sleep(lookup_seconds)
            alone = lookups.window(start, time.perf_counter())
            # ingest: the group is moved back to the stream's first entry (what an operator
            # does to replay a log), and the consumer drains the backlog
            before = _applied(server)
            started = time.perf_counter()
            client.xgroup_setid(TOPIC, group, id="0")
            _wait(lambda: _applied(server) >= before + expected, 600,
                  f"{name}: the backlog")
            ended = time.perf_counter()
            during = lookups.window(started, ended)
            visible = _visibility(server, publisher, rng, keys, dim, probe, samples)
    finally:
        server.close()
        client.close()
    ordered = sorted(visible)
    return {
        "name": name,
        "ingest_rows_per_s": expected * per_message / (ended - started),
        "ingest_seconds": ended - started,
        "visibility_p50_ms": statistics.median(ordered) * 1e3,
        "visibility_p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3,
        "lookups_per_s_alone": alone["lookups_per_s"],
        "lookups_per_s_during_ingest": during["lookups_per_s"],
        "lookup_p50_ms_alone": alone["p50_ms"],
        "lookup_p50_ms_during_ingest": during["p50_ms"],
        "lookup_p50_ratio": during["p50_ms"] / alone["p50_ms"],
        "lookup_p99_ms_alone": alone["p99_ms"],
        "lookup_p99_ms_during_ingest": during["p99_ms"],
    }


def _visibility(server: Any, publisher: UpdatePublisher, rng: np.random.Generator,
                keys: np.ndarray, dim: int, probe: int, samples: int) -> list[float]:
    """Seconds from an XADD of new rows to a lookup that answers them, `samples` times."""
    out = []
    for _ in range(samples):
        chosen = rng.choice(keys, probe, replace=False)
        rows = rng.standard_normal((probe, dim), dtype=np.float32)
        payload = codec.encode(chosen, rows)
        started = time.perf_counter()
        publisher.publish(TOPIC, [payload])
        while not np.array_equal(server.lookup(MODEL, 0, chosen), rows):
            if time.perf_counter() - started > 30:
                raise RuntimeError("an update did not become visible within 30 s")
            time.sleep(0.0005)
        out.append(time.perf_counter() - started)
    return out


def bench_updates(rows: int = 2_000_000, table_keys: int = 500_000, dim: int = 64,
                  batch: int = 1024, per_message: int = 8192, lookup_seconds: float = 5.0,
                  samples: int = 100, probe: int = 16, seed: int = 0
                  ) -> list[dict[str, Any]]:
    """Ingest rate, visibility p50/p99, lookup rate and p50 with and without ingest, for
    the in-process tier alone and with RocksDB (see the module docstring)."""
    from hps.modelfiles.formats.sparse_folder import write_sparse_model

    rng = np.random.default_rng(seed)
    keys = np.arange(table_keys, dtype=np.int64)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hps-bench-updates-") as tmp, \
            _stream_server() as address:
        folder = Path(tmp)
        write_sparse_model(folder / "table0", keys,
                           rng.standard_normal((table_keys, dim), dtype=np.float32))
        publisher = open_publisher(UpdateSourceConfig(type="redis_stream", address=address))
        try:
            messages = _publish_backlog(publisher, rows, dim, table_keys, per_message, rng)
            for name, rocksdb in (("in-process", False), ("in-process + RocksDB", True)):
                config = _config(folder, address, f"bench-{len(results)}", dim, batch,
                                 rocksdb, per_message)
                # a seed per run: the runs share the stream, and the second one reads the
                # first one's visibility messages too (the same rows would be there already)
                results.append(_run_one(name, config, address, keys, messages, publisher,
                                        dim=dim, batch=batch, per_message=per_message,
                                        lookup_seconds=lookup_seconds, samples=samples,
                                        probe=probe, seed=seed + len(results)))
        finally:
            publisher.close()
    for r in results:
        r.update({"rows": rows, "table_keys": table_keys, "dim": dim, "lookup_batch": batch,
                  "rows_per_message": per_message})
    return results
