"""`hps bench storage`: each embedding_storage_dtype beside float32 on the public call.

One process loads the same table (a sparse folder of random keys) as one model per
storage type into the embedded default (hash map over RocksDB). Per batch size, the
median µs of `HPS.lookup` (float32 output) of each model, taking turns on their own
uniform draws (all hits) so load from other processes hits all alike, and each type's
speed over float32's (float32 µs / its µs: > 1 is faster). One more row: a float16 table
looked up into a float16 output (`lookup_fromdlpack`, written without widening) beside a
float32 table into a float32 output through the same call. Then the process RSS growth of
loading the table, per type, each in a fresh process (hps.tools.bench.load's measured load),
with its ratio to float32's.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hps.rows.storage_types import STORAGE_NAMES, decode, encode, narrow
from hps.tools.bench.load import _load_in_child, load_config
from hps.tools.bench.tiers import (
    _interleaved_medians,
    _public_model,
    _query_batches,
    public_model_name,
)

#: the extra row: a float16 table into a float16 output, beside float32 into float32
HALF_OUT = "float16 → float16 out"


def bench_storage(num_keys: int = 1_000_000, dim: int = 64,
                  batches: Sequence[int] = (1, 256, 16384), repeats: int = 2000,
                  rss_rounds: int = 1, path: str | None = None) -> dict[str, Any]:
    """The figures the module docstring names, as a dict (`format_storage` prints it)."""
    work = tempfile.mkdtemp(prefix="hps-bench-storage-", dir=path)
    try:
        hps, keys, vectors = _public_model(work, num_keys, dim, STORAGE_NAMES)
        try:
            latency = [_latency_row(hps, keys, vectors, batch, repeats) for batch in batches]
        finally:
            hps.close()
        del vectors
        memory = _rss_growth(os.path.join(work, "table0"), dim, work, rss_rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"num_keys": num_keys, "dim": dim, "cpus": os.cpu_count(), "latency": latency,
            "memory": memory}


def _latency_row(hps: Any, keys: np.ndarray, vectors: np.ndarray, batch: int,
                 repeats: int) -> dict[str, Any]:
    count = max(20, min(repeats, repeats * 256 // max(batch, 1)))
    calls = _calls(hps, dim=vectors.shape[1], batch=batch)
    sides = len(calls)
    # each side its own draws: a batch another side just read would be in the CPU caches
    queries = _query_batches(keys, batch, sides * (10 + count), seed=batch)
    _check(hps, keys, vectors, queries[0])

    def turn(k: int, call: Callable[[np.ndarray], object]) -> Callable[[int], object]:
        return lambda i: call(queries[sides * i + k])

    medians = _interleaved_medians(
        {name: turn(k, call) for k, (name, call) in enumerate(calls.items())}, count, 10)
    base = medians["float32"]
    return {"batch": batch,
            "us": {name: m * 1e6 for name, m in medians.items()},
            "speedup": {name: (medians["float32 out"] if name == HALF_OUT else base) / m
                        for name, m in medians.items()}}


def _calls(hps: Any, dim: int, batch: int) -> dict[str, Callable[[np.ndarray], object]]:
    """The timed public calls, by row name."""
    def lookup(model: str) -> Callable[[np.ndarray], object]:
        return lambda q: hps.lookup(q, model, 0)

    calls = {storage: lookup(public_model_name(storage)) for storage in STORAGE_NAMES}
    wide = np.empty((batch, dim), np.float32)
    half = np.empty((batch, dim), np.float16)
    calls["float32 out"] = lambda q: hps.lookup_fromdlpack(q, wide, "bench", 0)
    calls[HALF_OUT] = lambda q: hps.lookup_fromdlpack(q, half, public_model_name("float16"), 0)
    return calls


def _check(hps: Any, keys: np.ndarray, vectors: np.ndarray, query: np.ndarray) -> None:
    """Every model serves the reference decode of the rows (once, outside the timing)."""
    rows = vectors[np.searchsorted(keys, query)]
    for storage in STORAGE_NAMES:
        got = hps.lookup(query, public_model_name(storage), 0)
        if not np.array_equal(got, decode(storage, encode(storage, rows), rows.shape[1])):
            raise AssertionError(f"the {storage} model does not serve the reference decode")
    half = np.empty(rows.shape, np.float16)
    hps.lookup_fromdlpack(query, half, public_model_name("float16"), 0)
    if not np.array_equal(half, narrow("float16", rows)):
        raise AssertionError("the float16 output does not hold the stored float16 rows")


def _rss_growth(files: str, dim: int, work: str, rounds: int) -> list[dict[str, Any]]:
    """RSS growth of `HPS(config)` loading `files`, per storage type, in a fresh process
    (median of `rounds`), and its ratio to float32's."""
    grown: dict[str, float] = {}
    for storage in STORAGE_NAMES:
        results = []
        for i in range(rounds):
            rocks = os.path.join(work, f"rocks-{storage}-{i}")
            config = load_config(files, dim, rocks)
            config["models"][0]["embedding_storage_dtype"] = storage
            results.append(_load_in_child(config, work))
            shutil.rmtree(rocks, ignore_errors=True)
        grown[storage] = statistics.median(r["rss_after"] - r["rss_before"] for r in results)
    return [{"storage": s, "rss_growth_bytes": g, "ratio": g / grown["float32"]}
            for s, g in grown.items()]


def format_storage(result: dict[str, Any]) -> str:
    """The figures of `bench_storage` as a plain-text table."""
    names = list(result["latency"][0]["us"])
    lines = [f"HPS.lookup on the embedded default (hash map over RocksDB), "
             f"{result['num_keys']:,} keys, width {result['dim']}, {result['cpus']} CPUs; "
             "median µs (speed over float32)",
             f"{'storage':>22}" + "".join(f"{r['batch']:>22,}" for r in result["latency"])]
    for name in names:
        cells = "".join(f"{r['us'][name]:>12,.1f} ({r['speedup'][name]:>5.2f}×)"
                        for r in result["latency"])
        lines.append(f"{name:>22}{cells}")
    lines.append(f"('{HALF_OUT}': lookup_fromdlpack, over 'float32 out', the same call of "
                 "the float32 table)")
    lines.append("process RSS growth of the load (hash map over RocksDB, a fresh process "
                 "each):")
    for row in result["memory"]:
        lines.append(f"{row['storage']:>22}{row['rss_growth_bytes'] / 2**20:>12,.1f} MiB "
                     f"({row['ratio']:.3f}× float32)")
    return "\n".join(lines)
