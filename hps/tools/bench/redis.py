"""Benchmark of the Redis tier beside a raw redis-py pipelined HMGET, same run, same keys.

`bench_redis(address)` loads `num_keys` rows of width `dim` into one table (HugeCTR's
layout: `num_partitions` hashes `hps_et{<table>/p<N>}v`), then times, on the same random
batches of `batch` keys (all present):

- ours: `RedisTier.fetch(table, keys)`, int64 keys in, float32 rows + found mask out: key
  conversion, grouping by partition and decoding included;
- baseline: a redis-py pipeline (`Redis.pipeline` or, on a cluster, `RedisCluster.pipeline`)
  of one `HMGET` per partition hash and `max_batch_size` chunk, over byte keys already
  converted and grouped outside the timing; the replies are left as redis-py returns them
  (lists of bytes), nothing decoded.

Timings are medians of `repeats` batches after `warmup`, ours and the baseline taking
turns batch by batch. With no `address`, the benchmark
starts its own servers (`hps.tools.bench.redis_servers`): a standalone server, or with
`cluster=True` a cluster of 3 masters. `python -m hps.tools.bench.redis` runs both and prints
the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

TABLE = "hps_et.bench.table0"


@contextlib.contextmanager
def _servers(address: str | None, cluster: bool) -> Iterator[str]:
    if address is not None:
        yield address
        return
    from hps.tools.bench.redis_servers import RedisClusterProcs, RedisServer

    if cluster:
        with RedisClusterProcs(masters=3) as procs:
            yield procs.address
    else:
        with RedisServer() as server:
            yield server.address


def _baseline_client(address: str, cluster: bool) -> Any:
    import redis

    host, port = address.split(",")[0].rsplit(":", 1)
    if cluster:
        return redis.RedisCluster(host=host, port=int(port))
    return redis.Redis(host=host, port=int(port))


def bench_redis(
    address: str | None = None,
    num_keys: int = 1_000_000,
    dim: int = 64,
    batch: int = 16384,
    *,
    cluster: bool = False,
    repeats: int = 30,
    warmup: int = 3,
    num_partitions: int = 16,
    max_batch_size: int = 65536,
) -> dict[str, Any]:
    """RedisTier.fetch vs a raw redis-py pipelined HMGET; returns the figures as a dict.

    `address`: a running Redis (`host:port`, or a comma list of cluster seeds); the mode
    is detected. None: start a standalone server (or a 3-master cluster if `cluster`).
    The table is dropped at the end.
    """
    from hps.config import VolatileDBConfig
    from hps.tiers.partition import partition_of
    from hps.tiers.redis import RedisTier, value_hash
    from hps.tools.bench.tiers import make_table

    keys, vectors = make_table(num_keys, dim)
    rng = np.random.default_rng(1)
    queries = [keys[rng.integers(0, num_keys, batch)] for _ in range(warmup + repeats)]

    with _servers(address, cluster) as addr:
        config = VolatileDBConfig(
            type="redis_cluster", address=addr, num_partitions=num_partitions,
            max_batch_size=max_batch_size, socket_timeout=30.0,
        )
        tier = RedisTier(config)
        is_cluster = bool(tier.cluster)
        tier.create_table(TABLE, dim)
        tier.drop_table(TABLE)
        tier.create_table(TABLE, dim)
        start = time.perf_counter()
        for a in range(0, num_keys, 1 << 17):
            tier.insert(TABLE, keys[a:a + (1 << 17)], vectors[a:a + (1 << 17)])
        load_s = time.perf_counter() - start

        names = [value_hash(TABLE, p) for p in range(num_partitions)]

        def prepare(q: np.ndarray) -> list[tuple[str, list[bytes]]]:
            parts = partition_of(q, num_partitions)
            commands = []
            for p in range(num_partitions):
                fields = q[parts == p].astype("<i8").view("V8").tolist()
                for a in range(0, len(fields), max_batch_size):
                    commands.append((names[p], fields[a:a + max_batch_size]))
            return commands

        prepared = [prepare(q) for q in queries]
        client = _baseline_client(addr, is_cluster)

        def baseline(i: int) -> list[Any]:
            pipe = client.pipeline(transaction=False) if not is_cluster else client.pipeline()
            for name, fields in prepared[i]:
                pipe.execute_command("HMGET", name, *fields)
            return list(pipe.execute())

        def ours(i: int) -> None:
            tier.fetch(TABLE, queries[i])

        # Same answers, checked once outside the timing.
        got, found = tier.fetch(TABLE, queries[0])
        replies = baseline(0)
        assert found.all(), "every benchmark key is present"
        rows = np.concatenate([
            np.frombuffer(b"".join(r), dtype="<f4").reshape(-1, dim) for r in replies
        ])
        order = np.argsort(partition_of(queries[0], num_partitions), kind="stable")
        assert np.array_equal(rows, got[order]), "tier and baseline disagree"

        # Interleaved batch by batch, so that the drift of a shared machine hits both alike.
        for i in range(warmup):
            baseline(i)
            ours(i)
        base_t, ours_t = [], []
        for i in range(warmup, warmup + repeats):
            start = time.perf_counter()
            baseline(i)
            base_t.append(time.perf_counter() - start)
            start = time.perf_counter()
            ours(i)
            ours_t.append(time.perf_counter() - start)
        base_s, ours_s = statistics.median(base_t), statistics.median(ours_t)
        tier.drop_table(TABLE)
        stats = tier.stats()
        tier.close()
        client.close()

    return {
        "tier": "redis cluster" if is_cluster else "redis",
        "nodes": len(stats["nodes"]),
        "num_keys": num_keys,
        "dim": dim,
        "batch": batch,
        "ours_keys_per_s": batch / ours_s,
        "baseline": "redis-py pipelined HMGET, prepared byte keys",
        "baseline_keys_per_s": batch / base_s,
        "ratio": base_s / ours_s,
        "ours_batch_ms": ours_s * 1e3,
        "baseline_batch_ms": base_s * 1e3,
        "load_keys_per_s": num_keys / load_s,
    }


def bench_redis_both(
    num_keys: int = 1_000_000, dim: int = 64, batch: int = 16384, repeats: int = 30
) -> list[dict[str, Any]]:
    """Standalone and 3-master cluster, each on servers started for the run."""
    return [
        bench_redis(None, num_keys, dim, batch, cluster=c, repeats=repeats) for c in (False, True)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a running Redis (default: start servers)")
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    if args.address:
        results = [bench_redis(args.address, args.keys, args.dim, args.batch,
                               repeats=args.repeats)]
    else:
        results = bench_redis_both(args.keys, args.dim, args.batch, args.repeats)
    for r in results:
        print(f"== {r['tier']} ({r['nodes']} node(s), {r['num_keys']:,} keys, dim {r['dim']}, "
              f"batch {r['batch']:,})")
        for k, v in r.items():
            if k in ("tier", "nodes", "num_keys", "dim", "batch"):
                continue
            if isinstance(v, float):
                v = f"{v:,.2f}" if v < 100 else f"{v:,.0f}"
            print(f"  {k:22s} {v}")


if __name__ == "__main__":
    main()
