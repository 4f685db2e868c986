"""The lookups on the lookup threads, watched: no request waits for one past its limit.

A lookup thread can be held by something that does not end: a tier that hangs, or what
a dead process left behind (a shared table's write that never ended is bounded where it
is read: hps/tiers/hash_map/shared_table.py). The request must not hang with it.
`LookupWatch.run` hands the lookup to the pool and awaits it; one task per app (every
TICK seconds: no timer made and cancelled per lookup, as the connections' deadlines are
kept, hps/http/connections.py) gives up on each lookup whose limit passed: LOOKUP_WAIT_S
after it was handed over, or its deadline if sooner. A lookup given up raises `GivenUp`
at once (the caller answers 504 past the deadline, else 503); its thread is counted in
`held` until it returns, and /readyz says not ready while any is.

Lookups run on the event loop (`lookup_threads` 0) are not watched: nothing else runs
while they do.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

#: seconds a lookup may take on a lookup thread before its request is answered without
#: it: within the 5 s a client may wait for an answer or a refusal, with TICK to spare
LOOKUP_WAIT_S = 4.0
#: seconds between two looks at the lookups running
TICK = 0.05


class GivenUp(Exception):
    """The lookup's limit passed before it returned (its thread is still held)."""


class LookupWatch:
    """The lookups of one app's thread pool, each with its limit (see the module)."""

    def __init__(self, wait_s: float = LOOKUP_WAIT_S) -> None:
        self.wait_s = wait_s
        #: lookup threads held by a lookup given up (until it returns)
        self.held = 0
        self._running: dict[asyncio.Future[Any], float] = {}  # future → its limit
        self._given_up: set[asyncio.Future[Any]] = set()
        self._task: asyncio.Task[None] | None = None

    async def run(self, executor: Executor, deadline: float | None,
                  fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on `executor`; GivenUp once its limit passed (see the module)."""
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = loop.create_task(self._watch(), name="hps-lookup-watch")
        work = executor.submit(fn, *args)
        future = asyncio.wrap_future(work, loop=loop)
        limit = time.monotonic() + self.wait_s
        self._running[future] = limit if deadline is None else min(limit, deadline)
        try:
            return await future
        except asyncio.CancelledError:
            if future not in self._given_up:
                raise  # the request itself was cancelled (its client went away)
            self._given_up.discard(future)
            self._hold(work, loop)
            raise GivenUp() from None
        finally:
            self._running.pop(future, None)

    def close(self) -> None:
        """Stop watching (the app stops)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _hold(self, work: Future[Any], loop: asyncio.AbstractEventLoop) -> None:
        """Count `work`'s thread as held until it returns (a lookup still queued was
        cancelled with its future: it returns at once)."""
        self.held += 1

        def released(_: Future[Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing to count
                loop.call_soon_threadsafe(self._release)

        work.add_done_callback(released)

    def _release(self) -> None:
        self.held -= 1

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            if not self._running:
                continue
            now = time.monotonic()
            for future, limit in list(self._running.items()):  # a loop over lookups
                if limit <= now and not future.done():
                    self._given_up.add(future)
                    future.cancel()
