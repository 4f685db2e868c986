"""The GPU cache's fill from the model files as a step of the load's progress
(hps/server/counted_chunks.py, gpu_caches.py `_fill`), heard on the GPU machine from a
real load: a line while it fills, counted in keys in the cache, rising with the chunks
the cache takes, never "0 of N (0%)" while work goes on, and a last line that says done
with the whole count."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from hps.server import HierarchicalParameterServer
from hps.server.loader import BothProgress, LoadProgress
from hps.server.progress_lines import LineProgress
from tests.conftest import model_config, write_table
from tests.server.test_progress_lines import _Lines

pytestmark = pytest.mark.gpu

KEYS, DIM = 10_240, 16
FILLING = re.compile(r"filling the GPU cache of m/sparse_embedding0 on GPU 0: (?:none of "
                     r"[\d,]+ keys in the cache yet|([\d,]+) of ([\d,]+) keys in the cache "
                     r"\(\d+%\)), \d+ s so far")


class _OneLinePerStep(LoadProgress):
    """Holds each counted advance of a step until a progress line came after it: the
    fill goes on at the pace of the lines, so each chunk's count is seen, on any
    machine."""

    def __init__(self, said: _Lines) -> None:
        self.said = said

    def step(self, done: int) -> None:
        self.said.wait_after(len(self.said.lines))


def test_the_fill_of_a_gpu_cache_says_its_count_as_the_cache_takes_chunks(
        tmp_path: Path) -> None:
    keys = np.arange(KEYS, dtype=np.int64) * 3 + 11
    vectors = np.random.default_rng(5).standard_normal((KEYS, DIM)).astype(np.float32)
    write_table(tmp_path / "t0", keys, vectors)
    # a dynamic cache of the whole table, filled 5% of its capacity a chunk
    config = {"models": [model_config([str(tmp_path / "t0")], [DIM], gpucache=True,
                                      gpucacheper=1.0, embedding_cache_type="dynamic",
                                      cache_refresh_percentage_per_iteration=0.05)],
              "volatile_db": {"type": "hash_map"}}
    said = _Lines()
    lines = LineProgress(said.say, every=0.02)
    try:
        progress = BothProgress(lines, _OneLinePerStep(said))
        with HierarchicalParameterServer(config, progress=progress) as server:
            assert server.gpu_enabled
            np.testing.assert_array_equal(server.lookup("m", 0, keys[:64]), vectors[:64])
    finally:
        lines.close()
    filling = [line for line in said.lines if line.startswith("filling the GPU cache ")]
    assert filling, said.lines
    matched = [FILLING.fullmatch(line) for line in filling[:-1]]
    assert all(matched), filling  # every line but the last says how far
    counts = [int(m.group(1).replace(",", "")) for m in matched if m and m.group(1)]
    assert len(set(counts)) >= 5 and counts == sorted(counts), filling
    assert re.fullmatch(r"filling the GPU cache of m/sparse_embedding0 on GPU 0: done in "
                        r"[\d.]+ s, 10,240 of 10,240 keys in the cache", filling[-1]), filling
    assert not [line for line in said.lines if re.search(r"\b0 of [\d,]+|\(0%\)", line)]
