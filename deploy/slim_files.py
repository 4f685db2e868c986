"""File removal for the CPU image's slimming scripts (deploy/slim_venv.py for the
virtual environment, deploy/slim_base.py for the base image's Python and leftovers): each
step removes paths and reports the bytes they held, so the build log says what a cut saved.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path


def size(path: Path) -> int:
    """Bytes a file, link or folder holds (a folder's files, links not followed)."""
    if path.is_dir() and not path.is_symlink():
        return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file())
    return path.lstat().st_size


def remove(paths: Iterable[Path]) -> int:
    """Remove files, links and folders; returns the bytes they held. A path already gone
    (inside a folder removed before, or never there) counts nothing."""
    freed = 0
    for path in paths:
        if not path.exists() and not path.is_symlink():
            continue
        freed += size(path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return freed


def drop_bytecode(folder: Path) -> int:
    """Remove every `__pycache__` under folder; returns the bytes freed. The modules a
    process then imports compile again, and write their bytecode back where they may."""
    return remove([p for p in folder.rglob("__pycache__") if p.is_dir()])
