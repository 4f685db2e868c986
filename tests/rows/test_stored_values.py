"""decode_rows: stored values → rows, bad sizes set aside as not found."""

from __future__ import annotations

import numpy as np

from hps.rows.stored_values import decode_rows


def row(*values: float) -> bytes:
    return np.array(values, "<f4").tobytes()


def test_all_present_and_some_missing() -> None:
    rows, good, bad = decode_rows([row(1, 2), row(3, 4)], 2)
    np.testing.assert_array_equal(rows, [[1, 2], [3, 4]])
    assert good.tolist() == [True, True] and bad == 0
    rows, good, bad = decode_rows([None, row(5, 6), None], 2)
    np.testing.assert_array_equal(rows, [[5, 6]])
    assert good.tolist() == [False, True, False] and bad == 0
    rows, good, bad = decode_rows([None, None], 2)
    assert rows.shape == (0, 2) and not good.any() and bad == 0


def test_values_of_other_sizes_are_set_aside() -> None:
    values = [row(1, 2), row(1, 2, 3), None, b"", row(7, 8), b"xyz"]
    rows, good, bad = decode_rows(values, 2)
    np.testing.assert_array_equal(rows, [[1, 2], [7, 8]])
    assert good.tolist() == [True, False, False, False, True, False]
    assert bad == 3
