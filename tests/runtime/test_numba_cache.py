"""Where numba caches: the usual places, or a private folder when they are read-only."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hps.runtime import numba_cache


def test_explicit_numba_cache_dir_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/somewhere")
    monkeypatch.setattr(numba_cache, "_writable_dir", lambda path: False)
    assert numba_cache.cache_dir() is None


def test_private_temp_dir_when_package_and_home_are_read_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(numba_cache, "_writable_dir", lambda path: False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(numba_cache.tempfile, "tempdir", None)
    chosen = numba_cache.cache_dir()
    assert chosen == str(tmp_path / f"hps-numba-{os.getuid()}")
    assert stat.S_IMODE(os.stat(chosen).st_mode) == 0o700


def test_writable_dir_is_tried_for_real(tmp_path: Path) -> None:
    assert numba_cache._writable_dir(str(tmp_path / "new" / "folder"))
    assert not numba_cache._writable_dir("/proc/hps-cannot-be-here")
