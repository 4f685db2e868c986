"""`hps bench load`: how fast a model loads, through the call a user makes.

`bench_load_formats`: the same rows written as a HugeCTR sparse folder and in each other
format (Parquet, NumPy, safetensors, by hps's own streaming writers), each loaded by
`HPS(config)` into the same embedded tiers (in-process hash map over RocksDB, on a fresh
store every time), in interleaved rounds so machine load hits every format alike. Each
format's median load rate is printed beside the sparse folder's, as a ratio. The files
are hot in the page cache for every format alike (they were just written).

`time_load(config)` is the one timed step (a full `HPS(config)` construction): other
load benchmarks (scale curves) build on it.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hps.bench.tiers import make_table, peak_rss_bytes
from hps.io.formats import FORMATS, open_writer

#: where each format's copy of the table is written, inside the work folder
FORMAT_FILES = {
    "sparse_folder": "sparse_folder",
    "parquet": "table.parquet",
    "numpy": "numpy_folder",
    "safetensors": "table.safetensors",
}
BASELINE = "sparse_folder"


def load_config(files: str, dim: int, rocks_path: str) -> dict[str, Any]:
    """A ps config of one table read from `files` into the hash map over RocksDB."""
    return {
        "supportlonglong": True,
        "models": [{
            "model": "bench",
            "sparse_files": [files],
            "embedding_vecsize_per_table": [dim],
            "maxnum_catfeature_query_per_table_per_sample": [1],
            "max_batch_size": 1024,
            "deployed_device_list": [0],
            "gpucache": False,
        }],
        "volatile_db": {"type": "hash_map"},
        "persistent_db": {"type": "rocks_db", "path": rocks_path},
    }


def time_load(config: dict[str, Any], check_keys: np.ndarray | None = None
              ) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) `HPS(config)` takes to load every
    table; optionally checks that a few keys are served.

    CPU seconds count every thread of the process (readers, RocksDB's own threads): the
    work done, which other processes on a busy machine do not inflate as they do wall time.
    """
    from hps.api import HPS

    start, cpu = time.perf_counter(), time.process_time()
    hps = HPS(config)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    try:
        if check_keys is not None:
            vectors = hps.lookup(check_keys, "bench", 0)
            if not np.any(vectors):
                raise AssertionError("loaded table answered only default vectors")
    finally:
        hps.close()
    return seconds, cpu


def write_formats(folder: str, keys: np.ndarray, vectors: np.ndarray,
                  formats: Sequence[str], chunk_rows: int = 1 << 18) -> dict[str, str]:
    """The table written once per format under `folder`; format → path."""
    paths = {}
    for fmt in formats:
        path = os.path.join(folder, FORMAT_FILES[fmt])
        with open_writer(path, fmt, len(keys), vectors.shape[1]) as writer:
            for start in range(0, len(keys), chunk_rows):
                writer.write(keys[start : start + chunk_rows], vectors[start : start + chunk_rows])
        paths[fmt] = path
    return paths


def bench_load_formats(
    formats: Sequence[str] = FORMATS,
    num_keys: int = 2_000_000,
    dim: int = 64,
    rounds: int = 3,
    path: str | None = None,
) -> list[dict[str, Any]]:
    """Load rate of each format beside the sparse folder's on the same rows; one row each.

    Every round loads every format once (the order rotating), each into a fresh RocksDB
    store; a row reports the median seconds and keys/s of the format and of the sparse
    folder, and their ratio (format keys/s ÷ sparse folder keys/s); the same ratio of the
    best (fastest) rounds, and of the process's CPU seconds (both steadier than the median
    wall time on a busy machine).
    """
    unknown = [f for f in formats if f not in FORMAT_FILES]
    if unknown:
        raise ValueError(f"unknown format(s) {', '.join(unknown)}: pick from {', '.join(FORMATS)}")
    wanted = [BASELINE, *[f for f in formats if f != BASELINE]]
    keys, vectors = make_table(num_keys, dim)
    order = np.random.default_rng(3).permutation(num_keys)  # files hold keys unsorted
    keys, vectors = keys[order], vectors[order]
    check = keys[:: max(1, num_keys // 1000)]
    work = tempfile.mkdtemp(prefix="hps-bench-load-", dir=path)
    try:
        files = write_formats(work, keys, vectors, wanted)
        sizes = {f: _size(p) for f, p in files.items()}
        del order, vectors
        times: dict[str, list[float]] = {f: [] for f in wanted}
        cpu: dict[str, list[float]] = {f: [] for f in wanted}
        for i in range(rounds):
            shift = i % len(wanted)
            for fmt in wanted[shift:] + wanted[:shift]:
                rocks = os.path.join(work, f"rocks-{fmt}-{i}")
                wall, used = time_load(load_config(files[fmt], dim, rocks), check)
                times[fmt].append(wall)
                cpu[fmt].append(used)
                shutil.rmtree(rocks, ignore_errors=True)
        base = statistics.median(times[BASELINE])
        base_cpu = statistics.median(cpu[BASELINE])
        rows = []
        for fmt in wanted:
            seconds, cpu_seconds = statistics.median(times[fmt]), statistics.median(cpu[fmt])
            rows.append({
                "name": fmt,
                "num_keys": num_keys,
                "dim": dim,
                "file_bytes": sizes[fmt],
                "keys_per_s": num_keys / seconds,
                "sparse_folder_keys_per_s": num_keys / base,
                "ratio": base / seconds,
                "best_ratio": min(times[BASELINE]) / min(times[fmt]),
                "cpu_seconds": cpu_seconds,
                "cpu_ratio": base_cpu / cpu_seconds,
                "seconds": seconds,
                "rounds": rounds,
                "peak_rss_bytes": peak_rss_bytes(),
            })
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return os.path.getsize(path)
