"""A device's hot copy: the heaviest rows of the shards its peers hold, kept on it, which
a sharded table's one pass reads before it crosses the link (`gpu_hot_rows`).

Why. A pulled row of a peer's shard costs two round trips over NVLink (its bucket, then
its row), and a pushed one a posted write of every row however often the batch repeats
it: on two H200s 1M power-law keys (Zipf 1.1 over 4M) ran at 0.51-0.54 of the link bound,
where one GPU re-reads its hot rows from its own L2 (docs/gpu-cache.md "What was tried on
1M all-hit batches" has the kernel times). Under Zipf 1.1 over 4M keys the 64K heaviest
keys take 87% of the lookups, so a few MB of copies take most of a skewed batch off the
link (HugeCTR's hybrid embedding kept its frequent categories on every GPU for the same
reason).

What it is: a StaticEmbeddingTable on the device, at load factor HOT_LOAD_FACTOR, filled
with the rows of given keys (`ShardedTable.replicate_hot`: the keys a user knows are hot,
or the table's hot-key sketch's heaviest) that live on other devices. The one pass's
shards' array on the device carries it after the shards (cuda/hps_common.cuh hps_shard),
and the kernel (cuda/static_table.cu static_round_keys) reads one bucket of it for each
key of a remote shard in batches of more than SMALL_BATCH keys: a key found there is
read here; any other key, one past its first bucket included, is read where it lives. A
pushed query's launch on a peer reads a mirror of the copy's index there (written by the
same fill) and leaves the keys it holds to the caller's launch. So the copy only decides
where a row is read, never what: its rows are the shards' rows.

Measured (two H200s, `hps bench gpu --profile sharded`, docs/gpu-cache.md): 1M power-law
keys at 0.83-0.94 of the link bound with the 64K heaviest keys copied, 0.50 without.

Exact: the copy's rows are read from the shards (widened to float32 and stored again in
the same storage type: the same bits for float32, float16 and bfloat16; int8 tables get
no copy), and every update and insert of the table writes the copies as well as the
shards (ShardedTable, under its write lock, which a fill holds too, so no update falls
between a fill's read and its build). The copy is a table of its own: the one pass holds
it (its lock, its gate) like a shard, so a fill or an update of it waits for the queries
reading it, and later queries wait for it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from hps.gpu import kernels
from hps.gpu.kernels import EMPTY_KEY
from hps.gpu.launch_shape import BLOCK
from hps.gpu.shard_routing import shard_of
from hps.gpu.static_table import StaticEmbeddingTable, num_slots
from hps.rows.storage_types import INT8, StorageType

#: keys a device's hot copy holds by default (the model's `gpu_hot_rows`): Zipf 1.1 over 4M
#: keys puts 87% of lookups on the 64K heaviest; 34 MB a device at dim 64, float32
HOT_ROWS = 1 << 16
#: batches of up to this many keys read no copy (cuda/static_table.cu PROBE_AHEAD_KEYS:
#: latency-bound, they wait for their slowest key, which the copy does not speed up)
SMALL_BATCH = 1 << 16
#: the copy's load factor: a key past its first bucket is read from its owner, and at 0.5
#: few are (at 0.8, buckets of 8 fill often)
HOT_LOAD_FACTOR = 0.5


def hot_copy_applies(kind: str, storage: StorageType, rows: int) -> bool:
    """Whether shards of this table kind and storage take hot copies of `rows` keys: static
    shards (a cache's rows come and go with its misses) not stored as int8 (re-encoding
    its rows is not bit-exact)."""
    return kind == "static table" and storage != INT8 and rows > 0


def hot_copy_bytes(rows: int, dim: int, storage: StorageType | str, devices: int) -> int:
    """Device bytes one device of `devices` holds for the hot copies of `rows` keys: its
    copy and the mirrors of its peers' copies' indexes."""
    copy = StaticEmbeddingTable.memory_required(rows, dim, HOT_LOAD_FACTOR, storage)
    return copy + (devices - 1) * num_slots(rows, HOT_LOAD_FACTOR) * 8


class HotRows:
    """Device `device_id`'s hot copy (see the module docstring) of up to `capacity` keys of
    the shards numbered `remote` (those on other devices) among `num_shards`."""

    def __init__(self, device_id: int, capacity: int, dim: int, storage: StorageType,
                 num_shards: int, remote: list[int], peers: list[int]) -> None:
        cp = kernels.cupy_module()
        self.device_id = device_id
        self.capacity = int(capacity)
        self.num_shards = num_shards
        self.remote = remote
        self.table = t = StaticEmbeddingTable(self.capacity, dim, device_id,
                                              load_factor=HOT_LOAD_FACTOR, storage=storage)
        # the copy's index on each peer (a pushed query's launch there skips its keys)
        self._mirrors: dict[int, Any] = {}
        for peer in peers:
            with cp.cuda.Device(peer):
                self._mirrors[peer] = cp.full(t.num_slots, EMPTY_KEY, np.int64)
        #: the keys the copy was last filled with (a refresh fills it again)
        self.keys = np.empty(0, np.int64)
        self._arrays: dict[int, Any] = {}  # the one pass's shards' arrays, by device

    def entry(self, device: int) -> list[int]:
        """The row of the shards' array on `device` (cuda/hps_common.cuh hps_shard) after
        the shards: on this device the copy, on a peer its mirror (no rows); no sets until
        it is filled, so an empty copy costs the kernel nothing."""
        t = self.table
        if device == self.device_id:
            return [t._keys_ptr, 0, t._vecs_ptr, 0, t._flags_ptr, 0]
        return [int(self._mirrors[device].data.ptr), 0, 0, 0, 0, 0]

    def attach(self, arrays: dict[int, Any]) -> None:
        """The one pass's shards' arrays (device: array), whose entry `num_shards` a fill
        sets."""
        self._arrays = arrays

    def fill(self, keys: Any, rows: Any) -> int:
        """The copy holds these keys (CuPy int64 [n] on this device, distinct, none
        EMPTY_KEY, heaviest first) with their rows (float32 [n, dim]) and nothing else:
        one write, ordered after the queries reading it; later ones read the new copy.
        Returns the keys it holds (those past `capacity` are left out)."""
        t, cp = self.table, kernels.cupy_module()
        n = min(int(keys.shape[0]), self.capacity)
        keys, rows = keys[:n], rows[:n]
        sets = cp.array([t.num_sets if n else 0], np.int64)
        with t._writing(keys, rows, sets):
            t._keys.fill(EMPTY_KEY)
            t._flags.fill(0)
            if n:
                t._kernel("static_build")(
                    (kernels.grid(self.device_id, n * t._group, BLOCK),), (BLOCK,),
                    (keys, np.int64(n), rows, t._vec4(rows), t._keys, t._vecs,
                     np.uint32(t.num_sets), t._flags))
            # the index to the mirrors, then the sets into every entry: the kernels read
            # the copy from now on (none: not at all)
            stream = t._stream
            for mirror in self._mirrors.values():
                mirror.data.copy_from_device_async(t._keys.data, t._keys.nbytes, stream)
            for array in self._arrays.values():
                at = array.data + (self.num_shards * 6 + 3) * 8  # entry num_shards's sets
                at.copy_from_device_async(sets.data, 8, stream)
        with t._lock, t._device:
            held = int(t._flags[1:2].get(stream=t._stream)[0])
        self.keys = cp.asnumpy(keys)
        return held

    def update(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """The rows of the keys the copy holds (host arrays; others skipped), as a shard's
        update: returns the keys it held."""
        if not self.keys.size or not keys.size:
            return 0
        return int(self.table.update(keys, vectors))

    def memory_bytes(self) -> int:
        return self.table.memory_bytes() + sum(m.nbytes for m in self._mirrors.values())

    def stats(self) -> dict[str, Any]:
        return {"device": self.device_id, "capacity": self.capacity,
                "keys": int(self.keys.size), "memory_bytes": self.memory_bytes()}

    def close(self) -> None:
        self.table.close()


class HotCopies:
    """A sharded table's hot copies (`on(device)`: one for each device with shards of its
    peers to copy, where `hot_copy_applies`) and the lock that orders their fills after
    and before the table's writes: ShardedTable holds `lock` over each update, insert and
    refresh of its shards and copies, so a fill never reads a row that a write then
    changes before the fill builds it."""

    def __init__(self, shards: list[Any], rows: int) -> None:
        self.lock = threading.RLock()
        self._shards = shards
        self._copies: dict[int, HotRows] = {}
        # what the background filler (hps/server/hot_fill.py) keeps between its looks: the
        # keys the copies were last offered (sorted), when (time.monotonic()), the hot
        # sketch's weight counted then, and the keys a reload's new version starts from
        self.offered = np.empty(0, np.int64)
        self.filled_at: float | None = None
        self.sketch_total = -1
        self.seed: np.ndarray | None = None
        first = shards[0]._table
        devices = sorted({s.device_id for s in shards})
        if len(devices) < 2 or not hot_copy_applies(first._kind, first.storage, rows):
            return
        try:
            for device in devices:
                remote = [s for s, shard in enumerate(shards) if shard.device_id != device]
                self._copies[device] = HotRows(device, rows, first.dim, first.storage,
                                               len(shards), remote,
                                               [d for d in devices if d != device])
        except BaseException:
            self.close()
            raise

    def on(self, device: int) -> HotRows | None:
        """`device`'s hot copy (None: it has none)."""
        return self._copies.get(device)

    def __bool__(self) -> bool:
        return bool(self._copies)

    def replicate(self, keys: np.ndarray) -> dict[int, int]:
        """Each device's copy holds the rows of `keys` (host int64, heaviest first: those
        past its capacity are left out) that its peers' shards hold, and nothing else;
        returns the keys each device's copy holds."""
        keys = np.ascontiguousarray(keys, np.int64).reshape(-1)
        _, first = np.unique(keys, return_index=True)  # each key once, order kept
        keys = keys[np.sort(first)]
        keys = keys[keys != EMPTY_KEY]  # its special slot is not probed by the copy
        owner = shard_of(keys, len(self._shards))
        with self.lock:
            self.offered = np.sort(keys)
            self.filled_at = time.monotonic()
            return {device: self._fill(hot, keys[np.isin(owner, hot.remote)], owner[
                np.isin(owner, hot.remote)]) for device, hot in self._copies.items()}

    def refill(self) -> None:
        """Each copy filled again with its keys' rows (after a refresh of the shards)."""
        with self.lock:
            for hot in self._copies.values():
                self._fill(hot, hot.keys, shard_of(hot.keys, len(self._shards)))

    def _fill(self, hot: HotRows, keys: np.ndarray, owner: np.ndarray) -> int:
        """`hot` filled with the rows of `keys` (of shards `owner`) that their shards hold
        (each shard's query on its device, its misses left out), the heaviest `capacity`."""
        cp = kernels.cupy_module()
        keys, owner = keys[:hot.capacity], owner[:hot.capacity]
        held_keys, held_rows = [np.empty(0, np.int64)], [np.empty((0, hot.table.dim),
                                                                    np.float32)]
        for s in hot.remote:
            mine = keys[owner == s]
            if not mine.size:
                continue
            table = self._shards[s]._table
            with cp.cuda.Device(table.device_id):
                rows = cp.empty((mine.size, table.dim), np.float32)
                missed, count = table.query(cp.asarray(mine), rows)
                found = np.ones(mine.size, bool)
                found[cp.asnumpy(missed[:count])] = False
                held_keys.append(mine[found])
                held_rows.append(cp.asnumpy(rows)[found])
        with cp.cuda.Device(hot.device_id):
            return hot.fill(cp.asarray(np.concatenate(held_keys)),
                            cp.asarray(np.concatenate(held_rows)))

    def update(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """The rows of the keys each copy holds (host arrays: a write of the table's,
        under `lock`, after its shards took it)."""
        for hot in self._copies.values():
            hot.update(keys, vectors)

    def stats(self) -> list[dict[str, Any]]:
        return [hot.stats() for hot in self._copies.values()]

    def memory_bytes(self) -> int:
        return sum(hot.memory_bytes() for hot in self._copies.values())

    def close(self) -> None:
        for hot in self._copies.values():
            hot.close()
