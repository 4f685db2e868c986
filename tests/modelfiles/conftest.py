"""Fixtures for the model-source tests; the S3 server (`s3_server`) is
tests/support/s3_server.py's."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def model_arrays() -> tuple[np.ndarray, np.ndarray]:
    """A small table: 300 shuffled int64 keys × float32 vectors of width 8."""
    rng = np.random.default_rng()
    keys = rng.permutation(np.arange(-150, 150, dtype=np.int64) * 7919)
    vectors = rng.standard_normal((keys.size, 8)).astype(np.float32)
    return keys, vectors
