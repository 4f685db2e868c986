"""Compiled loops over Parquet's RLE / bit-packed hybrid encoding (levels, dictionary ids).

A Parquet list column stores, beside its values, a repetition level and a definition level
per value, each run-length or bit-packed. pyarrow decodes every level of every value to
rebuild the lists, which for a column of embedding rows costs more than the values. A
table of rows needs no lists rebuilt, only proof of their shape: every row exactly `dim`
values, none null. These loops check that proof run by run (a byte per 8 values, or O(1)
per run-length run), and decode dictionary ids where a page holds them.

The hybrid encoding (bit width `w`): a sequence of runs, each starting with a ULEB128
header `h`; `h & 1` = bit-packed: `h >> 1` groups of 8 values, `w` bytes per group, least
significant bit first; else run-length: `h >> 1` copies of one value stored in
ceil(w / 8) little-endian bytes.

Every function returns False / -1 for anything malformed (a run past the buffer's end,
too few values); it never reads outside [start, end).
"""

from __future__ import annotations

import numpy as np

from hps.runtime.compiled import array, inlined, kernel, types

_BYTES = array(np.uint8, readonly=True)
_U32 = array(np.uint32)
_I64 = types.int64


@inlined
def _header(buf: np.ndarray, p: int, end: int) -> tuple[int, int]:
    """(run header, position after it), or (-1, p) when it runs past `end`."""
    value = 0
    shift = 0
    while p < end and shift < 63:
        byte = buf[p]
        p += 1
        value |= (int(byte) & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, p
    return -1, p


@kernel([types.boolean(_BYTES, _I64, _I64, _I64, _I64, _I64, _BYTES)])
def rows_of_dim(buf: np.ndarray, start: int, end: int, num_values: int, first: int,
                dim: int, expected: np.ndarray) -> bool:
    """Whether the repetition levels (bit width 1) in buf[start:end] are those of whole
    rows of `dim` values: level 0 at every value position p ≡ 0 (mod dim), else 1, for
    positions first, first + 1, …, first + num_values - 1 (`first` > 0 when the page
    starts inside a row). `expected[r]` is the byte of 8 levels starting at position
    p ≡ r (mod dim), as `row_start_bytes(dim)` makes it."""
    p = start
    pos = first
    stop = first + num_values
    while pos < stop:
        h, p = _header(buf, p, end)
        if h < 0:
            return False
        count = h >> 1
        if h & 1:  # bit-packed: one byte per group of 8 levels
            if p + count > end:
                return False
            for i in range(count):
                if pos >= stop:
                    break
                byte = int(buf[p + i])
                want = int(expected[pos % dim])
                left = stop - pos
                if left < 8:  # the last group's unused bits are padding
                    mask = (1 << left) - 1
                    byte &= mask
                    want &= mask
                if byte != want:
                    return False
                pos += 8
            p += count
        else:
            if p >= end or count == 0:
                return False
            level = buf[p]
            p += 1
            at = pos % dim
            if level == 0:  # row starts: only one in a row unless rows are 1 wide
                if at != 0 or (count != 1 and dim != 1):
                    return False
            elif level == 1:  # inside one row
                if at == 0 or at + count > dim:
                    return False
            else:
                return False
            pos += count
    return True


@kernel([types.boolean(_BYTES, _I64, _I64, _I64, _I64, _I64)])
def all_equal(buf: np.ndarray, start: int, end: int, num_values: int, bit_width: int,
              value: int) -> bool:
    """Whether the first `num_values` levels of width `bit_width` in buf[start:end] all
    equal `value` (definition levels at their maximum: no null row, no null value)."""
    packed = np.zeros(bit_width, np.uint8)  # 8 copies of value, bit-packed
    for i in range(8):
        for b in range(bit_width):
            if (value >> b) & 1:
                bit = i * bit_width + b
                packed[bit >> 3] |= np.uint8(1 << (bit & 7))
    run_bytes = (bit_width + 7) >> 3
    p = start
    pos = 0
    while pos < num_values:
        h, p = _header(buf, p, end)
        if h < 0:
            return False
        count = h >> 1
        if h & 1:
            if p + count * bit_width > end:
                return False
            for g in range(count):
                if pos >= num_values:
                    break
                left = num_values - pos
                at = p + g * bit_width
                if left >= 8:
                    for j in range(bit_width):
                        if buf[at + j] != packed[j]:
                            return False
                else:  # compare only the used bits of the last group
                    for i in range(left):
                        got = 0
                        for b in range(bit_width):
                            bit = i * bit_width + b
                            got |= ((int(buf[at + (bit >> 3)]) >> (bit & 7)) & 1) << b
                        if got != value:
                            return False
                pos += 8
            p += count * bit_width
        else:
            if p + run_bytes > end or count == 0:
                return False
            got = 0
            for j in range(run_bytes):
                got |= int(buf[p + j]) << (8 * j)
            p += run_bytes
            if got != value:
                return False
            pos += count
    return True


@kernel([_I64(_BYTES, _I64, _I64, _I64, _U32)])
def decode_ids(buf: np.ndarray, start: int, end: int, bit_width: int, out: np.ndarray) -> int:
    """Decode len(out) values of width `bit_width` (≤ 32) from buf[start:end] into `out`;
    returns the largest value, or -1 when the runs end early or are malformed."""
    n = out.shape[0]
    run_bytes = (bit_width + 7) >> 3
    mask = (1 << bit_width) - 1
    largest = 0
    p = start
    pos = 0
    while pos < n:
        h, p = _header(buf, p, end)
        if h < 0:
            return -1
        count = h >> 1
        if h & 1:
            if p + count * bit_width > end:
                return -1
            bits = 0
            held = 0
            q = p
            for _ in range(count * 8):
                while held < bit_width:
                    bits |= int(buf[q]) << held
                    q += 1
                    held += 8
                if pos < n:
                    v = bits & mask
                    out[pos] = v
                    if v > largest:
                        largest = v
                    pos += 1
                bits >>= bit_width
                held -= bit_width
            p += count * bit_width
        else:
            if p + run_bytes > end:
                return -1
            v = 0
            for j in range(run_bytes):
                v |= int(buf[p + j]) << (8 * j)
            p += run_bytes
            if v > mask:
                return -1
            take = min(count, n - pos)
            out[pos : pos + take] = v
            if take and v > largest:
                largest = v
            pos += take
    return largest


def row_start_bytes(dim: int) -> np.ndarray:
    """expected[r] of `rows_of_dim`: the 8 repetition levels (bit-packed, LSB first) of
    positions r, r + 1, …, r + 7 of rows `dim` wide (0 at a row's start, else 1)."""
    offsets = (np.arange(dim)[:, None] + np.arange(8)[None, :]) % dim
    bits = (offsets != 0).astype(np.uint8) << np.arange(8, dtype=np.uint8)
    return np.ascontiguousarray(bits.sum(axis=1, dtype=np.uint8))
