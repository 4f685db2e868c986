"""A replica's first lookups, cold and warmed from a peer's hot set (`warm_from`).

One table is written as a sparse folder; a **peer** serves it and answers `lookups`
lookups of skewed keys (its hot-key sketch samples every one of them:
`hot_key_sampling: 1`, as a peer that has served for hours has seen enough). The peer's
hot set (`HierarchicalParameterServer.hot_set`, as `GET .../hot-set` exports it: the
sketch's hot keys, then the keys its GPU cache holds) is written to a file, and then the
peer answers the stream's next `first` lookups: its warm p50 and p99 of exactly the
lookups the replicas answer. Then two replicas start over the same files: a **cold**
one, and one **warmed** from that file. Each answers those `first` lookups; their p50
and p99 stand beside the peer's, with how many of them took longer than the peer's warm
p99 and the last one that did (`over`, `last`: from the lookup after it on, the replica
serves at the warm p99).

- Host path (default): `HPS.lookup` of Zipf(`zipf`) keys; every server has a volatile
  tier left empty by the load (`initial_cache_rate: 0`) that the rows its lookups find
  in RocksDB (each server its own) are copied to (`cache_missed_embeddings`), the way a
  partial cache warms by itself.
- `gpu`: HugeCTR's hps_profiler workload (hps/tools/bench/gpu_misses.py) with the sizes
  given (`python3 -m hps.tools.bench.warm_start --gpu` takes HugeCTR's: 630,000 keys of
  width 16, power law 1.2, 2,000 keys a lookup, 1,000 lookups): the whole table in the
  in-process tier, a dynamic GPU cache of 0.9 of the table on device 0 (not warmed from
  the files), `hit_rate_threshold: 1.0`; keys and output are torch tensors on the device
  through `HPS.lookup_fromdlpack` (wall clock around the call and a sync of torch's
  stream), and the replicas' first lookups are also counted in GPU-cache hits.

Run `hps bench warm-start [--gpu]` or `python3 -m hps.tools.bench.warm_start [--gpu]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from hps.tools.bench.tiers import make_table

MODEL = "warm"
#: the replicas' very first lookups, whose GPU hit rate is printed apart
FIRST_FEW = 10


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


def _gpu_config(folder: str, name: str, dim: int, batch: int, **model: Any
                ) -> dict[str, Any]:
    """HugeCTR's profile: the whole table in the in-process tier, a cold dynamic cache of
    0.9 of it, every miss fetched and inserted before the call returns."""
    config = _config(folder, name, dim, batch, True, gpucacheper=0.9,
                     embedding_cache_type="dynamic",
                     cache_refresh_percentage_per_iteration=0.0, **model)
    config["volatile_db"] = {"type": "hash_map"}
    del config["persistent_db"]
    return config


def _timed(hps: Any, batches: list[np.ndarray]) -> np.ndarray:
    """Seconds of each `HPS.lookup` of `batches`, in order."""
    took = np.empty(len(batches))
    for i, keys in enumerate(batches):
        start = time.perf_counter()
        hps.lookup(keys, MODEL, 0)
        took[i] = time.perf_counter() - start
    return took


def _timed_gpu(hps: Any, batches: list[Any], dim: int) -> np.ndarray:
    """Seconds of each `HPS.lookup_fromdlpack` of `batches` (torch tensors on device 0)
    into one torch output, each ended by a sync of torch's stream."""
    import torch

    if not batches:
        return np.empty(0)
    out = torch.empty((batches[0].numel(), dim), dtype=torch.float32, device="cuda:0")
    stream = torch.cuda.current_stream(out.device)
    stream.synchronize()
    took = np.empty(len(batches))
    for i, keys in enumerate(batches):
        start = time.perf_counter()
        hps.lookup_fromdlpack(keys, out, MODEL, 0)
        stream.synchronize()
        took[i] = time.perf_counter() - start
    return took


def _gpu_hits(hps: Any) -> int:
    caches = hps.server.model(MODEL).tables[0].gpu
    return sum(int(c.stats()["hits"]) for c in caches.values())


def _stream(keys: np.ndarray, count: int, batch: int, zipf: float, gpu: bool
            ) -> np.ndarray:
    """`count` batches of `batch` skewed keys of the table (the hot keys spread over it)."""
    rng = np.random.default_rng(5)
    num_keys = keys.size
    if gpu:  # HugeCTR's profile: a power law over the table's ranks
        from hps.tools.bench.gpu_misses import _power_law_ranks

        ranks = np.concatenate(_power_law_ranks(rng, num_keys, zipf, batch, count))
    else:
        ranks = (rng.zipf(zipf, count * batch) - 1) % num_keys
    order = rng.permutation(num_keys)
    return keys[order[ranks]].reshape(count, batch)


def bench_warm_start(num_keys: int = 1_000_000, dim: int = 64, batch: int = 256,
                     lookups: int = 2000, first: int = 100, zipf: float = 1.1,
                     gpu: bool = False, warm_timeout: float = 60.0,
                     replicas: tuple[str, ...] = ("cold", "warmed")) -> dict[str, Any]:
    """The figures of the module docstring: per server (peer, cold, warmed) the p50 and
    p99 in µs of the same `first` lookups (the peer's after its export), the lookups over
    the peer's p99, and the seconds to start (the warm-up included). `replicas`: which replicas
    start, in that order (one process runs them all, one after the other)."""
    from hps.api import HPS
    from hps.modelfiles.formats.sparse_folder import write_sparse_model

    work = tempfile.mkdtemp(prefix="hps-bench-warm-")
    try:
        keys, vectors = make_table(num_keys, dim)
        write_sparse_model(os.path.join(work, "table0"), keys, vectors)
        del vectors
        stream: Any = _stream(keys, lookups + first, batch, zipf, gpu)
        if gpu:
            import torch

            stream = torch.as_tensor(stream, device="cuda:0")  # uploaded before any timing
        seen, after = list(stream[:lookups]), list(stream[lookups:])

        def config(name: str, **model: Any) -> dict[str, Any]:
            if gpu:
                return _gpu_config(work, name, dim, batch, **model)
            return _config(work, name, dim, batch, False, **model)

        def timed(hps: Any, batches: list[Any]) -> np.ndarray:
            return _timed_gpu(hps, batches, dim) if gpu else _timed(hps, batches)

        rows: dict[str, Any] = {}
        with HPS(config("peer", hot_key_sampling=1)) as peer:
            timed(peer, seen)
            hot = peer.server.hot_set(MODEL, 0)  # exported before it sees `after`
            hits = _gpu_hits(peer) if gpu else 0
            peer_times = timed(peer, after)  # the replicas' lookups, answered warm
            rows["peer"] = _figures(peer_times)
            if gpu:
                rows["peer"]["gpu_hit_rate"] = (_gpu_hits(peer) - hits) / (first * batch)
        export = os.path.join(work, "table0.hot-set")
        hot.astype("<i8").tofile(export)
        warm_p99 = rows["peer"]["p99_us"]
        warmed = {"warm_from": export, "warm_timeout": warm_timeout}
        for name in replicas:
            extra = warmed if name == "warmed" else {}
            started = time.perf_counter()
            with HPS(config(name, **extra)) as replica:
                ready = time.perf_counter() - started
                hits = _gpu_hits(replica) if gpu else 0
                times = timed(replica, after[:FIRST_FEW])
                few = _gpu_hits(replica) if gpu else 0
                times = np.concatenate([times, timed(replica, after[FIRST_FEW:])])
                rows[name] = {**_figures(times, warm_p99), "start_seconds": ready,
                              "times_us": (times * 1e6).round(1).tolist()}
                if gpu:
                    rows[name]["gpu_hit_rate"] = (_gpu_hits(replica) - hits) / (first * batch)
                    rows[name]["gpu_hit_rate_few"] = (few - hits) / (
                        min(FIRST_FEW, first) * batch)
        return {"num_keys": num_keys, "dim": dim, "batch": batch, "lookups": lookups,
                "first": first, "zipf": zipf, "gpu": gpu, "hot_keys": int(hot.size),
                "rows": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _figures(seconds: np.ndarray, warm_p99_us: float | None = None) -> dict[str, Any]:
    figures: dict[str, Any] = {"p50_us": float(np.percentile(seconds, 50) * 1e6),
                               "p99_us": float(np.percentile(seconds, 99) * 1e6)}
    if warm_p99_us is not None:
        over = np.flatnonzero(seconds * 1e6 > warm_p99_us)
        figures["over_warm_p99"] = int(over.size)
        figures["last_over"] = int(over[-1]) + 1 if over.size else 0  # 1-based; 0: none
    return figures


def format_warm_start(result: dict[str, Any]) -> str:
    """The figures of `bench_warm_start` as a plain-text table."""
    gpu = result["gpu"]
    draw = "power law" if gpu else "Zipf"
    lines = [
        f"{result['num_keys']:,} keys, width {result['dim']}, {result['batch']} keys a "
        f"lookup, {draw} {result['zipf']}"
        + ("; a GPU cache of 0.9 of the table, lookup_fromdlpack of torch tensors" if gpu
           else "") + ";",
        f"the peer's hot set: {result['hot_keys']:,} keys",
        f"{'server':>8}  {'p50 µs':>9}  {'p99 µs':>9}  {'over':>5}  {'last':>5}  "
        f"{'start s':>8}" + (f"  {'GPU hit rate':>12}  {f'first {FIRST_FEW}':>8}" if gpu
                             else ""),
    ]
    for name, row in result["rows"].items():
        start = f"{row['start_seconds']:>8.2f}" if "start_seconds" in row else f"{'-':>8}"
        over = (f"{row['over_warm_p99']:>5}  {row['last_over']:>5}" if "over_warm_p99" in row
                else f"{'-':>5}  {'-':>5}")
        line = f"{name:>8}  {row['p50_us']:>9,.1f}  {row['p99_us']:>9,.1f}  {over}  {start}"
        if gpu and "gpu_hit_rate" in row:
            few = f"{row['gpu_hit_rate_few']:>8.3f}" if "gpu_hit_rate_few" in row else f"{'-':>8}"
            line += f"  {row['gpu_hit_rate']:>12.3f}  {few}"
        lines.append(line)
    lines.append(f"the same {result['first']} lookups each: the peer's after its "
                 f"{result['lookups']:,} (and its export), the replicas' first; over: of "
                 "those, the lookups slower than the peer's p99; last: the last of them "
                 "(0: none)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true",
                        help="HugeCTR's profile through a GPU cache on device 0")
    parser.add_argument("--keys", type=int, help="table keys (630,000 with --gpu, else 1M)")
    parser.add_argument("--dim", type=int, help="width (16 with --gpu, else 64)")
    parser.add_argument("--batch", type=int, help="keys a lookup (2,000 with --gpu, else 256)")
    parser.add_argument("--lookups", type=int,
                        help="the peer's lookups (1,000 with --gpu, else 2,000)")
    parser.add_argument("--first", type=int, default=100)
    parser.add_argument("--skew", type=float, help="power law 1.2 with --gpu, else Zipf 1.1")
    args = parser.parse_args(argv)
    sizes = (630_000, 16, 2000, 1000, 1.2) if args.gpu else (1_000_000, 64, 256, 2000, 1.1)
    given = (args.keys, args.dim, args.batch, args.lookups, args.skew)
    keys, dim, batch, lookups, skew = (g if g is not None else d
                                       for g, d in zip(given, sizes, strict=True))
    result = bench_warm_start(int(keys), int(dim), int(batch), int(lookups), args.first,
                              zipf=float(skew), gpu=args.gpu)
    print(format_warm_start(result))


if __name__ == "__main__":
    main()
