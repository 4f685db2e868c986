"""Which CUDA stream handles name the same stream.

Work queued on one stream runs in order, so a wait for work queued earlier on the stream
a caller is about to use costs nothing and needs no event: the lookup path skips those
waits (each is a driver call of several microseconds). Handles are compared as the
integers CuPy and torch hand out. The per-thread default stream's handle is the same
integer in every thread but names another stream in each, so it never counts as the same.
"""

from __future__ import annotations

#: cudaStreamPerThread
PER_THREAD_STREAM = 2


def same_stream(a: int, b: int) -> bool:
    """Whether handles `a` and `b` surely name one stream."""
    return a == b and a != PER_THREAD_STREAM
