"""LookupWatch on a real thread pool: a lookup that does not return is given up at its
limit (LOOKUP_WAIT_S, or its deadline if sooner), its thread counted as held until it
returns; a lookup still queued behind it is cancelled and never runs."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hps.http.lookup_watch import TICK, GivenUp, LookupWatch


def test_a_lookup_that_returns_is_answered_and_its_error_raised() -> None:
    async def main() -> None:
        watch = LookupWatch(wait_s=1.0)
        with ThreadPoolExecutor(1) as pool:
            assert await watch.run(pool, None, lambda x: x + 1, 41) == 42
            with pytest.raises(ZeroDivisionError):
                await watch.run(pool, None, lambda: 1 / 0)
        watch.close()
        assert watch.held == 0

    asyncio.run(main())


def test_a_lookup_that_does_not_return_is_given_up_and_its_thread_counted() -> None:
    release = threading.Event()
    ran: list[str] = []

    async def main() -> None:
        watch = LookupWatch(wait_s=0.3)
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            stuck = asyncio.ensure_future(watch.run(pool, None, release.wait))
            # queued behind it on the one thread: given up at its (sooner) deadline
            queued = asyncio.ensure_future(watch.run(pool, time.monotonic() + 0.1,
                                                     ran.append, "queued"))
            with pytest.raises(GivenUp):
                await queued
            assert time.monotonic() - started < 0.1 + 3 * TICK
            with pytest.raises(GivenUp):
                await stuck
            assert 0.3 <= time.monotonic() - started < 0.3 + 3 * TICK
            await asyncio.sleep(TICK)
            assert watch.held == 1  # the stuck one; the queued one was cancelled
            release.set()
            while watch.held:
                await asyncio.sleep(0.01)
            assert await watch.run(pool, None, lambda: "after") == "after"
        watch.close()

    asyncio.run(main())
    assert ran == []  # the queued lookup never ran
