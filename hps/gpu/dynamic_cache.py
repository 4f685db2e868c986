"""The dynamic GPU embedding cache: set-associative, least recently used out first.

`EmbeddingCache(capacity_slots, dim, device_id, storage=...)` holds up to `capacity_slots`
vectors of `dim` values on one device, stored as float32 or in a compact storage type
(hps/rows/gpu_layout.py) (rounded up to whole sets of `SET_SIZE` slots). A key's set is
MurmurHash3's finalizer of the key scaled to the set count; a set's keys are contiguous, so
a lookup reads 64 bytes of keys and then one 16-byte-aligned row (kernels in
`cuda/embedding_cache.cu`).

Operations, all on device arrays (host NumPy arrays are accepted and copied over):

    misses_at, n_misses = cache.query(keys, out)   # hits written into out's rows
    cache.insert(keys, vectors)                    # fills free slots, else evicts the LRU
    cache.update(keys, vectors)                    # rewrites present keys only
    cache.remove(keys)
    held = cache.dump(start_set, stop_set)         # keys held in a range of sets
    recent = cache.held_keys(most)                 # host keys, most recently used first

Every int64 key is a valid key. Empty slots hold `EMPTY_KEY` (2**63 - 1); that key itself
is kept in one extra slot outside the sets, which is never evicted (only removed).

Streams, memory and launches: hps/gpu/device_table.py (queries on the caller's stream,
writes on the cache's own, ordered with CUDA events; thread-safe).

Least-recently-used order is kept with a 64-bit stamp per slot: every query and every
insert call takes the next tick; a hit stamps its slot with `tick << RANK_BITS`, an insert
with `tick << RANK_BITS | r` where r is the key's rank among the batch's keys of its set.
By default one hit in two is stamped (`lru_sample_shift=1`, chosen by a hash of key and
tick): the stamp write is a read-modify-write of a memory sector per hit, the largest cost
of a hit at small widths, and sampling halves it while keeping recency close to exact.
`lru_sample_shift=0` stamps every hit (exact LRU).
An insert of a key that is not held takes the first free way of its set, else evicts the
way with the smallest stamp (the lowest way on ties). Keys of one insert batch that map to
one set are inserted in batch order. `hps/gpu/cache_model.py` is a NumPy model of
exactly this.

Which table a model's table gets (this cache, or the static or uvm table) and its sizing:
hps/gpu/open.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hps.errors import LookupInputError
from hps.gpu import kernels
from hps.gpu.device_arrays import host_keys
from hps.gpu.device_table import DeviceTable, decode_rows
from hps.gpu.fast_query import TICK
from hps.gpu.kernels import EMPTY_KEY, RANK_BITS, SET_SIZE
from hps.gpu.launch_shape import BLOCK, default_group, default_unroll
from hps.gpu.workspace import QueryWorkspace
from hps.rows.gpu_layout import OUT_FLOAT32, stored_row_bytes, table_storage
from hps.rows.storage_types import FLOAT32, StorageType

if TYPE_CHECKING:
    from hps.gpu.shared_cache import SharedTableRecord

__all__ = ["DEFAULT_LRU_SAMPLE_SHIFT", "EMPTY_KEY", "RANK_BITS", "SET_SIZE", "EmbeddingCache",
           "murmur3_fmix64", "set_codes", "set_of"]

# Stamp 1 in 2**shift hits (sampled LRU). The stamp is a partial-sector write per hit, the
# largest cost of a hit at small widths (H100, dim 16, 1M uniform hits: exact 5.6 G keys/s,
# 1/2 6.7, 1/4 7.5, never 8.2); one hit in two keeps the recency order close to exact.
DEFAULT_LRU_SAMPLE_SHIFT = 1

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_S32 = np.uint64(32)


def murmur3_fmix64(keys: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer (fmix64: xor-shift 33, multiply by 0xff51afd7ed558ccd,
    xor-shift 33, multiply by 0xc4ceb9fe1a85ec53, xor-shift 33) of int64 keys, as uint64;
    hps_murmur3_fmix64 in the kernels. The set hash of the GPU caches (the database tiers'
    partition hash is another one, hps/tiers/partition.py)."""
    k = np.ascontiguousarray(keys, dtype=np.int64).view(np.uint64).copy()
    with np.errstate(over="ignore"):
        k ^= k >> _S33
        k *= _M1
        k ^= k >> _S33
        k *= _M2
        k ^= k >> _S33
    return k


def set_of(keys: np.ndarray, num_sets: int) -> np.ndarray:
    """The set (or static bucket) of each key among num_sets (hps_set_of in the kernels)."""
    return ((murmur3_fmix64(keys) >> _S32) * np.uint64(num_sets) >> _S32).astype(np.int64)


def set_codes(keys: np.ndarray, num_sets: int) -> np.ndarray:
    """Sorted set << 32 | position codes of host keys: the insert kernel's input order,
    computed on the host (no device sort) when the keys come from the host anyway."""
    codes = set_of(keys, num_sets).view(np.uint64) << _S32
    codes |= np.arange(keys.size, dtype=np.uint64)
    codes.sort()
    return codes


class EmbeddingCache(DeviceTable):
    """A set-associative LRU cache of `dim`-wide vectors on one GPU, stored as `storage`
    (float32, float16, bfloat16 or int8; inserts take float32 rows and encode them).

    capacity_slots is rounded up to whole sets of SET_SIZE. Raises DeviceError when the
    device lacks the memory (`memory_required` tells how much before allocating),
    ConfigError for an unknown storage type and MissingExtraError without CuPy.
    """

    _kind = "embedding cache"
    _source = "embedding_cache.cu"
    _query_kernel = "cache_query"
    _pipelined_kernel = "cache_query_pipelined"
    _query_signature = "ptr i64 ptr ptr ptr u32 ptr ptr i32 ptr ptr ptr ptr u64 f32"
    _dump_kernel = "cache_dump"
    _update_kernel = "cache_update"

    def __init__(self, capacity_slots: int, dim: int, device_id: int = 0, *,
                 lru_sample_shift: int = DEFAULT_LRU_SAMPLE_SHIFT, group: int | None = None,
                 unroll: int | None = None, storage: str | StorageType = FLOAT32,
                 shared: SharedTableRecord | None = None) -> None:
        if capacity_slots < 1:
            raise LookupInputError(f"capacity_slots must be positive, got {capacity_slots}")
        if dim < 1:
            raise LookupInputError(f"dim must be positive, got {dim}")
        num_sets = -(-int(capacity_slots) // SET_SIZE)
        if num_sets >= 2**32:
            raise LookupInputError(f"capacity_slots {capacity_slots} is too large")
        if not 0 <= lru_sample_shift <= 8:
            raise LookupInputError(f"lru_sample_shift must be in [0, 8], got {lru_sample_shift}")
        self.lru_sample_shift = int(lru_sample_shift)
        super().__init__(dim, device_id, num_sets,
                         group=group or default_group(dim), unroll=unroll or default_unroll(dim),
                         special_flags=2, storage=storage, shared=shared)
        self._defines["STAMP_SHIFT"] = self.lru_sample_shift
        with self._device:
            self._stamps = self._alloc((self.num_slots,), np.uint64)
            if self._fresh:
                with self._stream:
                    self._stamps.fill(0)
            self._stream.synchronize()
        self._stamps_ptr = int(self._stamps.data.ptr)

    def set_lru_sample_shift(self, shift: int) -> None:
        """Stamp 1 in 2**shift hits from now on (0: every hit, exact LRU)."""
        if not 0 <= shift <= 8:
            raise LookupInputError(f"lru_sample_shift must be in [0, 8], got {shift}")
        with self._lock:
            self._gate.close()  # fast queries take the locked path, which rebinds them
            self.lru_sample_shift = int(shift)
            self._defines = {**self._defines, "STAMP_SHIFT": self.lru_sample_shift}
            self._fn = {}
            self._generation += 1
            self._gate.write_queued(self._rt, 0)  # a shared gate: nothing written, reopen

    @staticmethod
    def memory_required(capacity_slots: int, dim: int,
                        storage: str | StorageType = FLOAT32) -> int:
        """Device bytes a cache of this capacity, width and storage type takes."""
        slots = -(-int(capacity_slots) // SET_SIZE) * SET_SIZE
        return slots * (8 + 8) + (slots + 1) * stored_row_bytes(dim, table_storage(storage)) + 64

    def _memory_bytes(self) -> int:
        return self.memory_required(self.num_slots, self.dim, self.storage)

    @property
    def capacity(self) -> int:
        return self.num_slots

    def _free_extra(self) -> None:
        self._stamps = None

    def _empty_extra(self) -> None:
        self._stamps.fill(0)

    _query_slots = (0, 1, 7, 8, 14)
    _tick_slot = 13

    def _fixed_query_params(self, ws: QueryWorkspace) -> dict[int, float]:
        return {2: self._keys_ptr, 3: self._stamps_ptr, 4: self._vecs_ptr, 5: self.num_sets,
                6: self._flags_ptr, 9: ws.ctl_ptr, 10: ws.host_ptr, 11: ws.positions_ptr,
                12: ws.keys_ptr}

    def _dump_args(self, start: int, stop: int, count: Any, out: Any) -> tuple[Any, ...]:
        return (self._keys, np.uint32(self.num_sets), np.uint32(start), np.uint32(stop),
                self._flags, count, out)

    def _next_tick(self) -> np.uint64:
        """The next tick, shifted into place for the stamps (see RANK_BITS)."""
        return np.uint64(self._gate.next_tick() << RANK_BITS)

    def insert(self, keys: Any, vectors: Any) -> None:
        """Inserts (or overwrites) keys with their rows, evicting least recently used keys
        of full sets. Repeated keys: the last row wins. Host keys are ordered by set on
        the host; device keys by a device sort."""
        if isinstance(keys, np.ndarray):
            host = host_keys(keys)
            vectors = self._device_rows(vectors, host.size)
            if host.size:
                codes = set_codes(host, self.num_sets)
                with self._device:
                    self.insert_by_set(self._cp.asarray(host), vectors,
                                       self._cp.asarray(codes))
            return
        keys = self._device_keys(keys)
        n = int(keys.shape[0])
        vectors = self._device_rows(vectors, n)
        if n == 0:
            return
        cp = self._cp
        with self._device:
            codes = cp.empty(n, dtype=np.uint64)
            self._kernel("cache_set_codes")(
                (kernels.grid(self.device_id, n, BLOCK),), (BLOCK,),
                (keys, np.int64(n), np.uint32(self.num_sets), codes),
            )
            codes.sort()
            self.insert_by_set(keys, vectors, codes)

    def insert_by_set(self, keys: Any, vectors: Any, codes: Any) -> None:
        """insert() for checked device arrays whose set codes are known: `codes` (uint64
        [n], on the device) is `set_codes(keys)` sorted (see set_codes). On the caller's
        stream order; the device current."""
        n = int(keys.shape[0])
        with self._writing(keys, vectors, codes):
            self._kernel("cache_insert")(
                (kernels.grid(self.device_id, n * self._group, BLOCK),), (BLOCK,),
                (codes, np.int64(n), keys, vectors, self._vec4(vectors), self._keys,
                 self._stamps, self._vecs, np.uint32(self.num_sets), self._flags,
                 self._next_tick()),
            )

    def insert_staged(self, keys_ptr: int, rows_ptr: int, codes_ptr: int, n: int,
                      ws: QueryWorkspace, stream_ptr: int,
                      scatter: tuple[int, int, int, int] | None = None,
                      out_type: int = OUT_FLOAT32) -> None:
        """insert_by_set on device addresses, queued on the caller's stream `stream_ptr`
        (the device current) with a launch bound to `ws`: keys int64 [n], rows float32
        [n, dim] and their sorted set codes uint64 [n], contiguous. Ordered after the
        queries in flight on other streams and the writes before it; later queries and
        writes wait for it (see DeviceTable._writing_on, inlined: this is the lookup
        path's). The kernel runs on the workspace's device: the table's, or a peer that
        reaches its memory. (A sharded table's miss path inserts into every shard by one
        launch of its own, under hold_for_insert: hps/gpu/sharded_misses.py.)

        `scatter` (positions, inverse, count, out: device addresses) also writes the rows
        into a lookup's output, out[positions[j]] = rows[inverse[j]] for j < count
        (inverse 0: rows[j]), in the same launch (cuda/embedding_cache.cu
        cache_insert_scatter): the miss path pays one kernel launch, not two. The output
        is of output type `out_type` (hps/rows/gpu_layout.py)."""
        cells = ws.insert_cells
        if (cells is None or ws.insert_generation != self._generation
                or ws.insert_type != out_type):
            launch = kernels.Launch(self._kernel("cache_insert_scatter", out_type,
                                                 ws.device_id),
                                    "ptr i64 ptr ptr i32 ptr ptr ptr u32 ptr u64 "
                                    "u32 ptr ptr i64 ptr i32")
            for i, v in ((5, self._keys_ptr), (6, self._stamps_ptr), (7, self._vecs_ptr),
                         (8, self.num_sets), (9, self._flags_ptr)):
                launch.set(i, v)
            ws.insert_launch = launch
            ws.insert_type = out_type
            ws.insert_generation = self._generation
            ws.insert_cells = cells = launch.values
        cells[0].value = codes_ptr
        cells[1].value = n
        cells[2].value = keys_ptr
        cells[3].value = rows_ptr
        cells[4].value = self._dim4 and rows_ptr % 16 == 0
        blocks = kernels.grid(ws.device_id, n * self._group, BLOCK)
        cells[11].value = blocks
        if scatter is None:
            cells[14].value = 0
        else:
            positions, inverse, count, out_ptr = scatter
            vec4 = self._dim4 and out_ptr % 16 == 0 and rows_ptr % 16 == 0
            cells[12].value = positions
            cells[13].value = inverse
            cells[14].value = count
            cells[15].value = out_ptr
            cells[16].value = vec4
            blocks += kernels.grid(ws.device_id, count * (self.dim // 4 if vec4 else self.dim),
                                   BLOCK)
        cells[10].value = self.hold_for_insert(stream_ptr, ws.event_ptr)
        done = None
        try:
            ws.insert_launch.go_recorded(  # type: ignore[union-attr]
                blocks, BLOCK, stream_ptr, int(ws.write_done.ptr))  # the GIL kept throughout
            done = ws.write_done
        finally:
            self.release_after_insert(done)

    # An insert queued on the lookup path, here or by a kernel that inserts into several
    # tables at once (a sharded table's misses: hps/gpu/sharded_misses.py):
    #     tick = table.hold_for_insert(stream, own_event)  # the lock taken, the order set
    #     ... launch with `tick`, record `done` (an Event) on stream ...
    #     table.release_after_insert(done)                 # None: nothing was launched
    def hold_for_insert(self, stream_ptr: int, own_event: int,
                        device: int | None = None) -> int:
        """Takes the table's lock, closes its gate and orders `stream_ptr` (of `device`;
        None: this table's) after the queries in flight on other streams (`own_event`:
        the caller's own, not waited for) and after the last write; returns the insert's
        LRU tick (shifted for its ranks). Raises DeviceError (the lock released) when the
        table is closed."""
        self._lock.acquire()
        try:
            if self._closed:
                self._check_open()
            self._after_queries(stream_ptr, own_event, device)
            if self._write_event is not None:
                self._wait_for_writes(stream_ptr)
            return int(self._gate.next_tick() << RANK_BITS)
        except BaseException:
            self._gate.write_queued(self._rt, 0)
            self._lock.release()
            raise

    def release_after_insert(self, done: Any) -> None:
        """The insert held by hold_for_insert was queued and recorded the event `done`
        (None: it was not): later queries and writes wait for it; the lock released."""
        try:
            if done is not None:
                self._write_event = done
            self._gate.write_queued(self._rt, int(done.ptr) if done is not None else 0)
        finally:
            self._lock.release()

    def codes_on_device(self, keys_ptr: int, n: int, codes_ptr: int, stream_ptr: int) -> None:
        """Unsorted set codes (set << 32 | position) of n device keys, on the stream."""
        kernels.Launch(self._kernel("cache_set_codes"), "ptr i64 u32 ptr")(
            kernels.grid(self.device_id, n, BLOCK), BLOCK, stream_ptr, keys_ptr, n,
            self.num_sets, codes_ptr)

    def remove(self, keys: Any) -> None:
        """Frees the slots of the keys held; others are ignored."""
        keys = self._device_keys(keys)
        n = int(keys.shape[0])
        if n == 0:
            return
        with self._writing(keys):
            self._kernel("cache_remove")(
                (kernels.grid(self.device_id, n * self._group, BLOCK),), (BLOCK,),
                (keys, np.int64(n), self._keys, self._stamps, np.uint32(self.num_sets),
                 self._flags),
            )

    def held_keys(self, most: int) -> np.ndarray:
        """Up to `most` of the keys held, most recently used first (by stamp), as host
        int64: the working set a replica's cache is warmed with (`GET .../hot-set`). Read
        on the table's stream after the writes queued; a key whose stamp a query moves
        meanwhile keeps either place. Takes ~24 B of device memory per slot for a moment."""
        cp = self._cp
        with self._on_table_stream():
            self._wait_for_writes(self._stream.ptr)
            held = self._keys != EMPTY_KEY
            keys, stamps = self._keys[held], self._stamps[held]
            if 0 < most < keys.size:  # the `most` newest stamps, then only those sorted
                newest = cp.argpartition(stamps, keys.size - most)[keys.size - most:]
                keys, stamps = keys[newest], stamps[newest]
            order = cp.argsort(stamps)[::-1][:max(int(most), 0)]
            recent = keys[order].get(stream=self._stream)
            self._stream.synchronize()
            return recent

    def state(self) -> dict[str, np.ndarray]:
        """Host copies of the whole cache (for tests): keys and stamps [num_sets, SET_SIZE],
        rows [num_sets, SET_SIZE, dim] (decoded to float32), the special slot's presence,
        row and stamp-free key count."""
        with self._lock:
            self._check_open()
            with self._device:
                self._stream.synchronize()
                s = self._stream
                rows = decode_rows(self._vecs.get(stream=s), self.dim, self.storage)
                return {
                    "keys": self._keys.get(stream=s).reshape(self.num_sets, SET_SIZE),
                    "stamps": self._stamps.get(stream=s).reshape(self.num_sets, SET_SIZE),
                    "rows": rows[:-1].reshape(self.num_sets, SET_SIZE, self.dim),
                    "special": bool(self._flags.get(stream=s)[0]),
                    "special_row": rows[-1],
                    "size": int(self._flags.get(stream=s)[1]),
                    "tick": np.uint64(self._gate.words[TICK]),
                }
