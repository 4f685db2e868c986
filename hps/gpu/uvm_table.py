"""The uvm table: a whole embedding table served on the GPU, its hottest rows in GPU memory,
the others in pinned, device-mapped host memory that the query kernel reads directly.

    table = UvmEmbeddingTable(num_keys, dim, device_id, gpu_rows=2_000_000)
    table.build(keys, vectors)     # chunk by chunk, like the static table; the first
                                   # gpu_rows keys built get GPU rows (file order)
    misses_at, n = table.query(keys, out)   # held keys, hot or cold, served on the GPU
    table.update(keys, vectors)    # rewrites both copies of the rows
    table.promote()                # one promotion pass (a background task runs them)
    table.close()

Layout (cuda/uvm_table.cu): the static table's index (hps/gpu/static_table.py: buckets of
SET_SIZE slots, open addressing) holds every key in GPU memory. Every key's row lives in
pinned host memory at its slot (allocated with cudaHostAllocMapped; the kernel reads it
over the bus through the mapped device pointer, so a lookup of a held key needs no CPU
work and no tier call); `gpu_rows` rows also have a copy in GPU memory, linked from the
slot. Keys the table lacks are misses, for the caller's usual miss path.

Placement: the first `gpu_rows` keys built get the GPU rows (file order, HugeCTR's warm-up
order); `seed_hits(keys, counts)` lets known access counts decide the first pass instead.
Every access counts in the key's `hits` (up to HITS_CAP). A promotion pass (the background
task, every `promotion_interval` seconds while lookups come, on the table's stream; while
lookups promote rows themselves (below), the task only halves the counts;
hps/gpu/uvm_moves.py chooses the moves):

1. candidates: keys without a GPU row with hits >= MIN_HITS, most hits first (ties: lower
   slot first); victims: GPU rows, free ones first, then by their key's hits, fewest first
   (ties: lower row first); at most `max_moves` pairs;
2. the i-th candidate takes the i-th victim's row while candidate hits > PROMOTE_FACTOR ×
   victim hits (a free row counts as -1 hits): the hysteresis keeps rows of keys about
   as hot as the candidates from swapping back and forth;
3. every count is halved (older accesses weigh less).

Promotion on the lookup path: a grouped query (below) of n keys that runs alone on the
device (no query on another stream in flight, no pass choosing moves) and read at most
n / 2 rows from host memory then promotes the host rows it read for keys with MIN_HITS
accesses or more, at most min(gpu_rows, n) // 32 of them, into the GPU
rows with the fewest hits in windows at a clock hand (cuda/uvm_table.cu
uvm_promote_read_rows), on the caller's stream: skewed traffic then reads its warm rows
from GPU memory from the next batch on instead of waiting for a pass. The promotion
copies float32 rows from the batch's output (no second read of host memory) and then
publishes the batch's miss count, so the call returns only once nothing reads its output.
Smaller batches do not promote: each one that read a host row would pay a promotion
launch (2,000-key p50 29 against 23 µs without, H100), and the passes place their keys.
Later queries and writes wait for it as for a write, so an update either comes first
(the copy is of its row) or rewrites the new GPU copy too.

tests/support/uvm_reference.py models this in NumPy, slot for slot.

A move never blocks a lookup on the host and never lets one read a half-copied row: the
demoted slots are unlinked first (a tiny kernel that later queries wait for on the GPU);
the copy into the freed rows waits only for the queries already in flight and then links
the promoted slots. Rows are always current in host memory (updates write both copies),
so both copies a query may read are equal. Counts are updated without locks: a pass that
runs while queries count may lose a few increments.

Host reads (hps/gpu/uvm_reads.py): a batch of `grouped_reads_from` keys or more reads its
host rows grouped by region; a smaller one reads them at once (cuda/uvm_table.cu
uvm_query, the static query's shape).

Memory: GPU slots × 16 B (key, GPU row link, hits) + gpu_rows × (row bytes + 4); pinned
host (slots + 1) × row bytes (`device_bytes_required`, `host_bytes_required`). Too little
host memory is a ConfigError before anything is allocated. A thread's grouped reads use
12 B per key of its largest batch and 8 B per host region of GPU memory (CuPy's pool).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

import numpy as np

from hps.errors import ConfigError, LookupInputError
from hps.gpu import kernels
from hps.gpu.device_table import decode_rows
from hps.gpu.host_memory import MappedHostMemory
from hps.gpu.kernels import SET_SIZE
from hps.gpu.launch_shape import BLOCK
from hps.gpu.static_table import StaticEmbeddingTable, _num_buckets
from hps.gpu.streams import same_stream, stream_key
from hps.gpu.uvm_moves import MIN_HITS, NO_ROW, choose_moves, compile_pass_kernels
from hps.gpu.uvm_reads import REGION_BYTES, SCAN_BLOCK, HostReadLists, region_shift
from hps.gpu.workspace import QueryWorkspace
from hps.rows.gpu_layout import stored_row_bytes, table_storage
from hps.rows.storage_types import FLOAT32, StorageType
from hps.runtime.background import PeriodicTask
from hps.runtime.memory_available import available_memory

log = logging.getLogger("hps.gpu")

HITS_CAP = 1 << 16  # counts stop here: hot keys' counters are then only read
# Index slots per key, as the static table's: a small batch waits for its longest probe,
# and at 0.9 (about 1.3 bucket reads a lookup on average) the longest ones made a 2,000-key
# query's kernel take 21.0 µs against 15.3 at 0.8 and 14.0 at 0.7, every row in GPU memory
# (H100, 2M keys dim 64, scripts/probe_uvm_small.py); 0.8 costs 12% more index memory.
DEFAULT_LOAD_FACTOR = 0.8
DEFAULT_PROMOTION_INTERVAL = 0.1  # seconds between background passes
# Batches of this many keys or more read their host rows grouped by region (see above).
# Not tuned on a GPU yet beyond 1M-key batches: below it the direct reads are kept.
GROUPED_READS_FROM = 1 << 14
_QUERY_SIGNATURE = "ptr i64 ptr ptr u32 ptr ptr i32 ptr ptr ptr ptr f32 ptr ptr ptr"
_PROMOTE_SIGNATURE = "ptr i64 ptr u32 u32 ptr ptr ptr ptr ptr u32 ptr ptr ptr i32 ptr ptr"
_GROUPED_KERNELS = (  # name, signature
    ("uvm_query_grouped", _QUERY_SIGNATURE + " ptr ptr i32"),
    ("uvm_region_scan", "ptr ptr u32 ptr"),
    ("uvm_region_scatter", "i64 ptr ptr i32 ptr ptr"),
    ("uvm_gather", "ptr ptr ptr ptr ptr i32 ptr ptr i32"),
)


class UvmEmbeddingTable(StaticEmbeddingTable):
    """A whole table on one GPU: index and `gpu_rows` hot rows in GPU memory, every row in
    pinned, device-mapped host memory. Queries, build, update and dump keep the static
    table's contract (hps/gpu/static_table.py); `promote()` moves hot rows to the GPU.

    Raises ConfigError when the host lacks the pinned memory, DeviceError when the device
    lacks memory, LookupInputError for bad sizes. Thread-safe.
    """

    _kind = "uvm table"
    _source = "uvm_table.cu"  # includes static_table.cu: static_build and static_dump too
    _query_kernel = "uvm_query"  # batches below grouped_reads_from
    _query_signature = _QUERY_SIGNATURE
    _fast_queries = False  # its moves wait for its queries by their events
    _update_kernel = "uvm_update"
    _pipelined_kernel = None  # uvm_query serves every batch it does not group
    # lookup promotions copy float32 rows from the batch's output, not the host again
    promote_from_output = True

    def __init__(self, num_keys: int, dim: int, device_id: int = 0, *, gpu_rows: int,
                 load_factor: float = DEFAULT_LOAD_FACTOR,
                 promotion_interval: float = DEFAULT_PROMOTION_INTERVAL,
                 max_moves: int | None = None, huge_pages: bool = True,
                 group: int | None = None, unroll: int | None = None,
                 storage: str | StorageType = FLOAT32,
                 grouped_reads_from: int = GROUPED_READS_FROM,
                 read_region_bytes: int = REGION_BYTES, promote_on_lookup: bool = True
                 ) -> None:
        if not 0 <= gpu_rows < NO_ROW:
            raise LookupInputError(f"gpu_rows must be in [0, {NO_ROW}), got {gpu_rows}")
        if promotion_interval < 0:
            raise LookupInputError(
                f"promotion_interval must be >= 0 seconds, got {promotion_interval}")
        slots = _num_buckets(max(int(num_keys), 1), load_factor) * SET_SIZE
        if slots + 1 >= NO_ROW:
            raise LookupInputError(f"num_keys {num_keys} is too large for a uvm table")
        self.gpu_rows = min(int(gpu_rows), int(num_keys) + 1)
        self.max_moves = int(max_moves) if max_moves else max(1024, self.gpu_rows // 16)
        host = self.host_bytes_required(num_keys, dim, load_factor, storage)
        available = available_memory()
        if available is None:  # no MemAvailable: the free pages
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if host > available:
            raise ConfigError(
                f"the uvm table of {num_keys} keys of dim {dim} needs {host / 2**30:.2f} GiB "
                f"of pinned host memory but the host has {available / 2**30:.2f} GiB "
                f"available; use embedding_cache_type 'dynamic' or a host with more memory"
            )
        self.huge_pages = bool(huge_pages)
        self._host_mem: MappedHostMemory | None = None
        self._host_rows_view: np.ndarray | None = None
        super().__init__(num_keys, dim, device_id, load_factor=load_factor, group=group,
                         unroll=unroll, storage=storage)
        self._defines["HITS_CAP"] = HITS_CAP
        with self._device:
            # each slot's GPU row link and hit count side by side (cuda/uvm_table.cu: a
            # query reads both); the two are strided views of the pairs
            self._links = self._alloc((self.num_slots + 1, 2), np.uint32)
            self._gpu_row = self._links[:, 0]
            self._hits = self._links[:, 1]
            self._gpu_vecs = self._alloc(*self._row_array(max(self.gpu_rows, 1)))
            self._owner = self._alloc((max(self.gpu_rows, 1),), np.uint32)
            self._clock = self._alloc((2,), np.uint64)  # the hand; rows promoted on lookups
            with self._stream:
                self._clock.fill(0)
                self._gpu_row.fill(NO_ROW)
                self._hits.fill(0)
                self._gpu_vecs.fill(0)
                self._owner.fill(NO_ROW)
                compile_pass_kernels(self._cp)
            self._stream.synchronize()
        self._gpu_row_ptr = int(self._gpu_row.data.ptr)
        self._gpu_vecs_ptr = int(self._gpu_vecs.data.ptr)
        self._hits_ptr = int(self._hits.data.ptr)
        self._owner_ptr = int(self._owner.data.ptr)
        self._clock_ptr = int(self._clock.data.ptr)
        self.promote_on_lookup = bool(promote_on_lookup) and self.gpu_rows > 0
        self._pass_busy = False  # a pass chooses moves: lookups do not promote meanwhile
        self._moves_done: Any = None  # the last pass's moves, for lookup promotions to follow
        self._placed = 0  # GPU rows handed out in build order
        self.grouped_reads_from = max(1, int(grouped_reads_from))
        self._region_shift = region_shift(self.num_slots + 1, self._row_bytes,
                                          read_region_bytes)
        self._regions = ((self.num_slots + 1) >> self._region_shift) + 1
        self._read_lists: weakref.WeakKeyDictionary[QueryWorkspace, HostReadLists] = \
            weakref.WeakKeyDictionary()
        self._grouped: dict[int, tuple[Any, ...]] = {}  # out type → bound launches
        self._grouped_generation = -1
        self._pass_lock = threading.Lock()  # one pass at a time
        self._lookups = self._seen_lookups = self._seen_promoted = 0
        self.passes = 0
        self.moved = 0
        self._promoter: PeriodicTask | None = None
        if promotion_interval > 0 and self.gpu_rows > 0:
            self._promoter = PeriodicTask(f"hps-uvm-promote-{device_id}", promotion_interval,
                                          self._background_pass, log=log)

    # -- memory ---------------------------------------------------------------------------

    @staticmethod
    def index_bytes(num_keys: int, load_factor: float = DEFAULT_LOAD_FACTOR) -> int:
        """GPU bytes of the index of num_keys keys: slots × (key 8 + GPU row link 4 +
        hits 4), plus the special slot and flags."""
        slots = _num_buckets(max(int(num_keys), 1), load_factor) * SET_SIZE
        return slots * 8 + (slots + 1) * 8 + 64

    @staticmethod
    def gpu_row_bytes(dim: int, storage: str | StorageType = FLOAT32) -> int:
        """GPU bytes of one hot row: the stored row (hps/rows/gpu_layout.py) and its owner
        link."""
        return stored_row_bytes(dim, table_storage(storage)) + 4

    @classmethod
    def device_bytes_required(cls, num_keys: int, dim: int, gpu_rows: int,
                              load_factor: float = DEFAULT_LOAD_FACTOR,
                              storage: str | StorageType = FLOAT32) -> int:
        """GPU bytes of a uvm table: the index and gpu_rows hot rows."""
        return cls.index_bytes(num_keys, load_factor) + max(int(gpu_rows), 1) * \
            cls.gpu_row_bytes(dim, storage)

    @staticmethod
    def host_bytes_required(num_keys: int, dim: int,
                            load_factor: float = DEFAULT_LOAD_FACTOR,
                            storage: str | StorageType = FLOAT32) -> int:
        """Pinned host bytes of a uvm table: a stored row per slot and the special
        slot's."""
        slots = _num_buckets(max(int(num_keys), 1), load_factor) * SET_SIZE
        return (slots + 1) * stored_row_bytes(dim, table_storage(storage))

    def _memory_bytes(self) -> int:
        return self.device_bytes_required(self.num_keys, self.dim, self.gpu_rows,
                                          self.load_factor, self.storage)

    def memory_stats(self) -> dict[str, Any]:
        """memory_bytes (GPU), host_memory_bytes (pinned) and host_memory_kind (see
        hps/gpu/host_memory.py), gpu_rows, gpu_rows_used, promotion passes and rows moved
        so far (by passes; rows_promoted_on_lookup: by lookups)."""
        return {"memory_bytes": self._memory_bytes(),
                "host_memory_bytes": self.host_bytes_required(self.num_keys, self.dim,
                                                              self.load_factor, self.storage),
                "host_memory_kind": self._host_mem.kind if self._host_mem else "",
                "gpu_rows": self.gpu_rows, "gpu_rows_used": self.gpu_rows_used(),
                "promotion_passes": self.passes, "rows_moved": self.moved,
                "rows_promoted_on_lookup": self.lookup_promotions()}

    def _alloc_rows(self) -> Any:
        """Every slot's row in pinned, device-mapped host memory (hps/gpu/host_memory.py),
        zeroed, as a CuPy array over the mapped device pointer: kernels read and write it
        directly."""
        cp = self._cp
        shape, dtype = self._row_array(self.num_slots + 1)
        nbytes = shape[0] * shape[1] * np.dtype(dtype).itemsize
        mem = MappedHostMemory(cp, nbytes, huge_pages=self.huge_pages)
        self._host_mem = mem
        self._host_rows_view = mem.view(dtype).reshape(shape)
        memory = cp.cuda.UnownedMemory(mem.device_ptr, mem.nbytes, mem, self.device_id)
        return cp.ndarray(shape, dtype=dtype, memptr=cp.cuda.MemoryPointer(memory, 0))

    def _free_extra(self) -> None:
        self._links = self._gpu_row = self._hits = self._gpu_vecs = self._owner = None
        self._clock = self._host_rows_view = None
        if self._host_mem is not None:
            self._host_mem.close()
            self._host_mem = None

    # -- kernels' arguments ---------------------------------------------------------------

    def _fixed_query_params(self, ws: QueryWorkspace) -> dict[int, float]:
        return {**super()._fixed_query_params(ws), 13: self._gpu_row_ptr,
                14: self._gpu_vecs_ptr, 15: self._hits_ptr}

    def _enqueue(self, keys_ptr: int, n: int, out_ptr: int, default: float,
                 ws: QueryWorkspace, stream_ptr: int, out_type: int, event_ptr: int) -> None:
        self._lookups += 1  # under the lock; a background pass runs only when this moved
        if n < self.grouped_reads_from:
            super()._enqueue(keys_ptr, n, out_ptr, default, ws, stream_ptr, out_type,
                             event_ptr)
        else:
            self._enqueue_grouped(keys_ptr, n, out_ptr, default, ws, stream_ptr, out_type)
            self._rt.eventRecord(event_ptr, stream_ptr)

    def _lists_for(self, ws: QueryWorkspace, n: int) -> HostReadLists:
        """ws's grouped-read buffers, grown to n keys (the lock held, the device
        current)."""
        lists = self._read_lists.get(ws)
        if lists is None or lists.capacity < n:
            if lists is not None:  # this workspace's last query may still use them: its
                self._rt.eventSynchronize(ws.event_ptr)  # event, not the whole device
            lists = HostReadLists(self._cp, max(n, 2 * (lists.capacity if lists else 0)),
                                   self._regions)
            self._cp.cuda.get_current_stream().synchronize()  # zeroed before any query
            self._read_lists[ws] = lists
        return lists

    def _grouped_launches(self, out_type: int) -> tuple[Any, ...]:
        """The four kernels of a grouped query writing out_type and the promotion after
        it (see cuda/uvm_table.cu)."""
        if self._grouped_generation != self._generation:
            self._grouped = {}
            self._grouped_generation = self._generation
        launches = self._grouped.get(out_type)
        if launches is None:
            launches = (*(kernels.Launch(self._kernel(name, out_type), signature)
                          for name, signature in _GROUPED_KERNELS),
                        kernels.Launch(self._kernel("uvm_promote_read_rows", out_type),
                                       _PROMOTE_SIGNATURE))  # last
            self._grouped[out_type] = launches
        return launches

    def _enqueue_grouped(self, keys_ptr: int, n: int, out_ptr: int, default: float,
                         ws: QueryWorkspace, stream_ptr: int, out_type: int) -> None:
        """The query with its host reads grouped by region (the lock held, the device
        current, ws reserved): four launches on the stream, the last publishing the miss
        count; then the promotion of the rows read, where _may_promote allows it."""
        lists = self._lists_for(ws, n)
        listed, by_pos, order_slots, order_positions, counts, starts = lists.ptrs
        query, scan, scatter, gather, promotion = self._grouped_launches(out_type)
        vec4 = int(self._out_dim_vec[out_type] and out_ptr % 16 == 0)
        shift = self._region_shift
        keys_per_block = self._unroll * (32 // self._group) * (BLOCK // 32)
        blocks = -(-n // keys_per_block)
        if self._waves:
            blocks = min(blocks, self._sms * self._waves)
        query(blocks, BLOCK, stream_ptr, keys_ptr, n, self._keys_ptr, self._vecs_ptr,
              self.num_sets, self._flags_ptr, out_ptr, vec4, ws.ctl_ptr, ws.host_ptr,
              ws.positions_ptr, ws.keys_ptr, default, self._gpu_row_ptr, self._gpu_vecs_ptr,
              self._hits_ptr, by_pos, counts, shift)
        scan(1, SCAN_BLOCK, stream_ptr, counts, starts, self._regions, listed)
        scatter(min(-(-n // BLOCK), self._sms * 16), BLOCK, stream_ptr, n, by_pos, starts,
                shift, order_slots, order_positions)
        promoting = self._may_promote(stream_ptr)
        gather(min(-(-(n * self._group) // BLOCK), self._sms * 16), BLOCK, stream_ptr, listed,
               order_slots, order_positions, self._vecs_ptr, out_ptr, vec4, ws.ctl_ptr,
               ws.host_ptr, int(not promoting))
        if promoting:  # publishes the miss count in the gather's stead
            self._enqueue_promotion(promotion, lists, n, stream_ptr, out_ptr, ws)

    def _enqueue_promotion(self, launch: Any, lists: HostReadLists, n: int, stream_ptr: int,
                           out_ptr: int, ws: QueryWorkspace) -> None:
        """The promotion (`launch`: uvm_promote_read_rows, bound) of the host rows the
        grouped query on ws just read (the lock held, the device current, _may_promote
        true), copied from its output rows where promote_from_output allows it (see
        cuda/uvm_table.cu); it then publishes the query's miss count (the caller returns
        only once nothing reads its output any more)."""
        listed, _, order_slots, order_positions, _, _ = lists.ptrs
        moves = self._moves_done
        if moves is not None and not moves.done:  # the last pass's links come first
            self._rt.streamWaitEvent(stream_ptr, moves.ptr, 0)
        budget = max(1, min(self.gpu_rows, n) // 32)  # whole windows of 32 rows each
        launch(min(-(-n * 32 // BLOCK), self._sms * 16), BLOCK, stream_ptr, listed, n,
               order_slots, budget, MIN_HITS, self._vecs_ptr, self._gpu_row_ptr,
               self._hits_ptr, self._gpu_vecs_ptr, self._owner_ptr, self.gpu_rows,
               self._clock_ptr, order_positions, out_ptr, int(self.promote_from_output),
               ws.ctl_ptr, ws.host_ptr)
        self._rt.eventRecord(lists.promoted.ptr, stream_ptr)
        self._write_event = lists.promoted  # later queries and writes come after it

    def _may_promote(self, stream_ptr: int) -> bool:
        """Whether a grouped query on stream_ptr may promote its rows (the lock held): no
        query on another stream is in flight (it may read a victim's row) and no pass is
        choosing moves (it would move rows the promotion gave away)."""
        key = stream_key(stream_ptr, self.device_id)
        return self.promote_on_lookup and not self._pass_busy and all(
            same_stream(other, key) for other in self._inflight.values())

    def lookup_promotions(self) -> int:
        """Rows promoted on the lookup path so far (0 once closed)."""
        with self._lock:
            if self._closed:
                return 0
            with self._device:
                self._wait_for_writes(self._stream.ptr)
                return int(self._clock[1:2].get(stream=self._stream)[0])

    def _update_args(self, keys: Any, n: int, vectors: Any, updated: Any) -> tuple[Any, ...]:
        return (*super()._update_args(keys, n, vectors, updated), self._gpu_row,
                self._gpu_vecs)

    def _after_build(self, keys: Any, n: int) -> None:
        """Initial placement in build order (uvm_place); keys built again get their GPU
        copies rewritten."""
        self._kernel("uvm_place")(
            (kernels.grid(self.device_id, n * self._group, BLOCK),), (BLOCK,),
            (keys, np.int64(n), np.int64(self._placed), np.uint32(self.gpu_rows), self._keys,
             self._vecs, np.uint32(self.num_sets), self._flags, self._gpu_row, self._gpu_vecs,
             self._owner),
        )
        self._placed = min(self.gpu_rows, self._placed + n)

    def build(self, keys: Any, vectors: Any) -> int:
        """StaticEmbeddingTable.build, then the initial placement (see _after_build); not
        while a promotion pass chooses rows."""
        with self._pass_lock:
            return super().build(keys, vectors)

    def seed_hits(self, keys: Any, counts: Any) -> None:
        """Sets the access counts of the keys held (others are skipped), e.g. from known
        access statistics, so the next pass places rows by them. counts: uint32 [n]."""
        keys = self._device_keys(keys)
        n = int(keys.shape[0])
        if n == 0:
            return
        with self._device:
            counts = self._cp.asarray(counts, dtype=np.uint32).reshape(-1)
        if int(counts.shape[0]) != n:
            raise LookupInputError(f"counts must have {n} entries, got {counts.shape[0]}")
        with self._writing(keys, counts):
            self._kernel("uvm_seed_hits")(
                (kernels.grid(self.device_id, n * self._group, BLOCK),), (BLOCK,),
                (keys, counts, np.int64(n), self._keys, np.uint32(self.num_sets),
                 self._flags, self._hits),
            )

    # -- promotion ------------------------------------------------------------------------

    def _background_pass(self) -> None:
        if self._lookups == self._seen_lookups:  # only while lookups come
            return
        self._seen_lookups = self._lookups
        promoted = self.lookup_promotions()
        if promoted == self._seen_promoted:
            # a full pass on every tick: backing off to every 2nd, 4th, ... 32nd tick while
            # passes moved nothing gained nothing measurable (1M power-law keys within
            # noise, H100 and H200; docs/benchmarks.md)
            self.promote()
            return
        # lookups placed rows since the last pass: the counts only decay (a pass's moves
        # would fight theirs, and lookups that promote wait for a pass's copies)
        self._seen_promoted = promoted
        with self._pass_lock, self._lock:
            if self._closed:
                return
            with self._device, self._stream:
                self._cp.right_shift(self._hits, 1, out=self._hits)
            self.passes += 1

    def promote(self) -> int:
        """One promotion pass (see the module docstring); returns the rows moved. Queued on
        the table's stream: lookups on other streams go on meanwhile."""
        with self._pass_lock:
            if self._closed or self.gpu_rows == 0:
                return 0
            cp = self._cp
            with self._device, self._stream:
                with self._lock:
                    if self._closed:
                        return 0
                    self._pass_busy = True
                    self._wait_for_writes(self._stream.ptr)  # lookups' promotions first
                try:
                    moves = choose_moves(self._cp, self._hits, self._gpu_row,
                                         self._owner[: self.gpu_rows], self.max_moves)
                    with self._lock:
                        if self._closed:
                            return 0
                        moved = self._enqueue_moves(*moves) if moves is not None else 0
                        cp.right_shift(self._hits, 1, out=self._hits)
                        done = cp.cuda.Event(block=False, disable_timing=True)
                        done.record(self._stream)
                        self._moves_done = done
                finally:
                    with self._lock:
                        self._pass_busy = False
                # outside the lock: lookups enqueue meanwhile; `moves` lives until here
                self._stream.synchronize()
            self.passes += 1
            self.moved += moved
            return moved

    def _enqueue_moves(self, promoted: Any, rows: Any, demoted: Any) -> int:
        """Queues a move on the table's stream (the lock held, the device and the stream
        current): unlink the demoted slots and make later queries wait for that; then,
        after the queries in flight, fill the rows and link the promoted slots."""
        cp = self._cp
        stream = self._stream
        m = int(promoted.shape[0])
        if demoted.size:
            self._kernel("uvm_demote")(
                (kernels.grid(self.device_id, int(demoted.size), BLOCK),), (BLOCK,),
                (demoted, np.int64(demoted.size), self._gpu_row))
            unlinked = cp.cuda.Event(block=False, disable_timing=True)
            unlinked.record(stream)
            self._write_event = unlinked  # queries from now on read the host rows
        self._after_queries(stream.ptr)  # queries that may still read the old links
        self._kernel("uvm_fill")(
            (kernels.grid(self.device_id, m * self._row_units, BLOCK),), (BLOCK,),
            (promoted, rows, np.int64(m), self._vecs, self._gpu_vecs))
        self._kernel("uvm_publish")(
            (kernels.grid(self.device_id, m, BLOCK),), (BLOCK,),
            (promoted, rows, np.int64(m), self._gpu_row, self._owner))
        return m

    def gpu_rows_used(self) -> int:
        """GPU rows holding a key's copy."""
        with self._lock:
            self._check_open()
            with self._device:
                owner = self._owner[: self.gpu_rows]
                self._wait_for_writes(self._stream.ptr)  # lookups' promotions
                with self._stream:
                    used = int(self._cp.count_nonzero(owner != NO_ROW))
                return used

    def state(self) -> dict[str, np.ndarray]:
        """Host copies of the placement (for tests): slot keys [slots], gpu_row and hits
        [slots + 1], owner [gpu_rows], host rows [slots + 1, dim] and GPU rows
        [gpu_rows, dim]."""
        with self._lock:
            self._check_open()
            with self._device:
                self._wait_for_writes(self._stream.ptr)  # lookups' promotions
                self._stream.synchronize()
                s = self._stream
                assert self._host_rows_view is not None
                return {
                    "keys": self._keys.get(stream=s),
                    "gpu_row": self._gpu_row.get(stream=s),
                    "hits": self._hits.get(stream=s),
                    "owner": self._owner.get(stream=s)[: self.gpu_rows],
                    "host_rows": decode_rows(self._host_rows_view, self.dim, self.storage),
                    "gpu_rows": decode_rows(self._gpu_vecs.get(stream=s)[: self.gpu_rows],
                                            self.dim, self.storage),
                    "special": bool(self._flags.get(stream=s)[0]),
                }

    def close(self) -> None:
        """Stops the promotion task, waits for work in flight, frees GPU and pinned host
        memory. Idempotent."""
        if self._promoter is not None:
            self._promoter.close(timeout=30)
        with self._pass_lock:  # a pass from another thread finishes first
            with self._lock:
                last = self._write_event  # a lookup's promotion may still run
                if last is not None and not self._closed:
                    last.synchronize()
            super().close()
