"""A GPU cache's fill from the model files as a step of the load's progress
(hps/server/counted_chunks.py), over a real table's chunks read from its files: the
count says what the consumer took, chunk by chunk, up to the cache's capacity, and the
lines say it in keys in the cache, never "0 of N"."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from hps.config import load_config
from hps.modelfiles.formats import ModelReader
from hps.server.counted_chunks import CountedChunks
from hps.server.loader import LoadProgress, open_reader
from hps.server.progress_lines import LineProgress
from tests.conftest import model_config, write_table

KEYS, DIM, CHUNK = 10_000, 8, 1_000


class _Steps(LoadProgress):
    def __init__(self) -> None:
        self.started: tuple[str, int, str] | None = None
        self.steps: list[int] = []
        self.finished = 0

    def start_step(self, what: str, total: int, unit: str) -> None:
        self.started = (what, total, unit)

    def step(self, done: int) -> None:
        self.steps.append(done)

    def finish_step(self, seconds: float) -> None:
        self.finished += 1


def _reader(tmp_path: Path) -> ModelReader:
    keys = np.arange(KEYS, dtype=np.int64)
    write_table(tmp_path / "t", keys, np.ones((KEYS, DIM), np.float32))
    config = load_config({"models": [model_config([str(tmp_path / "t")], [DIM])]})
    return open_reader(config, config.models[0], 0)


def _fill(chunks: Iterable[tuple[np.ndarray, np.ndarray]], capacity: int) -> int:
    """Takes chunks as a dynamic cache's fill does: until it holds `capacity` keys, the
    last chunk cut to fit (hps/gpu/fill.py)."""
    held = 0
    for keys, _ in chunks:
        if held >= capacity:
            break
        held += min(keys.size, capacity - held)
    return held


def test_a_fill_counts_what_the_cache_took_chunk_by_chunk(tmp_path: Path) -> None:
    reader = _reader(tmp_path)
    try:
        for capacity, total in ((KEYS, KEYS), (4_500, 4_500)):  # static-like, dynamic
            steps = _Steps()
            filled = CountedChunks(steps, "filling the GPU cache of m/t on GPU 0", total)
            took = _fill(filled.chunks(reader.chunks(chunk_keys=CHUNK)), capacity)
            filled.finish()
            assert steps.started == ("filling the GPU cache of m/t on GPU 0", total,
                                     "keys in the cache")
            assert took == total and sum(steps.steps) == total and filled.done == total
            assert len(steps.steps) >= total // CHUNK and steps.finished == 1
    finally:
        reader.close()


def test_a_fill_that_runs_a_while_says_so_in_lines(tmp_path: Path) -> None:
    said: list[str] = []
    lines = LineProgress(said.append, every=0.01)
    reader = _reader(tmp_path)
    try:
        filled = CountedChunks(lines, "filling the GPU cache of m/t on GPU 0", KEYS)

        def slowly() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for chunk in reader.chunks(chunk_keys=CHUNK):
                seen = len(said)
                while len(said) == seen:  # a line between two chunks
                    time.sleep(0.005)
                yield chunk

        _fill(filled.chunks(slowly()), KEYS)
        filled.finish()
    finally:
        reader.close()
        lines.close()
    counts = [int(m.group(1).replace(",", "")) for m in map(re.compile(
        r"filling the GPU cache of m/t on GPU 0: ([\d,]+) of 10,000 keys in the cache "
        r"\(\d+%\), \d+ s so far").fullmatch, said) if m]
    assert counts == sorted(counts) and len(set(counts)) >= 5, said
    assert said[-1].startswith("filling the GPU cache of m/t on GPU 0: done in ")
    assert said[-1].endswith("10,000 of 10,000 keys in the cache")
    assert not [line for line in said if re.search(r"\b0 of [\d,]+|\(0%\)", line)], said
