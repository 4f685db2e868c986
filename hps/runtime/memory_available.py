"""How much host memory the system can still give this process.

Linux's MemAvailable (free pages plus the caches it can drop) is the figure that says
whether a table fits before anything is allocated: the loader checks in-process tiers
against it, the uvm table its pinned host rows.
"""

from __future__ import annotations


def available_memory() -> int | None:
    """Bytes of memory the system can give this process now (Linux MemAvailable), None
    where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
