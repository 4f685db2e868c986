"""HierarchicalParameterServer: the tiers, the loaded models, and the lookup entry points.

Lookup path (docs/architecture.md): keys → GPU cache (when there is one) → volatile tier →
persistent tier → the table's default value. The parts live beside this file:
`registry.py` (versioned loads and swaps), `host_lookup.py` (the tiers, top down),
`gpu_caches.py` (GPU caches), `updates.py` (online updates from Kafka or Redis
Streams), `key_sketch.py` (hot and missing keys), `prefetch.py` and `warm_up.py`
(warm-ups); the tiers themselves come from `open_tiers` (hps/tiers/open.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hps.config import ModelConfig, PSConfig, load_config
from hps.errors import ConfigError, DeviceError, StoreInUseError, UnknownModelError
from hps.gate.settings import requested_opt_ins
from hps.host_answers import refuse_host_path
from hps.intake.array_ref import HOST, ArrayRef
from hps.intake.keys import (
    device_pair,
    host_key_array,
    is_device_array,
    key_ref,
    output_array,
    output_ref,
    plain_host_keys,
    plain_host_output,
)
from hps.modelfiles.formats import DEFAULT_CHUNK_BYTES
from hps.rows.gpu_layout import OUT_FLOAT32
from hps.server.gpu_caches import GpuCaches
from hps.server.host_device import host_device, spread_line
from hps.server.host_lookup import HostLookup, TableFetch
from hps.server.hot_fill import HotRowsFiller
from hps.server.loader import LoadProgress
from hps.server.models import LoadedModel, LoadedTable
from hps.server.prefetch import Prefetcher, PrefetchJob
from hps.server.registry import ModelRegistry
from hps.server.store_in_use import read_only_ways
from hps.server.updates import ServerUpdates
from hps.server.warm_paths import warm_paths
from hps.server.warm_up import MOST_CACHED_KEYS, hot_set, warm_up
from hps.tiers import Tiers, open_tiers
from hps.tiers.contract import Tier

log = logging.getLogger("hps")


class HierarchicalParameterServer:
    """Holds the tiers and the loaded models, and serves lookups.

    Thread-safe: lookups may run from many threads, also while a model loads.
    """

    def __init__(
        self,
        config: PSConfig | dict[str, Any] | str,
        *,
        load: bool = True,
        progress: LoadProgress | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.config = load_config(config)
        self.chunk_bytes = chunk_bytes
        #: this process's index among `hps serve --workers N`'s workers (0: one process)
        #: and their number (None: one process): the device of its host-key lookups
        #: (hps/server/host_device.py); ReplicatedServer sets them before it loads
        self.worker, self.workers = 0, None
        try:
            self.tiers: Tiers = open_tiers(self.config, load_chunk_bytes=chunk_bytes)
        except StoreInUseError as exc:  # the config's path and models make the way out
            ways = read_only_ways(config, self.config)
            if not ways:
                raise
            raise StoreInUseError(f"{exc}. {ways}") from None
        self._host = HostLookup(
            self.tiers, cache_missed_embeddings=self.config.volatile_db.cache_missed_embeddings)
        self._gpu = GpuCaches(self.config, self._host)
        self._prefetch = Prefetcher(self.tiers, self._gpu)
        self._gpu.before_serving = self._before_serving
        self._registry = ModelRegistry(self.config, self.tiers, self._gpu,
                                       chunk_bytes=chunk_bytes)
        #: fills the hot copies of sharded tables from their sketches (hot_fill.py)
        self.hot_fill = HotRowsFiller(self._registry.acquire,
                                      lambda: list(self._registry.models))
        # online updates (update_source): the consumer follows each model once it serves
        self.updates: ServerUpdates | None = None
        if self.config.update_source.enabled:
            self.updates = ServerUpdates(self.config, self.tiers, self._registry, self._gpu)
        if load:
            try:
                for model in self.config.models:
                    self.load_model(model, progress=progress)
            except BaseException:
                self.close()  # a server that failed to start holds no files or sockets
                raise
        if self.updates is not None:
            self.updates.start()

    @property
    def volatile(self) -> Tier | None:
        """The volatile tier (hash map or Redis), None when disabled."""
        return self.tiers.volatile

    @property
    def gpu_enabled(self) -> bool:
        """Whether models are served through GPU caches (asked for, and CUDA present)."""
        return bool(self._gpu.enabled)

    @property
    def persistent(self) -> Tier | None:
        """The persistent tier (RocksDB), None when disabled."""
        return self.tiers.persistent

    # -- models ---------------------------------------------------------------------------

    @property
    def registry(self) -> ModelRegistry:
        """The versions served: `acquire(model)` holds one (`refs.release()` ends it),
        `retiring` counts replaced versions whose tables are not dropped yet."""
        return self._registry

    @property
    def models(self) -> dict[str, LoadedModel]:
        """Loaded models by name (a snapshot)."""
        return self._registry.models

    def model(self, name: str) -> LoadedModel:
        """The served version of model `name`; raises UnknownModelError if none."""
        return self._registry.model(name)

    def load_model(self, model: ModelConfig, progress: LoadProgress | None = None, *,
                   allow_empty: bool = False, allow_shrink: bool = False) -> LoadedModel:
        """Load (or reload) `model`; it becomes visible to lookups only when complete.

        A reload of a served model writes the new version beside the old one (staging
        storage names) and swaps it in with one assignment; a load that fails leaves the
        old version serving and removes what it wrote. The old version's tables are
        dropped when the last lookup reading them is done. `allow_empty`, `allow_shrink`:
        the load gate's settings of those names, set for this load alone (a table of no
        keys, a reload far smaller than the served version, is refused otherwise).
        """
        self._check_host_path(model)
        return self._registry.load(model, progress=progress,
                                   opt_ins=requested_opt_ins(allow_empty, allow_shrink))

    def add_model(self, model: ModelConfig, progress: LoadProgress | None = None, *,
                  allow_empty: bool = False) -> LoadedModel:
        """Load a model that is not served yet and add it to `config.models`.

        Raises ModelExistsError (a ConfigError) when a model of that name is served; a
        failed load serves and records nothing. Other models keep serving throughout.
        `allow_empty`: a table of no keys loads (see `load_model`).
        """
        self._check_host_path(model)
        loaded = self._registry.add(model, progress=progress,
                                    opt_ins=requested_opt_ins(allow_empty, False))
        self._set_models([*(m for m in self.config.models if m.model != model.model), model])
        return loaded

    def _check_host_path(self, model: ModelConfig) -> None:
        """ConfigError where `model` asks for http_lookup_path "host" over tiers that may
        answer otherwise than its GPU cache (hps/host_answers.py): a config file's models
        were checked as it was read; a block added at run time is checked here."""
        try:
            refuse_host_path(model, self.config.volatile_db, self.config.persistent_db)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _set_models(self, models: list[ModelConfig]) -> None:
        # a copy, not validated on purpose: a server may serve no model once the last is
        # removed (ps.json must name one); readers see the old config or the new one whole
        self.config = self.config.model_copy(update={"models": models})

    def reload_model(self, name: str, sparse_files: Sequence[str] | None = None,
                     progress: LoadProgress | None = None, *, allow_empty: bool = False,
                     allow_shrink: bool = False) -> LoadedModel:
        """Re-read a served model, optionally from new files (a new version);
        `allow_empty`, `allow_shrink` as for `load_model`."""
        return self._registry.reload(name, sparse_files, progress=progress,
                                     opt_ins=requested_opt_ins(allow_empty, allow_shrink))

    def unload_model(self, name: str) -> None:
        """Stop serving model `name` and take it out of `config.models`.

        Raises UnknownModelError when it is not served. Other models keep serving; its
        tables leave every tier, its GPU caches close and the freed memory goes back to
        the OS once no lookup reads it.
        """
        self._registry.unload(name)
        self._set_models([m for m in self.config.models if m.model != name])

    def wait_retired(self, timeout: float | None = None) -> bool:
        """Wait until the tables of every replaced version are dropped (their last
        lookups are done); False if `timeout` seconds passed first."""
        return self._registry.wait_retired(timeout)

    # -- lookups --------------------------------------------------------------------------

    def lookup(self, model: str, table: int | str, keys: Any, device_id: int | None = None
               ) -> np.ndarray:
        """Vectors of `keys` as a new float32 [n, dim] host array.

        With a GPU cache, the cache of the keys' device serves them (host keys: that of
        `device_id`, default the model's first deployed device; worker i of `hps serve
        --workers N`: deployed_device_list[i % len], hps/server/host_device.py).
        """
        loaded = self._registry.acquire(model)
        try:
            return self.lookup_version(loaded, table, keys, device_id)
        finally:
            loaded.refs.release()

    def lookup_version(self, loaded: LoadedModel, table: int | str, keys: Any,
                       device_id: int | None = None) -> np.ndarray:
        """`lookup` in the version `loaded`, which the caller holds (or warms up before it
        serves: hps/server/warm_paths.py)."""
        t = loaded.table(table)
        if not t.gpu and device_id is None and plain_host_keys(keys) and (
                0 < keys.size <= t.max_keys):
            out = np.empty((keys.size, t.dim), np.float32)
            self._host.fetch_into(t, keys, out)
            return out
        kref = t.checked_ref(keys)
        if kref.size == 0:
            return np.empty((0, t.dim), np.float32)
        device = _serving_device(loaded, kref, None, device_id, self.worker)
        gpu = t.gpu.get(device) if t.gpu else None
        if gpu is not None:
            out = gpu.host_output(kref.size)  # pinned: the rows come back in one copy
            _gpu_lookup(t, gpu, kref, output_ref(out, kref.size, t.dim))
            return out
        out = np.empty((kref.size, t.dim), np.float32)
        self._host.fetch_into(t, host_key_array(kref), out)
        return out

    def lookup_http(self, model: str, table: int | str, keys: np.ndarray,
                    out: np.ndarray | None = None) -> np.ndarray:
        """Vectors of host `keys` (a NumPy integer array) for a lookup whose keys arrive
        and rows leave on the host (HTTP, gRPC): through the path of the table for that
        many keys, the GPU cache of this process's device or the host tiers
        (`LoadedTable.http_path`, hps/server/http_path.py: counted, and now and then
        timed). Written into `out` (host float32 [n, dim]) where given, else into a new
        array; returns them."""
        loaded = self._registry.acquire(model)
        try:
            t = loaded.table(table)
            n = int(keys.size)
            route = t.http_path
            host, probe = route.pick(n) if route is not None and n else (not t.gpu, -1)
            if host and out is not None and not plain_host_output(out, n, t.dim):
                host = False  # an output the general path checks (and fills)
            started = time.perf_counter() if probe >= 0 else 0.0
            cpu_started = time.thread_time() if probe >= 0 else 0.0
            if not (host and n and t.gpu):  # the GPU path; or a table's only, the host's
                if out is None:
                    rows = self.lookup_version(loaded, t.index, keys)
                else:
                    self.lookup_version_into(loaded, t.index, keys, out)
                    rows = out
            else:
                # keys in the common host form skip the general path's reading, as a table
                # without a GPU cache does (a server answering every lookup from its host
                # tiers spent 1.5% of its event loop there: py-spy, one H200)
                kref = None if plain_host_keys(keys) and n <= t.max_keys else t.checked_ref(keys)
                host_keys = keys if kref is None else host_key_array(kref)
                rows = np.empty((n, t.dim), np.float32) if out is None else out
                self._host.fetch_into(t, host_keys, rows)
                sample = t.hot_sample  # the hot sketch sees these keys as a GPU lookup's
                if sample is not None and not next(sample.calls) & sample.mask:
                    sample.take(kref if kref is not None else t.checked_ref(host_keys), None)
            if probe >= 0 and route is not None:
                route.took(probe, host, time.perf_counter() - started,
                           time.thread_time() - cpu_started)
            return rows
        finally:
            loaded.refs.release()

    def http_device(self, loaded: LoadedModel) -> int:
        """The device whose cache answers this process's lookups of `loaded` with host
        keys and no device_id (hps/server/host_device.py)."""
        return host_device(loaded.config.deployed_device_list, self.worker)

    def host_fetch(self, table: LoadedTable) -> TableFetch:
        """The host path a GPU cache of `table` takes for its misses (the warm-up runs it)."""
        return self._host.for_table(table)

    def warm_writes(self, table: LoadedTable) -> None:
        """Compile the tiers' writes of `table`, writing nothing (the warm-up: the first
        online update after ready then compiles nothing; the persistent tier's with updates)."""
        updated = self.config.update_source.enabled
        for tier in (self.tiers.volatile, self.tiers.persistent if updated else None):
            if tier is not None and hasattr(tier, "warm_writes"):
                tier.warm_writes(table.storage_name)

    def lookup_into(self, model: str, table: int | str, keys: Any, out: Any,
                    device_id: int | None = None) -> int:
        """Write the vectors of `keys` into `out` in place; returns the number of keys.

        `keys` and `out` may be host or CUDA arrays of any producer (torch, CuPy, NumPy,
        DLPack capsules, `__dlpack__` objects; hps/intake/array_ref.py). CUDA arrays are served
        by the GPU cache of their device, from any thread, whatever its current device;
        `device_id` (default: the arrays' device, else this worker's of the deployed
        devices: host_device.py) picks the cache for host arrays. Raises an HPSError
        subclass, writing nothing, for bad input: DeviceError for keys and output on
        different devices, a device the model is not deployed on, or a `device_id` other
        than the arrays' device.
        """
        loaded = self._registry.acquire(model)
        try:
            return self.lookup_version_into(loaded, table, keys, out, device_id)
        finally:
            loaded.refs.release()

    def lookup_version_into(self, loaded: LoadedModel, table: int | str, keys: Any,
                            out: Any, device_id: int | None = None) -> int:
        """`lookup_into` in the version `loaded`, which the caller holds (or warms up
        before it serves: hps/server/warm_paths.py)."""
        t = loaded.table(table)
        if not t.gpu:
            if (device_id is None and plain_host_keys(keys) and 0 < keys.size <= t.max_keys
                    and plain_host_output(out, keys.size, t.dim)):
                self._host.fetch_into(t, keys, out)
                return int(keys.size)
        else:
            # the common case (int64 keys, a float32 output or the storage's own
            # 16-bit one, contiguous, one CUDA device) read in a few calls; anything
            # else, or out of bounds: the general path, which explains its refusals
            pair = device_pair(keys, out)
            if pair is not None:
                keys_ptr, n, out_ptr, out_size, device, stream, out_type = pair
                gpu = t.gpu.get(device)
                if (gpu is not None and (device_id is None or device_id == device)
                        and 0 < n <= t.max_keys and out_size >= n * t.dim
                        and (out_type == OUT_FLOAT32
                             or out_type == t.narrow_output_type)):
                    gpu.lookup_contiguous(keys_ptr, n, out_ptr, stream, out_type)
                    # the hot sketch's sample of the keys, queued after the lookup
                    sample = t.hot_sample
                    if sample is not None and not next(sample.calls) & sample.mask:
                        sample.device_keys(keys_ptr, n, device, stream)
                    return n
        kref = t.checked_ref(keys)
        n = kref.size
        oref = output_ref(out, n, t.dim, t.storage)
        device = kref.device
        if (device_id is not None or device < 0 or device != oref.device
                or device not in loaded.config.deployed_device_list):
            device = _serving_device(loaded, kref, oref, device_id, self.worker)
        if n == 0:
            return 0
        gpu = t.gpu.get(device) if t.gpu else None
        if gpu is not None:
            _gpu_lookup(t, gpu, kref, oref)
            return n
        host_keys = host_key_array(kref)
        target = output_array(oref, n, t.dim)
        if is_device_array(target):
            target.set(self._host.fetch(t, host_keys, target.dtype))
        elif target.flags.c_contiguous:
            self._host.fetch_into(t, host_keys, target)
        else:
            np.copyto(target, self._host.fetch(t, host_keys, target.dtype))
        return n

    # -- hot keys and warm-ups --------------------------------------------------------------

    def _before_serving(self, loaded: LoadedModel, progress: LoadProgress) -> None:
        """A version about to serve: its hot-key sampling set, each table's lookup path
        run once (hps/server/warm_paths.py: WarmUpError fails the load; a step of the
        load's `progress`), then warmed from
        its `warm_from` for at most `warm_timeout` seconds (hps/server/warm_up.py)."""
        for table in loaded.tables:
            table.sample_hot_keys(loaded.config.hot_key_sampling)
        warm_paths(self, loaded, progress)  # and each table's path for HTTP (http_path.py)
        if any(t.gpu for t in loaded.tables):
            log.info(spread_line(loaded.config.model, loaded.config.deployed_device_list,
                                 self.worker, self.workers))
        # the hot copies filled in the background, a reload's first from the served
        # version's sketch (hot_fill.py)
        self.hot_fill.watch(loaded, self._registry.models.get(loaded.config.model))
        try:
            warm_up(loaded, self._prefetch)
        except Exception:  # a warm-up is a bonus: the version serves cold rather than not
            log.exception("warm-up of model %r failed", loaded.config.model)

    def top_keys(self, model: str, table: int | str, kind: str = "hot", top: int = 100
                 ) -> dict[str, Any]:
        """The `top` heaviest keys of a table's `kind` sketch ("hot": looked up, sampled;
        "missing": found in no tier): `keys` int64[m] and `counts` int64[m] (estimates,
        heaviest first), `error` (each count's bound: the true count lies in [count -
        error, count]), `total` (the weight counted), `source` and `sampling` (what the
        sketch sees). Raises UnknownModelError, UnknownTableError, ConfigError (kind)."""
        if kind not in ("hot", "missing"):
            raise ConfigError(f"kind must be 'hot' or 'missing', got {kind!r}")
        loaded = self._registry.acquire(model)
        try:
            t = loaded.table(table)
            seen = t.keys_seen
            answer = seen.sketch(kind).top(top)
            answer.update(model=model, table=t.name, kind=kind, sampling=seen.sampling(kind),
                          source=seen.source if kind == "hot" else "lookups")
            return answer
        finally:
            loaded.refs.release()

    def hot_set(self, model: str, table: int | str, top: int = 1 << 20,
                cached: int = MOST_CACHED_KEYS) -> np.ndarray:
        """What a replica warms from (`GET .../hot-set`, `warm_from`): the table's `top`
        hot keys, heaviest first, then up to `cached` keys its GPU caches hold, most
        recently used first (hps/server/warm_up.py). Raises UnknownModelError,
        UnknownTableError."""
        loaded = self._registry.acquire(model)
        try:
            return hot_set(loaded.table(table), top, cached)
        finally:
            loaded.refs.release()

    def fill_hot_rows(self, model: str, table: int | str | None = None) -> dict[str, Any]:
        """Fill the hot copies of one table of `model` (None: every table that keeps some)
        now, from its hot-key sketch, as the background filler does at its interval
        (hps/server/hot_fill.py): {"model", "tables": [{"table", "keys", "held"}]}.
        Raises UnknownModelError, UnknownTableError, or NoHotCopiesError where no table
        asked for keeps copies here (a server without GPUs keeps none)."""
        return self.hot_fill.fill(model, table)

    def replicate_hot_rows(self, model: str, table: int | str, keys: Any = None
                           ) -> dict[str, Any]:
        """Fills each device's hot copy of a sharded static table (hps/gpu/hot_rows.py)
        with the rows of `keys` (any integer array or list, heaviest first; None: the
        table's hot-key sketch's heaviest) held by its peers' shards. Returns the keys
        offered and what each device's copy holds. Raises UnknownModelError,
        UnknownTableError, KeyTypeError, or NoHotCopiesError where the table has no hot
        copies."""
        loaded = self._registry.acquire(model)
        try:
            t = loaded.table(table)
            if keys is None:
                sketch = t.keys_seen.sketch("hot")
                keys = sketch.top(sketch.capacity)["keys"]
            host_keys = host_key_array(key_ref(keys))
            held = GpuCaches.replicate_hot(t, host_keys)
            return {"model": model, "table": t.name, "keys": int(host_keys.size),
                    "held": {str(device): n for device, n in held.items()}}
        finally:
            loaded.refs.release()

    def prefetch(self, model: str, table: int | str, keys: Any, job_id: str | None = None
                 ) -> PrefetchJob:
        """Warm the volatile tier (from the persistent one) and the GPU caches of a table
        with the rows of `keys` (any integer array or list), in the background; returns
        the job (`status`, counts, `wait(timeout)`). Keys no tier holds are counted and
        skipped. Raises UnknownModelError, UnknownTableError or KeyTypeError at once.
        `job_id`: this process's part of a job another process announced."""
        loaded = self._registry.acquire(model)
        try:
            t = loaded.table(table)
            host_keys = host_key_array(key_ref(keys))
        except BaseException:
            loaded.refs.release()
            raise
        return self._prefetch.submit(loaded, t, host_keys, release=loaded.refs.release,
                                     job_id=job_id)

    def prefetch_job(self, job_id: str) -> PrefetchJob | None:
        """A prefetch job by id (None when unknown or long forgotten)."""
        return self._prefetch.job(job_id)

    def prefetch_status(self, job_id: str) -> dict[str, Any] | None:
        """A prefetch job's status and counts as the routes answer them (None when
        unknown or long forgotten)."""
        job = self._prefetch.job(job_id)
        return None if job is None else job.as_dict()

    # -- maintenance ----------------------------------------------------------------------

    def refresh(self, model: str | None = None) -> int:
        """Re-read the GPU-cached vectors of one or all models from the databases."""
        names = [model] if model else sorted(self.models)
        held = [self._registry.acquire(name) for name in names]
        try:
            return self._gpu.refresh(held)
        finally:
            for loaded in held:
                loaded.refs.release()

    def degraded(self) -> dict[str, dict[str, Any]]:
        """The tiers that do not serve as configured now, by tier name: down
        (`available` False), or missing tables a load could not write to them
        (`tables_pending`, filled in the background). Empty when all is well."""
        filler = self._registry.filler
        pending = sorted(t.storage_name for t in filler.pending()) if filler else []
        out: dict[str, dict[str, Any]] = {}
        for tier in self.tiers:
            available = bool(tier.stats()["available"])
            tables = pending if tier is self.tiers.volatile else []
            if not available or tables:
                out[tier.name] = {"available": available, "tables_pending": tables}
        return out

    def describe(self) -> list[dict[str, Any]]:
        """Models, tables, widths, sources, tier sizes and counters (for CLI and HTTP)."""
        out = []
        for name in sorted(self.models):
            try:
                loaded = self._registry.acquire(name)
            except UnknownModelError:
                continue  # unloaded meanwhile
            try:
                out.append(self._describe(name, loaded))
            finally:
                loaded.refs.release()
        return out

    def _describe(self, name: str, loaded: LoadedModel) -> dict[str, Any]:
        tables = []
        for t in loaded.tables:
            info: dict[str, Any] = {
                "index": t.index, "name": t.name, "storage_name": t.storage_name,
                "dim": t.dim, "default_value": t.default_value, "max_keys": t.max_keys,
                "source": t.source.as_dict(), "stats": t.stats.as_dict(), "tiers": {},
                "volatile_ready": t.volatile_ready,
                "storage_dtype": t.storage.name,
            }
            for tier, keys in self.tiers.sizes(t.storage_name).items():
                info["tiers"][tier] = ({"keys": keys} if keys is not None
                                       else {"keys": None, "error": "unavailable"})
            volatile = self.tiers.volatile
            if volatile is not None and volatile.in_process and t.volatile_ready:
                # what the rows take in this process (compact storage: 0.5×, ~0.25× + 8 B)
                info["tiers"][volatile.name]["memory_bytes"] = volatile.memory_bytes(
                    t.storage_name)
            if t.gpu:
                info["gpu"] = {str(d): g.stats() for d, g in t.gpu.items()}
            if t.http_path is not None:  # which path answers its HTTP lookups, and why
                info["http_lookup"] = t.http_path.as_dict()
            tables.append(info)
        return {"model": name, "tables": tables}

    def update_status(self) -> dict[str, Any] | None:
        """The online updates' state ("running", "down", ...), rate, and per-table
        counters and lag; None when `update_source.type` is "null"."""
        return self.updates.status() if self.updates is not None else None

    def close(self) -> None:
        """Stop the update consumer and background work, and close every tier."""
        if self.updates is not None:
            self.updates.close()
        self.hot_fill.close()
        self._prefetch.close()
        self._registry.close()
        self.tiers.close()

    def __enter__(self) -> HierarchicalParameterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _gpu_lookup(t: LoadedTable, gpu: Any, kref: ArrayRef, oref: ArrayRef) -> None:
    """A lookup of `kref` through the GPU cache `gpu` of `t` into `oref`, its keys
    sampled for the hot sketch."""
    gpu.lookup(kref, oref)
    sample = t.hot_sample
    if sample is not None and not next(sample.calls) & sample.mask:
        sample.take(kref, kref.stream if kref.stream is not None else oref.stream)


def _serving_device(loaded: LoadedModel, keys: ArrayRef, out: ArrayRef | None,
                    device_id: int | None, worker: int = 0) -> int:
    """The device whose cache serves a lookup: that of the CUDA arrays (keys and output
    must agree), else `device_id`, else this worker's of the model's deployed devices
    (host_device.py: the first in one process). Raises DeviceError naming both sides where
    they disagree or the device is not deployed."""
    device = keys.device
    if out is not None and out.device != HOST:
        if device != HOST and device != out.device:
            raise DeviceError(f"keys are on {keys.where()} but the output is on "
                              f"{out.where()}: both must be on one device")
        device = out.device
    deployed = loaded.config.deployed_device_list
    if device == HOST:
        device = host_device(deployed, worker) if device_id is None else int(device_id)
        what = f"device_id {device}"
    else:
        if device_id is not None and int(device_id) != device:
            raise DeviceError(f"the arrays are on cuda:{device} but device_id {device_id} "
                              "was asked for")
        what = f"the arrays' device cuda:{device}"
    if device not in deployed:
        raise DeviceError(f"{what} is not in deployed_device_list {deployed} of model "
                          f"{loaded.config.model!r}")
    return device
