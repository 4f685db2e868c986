"""Pinned lookup results (hps/gpu/host_memory.py pinned_empty): pinned and writable within
the limits, plain NumPy past them, the bytes given back when the array and its views go;
and HPS.lookup's results on a GPU table, exact and pinned."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hps import write_sparse_model
from hps.api import HPS
from hps.gpu import host_memory

pytestmark = pytest.mark.gpu


def _pinned(cp: Any, array: np.ndarray) -> bool:
    """Whether CUDA knows the array's memory as pinned host memory."""
    attrs = cp.cuda.runtime.pointerGetAttributes(array.ctypes.data)
    return int(attrs.type) == 1  # cudaMemoryTypeHost


def test_pinned_within_the_limits_and_given_back(cp: Any) -> None:
    alive = host_memory._results.alive
    rows = host_memory.pinned_empty(cp, (300, 7), np.float32)
    assert rows.shape == (300, 7) and rows.dtype == np.float32
    assert rows.flags.c_contiguous and rows.flags.writeable
    assert _pinned(cp, rows)
    assert host_memory._results.alive == alive + 300 * 7 * 4
    rows[:] = 1.5
    view = rows[10:20]
    del rows
    gc.collect()
    assert host_memory._results.alive == alive + 300 * 7 * 4  # the view keeps it
    assert (view == 1.5).all()
    del view
    gc.collect()
    assert host_memory._results.alive == alive


def test_numpy_past_the_limits(cp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    big = host_memory.pinned_empty(cp, (host_memory.PINNED_RESULT_BYTES // 4 + 1,),
                                   np.float32)
    assert big.flags.owndata and not _pinned(cp, big)
    monkeypatch.setattr(host_memory, "PINNED_RESULTS_BYTES",
                        host_memory._results.alive + (1 << 20))
    held = host_memory.pinned_empty(cp, (1 << 18,), np.float32)  # 1 MiB: all that is left
    assert _pinned(cp, held)
    more = host_memory.pinned_empty(cp, (16,), np.float32)
    assert more.flags.owndata and not _pinned(cp, more)
    empty = host_memory.pinned_empty(cp, (0, 4), np.float32)
    assert empty.shape == (0, 4)


def test_hps_lookup_returns_pinned_exact_rows(cp: Any, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    keys = rng.choice(2**40, 5000, replace=False).astype(np.int64)
    rows = rng.standard_normal((5000, 16)).astype(np.float32)
    write_sparse_model(tmp_path / "t0", keys, rows)
    hps = HPS({"supportlonglong": True, "models": [{
        "model": "m", "sparse_files": [str(tmp_path / "t0")],
        "embedding_vecsize_per_table": [16],
        "maxnum_catfeature_query_per_table_per_sample": [4096],
        "default_value_for_each_table": [0.0], "deployed_device_list": [0],
        "max_batch_size": 1, "gpucache": True, "gpucacheper": 0.5,
        "hit_rate_threshold": 1.0}], "volatile_db": {"type": "hash_map"}})
    try:
        for _ in range(3):  # misses first, then hits
            pick = rng.integers(0, 5000, 3000)
            got = hps.lookup(keys[pick], "m", 0)
            np.testing.assert_array_equal(got, rows[pick])
            assert _pinned(cp, got)
            held = [hps.lookup(keys[pick[:8]], "m", 0) for _ in range(4)]  # kept: distinct
            assert len({a.ctypes.data for a in held}) == 4
            for a in held:
                np.testing.assert_array_equal(a, rows[pick[:8]])
    finally:
        hps.close()


def test_mapped_address_of_pinned_memory_only(cp: Any) -> None:
    pinned = host_memory.pinned_empty(cp, (64, 4), np.float32)
    assert host_memory.mapped_address(cp, pinned.ctypes.data) != 0
    assert host_memory.mapped_address(cp, np.empty((64, 4), np.float32).ctypes.data) == 0
