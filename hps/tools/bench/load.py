"""`hps bench load`: how fast a model loads, through the call a user makes.

`bench_load_formats`: the same rows written as a HugeCTR sparse folder and in each other
format (Parquet, NumPy, safetensors, by hps's own streaming writers; PyTorch's files as a
training job writes them: `torch` a `torch.save` state_dict, `dcp` two checkpoint folders
saved by two processes with the table sharded row-wise and column-wise), each loaded by
`HPS(config)` into the same embedded tiers (in-process hash map over RocksDB, on a fresh
store every time), in interleaved rounds so machine load hits every format alike. Each
format's median load rate is printed beside the sparse folder's, as a ratio, and beside
safetensors' when PyTorch's files are measured (safetensors is then always measured, and
every file holds keys = row index, as PyTorch's files do: the same keys and rows in every
format; the safetensors file is then a PyTorch user's, `save_file({"weight": rows})`).
The files are hot in the page cache for every format alike (they were just written).

`time_load(config)` is the one timed step (a full `HPS(config)` construction): other
load benchmarks (scale curves) build on it.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from hps.modelfiles.formats import FORMATS, open_writer
from hps.tools.bench import load_files
from hps.tools.bench.tiers import make_table, peak_rss_bytes

#: where each format's copy of the table is written, inside the work folder
FORMAT_FILES = {
    "sparse_folder": "sparse_folder",
    "parquet": "table.parquet",
    "numpy": "numpy_folder",
    "safetensors": "table.safetensors",
    "torch": "table.pt",
    "dcp row-wise": "dcp_row_wise",
    "dcp column-wise": "dcp_column_wise",
}
BASELINE = "sparse_folder"
#: the formats `--format` names, and what each one measures
BENCH_FORMATS = {"parquet": ("parquet",), "numpy": ("numpy",),
                 "safetensors": ("safetensors",), "torch": ("torch",),
                 "dcp": ("dcp row-wise", "dcp column-wise")}
#: what PyTorch's files are compared with: the reader of their closest format
TORCH_BASELINE = "safetensors"
_TORCH_FILES = ("torch", "dcp row-wise", "dcp column-wise")


def load_config(files: str | dict[str, Any], dim: int, rocks_path: str) -> dict[str, Any]:
    """A ps config of one table read from `files` (a path, or a sparse_files entry) into
    the hash map over RocksDB."""
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
                  formats: Sequence[str], chunk_rows: int = 1 << 18, *,
                  by_row_index: bool = False) -> dict[str, str | dict[str, Any]]:
    """The table written once per format under `folder`; format → its sparse_files entry.
    PyTorch's files key a row by its index: `keys` must then be 0 … n-1, and
    `by_row_index` writes safetensors as a PyTorch user does too (`save_file({"weight":
    rows})`, no keys tensor)."""
    paths: dict[str, str | dict[str, Any]] = {}
    for fmt in formats:
        path = os.path.join(folder, FORMAT_FILES[fmt])
        if fmt in _TORCH_FILES or (by_row_index and fmt == "safetensors"):
            paths[fmt] = _write_torch_files(folder, path, fmt, vectors)
            continue
        with open_writer(path, fmt, len(keys), vectors.shape[1]) as writer:
            for start in range(0, len(keys), chunk_rows):
                writer.write(keys[start : start + chunk_rows], vectors[start : start + chunk_rows])
        paths[fmt] = path
    return paths


def _write_torch_files(folder: str, path: str, fmt: str, vectors: np.ndarray
                       ) -> dict[str, Any]:
    if fmt in ("torch", "safetensors"):
        write = load_files.write_torch_state if fmt == "torch" else load_files.write_safetensors
        write(path, vectors)
        return {"path": path, "format": fmt, "tensor": load_files.TORCH_TENSOR}
    rows_npy = os.path.join(folder, "dcp_rows.npy")  # what each saving rank reads its shard of
    if not os.path.exists(rows_npy):
        np.save(rows_npy, vectors)
    load_files.write_dcp(path, rows_npy, fmt.removeprefix("dcp "))
    return {"path": path, "format": "dcp", "tensor": load_files.TORCH_TENSOR}


def bench_load_formats(
    formats: Sequence[str] = FORMATS,
    num_keys: int = 2_000_000,
    dim: int = 64,
    rounds: int = 3,
    path: str | None = None,
) -> list[dict[str, Any]]:
    """Load rate of each format beside the sparse folder's on the same rows; one row each.

    `formats` are `--format`'s names (BENCH_FORMATS: `dcp` measures a row-wise and a
    column-wise checkpoint). An untimed round first loads every format once; then every
    round loads every format once (the order rotating), each into a fresh RocksDB store; a
    row reports the median seconds and keys/s of the format and of the sparse folder, and
    their ratio (format keys/s ÷ sparse folder keys/s); the same ratio of the best
    (fastest) rounds, and of the process's CPU seconds (both steadier than the median wall
    time on a busy machine). With PyTorch's files, the same three ratios to safetensors
    (`safetensors_ratio`, `safetensors_best_ratio`, `safetensors_cpu_ratio`).
    """
    unknown = [f for f in formats if f not in BENCH_FORMATS and f != BASELINE]
    if unknown:
        raise ValueError(f"unknown format(s) {', '.join(unknown)}: pick from "
                         f"{', '.join(BENCH_FORMATS)}")
    measured = [m for f in formats if f != BASELINE for m in BENCH_FORMATS[f]]
    torch_files = any(m in _TORCH_FILES for m in measured)
    if torch_files and TORCH_BASELINE not in measured:
        measured.insert(0, TORCH_BASELINE)
    wanted = [BASELINE, *dict.fromkeys(measured)]
    keys, vectors = make_table(num_keys, dim)
    if torch_files:  # PyTorch's files key a row by its index: every format does the same
        keys = np.arange(num_keys, dtype=np.int64)
    else:
        order = np.random.default_rng(3).permutation(num_keys)  # files hold keys unsorted
        keys, vectors = keys[order], vectors[order]
        del order
    check = keys[:: max(1, num_keys // 1000)]
    work = tempfile.mkdtemp(prefix="hps-bench-load-", dir=path)
    try:
        files = write_formats(work, keys, vectors, wanted, by_row_index=torch_files)
        sizes = {f: _size(p if isinstance(p, str) else p["path"]) for f, p in files.items()}
        del vectors
        times: dict[str, list[float]] = {f: [] for f in wanted}
        cpu: dict[str, list[float]] = {f: [] for f in wanted}
        # round -1 is not timed: a process's first load of each format also loads compiled
        # kernels and libraries once, which would count against whichever format came first
        for i in range(-1, rounds):
            shift = i % len(wanted)
            for fmt in wanted[shift:] + wanted[:shift]:
                rocks = os.path.join(work, f"rocks-{fmt.replace(' ', '-')}-{i}")
                wall, used = time_load(load_config(files[fmt], dim, rocks), check)
                if i >= 0:
                    times[fmt].append(wall)
                    cpu[fmt].append(used)
                shutil.rmtree(rocks, ignore_errors=True)
        rows = []
        for fmt in wanted:
            row = {
                "name": fmt,
                "num_keys": num_keys,
                "dim": dim,
                "file_bytes": sizes[fmt],
                "keys_per_s": num_keys / statistics.median(times[fmt]),
                "sparse_folder_keys_per_s": num_keys / statistics.median(times[BASELINE]),
                **_ratios(times, cpu, fmt, BASELINE, ""),
                "cpu_seconds": statistics.median(cpu[fmt]),
                "seconds": statistics.median(times[fmt]),
                "rounds": rounds,
                "peak_rss_bytes": peak_rss_bytes(),
            }
            if torch_files:
                row.update(_ratios(times, cpu, fmt, TORCH_BASELINE, "safetensors_"))
            rows.append(row)
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _ratios(times: dict[str, list[float]], cpu: dict[str, list[float]], fmt: str,
            base: str, prefix: str) -> dict[str, float]:
    """`fmt`'s load rate over `base`'s: by median wall time, best round, median CPU time."""
    return {
        f"{prefix}ratio": statistics.median(times[base]) / statistics.median(times[fmt]),
        f"{prefix}best_ratio": min(times[base]) / min(times[fmt]),
        f"{prefix}cpu_ratio": statistics.median(cpu[base]) / statistics.median(cpu[fmt]),
    }


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return os.path.getsize(path)


# -- the scale curve ---------------------------------------------------------------------


#: rows of each size the baseline (rocksdict's own SstFileWriter, one core, a Python call
#: per key) writes: its rate per key does not depend on the table size, and at 100M keys
#: writing them all would take longer than the load it is a baseline for
BASELINE_ROWS = 2_000_000
#: keys whose rows the measured process looks up and compares after its load
CHECK_KEYS = 1024


def sst_writer_keys_per_s(keys: np.ndarray, vectors: np.ndarray, folder: str,
                          file_bytes: int = 64 << 20) -> float:
    """Keys/s of rocksdict's own `SstFileWriter` writing these rows, already sorted in
    RocksDB's order, as table files of `file_bytes` (as REFERENCE.md §15 measured it: the
    raw bytes made by NumPy, a `put` per key driven by `map`, no compression)."""
    import collections

    import rocksdict

    options = rocksdict.Options(raw_mode=True)
    options.set_compression_type(rocksdict.DBCompressionType.none())
    dim = vectors.shape[1]
    per_file = max(1, file_bytes // (4 * dim))
    start = time.perf_counter()
    for i, first in enumerate(range(0, len(keys), per_file)):
        writer = rocksdict.SstFileWriter(options)
        writer.open(os.path.join(folder, f"raw-{i:05d}.sst"))
        key_bytes = keys[first : first + per_file].astype("<i8").view("V8").tolist()
        rows = vectors[first : first + per_file].view(f"V{4 * dim}").reshape(-1).tolist()
        collections.deque(map(writer.__setitem__, key_bytes, rows), maxlen=0)
        writer.finish()
    return len(keys) / (time.perf_counter() - start)


def baseline_keys_per_s(num_keys: int, dim: int, folder: str) -> float:
    """`sst_writer_keys_per_s` on the first `BASELINE_ROWS` rows of the synthetic table
    (all of them when it is smaller), sorted in RocksDB's order, under `folder` (removed)."""
    from hps.tiers.rocksdb.bulk import bytewise_order

    count = min(num_keys, BASELINE_ROWS)
    keys = load_files.keys_of(np.arange(count, dtype=np.int64))
    keys = keys[bytewise_order(keys)]
    os.makedirs(folder)
    try:
        return sst_writer_keys_per_s(keys, load_files.rows_of(keys, dim), folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def measure_load(config_path: str, num_keys: int | None = None) -> dict[str, float]:
    """Run in a fresh process: `HPS(config)` from the config file, timed (wall and CPU
    seconds), with the process's RSS before (the tiers' compiled code loaded, nothing
    else), after (the server still open) and at its peak. With `num_keys` (a table of
    `hps.tools.bench.load_files`), afterwards the rows of CHECK_KEYS keys spread over the table
    are looked up and compared with what the files hold (AssertionError on a difference)."""
    import gc
    import json
    import resource

    import psutil

    from hps.api import HPS
    from hps.tiers.hash_map import HashMapTier  # noqa: F401 - compiled kernels: not the load's
    from hps.tiers.rocksdb.tier import RocksDBTier  # noqa: F401

    with open(config_path) as f:
        config = json.load(f)
    process = psutil.Process()
    gc.collect()
    before = process.memory_info().rss
    start, cpu = time.perf_counter(), time.process_time()
    hps = HPS(config)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    try:
        gc.collect()
        after = process.memory_info().rss
        if num_keys is not None:
            _check_rows(hps, num_keys, config["models"][0]["embedding_vecsize_per_table"][0])
    finally:
        hps.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "cpu_seconds": cpu, "rss_before": before,
            "rss_after": after, "rss_peak": peak}


def _check_rows(hps: Any, num_keys: int, dim: int) -> None:
    """AssertionError unless keys spread over the table get exactly the files' rows."""
    rows = np.linspace(0, num_keys - 1, min(num_keys, CHECK_KEYS)).astype(np.int64)
    keys = load_files.keys_of(rows)
    got = hps.lookup(keys, "bench", 0)
    wrong = np.flatnonzero(~np.all(got == load_files.rows_of(keys, dim), axis=1))
    if wrong.size:
        raise AssertionError(f"{wrong.size} of {keys.size} checked keys got other rows than "
                             f"the files hold (first: key {int(keys[wrong[0]])})")


def _load_in_child(config: dict[str, Any], folder: str,
                   num_keys: int | None = None) -> dict[str, float]:
    """`measure_load` of `config` in a fresh process; with `num_keys` (a table written by
    hps.tools.bench.load_files) its rows are checked after the load."""
    import json
    import subprocess
    import sys

    import hps

    path = os.path.join(folder, "ps.json")
    with open(path, "w") as f:
        json.dump(config, f)
    # the folder holding this hps package: the child imports the same copy of it
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(hps.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)}
    checked = [] if num_keys is None else [str(num_keys)]
    done = subprocess.run([sys.executable, "-m", "hps.tools.bench.load", "measure", path,
                           *checked], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the measured load failed:\n{done.stderr[-4000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def disk_needed(num_keys: int, dim: int) -> int:
    """Bytes of disk one size of the scale curve takes at once: the files, the RocksDB
    store a load writes (keys as 16-byte internal keys, a few bytes of framing a row),
    the baseline's table files."""
    raw = num_keys * (8 + 4 * dim)
    store = num_keys * (16 + 4 * dim + 8)
    baseline = min(num_keys, BASELINE_ROWS) * (16 + 4 * dim + 8)
    return raw + store + baseline


def scale_rows(sizes: Sequence[int], dim: int = 64, rounds: int = 3,
               path: str | None = None, progress: Any = None) -> Iterator[dict[str, Any]]:
    """The scale curve, a size at a time: for each table size, `HPS(config)` loading a
    sparse folder of that many random keys (`hps.tools.bench.load_files`: written once per
    size, fsynced, reused by every round, removed before the next size) into the hash map
    over RocksDB (a fresh process and store per load; median of `rounds`; every load
    checked against the files on spread keys), its keys/s and CPU seconds, the process's
    RSS growth over the raw key + vector bytes (after the load, and at its peak), beside
    the keys/s of rocksdict's own SST writer on the first BASELINE_ROWS rows (presorted)
    measured in the same run. ValueError before writing a size's files when its disk need
    is not free. `progress(text)`, when given, hears each step as it starts (a run cut off
    still shows where it was)."""
    say = progress or (lambda text: None)
    for num_keys in sizes:
        work = tempfile.mkdtemp(prefix="hps-bench-scale-", dir=path)
        try:
            need, free = disk_needed(num_keys, dim), shutil.disk_usage(work).free
            if need > free:
                raise ValueError(f"{num_keys:,} keys of width {dim} need about "
                                 f"{need / 2**30:.1f} GiB of disk under {work}, "
                                 f"{free / 2**30:.1f} GiB are free")
            say(f"{num_keys:,} keys: writing the files ({num_keys * (8 + 4 * dim) / 2**30:.2f}"
                f" GiB) …")
            started = time.perf_counter()
            load_files.write_table(os.path.join(work, "table"), num_keys, dim)
            written = time.perf_counter() - started
            say(f"{num_keys:,} keys: files written in {written:.1f} s; the baseline "
                f"(SstFileWriter, {min(num_keys, BASELINE_ROWS):,} rows) …")
            baseline = baseline_keys_per_s(num_keys, dim, os.path.join(work, "raw"))
            raw = num_keys * (8 + 4 * dim)
            results = []
            for i in range(rounds):
                say(f"{num_keys:,} keys: load {i + 1} of {rounds} …")
                config = load_config(os.path.join(work, "table"), dim,
                                     os.path.join(work, f"rocks-{i}"))
                results.append(_load_in_child(config, work, num_keys))
                shutil.rmtree(os.path.join(work, f"rocks-{i}"), ignore_errors=True)
            seconds = statistics.median(r["seconds"] for r in results)
            yield {
                "num_keys": num_keys, "dim": dim, "rounds": rounds,
                "keys_per_s": num_keys / seconds,
                "cpu_seconds": statistics.median(r["cpu_seconds"] for r in results),
                "seconds": seconds,
                "rss_growth_over_raw": statistics.median(
                    (r["rss_after"] - r["rss_before"]) / raw for r in results),
                "peak_rss_growth_over_raw": statistics.median(
                    (r["rss_peak"] - r["rss_before"]) / raw for r in results),
                "sst_writer_keys_per_s": baseline,
                "ratio": num_keys / seconds / baseline,
                "files_seconds": written,
            }
        finally:
            shutil.rmtree(work, ignore_errors=True)


SCALE_HEADER = (f"{'keys':>12} {'dim':>4} {'load keys/s':>12} {'CPU s':>7} {'RSS/raw':>8} "
                f"{'peak/raw':>8} {'SstFileWriter keys/s':>21} {'ratio':>6}")


def format_scale_row(r: dict[str, Any]) -> str:
    """One size of the scale curve as a line under SCALE_HEADER."""
    return (f"{r['num_keys']:>12,} {r['dim']:>4} {r['keys_per_s']:>12,.0f} "
            f"{r['cpu_seconds']:>7.2f} {r['rss_growth_over_raw']:>8.3f} "
            f"{r['peak_rss_growth_over_raw']:>8.3f} {r['sst_writer_keys_per_s']:>21,.0f} "
            f"{r['ratio']:>5.2f}×")


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) in (3, 4) and sys.argv[1] == "measure":
        print(json.dumps(measure_load(sys.argv[2], *map(int, sys.argv[3:]))))
    else:
        sys.exit("usage: python -m hps.tools.bench.load measure CONFIG [NUM_KEYS] (run by "
                 "_load_in_child)")
