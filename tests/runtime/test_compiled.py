"""Compiled code: kernels compiled into numba's cache, and their GIL-holding twins."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

#: the hash map's compiled loops, the kernels this test caches
HASH_MAP_LOOPS = "hps.tiers.hash_map.loops"


def test_a_process_compiles_what_it_calls_into_a_fresh_cache_dir(tmp_path: Path) -> None:
    """A process with its own NUMBA_CACHE_DIR that fetches float32 rows from the hash map
    (a batch large enough for the kernel itself, not its GIL-holding twin) compiles
    fetch for that one row type (of the five declared), into that cache; a second
    process loads it from there and compiles nothing."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    code = ("import numpy as np; from hps.tiers.hash_map import HashMapTier, loops as k; "
            "t = HashMapTier(); t.create_table('t', 4); "
            "t.insert('t', np.arange(10**4), np.ones((10**4, 4), np.float32)); "
            "v, found = t.fetch('t', np.arange(2 * 10**4)); assert found.sum() == 10**4; "
            "s = k.fetch.stats; print(len(k.fetch.signatures), len(k.fetch.declared), "
            "sum(s.cache_hits.values()), sum(s.cache_misses.values()))")
    runs = [subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=600,
                           capture_output=True, text=True).stdout.split() for _ in range(2)]
    declared = str(len(_fetch_signatures()))
    assert runs == [["1", declared, "0", "1"], ["1", declared, "1", "0"]]
    cached = list(tmp_path.rglob("*.nbi"))
    # numba names a cache file after the module's file: <file stem>.<function>-<line>...
    stem = HASH_MAP_LOOPS.rpartition(".")[2]
    assert any(p.name.startswith(f"{stem}.fetch-") for p in cached), cached


def _fetch_signatures() -> list[object]:
    return list(importlib.import_module(HASH_MAP_LOOPS).fetch.declared)


def _python_steps_during(call: Callable[[], object]) -> int:
    """How many loop steps another Python thread made while `call()` ran on this one."""
    steps = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            steps[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        while steps[0] < 1000:  # the counter runs
            time.sleep(0.001)
        before = steps[0]
        call()
        return steps[0] - before
    finally:
        stop.set()
        counter.join()


def test_holding_gil_twin_keeps_the_gil_its_kernel_releases_it() -> None:
    """The lookup path's small compiled calls (host_loops.stage, the hash map's small
    fetches) keep the GIL so that no other thread's Python runs inside a lookup; the
    kernels for large batches release it. Both give the same answer."""
    from hps.gpu import host_loops

    keys = np.random.default_rng(0).integers(0, 2**62, 4_000_000, dtype=np.int64)
    keys[3::3] = keys[1:-2:3]  # repeats to fold
    out = [(np.empty(keys.size, np.int64), np.empty(keys.size, np.int32),
            np.empty(keys.size, np.uint64)) for _ in range(2)]
    found: list[int] = []
    # compiled at first use: compile both before timing (a compile runs Python, and the
    # other thread's steps with it)
    host_loops.stage_misses(keys[:64], 4099, *(a[:64] for a in out[0]))
    host_loops.stage_misses_held(keys[:64], 4099, *(a[:64] for a in out[1]))
    released = _python_steps_during(
        lambda: found.append(host_loops.stage_misses(keys, 4099, *out[0])))
    held = _python_steps_during(
        lambda: found.append(host_loops.stage_misses_held(keys, 4099, *out[1])))
    assert found[0] == found[1] < keys.size
    for a, b in zip(out[0], out[1], strict=True):
        np.testing.assert_array_equal(a[:found[0]], b[:found[0]])
    # held: the other thread runs only around the call (at most a switch interval or
    # two); released: the whole call long, on another core
    assert held * 4 < released, (held, released)
    assert host_loops.stage(keys[:100], 7, *out[1]) == np.unique(keys[:100]).size
