"""GPU tests: they run where CuPy and a CUDA device are (scripts/gpu_check.sh on the GPU
machine). Elsewhere every test marked `gpu` is skipped; the modules still import, since
none imports CuPy at module level (the `cp` fixture does).

Every test that draws random data takes the `seed` fixture: a fresh seed per run, printed
(pytest shows it with a failure), so a failing sequence can be replayed with HPS_SEED=<n>.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps.gpu.table import cuda_available

with warnings.catch_warnings():  # CuPy's import-time notices are not test failures
    warnings.simplefilter("ignore")
    HAVE_CUDA = cuda_available()
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA device (run scripts/gpu_check.sh)")
    for item in items:
        if item.get_closest_marker("gpu") and _HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


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
