"""hit_rate_threshold decided exactly (the CPU side of hps/gpu/threshold.py; the GPU
lookups at the boundary are in tests/gpu/test_lookup.py): a hit rate just below the
threshold is synchronous, at it and just above it background."""

from __future__ import annotations

import pytest

from hps.gpu.threshold import HitRateThreshold


@pytest.mark.parametrize("threshold", [0.9, 0.93, 0.5, 0.1, 0.99, 1.0, 0.333])
@pytest.mark.parametrize("keys", [10, 100, 1000, 3, 7, 2_000_003])
def test_below_at_above(threshold: float, keys: int) -> None:
    decide = HitRateThreshold(threshold)
    # the fewest hits that reach the threshold: ceil(threshold × keys), exactly
    from fractions import Fraction

    at = -(-Fraction(repr(threshold)) * keys // 1)
    for hits, synchronous in ((at - 1, True), (at, False), (at + 1, False)):
        if 0 <= hits <= keys:
            assert decide.synchronous(keys - hits, keys) is synchronous, (hits, keys)


def test_float_rounding_does_not_move_the_boundary() -> None:
    """93 hits of 100 is at 0.93: 1 - 7/100 is 0.9299999999999999 in floats, which put
    such a lookup below the threshold (synchronous)."""
    assert 1.0 - 7 / 100 < 0.93  # the float comparison's error
    assert HitRateThreshold(0.93).synchronous(7, 100) is False
    assert HitRateThreshold(0.93).synchronous(8, 100) is True


def test_edges() -> None:
    assert HitRateThreshold(1.0).synchronous(0, 10) is False  # all hits: at 1.0
    assert HitRateThreshold(1.01).synchronous(0, 10) is True  # above 1: always synchronous
    assert HitRateThreshold(0.0).synchronous(10, 10) is False  # 0: never
    assert HitRateThreshold(0.9).synchronous(0, 0) is False  # no keys: nothing to fetch
    with pytest.raises(ValueError, match=">= 0"):
        HitRateThreshold(-0.1)
