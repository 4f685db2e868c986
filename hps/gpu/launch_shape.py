"""How the GPU tables' kernels are launched, and the measurements that chose it.

Threads per block (`BLOCK`), lanes that serve one key (`default_group`), keys a lane group
has in flight (`default_unroll`), the cache hints (`default_hints`) and the batches that
take the pipelined query kernel (`PIPELINED_AFTER`, `PIPELINED_ROW_BYTES`). The kernels
get them as -D options (GROUP, UNROLL, HINTS: hps/gpu/kernels.py); a table's launch shape
can be changed for tuning (`DeviceTable.set_launch`, hps/tools/bench/gpu.py --sweep). The
row layout stays the same whatever the shape.
"""

from __future__ import annotations

from hps.rows.storage_types import StorageType

BLOCK = 256
# Batches of more keys than PIPELINED_AFTER into 16-bit outputs, of rows up to
# PIPELINED_ROW_BYTES, take a table's pipelined query kernel (cuda/static_table.cu
# static_query_pipelined says why). H100, 1M keys, the public call, static table,
# alternating with it off (scripts/pipelined_query_probe.py): float16 / bfloat16 rows at
# dim 32 1.09x / 1.10x, dim 64 1.19x / 1.20x, dim 128 1.13x / 1.05x; at dim 256 (512-byte
# rows) 0.96x / 1.04x, as float32 rows of 512 bytes gained nothing (kernel time 417-424
# against 408 us).
PIPELINED_AFTER = 1 << 16
PIPELINED_ROW_BYTES = 256


def default_group(dim: int) -> int:
    """Lanes that serve one key (measured on an H100, hps/tools/bench/gpu.py --sweep)."""
    return 2 if dim <= 32 else 8


def default_unroll(dim: int) -> int:
    """Keys a lane group has in flight at once (measured likewise)."""
    return 2


def default_hints(storage: StorageType) -> int:
    """The cache hints of a table's kernels (HINTS, bits; cuda/hps_common.cuh).

    Bit 1, streaming hints on row reads and output writes: compact rows only. H100, 1M
    all-hit keys at dim 128, each pair timed in one block: with compact rows (`hps bench
    gpu --profile storage --sweep`, static table, public call) float16 rows into float16
    outputs 3.83 against 3.48 G keys/s without, into float32 3.08 against 2.83, int8 3.12
    against 2.98; with float32 rows (`--only throughput --sweep`, kernel time) they lose:
    static 2.23 against 2.40, dynamic 1.94 against 2.26.

    Bit 2, queries' reads of the index (the dynamic cache's sets, the static and uvm
    tables' buckets) keep their L2 lines ahead of the streamed rows: every type. H100,
    1M keys at dim 128, 1M uniform keys through the public call, calls alternating with
    and without (`python scripts/index_hint_probe.py [--cache-type dynamic]`): static
    table (three runs) float32 rows 2.50-2.55 against 2.25-2.29 G keys/s, float16 into
    float32 3.18-3.24 against 2.91-2.96, int8 3.20-3.31 against 2.93-3.00, float16 into
    float16 3.67-3.80 against 3.57-3.71; dynamic cache float32 2.43 against 2.20, float16
    into float32 3.10 against 2.83, int8 3.16 against 2.86, float16 into float16 3.48
    against 3.38; every output the same bit for bit. Over 8M keys at dim 64 (an index
    larger than L2) the static table still gained 1-2%."""
    return (1 if storage.compact else 0) | 2
