"""Benchmarks of the database tiers, each beside its baseline on the same data and keys.

- `bench_hash_map`: `HashMapTier.fetch` vs NumPy `searchsorted` on the sorted key array +
  `take` of the rows.
- `bench_rocksdb`: `RocksDBTier.fetch` (key conversion and assembly included) vs a raw
  rocksdict `multi_get` over prepared byte keys, on the same database.
- `bench_bulk_load`: `RocksDBTier.load` (SST ingestion) vs plain WriteBatch inserts.

Each returns a dict of figures: keys/s of ours and of the baseline, their ratio, and the
peak RSS of the process. Timings are medians of `repeats` runs after `warmup` runs; ours
and the baseline take turns on the same keys in the same process (`_interleaved_medians`),
so load from other processes on the machine hits both alike. Run
`python -m hps.bench.tiers` for a table (`--keys`, `--dim`, `--batch`, `--only`).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

TABLE = "hps_et.bench.table0"


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def current_rss_bytes() -> int | None:
    """Resident set size of this process now (Linux /proc), or None where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _interleaved_medians(
    fns: dict[str, Callable[[int], object]], repeats: int, warmup: int
) -> dict[str, float]:
    """Median seconds of each function, run in turns on the same inputs.

    Turn i runs every function on input i, starting with a different one each turn, so
    drifting machine load and the caches warmed by whoever ran first hit all alike.
    """
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            fns[name](i)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def make_table(num_keys: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct random int64 keys (over the whole positive range) and their rows."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, 2**62, int(num_keys * 1.001) + 16, dtype=np.int64))
    keys = keys[rng.permutation(keys.size)[:num_keys]]
    keys.sort()
    vectors = rng.random((num_keys, dim), dtype=np.float32)
    return keys, vectors


def _chunks(
    keys: np.ndarray, vectors: np.ndarray, rows: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for start in range(0, keys.size, rows):
        yield keys[start : start + rows], vectors[start : start + rows]


def _query_batches(keys: np.ndarray, batch: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [keys[rng.integers(0, keys.size, batch)] for _ in range(count)]


def bench_hash_map(
    num_keys: int = 10_000_000, dim: int = 64, batch: int = 16384, repeats: int = 50,
    warmup: int = 5,
) -> dict[str, Any]:
    """HashMapTier.fetch vs `searchsorted` + `take` on uniform keys (all hits)."""
    from hps.config import VolatileDBConfig
    from hps.db.hash_map import HashMapTier

    keys, vectors = make_table(num_keys, dim)
    tier = HashMapTier(VolatileDBConfig.model_validate({}))
    tier.create_table(TABLE, dim)
    gc.collect()
    rss_before = current_rss_bytes()
    start = time.perf_counter()
    tier.load(TABLE, _chunks(keys, vectors, 1 << 18))
    load_s = time.perf_counter() - start
    gc.collect()
    rss_after = current_rss_bytes()
    queries = _query_batches(keys, batch, warmup + repeats, seed=1)
    out = np.empty((batch, dim), np.float32)

    def ours(i: int) -> None:
        tier.fetch(TABLE, queries[i])

    def baseline(i: int) -> None:
        rows = np.searchsorted(keys, queries[i])
        np.take(vectors, rows, axis=0, out=out, mode="clip")

    # Same answers, checked once outside the timing.
    got, found = tier.fetch(TABLE, queries[0])
    baseline(0)
    assert found.all() and np.array_equal(got, out)

    medians = _interleaved_medians({"ours": ours, "baseline": baseline}, repeats, warmup)
    ours_s, base_s = medians["ours"], medians["baseline"]
    raw = num_keys * (8 + 4 * dim)
    result = {
        "tier": "hash_map",
        "num_keys": num_keys,
        "dim": dim,
        "batch": batch,
        "ours_keys_per_s": batch / ours_s,
        "baseline": "np.searchsorted + np.take",
        "baseline_keys_per_s": batch / base_s,
        "ratio": base_s / ours_s,
        "ours_batch_ms": ours_s * 1e3,
        "baseline_batch_ms": base_s * 1e3,
        "load_keys_per_s": num_keys / load_s,
        "memory_over_raw": tier.memory_bytes(TABLE) / raw,
        "rss_growth_over_raw": (
            (rss_after - rss_before) / raw if rss_before is not None and rss_after else None
        ),
        "peak_rss_bytes": peak_rss_bytes(),
    }
    tier.close()
    return result


def _rocksdb_tier(path: str, num_threads: int = 16) -> Any:
    from hps.config import PersistentDBConfig
    from hps.db.rocksdb import RocksDBTier

    config = PersistentDBConfig.model_validate(
        {"type": "rocks_db", "path": path, "num_threads": num_threads}
    )
    return RocksDBTier(config)


def bench_rocksdb(
    num_keys: int = 10_000_000, dim: int = 64, batch: int = 16384, repeats: int = 30,
    warmup: int = 3, path: str | None = None,
) -> dict[str, Any]:
    """RocksDBTier.fetch vs a raw rocksdict `multi_get` of prepared byte keys, same DB.

    Loads a fresh store under `path` (a temporary directory by default, removed after).
    The raw baseline runs twice: with RocksDB's default read options, and with the read
    options the tier uses (checksums not verified), so the ratio is not an options effect.
    """
    import rocksdict

    from hps.db.rocksdb import key_bytes

    work = tempfile.mkdtemp(prefix="hps-bench-rocksdb-", dir=path)
    try:
        keys, vectors = make_table(num_keys, dim)
        tier = _rocksdb_tier(work)
        tier.create_table(TABLE, dim)
        start = time.perf_counter()
        tier.load(TABLE, _chunks(keys, vectors, 1 << 18))
        load_s = time.perf_counter() - start
        del vectors
        gc.collect()
        queries = _query_batches(keys, batch, warmup + repeats, seed=2)
        prepared = [key_bytes(q) for q in queries]
        raw = tier.raw_table(TABLE)
        same_options = rocksdict.ReadOptions()
        same_options.set_verify_checksums(False)

        got, found = tier.fetch(TABLE, queries[0])
        values = raw.get(prepared[0])
        assert found.all() and got.tobytes() == b"".join(values)

        medians = _interleaved_medians(
            {
                "ours": lambda i: tier.fetch(TABLE, queries[i]),
                "baseline": lambda i: raw.get(prepared[i]),
                "same_options": lambda i: raw.get(prepared[i], read_opt=same_options),
            },
            repeats,
            warmup,
        )
        ours_s, base_s, same_s = medians["ours"], medians["baseline"], medians["same_options"]
        result = {
            "tier": "rocksdb",
            "num_keys": num_keys,
            "dim": dim,
            "batch": batch,
            "ours_keys_per_s": batch / ours_s,
            "baseline": "rocksdict multi_get, prepared byte keys",
            "baseline_keys_per_s": batch / base_s,
            "ratio": base_s / ours_s,
            "baseline_same_options_keys_per_s": batch / same_s,
            "ratio_same_options": same_s / ours_s,
            "ours_batch_ms": ours_s * 1e3,
            "baseline_batch_ms": base_s * 1e3,
            "load_keys_per_s": num_keys / load_s,
            "peak_rss_bytes": peak_rss_bytes(),
        }
        tier.close()
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_bulk_load(
    num_keys: int = 10_000_000, dim: int = 64, chunk_keys: int = 1 << 18,
    path: str | None = None,
) -> dict[str, Any]:
    """RocksDBTier.load (sorted SST files, ingested, then compacted) vs WriteBatch inserts.

    The baseline is the generic `Tier.load`: one WriteBatch `insert` per chunk, WAL on,
    as HugeCTR loaded RocksDB. Each runs on its own fresh store.
    """
    from hps.db.base import Tier

    keys, vectors = make_table(num_keys, dim)
    rng = np.random.default_rng(3)
    order = rng.permutation(num_keys)  # files come in no particular key order
    keys, vectors = keys[order], vectors[order]
    del order
    work = tempfile.mkdtemp(prefix="hps-bench-load-", dir=path)
    try:
        timings = {}
        for name, loader in (("ours", None), ("baseline", Tier.load)):
            store = os.path.join(work, name)
            tier = _rocksdb_tier(store)
            tier.create_table(TABLE, dim)
            start = time.perf_counter()
            if loader is None:
                tier.load(TABLE, _chunks(keys, vectors, chunk_keys))
            else:
                loader(tier, TABLE, _chunks(keys, vectors, chunk_keys))
                tier.raw_table(TABLE).flush(True)  # durable in table files, like ours
            timings[name] = time.perf_counter() - start
            assert tier.fetch(TABLE, keys[:1000])[1].all()
            tier.close()
            shutil.rmtree(store, ignore_errors=True)
        return {
            "tier": "rocksdb_bulk_load",
            "num_keys": num_keys,
            "dim": dim,
            "batch": chunk_keys,
            "ours_keys_per_s": num_keys / timings["ours"],
            "baseline": "Tier.load: a WriteBatch insert per chunk",
            "baseline_keys_per_s": num_keys / timings["baseline"],
            "ratio": timings["baseline"] / timings["ours"],
            "ours_seconds": timings["ours"],
            "baseline_seconds": timings["baseline"],
            "peak_rss_bytes": peak_rss_bytes(),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _print_table(results: list[dict[str, Any]]) -> None:
    for r in results:
        print(f"== {r['tier']}  ({r['num_keys']:,} keys, dim {r['dim']}, batch {r.get('batch')})")
        for k, v in r.items():
            if k in ("tier", "num_keys", "dim", "batch"):
                continue
            if isinstance(v, float):
                v = f"{v:,.3f}" if v < 100 else f"{v:,.0f}"
            elif isinstance(v, int):
                v = f"{v:,}"
            print(f"  {k:24s} {v}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--only", choices=["hash_map", "rocksdb", "bulk_load"], action="append")
    args = parser.parse_args(argv)
    chosen = args.only or ["hash_map", "rocksdb", "bulk_load"]
    results = []
    for name in chosen:
        fn = BENCHES[name]
        kwargs: dict[str, Any] = {"num_keys": args.keys, "dim": args.dim}
        if name != "bulk_load":
            kwargs.update(batch=args.batch, repeats=args.repeats)
        results.append(fn(**kwargs))
        gc.collect()
        _print_table(results[-1:])


BENCHES: dict[str, Callable[..., dict[str, Any]]] = {
    "hash_map": bench_hash_map,
    "rocksdb": bench_rocksdb,
    "bulk_load": bench_bulk_load,
}

if __name__ == "__main__":
    main()
