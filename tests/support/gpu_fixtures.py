"""Fixtures of the GPU tests and of every test that draws random data (a pytest plugin,
registered by tests/conftest.py, so every folder sees them).

GPU tests carry the `gpu` mark (a module's `pytestmark` or per test) and may live beside
their topic anywhere under tests/: CI deselects them (`-m "not gpu"`, scripts/test.sh),
the GPU machine selects them (`-m gpu`, scripts/gpu_check.sh). None imports CuPy at
module level, so every module still imports where CuPy is missing; the `cp` fixture
hands it to a test. Where CuPy is installed it is imported here, once, with its
import-time notices silenced: warnings are errors in the tests, and those notices are not
test failures.

Every test that draws random data takes the `rng` fixture (through `seed`): a fresh seed
per run, printed (pytest shows it with a failure), so a failing sequence can be replayed
with HPS_SEED=<n>.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("cupy") is not None:  # elsewhere nothing to import (and no cost)
    from hps.gpu.table import cuda_available

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cuda_available()


@pytest.fixture
def cp() -> Any:
    return pytest.importorskip("cupy")


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    value = int(os.environ.get("HPS_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"{request.node.nodeid}: seed={value}")
    return value


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)
