"""Which CUDA stream handles name the same stream.

Work queued on one stream runs in order, so a write queued on the stream of a query in
flight needs no event to follow it (DeviceTable._after_queries skips that wait). Handles
are compared as the integers CuPy and torch hand out. The per-thread default stream's
handle is the same integer in every thread but names another stream in each, so it never
counts as the same.

The lookup path itself keeps its waits on its own stream (the miss positions' release,
the last write, the staging buffers' reuse): skipping them there removed driver calls
but measured no faster on the H100, and in most same-run pairs slower, on the HugeCTR
profile.
"""

from __future__ import annotations

#: cudaStreamPerThread
PER_THREAD_STREAM = 2


def same_stream(a: int, b: int) -> bool:
    """Whether handles `a` and `b` surely name one stream."""
    return a == b and a != PER_THREAD_STREAM
