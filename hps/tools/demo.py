"""`hps demo`: a synthetic model in HugeCTR's format, loaded and checked end to end.

Writes two tables (widths 16 and 64, about one million keys in all) as sparse model
folders plus the matching ps.json, loads them into the embedded default tiers
(in-process hash map over RocksDB), runs lookups, checks every returned vector against
the files, and reports keys loaded, load time, lookup rate and memory.

The load time is the load's alone: numba compiles each function at its first use
(hps/runtime/compile_on_use.py), so `warm_up` first runs the same demo on a small model in
a temporary folder, which compiles what the load and the lookups run (or, after the first
run on a machine, reads it from numba's cache), timed apart.

The demo rewrites its folder's model files, ps.json and RocksDB: `check_not_served`
refuses, before a byte is written, while a running `hps serve` holds that RocksDB.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hps.api import HPS
from hps.errors import TierSetupError
from hps.modelfiles.formats.sparse_folder import SparseModelReader, write_sparse_model
from hps.runtime.compile_on_use import CompileEvent, compile_events
from hps.server.loader import LoadProgress
from hps.tiers.rocksdb.store import writer_of

MODEL = "demo"
TABLES = (("user_item", 600_000, 16), ("item_category", 400_000, 64))
BATCH = 16_384
#: batches of BATCH keys each table is looked up and checked in
CHECK_BATCHES = 8
#: keys of a chunk read back to check the lookups (16 MiB of the wider table's rows)
READ_BACK_KEYS = 1 << 16
#: keys every demo table holds, first in its files: the README's examples use them
EXAMPLE_KEYS = (17, 42, -3)
#: the demo's RocksDB, in its folder (ps.json's persistent_db.path)
ROCKSDB_FOLDER = "rocksdb"
#: the warm-up model's size relative to the demo's: 5,000 keys take every step of the
#: demo's load and lookups (the same functions for the same types) in a fraction of a second
WARM_UP_SCALE = 0.005


def write_model(folder: Path, seed: int = 7, scale: float = 1.0,
                progress: LoadProgress | None = None) -> Path:
    """Write the demo's sparse model folders and ps.json under `folder`; returns ps.json.
    Each table written is a step of `progress` counted in keys (seconds at --scale 5)."""
    rng = np.random.default_rng(seed)
    files, dims = [], []
    sizes = [max(len(EXAMPLE_KEYS), int(count * scale)) for _, count, _ in TABLES]
    progress = progress or LoadProgress()
    started = time.perf_counter()
    progress.start_step("writing the demo model", sum(sizes), "keys written")
    for (name, _, dim), n in zip(TABLES, sizes, strict=True):
        # sparse, signed 64-bit keys, as hashed categorical features are
        keys = rng.choice(np.int64(2**62), size=n, replace=False) - np.int64(2**61)
        keys = np.concatenate([EXAMPLE_KEYS, np.setdiff1d(keys, EXAMPLE_KEYS,
                                                          assume_unique=True)])[:n]
        rng.shuffle(keys[len(EXAMPLE_KEYS):])
        vectors = rng.standard_normal((n, dim), dtype=np.float32)
        write_sparse_model(folder / name, keys, vectors)
        progress.step(n)
        files.append(name)
        dims.append(dim)
    progress.finish_step(time.perf_counter() - started)
    config = ps_config(files, dims)
    path = folder / "ps.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def ps_config(files: list[str], dims: list[int]) -> dict[str, Any]:
    """The demo's ps.json: HugeCTR keys, embedded tiers, GPU cache when CUDA is there."""
    try:
        from hps.gpu.table import cuda_available

        gpu = cuda_available()
    except ImportError:
        gpu = False
    return {
        "supportlonglong": True,
        "models": [{
            "model": MODEL,
            "sparse_files": files,
            "embedding_table_names": [name for name, _, _ in TABLES],
            "embedding_vecsize_per_table": dims,
            "maxnum_catfeature_query_per_table_per_sample": [16, 16],
            "default_value_for_each_table": [0.0, 0.0],
            "deployed_device_list": [0],
            "max_batch_size": BATCH // 16,
            "gpucache": gpu,
            "gpucacheper": 0.5,
            "cache_refresh_percentage_per_iteration": 0.2,
        }],
        "volatile_db": {"type": "hash_map", "num_partitions": 16},
        "persistent_db": {"type": "rocks_db", "path": ROCKSDB_FOLDER},
    }


def check_not_served(folder: Path) -> None:
    """TierSetupError, before anything is written, while the demo's RocksDB in `folder` is
    open for writing (a running `hps serve` of the demo): the demo would rewrite the model
    files and ps.json that server serves, and then fail on that lock."""
    writer = writer_of(str(folder / ROCKSDB_FOLDER))
    if writer is None:
        return
    if writer == os.getpid():
        who = "this process (an HPS of that config not closed yet)"
    else:
        who = ("another process" if writer < 0 else f"process {writer}") + \
            " (a running `hps serve`?)"
    raise TierSetupError(
        f"hps demo would rewrite {folder}, but {who} has its RocksDB open for writing: "
        "nothing was written. Stop that server first, or write the demo elsewhere with "
        f"--folder; meanwhile `hps lookup {folder / 'ps.json'} -m {MODEL} -- "
        f"{' '.join(map(str, EXAMPLE_KEYS))}` reads what it serves")


@dataclass(frozen=True)
class WarmUp:
    """What `warm_up` did: functions compiled, functions read from numba's cache, seconds."""

    compiled: int
    cached: int
    seconds: float


def warm_up(listener: Callable[[CompileEvent], None] | None = None) -> WarmUp:
    """Run the demo on a small model in a temporary folder, so that what the demo's load
    and lookups run is compiled (the first time on a machine: seconds) or read from
    numba's cache (milliseconds) before they are timed. `listener` hears each compile."""
    counts = {True: 0, False: 0}

    def hear(event: CompileEvent) -> None:
        if event.seconds is not None:
            counts[event.from_cache] += 1
        if listener is not None:
            listener(event)

    started = time.perf_counter()
    with compile_events(hear), tempfile.TemporaryDirectory(prefix="hps-demo-") as tmp:
        _run(Path(tmp), None, WARM_UP_SCALE, seed=7, compile_seconds=0.0)
    return WarmUp(counts[False], counts[True], time.perf_counter() - started)


@dataclass
class DemoReport:
    #: the warm-up before the load (`warm_up`: compiling, the first time); not in
    #: load_seconds
    compile_seconds: float
    keys_loaded: int
    load_seconds: float
    lookup_keys_per_s: float
    keys_checked: int
    mismatches: int
    unknown_keys_defaulted: bool
    rss_bytes: int
    volatile_bytes: int
    persistent_disk_bytes: int

    def rows(self) -> list[tuple[str, str]]:
        mib = 1 << 20
        return [
            ("keys loaded", f"{self.keys_loaded:,}"),
            ("load time", f"{self.load_seconds:.2f} s "
                          f"({self.keys_loaded / self.load_seconds:,.0f} keys/s)"),
            ("lookup rate", f"{self.lookup_keys_per_s:,.0f} keys/s (batches of {BATCH:,})"),
            ("vectors checked against files", f"{self.keys_checked:,}, "
                                              f"{self.mismatches} mismatches"),
            ("unknown keys get the default", "yes" if self.unknown_keys_defaulted else "NO"),
            ("process memory (RSS)", f"{self.rss_bytes / mib:,.0f} MiB"),
            ("in-process tier", f"{self.volatile_bytes / mib:,.0f} MiB"),
            ("RocksDB on disk", f"{self.persistent_disk_bytes / mib:,.0f} MiB"),
        ]

    @property
    def ok(self) -> bool:
        return self.mismatches == 0 and self.unknown_keys_defaulted


def _read_back(reader: SparseModelReader, progress: LoadProgress
               ) -> tuple[np.ndarray, np.ndarray]:
    """Every key and vector of `reader`'s files, chunk by chunk, each chunk a step of
    `progress`."""
    keys = np.empty(reader.num_keys, np.int64)
    vectors = np.empty((reader.num_keys, reader.vec_size), np.float32)
    at = 0
    for chunk_keys, chunk_vectors in reader.chunks(chunk_keys=READ_BACK_KEYS):
        keys[at:at + chunk_keys.size] = chunk_keys
        vectors[at:at + chunk_keys.size] = chunk_vectors
        at += chunk_keys.size
        progress.step(int(chunk_keys.size))
    return keys, vectors


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_demo(folder: Path, progress: LoadProgress | None = None, scale: float = 1.0,
             seed: int = 7, warmed: WarmUp | None = None) -> DemoReport:
    """Refuse while served (`check_not_served`), warm up (unless `warmed` says it was
    done), then write, load, look up, check. `scale` shrinks the model (tests use small
    ones)."""
    check_not_served(folder)
    if warmed is None:
        warmed = warm_up()
    return _run(folder, progress, scale, seed, warmed.seconds)


def _run(folder: Path, progress: LoadProgress | None, scale: float, seed: int,
         compile_seconds: float) -> DemoReport:
    """Write, load, look up, check (no warm-up, no check of the folder)."""
    import psutil

    folder.mkdir(parents=True, exist_ok=True)
    config_path = write_model(folder, seed=seed, scale=scale, progress=progress)
    started = time.perf_counter()
    hps = HPS(str(config_path), progress=progress)
    load_seconds = time.perf_counter() - started
    try:
        rng = np.random.default_rng(seed + 1)
        keys_loaded = checked = mismatches = 0
        lookup_seconds = 0.0
        looked_up = 0
        defaulted = True
        # the files read back to check the lookups against: seconds at --scale 5
        checks = progress or LoadProgress()
        checks_started = time.perf_counter()
        readers = [SparseModelReader(str(folder / name)) for name, _, _ in TABLES]
        checks.start_step("reading the model files back to check the lookups",
                          sum(r.num_keys for r in readers), "keys read")
        for index, reader in enumerate(readers):
            keys_loaded += reader.num_keys
            file_keys, file_vectors = _read_back(reader, checks)
            for _ in range(CHECK_BATCHES):
                rows = rng.integers(0, reader.num_keys, size=min(BATCH, reader.num_keys))
                t0 = time.perf_counter()
                got = hps.lookup(file_keys[rows], MODEL, index)
                lookup_seconds += time.perf_counter() - t0
                looked_up += rows.size
                checked += rows.size
                mismatches += int(np.count_nonzero(~np.all(got == file_vectors[rows], axis=1)))
            unknown = np.setdiff1d(np.arange(-50, 50, dtype=np.int64), file_keys)
            defaulted &= bool(np.all(hps.lookup(unknown, MODEL, index) == 0.0))
        checks.finish_step(time.perf_counter() - checks_started)
        server = hps.server
        volatile_bytes = sum(
            server.volatile.memory_bytes(t.storage_name)
            for t in server.model(MODEL).tables) if server.volatile else 0
        return DemoReport(
            compile_seconds=compile_seconds,
            keys_loaded=keys_loaded,
            load_seconds=load_seconds,
            lookup_keys_per_s=looked_up / lookup_seconds,
            keys_checked=checked,
            mismatches=mismatches,
            unknown_keys_defaulted=defaulted,
            rss_bytes=psutil.Process(os.getpid()).memory_info().rss,
            volatile_bytes=volatile_bytes,
            persistent_disk_bytes=_disk_bytes(folder / "rocksdb"),
        )
    finally:
        hps.close()
