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

And PyTorch's files of a table of rows (keys = row index), as a training job writes them
(the `torch` extra): `write_torch_state` (`torch.save` of a state_dict `{"weight": rows}`),
`write_safetensors` (the same dict saved by safetensors) and `write_dcp` (a
`torch.distributed.checkpoint` folder saved by `ranks` processes, gloo on loopback, the
table a DTensor sharded row-wise or column-wise over them, each rank holding only its
own shard).
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


#: the state_dict key of the table in the PyTorch files written here
TORCH_TENSOR = "weight"


def write_torch_state(path: str, rows: np.ndarray) -> None:
    """`torch.save({"weight": rows}, path)`, fsynced: what `torch.save(model.state_dict())`
    of one nn.Embedding writes (keys = row index)."""
    import torch

    torch.save({TORCH_TENSOR: torch.from_numpy(np.ascontiguousarray(rows))}, path)
    _fsync(path)


def write_safetensors(path: str, rows: np.ndarray) -> None:
    """`safetensors.numpy.save_file({"weight": rows}, path)`, fsynced: how a PyTorch user
    re-saves an embedding's weight for serving (keys = row index; the `safetensors`
    extra)."""
    from safetensors.numpy import save_file

    save_file({TORCH_TENSOR: np.ascontiguousarray(rows)}, path)
    _fsync(path)


def write_dcp(folder: str, rows_npy: str, sharding: str, ranks: int = 2) -> None:
    """A DCP checkpoint folder of the table in the .npy file `rows_npy` (float32 [n, dim]),
    saved by `ranks` processes (torch.multiprocessing spawn, gloo on loopback), the table
    a DTensor sharded `sharding` ("row-wise": Shard(0), "column-wise": Shard(1)) with each
    rank holding its shard alone; fsynced."""
    import socket

    import torch.multiprocessing as mp

    if sharding not in _SHARD_DIM:
        raise ValueError(f"sharding must be one of {', '.join(_SHARD_DIM)}, got {sharding!r}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_save_dcp_rank, args=(ranks, folder, rows_npy, _SHARD_DIM[sharding], port),
             nprocs=ranks)
    for name in os.listdir(folder):
        _fsync(os.path.join(folder, name))


_SHARD_DIM = {"row-wise": 0, "column-wise": 1}


def _save_dcp_rank(rank: int, world: int, folder: str, rows_npy: str, dim: int,
                   port: int) -> None:
    """One rank of write_dcp: its shard of the table (torch's own split: even shards, the
    last ones smaller), saved with dcp.save."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        table = np.load(rows_npy, mmap_mode="r")
        size = table.shape[dim]
        step = -(-size // world)
        first, last = min(rank * step, size), min((rank + 1) * step, size)
        shard = table[first:last] if dim == 0 else table[:, first:last]
        local = torch.from_numpy(np.array(shard))  # the rank's own copy (writable)
        weight = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False,
                                    shape=torch.Size(table.shape),
                                    stride=(table.shape[1], 1))
        dcp.save({TORCH_TENSOR: weight}, checkpoint_id=folder)
    finally:
        dist.destroy_process_group()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
