"""Benchmarks of the database tiers, each beside its baseline on the same data and keys.

- `bench_hash_map`: `HashMapTier.fetch` vs NumPy `searchsorted` on the sorted key array +
  `take` of the rows.
- `bench_rocksdb`: `RocksDBTier.fetch` (key conversion and assembly included) vs a raw
  rocksdict `multi_get` over prepared byte keys, on the same database.
- `bench_bulk_load`: `RocksDBTier.load` (SST ingestion) vs plain WriteBatch inserts.
- `bench_public_lookup`: `HPS.lookup` on the embedded default (hash map over RocksDB, a
  model loaded from files) at 1, 256 and 16,384 keys vs `searchsorted` + `take` of the
  same keys, and the keys/s of two threads calling it over one thread's.
- `bench_key_sketch`: `HPS.lookup` with the hot- and missing-key sketches vs the same
  table with them off, at 1, 256 and 2,000 keys.

Each returns a dict of figures: keys/s of ours and of the baseline, their ratio, and the
peak RSS of the process. Timings are medians of `repeats` runs after `warmup` runs; ours
and the baseline take turns on the same keys in the same process (`_interleaved_medians`),
so load from other processes on the machine hits both alike. Run
`python -m hps.tools.bench.tiers` for a table (`--keys`, `--dim`, `--batch`, `--only`).
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
    fns: dict[str, Callable[[int], object]], repeats: int, warmup: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds of each function, run in turns on the same inputs.

    Turn i runs every function on input i, starting with a different one each turn, so
    drifting machine load and the caches warmed by whoever ran first hit all alike.
    `clock` may be `time.thread_time` for work done on the calling thread alone: the time
    other processes take the core from it is then not counted.
    """
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + repeats):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start = clock()
            fns[name](i)
            if i >= warmup:
                times[name].append(clock() - start)
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
    from hps.tiers.hash_map import HashMapTier

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
    from hps.tiers.rocksdb.tier import RocksDBTier

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

    from hps.tiers.rocksdb.tier import key_bytes

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

    The baseline is the generic `BulkLoadTier.load`: one WriteBatch `insert` per chunk, WAL on,
    as HugeCTR loaded RocksDB. Each runs on its own fresh store.
    """
    from hps.tiers.bulk_load import BulkLoadTier

    keys, vectors = make_table(num_keys, dim)
    rng = np.random.default_rng(3)
    order = rng.permutation(num_keys)  # files come in no particular key order
    keys, vectors = keys[order], vectors[order]
    del order
    work = tempfile.mkdtemp(prefix="hps-bench-load-", dir=path)
    try:
        timings = {}
        for name, loader in (("ours", None), ("baseline", BulkLoadTier.load)):
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
            "baseline": "BulkLoadTier.load: a WriteBatch insert per chunk",
            "baseline_keys_per_s": num_keys / timings["baseline"],
            "ratio": timings["baseline"] / timings["ours"],
            "ours_seconds": timings["ours"],
            "baseline_seconds": timings["baseline"],
            "peak_rss_bytes": peak_rss_bytes(),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def public_model_name(storage: str) -> str:
    """The model `_public_model` serves the table as, stored as `storage`."""
    return "bench" if storage == "float32" else f"bench_{storage}"


def _public_model(folder: str, num_keys: int, dim: int,
                  storages: tuple[str, ...] = ("float32",)) -> tuple[Any, np.ndarray, np.ndarray]:
    """A one-table model written as a sparse folder and loaded into the embedded default
    tiers, once per embedding_storage_dtype in `storages` (models named by
    `public_model_name`); returns the HPS and the table's keys (sorted) with their rows."""
    from hps.api import HPS
    from hps.modelfiles.formats.sparse_folder import write_sparse_model

    keys, vectors = make_table(num_keys, dim)
    shuffled = np.random.default_rng(4).permutation(num_keys)
    write_sparse_model(os.path.join(folder, "table0"), keys[shuffled], vectors[shuffled])
    del shuffled
    config = {
        "supportlonglong": True,
        "models": [{
            "model": public_model_name(storage),
            "sparse_files": [os.path.join(folder, "table0")],
            "embedding_table_names": ["table0"], "embedding_vecsize_per_table": [dim],
            "maxnum_catfeature_query_per_table_per_sample": [1],
            "default_value_for_each_table": [0.0], "deployed_device_list": [0],
            "max_batch_size": 1 << 20, "gpucache": False,
            "embedding_storage_dtype": storage,
        } for storage in storages],
        "volatile_db": {"type": "hash_map"},
        "persistent_db": {"type": "rocks_db", "path": os.path.join(folder, "rocksdb")},
    }
    return HPS(config), keys, vectors


def _threads_keys_per_s(call: Callable[[int], object], threads: int, calls: int,
                        batch: int) -> float:
    """Keys/s of `threads` threads each making `calls` calls of `batch` keys at once."""
    import threading

    start_line = threading.Barrier(threads + 1)

    def worker(w: int) -> None:
        start_line.wait()
        for i in range(calls):
            call(w * calls + i)

    workers = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    for t in workers:
        t.start()
    start_line.wait()
    start = time.perf_counter()
    for t in workers:
        t.join()
    return threads * calls * batch / (time.perf_counter() - start)


def bench_public_lookup(
    num_keys: int = 1_000_000, dim: int = 64, batches: tuple[int, ...] = (1, 256, 16384),
    repeats: int = 2000, thread_batch: int = 16384, rounds: int = 5, path: str | None = None,
) -> dict[str, Any]:
    """`HPS.lookup` (the public call: key intake, dispatch, tiers, counters) vs NumPy
    `searchsorted` on the sorted keys + `take` of the rows, on the same uniform keys (all
    hits), per batch size: median µs of each and the speed-up (baseline time / ours, so
    > 1 is faster than NumPy). Then the keys/s of two threads calling `HPS.lookup` with
    `thread_batch` keys over one thread's (median of `rounds`), and the same for the
    baseline, which shows how much of a second core the machine gave.

    Repeats shrink with the batch so every size takes about as long.
    """
    work = tempfile.mkdtemp(prefix="hps-bench-public-", dir=path)
    latency: list[dict[str, Any]] = []
    try:
        hps, keys, vectors = _public_model(work, num_keys, dim)
        try:
            for batch in batches:
                count = max(20, min(repeats, repeats * 256 // max(batch, 1)))
                # each side its own draws: a batch the other side just read would be
                # served from the CPU caches
                queries = _query_batches(keys, batch, 2 * (10 + count), seed=batch)
                got = hps.lookup(queries[0], "bench", 0)
                assert np.array_equal(got, vectors[np.searchsorted(keys, queries[0])])

                def timed_ours(i: int, q: list[np.ndarray] = queries) -> object:
                    return hps.lookup(q[2 * i], "bench", 0)

                def timed_numpy(i: int, q: list[np.ndarray] = queries) -> object:
                    return np.take(vectors, np.searchsorted(keys, q[2 * i + 1]), axis=0)

                medians = _interleaved_medians({"ours": timed_ours, "baseline": timed_numpy},
                                               count, 10)
                latency.append({
                    "batch": batch, "ours_us": medians["ours"] * 1e6,
                    "baseline_us": medians["baseline"] * 1e6,
                    "speedup": medians["baseline"] / medians["ours"],
                })
            calls = 40
            queries = _query_batches(keys, thread_batch, 2 * calls, seed=7)

            def ours(i: int) -> object:
                return hps.lookup(queries[i], "bench", 0)

            def baseline(i: int) -> object:
                return np.take(vectors, np.searchsorted(keys, queries[i]), axis=0)

            scaling: dict[str, list[float]] = {"ours": [], "baseline": []}
            for _ in range(rounds):
                for name, fn in (("ours", ours), ("baseline", baseline)):
                    one = _threads_keys_per_s(fn, 1, calls, thread_batch)
                    two = _threads_keys_per_s(fn, 2, calls, thread_batch)
                    scaling[name].append(two / one)
        finally:
            hps.close()
        return {
            "num_keys": num_keys, "dim": dim, "cpus": os.cpu_count(), "latency": latency,
            "thread_batch": thread_batch,
            "two_threads_over_one": statistics.median(scaling["ours"]),
            "baseline_two_threads_over_one": statistics.median(scaling["baseline"]),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def format_public_lookup(result: dict[str, Any]) -> str:
    """The figures of `bench_public_lookup` as a plain-text table."""
    lines = [
        f"HPS.lookup on the embedded default, {result['num_keys']:,} keys, width "
        f"{result['dim']}, {result['cpus']} CPUs (medians)",
        f"{'keys':>8}  {'HPS.lookup µs':>14}  {'searchsorted+take µs':>21}  {'speed-up':>8}",
    ]
    for row in result["latency"]:
        lines.append(f"{row['batch']:>8,}  {row['ours_us']:>14,.1f}  "
                     f"{row['baseline_us']:>21,.1f}  {row['speedup']:>7.2f}×")
    lines.append(
        f"two threads / one, {result['thread_batch']:,} keys per call: HPS.lookup "
        f"{result['two_threads_over_one']:.2f}×, searchsorted+take "
        f"{result['baseline_two_threads_over_one']:.2f}×")
    return "\n".join(lines)


def bench_key_sketch(
    num_keys: int = 1_000_000, dim: int = 64, batches: tuple[int, ...] = (1, 256, 2000),
    repeats: int = 2000, block: int = 64, path: str | None = None,
) -> dict[str, Any]:
    """What the hot- and missing-key sketches cost a lookup: `HPS.lookup` of one table
    with the default `hot_key_sampling`, in turns with the same lookups with the sampling
    switched off through the lookup path's own switch (`LoadedTable.hot_mask`, what
    `hot_key_sampling: 0` sets), on uniform keys (all hits; the sketch's worst case:
    almost every key it is fed is new to it). One table for both sides, so its memory
    layout is no difference between them. A sampled lookup pays for the others, so each
    timing is a block of `block` lookups (a multiple of the sampling), the median of
    blocks per side, in CPU time of the calling thread; per batch size: µs per lookup of
    each and the overhead (with / without - 1)."""
    from hps.server.key_sketch import HOT_EVERY

    work = tempfile.mkdtemp(prefix="hps-bench-sketch-", dir=path)
    rows: list[dict[str, Any]] = []
    try:
        hps, keys, _ = _public_model(work, num_keys, dim)
        try:
            table = hps.server.model("bench").tables[0]
            sampled_mask = table.hot_mask
            for batch in batches:
                count = max(50, min(repeats, repeats * 256 // max(batch, 1)) // 10)
                queries = _query_batches(keys, batch, block, seed=batch + 1)

                def sampled(i: int, q: list[np.ndarray] = queries) -> None:
                    table.hot_mask = sampled_mask
                    for j in range(block):
                        hps.lookup(q[j], "bench", 0)

                def unsampled(i: int, q: list[np.ndarray] = queries) -> None:
                    table.hot_mask = -1
                    for j in range(block):
                        hps.lookup(q[j], "bench", 0)

                # a hit is served on this thread alone (the hash map's compiled fetch):
                # its CPU time leaves out what other processes take of the core
                medians = _interleaved_medians({"with": sampled, "without": unsampled},
                                               count, 3, clock=time.thread_time)
                table.hot_mask = sampled_mask
                fed, plain = _sampled_call_medians(hps, table, queries, count)
                rows.append({"batch": batch, "with_us": medians["with"] / block * 1e6,
                             "without_us": medians["without"] / block * 1e6,
                             "overhead": medians["with"] / medians["without"] - 1.0,
                             "fed_call_us": fed * 1e6, "plain_call_us": plain * 1e6,
                             "overhead_from_calls": (fed - plain) / HOT_EVERY / plain})
        finally:
            hps.close()
        return {"num_keys": num_keys, "dim": dim, "every": HOT_EVERY, "block": block,
                "latency": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _sampled_call_medians(hps: Any, table: Any, queries: list[np.ndarray], rounds: int
                          ) -> tuple[float, float]:
    """Median seconds of the lookups that fed the hot sketch and of the others, timed one
    by one in the same run (a lookup feeds it when its number, `TableStats.lookups` after
    it, has none of `table.hot_mask`'s bits set)."""
    fed: list[float] = []
    plain: list[float] = []
    for _ in range(rounds):
        for q in queries:
            number = table.stats.lookups + 1
            start = time.perf_counter()
            hps.lookup(q, "bench", 0)
            took = time.perf_counter() - start
            (plain if number & table.hot_mask else fed).append(took)
    return statistics.median(fed), statistics.median(plain)


def format_key_sketch(result: dict[str, Any]) -> str:
    """The figures of `bench_key_sketch` as a plain-text table."""
    lines = [
        f"the key sketches' cost: HPS.lookup, sampling 1 in {result['every']} vs off, "
        f"{result['num_keys']:,} keys,",
        f"width {result['dim']} (medians: of {result['block']}-lookup blocks in thread CPU "
        "time, and of single calls)",
        f"{'keys':>8}  {'with µs':>8}  {'without µs':>10}  {'ratio':>6}  {'fed µs':>8}  "
        f"{'other µs':>8}  {'added':>6}",
    ]
    for row in result["latency"]:
        lines.append(f"{row['batch']:>8,}  {row['with_us']:>8,.2f}  "
                     f"{row['without_us']:>10,.2f}  {row['overhead'] + 1:>5.3f}×  "
                     f"{row['fed_call_us']:>8,.2f}  {row['plain_call_us']:>8,.2f}  "
                     f"{row['overhead_from_calls']:>+6.2%}")
    lines += ["ratio: with / without, blocks of lookups in turns; added: (a lookup that fed",
              f"the sketch - another) / {result['every']} / another, timed one by one"]
    return "\n".join(lines)


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
