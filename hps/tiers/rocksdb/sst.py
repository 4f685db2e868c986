"""RocksDB table files (SST) written from arrays in compiled code, for bulk loads.

rocksdict's `SstFileWriter` takes one Python call and two new `bytes` objects per key
(about 1 µs of CPU per key, all of it under the GIL), which caps a bulk load near one
million keys per second however many cores there are. This module encodes a whole file
from sorted arrays in one numba kernel that releases the GIL, so files are built in
parallel and a key costs tens of nanoseconds.

What is written is the block-based table format that RocksDB's own `SstFileWriter`
writes with `format_version=2`, `checksum=kNoChecksum`, no compression and no filter:

    data blocks    entries `varint32 shared, varint32 unshared, varint32 value length,
                   key[shared:], value`, a restart point every RESTART_INTERVAL entries,
                   then the restart offsets (fixed32) and their count (fixed32); each
                   block followed by a 5-byte trailer (compression type 0, checksum 0)
    index block    one entry per data block: the internal key of its last key → the
                   block's handle (varint64 offset, varint64 size), restarts at every entry
    properties     the table properties, sorted by name (those an SstFileWriter writes,
                   among them rocksdb.external_sst_file.version = 2, which ingestion
                   requires)
    metaindex      "rocksdb.properties" → the properties block's handle
    footer         checksum type, metaindex and index handles padded to 40 bytes,
                   format_version (fixed32), the block-based table magic (fixed64)

Keys are the tier's user keys (the 8 raw little-endian bytes of an int64) followed by the
internal-key trailer of sequence number 0, type value (`01 00 00 00 00 00 00 00`), as an
SstFileWriter writes them; RocksDB gives ingested files their sequence number itself.
Keys must be distinct and sorted in bytewise order. A file without a filter block is
read like any other; a lookup of an absent key then reads one data block.

`tests/tiers/test_sst.py` checks the data and index blocks byte for byte against rocksdict's
own writer with the same options, and ingests the files into a live store.
"""

from __future__ import annotations

import secrets
import string
import struct

import numpy as np

from hps.runtime.compiled import array, copy_bytes, inlined, kernel, prefetch, types

FORMAT_VERSION = 2
MAGIC = 0x88E241B785F4CFF7
RESTART_INTERVAL = 16
#: data block size an entry is added to until reached (RocksDB's default block_size)
BLOCK_BYTES = 4096
KEY_BYTES = 8
#: internal key: user key + fixed64 (sequence 0 << 8 | type value 1)
INTERNAL_KEY_BYTES = KEY_BYTES + 8
_BLOCK_TRAILER = 5
#: rows between a prefetch and their copy into a block
_AHEAD = 8
_LINE_BYTES = 64
#: RocksDB closes a block early when it is past this size and the next entry would
#: take it over BLOCK_BYTES (block_size_deviation 10)
_DEVIATION_LIMIT = (BLOCK_BYTES * 90 + 99) // 100

_U8 = array(np.uint8)
_U8_IN_2D = array(np.uint8, 2, readonly=True)
_KEYS_IN = array(np.int64, readonly=True)
_POSITIONS_IN = array(np.int64, readonly=True)
_OFFSETS = array(np.int64)
_SCRATCH = array(np.int64, 2)


@inlined
def _put_varint(buf: np.ndarray, pos: int, value: int) -> int:
    while value >= 0x80:
        buf[pos] = np.uint8((value & 0x7F) | 0x80)
        value >>= 7
        pos += 1
    buf[pos] = np.uint8(value)
    return pos + 1


@inlined
def _put_fixed32(buf: np.ndarray, pos: int, value: int) -> int:
    for b in range(4):
        buf[pos + b] = np.uint8((value >> (8 * b)) & 0xFF)
    return pos + 4


@inlined
def _put_internal_key(buf: np.ndarray, pos: int, key: int, skip: int) -> int:
    """Bytes [skip, 16) of the internal key of `key` (little-endian bytes, then the
    trailer of sequence 0, type value)."""
    for b in range(skip, KEY_BYTES):
        buf[pos] = np.uint8((key >> (8 * b)) & 0xFF)
        pos += 1
    buf[pos] = np.uint8(1)
    for b in range(1, 8):
        buf[pos + b] = np.uint8(0)
    return pos + 8


@inlined
def _shared_prefix(a: int, b: int) -> int:
    """Leading little-endian bytes two distinct keys have in common."""
    n = 0
    while n < KEY_BYTES and ((a >> (8 * n)) & 0xFF) == ((b >> (8 * n)) & 0xFF):
        n += 1
    return n


@inlined
def _varint_bytes(value: int) -> int:
    n = 1
    while value >= 0x80:
        value >>= 7
        n += 1
    return n


@kernel([types.int64(_U8, _KEYS_IN, _U8_IN_2D, _POSITIONS_IN, _OFFSETS, _SCRATCH)])
def encode(buf: np.ndarray, keys: np.ndarray, rows: np.ndarray, positions: np.ndarray,
           sizes: np.ndarray, scratch: np.ndarray) -> int:
    """Write the data blocks and the index block of a table file into `buf`.

    `keys[i]` (distinct, bytewise order) gets the value `rows[positions[i]]` (raw bytes,
    one row of `rows` per value). A data block is closed where RocksDB's flush policy
    closes it (block size BLOCK_BYTES, deviation 10%), so blocks match its own writer's.
    `buf` must hold `max_bytes(...)`; `scratch` is int64[4, n + 1] of any content (a
    worker reuses one, so a file allocates nothing). On return sizes = (data bytes incl.
    trailers, index block offset, index block size without its trailer, data blocks, raw
    key bytes, raw value bytes). Returns the bytes written (data + index + its trailer).
    """
    n = keys.size
    value_bytes = rows.shape[1]
    flat = rows.reshape(-1)
    # an entry's share of RocksDB's size estimate when it decides to close a block
    entry_estimate = (INTERNAL_KEY_BYTES + value_bytes + 4 + _varint_bytes(INTERNAL_KEY_BYTES)
                      + _varint_bytes(value_bytes))
    block_offsets = scratch[0]
    block_sizes = scratch[1]
    block_last = scratch[2]
    restarts = scratch[3]
    num_blocks = 0
    pos = 0
    begin = 0
    count = 0  # restart points of the open block
    entries = 0  # entries of the open block
    since_restart = 0
    for i in range(n + 1):
        if entries:
            estimate = pos - begin + 4 * count + 4
            after = estimate + entry_estimate + (4 if since_restart >= RESTART_INTERVAL else 0)
            if i == n or estimate >= BLOCK_BYTES or (
                    estimate > _DEVIATION_LIMIT and after > BLOCK_BYTES):
                for r in range(count):
                    pos = _put_fixed32(buf, pos, restarts[r])
                pos = _put_fixed32(buf, pos, count)
                block_offsets[num_blocks] = begin
                block_sizes[num_blocks] = pos - begin
                block_last[num_blocks] = keys[i - 1]
                num_blocks += 1
                for b in range(_BLOCK_TRAILER):
                    buf[pos + b] = np.uint8(0)
                pos += _BLOCK_TRAILER
                begin = pos
                count = 0
                entries = 0
                since_restart = 0
        if i == n:
            break
        shared = 0
        if entries == 0 or since_restart >= RESTART_INTERVAL:
            restarts[count] = pos - begin
            count += 1
            since_restart = 0
        else:
            shared = _shared_prefix(keys[i - 1], keys[i])
        pos = _put_varint(buf, pos, shared)
        pos = _put_varint(buf, pos, INTERNAL_KEY_BYTES - shared)
        pos = _put_varint(buf, pos, value_bytes)
        pos = _put_internal_key(buf, pos, keys[i], shared)
        if i + _AHEAD < n:  # rows come in key order, from anywhere in `rows`
            ahead = positions[i + _AHEAD] * value_bytes
            for c in range(0, value_bytes, _LINE_BYTES):
                prefetch(flat, ahead + c)
        copy_bytes(buf, pos, flat, positions[i] * value_bytes, value_bytes)
        pos += value_bytes
        entries += 1
        since_restart += 1
    data_bytes = pos
    # the index: the last key of each block → its handle; a restart at every entry
    index_begin = pos
    handle = np.empty(20, np.uint8)
    for blk in range(num_blocks):
        restarts[blk] = pos - index_begin
        handle_bytes = _put_varint(handle, 0, block_offsets[blk])
        handle_bytes = _put_varint(handle, handle_bytes, block_sizes[blk])
        pos = _put_varint(buf, pos, 0)
        pos = _put_varint(buf, pos, INTERNAL_KEY_BYTES)
        pos = _put_varint(buf, pos, handle_bytes)
        pos = _put_internal_key(buf, pos, block_last[blk], 0)
        for b in range(handle_bytes):
            buf[pos + b] = handle[b]
        pos += handle_bytes
    for blk in range(num_blocks):
        pos = _put_fixed32(buf, pos, restarts[blk])
    pos = _put_fixed32(buf, pos, num_blocks)
    index_size = pos - index_begin
    for b in range(_BLOCK_TRAILER):
        buf[pos + b] = np.uint8(0)
    pos += _BLOCK_TRAILER
    sizes[0] = data_bytes
    sizes[1] = index_begin
    sizes[2] = index_size
    sizes[3] = num_blocks
    sizes[4] = n * INTERNAL_KEY_BYTES
    sizes[5] = n * value_bytes
    return pos


def max_bytes(num_keys: int, value_bytes: int) -> int:
    """An upper bound of `encode`'s output for `num_keys` keys (a block per key at worst)."""
    per_entry = 5 + INTERNAL_KEY_BYTES + value_bytes + 4  # varints, key, value, restart
    per_block = 4 + _BLOCK_TRAILER + (3 + INTERNAL_KEY_BYTES + 20 + 4)  # + index entry
    return num_keys * (per_entry + per_block) + 4 + _BLOCK_TRAILER + 64


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _block(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A block of full keys (restart interval 1), as RocksDB's meta blocks are read."""
    body = bytearray()
    offsets = []
    for key, value in entries:
        offsets.append(len(body))
        body += _varint(0) + _varint(len(key)) + _varint(len(value)) + key + value
    body += b"".join(struct.pack("<I", o) for o in offsets)
    body += struct.pack("<I", len(offsets))
    return bytes(body)


def _handle(offset: int, size: int) -> bytes:
    return _varint(offset) + _varint(size)


def _session_id() -> bytes:
    """A fresh 20-character session id, as RocksDB writes one into each file: with the
    file number it makes the file's unique id (block cache keys)."""
    alphabet = string.digits + string.ascii_uppercase
    return "".join(secrets.choice(alphabet) for _ in range(20)).encode()


def tail(sizes: np.ndarray, num_keys: int) -> bytes:
    """The properties block, metaindex block and footer that follow `encode`'s output."""
    data_bytes, index_offset, index_size, blocks, key_bytes, value_bytes = (
        int(x) for x in sizes)
    properties = {
        b"rocksdb.block.based.table.index.type": struct.pack("<I", 0),
        b"rocksdb.block.based.table.prefix.filtering": b"0",
        b"rocksdb.block.based.table.whole.key.filtering": b"1",
        b"rocksdb.column.family.id": _varint(0x7FFFFFFF),  # unknown: any family
        b"rocksdb.comparator": b"leveldb.BytewiseComparator",
        b"rocksdb.compression": b"NoCompression",
        b"rocksdb.compression_options": (
            b"window_bits=-14; level=32767; strategy=0; max_dict_bytes=0; "
            b"zstd_max_train_bytes=0; enabled=0; max_dict_buffer_bytes=0; "
            b"use_zstd_dict_trainer=1; "),
        b"rocksdb.creating.db.identity": b"SST Writer",
        b"rocksdb.creating.host.identity": b"hps",
        b"rocksdb.creating.session.identity": _session_id(),
        b"rocksdb.creation.time": _varint(0),
        b"rocksdb.data.size": _varint(data_bytes),
        b"rocksdb.deleted.keys": _varint(0),
        b"rocksdb.external_sst_file.global_seqno": struct.pack("<Q", 0),
        b"rocksdb.external_sst_file.version": struct.pack("<I", 2),
        b"rocksdb.filter.size": _varint(0),
        b"rocksdb.fixed.key.length": _varint(0),
        b"rocksdb.format.version": _varint(FORMAT_VERSION),
        b"rocksdb.index.key.is.user.key": _varint(0),
        b"rocksdb.index.size": _varint(index_size + _BLOCK_TRAILER),
        b"rocksdb.index.value.is.delta.encoded": _varint(0),
        b"rocksdb.key.largest.seqno": _varint(0),
        b"rocksdb.merge.operands": _varint(0),
        b"rocksdb.merge.operator": b"nullptr",
        b"rocksdb.num.data.blocks": _varint(blocks),
        b"rocksdb.num.entries": _varint(num_keys),
        b"rocksdb.num.filter_entries": _varint(0),
        b"rocksdb.num.range-deletions": _varint(0),
        b"rocksdb.oldest.key.time": _varint(0),
        b"rocksdb.original.file.number": _varint(1),
        b"rocksdb.prefix.extractor.name": b"nullptr",
        b"rocksdb.property.collectors": b"[]",
        b"rocksdb.raw.key.size": _varint(key_bytes),
        b"rocksdb.raw.value.size": _varint(value_bytes),
        b"rocksdb.tail.start.offset": _varint(data_bytes),
    }
    trailer = bytes(_BLOCK_TRAILER)
    properties_offset = index_offset + index_size + _BLOCK_TRAILER
    properties_block = _block(sorted(properties.items()))
    metaindex_offset = properties_offset + len(properties_block) + _BLOCK_TRAILER
    metaindex_block = _block(
        [(b"rocksdb.properties", _handle(properties_offset, len(properties_block)))])
    handles = _handle(metaindex_offset, len(metaindex_block)) + _handle(index_offset, index_size)
    footer = (b"\x00" + handles + bytes(40 - len(handles))
              + struct.pack("<I", FORMAT_VERSION) + struct.pack("<Q", MAGIC))
    return properties_block + trailer + metaindex_block + trailer + footer


def write_file(path: str, keys: np.ndarray, rows: np.ndarray,
               positions: np.ndarray | None = None) -> int:
    """Write a table file at `path` holding `keys[i]` → the raw bytes of
    `rows[positions[i]]` (or of `rows[i]`); returns its size in bytes.

    `keys`: distinct int64 in bytewise order of their little-endian bytes. `rows`: any
    C-contiguous 2-D array (its rows' bytes are the values). The file is not synced: the
    caller syncs what it ingests.
    """
    keys = np.ascontiguousarray(keys, np.int64)
    raw = np.ascontiguousarray(rows).view(np.uint8).reshape(rows.shape[0], -1)
    if positions is None:
        positions = np.arange(keys.size, dtype=np.int64)
    buf = np.empty(max_bytes(keys.size, raw.shape[1]), np.uint8)
    sizes = np.zeros(6, np.int64)
    written = encode(buf, keys, raw, np.ascontiguousarray(positions, np.int64), sizes,
                     np.empty((4, keys.size + 1), np.int64))
    end = tail(sizes, keys.size)
    with open(path, "wb") as f:
        f.write(buf[:written].data)
        f.write(end)
    return written + len(end)
