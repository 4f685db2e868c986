"""Compiled-code set-up: where numba caches when the usual places are read-only."""

from __future__ import annotations

import importlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hps.runtime import compiled

#: the hash map's compiled loops, the kernels this test caches
HASH_MAP_LOOPS = "hps.tiers.hash_map.loops"


def test_explicit_numba_cache_dir_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/somewhere")
    monkeypatch.setattr(compiled, "_writable_dir", lambda path: False)
    assert compiled.cache_dir() is None


def test_private_temp_dir_when_package_and_home_are_read_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(compiled, "_writable_dir", lambda path: False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(compiled.tempfile, "tempdir", None)
    chosen = compiled.cache_dir()
    assert chosen == str(tmp_path / f"hps-numba-{os.getuid()}")
    assert stat.S_IMODE(os.stat(chosen).st_mode) == 0o700


def test_writable_dir_is_tried_for_real(tmp_path: Path) -> None:
    assert compiled._writable_dir(str(tmp_path / "new" / "folder"))
    assert not compiled._writable_dir("/proc/hps-cannot-be-here")


def test_kernels_load_from_a_fresh_cache_dir(tmp_path: Path) -> None:
    """A process with its own NUMBA_CACHE_DIR compiles the hash map kernels there at import,
    and a second process loads them from that cache."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    code = (f"import sys, {HASH_MAP_LOOPS} as k; s = k.fetch.stats; "
            "print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))")
    runs = [subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=600,
                           capture_output=True, text=True).stdout.split() for _ in range(2)]
    # fetch has one signature per stored/output type pair: compiled into the cache, then
    # loaded from it
    pairs = str(len(_fetch_signatures()))
    assert runs == [["0", pairs], [pairs, "0"]]
    cached = list(tmp_path.rglob("*.nbi"))
    # numba names a cache file after the module's file: <file stem>.<function>-<line>...
    stem = HASH_MAP_LOOPS.rpartition(".")[2]
    assert any(p.name.startswith(f"{stem}.") for p in cached), cached


def _fetch_signatures() -> list[object]:
    return list(importlib.import_module(HASH_MAP_LOOPS).fetch.signatures)
