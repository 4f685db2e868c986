"""Where a table lives in Redis, and the bytes of its keys and rows: HugeCTR's layout.

HugeCTR's `RedisClusterBackend` (HugeCTR/src/hps/redis_backend.cpp, v23–v24.06) names a
partition's hashes with

    make_hkey(table_name, part, suffix) = "hps_et{" + table_name + "/p" + part + "}" + suffix

and `HierParameterServer::update_database_per_model` passes as `table_name` the tag
`HierParameterServerBase::make_tag_name(model, table)` = "hps_et.<model>.<table>". So the
tag inside the braces is the whole storage name, prefix included:

    hps_et{hps_et.<model>.<table>/p<N>}v    fields: raw 8-byte little-endian keys
                                            values: raw float32 rows (dim × 4 bytes)
    hps_et{hps_et.<model>.<table>/p<N>}t    eviction metadata, same fields:
                                            evict_least_used: access count, ASCII decimal
                                              (HugeCTR bumps it with HINCRBY, 1 per insert
                                              and per fetch)
                                            evict_oldest: time_t seconds, raw 8 bytes LE
                                            evict_random: no metadata

    hps_et{hps_et.<model>.<table>/p<N>}m    this server's marker (a string, "1"): written
                                            when the table is created, before its rows,
                                            so a partition whose marker is gone lost its
                                            rows (a restart without persistence, FLUSHALL,
                                            a failover to an empty replica); HugeCTR
                                            ignores it

with N = rrxmrrxmsx_0(key) % num_partitions (`hps.tiers.partition`). The braces make Redis
Cluster hash only "<tag>/p<N>", so every key of a partition lives on one node.

Requests are RESP packed with NumPy (a fixed-width record per key), never built key by key
in Python; replies are decoded with `b"".join` + `np.frombuffer`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hps.tiers.contract import TABLE_PREFIX
from hps.tiers.partition import partition_of

NUM_SLOTS = 16384
KEY_BYTES = 8
FIELD_WIDTH = 14  # b"$8\r\n" + 8 key bytes + b"\r\n"

# HugeCTR pipelines one HINCRBY per key; one script call per partition chunk writes the
# same counters (ASCII integers in the `t` hash) without a reply per key.
LFU_SCRIPT = b"for i=1,#ARGV do redis.call('HINCRBY',KEYS[1],ARGV[i],1) end return #ARGV"


def value_hash(table: str, partition: int) -> str:
    """Name of the hash holding the rows of `partition` of `table` (HugeCTR's layout)."""
    return f"{TABLE_PREFIX}{{{table}/p{partition}}}v"


def meta_hash(table: str, partition: int) -> str:
    """Name of the companion hash with the eviction metadata of the same partition."""
    return f"{TABLE_PREFIX}{{{table}/p{partition}}}t"


def marker_key(table: str, partition: int) -> str:
    """Name of the marker that says this partition's rows were not lost since written."""
    return f"{TABLE_PREFIX}{{{table}/p{partition}}}m"


# -- RESP packing ---------------------------------------------------------------------------


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def head(num_args: int, *leading: bytes) -> bytes:
    """RESP array header for a command of `num_args` arguments, with its leading ones."""
    return b"*%d\r\n" % num_args + b"".join(_bulk(a) for a in leading)


def command(*args: bytes) -> bytes:
    return head(len(args), *args)


def _key_bytes(keys: np.ndarray) -> np.ndarray:
    """uint8[n, 8]: the keys as raw little-endian int64, HugeCTR's field format."""
    return np.ascontiguousarray(keys, dtype="<i8").view(np.uint8).reshape(-1, KEY_BYTES)


_FIELD_TEMPLATE = np.frombuffer(b"$8\r\n" + bytes(8) + b"\r\n", dtype=np.uint8)


def pack_fields(keys: np.ndarray) -> np.ndarray:
    """uint8[n * 14]: the keys as consecutive RESP bulk strings, one fixed record each."""
    out = np.empty((keys.size, FIELD_WIDTH), dtype=np.uint8)
    out[:] = _FIELD_TEMPLATE
    out[:, 4:12] = _key_bytes(keys)
    return out.reshape(-1)


def pack_pairs(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, int]:
    """(uint8[n * width], width): field/value pairs as RESP bulk strings.

    `values` is uint8[n, L]: every value has the same length, so every pair is a record of
    the same width and the whole request is one strided NumPy fill.
    """
    n, length = values.shape
    vhead = np.frombuffer(b"$%d\r\n" % length, dtype=np.uint8)
    width = FIELD_WIDTH + vhead.size + length + 2
    out = np.empty((n, width), dtype=np.uint8)
    out[:, :FIELD_WIDTH] = _FIELD_TEMPLATE
    out[:, 4:12] = _key_bytes(keys)
    at = FIELD_WIDTH
    out[:, at:at + vhead.size] = vhead
    at += vhead.size
    out[:, at:at + length] = values
    out[:, -2] = 13
    out[:, -1] = 10
    return out.reshape(-1), width


def parse_keys(fields: Sequence[bytes]) -> np.ndarray:
    """int64 keys from raw 8-byte fields; fields of another length (not ours) are skipped."""
    if not fields:
        return np.empty(0, dtype=np.int64)
    data = b"".join(fields)
    if len(data) != KEY_BYTES * len(fields):
        ok = np.fromiter(map(len, fields), dtype=np.int64, count=len(fields)) == KEY_BYTES
        data = b"".join(np.asarray(fields, dtype=object)[ok].tolist())
    return np.frombuffer(data, dtype="<i8").astype(np.int64)


def _parse_times(values: Sequence[bytes]) -> np.ndarray:
    """HugeCTR's evict_oldest metadata: raw 8-byte time_t; anything else reads as 0."""
    n = len(values)
    data = b"".join(values)
    if len(data) == KEY_BYTES * n:
        return np.frombuffer(data, dtype="<i8").astype(np.int64)
    out = np.zeros(n, dtype=np.int64)
    ok = np.fromiter(map(len, values), dtype=np.int64, count=n) == KEY_BYTES
    out[ok] = np.frombuffer(b"".join(np.asarray(values, dtype=object)[ok].tolist()), dtype="<i8")
    return out


def _parse_counts(values: Sequence[bytes]) -> np.ndarray:
    """HugeCTR's evict_least_used metadata: ASCII decimal counts; anything else reads as 0."""
    out = np.zeros(len(values), dtype=np.int64)
    if not values:
        return out
    text = np.asarray(values, dtype=np.bytes_)
    ok = np.char.isdigit(text) & (np.char.str_len(text) <= 18)
    out[ok] = text[ok].astype(np.int64)
    return out


def eviction_scores(
    keys: np.ndarray, metadata: Sequence[bytes], policy: str
) -> tuple[np.ndarray, np.ndarray]:
    """(score per key, stale metadata keys) of one partition, from its HGETALL of `t`.

    Lower scores go first: the access count (evict_least_used) or the time
    (evict_oldest); keys without metadata score 0. Stale: keys with metadata but no row.
    """
    meta_keys = parse_keys(metadata[0::2])
    values = metadata[1::2]
    if meta_keys.size != len(values) or not values:  # none, or fields that are not keys
        return np.zeros(keys.size, dtype=np.int64), np.empty(0, dtype=np.int64)
    meta_score = _parse_counts(values) if policy == "evict_least_used" else _parse_times(values)
    sorter = np.argsort(meta_keys, kind="stable")
    meta_keys, meta_score = meta_keys[sorter], meta_score[sorter]
    at = np.minimum(np.searchsorted(meta_keys, keys), meta_keys.size - 1)
    score = np.where(meta_keys[at] == keys, meta_score[at], 0)
    stale = meta_keys[~np.isin(meta_keys, keys)]
    return score, stale


# -- keys grouped by partition --------------------------------------------------------------


@dataclass(frozen=True)
class Grouped:
    """Keys sorted by partition: `keys[i] == original[order[i]]`, partition p spans
    `starts[p]:starts[p + 1]`."""

    order: np.ndarray
    keys: np.ndarray
    starts: np.ndarray

    def chunks(self, max_batch: int) -> Iterator[tuple[int, int, int]]:
        """(partition, start, stop) of every non-empty partition, cut at `max_batch` keys.

        Loops over partitions and chunks, never over keys.
        """
        starts = self.starts
        for p in np.flatnonzero(np.diff(starts)).tolist():
            a, end = int(starts[p]), int(starts[p + 1])
            while a < end:
                b = min(a + max_batch, end)
                yield p, a, b
                a = b


def group_by_partition(keys: np.ndarray, num_partitions: int) -> Grouped:
    """`keys` sorted by partition (stable: equal partitions keep their order)."""
    parts = np.asarray(partition_of(keys, num_partitions), dtype=np.int64)
    order = np.argsort(parts, kind="stable")
    starts = np.zeros(num_partitions + 1, dtype=np.int64)
    np.cumsum(np.bincount(parts, minlength=num_partitions), out=starts[1:])
    return Grouped(order=order, keys=keys[order], starts=starts)


@dataclass(frozen=True)
class TableLayout:
    """Hash names and cluster slots of one table's partitions."""

    values: list[bytes]
    metas: list[bytes]
    markers: list[bytes]
    slots: np.ndarray


def table_layout(table: str, num_partitions: int) -> TableLayout:
    """The hash names and cluster slots of every partition of `table`."""
    from redis.crc import key_slot  # the redis extra: only a RedisTier calls this

    values = [value_hash(table, p).encode() for p in range(num_partitions)]
    metas = [meta_hash(table, p).encode() for p in range(num_partitions)]
    markers = [marker_key(table, p).encode() for p in range(num_partitions)]
    slots = np.array([key_slot(v) for v in values], dtype=np.int64)
    return TableLayout(values=values, metas=metas, markers=markers, slots=slots)
