"""The `stacklevel` that points a warning at the user's line rather than at library code.

A warning raised deep inside a call (a config check under pydantic under `HPS(...)`) is
shown with the file and line of the frame `stacklevel` names; a fixed number breaks as
soon as the call path changes, so the frames are counted instead.
"""

from __future__ import annotations

import sys


def caller_stacklevel(internal: tuple[str, ...]) -> int:
    """For `warnings.warn` called by the caller of this function: the stacklevel of the
    first frame whose file is not under one of the `internal` folder prefixes (the
    outermost frame when every one is, as under a command-line entry point)."""
    frame = sys._getframe(1)  # the function that warns: stacklevel 1
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(internal):
        frame = frame.f_back
        level += 1
    return level
