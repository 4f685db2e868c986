"""HugeCTR's update message: encode and decode as arrays, every malformed kind refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hps.errors import BadUpdateError
from hps.updates import codec


def _message(keys: np.ndarray, vectors: np.ndarray, key_bytes: int = 8) -> bytes:
    """The format written out by hand, record by record (the spec, not the codec)."""
    out = b"HCTR" + struct.pack("<I", vectors.shape[1] * 4)
    fmt = "<q" if key_bytes == 8 else "<I"
    for key, row in zip(keys, vectors, strict=True):
        out += struct.pack(fmt, int(key)) + np.asarray(row, "<f4").tobytes()
    return out


@given(n=st.integers(0, 40), dim=st.integers(1, 9), key_bytes=st.sampled_from([4, 8]),
       seed=st.integers(0, 2**32 - 1))
def test_encode_matches_the_format_and_decodes_back(n: int, dim: int, key_bytes: int,
                                                    seed: int) -> None:
    rng = np.random.default_rng(seed)
    high = 2**32 if key_bytes == 4 else 2**62
    low = 0 if key_bytes == 4 else -(2**62)
    keys = rng.integers(low, high, n, dtype=np.int64)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    payload = codec.encode(keys, vectors, key_bytes=key_bytes)
    assert payload == _message(keys, vectors, key_bytes)
    got_keys, got_vectors = codec.decode(payload, dim=dim, key_bytes=key_bytes,
                                         uint32_keys=key_bytes == 4)
    assert got_keys.dtype == np.int64 and got_vectors.dtype == np.float32
    assert got_vectors.flags.c_contiguous and got_vectors.shape == (n, dim)
    np.testing.assert_array_equal(got_keys, keys)
    np.testing.assert_array_equal(got_vectors, vectors)


def _reason(payload: bytes, dim: int = 4, key_bytes: int = 8, uint32: bool = False) -> str:
    with pytest.raises(BadUpdateError) as info:
        codec.decode(payload, dim=dim, key_bytes=key_bytes, uint32_keys=uint32)
    assert info.value.reason in codec.REASONS
    return info.value.reason


def test_every_malformed_kind_names_its_reason() -> None:
    good = _message(np.array([1, 2]), np.ones((2, 4), np.float32))
    assert _reason(b"HCT") == "truncated"
    assert _reason(b"XCTR" + good[4:]) == "magic"
    assert _reason(good, dim=8) == "value_size"
    assert _reason(good[:-1]) == "truncated"
    assert _reason(good + b"\0" * 5) == "truncated"
    nan = _message(np.array([1, 2]), np.array([[0, 0, 0, 0], [0, np.nan, 0, 0]], np.float32))
    assert _reason(nan) == "non_finite"
    inf = _message(np.array([1]), np.array([[np.inf, 0, 0, 0]], np.float32))
    assert _reason(inf) == "non_finite"
    # int64 keys on a supportlonglong: false server (key_bytes 8): [0, 2**32) only
    assert _reason(_message(np.array([2**32]), np.ones((1, 4), np.float32)),
                   uint32=True) == "key_range"
    assert _reason(_message(np.array([-1]), np.ones((1, 4), np.float32)),
                   uint32=True) == "key_range"
    keys, _ = codec.decode(_message(np.array([2**32 - 1]), np.ones((1, 4), np.float32)),
                           dim=4, key_bytes=8, uint32_keys=True)
    assert keys.tolist() == [2**32 - 1]


def test_header_only_message_holds_no_rows() -> None:
    keys, vectors = codec.decode(b"HCTR" + struct.pack("<I", 16), dim=4, key_bytes=8,
                                 uint32_keys=False)
    assert keys.size == 0 and vectors.shape == (0, 4)


def test_encode_refuses_what_a_consumer_would_skip() -> None:
    with pytest.raises(BadUpdateError) as info:
        codec.encode(np.array([2**32]), np.ones((1, 2), np.float32), key_bytes=4)
    assert info.value.reason == "key_range"
    with pytest.raises(BadUpdateError) as info:
        codec.encode(np.array([1]), np.full((1, 2), np.nan, np.float32))
    assert info.value.reason == "non_finite"
    with pytest.raises(BadUpdateError) as info:
        codec.encode(np.array([1, 2]), np.ones((3, 2), np.float32))
    assert info.value.reason == "value_size"
    with pytest.raises(BadUpdateError):
        codec.encode(np.array([1.5]), np.ones((1, 2), np.float32))
