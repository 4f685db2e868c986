"""What a server's lookup thread (HTTP and gRPC) sets up once, when it starts.

Its GPU waits: a GPU query's wait keeps the GIL by default (hps/gpu/gil_wait.py says why);
in a server the GIL's other holder is the event loop, stopped for as long as the wait
lasts. `HPS_LOOKUP_GIL=release` makes the lookup threads release it in every wait, `keep`
(the default) keeps the in-process callers' rule.
"""

from __future__ import annotations

import os

#: the environment variable that picks the lookup threads' GIL rule in GPU waits
GIL_ENV = "HPS_LOOKUP_GIL"
GIL_RULES = ("keep", "release")


def gil_rule() -> str:
    """`HPS_LOOKUP_GIL`'s rule (an unknown value reads as the default, `keep`)."""
    rule = os.environ.get(GIL_ENV, "keep").strip().lower()
    return rule if rule in GIL_RULES else "keep"


def lookup_thread_start() -> None:
    """The lookup thread pool's initializer."""
    if gil_rule() == "release":
        from hps.gpu.gil_wait import release_gil_in_waits

        release_gil_in_waits()
