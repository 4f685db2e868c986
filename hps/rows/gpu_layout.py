"""How the GPU tiers store a row of each storage type (`embedding_storage_dtype`, defined
in hps/rows/storage_types.py) and which outputs a lookup may write: the compile-time codes the
kernels select their row code with, the bytes of a stored row, the output checks.

    storage    STORAGE  bytes a row on the GPU            a lane reads
    float32    0        align4(dim) · 4 (float4 padding)   float4
    float16    1        align8(dim) · 2 (16-byte padding)  4 halves (float32 out), 8 (float16 out)
    bfloat16   2        align8(dim) · 2                    likewise, raw 16-bit patterns
    int8       3        align4(dim) + 8 (hps/rows/storage_types.py's  4 codes; scale and bias
                        int8 row, byte for byte)           (float32 each) at the row's end

A lookup's output (OUT_TYPE) is float32 (0) for every storage, widened in registers, or the
storage's own 16-bit type (float16 1, bfloat16 2), copied without widening: the output
types hps/rows/storage_types.py's StorageType.output_dtypes allows. Anything else is an
OutputBufferError naming what the table allows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hps.errors import ConfigError, OutputBufferError
from hps.rows.storage_types import FLOAT32, StorageType, int8_row_bytes, storage_type

STORAGE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3}
OUTPUT_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
OUT_FLOAT32 = 0
# how a CuPy array of the output holds its elements (bfloat16: its bit patterns)
OUTPUT_CUPY_DTYPE = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.uint16))
_FLOAT32 = np.dtype(np.float32)


def table_storage(name: str | StorageType) -> StorageType:
    """The StorageType of a table; ConfigError naming the allowed ones for another name."""
    try:
        return storage_type(name)
    except ValueError as exc:
        raise ConfigError(f"embedding_storage_dtype: {exc}") from None


def stored_row_bytes(dim: int, storage: StorageType = FLOAT32) -> int:
    """Bytes of one stored row of width `dim` in the GPU tiers (see the module
    docstring); the kernels get it as ROW_BYTES and check it against their layout."""
    dim = int(dim)
    if storage.name == "float32":
        return -(-dim // 4) * 16
    if storage.name == "int8":
        return int8_row_bytes(dim)
    return -(-dim // 8) * 16


def row_unit_bytes(storage: StorageType) -> int:
    """Bytes of the unit the kernels address rows in (hps_row_t): 16, int8 rows 4."""
    return 4 if storage.name == "int8" else 16


def narrow_output_code(storage: StorageType) -> int:
    """OUT_TYPE of the storage's own 16-bit output (float16, bfloat16), which lookups fill
    without widening; -1 for a storage that has none (float32, int8)."""
    narrow = storage.narrow_output
    return OUTPUT_CODES[narrow] if narrow is not None else -1


def output_code(out: Any, storage: StorageType) -> int:
    """OUT_TYPE of an output ArrayRef (hps/intake/array_ref.py) whose dtype hps/intake/keys.py
    output_ref accepted for a table of `storage` (float32, or the storage's own 16-bit
    type). Raises OutputBufferError for a strided bfloat16 output: the GPU path moves
    those through CuPy, which has no bfloat16."""
    dtype = out.dtype
    if dtype == _FLOAT32:
        return OUT_FLOAT32
    name = dtype.name if dtype is not None else out.alien_dtype
    if name not in storage.output_dtypes:  # output_ref refuses these: not reached
        raise OutputBufferError(f"output must be float32 for a table stored as "
                                f"{storage.name}, got dtype {name}")
    if dtype is None and not out.contiguous:
        raise OutputBufferError(f"a {name} output of the GPU cache must be contiguous")
    return OUTPUT_CODES[name]
