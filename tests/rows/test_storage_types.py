"""The storage types' reference codecs (hps/rows/storage_types.py): layouts, error bounds on random
and adversarial rows, and what each type refuses."""

from __future__ import annotations

import numpy as np
import pytest

from hps.rows.storage_types import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    INT8,
    STORAGE_NAMES,
    decode,
    encode,
    error_bound,
    first_unencodable_row,
    int8_layout,
    int8_scales,
    storage_type,
    unencodable_rows,
)

COMPACT = ("float16", "bfloat16", "int8")


def _within_bound(name: str, rows: np.ndarray) -> np.ndarray:
    decoded = decode(name, encode(name, rows), rows.shape[1])
    assert decoded.dtype == np.float32 and decoded.shape == rows.shape
    error = np.abs(decoded.astype(np.float64) - rows.astype(np.float64))
    return error <= error_bound(name, rows)


def _random_rows(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    # magnitudes over many decades, both signs: embeddings are mostly small, not all
    scale = 10.0 ** rng.uniform(-6, 4, size=(n, 1))
    return (rng.standard_normal((n, dim)) * scale).astype(np.float32)


def test_names_and_sizes() -> None:
    assert STORAGE_NAMES == ("float32", "float16", "bfloat16", "int8")
    assert [storage_type(n).row_bytes(64) for n in STORAGE_NAMES] == [256, 128, 128, 72]
    assert storage_type("int8").row_bytes(13) == 16 + 8  # padded so scale stays aligned
    assert storage_type(INT8) is INT8 and not FLOAT32.compact and INT8.compact
    with pytest.raises(ValueError, match="expected one of float32, float16, bfloat16, int8"):
        storage_type("fp8")


@pytest.mark.parametrize("name", COMPACT)
@pytest.mark.parametrize("dim", [1, 3, 16, 64, 129])
def test_random_rows_within_bound(name: str, dim: int) -> None:
    rng = np.random.default_rng()
    rows = _random_rows(rng, 2000, dim)
    assert _within_bound(name, rows).all()


@pytest.mark.parametrize("name", COMPACT)
def test_adversarial_rows_within_bound(name: str) -> None:
    limit = min(storage_type(name).max_magnitude, 3e38)
    big = np.float32(np.nextafter(np.float32(limit), np.float32(0)))
    tiny = np.float32(2.0**-140)
    rows = np.array([
        [7.25] * 8,                                      # constant
        [-0.0] * 8,                                      # negative zero
        [0.0, -0.0] * 4,
        [big, -big, 0, 1, -1, big / 2, -big / 3, 5],     # the widest range the type holds
        [tiny, -tiny, 2.0**-149, 0, tiny * 3, 0, 0, 0],  # subnormals
        [1000.0, 1000.0001, 1000.0002, 1000, 1000, 1000, 1000, 1000.0003],  # narrow range
        [1e-30, 1e-20, 1e-10, 1, 1e3, -1e3, -1e-30, 0],  # many decades
        [65504, -65504, 65519, 1, 2, 3, 4, 5],           # float16's edge
    ], np.float32)
    if name == "float16":
        rows[3, :2] = [60000.0, -60000.0]
    if name != "float16":
        rows = np.vstack([rows, np.array([[1e30, -1e30, 0, 1, 2, 3, -4, 1e29]], np.float32)])
    assert _within_bound(name, rows).all()


@pytest.mark.parametrize("name", COMPACT)
def test_constant_rows_are_exact(name: str) -> None:
    # values each type holds exactly: a constant row of them decodes to itself (int8: the
    # bias, whatever the value)
    values = np.array([0.0, 1.0, -3.5, 2.0**-20, 96.0, -0.125], np.float32)
    if name == "int8":
        values = np.concatenate([values, np.float32([0.1, -7.3e-5, 3.3e37])])
    rows = np.repeat(values[:, None], 16, axis=1)
    np.testing.assert_array_equal(decode(name, encode(name, rows), 16), rows)


def test_negative_zero_keeps_its_sign_in_float_types() -> None:
    rows = np.array([[-0.0, 0.0, -0.0, 1.0]], np.float32)
    for name in ("float16", "bfloat16"):
        decoded = decode(name, encode(name, rows), 4)
        np.testing.assert_array_equal(np.signbit(decoded), np.signbit(rows))
    decoded = decode("int8", encode("int8", np.full((1, 4), -0.0, np.float32)), 4)
    assert (decoded == 0).all()  # equal; int8 gives +0.0 back (documented)


def test_bfloat16_rounds_to_nearest_even() -> None:
    halfway = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF], np.uint32)
    bits = encode("bfloat16", halfway.view(np.float32)[None, :])[0]
    # ties go to the even upper half; just above rounds up, just below rounds down
    assert bits.tolist() == [0x3F80, 0x3F82, 0x3F81, 0x3F80]


def test_int8_layout_and_codes() -> None:
    rows = np.array([[0.0, 1.0, 2.0, 255.0, 127.4, 127.6]], np.float32)
    stored = encode("int8", rows)
    layout = int8_layout(6)
    assert layout == (16, 8, 12, 2, 3) and stored.shape == (1, 16)
    assert stored[0, :6].tolist() == [0, 1, 2, 255, 127, 128]
    assert stored[0, 6:8].tolist() == [0, 0]  # padding
    scale, bias = int8_scales(stored, 6)
    assert scale[0] == np.float32(1.0) and bias[0] == 0.0
    assert stored[0, 8:12].tobytes() == np.float32(1.0).tobytes()  # little-endian scale
    np.testing.assert_array_equal(decode("int8", stored, 6)[0], [0, 1, 2, 255, 127, 128])


def test_int8_decode_is_two_float32_roundings() -> None:
    rng = np.random.default_rng()
    rows = _random_rows(rng, 500, 32)
    stored = encode("int8", rows)
    scale, bias = int8_scales(stored, 32)
    q = stored[:, :32].astype(np.float32)
    expected = (q * scale[:, None]).astype(np.float32) + bias[:, None]
    np.testing.assert_array_equal(decode("int8", stored, 32), expected)


def test_float16_and_float32_round_trip() -> None:
    rows = np.array([[1.0, 0.1, -2.5, 65504.0]], np.float32)
    assert encode("float16", rows).dtype == np.float16
    np.testing.assert_array_equal(decode("float16", encode("float16", rows), 4),
                                  rows.astype(np.float16).astype(np.float32))
    assert encode("float32", rows) is rows
    np.testing.assert_array_equal(decode("float32", rows, 4), rows)


@pytest.mark.parametrize("name", COMPACT)
def test_unencodable_rows(name: str) -> None:
    rows = np.ones((6, 4), np.float32)
    rows[1, 2] = np.nan
    rows[3, 0] = -np.inf
    rows[4, 3] = np.float32(storage_type(name).max_magnitude)  # the first value refused
    assert unencodable_rows(name, rows).tolist() == [False, True, False, True, True, False]
    assert first_unencodable_row(name, rows) == 1
    assert first_unencodable_row(name, rows[[0, 2, 5]]) is None
    with pytest.raises(ValueError, match=f"row 1 holds NaN.*{name} cannot hold"):
        encode(name, rows)
    assert first_unencodable_row("float32", rows) is None


def test_largest_encodable_values_stay_finite() -> None:
    for t in (FLOAT16, BFLOAT16, INT8):
        edge = np.nextafter(np.float32(t.max_magnitude), np.float32(0))
        rows = np.array([[edge, -edge, 0.0, 1.0]], np.float32)
        assert np.isfinite(decode(t, encode(t, rows), 4)).all()
    # past the edge the float types would round to infinity
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(FLOAT16.max_magnitude).astype(np.float16))


def test_empty_rows() -> None:
    for name in STORAGE_NAMES:
        stored = encode(name, np.empty((0, 5), np.float32))
        assert stored.shape == (0, storage_type(name).row_width(5))
        assert decode(name, stored, 5).shape == (0, 5)
