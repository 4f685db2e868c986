"""The misses of a sharded table's one-pass query (hps/gpu/sharded_query.py), served the way
one GPU serves its own (hps/gpu/table.py `_serve_misses`).

Why. The one pass leaves the missed keys in pinned host memory and their positions on the
caller's device. The copy path (hps/gpu/sharded.py) then sent the missed keys back to the
device, partitioned them, waited on the host for the run sizes, and had every shard query
them again, wait for its own miss count, fetch, insert and return rows by peer copies: a
2,000-key power-law batch with a few misses ran at 0.12x one GPU on two H100s. Here the
missed keys are fetched once, for every shard together, as one table fetches them:

- above the model's `hit_rate_threshold` (HugeCTR's semantics) the batch keeps the default
  rows the query wrote, and each shard's background worker fetches and inserts its keys;
- below it, the distinct keys are grouped by shard with each group's set codes (compiled,
  hps/gpu/host_loops.py `stage_sharded`), fetched through the host path the shards share,
  sent in one copy and inserted into every shard by one launch on the caller's device and
  stream (cuda/embedding_cache.cu cache_insert_sharded): a shard on another device is
  written over the link (peer access, as the query reads it), and the same launch
  scatters the batch's fetched rows into the caller's output. So the call's next query
  on that stream is ordered after the inserts as on one GPU, with no copy of the staging
  to another device, no stream there and no event between devices (inserting on the
  owner's device from a copy sent there, the next call's query waited on that device's
  event, and on the host before the staging was written again: 2 H200s, a quarter
  cached, 0.60-0.70x one GPU; a staged insert a shard, 0.75x: two launches and two
  inserts' Python). The rows an online update overtook are dropped again, as one table
  drops them (hps/gpu/update_log.py).

Shards that hold the whole table (gpucacheper 1: an open-addressing table filled by its
misses) take the staged rows while they have room, each by its own staged insert, as one
such table does; static shards hold every key they serve, so their misses (unknown keys)
are only fetched and scattered.
"""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.gpu import host_loops, kernels
from hps.gpu.launch_shape import BLOCK
from hps.gpu.sharded_query import MAX_SHARDS, peer_atomics
from hps.gpu.staging import MissStaging
from hps.gpu.workspace import QueryWorkspace

if TYPE_CHECKING:
    from hps.gpu.dynamic_cache import EmbeddingCache
    from hps.gpu.table import GpuEmbeddingTable


class ShardedMisses:
    """The miss path of the one pass from device `device_id` over `shards`, whose array
    (cuda/hps_common.cuh hps_shard, on `device_id`: the one pass's) is at `shards_ptr`.
    Thread-safe: each thread stages in buffers of its own."""

    def __init__(self, cupy: Any, device_id: int, shards: list[GpuEmbeddingTable],
                 shards_ptr: int) -> None:
        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self.device_id = device_id
        self.shards = shards
        first = shards[0]
        self.dim = first.dim
        self._threshold = first._threshold
        # misses inserted in the background above the threshold: the dynamic kinds' rule
        self._dynamic = first._cache is not None or first._whole is not None
        self._num_sets = int(first._cache.num_sets) if first._cache is not None else 1
        self._fetch_into = first._fetch_into  # the host path every shard shares
        self._scatter_fn = kernels.function("rows.cu", "scatter_rows", device_id, DIM=self.dim)
        caches = [s._cache for s in shards]
        self._insert_all = (_InsertAll(cupy, device_id, caches,  # type: ignore[arg-type]
                                       shards_ptr)
                            if all(c is not None for c in caches) else None)
        self._tls = threading.local()

    @staticmethod
    def applies(device_id: int, shards: list[GpuEmbeddingTable]) -> bool:
        """Whether the shards are of one kind (dynamic caches of one set count, whole-table
        caches, or static tables) and `device_id` inserts into each with atomics (peer
        access, which the one pass enabled, over NVLink)."""
        if not all(peer_atomics(device_id, s.device_id) for s in shards):
            return False
        caches = [s._cache for s in shards]
        if all(c is not None for c in caches):
            return len({c.num_sets for c in caches if c is not None}) == 1
        return all(s._cache is None and (s._whole is None) == (shards[0]._whole is None)
                   for s in shards)

    def serve(self, ws: QueryWorkspace, m: int, n: int, out_ptr: int, stream: int,
              counts: dict[str, int]) -> None:
        """The m misses of the n-key query just made on `stream` (this device current),
        whose missed keys and positions `ws` holds, into the float32 output at out_ptr."""
        missed = ws.host_keys[:m]
        shards = self.shards
        if self._dynamic and not self._threshold.synchronous(m, n):
            # the query's default rows stand; each shard fetches and inserts its keys later
            starts, keys = self._grouped(missed)
            for s, shard in enumerate(shards):
                if starts[s + 1] > starts[s]:
                    shard._submit(keys[starts[s]:starts[s + 1]].copy())
            return
        state = self._state()
        staging = state.staging
        keys, codes, inverse, rows = staging.prepare(m, self.dim)
        marks = [shard._updates.mark() for shard in shards]  # before the fetch
        u = host_loops.stage_sharded(missed, len(shards), self._num_sets, keys, inverse,
                                     codes, state.starts)
        self._fetch_into(keys[:u], rows[:u])
        staging.send(u, stream)
        counts["sync_fetches"] += u
        d_keys, d_codes, d_inverse, d_rows = staging.device_ptrs()
        starts = state.starts.tolist()
        if self._insert_all is not None:  # dynamic caches: one launch inserts and scatters
            self._insert_all.launch(state, u, d_keys, d_rows, d_codes,
                                    (ws.positions_ptr, d_inverse, m, out_ptr), stream)
            for s, shard in enumerate(shards):
                if starts[s + 1] > starts[s]:
                    shard._drop_raced(marks[s], keys[starts[s]:starts[s + 1]])
        else:  # whole-table caches insert while they have room; static tables hold theirs
            self._scatter(state, ws.positions_ptr, d_inverse, m, d_rows, out_ptr, stream)
            row_bytes = self.dim * 4
            for s, shard in enumerate(shards):
                a, b = starts[s], starts[s + 1]
                if a == b or shard._whole is None or (
                        shard._whole_inserted + b - a > shard.capacity):
                    continue
                shard._whole_inserted += b - a
                shard._whole.insert_staged(d_keys + a * 8, d_rows + a * row_bytes, b - a,
                                           state.inserts[s], stream)
                shard._drop_raced(marks[s], keys[a:b])
        staging.done(stream)
        ws.released_by(staging.done_ptr)

    def _grouped(self, missed: np.ndarray) -> tuple[list[int], np.ndarray]:
        """The distinct missed keys grouped by shard, and where each group starts."""
        state = self._state()
        unique = np.empty(missed.size, np.int64)
        inverse = np.empty(missed.size, np.int32)
        codes = np.empty(missed.size, np.uint64)
        host_loops.stage_sharded(missed, len(self.shards), self._num_sets, unique, inverse,
                                 codes, state.starts)
        return state.starts.tolist(), unique

    def _scatter(self, state: _ThreadState, positions: int, inverse: int, m: int,
                 rows: int, out_ptr: int, stream: int) -> None:
        """out[positions[j]] = rows[inverse[j]] for the m misses."""
        vec4 = self.dim % 4 == 0 and out_ptr % 16 == 0
        width = self.dim // 4 if vec4 else self.dim
        state.scatter(kernels.grid(self.device_id, m * width), 256, stream,
                      positions, inverse, m, rows, out_ptr, vec4)

    def _state(self) -> _ThreadState:
        state: _ThreadState | None = getattr(self._tls, "state", None)
        if state is None:
            state = self._tls.state = _ThreadState(
                self._cp, self.device_id, self._scatter_fn,
                len(self.shards) if self.shards[0]._whole is not None else 0)
        return state


class _ThreadState:
    """One thread's staging (made on the caller's device), scatter launch and group
    starts (MAX_SHARDS + 1 of them: cache_insert_sharded takes them by value), the
    parameters of its one-launch insert, or a workspace of the caller's device for each
    whole-table shard's staged insert (`staged_inserts` of them: an insert's launch is
    bound to its shard and to the device it runs on)."""

    def __init__(self, cupy: Any, device_id: int, scatter_fn: Any, staged_inserts: int
                 ) -> None:
        self.staging = MissStaging(cupy)
        self.scatter = kernels.Launch(scatter_fn, "ptr ptr i64 ptr ptr i32")
        self.starts = np.zeros(MAX_SHARDS + 1, np.int64)
        self.inserts = [QueryWorkspace(cupy, device_id) for _ in range(staged_inserts)]
        self.insert_all: _InsertParams | None = None


class _InsertAll:
    """The inserts of a batch's misses into shards that are all dynamic caches, in one
    launch from the caller's device (cuda/embedding_cache.cu cache_insert_sharded), which
    also scatters the fetched rows into the lookup's output. Its write order is each
    shard's (EmbeddingCache.hold_for_insert), every shard held in shard order (as the one
    pass takes them), those without misses too: the launch's event becomes each one's
    last write, so each must be ordered before it."""

    def __init__(self, cupy: Any, device_id: int, caches: list[EmbeddingCache],
                 shards_ptr: int) -> None:
        self._cp = cupy
        self.device_id = device_id
        self.caches = caches
        self._shards_ptr = shards_ptr  # the one pass's array of the shards, on device_id
        self._fn = 0
        self._generation = -1  # the first shard's, whose defines the kernel is built with
        lib = kernels.driver()  # present wherever CuPy runs kernels
        self._launch, self._record = lib.cuLaunchKernel, lib.cuEventRecord
        # launch and record in one compiled call that keeps the GIL, as one table's insert
        # (kernels.Launch.go_recorded): ctypes' two calls each let the GIL go (4 H200s, a
        # quarter cached: the ctypes launch took 7-14 us of a 117 us call)
        self._held = kernels.held_launcher()

    def launch(self, state: _ThreadState, u: int, keys: int, rows: int, codes: int,
               scatter: tuple[int, int, int, int], stream: int) -> None:
        """Inserts the u staged misses (device addresses; state.starts groups them) into
        their shards and scatters (positions, inverse, count, out) on `stream`."""
        first = self.caches[0]
        if self._generation != first._generation:
            self._fn = int(first._kernel("cache_insert_sharded", device=self.device_id)
                           .kernel.ptr)
            self._generation = first._generation
        params = state.insert_all
        if params is None:
            params = state.insert_all = _InsertParams(self._cp, self.device_id, state.starts,
                                                      self._shards_ptr, len(self.caches))
        positions, inverse, count, out_ptr = scatter
        src_vec4 = first._dim4 and rows % 16 == 0
        vec4 = src_vec4 and out_ptr % 16 == 0
        insert_blocks = kernels.grid(self.device_id, u * first._group, BLOCK)
        blocks = insert_blocks + kernels.grid(
            self.device_id, count * (first.dim // 4 if vec4 else first.dim), BLOCK)
        c = params.cells
        c[4].value, c[5].value, c[6].value, c[7].value = codes, keys, rows, src_vec4
        c[8].value, c[9].value, c[10].value, c[11].value = insert_blocks, positions, inverse, count
        c[12].value, c[13].value = out_ptr, vec4
        held: list[EmbeddingCache] = []
        done = None
        try:
            for s, cache in enumerate(self.caches):
                params.ticks[s] = cache.hold_for_insert(stream, 0, self.device_id)
                held.append(cache)
            if self._held is not None:
                status = self._held(self._fn, blocks, BLOCK, stream, params.address,
                                    params.done_ptr)
            else:
                status = self._launch(self._fn, blocks, 1, 1, BLOCK, 1, 1, 0, stream,
                                      params.address, 0)
                if status == 0:
                    status = self._record(params.done_ptr, stream)
            if status:
                self._cp.cuda.driver.check_status(status)
            done = params.done
        finally:
            for cache in held:
                cache.release_after_insert(done)


class _InsertParams:
    """One thread's parameter block of cache_insert_sharded: the shards' array and count,
    the ticks and group starts by value (arrays the block points at), the staged batch,
    the scatter's arguments; and the event its launches record."""

    def __init__(self, cupy: Any, device_id: int, starts: np.ndarray, shards_ptr: int,
                 num_shards: int) -> None:
        u64, i64, i32, u32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint32
        self.ticks = np.zeros(MAX_SHARDS, np.uint64)
        self._starts = starts  # kept alive: the block points at it
        self.cells: list[Any] = [u64(shards_ptr), i64(num_shards), None, None, u64(), u64(),
                                 u64(), i32(), u32(), u64(), u64(), i64(), u64(), i32()]
        by_value = {2: int(self.ticks.ctypes.data), 3: int(starts.ctypes.data)}
        addresses = [by_value[i] if c is None else ctypes.addressof(c)
                     for i, c in enumerate(self.cells)]
        self._pointers = (ctypes.c_void_p * len(addresses))(*addresses)
        self.address = ctypes.addressof(self._pointers)
        with cupy.cuda.Device(device_id):
            self.done = cupy.cuda.Event(block=False, disable_timing=True)
        self.done_ptr = int(self.done.ptr)
