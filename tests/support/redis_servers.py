"""Real `redis-server` processes for the tests (re-exported from `hps.tools.bench.redis_servers`,
where the benchmark uses them too), plus a polling helper for the fault tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from hps.tools.bench.redis_servers import (
    RedisBinaryMissing,
    RedisClusterProcs,
    RedisServer,
    free_port,
    redis_binary,
)

__all__ = [
    "RedisBinaryMissing",
    "RedisClusterProcs",
    "RedisServer",
    "eventually",
    "free_port",
    "redis_binary",
]

T = TypeVar("T")


def eventually(fn: Callable[[], T], timeout: float, what: str) -> T:
    """Call `fn` until it returns without raising, for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} within {timeout} s: {exc!r}") from exc
        time.sleep(0.05)
