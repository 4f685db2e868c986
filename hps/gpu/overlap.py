"""Host work that runs while the GPU answers a lookup.

A GPU lookup waits on the host for its query kernel's miss count (DeviceTable.query_ptr
spins on it for the ~20 µs the kernel takes at 2,000 keys). A caller with host work of
its own for the next call can hand it over for that wait instead of paying for it on its
own time: hps.torch's LookupLayer allocates the output of its next call there, which
cost it 5.5-7.6 µs of its ~35 µs call on the H100 (`torch.empty`).

The task is per thread: `set_task(task, arg)` before the lookup, `set_task(None)` after (in a
`finally`). The lookup runs it at most once, after its kernel is queued; a lookup that
queues no kernel (host-only models, empty batches) does not run it. A task must not
raise, and must not call back into the lookup.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_local = threading.local()


def set_task(task: Callable[[Any], None] | None, arg: Any = None) -> None:
    """`task(arg)` is what the next GPU lookup of this thread runs while it waits (None:
    nothing). The argument is separate so a caller builds no closure per call."""
    _local.task = (task, arg) if task is not None else None


def has_task() -> bool:
    """Whether this thread has set a task for its next lookup."""
    return getattr(_local, "task", None) is not None


def run_task() -> None:
    """Run this thread's task, if any, once (the lookup calls it while the GPU works)."""
    pending = getattr(_local, "task", None)
    if pending is not None:
        _local.task = None
        pending[0](pending[1])
