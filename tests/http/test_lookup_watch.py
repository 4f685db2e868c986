"""LookupWatch on a real thread pool: a lookup that does not return is given up at its
limit (LOOKUP_WAIT_S, or its deadline if sooner), its thread counted as held until it
returns; a lookup still queued behind it is cancelled and never runs."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hps.http.lookup_watch import TICK, GivenUp, LookupWatch
from hps.tiers.hash_map import shared_table
from hps.tiers.hash_map.shared import SharedHashMapTier
from hps.tiers.hash_map.shared_table import SharedTable
from tests.http.conftest import MODEL, Live, ModelFiles, serving, wait_until


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


def _shared(model: ModelFiles) -> ModelFiles:
    """The model over the hash map in shared memory (a run folder of its own)."""
    config = {**copy.deepcopy(model.config),
              "volatile_db": {"type": "multi_process_hash_map", "num_partitions": 4}}
    return ModelFiles(model.dir, config, model.keys, model.vectors)


def _odd(live: Live) -> SharedTable:
    """The users table's sequence counter made odd by this process (a write that does
    not end: the writer alive)."""
    tier = live.server.tiers.volatile
    assert isinstance(tier, SharedHashMapTier)
    table = tier._table(live.server.model(MODEL).table("users").storage_name)
    assert isinstance(table, SharedTable)
    table.begin_write()
    return table


def test_a_lookup_held_past_the_limit_is_refused_and_readyz_says_stalled(
        model_files: ModelFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over HTTP, a lookup thread held (a shared table's write that does not end; its
    own bound set out of the way): 503 lookup_stalled at the limit, /readyz 503
    `stalled` until the thread is free, then answers right again."""
    monkeypatch.setattr(shared_table, "READ_WAIT", 60.0)
    with serving(_shared(model_files), lookup_threads=2) as live:
        live.app.state.hps.lookups.wait_s = 0.5
        keys = model_files.keys[0][:16]
        table = _odd(live)
        try:
            started = time.monotonic()
            answer = live.lookup_binary("users", keys)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["kind"] == "lookup_stalled"
            assert answer.headers["Retry-After"] == "1"
            assert time.monotonic() - started < 0.5 + 5 * TICK
            ready = live.client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["status"] == "stalled"
        finally:
            table.end_write()
        wait_until(lambda: live.client.get("/readyz").status_code == 200, timeout=5)
        answer = live.lookup_binary("users", keys)
        assert answer.status_code == 200
        np.testing.assert_array_equal(
            np.frombuffer(answer.content, "<f4").reshape(keys.size, -1),
            model_files.expected(0, keys))


def test_a_table_left_mid_write_without_a_persistent_tier_is_a_503_not_defaults(
        model_files: ModelFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    """No tier below holds the rows: the lookup is refused (table_unreadable), never
    answered with default values."""
    monkeypatch.setattr(shared_table, "READ_WAIT", 0.2)
    with serving(_shared(model_files), lookup_threads=0) as live:
        table = _odd(live)
        try:
            answer = live.lookup_binary("users", model_files.keys[0][:16])
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["kind"] == "table_unreadable"
        finally:
            table.end_write()
        assert live.lookup_binary("users", model_files.keys[0][:16]).status_code == 200
