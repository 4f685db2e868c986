"""The GPU miss path's host side is compiled by the warm-up (hps/server/warm_paths.py),
which sends a GPU cache no key it lacks: after `_warm_staging`, the staging a lookup's
misses take (hps/gpu/host_loops.py, both twins, one table or sharded) compiles nothing.
A CPU test: the staging is compiled host code; nothing here reaches a device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CODE = """
import numpy as np
from hps.gpu import host_loops
from hps.runtime.compile_on_use import compile_events
from hps.server.warm_paths import _warm_staging

_warm_staging()
heard = []
with compile_events(lambda e: heard.append(e.function) if e.seconds is not None else None):
    for n in (37, 3000):  # other sizes than the warm-up's, each twin
        missed = np.random.default_rng(n).integers(0, 2**40, n)
        unique, inverse = np.empty(n, np.int64), np.empty(n, np.int32)
        codes, starts = np.empty(n, np.uint64), np.zeros(5, np.int64)
        u = host_loops.stage(missed, 64, unique, inverse, codes)
        assert np.array_equal(np.sort(unique[:u]), np.unique(missed))
        host_loops.stage_sharded(missed, 4, 64, unique, inverse, codes, starts)
        assert starts[-1] == u
print(heard)
"""


def test_the_warm_up_compiles_the_gpu_miss_paths_staging(tmp_path: Path) -> None:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}  # nothing read from a cache
    done = subprocess.run([sys.executable, "-c", CODE], env=env, timeout=600,
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
