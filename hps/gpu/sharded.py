"""One table's GPU cache split row-wise into shards by key hash (`gpu_sharding: row_wise`).

A replicated table (the default, HugeCTR's design) keeps a whole cache on every deployed
device, so no table can be cached beyond one device's memory. Sharded, the table's keys
are divided among `gpu_shards` caches (default: one per deployed device), shard s on
device `deployed_device_list[s % devices]`, so the devices together cache up to
N × one device's rows. Each shard is an ordinary GpuEmbeddingTable (hps/gpu/table.py) of
its share of the keys, so its queries, misses, inserts and refresh are the ones tested
for every table. Shard of key = (low 32 bits of murmur3_fmix64(key)) × shards >> 32
(hps/gpu/shard_routing.py).

The caches' sets take the high 32 bits of the same hash (hps/gpu/dynamic_cache.py
`set_of`), so a shard's keys still spread over all of its sets.

A lookup with keys on device k (`ShardedTable.view(k)`, what the server keeps per
device), on the caller's stream: one kernel appends each key and its position to its
shard's run, each shard looks up its run into a rows buffer (a shard on another device
gets its run by a peer copy and sends its rows back, ordered with events both ways), and
one scatter puts every row at its position in the caller's output. The run sizes are the
one extra host wait. Misses go to the host tiers from the shard that owns the key, so
each missed key is fetched once. Where the one pass serves (hps/gpu/sharded_query.py),
its misses are fetched once for all shards and inserted into each
(hps/gpu/sharded_misses.py). Inserts, updates and the refresh are split on the host by
the same hash (NumPy); the warm-up on each device (`ShardedTable.warm_up`).

With one device and `gpu_shards` > 1 every shard lives on that device: the routing, the
per-shard misses and updates run (and are tested against the NumPy model) on a machine
with one GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from hps.errors import NoHotCopiesError
from hps.gpu import kernels
from hps.gpu.device_arrays import lookup_refs
from hps.gpu.fast_query import FALLBACK
from hps.gpu.host_memory import pinned_empty
from hps.gpu.hot_rows import HOT_ROWS, HotCopies
from hps.gpu.shard_routing import shard_keys, split_by_shard
from hps.gpu.sharded_misses import ShardedMisses
from hps.gpu.sharded_query import OnePassQuery, enable_peer_access, peers_reachable
from hps.gpu.staging import device_view, external_stream
from hps.intake.keys import is_wide
from hps.rows.gpu_layout import OUT_FLOAT32, OUTPUT_CUPY_DTYPE

if TYPE_CHECKING:
    from hps.config import ModelConfig
    from hps.gpu.table import GpuEmbeddingTable

#: rows a device takes of a warm-up chunk at once (each device is sent every chunk: a
#: whole-table chunk, `cache_refresh_percentage_per_iteration` 0, of a table sharded for
#: its size would not fit one device)
WARM_PART_BYTES = 256 << 20
#: the counters of the one pass (its misses: those hps/gpu/sharded_misses.py served)
_ONE_PASS_COUNTS = ("lookups", "keys", "hits", "misses", "sync_fetches")

# shard_of on the device (hps_shard_of of cuda/hps_common.cuh), each key's shard alone (the
# warm-up's), and one pass over the batch: each key's shard, and the key and its position
# appended to its shard's run (order within a run is the atomics' order: a run is a set of
# keys). The lanes of a warp that share a shard take their slots with one atomic (a
# 1M-key batch on 2 shards spent ~1 ms in per-key atomics on two counters).
_KERNELS = r"""
__device__ unsigned long long shard_of_key(long long key, unsigned long long num_shards) {
  unsigned long long k = (unsigned long long)key;
  k ^= k >> 33; k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return ((k & 0xffffffffULL) * num_shards) >> 32;
}

extern "C" __global__ void shard_of_keys(const long long* keys, long long n,
                                         unsigned long long num_shards, signed char* shards) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) shards[i] = (signed char)shard_of_key(keys[i], num_shards);
}

extern "C" __global__ void partition_by_shard(
    const long long* keys, long long n, unsigned long long num_shards,
    unsigned int* counts, long long* runs, long long* positions) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  bool live = i < n;
  unsigned long long s = ~0ULL;
  long long key = 0;
  if (live) {
    key = keys[i];
    s = shard_of_key(key, num_shards);
  }
  unsigned int active = __ballot_sync(0xffffffffu, live);
  if (!live) return;
  unsigned int group = __match_any_sync(active, s);
  unsigned int lane = threadIdx.x & 31u;
  unsigned int leader = __ffs(group) - 1;
  unsigned int base = 0;
  if (lane == leader) base = atomicAdd(&counts[s], (unsigned int)__popc(group));
  base = __shfl_sync(group, base, leader);
  unsigned long long j = base + __popc(group & ((1u << lane) - 1u));
  runs[s * n + j] = key;
  positions[s * n + j] = i;
}

// Row r of the packed rows (the shards' runs one after another) to its position in the
// caller's output; rows move as `words` 32-bit or 16-bit words.
template <typename W>
__device__ void scatter(const W* rows, const long long* positions, const unsigned int* counts,
                        long long n, int num_shards, long long words, W* out) {
  long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long r = t / words;
  if (r >= n) return;
  long long w = t - r * words;
  long long start = 0;
  int s = 0;
  for (; s < num_shards; ++s) {
    long long c = counts[s];
    if (r < start + c) break;
    start += c;
  }
  long long pos = positions[(long long)s * n + (r - start)];
  out[pos * words + w] = rows[r * words + w];
}

extern "C" __global__ void scatter_words32(const unsigned int* rows, const long long* positions,
    const unsigned int* counts, long long n, int num_shards, long long words,
    unsigned int* out) {
  scatter(rows, positions, counts, n, num_shards, words, out);
}

extern "C" __global__ void scatter_words16(const unsigned short* rows,
    const long long* positions, const unsigned int* counts, long long n, int num_shards,
    long long words, unsigned short* out) {
  scatter(rows, positions, counts, n, num_shards, words, out);
}
"""


@functools.lru_cache(maxsize=None)
def _kernels_on(device: int) -> tuple[Any, ...]:
    """(shard_of_keys, partition_by_shard, scatter_words32, scatter_words16) of _KERNELS,
    compiled once and loaded on `device`."""
    cp = kernels.cupy_module()
    with cp.cuda.Device(device):
        module = cp.RawModule(code=_KERNELS, options=("--std=c++17",))
        return tuple(module.get_function(name) for name in (
            "shard_of_keys", "partition_by_shard", "scatter_words32", "scatter_words16"))


class ShardedTable:
    """The shards of one table, and what writes go through (routed by key hash)."""

    def __init__(self, model: ModelConfig, table_id: int, num_keys: int,
                 fetch_host: Callable[[np.ndarray], np.ndarray],
                 fetch_into: Callable[[np.ndarray, np.ndarray], None] | None = None,
                 table_type: type[GpuEmbeddingTable] | None = None) -> None:
        if table_type is None:
            from hps.gpu.table import GpuEmbeddingTable as table_type
        devices = list(model.deployed_device_list)
        self.num_shards = int(model.gpu_shards or len(devices))
        self.devices = devices
        self.shards: list[GpuEmbeddingTable] = []
        try:
            for s in range(self.num_shards):
                self.shards.append(table_type(
                    model, table_id, shard_keys(num_keys, self.num_shards),
                    devices[s % len(devices)], fetch_host=fetch_host, fetch_into=fetch_into))
        except BaseException:
            self.close()
            raise
        first = self.shards[0]
        self.dim = first.dim
        self.storage = first.storage
        self.mode = first.mode
        self.capacity = sum(int(s.capacity) for s in self.shards)
        # each device's copy of its peers' hottest rows (hps/gpu/hot_rows.py)
        self.hot = HotCopies(self.shards, HOT_ROWS if model.gpu_hot_rows is None
                             else int(model.gpu_hot_rows))
        self._views = {d: ShardedView(self, d) for d in devices}
        self._shards_on = {d: [s for s, shard in enumerate(self.shards) if shard.device_id == d]
                           for d in devices}

    def view(self, device: int) -> ShardedView:
        """What serves lookups whose keys and output are on `device`."""
        return self._views[device]

    def warm_up(self, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
        """Each chunk's rows go to their shards' warm-ups, in file order, until each shard
        holds what it promises (hps/gpu/fill.py). Each chunk crosses from the host once, in
        parts of at most WARM_PART_BYTES of rows, to the first device, and from there to
        the others over the link; one thread a device, while this one reads and sends the
        next part, picks its shards' keys out of the part (in file order) and inserts
        them, set codes sorted on the device.

        Why. The host splitting each chunk and gathering each shard's rows, then sorting
        its set codes, was the warm-up's time (2 H200s, 4M rows of 64: 0.84x a table
        replicated on both); with that on the devices, every device taking each part from
        the host was (0.92-1.04x: two pageable copies of the file at once, each as slow
        as one replicated table's, which copies it once a device in turn)."""
        cp = kernels.cupy_module()
        submitted = [0] * self.num_shards  # each shard's keys so far (its device's thread's)
        devices = sorted({shard.device_id for shard in self.shards})
        first = devices[0]
        pending: dict[int, Any] = {}  # each device's part in flight
        inserted = 0
        with ThreadPoolExecutor(len(devices), thread_name_prefix="hps-warm-up") as pool:
            for keys, vectors in chunks:
                keys = np.ascontiguousarray(keys, np.int64)
                step = max(1, WARM_PART_BYTES // max(1, vectors.nbytes // max(1, keys.size)))
                for start in range(0, keys.shape[0], step):
                    with cp.cuda.Device(first):
                        part = (cp.asarray(keys[start:start + step]),
                                cp.asarray(vectors[start:start + step]))
                        sent = cp.cuda.Event(block=False, disable_timing=True)
                        sent.record()
                    for device in devices:
                        if device in pending:  # a device takes the parts in file order
                            inserted += pending.pop(device).result()
                        pending[device] = pool.submit(self._warm_device, device, part, sent,
                                                      submitted)
            inserted += sum(f.result() for f in pending.values())
        return inserted

    def _warm_device(self, device: int, part: tuple[Any, Any], sent: Any,
                     submitted: list[int]) -> int:
        """A part's keys of `device`'s shards into them (see warm_up): the part's keys and
        rows on the first device, there once `sent` completes; the keys inserted."""
        cp = kernels.cupy_module()
        shard_of_keys = _kernels_on(device)[0]
        inserted = 0
        with cp.cuda.Device(device):
            stream = cp.cuda.get_current_stream()
            stream.wait_event(sent)
            part_keys, part_rows = part
            if part_keys.device.id != device:  # a peer copy of the first device's
                part_keys, part_rows = _copied(cp, part_keys, stream), _copied(cp, part_rows,
                                                                              stream)
            n = int(part_keys.size)
            owner = cp.empty(n, np.int8)
            shard_of_keys((-(-n // 256),), (256,),
                          (part_keys, np.int64(n), np.uint64(self.num_shards), owner))
            for s in self._shards_on[device]:
                shard = self.shards[s]
                where = cp.flatnonzero(owner == s)
                if shard.mode == "dynamic":
                    where = where[:max(0, int(shard.capacity) - submitted[s])]
                if where.size:
                    submitted[s] += int(where.size)
                    inserted += int(shard.warm_up([(part_keys[where], part_rows[where])]))
            stream.synchronize()  # the first device's part is freed for the next one
        return inserted

    def refresh(self) -> int:
        with self.hot.lock:  # (the hot copies' writes: HotCopies says why under its lock)
            total = sum(int(s.refresh()) for s in self.shards)
            self.hot.refill()
        return total

    def update(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        with self.hot.lock:
            held = sum(int(self.shards[s].update(keys[w], vectors[w]))
                       for s, w in self._routed(keys))
            self.hot.update(keys, vectors)
        return held

    def insert(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        with self.hot.lock:
            for s, where in self._routed(keys):
                self.shards[s].insert(keys[where], vectors[where])
            self.hot.update(keys, vectors)

    def replicate_hot(self, keys: np.ndarray) -> dict[int, int]:
        """Each device's hot copy holds the rows of `keys` (host int64, heaviest first)
        that its peers' shards hold (hps/gpu/hot_rows.py); the keys each device's copy
        holds. Raises NoHotCopiesError where the table has none."""
        if not self.hot:
            raise NoHotCopiesError(
                "this table has no hot copies: they are made for a static table sharded "
                "over several devices (not stored as int8), with gpu_hot_rows above 0")
        return self.hot.replicate(keys)

    def _routed(self, keys: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        for s, where in enumerate(split_by_shard(keys, self.num_shards)):
            if where.size:
                yield s, where

    def stats(self) -> dict[str, Any]:
        """The shards' counters summed, their sizes and devices, and each shard's stats."""
        parts = [s.stats() for s in self.shards]
        total: dict[str, Any] = {
            "mode": self.mode, "sharding": "row_wise", "shards": self.num_shards,
            "storage_dtype": parts[0]["storage_dtype"], "dim": self.dim,
            "capacity": self.capacity}
        for key in ("size", "slots", "memory_bytes", "lookups", "keys", "hits", "misses",
                    "sync_fetches", "async_inserts", "dropped_inserts", "refreshed",
                    "background_errors"):
            total[key] = sum(int(p.get(key) or 0) for p in parts)
        # what the one pass served without the shards (their misses the shards count)
        one_pass = dict.fromkeys(_ONE_PASS_COUNTS, 0)
        for view in self._views.values():
            for key, value in view.one_pass_counts().items():
                one_pass[key] += value
                total[key] += value
        total["one_pass"] = one_pass
        total["hot_rows"] = self.hot.stats()
        total["memory_bytes"] += self.hot.memory_bytes()
        looked = total["hits"] + total["misses"]
        total["hit_rate"] = total["hits"] / looked if looked else None
        total["per_shard"] = parts
        return total

    def close(self) -> None:
        self.hot.close()
        for shard in self.shards:
            shard.close()


class ShardedView:
    """A sharded table as seen from one deployed device: the lookup entries of
    GpuEmbeddingTable (lookup, lookup_contiguous) for keys and outputs on that device.
    Writes, warm-up, refresh and stats go to the table once, whichever view is asked:
    the server keeps one view per device, and applies writes through `owner`."""

    def __init__(self, table: ShardedTable, device: int) -> None:
        self.owner = table
        self.device_id = device
        self.dim = table.dim
        self.storage = table.storage
        self.mode = table.mode
        self.capacity = table.capacity
        self._cp = kernels.cupy_module()
        self._rt = self._cp.cuda.runtime
        self._lock = threading.Lock()
        # the one-pass query over every shard (hps/gpu/sharded_query.py), where it applies
        self._one_pass: OnePassQuery | None = None
        if OnePassQuery.applies(table.shards) and peers_reachable(
                self._cp, device, {s.device_id for s in table.shards}):
            self._one_pass = OnePassQuery(self._cp, device, table.shards, table.hot.on(device))
        # its misses fetched once for every shard (hps/gpu/sharded_misses.py), where it applies
        self._misses: ShardedMisses | None = None
        if self._one_pass is not None and ShardedMisses.applies(device, table.shards):
            self._misses = ShardedMisses(self._cp, device, table.shards,
                                         self._one_pass.shards_ptr)
        #: whether lookups take the one pass where it applies (True) or the copy path
        #: (False: for comparing the two, `hps bench gpu --profile sharded`)
        self.use_one_pass = True
        self._default = table.shards[0].default_value
        self._counts: list[dict[str, int]] = []  # the one pass's counters, one per thread
        self._tls = threading.local()

    # -- lookups --------------------------------------------------------------------------

    def lookup(self, keys: Any, out: Any) -> None:
        """GpuEmbeddingTable.lookup's contract, for the whole sharded table."""
        kref, oref, out_type = lookup_refs(keys, out, self.dim, self.storage, self.device_id)
        n = kref.size
        dev = self.device_id
        if n == 0:
            return
        cp = self._cp
        with cp.cuda.Device(dev):
            stream = kref.stream if kref.stream is not None else oref.stream
            if stream is None:
                stream = cp.cuda.get_current_stream().ptr
            with external_stream(cp, stream):
                if kref.device == dev and is_wide(kref):
                    keys_dev = device_view(cp, kref.ptr, (n,), np.int64, kref.owner)
                elif kref.on_host:
                    keys_dev = cp.asarray(np.ascontiguousarray(kref.host_array(), np.int64))
                else:
                    keys_dev = kref.device_array().reshape(-1).astype(np.int64)
                if oref.device == dev and oref.contiguous:
                    self._lookup_device(keys_dev, n, oref.ptr, int(stream), out_type)
                    return
                rows = cp.empty((n, self.dim), OUTPUT_CUPY_DTYPE[out_type])
                self._lookup_device(keys_dev, n, int(rows.data.ptr), int(stream), out_type)
                if oref.on_host:
                    host = rows.get()
                    if oref.contiguous:  # any shape of n × dim values, bfloat16 too
                        ctypes.memmove(oref.ptr, host.ctypes.data, host.nbytes)
                    else:
                        oref.host_array()[...] = host
                else:
                    cp.copyto(oref.device_array(), rows)

    def host_output(self, n: int) -> np.ndarray:
        """GpuEmbeddingTable.host_output's contract: a new host array for lookup()."""
        return pinned_empty(self._cp, (n, self.dim), np.float32)

    def lookup_contiguous(self, keys_ptr: int, n: int, out_ptr: int, stream: int,
                          out_type: int = OUT_FLOAT32) -> None:
        """GpuEmbeddingTable.lookup_contiguous's contract, for the whole sharded table."""
        cp = self._cp
        one_pass = self._one_pass
        if one_pass is not None and out_type == OUT_FLOAT32 and self.use_one_pass:
            # the fast path first: one compiled call, no device switch (it checks the
            # context), as one table's lookup_contiguous
            missed = one_pass.fast(keys_ptr, n, out_ptr, stream, self._default)
            if missed == 0:
                self._count_one_pass(n, 0)
                return
            rt, dev = self._rt, self.device_id  # no CuPy arrays, no context managers
            previous = rt.getDevice()
            if previous != dev:
                rt.setDevice(dev)
            try:
                self._one_pass_lookup(keys_ptr, n, out_ptr, stream, missed, tried_fast=True)
            finally:
                if previous != dev:
                    rt.setDevice(previous)
            return
        with cp.cuda.Device(self.device_id), external_stream(cp, stream):
            keys = device_view(cp, keys_ptr, (n,), np.int64, None)
            self._lookup_copied(keys, n, out_ptr, stream, out_type)

    def _lookup_device(self, keys: Any, n: int, out_ptr: int, stream: int, out_type: int
                       ) -> None:
        """Keys (a CuPy int64 [n] array on this device) → rows at out_ptr, on `stream`
        (current, with this device)."""
        if self._one_pass is None or out_type != OUT_FLOAT32 or not self.use_one_pass:
            self._lookup_copied(keys, n, out_ptr, stream, out_type)
            return
        self._one_pass_lookup(int(keys.data.ptr), n, out_ptr, stream)

    def _one_pass_lookup(self, keys_ptr: int, n: int, out_ptr: int, stream: int,
                         missed: int = FALLBACK, tried_fast: bool = False) -> None:
        """The one pass (hps/gpu/sharded_query.py) into a float32 output, this device
        current; its misses served by hps/gpu/sharded_misses.py, or through the copy path,
        each to its own shard. `missed`: the miss count of the query its fast path made
        already (FALLBACK: none made; `tried_fast`: that path was tried, fell back)."""
        one_pass: OnePassQuery = self._one_pass  # type: ignore[assignment]
        if missed == FALLBACK:
            misses, ws = one_pass.query(keys_ptr, n, out_ptr, stream, self._default, tried_fast)
        else:
            misses, ws = missed, one_pass.workspace()
        counts = self._count_one_pass(n, misses)
        if misses and self._misses is not None:
            self._misses.serve(ws, misses, n, out_ptr, stream, counts)
        elif misses:
            cp = self._cp
            with cp.cuda.Device(self.device_id), external_stream(cp, stream):
                missed_keys = cp.asarray(ws.host_keys[:misses])
                rows = cp.empty((misses, self.dim), np.float32)
                self._lookup_copied(missed_keys, misses, int(rows.data.ptr), stream,
                                    OUT_FLOAT32)
                out = device_view(cp, out_ptr, (n, self.dim), np.float32, None)
                out[ws.positions[:misses]] = rows
                ws.release(stream)

    def _count_one_pass(self, n: int, misses: int) -> dict[str, int]:
        """Counts a one-pass lookup of n keys with `misses` into this thread's counters
        (its misses where the one pass serves them: hps/gpu/sharded_misses.py; else the
        shards of the copy path count them); returns the counters."""
        counts = self._thread_counts()
        served = misses if self._misses is not None else 0
        counts["lookups"] += 1
        counts["hits"] += n - misses
        counts["keys"] += n - misses + served
        counts["misses"] += served
        return counts

    def _thread_counts(self) -> dict[str, int]:
        counts: dict[str, int] | None = getattr(self._tls, "counts", None)
        if counts is None:
            counts = self._tls.counts = dict.fromkeys(_ONE_PASS_COUNTS, 0)
            with self._lock:
                self._counts.append(counts)
        return counts

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        """GpuEmbeddingTable.warming_up's contract: each shard's, and this thread's
        one-pass counts forgotten after the block."""
        with contextlib.ExitStack() as shards:
            for shard in self.owner.shards:
                shards.enter_context(shard.warming_up())
            yield
        for name in getattr(self._tls, "counts", None) or ():
            self._tls.counts[name] = 0

    def one_pass_counts(self) -> dict[str, int]:
        """The lookups the one pass served, their hits, and the misses it served itself
        (those of the copy path are counted by the shards that served them)."""
        with self._lock:
            parts = list(self._counts)
        return {k: sum(c[k] for c in parts) for k in _ONE_PASS_COUNTS}

    def _lookup_copied(self, keys: Any, n: int, out_ptr: int, stream: int, out_type: int
                       ) -> None:
        """_lookup_device by the copy path: a partition by shard, a lookup per shard (a
        peer's by copies both ways), a scatter back."""
        cp = self._cp
        table = self.owner
        num = table.num_shards
        partition, scatter32, scatter16 = _kernels_on(self.device_id)[1:]
        counts = cp.zeros(num, np.uint32)
        runs = cp.empty((num, n), np.int64)
        positions = cp.empty((num, n), np.int64)
        partition((-(-n // 256),), (256,),
                  (keys, np.int64(n), np.uint64(num), counts, runs, positions))
        sizes = counts.get().tolist()  # the one extra host wait
        row_bytes = self.dim * OUTPUT_CUPY_DTYPE[out_type].itemsize
        rows = cp.empty(n * row_bytes, np.uint8)
        start = 0
        for s, count in enumerate(sizes):
            if not count:
                continue
            run_keys = int(runs.data.ptr) + s * n * 8
            run_rows = int(rows.data.ptr) + start * row_bytes
            shard = table.shards[s]
            if shard.device_id == self.device_id:
                shard.lookup_contiguous(run_keys, count, run_rows, stream, out_type)
            else:
                self._peer_lookup(shard, run_keys, count, run_rows, row_bytes, stream,
                                  out_type)
            start += count
        wide = row_bytes % 4 == 0
        words = row_bytes // (4 if wide else 2)
        out = device_view(cp, out_ptr, (n * row_bytes,), np.uint8, None)
        (scatter32 if wide else scatter16)((-(-n * words // 256),), (256,), (
            rows, positions, counts, np.int64(n), np.int32(num), np.int64(words), out))

    def _peer_lookup(self, shard: GpuEmbeddingTable, keys_ptr: int, n: int, rows_ptr: int,
                     row_bytes: int, stream: int, out_type: int) -> None:
        """A run of keys served by a shard on another device: the keys copied there after
        the caller's stream has them, looked up on that device's stream, the rows copied
        back, and the caller's stream made to wait for them. Needs peer access between
        the two devices (enabled once per pair)."""
        cp = self._cp
        here, there = self.device_id, shard.device_id
        ready = cp.cuda.Event(disable_timing=True)
        ready.record(cp.cuda.ExternalStream(stream))
        with cp.cuda.Device(there):
            peer_stream = _peer_stream(cp, there)
            peer_stream.wait_event(ready)
            with peer_stream:
                keys = cp.empty(n, np.int64)
                rows = cp.empty(n * row_bytes, np.uint8)
                self._rt.memcpyPeerAsync(int(keys.data.ptr), there, keys_ptr, here, n * 8,
                                         peer_stream.ptr)
                shard.lookup_contiguous(int(keys.data.ptr), n, int(rows.data.ptr),
                                        peer_stream.ptr, out_type)
                self._rt.memcpyPeerAsync(rows_ptr, here, int(rows.data.ptr), there,
                                         n * row_bytes, peer_stream.ptr)
                done = peer_stream.record()
        cp.cuda.ExternalStream(stream).wait_event(done)

    # -- the table's writes and state, through its owner ---------------------------------

    def warm_up(self, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> int:
        return self.owner.warm_up(chunks)

    def refresh(self) -> int:
        return self.owner.refresh()

    def update(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        return self.owner.update(keys, vectors)

    def insert(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        self.owner.insert(keys, vectors)

    def stats(self) -> dict[str, Any]:
        return {**self.owner.stats(), "device_id": self.device_id}

    def close(self) -> None:
        self.owner.close()


_PEER_STREAMS: dict[tuple[int, int], Any] = {}
_PEER_LOCK = threading.Lock()


def _copied(cp: Any, array: Any, stream: Any) -> Any:
    """A copy on the current device of a contiguous array on another, on `stream` (a
    peer copy over the link where the two have access)."""
    copy = cp.empty_like(array)
    copy.data.copy_from_device_async(array.data, array.nbytes, stream)
    return copy


def _peer_stream(cp: Any, device: int) -> Any:
    """This thread's non-blocking stream on `device` for peer shards' work; peer access
    from every other device to it enabled the first time."""
    key = (threading.get_ident(), device)
    stream = _PEER_STREAMS.get(key)
    if stream is None:
        with _PEER_LOCK:
            for other in range(cp.cuda.runtime.getDeviceCount()):
                if other != device:
                    enable_peer_access(cp, device, other)
            stream = _PEER_STREAMS[key] = cp.cuda.Stream(non_blocking=True)
    return stream
