"""Synthetic sparse model folders for `hps bench load`, written fast at any size.

A table of N rows is a pure function of the row number, so it is written in parallel
blocks and never held whole in memory (at 100M keys of width 16 the files are 7.2 GB):

- row i's key is a bijection of i on [0, 2**62) (a multiply-xorshift permutation): keys
  are distinct without a sort or a set, spread over the positive int64 range, and in no
  order (the files hold them as a trained model's would);
- the row of a key is a hash of (key, column) scaled into [0, 1) with 24 bits, so any
  key's expected row is known without the files (`rows_of`): a load is checked exactly.

Each thread fills a block in compiled code (GIL released) and writes it at its offset
with `pwrite`; the files are fsynced before they are timed against, so a load does not
compete with their write-back.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hps.modelfiles.formats.sparse_folder import KEY_FILE, VECTOR_FILE
from hps.runtime.compiled import array, inlined, kernel, types
from hps.runtime.cores import usable_cores

#: bytes of rows a thread fills and writes at once
BLOCK_BYTES = 32 << 20

_MASK = np.uint64((1 << 62) - 1)
_C1 = np.uint64(0x9E3779B97F4A7C15 & ((1 << 62) - 1) | 1)
_C2 = np.uint64(0xBF58476D1CE4E5B9 & ((1 << 62) - 1) | 1)
_C3 = np.uint64(0x94D049BB133111EB)
_SCALE = np.float32(1.0 / (1 << 24))
_U64 = np.uint64


@inlined
def _key(i: int, seed: int) -> np.int64:
    """Row i's key: a bijection of i on [0, 2**62) (each step is one on 62-bit words)."""
    x = (_U64(i) + _U64(seed)) & _MASK
    x = (x * _C1) & _MASK
    x ^= x >> _U64(31)
    x = (x * _C2) & _MASK
    x ^= x >> _U64(29)
    return np.int64(x)


@inlined
def _value(key: int, column: int) -> np.float32:
    x = _U64(key) * _C3 + _U64(column)
    x ^= x >> _U64(30)
    x *= _C1
    x ^= x >> _U64(27)
    x *= _C2
    x ^= x >> _U64(31)
    return np.float32(x >> _U64(40)) * _SCALE


@kernel([types.void(array(np.int64, readonly=True), types.int64, array(np.int64))])
def _fill_keys(rows: np.ndarray, seed: int, out: np.ndarray) -> None:
    for j in range(rows.size):
        out[j] = _key(rows[j], seed)


@kernel([types.void(array(np.int64, readonly=True), array(np.float32, 2))])
def _fill_rows(keys: np.ndarray, out: np.ndarray) -> None:
    for j in range(keys.size):
        for c in range(out.shape[1]):
            out[j, c] = _value(keys[j], c)


def keys_of(rows: np.ndarray, seed: int = 0) -> np.ndarray:
    """The keys of row numbers `rows` (int64; distinct rows have distinct keys)."""
    rows = np.ascontiguousarray(rows, np.int64)
    out = np.empty(rows.size, np.int64)
    _fill_keys(rows, seed, out)
    return out


def rows_of(keys: np.ndarray, dim: int) -> np.ndarray:
    """The row (float32[n, dim], values in [0, 1)) the files hold for each of `keys`."""
    out = np.empty((len(keys), dim), np.float32)
    _fill_rows(np.ascontiguousarray(keys, np.int64), out)
    return out


def write_table(folder: str, num_keys: int, dim: int, seed: int = 0,
                threads: int | None = None) -> None:
    """Write a sparse model folder (`key`, `emb_vector`) of `num_keys` rows of width `dim`
    at `folder`, durable (fsynced) on return."""
    os.makedirs(folder, exist_ok=True)
    per_block = max(1, BLOCK_BYTES // (4 * dim))
    blocks = range(0, num_keys, per_block)
    workers = min(threads or usable_cores(), max(1, len(blocks)))
    fds = [os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
           for name in (KEY_FILE, VECTOR_FILE)]
    try:
        os.ftruncate(fds[0], 8 * num_keys)
        os.ftruncate(fds[1], 4 * dim * num_keys)

        def write_blocks(worker: int) -> None:
            for first in blocks[worker::workers]:  # a loop over blocks, not rows
                keys = keys_of(np.arange(first, min(first + per_block, num_keys)), seed)
                _pwrite_all(fds[0], keys, 8 * first)
                _pwrite_all(fds[1], rows_of(keys, dim), 4 * dim * first)

        with ThreadPoolExecutor(workers, thread_name_prefix="hps-bench-files") as pool:
            list(pool.map(write_blocks, range(workers)))
        with ThreadPoolExecutor(len(fds)) as pool:
            list(pool.map(os.fsync, fds))
    finally:
        for fd in fds:
            os.close(fd)


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = data.data.cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
