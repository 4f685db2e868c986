"""Compiled copies of stored rows into a lookup's output (numba): the decode of every
storage type of hps/rows/storage_types.py, picked by the types of the stored and output arrays when
a kernel is compiled, so a kernel written once serves every storage type.

`copy_row(stored, r, floats, out, i)` writes stored row `r` into `out[i]`:

    stored            out                      what out[i] gets
    float32 [m, dim]  float32 [n, dim]         the row
    uint16  [m, dim]  float32 [n, dim]         float16 bits widened (float16 storage)
    uint16  [m, dim]  uint32  [n, dim]         bfloat16 bits << 16: float32 bit patterns
                                               (bfloat16 storage; `out` is a float32
                                               output viewed as uint32)
    uint16  [m, dim]  uint16  [n, dim]         the bits as they are (float16 storage into
                                               a float16 output, bfloat16 into bfloat16)
    uint8   [m, w]    float32 [n, dim]         float32(q) * scale + bias (int8 storage;
                                               `floats` is `stored` viewed as float32, its
                                               last two columns scale and bias)

`floats` is ignored but for int8 (pass any float32 2-D array). Byte-for-byte the same
results as `hps.rows.storage_types.decode` (int8: two float32 roundings, no fused multiply-add).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hps.runtime.compiled import half_to_float, numba, types

_overload = numba.extending.overload


def copy_row(stored: Any, r: Any, floats: Any, out: Any, i: Any) -> Any:
    """out[i] = stored row r, decoded as the array types say (see the module docstring).
    Callable from compiled code only."""
    raise NotImplementedError("copy_row runs inside numba kernels")


def zero_row(out: Any, i: int) -> None:
    """out[i] = zeros (0.0 in every output type). Callable from compiled code only."""
    raise NotImplementedError("zero_row runs inside numba kernels")


@_overload(copy_row, inline="always")
def _copy_row(stored: Any, r: Any, floats: Any, out: Any, i: Any) -> Any:
    held, wanted = stored.dtype, out.dtype
    if held == wanted:  # float32 rows, or float16 / bfloat16 bits into the same type
        def copy(stored: Any, r: Any, floats: Any, out: Any, i: Any) -> Any:
            for j in range(out.shape[1]):
                out[i, j] = stored[r, j]
        return copy
    if held == types.uint16 and wanted == types.float32:
        def widen_half(stored: Any, r: Any, floats: Any, out: Any, i: Any) -> Any:
            for j in range(out.shape[1]):
                out[i, j] = half_to_float(stored[r, j])
        return widen_half
    if held == types.uint16 and wanted == types.uint32:
        def widen_bfloat16(stored: Any, r: Any, floats: Any, out: Any, i: Any) -> Any:
            for j in range(out.shape[1]):
                out[i, j] = np.uint32(stored[r, j]) << np.uint32(16)
        return widen_bfloat16
    if held == types.uint8 and wanted == types.float32:
        def dequantize(stored: Any, r: Any, floats: Any, out: Any, i: Any) -> Any:
            k = floats.shape[1] - 2
            scale = floats[r, k]
            bias = floats[r, k + 1]
            for j in range(out.shape[1]):
                out[i, j] = np.float32(stored[r, j]) * scale + bias
        return dequantize
    return None


@_overload(zero_row, inline="always")
def _zero_row(out: Any, i: Any) -> Any:
    def zero(out: Any, i: Any) -> Any:
        for j in range(out.shape[1]):
            out[i, j] = 0
    return zero


#: (stored dtype, output dtype) pairs `copy_row` decodes, for kernels' signature lists
PAIRS: tuple[tuple[Any, Any], ...] = (
    (np.float32, np.float32), (np.uint16, np.float32), (np.uint16, np.uint32),
    (np.uint16, np.uint16), (np.uint8, np.float32))
