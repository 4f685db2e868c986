"""Where numba caches compiled code, set before numba is imported.

numba writes next to the package (`__pycache__`) when it can, else in the user's cache
folder. When neither is writable (a read-only site-packages and no home, as in some
containers) it would refuse to cache at all, so this module points `NUMBA_CACHE_DIR` at a
private folder under the system's temporary directory first. An explicit
`NUMBA_CACHE_DIR` always wins. Every module of hps that uses numba imports it from here
(`numba`), directly or through hps/runtime/compiled.py.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any


def _writable_dir(path: str) -> bool:
    """Whether files can be created in `path` (created if missing)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            return True
    except OSError:
        return False


def _user_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "numba")


def cache_dir() -> str | None:
    """The folder numba should cache into, or None when its own choice works.

    None when NUMBA_CACHE_DIR is set or the package folder or the user cache folder is
    writable; else a private folder in the temporary directory (created, mode 0700).
    """
    if os.environ.get("NUMBA_CACHE_DIR"):
        return None
    package = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")
    if _writable_dir(package) or _writable_dir(_user_cache_dir()):
        return None
    private = os.path.join(tempfile.gettempdir(), f"hps-numba-{os.getuid()}")
    os.makedirs(private, mode=0o700, exist_ok=True)
    return private


def _configure() -> Any:
    fallback = cache_dir()
    if fallback is not None:
        os.environ["NUMBA_CACHE_DIR"] = fallback
    import numba

    if fallback is not None:
        # numba reads the environment once, at its import; set it for an earlier import too
        numba.config.CACHE_DIR = fallback  # type: ignore[attr-defined]
    return numba


numba = _configure()
