"""Whether this thread's waits for a GPU query keep the GIL.

A query of at most HELD_KEYS keys spins on its miss count with the GIL kept
(hps/gpu/device_table.py _HELD_SPIN_KEYS has the measurements): among many caller threads
that each wait on the GPU, a released GIL became a hand-off per query that convoyed them.

A server's lookup thread is not among such callers. The GIL's other holder there is the
worker's event loop, which reads, parses and answers the other requests; a wait that
keeps the GIL stops it for the whole wait, where the host tiers' compiled loops leave it
free (issue 74: 8 workers, 2,000-key HTTP lookups, a GPU cache 0.65-1.34x the same server
without one). `release_gil_in_waits` marks the calling thread so that its waits release
the GIL; the server's lookup threads call it where `HPS_LOOKUP_GIL` says `release`.
"""

from __future__ import annotations

import threading

#: queries of at most this many keys keep the GIL through their wait, unless the thread
#: said otherwise
HELD_KEYS = 1 << 14

_local = threading.local()


def held_keys() -> int:
    """The largest query whose wait keeps the GIL on this thread (0: none does)."""
    return getattr(_local, "held", HELD_KEYS)


def release_gil_in_waits(release: bool = True) -> None:
    """This thread's GPU waits release the GIL (True) or keep it up to HELD_KEYS keys."""
    _local.held = 0 if release else HELD_KEYS
