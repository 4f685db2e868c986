"""How many CPU cores this process may run on.

`os.cpu_count()` counts the machine's cores; a container or a `taskset` may give the
process fewer (its affinity mask), and threads beyond those only queue. Work split over
threads (loads, bulk writes, the benchmarks' file writers) asks here.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores in this process's affinity mask (the machine's count where the OS has no
    affinity call); at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)
