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
  sent in one copy, scattered into the caller's output by one kernel, and inserted: a
  shard on the caller's device by its own staged insert on the caller's stream, a shard
  on another device by the same insert on a stream of that device, from a copy of the
  staging sent there. The caller's stream does not wait for another device's insert (its
  rows are scattered already); that shard orders the insert against its own queries, as
  any write. No host wait beyond the query's miss count (and, before the staging is
  written again, the previous call's copies to other devices, long done by then); the
  rows an online update overtook are dropped again, as one table drops them
  (hps/gpu/update_log.py).

Shards that hold the whole table (gpucacheper 1: an open-addressing table filled by its
misses) take the staged rows while they have room, as one such table does; static shards
hold every key they serve, so their misses (unknown keys) are only fetched and scattered.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.gpu import host_loops, kernels
from hps.gpu.sharded_query import enable_peer_access
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
        for other in {s.device_id for s in shards} - {device_id}:
            # access both ways between the devices (the one pass enabled this device's to
            # the others'); the inserts elsewhere read their own copy of the staging
            enable_peer_access(cupy, other, device_id)
        self._scatter_fn = kernels.function("rows.cu", "scatter_rows", device_id, DIM=self.dim)
        self._tls = threading.local()

    @staticmethod
    def applies(shards: list[GpuEmbeddingTable]) -> bool:
        """Whether the shards are of one kind (dynamic caches of one set count, whole-table
        caches, or static tables)."""
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
        state.wait_for_peers(self._rt)  # their copies of the staging are done
        keys, codes, inverse, rows = staging.prepare(m, self.dim)
        marks = [shard._updates.mark() for shard in shards]  # before the fetch
        u = host_loops.stage_sharded(missed, len(shards), self._num_sets, keys, inverse,
                                     codes, state.starts)
        self._fetch_into(keys[:u], rows[:u])
        staging.send(u, stream)
        counts["sync_fetches"] += u
        d_keys, d_codes, d_inverse, d_rows = staging.device_ptrs()
        self._scatter(state, ws.positions_ptr, d_inverse, m, d_rows, out_ptr, stream)
        starts = state.starts.tolist()
        row_bytes = self.dim * 4
        for s, shard in enumerate(shards):
            a, b = starts[s], starts[s + 1]
            if a == b:
                continue
            if shard._cache is None and (
                    shard._whole is None or shard._whole_inserted + b - a > shard.capacity):
                continue  # static, or a whole-table cache that is full: nothing to insert
            at = (d_keys + a * 8, d_rows + a * row_bytes, d_codes + a * 8, b - a)
            if shard.device_id == self.device_id:
                _insert(shard, at, stream)
            else:
                self._insert_there(state, shard, at, u)
            stale = shard._updates.raced(marks[s], keys[a:b])
            if stale.size:
                with shard._device:
                    if shard._cache is not None:  # an update overtook them: not kept
                        shard._cache.remove(stale)
                    else:  # a whole-table cache keeps them: made current
                        shard._whole.update(  # type: ignore[union-attr]
                            stale, shard._fetch(stale))
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

    def _insert_there(self, state: _ThreadState, shard: GpuEmbeddingTable,
                      at: tuple[int, int, int, int], u: int) -> None:
        """A shard on another device inserts the staged rows on a stream of its device,
        from a copy of the staging sent there (once a call per device)."""
        rt, there = self._rt, shard.device_id
        staging = state.staging
        rt.setDevice(there)
        try:
            peer = state.peer(self._cp, there, staging.nbytes)
            if not peer.pending:
                staging.send_to(peer.buffer_ptr, u, peer.stream_ptr)
            moved = peer.buffer_ptr - staging.device_ptr  # the same layout there
            keys, rows, codes, count = at
            _insert(shard, (keys + moved, rows + moved, codes + moved, count),
                    peer.stream_ptr)
            rt.eventRecord(peer.done_ptr, peer.stream_ptr)
            peer.pending = True
        finally:
            rt.setDevice(self.device_id)

    def _state(self) -> _ThreadState:
        state: _ThreadState | None = getattr(self._tls, "state", None)
        if state is None:
            state = self._tls.state = _ThreadState(self._cp, self._scatter_fn,
                                                   len(self.shards))
        return state


def _insert(shard: GpuEmbeddingTable, at: tuple[int, int, int, int], stream: int) -> None:
    """Staged keys, rows and set codes (device addresses, count) into the shard, on
    `stream` of its device (current)."""
    keys, rows, codes, count = at
    if shard._cache is not None:
        shard._cache.insert_staged(keys, rows, codes, count, shard._state().ws, stream)
    elif shard._whole is not None:
        shard._whole_inserted += count
        shard._whole.insert_staged(keys, rows, count, shard._state().ws, stream)


class _Peer:
    """One thread's stream on another device, its copy of the staging there, and the
    event its copy and inserts end with (pending until the thread's next staging)."""

    def __init__(self, cupy: Any, device: int) -> None:
        self._cp = cupy
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.done = cupy.cuda.Event(block=False, disable_timing=True)
        self.stream_ptr = int(self.stream.ptr)
        self.done_ptr = int(self.done.ptr)
        self.buffer: Any = None
        self.buffer_ptr = 0
        self.pending = False

    def fit(self, nbytes: int) -> None:
        """A staging copy of at least `nbytes` (the device current)."""
        if self.buffer is None or self.buffer.nbytes < nbytes:
            self.buffer = self._cp.empty(nbytes, np.uint8)
            self.buffer_ptr = int(self.buffer.data.ptr)


class _ThreadState:
    """One thread's staging (made on the caller's device), scatter launch, group starts,
    and its peers on the other shards' devices."""

    def __init__(self, cupy: Any, scatter_fn: Any, num_shards: int) -> None:
        self.staging = MissStaging(cupy)
        self.scatter = kernels.Launch(scatter_fn, "ptr ptr i64 ptr ptr i32")
        self.starts = np.zeros(num_shards + 1, np.int64)
        self._peers: dict[int, _Peer] = {}

    def peer(self, cupy: Any, device: int, nbytes: int) -> _Peer:
        """The thread's peer on `device` (current), its staging copy of `nbytes` or more."""
        peer = self._peers.get(device)
        if peer is None:
            peer = self._peers[device] = _Peer(cupy, device)
        peer.fit(nbytes)
        return peer

    def wait_for_peers(self, rt: Any) -> None:
        """Waits until the copies of the last staging to other devices (and their inserts)
        are done: the staging is about to be written again."""
        for peer in self._peers.values():
            if peer.pending:
                rt.eventSynchronize(peer.done_ptr)
                peer.pending = False
