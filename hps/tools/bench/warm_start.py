"""A replica's first lookups, cold and warmed from a peer's hot set (`warm_from`).

One table is written as a sparse folder; a **peer** serves it and answers `lookups`
lookups of Zipf-distributed keys (its hot-key sketch sees every one of them:
`hot_key_sampling: 1`); its last `first` lookups give the warm p50 and p99. Every server
here has a volatile tier left empty by the load (`initial_cache_rate: 0`) that the rows
its lookups find in RocksDB are copied to (`cache_missed_embeddings`), the way a
partial cache warms by itself. The peer's hot set (`HierarchicalParameterServer.top_keys`,
as `GET .../hot-set` exports it) is written to a file. Then two replicas start over the
same files, each with its own RocksDB: a **cold** one, and one **warmed** from that
file. Each answers
the same next `first` lookups of the same stream; their p50 and p99 stand beside the
peer's. With `gpu`, every server has a GPU cache (`gpucache: true`, not warmed from the
files), and the replicas' first lookups are also counted in GPU-cache hits.

All timings are of `HPS.lookup`, the public call. Run `hps bench warm-start`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from hps.tools.bench.tiers import make_table

MODEL = "warm"


def _config(folder: str, name: str, dim: int, batch: int, gpu: bool,
            **model: Any) -> dict[str, Any]:
    return {
        "supportlonglong": True,
        "models": [{
            "model": MODEL, "sparse_files": [os.path.join(folder, "table0")],
            "embedding_table_names": ["table0"], "embedding_vecsize_per_table": [dim],
            "maxnum_catfeature_query_per_table_per_sample": [batch],
            "default_value_for_each_table": [0.0], "deployed_device_list": [0],
            "max_batch_size": 1, "gpucache": gpu, "init_ec": False,
            "hit_rate_threshold": 1.0, **model,
        }],
        "volatile_db": {"type": "hash_map", "initial_cache_rate": 0.0,
                        "cache_missed_embeddings": True},
        "persistent_db": {"type": "rocks_db", "path": os.path.join(folder, name)},
    }


def _timed(hps: Any, batches: list[np.ndarray]) -> np.ndarray:
    """Seconds of each lookup of `batches`, in order."""
    took = np.empty(len(batches))
    for i, keys in enumerate(batches):
        start = time.perf_counter()
        hps.lookup(keys, MODEL, 0)
        took[i] = time.perf_counter() - start
    return took


def _gpu_hits(hps: Any) -> int:
    caches = hps.server.model(MODEL).tables[0].gpu
    return sum(int(c.stats()["hits"]) for c in caches.values())


def bench_warm_start(num_keys: int = 1_000_000, dim: int = 64, batch: int = 256,
                     lookups: int = 2000, first: int = 100, zipf: float = 1.1,
                     gpu: bool = False, warm_timeout: float = 60.0) -> dict[str, Any]:
    """The figures of the module docstring: per server (peer, cold, warmed) the p50 and
    p99 in µs of its `first` lookups (the peer's last ones), and the warm-up's seconds."""
    from hps.api import HPS
    from hps.modelfiles.formats.sparse_folder import write_sparse_model

    work = tempfile.mkdtemp(prefix="hps-bench-warm-")
    try:
        keys, vectors = make_table(num_keys, dim)
        write_sparse_model(os.path.join(work, "table0"), keys, vectors)
        del vectors
        rng = np.random.default_rng(5)
        ranks = (rng.zipf(zipf, (lookups + first) * batch) - 1) % num_keys
        order = rng.permutation(num_keys)  # the hot keys spread over the key range
        stream = keys[order[ranks]].reshape(lookups + first, batch)
        seen, after = list(stream[:lookups]), list(stream[lookups:])
        rows: dict[str, Any] = {}
        with HPS(_config(work, "peer", dim, batch, gpu, hot_key_sampling=1)) as peer:
            peer_times = _timed(peer, seen)[-first:]
            hot = peer.server.top_keys(MODEL, 0, "hot", 1 << 20)["keys"]
        export = os.path.join(work, "table0.hot-set")
        hot.astype("<i8").tofile(export)
        rows["peer"] = _figures(peer_times)
        for name, extra in (("cold", {}), ("warmed", {"warm_from": export,
                                                      "warm_timeout": warm_timeout})):
            started = time.perf_counter()
            with HPS(_config(work, name, dim, batch, gpu, **extra)) as replica:
                ready = time.perf_counter() - started
                hits = _gpu_hits(replica) if gpu else 0
                times = _timed(replica, after)
                rows[name] = {**_figures(times), "start_seconds": ready}
                if gpu:
                    rows[name]["gpu_hit_rate"] = (_gpu_hits(replica) - hits) / (first * batch)
        return {"num_keys": num_keys, "dim": dim, "batch": batch, "lookups": lookups,
                "first": first, "zipf": zipf, "gpu": gpu, "hot_keys": int(hot.size),
                "rows": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _figures(seconds: np.ndarray) -> dict[str, float]:
    return {"p50_us": float(np.percentile(seconds, 50) * 1e6),
            "p99_us": float(np.percentile(seconds, 99) * 1e6)}


def format_warm_start(result: dict[str, Any]) -> str:
    """The figures of `bench_warm_start` as a plain-text table."""
    gpu = result["gpu"]
    lines = [
        f"{result['num_keys']:,} keys, width {result['dim']}, {result['batch']} keys a "
        f"lookup, Zipf {result['zipf']};",
        f"the peer's hot set: {result['hot_keys']:,} keys",
        f"{'server':>8}  {'p50 µs':>9}  {'p99 µs':>9}  {'start s':>8}"
        + (f"  {'GPU hit rate':>12}" if gpu else ""),
    ]
    for name, row in result["rows"].items():
        start = f"{row['start_seconds']:>8.2f}" if "start_seconds" in row else f"{'-':>8}"
        line = f"{name:>8}  {row['p50_us']:>9,.1f}  {row['p99_us']:>9,.1f}  {start}"
        if gpu and "gpu_hit_rate" in row:
            line += f"  {row['gpu_hit_rate']:>12.3f}"
        lines.append(line)
    lines.append(f"peer: its last {result['first']} of {result['lookups']:,} lookups; "
                 f"cold, warmed: their first {result['first']}")
    return "\n".join(lines)
