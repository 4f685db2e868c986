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
  sent in one copy and inserted into each shard by its staged insert, every one on the
  caller's device and stream: a shard on another device is written over the link (peer
  access, as the query reads it). The first insert also scatters the batch's fetched
  rows into the caller's output (cuda/embedding_cache.cu cache_insert_scatter). So the
  call's next query on that stream is ordered after the inserts as on one GPU, with no
  copy of the staging to another device, no stream there and no event between devices
  (inserting on the owner's device from a copy sent there, the next call's query waited
  on that device's event, and on the host before the staging was written again: 2
  H200s, a quarter cached, 0.60-0.70x one GPU). The rows an online update overtook are
  dropped again, as one table drops them (hps/gpu/update_log.py).

Shards that hold the whole table (gpucacheper 1: an open-addressing table filled by its
misses) take the staged rows while they have room, as one such table does; static shards
hold every key they serve, so their misses (unknown keys) are only fetched and scattered.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.gpu import host_loops, kernels
from hps.gpu.sharded_query import peer_atomics
from hps.gpu.staging import MissStaging
from hps.gpu.workspace import QueryWorkspace

if TYPE_CHECKING:
    from hps.gpu.table import GpuEmbeddingTable


class ShardedMisses:
    """The miss path of the one pass from device `device_id` over `shards`. Thread-safe:
    each thread stages in buffers of its own."""

    def __init__(self, cupy: Any, device_id: int, shards: list[GpuEmbeddingTable]) -> None:
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
        # the rows into the caller's output: by the insert of the first group (its rows
        # start the staging, which `inverse` indexes), else by a scatter of their own
        scatter: tuple[int, int, int, int] | None = (ws.positions_ptr, d_inverse, m, out_ptr)
        starts = state.starts.tolist()
        row_bytes = self.dim * 4
        for s, shard in enumerate(shards):
            a, b = starts[s], starts[s + 1]
            if a == b:
                continue
            at = (d_keys + a * 8, d_rows + a * row_bytes, d_codes + a * 8, b - a)
            if shard._cache is not None:
                shard._cache.insert_staged(*at, state.inserts[s], stream,
                                           scatter=scatter if a == 0 else None)
                if a == 0:
                    scatter = None
            elif shard._whole is not None and shard._whole_inserted + b - a <= shard.capacity:
                shard._whole_inserted += b - a
                shard._whole.insert_staged(at[0], at[1], b - a, state.inserts[s], stream)
            else:
                continue  # static, or a whole-table cache that is full: nothing to insert
            shard._drop_raced(marks[s], keys[a:b])
        if scatter is not None:
            self._scatter(state, ws.positions_ptr, d_inverse, m, d_rows, out_ptr, stream)
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
            state = self._tls.state = _ThreadState(self._cp, self.device_id,
                                                   self._scatter_fn, len(self.shards))
        return state


class _ThreadState:
    """One thread's staging (made on the caller's device), scatter launch and group
    starts, and a workspace of the caller's device for each shard's inserts (an insert's
    launch is bound to its shard and to the device it runs on)."""

    def __init__(self, cupy: Any, device_id: int, scatter_fn: Any, num_shards: int) -> None:
        self.staging = MissStaging(cupy)
        self.scatter = kernels.Launch(scatter_fn, "ptr ptr i64 ptr ptr i32")
        self.starts = np.zeros(num_shards + 1, np.int64)
        self.inserts = [QueryWorkspace(cupy, device_id) for _ in range(num_shards)]
