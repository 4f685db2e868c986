"""The static table: a whole embedding table on one GPU, built once, then read-only.

`StaticEmbeddingTable(num_keys, dim, device_id, storage=...)` reserves open-addressing buckets of
SET_SIZE slots for `num_keys` keys at `load_factor` (0.8: on average 1.15 bucket reads per
lookup), with each row stored beside its key's slot (no indirection: one bucket read and
one row read per hit; rows stored as float32 or a compact storage type,
hps/rows/gpu_layout.py). `build(keys, vectors)` adds keys (float32 rows, encoded on the
device), chunk by chunk; after that the
table is only read (`query`), or its rows rewritten in place by a refresh (`update`).
Nothing is evicted: more than `num_keys` keys raise an error.

Queries share the dynamic cache's contract and streams (see hps/gpu/device_table.py): hits
written into the caller's rows, misses compacted on the device, one host wait for the
miss count. Kernels: cuda/static_table.cu.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hps.errors import LookupInputError
from hps.gpu import kernels
from hps.gpu.device_table import DeviceTable
from hps.gpu.kernels import SET_SIZE
from hps.gpu.launch_shape import BLOCK, default_group, default_unroll
from hps.gpu.workspace import QueryWorkspace
from hps.rows.gpu_layout import stored_row_bytes, table_storage
from hps.rows.storage_types import FLOAT32, StorageType

if TYPE_CHECKING:
    from hps.gpu.shared_cache import SharedTableRecord

DEFAULT_LOAD_FACTOR = 0.8
# Batches up to this many keys probe 4 buckets per step: the batch waits for its longest
# probe (about 12 buckets among 2,000 keys at load factor 0.8), and small batches have
# bandwidth to spare; larger batches probe one bucket per step.
SMALL_BATCH = 1 << 16
_WINDOW = 4


def _num_buckets(num_keys: int, load_factor: float) -> int:
    return max(1, -(-int(np.ceil(max(int(num_keys), 1) / load_factor)) // SET_SIZE))


def num_slots(num_keys: int, load_factor: float = DEFAULT_LOAD_FACTOR) -> int:
    """Slots of a static table of `num_keys` keys at `load_factor`."""
    return _num_buckets(num_keys, load_factor) * SET_SIZE


class TableFullError(LookupInputError):
    """More keys were built into a static table than it was sized for."""


class StaticEmbeddingTable(DeviceTable):
    """A read-only GPU hash table of `dim`-wide rows for up to `num_keys` keys, stored as
    `storage` (float32 by default)."""

    _kind = "static table"
    _source = "static_table.cu"
    _query_kernel = "static_query"
    _query_signature = "ptr i64 ptr ptr u32 ptr ptr i32 ptr ptr ptr ptr f32"
    _dump_kernel = "static_dump"
    _update_kernel = "static_update"

    def __init__(self, num_keys: int, dim: int, device_id: int = 0, *,
                 load_factor: float = DEFAULT_LOAD_FACTOR, group: int | None = None,
                 unroll: int | None = None, storage: str | StorageType = FLOAT32,
                 shared: SharedTableRecord | None = None) -> None:
        if num_keys < 1:
            raise LookupInputError(f"num_keys must be positive, got {num_keys}")
        if dim < 1:
            raise LookupInputError(f"dim must be positive, got {dim}")
        if not 0.1 <= load_factor <= 0.95:
            raise LookupInputError(f"load_factor must be in [0.1, 0.95], got {load_factor}")
        self.num_keys = int(num_keys)
        self.load_factor = float(load_factor)
        num_buckets = _num_buckets(num_keys, load_factor)
        if num_buckets >= 2**32:
            raise LookupInputError(f"num_keys {num_keys} is too large")
        super().__init__(dim, device_id, num_buckets,
                         group=group or default_group(dim), unroll=unroll or default_unroll(dim),
                         special_flags=3, storage=storage, shared=shared)

    @staticmethod
    def memory_required(num_keys: int, dim: int, load_factor: float = DEFAULT_LOAD_FACTOR,
                        storage: str | StorageType = FLOAT32) -> int:
        """Device bytes a static table of this many keys, width and storage type takes."""
        slots = _num_buckets(num_keys, load_factor) * SET_SIZE
        return slots * 8 + (slots + 1) * stored_row_bytes(dim, table_storage(storage)) + 64

    def _memory_bytes(self) -> int:
        return self.memory_required(self.num_keys, self.dim, self.load_factor, self.storage)

    @property
    def capacity(self) -> int:
        return self.num_keys

    _query_slots = (0, 1, 6, 7, 12)

    def _fixed_query_params(self, ws: QueryWorkspace) -> dict[int, float]:
        return {2: self._keys_ptr, 3: self._vecs_ptr, 4: self.num_sets, 5: self._flags_ptr,
                8: ws.ctl_ptr, 9: ws.host_ptr, 10: ws.positions_ptr, 11: ws.keys_ptr}

    _pipelined_kernel: str | None = "static_query_pipelined"

    def _query_kernels(self, out_type: int) -> list[tuple[int, Any, int, int]]:
        # batches up to SMALL_BATCH keys: PROBE_WINDOW buckets per probe step, one key per
        # lane group and round
        fn = self._fn.get(("small query", out_type))
        if fn is None:
            defines = {**self._defines, "PROBE_WINDOW": _WINDOW, "UNROLL": 1}
            fn = kernels.function(self._source, self._query_kernel, self.device_id,
                                  **self._out_defines(defines, out_type))
            self._fn[("small query", out_type)] = fn
        # larger ones: the pipelined kernel where it applies, else static_query
        pipelined = self._pipelined_query(out_type)
        larger = [pipelined] if pipelined is not None else super()._query_kernels(out_type)
        return [(SMALL_BATCH, fn, 1, 0), *larger]

    def _dump_args(self, start: int, stop: int, count: Any, out: Any) -> tuple[Any, ...]:
        return (self._keys, np.uint32(self.num_sets), np.uint32(start), np.uint32(stop),
                self._flags, count, out)

    def _after_build(self, keys: Any, n: int) -> None:
        """Queued right after each build kernel, in the same write (the uvm table places
        rows here)."""

    def insert_staged(self, keys_ptr: int, rows_ptr: int, n: int, ws: QueryWorkspace,
                      stream_ptr: int) -> None:
        """build() on device addresses (keys int64 [n], rows float32 [n, dim], contiguous),
        queued on the caller's stream `stream_ptr` (the device current), ordered after the
        queries in flight and the writes before it, later ones after it. The caller keeps
        the keys built under `num_keys` (no error is raised here: a key that finds no
        slot is counted in the flags and not held). The kernel runs on the workspace's
        device: the table's, or a peer that reaches its memory (a sharded table's)."""
        launch = kernels.Launch(self._kernel("static_build", device=ws.device_id),
                                "ptr i64 ptr i32 ptr ptr u32 ptr")
        with self._writing_on(stream_ptr, ws):
            launch(kernels.grid(ws.device_id, n * self._group, BLOCK), BLOCK, stream_ptr,
                   keys_ptr, n, rows_ptr, self._dim4 and rows_ptr % 16 == 0, self._keys_ptr,
                   self._vecs_ptr, self.num_sets, self._flags_ptr)

    def build(self, keys: Any, vectors: Any) -> int:
        """Adds keys with their rows (a key already present gets the new row; repeated
        keys in one batch leave one of their rows). Returns the keys held afterwards.
        Raises TableFullError when keys found no free slot (far more distinct keys than
        `num_keys`); those keys are not held, the others are.
        """
        keys = self._device_keys(keys)
        n = int(keys.shape[0])
        vectors = self._device_rows(vectors, n)
        if n:
            with self._writing(keys, vectors):
                self._kernel("static_build")(
                    (kernels.grid(self.device_id, n * self._group, BLOCK),), (BLOCK,),
                    (keys, np.int64(n), vectors, self._vec4(vectors), self._keys, self._vecs,
                     np.uint32(self.num_sets), self._flags),
                )
                self._after_build(keys, n)
        with self._lock, self._device:
            flags = self._flags.get(stream=self._stream)
        held, lost = int(flags[1]), int(flags[2])
        if lost:
            raise TableFullError(
                f"the static table was sized for {self.num_keys} keys but {held + lost} "
                f"distinct keys were built into it; size it for the whole table"
            )
        return held

