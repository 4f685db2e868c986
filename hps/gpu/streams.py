"""Which CUDA stream handles name the same stream.

Work queued on one stream runs in order, so a write queued on the stream of a query in
flight needs no event to follow it (DeviceTable._after_queries skips that wait). Handles
are compared as keys (`stream_key`): a created stream's handle, which names one stream in
the process. The legacy default stream's handle (0, or cudaStreamLegacy) is the same
integer on every device but names another stream on each, so its key carries the device:
a sharded table's shard is queried and written from every device's streams, and a write
from one device's default stream that took another device's query on its default stream
for its own stream skipped the wait and rewrote slots under the query (four H200s, the
pushed lookups with misses: wrong rows). The per-thread default stream's handle is the
same integer in every thread but names another stream in each, so it never counts as the
same.

The lookup path itself keeps its waits on its own stream (the miss positions' release,
the last write, the staging buffers' reuse): skipping them there removed driver calls
but measured no faster on the H100, and in most same-run pairs slower, on the HugeCTR
profile.
"""

from __future__ import annotations

#: cudaStreamLegacy (handle 0 names the same stream)
LEGACY_STREAM = 1
#: cudaStreamPerThread
PER_THREAD_STREAM = 2


def stream_key(handle: int, device: int) -> int:
    """The key of stream `handle` of `device`: the handle, but for the legacy default
    stream's, which is one stream a device (a negative key per device)."""
    if handle == 0 or handle == LEGACY_STREAM:
        return -1 - device
    return handle


def same_stream(a: int, b: int) -> bool:
    """Whether keys `a` and `b` (stream_key; or two handles of one device) surely name one
    stream."""
    return a == b and a != PER_THREAD_STREAM
