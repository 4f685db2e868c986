"""Each table's lookup path run once before its version serves, so ready means fast.

numba compiles each signature of the lookup path's compiled functions at its first call
(hps/runtime/compile_on_use.py: seconds on a machine with an empty cache, milliseconds
read from numba's cache), the GPU kernels load at their first launch and a lookup's
buffers are made at the first call of their size. Before a version is swapped in (its
first load, a reload, a model added at run time) `warm_paths(server, loaded)` makes the
lookups a client's would: through the server's own entry points (`lookup_version`,
`lookup_version_into`), for every key dtype the routes accept (int64, int32, uint32,
uint64: hps/http/schemas.py `KEY_DTYPES`, the KServe v2 tensors alike), one key and a
batch past `compiled.HOLD_GIL_BYTES` (the fetch loops' two twins); on GPU tables the miss
path's host side (its tier fetches, past `table.HOST_MISSES` too, and its staging) and
lookups of keys the caches hold, host keys of each dtype and the device-array calls
in-process callers make (`_warm_gpu` says why no key a cache lacks is sent to it).

The lookups run on a copy of each table with counters and key sketches of its own (fed
on every lookup, so their compiled feeds run too): the served version's `/metrics`, hot
keys and missing keys show clients' lookups only. Rows found only in the persistent tier
may be cached in the volatile tier (`cache_missed_embeddings`), as a client's lookup of
them would; a GPU cache holds what it held, its counters forget the lookups and the
thread's buffers go back to the spares (`GpuEmbeddingTable.warming_up`).

Each table's path for lookups with host keys (HTTP, gRPC: `LoadedTable.http_path`) is
decided here too, the GPU path and the host path each timed where both may answer
(`measure_http`, hps/server/http_path.py), and said in the log, a line a table.

The volatile tier's writes of each table are compiled too, without writing
(`warm_writes`): a load compiles the twin of the hash map's insert its batches take, and
the first online update after ready (a few rows: the other twin) compiled the rest under
the table's write lock, every lookup of the table waiting for it. With online updates,
so are RocksDB's bulk writes (a big round's path), which a restart over its store never ran.

A lookup that fails here fails the load (`WarmUpError`): the version is not served, and
the server says why (`/readyz` lists the model as failed, `GET /v1/models` the reason).

Where it runs seconds (compiles on a machine with an empty numba cache, GPU kernels
loading, a loaded machine), it is a step of the load's progress of its own
(`LoadProgress.start_step`): "warming the lookup paths of model M", counted in lookups
run of all it makes (`lookups(table)` each table, host and GPU tables alike).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Protocol

import numpy as np

from hps.errors import HPSError
from hps.runtime.compiled import HOLD_GIL_BYTES, compile_declared
from hps.runtime.raw_memory import wait_while, wait_while_held
from hps.server.gpu_caches import GpuCaches
from hps.server.host_lookup import TableFetch
from hps.server.http_path import (
    SIZES,
    HttpPath,
    chosen,
    median_seconds,
    timed_keys,
    unmeasured,
    without_measuring,
)
from hps.server.key_sketch import TableKeys
from hps.server.loader import LoadProgress
from hps.server.models import LoadedModel, LoadedTable, TableStats

log = logging.getLogger("hps")

#: the key dtypes a lookup route accepts (hps/http/schemas.py KEY_DTYPES; the server's
#: layer cannot import the HTTP one)
KEY_DTYPES = (np.dtype("<i8"), np.dtype("<i4"), np.dtype("<u4"), np.dtype("<u8"))
#: misses past which a GPU table takes its large miss path (hps/gpu/table.py HOST_MISSES)
GPU_HOST_MISSES = 1 << 16
#: keys of the warm-up's lookups with device arrays
DEVICE_KEYS = 64
#: the first warm key of 64-bit dtypes and of 32-bit ones: far from the small numbers
#: models commonly use, so the keys mostly miss and walk every tier down to the default
_FIRST_WIDE = 1 << 61
_FIRST_NARROW = 1 << 30


class VersionLookups(Protocol):
    """The server's lookup entry points on a version it holds (HierarchicalParameterServer)."""

    def lookup_version(self, loaded: LoadedModel, table: int | str, keys: Any,
                       device_id: int | None = None) -> np.ndarray: ...

    def lookup_version_into(self, loaded: LoadedModel, table: int | str, keys: Any,
                            out: Any, device_id: int | None = None) -> int: ...

    def host_fetch(self, table: LoadedTable) -> TableFetch: ...

    def warm_writes(self, table: LoadedTable) -> None: ...

    def http_device(self, loaded: LoadedModel) -> int: ...

    @property
    def config(self) -> Any: ...  # the PSConfig: its tiers' blocks


class WarmUpError(HPSError):
    """A table's first lookup, run before its version serves, failed: the load fails."""

    kind = "warm_up"


def warm_paths(server: VersionLookups, loaded: LoadedModel,
               progress: LoadProgress | None = None) -> float:
    """Run every table's lookup path of `loaded` once (see the module docstring), each
    lookup counted as a step of `progress`; returns the seconds it took. Raises
    WarmUpError naming the table and what failed."""
    started = time.perf_counter()
    progress = progress or LoadProgress()
    copy = _warm_copy(loaded)
    progress.start_step(f"warming the lookup paths of model {loaded.config.model}",
                        sum(lookups(t, loaded) for t in copy.tables), "lookups run")
    try:
        for table in copy.tables:
            try:
                with contextlib.ExitStack() as gpu_tables:
                    for gpu in table.gpu.values():  # its caches see only keys they hold
                        gpu_tables.enter_context(gpu.warming_up())
                    _warm_table(server, copy, table, progress)
                    server.warm_writes(table)
                    route = measure_http(server, copy, table)
            except Exception as exc:
                raise WarmUpError(
                    f"model {loaded.config.model!r}, table {table.name!r}: its first lookup "
                    f"failed ({type(exc).__name__}: {exc})") from exc
            loaded.tables[table.index].http_path = route
            (log.info if table.gpu else log.debug)(route.line())
    finally:
        seconds = time.perf_counter() - started
        progress.finish_step(seconds)
    log.debug("model %r: lookup paths warmed in %.2fs", loaded.config.model, seconds)
    return seconds


def _warm_copy(loaded: LoadedModel) -> LoadedModel:
    """`loaded` with tables of their own counters and sketches, fed on every lookup."""
    tables = []
    for table in loaded.tables:
        twin = dataclasses.replace(table, stats=TableStats(), keys_seen=TableKeys())
        twin.sample_hot_keys(1)  # 1: every lookup feeds the hot sketch (or its sampler)
        tables.append(twin)
    return LoadedModel(loaded.config, tables, roots=loaded.roots)


def _wide(table: LoadedTable) -> int:
    """Keys of a batch whose rows pass HOLD_GIL_BYTES (the fetch loops' other twin)."""
    return min(table.max_keys, HOLD_GIL_BYTES // (table.dim * 4) + 1)


def _many(table: LoadedTable) -> int:
    """Keys of a batch that misses past GPU_HOST_MISSES, 0 when the table takes fewer."""
    return GPU_HOST_MISSES + 1 if table.max_keys > GPU_HOST_MISSES else 0


def _host_sizes(table: LoadedTable) -> list[int]:
    """Batch sizes of a host table's warm lookups."""
    return sorted({1, _wide(table)})


def _gpu_sizes(table: LoadedTable) -> list[int]:
    """Batch sizes of a GPU table's host-side warm fetches."""
    return sorted({1, _wide(table), _many(table)} - {0})


def _device_lookups(dtype: np.dtype[Any]) -> int:
    """The warm lookups of a GPU table on one device with keys of `dtype` (see _warm_gpu:
    host keys twice, device keys for the shortcut and the general path)."""
    return 3 if dtype.itemsize == 8 or dtype.kind == "i" else 2


def lookups(table: LoadedTable, loaded: LoadedModel) -> int:
    """The lookups (fetches, stagings) the warm-up of `table` runs, its progress's
    total: every call counted whatever runs it (host or GPU), a GPU dtype whose keys no
    cache holds counted as done when it is skipped."""
    if not table.gpu:
        return len(_host_sizes(table)) * len(KEY_DTYPES) * 2
    per_device = sum(_device_lookups(dtype) for dtype in KEY_DTYPES)
    return (len(_gpu_sizes(table)) * 2 + 1
            + len(loaded.config.deployed_device_list) * per_device)


def _warm_table(server: VersionLookups, loaded: LoadedModel,
                table: LoadedTable, progress: LoadProgress) -> None:
    """The lookups of one table (see the module docstring), each a step of `progress`."""
    if table.gpu:
        _warm_gpu(server, loaded, table, progress)
        return
    for size in _host_sizes(table):
        for dtype in KEY_DTYPES:
            keys = warm_keys(size, dtype)
            server.lookup_version(loaded, table.index, keys)
            progress.step(1)
            out = np.empty((size, table.dim), np.float32)
            server.lookup_version_into(loaded, table.index, keys, out)
            progress.step(1)


def _warm_gpu(server: VersionLookups, loaded: LoadedModel,
              table: LoadedTable, progress: LoadProgress) -> None:
    """A GPU table's paths. Its caches see only keys they hold: a key they lack would be
    inserted, evicting a row the load put there (a set-associative cache: the warm-up's
    fill and every shard's contents would change). So the miss path is run from the host
    side, the part that compiles: the tier fetches the misses take (both twins, and the
    sketch feeds on the warm copy), the staging of misses (hps/gpu/host_loops.py) and the
    locked query path's spins (compiled, not run); its
    GPU part (insert and scatter kernels of a module the queries already loaded) waits for
    the first miss. The GPU lookups (host keys of each dtype, and device keys and outputs
    on every deployed device) ask for held keys; a cache that holds none (init_ec false)
    is first queried by a client's lookup."""
    fetch = server.host_fetch(table)
    for size in _gpu_sizes(table):
        keys = warm_keys(size, KEY_DTYPES[0])
        fetch(keys)
        progress.step(1)
        fetch.into(keys, np.empty((size, table.dim), np.float32))
        progress.step(1)
    _warm_staging()
    # the spins of the query path a pending write sends lookups down: the warm-up's own
    # queries may all take the fast path (hps/gpu/fast_query.py), and the first client
    # lookup after a miss's insert compiled them after ready (57 ms each, H200 machine)
    compile_declared(wait_while, wait_while_held)
    progress.step(1)
    import cupy

    for device in loaded.config.deployed_device_list:
        held = np.unique(GpuCaches.held_keys(table, min(DEVICE_KEYS, table.max_keys), device))
        for dtype in KEY_DTYPES:
            keys = held[(held >= 0) & (held <= np.iinfo(dtype).max)].astype(dtype)
            if not keys.size:  # none it holds fits the dtype: no lookup that would insert
                progress.step(_device_lookups(dtype))
                continue
            server.lookup_version(loaded, table.index, keys, device_id=device)  # HTTP's
            progress.step(1)
            out = np.empty((keys.size, table.dim), np.float32)
            server.lookup_version_into(loaded, table.index, keys, out, device_id=device)
            progress.step(1)
            if _device_lookups(dtype) == 3:  # the shortcut, the general path
                with cupy.cuda.Device(device):
                    d_out = cupy.empty((keys.size, table.dim), cupy.float32)
                    server.lookup_version_into(loaded, table.index, cupy.asarray(keys),
                                               d_out)
                    cupy.cuda.get_current_stream().synchronize()
                progress.step(1)


def measure_http(server: VersionLookups, loaded: LoadedModel, table: LoadedTable
                 ) -> HttpPath:
    """The path of `table`'s lookups with host keys (hps/server/http_path.py): fixed where
    nothing is to measure, else both paths timed at each of SIZES (up to the table's
    limit) on keys the cache of this process's device holds (every key a hit: a key it
    lacks would be inserted, see _warm_gpu), the GPU path as HTTP takes it
    (`lookup_version`), the host path as the tiers answer it (`host_fetch`)."""
    device = server.http_device(loaded)
    cfg = server.config
    label = f"model {loaded.config.model!r} table {table.name!r}"
    fixed = without_measuring(loaded.config, cfg.volatile_db, cfg.persistent_db,
                              bool(table.gpu), device, label)
    if fixed is not None:
        return fixed
    sizes = sorted({min(n, table.max_keys) for n in SIZES})
    held = np.unique(GpuCaches.held_keys(table, sizes[-1], device))
    if not held.size:
        return unmeasured(device, label)
    fetch = server.host_fetch(table)
    gpu_s, host_s = [], []
    for n in sizes:
        keys = timed_keys(held, n)
        out = np.empty((n, table.dim), np.float32)
        gpu_s.append(median_seconds(
            lambda k=keys: server.lookup_version(loaded, table.index, k, device_id=device)))
        host_s.append(median_seconds(lambda k=keys, o=out: fetch.into(k, o)))
    return chosen(sizes, gpu_s, host_s, device, label)


def _warm_staging() -> None:
    """The GPU miss path's host staging (hps/gpu/host_loops.py), both twins of each, on
    a few scratch keys (a CPU call: nothing reaches a device)."""
    from hps.gpu import host_loops

    for n in (1, 4096):  # both sides of HOLD_GIL_BYTES (32 bytes a miss)
        missed = np.arange(n, dtype=np.int64)
        unique, inverse = np.empty(n, np.int64), np.empty(n, np.int32)
        codes, starts = np.empty(n, np.uint64), np.zeros(3, np.int64)
        host_loops.stage(missed, 1, unique, inverse, codes)
        host_loops.stage_sharded(missed, 2, 1, unique, inverse, codes, starts)


def warm_keys(n: int, dtype: np.dtype[Any], offset: int = 0) -> np.ndarray:
    """`n` distinct keys of `dtype` for the warm-up's lookups (see _FIRST_WIDE), from
    the `offset`-th on."""
    first = _FIRST_WIDE if dtype.itemsize == 8 else _FIRST_NARROW
    return (np.arange(n, dtype=np.int64) + first + offset).astype(dtype)

