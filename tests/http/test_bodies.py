"""Bodies of the hot routes (hps/http/bodies.py): the declared length every limit reads,
and the JSON encoders of answers."""

from __future__ import annotations

import json

import numpy as np

from hps.http import bodies


def test_declared_length_reads_only_plain_decimal_digits() -> None:
    assert bodies.declared_length({"content-length": "800"}) == 800
    assert bodies.declared_length({"content-length": "0"}) == 0
    for value in ("", " 8", "-8", "8.0", "0x10", "\u0661"):  # (a digit, not ASCII)
        assert bodies.declared_length({"content-length": value}) is None, value
    assert bodies.declared_length({}) is None
    for value in ("\u00b2", "1\u00b2", "\u0661"):  # digits to str.isdigit, not to int
        assert bodies.parse_length(value) is None, value


def test_json_encoders_agree_and_write_null_for_non_finite() -> None:
    vectors = np.array([[0.1, -2.5e-8, 3.4e38], [np.nan, np.inf, -np.inf]], dtype=np.float32)
    payload = {"model": "m", "table": "t", "width": 3, "count": 2}
    plain = json.loads(bodies.encode_json_stdlib({**payload, "vectors": vectors}))
    fast = json.loads(bodies.encode_json({**payload, "vectors": vectors}))
    assert plain == {**payload, "vectors": [[float(np.float32(0.1)), float(np.float32(-2.5e-8)),
                                             float(np.float32(3.4e38))], [None, None, None]]}
    assert np.array_equal(np.asarray(fast["vectors"][0], np.float32), vectors[0])
    assert fast["vectors"][1] == [None, None, None]
