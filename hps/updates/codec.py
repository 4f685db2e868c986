"""HugeCTR's update message (as HugeCTR's Kafka updates wrote it), encoded and decoded as
whole arrays.

    payload = b"HCTR" | value size in bytes (uint32 LE) | [key (LE) | value] × n

The key is 8 bytes (int64) with `supportlonglong`, 4 bytes (uint32) without; the value is
`dim` float32 (LE). Decoding is one `np.frombuffer` over a packed record dtype and one
copy of each field (into a buffer the caller gives, or arrays of their own): no Python
code runs per key.
"""

from __future__ import annotations

import struct

import numpy as np

from hps.errors import BadUpdateError
from hps.modelfiles.formats.base import UINT32_KEY_LIMIT

MAGIC = b"HCTR"
_HEADER = struct.Struct("<4sI")
HEADER_BYTES = _HEADER.size

#: the reasons a message is rejected (the `reason` label of hps_update_rejected_total)
REASONS = ("magic", "value_size", "truncated", "unknown_table", "non_finite", "key_range",
           "value_range")


def _records(key_bytes: int, dim: int) -> np.dtype:
    key = "<i8" if key_bytes == 8 else "<u4"
    return np.dtype([("key", key), ("vec", "<f4", (dim,))])  # packed: no padding


def encode(keys: np.ndarray, vectors: np.ndarray, *, key_bytes: int = 8) -> bytes:
    """One message of `keys` (int[n]) and their `vectors` (float32 [n, dim]).

    `key_bytes` 4 writes uint32 keys: raises BadUpdateError (reason "key_range") unless
    every key lies in [0, 2**32). Raises BadUpdateError ("value_size") when the shapes do
    not match and ("non_finite") for NaN or infinite values: a publisher refuses what a
    consumer would skip.
    """
    keys = np.asarray(keys).reshape(-1)
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[0] != keys.size or vectors.shape[1] < 1:
        raise BadUpdateError(f"{keys.size} keys need vectors of shape ({keys.size}, dim), "
                             f"got {vectors.shape}", "value_size")
    if keys.dtype.kind not in "iu":
        raise BadUpdateError(f"keys must be integers, got {keys.dtype}", "key_range")
    if key_bytes == 4:
        check_uint32(keys)
    if not np.isfinite(vectors).all():
        raise BadUpdateError("vectors hold NaN or infinite values", "non_finite")
    records = np.empty(keys.size, dtype=_records(key_bytes, vectors.shape[1]))
    records["key"] = keys
    records["vec"] = vectors
    return _HEADER.pack(MAGIC, vectors.shape[1] * 4) + records.tobytes()


def records(payload: bytes | memoryview, *, dim: int, key_bytes: int) -> np.ndarray:
    """The [key | value] records of one message as a read-only structured view of
    `payload` (fields "key" and "vec"; nothing is copied).

    Raises BadUpdateError whose `reason` is "magic", "value_size" (not `dim` × 4) or
    "truncated" (no header, or not a whole number of records).
    """
    size = len(payload)
    if size < HEADER_BYTES:
        raise BadUpdateError(f"message of {size} bytes has no header", "truncated")
    magic, value_size = _HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise BadUpdateError(f"message starts with {bytes(magic)!r}, not {MAGIC!r}", "magic")
    if value_size != dim * 4:
        raise BadUpdateError(f"value size {value_size} bytes, the table's rows are "
                             f"{dim} × 4 = {dim * 4} bytes", "value_size")
    dtype = _records(key_bytes, dim)
    body = size - HEADER_BYTES
    if body % dtype.itemsize:
        raise BadUpdateError(f"{body} bytes after the header are not a whole number of "
                             f"{dtype.itemsize}-byte records", "truncated")
    return np.frombuffer(payload, dtype=dtype, offset=HEADER_BYTES)


def unpack(rows: np.ndarray, keys: np.ndarray, vectors: np.ndarray, *, uint32_keys: bool
           ) -> None:
    """Copy `records(...)` into `keys` (int64 [n]) and `vectors` (float32 [n, dim]), e.g.
    slices of a buffer that a round's messages share, and check the copy: raises
    BadUpdateError "key_range" (`uint32_keys`: a key outside [0, 2**32)) or "non_finite"
    (NaN or infinite values). What was copied is then not to be used."""
    np.copyto(keys, rows["key"])
    if uint32_keys and rows.dtype["key"].itemsize == 8:
        check_uint32(keys)
    np.copyto(vectors, rows["vec"])
    if not np.isfinite(vectors).all():
        raise BadUpdateError("message holds NaN or infinite values", "non_finite")


def decode(payload: bytes | memoryview, *, dim: int, key_bytes: int, uint32_keys: bool
           ) -> tuple[np.ndarray, np.ndarray]:
    """The keys (int64 [n]) and vectors (float32 [n, dim], C-contiguous) of one message,
    in arrays of their own (`records` + `unpack`; see them for what is raised: every
    reason of REASONS but "unknown_table")."""
    rows = records(payload, dim=dim, key_bytes=key_bytes)
    keys = np.empty(rows.size, np.int64)
    vectors = np.empty((rows.size, dim), np.float32)
    unpack(rows, keys, vectors, uint32_keys=uint32_keys)
    return keys, vectors


def check_uint32(keys: np.ndarray) -> None:
    """BadUpdateError ("key_range") naming the first key outside [0, 2**32)."""
    bad = (keys < 0) | (keys >= UINT32_KEY_LIMIT)
    if bad.any():
        first = int(keys[int(np.argmax(bad))])
        raise BadUpdateError(f"key {first} is outside [0, 2**32) (supportlonglong: false)",
                             "key_range")
