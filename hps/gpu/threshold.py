"""HugeCTR's `hit_rate_threshold`, decided exactly.

A GPU lookup whose hit rate is *below* the threshold fetches its misses and inserts them
before it returns; at or above it, the misses keep the default value and are fetched in
the background. The hit rate is hits / keys, a ratio of integers, and the threshold is
what the config wrote in decimal ("0.93"); comparing them in floating point put 93 hits
of 100 below 0.93 (1 - 7/100 is 0.9299999999999999). Here both are exact fractions, and
the comparison is one integer multiplication per lookup.
"""

from __future__ import annotations

from fractions import Fraction


class HitRateThreshold:
    """`synchronous(misses, keys)`: whether a lookup with that hit rate is below the
    threshold (its misses are fetched before it returns)."""

    __slots__ = ("_den", "_num", "value")

    def __init__(self, threshold: float) -> None:
        if not threshold >= 0:
            raise ValueError(f"hit_rate_threshold must be >= 0, got {threshold}")
        self.value = float(threshold)
        # the decimal the config wrote: repr gives the shortest text of the same double
        exact = Fraction(repr(self.value))
        self._num, self._den = exact.numerator, exact.denominator

    def synchronous(self, misses: int, keys: int) -> bool:
        """True when (keys - misses) / keys < threshold; a lookup of no keys is not."""
        if keys <= 0:
            return False
        return (keys - misses) * self._den < self._num * keys
