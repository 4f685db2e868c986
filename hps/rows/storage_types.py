"""Storage types of embedding rows (`embedding_storage_dtype`): layouts, reference codecs,
error bounds. The one definition every compact tier (the in-process hash map, the GPU
tables) encodes and decodes against; NumPy only, no tier imports it back.

Rows arrive and leave as float32 [n, dim]. A table may keep them in one of:

    name       stored array                   bytes a row     decoded value
    float32    float32 [n, dim]               4·dim           the row itself
    float16    float16 [n, dim]               2·dim           IEEE binary16 → float32
    bfloat16   uint16  [n, dim] (bit patterns) 2·dim          bits << 16 read as float32
    int8       uint8   [n, int8_row_bytes]    align4(dim) + 8  q·scale + bias

Byte layout of one int8 row (little-endian, FBGEMM's row-wise layout; `p = align4(dim)`,
dim rounded up to a multiple of 4, so `p == dim` for the usual widths):

    bytes [0, dim)        q: uint8 codes, one per element
    bytes [dim, p)        zero padding (only when dim is not a multiple of 4)
    bytes [p, p + 4)      scale: float32
    bytes [p + 4, p + 8)  bias: float32 (the row's minimum)

Viewed as float32, the row's scale and bias are elements `p // 4` and `p // 4 + 1`
(`INT8_SCALE_FLOAT`, `INT8_BIAS_FLOAT` of `int8_layout(dim)`); the padding keeps them
4-byte aligned for any dim.

Encoding (bit-exact; a GPU port must follow these steps):
- float16: IEEE round-to-nearest-even (NumPy's `astype(float16)`).
- bfloat16: round-to-nearest-even on the float32 bits: `u = bits(x)`,
  `(u + 0x7FFF + ((u >> 16) & 1)) >> 16` as uint16.
- int8: per row `bias = min(x)` (float32), `scale = float32((float64(max) - float64(min))
  / 255)`, raised to the smallest float32 subnormal (2**-149) when that rounds to 0 but
  max > min; `q = clip(rint((float64(x) - float64(bias)) / float64(scale)), 0, 255)`
  (round half to even), and q = 0 where scale is 0 (a constant row).
- float32: stored as given.

Decoding: float16 and bfloat16 widen exactly. int8 decodes as `float32(q) * scale`
rounded to float32, then `+ bias` rounded to float32: two roundings, no fused
multiply-add (a CUDA port uses `__fmul_rn` then `__fadd_rn` to be bit-exact). A constant
row decodes to its value exactly (0 · 0 + bias), except that -0.0 comes back as +0.0.

What each type can hold (`first_unencodable_row`): finite values only, with
|x| < `max_magnitude` (float16: 65520, past which values round to infinity; bfloat16:
3.3961514e38, likewise; int8: 2**126, so that a row's range and q·scale stay finite in
float32). A compact table refuses other rows; float32 stores anything.

Error bound of the decoded value (`error_bound`), per element:
- float16: max(2**-11 · |x|, 2**-25) (relative 2**-11; half the subnormal step below 2**-14)
- bfloat16: max(2**-8 · |x|, 2**-134) (relative 2**-8; half the subnormal step)
- int8: scale / 2 (half a quantization step of the row) + 2**-21 · max|x| of the row +
  2**-141 (the float32 roundings of scale and of the decode; the last term covers a
  subnormal scale, whose rounding is absolute)
- float32: 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import numpy as np

StorageName = Literal["float32", "float16", "bfloat16", "int8"]
#: the values of `embedding_storage_dtype`, default first
STORAGE_NAMES: tuple[str, ...] = get_args(StorageName)

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_U16 = np.dtype(np.uint16)
_U8 = np.dtype(np.uint8)
_INT8_LEVELS = 255
_SMALLEST_SUBNORMAL = np.float32(2.0**-149)


@dataclass(frozen=True)
class StorageType:
    """One storage type of embedding rows.

    name: the config value; stored_dtype: the NumPy dtype of the stored array's elements;
    output_dtypes: the dtype names a lookup's output may have when a table stores this
    type (float32 always; float16 / bfloat16 only for the same storage, written without
    widening; bfloat16 outputs are torch tensors, NumPy has no such dtype);
    max_magnitude: values must be finite and smaller than this in magnitude.
    """

    name: str
    stored_dtype: np.dtype
    output_dtypes: tuple[str, ...]
    max_magnitude: float

    @property
    def compact(self) -> bool:
        """Whether rows are stored in fewer bytes than float32 (anything but float32)."""
        return self.name != "float32"

    def row_width(self, dim: int) -> int:
        """Elements of `stored_dtype` per stored row."""
        return int8_row_bytes(dim) if self.name == "int8" else dim

    def row_bytes(self, dim: int) -> int:
        """Bytes one stored row of width `dim` takes."""
        return self.row_width(dim) * self.stored_dtype.itemsize

    @property
    def narrow_output(self) -> str | None:
        """The output dtype other than float32 that lookups fill with the stored values
        without widening ("float16", "bfloat16"), None when there is none."""
        others = [name for name in self.output_dtypes if name != "float32"]
        return others[0] if others else None


FLOAT32 = StorageType("float32", _F32, ("float32",), float("inf"))
FLOAT16 = StorageType("float16", _F16, ("float32", "float16"), 65520.0)
BFLOAT16 = StorageType("bfloat16", _U16, ("float32", "bfloat16"),
                       float(np.array(0x7F7F8000, np.uint32).view(np.float32)))
INT8 = StorageType("int8", _U8, ("float32",), 2.0**126)

_TYPES = {t.name: t for t in (FLOAT32, FLOAT16, BFLOAT16, INT8)}
assert tuple(_TYPES) == STORAGE_NAMES


def storage_type(name: str | StorageType) -> StorageType:
    """The StorageType of a config value; raises ValueError naming the allowed ones."""
    if isinstance(name, StorageType):
        return name
    try:
        return _TYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown embedding storage dtype {name!r}: expected one of "
                         f"{', '.join(STORAGE_NAMES)}") from None


# -- the int8 row layout ------------------------------------------------------------------

class Int8Layout(NamedTuple):
    """Offsets in one int8 row of width `dim` (see the module docstring)."""

    row_bytes: int  # align4(dim) + 8
    scale_offset: int  # byte offset of the float32 scale (align4(dim))
    bias_offset: int  # byte offset of the float32 bias (align4(dim) + 4)
    scale_float: int  # index of the scale in the row viewed as float32 (align4(dim) // 4)
    bias_float: int  # index of the bias in the row viewed as float32


def int8_layout(dim: int) -> Int8Layout:
    """Where codes, scale and bias sit in an int8 row of width `dim`."""
    padded = (int(dim) + 3) // 4 * 4
    return Int8Layout(padded + 8, padded, padded + 4, padded // 4, padded // 4 + 1)


def int8_row_bytes(dim: int) -> int:
    """Bytes of one int8 row of width `dim`: align4(dim) + 8."""
    return int8_layout(dim).row_bytes


# -- checks ---------------------------------------------------------------------------------

def unencodable_rows(storage: StorageType | str, rows: np.ndarray) -> np.ndarray:
    """bool[n]: the rows of `rows` (float32 [n, dim]) the type cannot hold (NaN, infinity,
    magnitude at or past `max_magnitude`). All False for float32."""
    t = storage_type(storage)
    n = rows.shape[0] if rows.ndim else 0
    if not t.compact or n == 0:
        return np.zeros(n, bool)
    with np.errstate(invalid="ignore"):
        held = np.abs(rows).reshape(n, -1) < np.float32(t.max_magnitude)  # NaN: False
    out: np.ndarray = ~held.all(axis=1)
    return out


def first_unencodable_row(storage: StorageType | str, rows: np.ndarray) -> int | None:
    """Index of the first row the type cannot hold, None when it can hold them all."""
    bad = unencodable_rows(storage, rows)
    return int(np.argmax(bad)) if bad.any() else None


# -- reference codecs ---------------------------------------------------------------------

def encode(storage: StorageType | str, rows: np.ndarray) -> np.ndarray:
    """`rows` (float32 [n, dim]) in the stored form: an array of `stored_dtype` of shape
    [n, row_width(dim)], new (float32: `rows` itself when already C-contiguous float32).

    Raises ValueError when a row cannot be held (check `first_unencodable_row` first to
    name it).
    """
    t = storage_type(storage)
    x = np.ascontiguousarray(rows, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"rows must be 2-D [n, dim], got shape {x.shape}")
    if not t.compact:
        return x
    bad = first_unencodable_row(t, x)
    if bad is not None:
        raise ValueError(f"row {bad} holds NaN, infinity or a value of magnitude "
                         f"≥ {t.max_magnitude:g}, which {t.name} cannot hold")
    if t is INT8:
        return _encode_int8(x)
    return narrow(t, x)


def narrow(storage: StorageType | str, rows: np.ndarray) -> np.ndarray:
    """float32 rows in the 16-bit output type of a float16 or bfloat16 table: float16, or
    uint16 bfloat16 bits; round-to-nearest-even, as `encode`. Unchecked, like a cast:
    values out of range become infinities (for rows read from float32 tiers, which may
    hold anything another server wrote). Raises ValueError for other types."""
    t = storage_type(storage)
    x = np.ascontiguousarray(rows, dtype=np.float32)
    if t is FLOAT16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    if t is BFLOAT16:
        u = x.view(np.uint32).astype(np.uint64)  # no wrap-around past 2**32
        bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        bits[np.isnan(x)] = 0x7FC0  # a quiet NaN, whatever the payload's rounding gives
        return bits
    raise ValueError(f"{t.name} rows have no 16-bit output type")


#: rows an int8 encode works on at once (its float64 temporaries: 8 bytes an element)
_INT8_BLOCK_ROWS = 1 << 14


def _encode_int8(x: np.ndarray) -> np.ndarray:
    n, dim = x.shape
    out = np.zeros((n, int8_row_bytes(dim)), np.uint8)
    for start in range(0, n, _INT8_BLOCK_ROWS):  # a loop over blocks of rows
        stop = min(n, start + _INT8_BLOCK_ROWS)
        _encode_int8_block(x[start:stop], out[start:stop])
    return out


def _encode_int8_block(x: np.ndarray, out: np.ndarray) -> None:
    dim = x.shape[1]
    layout = int8_layout(dim)
    low = x.min(axis=1)
    span = x.max(axis=1).astype(np.float64) - low
    scale = (span / _INT8_LEVELS).astype(np.float32)
    scale[(scale == 0) & (span > 0)] = _SMALLEST_SUBNORMAL
    divisor = np.where(scale > 0, scale, np.float32(1)).astype(np.float64)
    q = np.rint((x - low[:, None].astype(np.float64)) / divisor[:, None])
    out[:, :dim] = np.clip(q, 0, _INT8_LEVELS)
    floats = out.view(np.float32)
    floats[:, layout.scale_float] = scale
    floats[:, layout.bias_float] = low


def decode(storage: StorageType | str, stored: np.ndarray, dim: int) -> np.ndarray:
    """The float32 [n, dim] rows a stored array (as `encode` returns it) stands for."""
    t = storage_type(storage)
    if t is FLOAT32:
        return np.array(stored, dtype=np.float32).reshape(-1, dim)
    if t is FLOAT16:
        return np.asarray(stored).astype(np.float32).reshape(-1, dim)
    if t is BFLOAT16:
        wide = np.asarray(stored, dtype=np.uint16).astype(np.uint32) << np.uint32(16)
        return wide.view(np.float32).reshape(-1, dim)
    raw = np.ascontiguousarray(stored, dtype=np.uint8)
    layout = int8_layout(dim)
    raw = raw.reshape(-1, layout.row_bytes)
    floats = raw.view(np.float32)
    scale = floats[:, layout.scale_float, None]
    bias = floats[:, layout.bias_float, None]
    # two float32 roundings, as every decoder does: no fused multiply-add
    product: np.ndarray = raw[:, :dim].astype(np.float32) * scale
    return product + bias


def int8_scales(stored: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, bias) float32 [n] of int8 stored rows."""
    layout = int8_layout(dim)
    floats = np.ascontiguousarray(stored, dtype=np.uint8).reshape(-1, layout.row_bytes).view(
        np.float32)
    return floats[:, layout.scale_float].copy(), floats[:, layout.bias_float].copy()


def error_bound(storage: StorageType | str, rows: np.ndarray) -> np.ndarray:
    """float64 [n, dim]: how far the decoded value of each element of `rows` (float32
    [n, dim], encodable) may be from it (see the module docstring)."""
    t = storage_type(storage)
    x = np.abs(np.asarray(rows, dtype=np.float64))
    if t is FLOAT32:
        return np.zeros_like(x)
    if t is FLOAT16:
        return np.maximum(x * 2.0**-11, 2.0**-25)
    if t is BFLOAT16:
        return np.maximum(x * 2.0**-8, 2.0**-134)
    scale, _ = int8_scales(_encode_int8(np.asarray(rows, np.float32)), x.shape[1])
    per_row = scale.astype(np.float64) / 2 + 2.0**-21 * x.max(axis=1, initial=0.0) + 2.0**-141
    return np.broadcast_to(per_row[:, None], x.shape).copy()
