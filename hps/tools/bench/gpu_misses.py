"""The GPU miss path through the public call (`hps bench gpu --profile hugectr|misses`).

- `hugectr`: HugeCTR's hps_profiler workload, as its docs describe it: a 630,000-key
  table of dim 16, keys drawn from a power law (alpha 1.2) over the table, 2,000 keys per
  lookup, a cold dynamic cache of 0.9 of the table, hit_rate_threshold 1.0 (every miss
  fetched and inserted before the call returns), 1,000 lookups of which the last 900 are
  timed. Keys and output are torch tensors on the GPU, passed to `HPS.lookup_fromdlpack`
  (wall clock around the call and a sync of torch's stream). Timed three ways, each on a
  cold cache: back to back as hps_profiler runs (every output kept, compared after the
  last call); checked between calls (each output copied and compared on the host before
  the next call); host upload (each call's keys copied from host memory to the device
  just before it, outputs compared after the last call). Printed beside HugeCTR's
  published 231 µs mean and 285 µs p99 (84% hit rate). Every returned vector is compared
  with the model file's. With `updates` (rows/s, `--updates`), an update stream runs
  meanwhile through the path online updates take: a Redis server started for the run,
  a publisher in another process sending that many rows a second (in 100 messages a
  second, keys drawn from the same power law, rows equal to the model's so every vector
  stays checkable), the server's own consumer applying them to the in-process tier and
  the GPU cache.
- `misses`: large miss batches: 1M uniform keys per lookup over a 20M-key dim-64 table
  with a 10% dynamic cache (same call and timing), keys/s; vectors checked likewise. The
  baseline, in the same run: the in-process tier's own `fetch_into` of the same keys on
  the host (the part of a miss no GPU work can avoid).

Both load the table from a model folder into the in-process hash map tier, as a user's
HPS does.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hps.tools.bench.gpu_public import MODEL, server_over_files

HUGECTR_MEAN_US, HUGECTR_P99_US, HUGECTR_HIT_RATE = 231.0, 285.0, 0.84


def _server(folder: Path, keys: np.ndarray, rows: np.ndarray, n: int, device_id: int,
            gpucacheper: float, **top: Any) -> Any:
    """HPS over the table's files: a cold dynamic cache, every miss synchronous; `top`:
    more of the server's config keys (update_source)."""
    return server_over_files(folder, keys, rows, n, device_id, gpucacheper=gpucacheper,
                             hit_rate_threshold=1.0,
                             cache_refresh_percentage_per_iteration=0.0,
                             embedding_cache_type="dynamic", top=top)


def _power_law_ranks(rng: np.random.Generator, table_keys: int, alpha: float, n: int,
                     draws: int) -> list[np.ndarray]:
    """`draws` batches of n ranks with P(rank r) ∝ (r + 1)^-alpha."""
    weights = np.arange(1, table_keys + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return [np.minimum(np.searchsorted(cdf, rng.random(n)), table_keys - 1)
            for _ in range(draws)]


MODES = {"back to back": "back to back, as hps_profiler",
         "checked": "checked between calls", "upload": "host upload"}


def _run(hps: Any, keys: np.ndarray, rows: np.ndarray, batches: list[np.ndarray],
         device_id: int, timed_from: int, check_rows: int,
         mode: str = "checked") -> dict[str, Any]:
    """Looks up each batch (indices into keys) with torch tensors; times from batch
    `timed_from` on; checks `check_rows` rows of every output (all: -1).

    `mode` (MODES): "checked": each output is copied to the host and compared before the
    next call. "back to back": the calls follow each other as in HugeCTR's hps_profiler,
    each into its own preallocated output (NaN-filled before the first call), and every
    output is compared after the last one. "upload": as back to back, each call's keys
    copied from host memory (torch.as_tensor) just before it, outside the timed call."""
    import torch

    dev = torch.device("cuda", device_id)
    gpu = hps.server.model(MODEL).tables[0].gpu[device_id]
    n = batches[0].size
    shape = (n, rows.shape[1])
    stream = torch.cuda.current_stream(dev)
    times = []
    wrong = 0
    before = None
    checked = mode == "checked"
    pick = slice(None) if check_rows < 0 else slice(0, check_rows)
    host_keys = [keys[b] for b in batches]
    t_keys = ([None] * len(batches) if mode == "upload"
              else [torch.as_tensor(k, device=dev) for k in host_keys])
    if checked:
        outs = [torch.empty(shape, dtype=torch.float32, device=dev)] * len(batches)
    else:
        outs = [torch.full(shape, float("nan"), dtype=torch.float32, device=dev)
                for _ in batches]
    torch.cuda.synchronize(dev)
    for i, (idx, k, out) in enumerate(zip(batches, t_keys, outs, strict=True)):
        if i == timed_from:
            before = gpu.stats()
        if checked:
            out.fill_(float("nan"))
            stream.synchronize()
        elif k is None:
            k = torch.as_tensor(host_keys[i], device=dev)
        t0 = time.perf_counter()
        hps.lookup_fromdlpack(k, out, MODEL, 0, device_id)
        stream.synchronize()
        t1 = time.perf_counter()
        if i >= timed_from:
            times.append((t1 - t0) * 1e6)
        if checked:
            wrong += int((out[pick].cpu().numpy() != rows[idx[pick]]).any(axis=1).sum())
    after = gpu.stats()
    if not checked:
        for idx, out in zip(batches, outs, strict=True):
            wrong += int((out[pick].cpu().numpy() != rows[idx[pick]]).any(axis=1).sum())
    assert before is not None
    hits = after["hits"] - before["hits"]
    misses = after["misses"] - before["misses"]
    return {"mean_us": statistics.fmean(times), "p50_us": statistics.median(times),
            "p99_us": float(np.percentile(times, 99)), "hit_rate": hits / (hits + misses),
            "mkeys_s": n / statistics.fmean(times), "wrong_rows": wrong,
            "lookups_timed": len(times), "cache_size": after["size"],
            "cache_capacity": after["capacity"], "gpu_mib": after["memory_bytes"] / 2**20}


def _publish_updates(address: str, topic: str, keys: np.ndarray, rows: np.ndarray,
                     ranks: np.ndarray, rows_per_s: int, stop: Any) -> None:
    """The update stream of `updates` (another process): rows_per_s rows a second in 100
    messages a second, keys drawn from `ranks` in turn, each with its model row."""
    from hps.config import UpdateSourceConfig
    from hps.updates import codec
    from hps.updates.open import open_publisher

    publisher = open_publisher(UpdateSourceConfig(type="redis_stream", address=address))
    per_message = max(1, rows_per_s // 100)
    interval = per_message / rows_per_s
    at, due = 0, time.perf_counter()
    try:
        while not stop.is_set():
            chosen = np.unique(ranks[np.arange(at, at + per_message) % ranks.size])
            at += per_message
            publisher.publish(topic, [codec.encode(keys[chosen], rows[chosen])])
            due += interval
            time.sleep(max(0.0, due - time.perf_counter()))
    finally:
        publisher.close()


class _UpdateStream:
    """A Redis server and a publisher process sending `rows_per_s` update rows a second
    to the topic of the bench's table (see the module docstring); `config` is the
    server's update_source."""

    def __init__(self, keys: np.ndarray, rows: np.ndarray, ranks: np.ndarray,
                 rows_per_s: int) -> None:
        self.args = (keys, rows, ranks, rows_per_s)
        self.config: dict[str, Any] = {}

    def __enter__(self) -> _UpdateStream:
        from hps.tools.bench.redis_servers import RedisServer

        self._redis = RedisServer().start()
        self.address = self._redis.address
        self.config = {"type": "redis_stream", "address": self.address,
                       "poll_timeout_ms": 100}
        return self

    def publish(self, topic: str) -> None:
        """Starts the publisher (the server follows `topic` already)."""
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._proc = context.Process(target=_publish_updates, daemon=True,
                                     args=(self.address, topic, *self.args, self._stop))
        self._proc.start()

    def stop(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self._stop.set()
            self._proc.join(10)
            self._proc = None

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._redis.close()


def _applied_rows(hps: Any) -> int:
    status = hps.server.update_status()
    return sum(int(t.get("rows", 0)) for t in status["tables"].values()) if status else 0


def bench_hugectr_profile(table_keys: int = 630_000, dim: int = 16, n: int = 2000,
                          alpha: float = 1.2, cache_fraction: float = 0.9,
                          lookups: int = 1000, untimed: int = 100, device_id: int = 0,
                          seed: int = 0, updates: int = 0) -> list[dict[str, Any]]:
    """HugeCTR's hps_profiler workload through lookup_fromdlpack (module docstring);
    `updates`: rows a second of an update stream applied meanwhile (0: none)."""
    if updates < 0:
        raise ValueError(f"updates must be rows a second, 0 or more, got {updates}")
    rng = np.random.default_rng(seed)
    keys = rng.permutation(np.arange(table_keys, dtype=np.int64)) * 7 + 3
    rows = rng.standard_normal((table_keys, dim)).astype(np.float32)
    batches = _power_law_ranks(rng, table_keys, alpha, n, lookups)
    label = (f"hugectr profile: {table_keys} keys dim {dim}, power law {alpha}, {n} keys, "
             f"cache {cache_fraction}, threshold 1.0")
    if updates:
        label += f", {updates} update rows/s"
    out = []
    # a fresh server (a cold cache) for each way of timing
    for mode, how in MODES.items():
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            top: dict[str, Any] = {}
            stream = None
            if updates:
                ranks = _power_law_ranks(rng, table_keys, alpha, 100_000, 1)[0]
                stream = stack.enter_context(_UpdateStream(keys, rows, ranks, updates))
                top["update_source"] = stream.config
            hps = _server(Path(tmp), keys, rows, n, device_id, cache_fraction, **top)
            try:
                applied = 0
                if stream is not None:
                    table = hps.server.model(MODEL).tables[0]
                    stream.publish(f"hps_et.{MODEL}.{table.name}")
                    started = time.perf_counter()
                    while _applied_rows(hps) == 0 and time.perf_counter() - started < 30:
                        time.sleep(0.01)  # the stream flows before the timing starts
                    applied = _applied_rows(hps)
                    started = time.perf_counter()
                result = _run(hps, keys, rows, batches, device_id, untimed, -1, mode=mode)
                if stream is not None:
                    result["update_rows_per_s"] = ((_applied_rows(hps) - applied)
                                                   / (time.perf_counter() - started))
                    stream.stop()
            finally:
                hps.close()
        out.append({"bench": "hugectr", "mode": f"{label}; {how}", **result,
                    "vs_hugectr_mean": result["mean_us"] / HUGECTR_MEAN_US,
                    "vs_hugectr_p99": result["p99_us"] / HUGECTR_P99_US})
    return [
        *out,
        {"bench": "hugectr", "mode": "HugeCTR published (its hps_profiler)",
         "mean_us": HUGECTR_MEAN_US, "p99_us": HUGECTR_P99_US, "hit_rate": HUGECTR_HIT_RATE},
    ]


def bench_large_misses(table_keys: int = 20_000_000, dim: int = 64, n: int = 1 << 20,
                       cache_fraction: float = 0.1, lookups: int = 12, untimed: int = 2,
                       device_id: int = 0, seed: int = 0) -> list[dict[str, Any]]:
    """1M uniform keys per lookup over a large table with a small cache (docstring)."""
    rng = np.random.default_rng(seed)
    keys = np.arange(table_keys, dtype=np.int64) * 11 + 5
    rows = rng.standard_normal((table_keys, dim), dtype=np.float32)
    batches = [rng.integers(0, table_keys, n) for _ in range(lookups)]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        hps = _server(Path(tmp), keys, rows, n, device_id, cache_fraction)
        load_s = time.perf_counter() - t0
        try:
            result = _run(hps, keys, rows, batches, device_id, untimed, 4096)
            tier = hps.server.tiers.volatile
            name = hps.server.model(MODEL).tables[0].storage_name
            host_out = np.empty((n, dim), np.float32)
            times = []
            for b in batches[-3:]:
                t0 = time.perf_counter()
                tier.fetch_into(name, keys[b], host_out)
                times.append(time.perf_counter() - t0)
            tier_mkeys = n / statistics.median(times) / 1e6
        finally:
            hps.close()
    return [{"bench": "misses", "mode": f"{n} uniform keys, {table_keys} keys dim {dim}, "
             f"cache {cache_fraction}", **result, "load_s": load_s,
             "vs_tier_fetch": result["mkeys_s"] / tier_mkeys},
            {"bench": "misses", "mode": "baseline: the in-process tier's fetch_into of the "
             "same keys (host)", "mkeys_s": tier_mkeys}]
