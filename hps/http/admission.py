"""Admission of lookups to the lookup threads: shed at the door, by the queueing delay
an arrival would meet, rather than queued.

A lookup that runs on the lookup thread pool is counted in `queued` from when it is
admitted (`enter`) until its answer is ready (`leave`): waiting for a thread, then on one.
`Admission` sheds an arrival (503 `overloaded` with `Retry-After`) when

- `queued` has reached `bound` (the hard limit: it holds when nothing drains), or
- at least `floor` lookups are in, and the delay the arrival would wait exceeds `target_s`:
  the lookups ahead of it times the measured time between two answers while every
  thread is busy (`drain_gap_s`, a running mean). Measured, not configured: it holds the
  lookup itself, the event loop's share of the CPU and what else runs on the machine, so
  the admitted depth follows the server's real pace (a few lookups per thread for short
  lookups, none waiting for long ones); or
- at least `floor` lookups are in and none has answered for `STALL_TARGETS` targets (a
  stalled tier: nothing more queues behind it).

Below `floor` nothing is shed: a few clients, each waiting for its answer before it asks
again, cannot overload the server, however slow a tier is at the moment (a Redis
restarting, a reload under way); shedding them would only fail requests the server can
answer. Once the server sheds, more clients are asking than that floor lets in, and a
lower one holds until a second passes without a refusal (`shedding_floor`): the queue
stays short while the overload lasts (a floor of 8 lookups on 2 threads put the served
p99 over 10 ms under 64 client processes; 4 kept it at 8-9 ms at the same served rate).

A queue shorter than `target_s` is a good queue (a burst that drains at once); a longer
one only makes every answer later, so what would join it is refused while refusing is
cheap, before its body is read. `Retry-After` is the seconds the lookups refused in the
last second would take at the drain rate: 1 unless refusals outrun what the server
serves, at most `MAX_RETRY_AFTER_S`.

A lookup whose deadline (`X-HPS-Deadline-Ms`, the v2 `timeout`) passes while it waits is
not run (`run` raises `Expired`; the caller answers 504).

The general path (each hot route's handler: `ServiceState.admit`, after the token) and
its shortcut (`refuse_early`, ahead of the handler, a pre-encoded answer) apply the same
rule (`shed_now`). Event loop only, except `run` (on a lookup thread).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from starlette.types import Send

    from hps.http.errors import ErrorBody

T = TypeVar("T")

#: default target of the queueing delay an admitted lookup meets. Well below the 10 ms
#: p99 the served requests are held to under overload (`hps bench http --overload`): the
#: clients' own scheduling on a loaded machine adds milliseconds (64 client processes on 2
#: cores: p99 8.0-8.9 ms with 2 ms, 10.1-12.0 ms with 3 ms, at the same served rate).
TARGET_DELAY_S = 0.002
#: no answer for this many targets (30 ms) while every thread is taken sheds what arrives
#: (a stalled tier). Shorter pauses are the machine's: on the shared 2-core machine under
#: 64 client processes the server is descheduled for milliseconds at a time, and
#: counting such a pause as the pace shed clients the server had room for.
STALL_TARGETS = 15
#: the most seconds `Retry-After` asks a client to wait
MAX_RETRY_AFTER_S = 30
#: weight of the newest gap in the running mean (about the last 20 answers count)
_NEW_WEIGHT = 0.05
#: the message of a refusal (the same on both paths)
SHED_MESSAGE = ("the server is at capacity (its lookup queue would delay this lookup "
                "past its target): retry after Retry-After seconds")


class Expired(Exception):
    """A lookup whose deadline passed while it waited for a thread (not started)."""


class Admission:
    """The admission rule of one app's lookup threads (see the module). `on_shed` is
    called once per refusal, `on_early_answer` once per refusal `refuse_early` answers
    (the metrics count them as the general path's error answer does)."""

    def __init__(self, threads: int, bound: int, target_s: float = TARGET_DELAY_S, *,
                 floor: int = 0, shedding_floor: int | None = None,
                 on_shed: Callable[[], None] | None = None,
                 on_early_answer: Callable[[], None] | None = None) -> None:
        self.threads = max(1, threads)
        self.bound = bound
        self.floor = min(floor, bound)
        #: the floor within a second of a refusal (default: `floor`)
        self.shedding_floor = self.floor if shedding_floor is None else min(
            shedding_floor, self.floor)
        self._last_shed = -math.inf  # monotonic time of the last refusal
        self.target_s = target_s
        self.on_shed = on_shed
        self.on_early_answer = on_early_answer
        #: lookups admitted and not answered yet
        self.queued = 0
        #: mean seconds between two answers while every thread is busy (0: not measured)
        self.drain_gap_s = 0.0
        self._last_done: float | None = None  # the last answer of the busy spell, if any
        self._busy_since = 0.0  # when every thread last became taken
        self._second = 0.0  # the start of the second refusals are counted in
        self._shed_this_second = 0
        self._shed_last_second = 0
        self._refusals: dict[tuple[int, str], tuple[list[tuple[bytes, bytes]], bytes]] = {}

    def shed_now(self) -> bool:
        """Whether a lookup arriving now is refused."""
        queued = self.queued
        if queued >= self.bound:
            return True
        ahead = queued - self.threads + 1  # answers it waits for before a thread is free
        if ahead <= 0 or queued < self._floor_now():
            return False
        if ahead * self.drain_gap_s > self.target_s:
            return True
        # no answer at all for many targets: a stalled tier, not a pause of the process
        since = time.perf_counter() - (self._last_done or self._busy_since)
        return since > STALL_TARGETS * self.target_s

    def _floor_now(self) -> int:
        """The floor: `shedding_floor` within a second of the last refusal, else `floor`."""
        shedding = time.monotonic() - self._last_shed <= 1.0
        return self.shedding_floor if shedding else self.floor

    def enter(self) -> None:
        """One lookup admitted."""
        self.queued += 1
        if self.queued == self.threads and self._last_done is None:
            self._busy_since = time.perf_counter()

    def leave(self) -> None:
        """One admitted lookup answered (or given up)."""
        now = time.perf_counter()
        if self._last_done is not None:  # every thread was busy since that answer
            gap = now - self._last_done
            self.drain_gap_s += (_NEW_WEIGHT if self.drain_gap_s else 1.0) * (
                gap - self.drain_gap_s)
        self.queued -= 1
        self._last_done = now if self.queued >= self.threads else None

    def count_shed(self) -> str:
        """Count one refusal; the `Retry-After` value to send with it."""
        if self.on_shed is not None:
            self.on_shed()
        now = self._last_shed = time.monotonic()
        if now - self._second >= 1.0:
            self._shed_last_second = self._shed_this_second if now - self._second < 2.0 else 0
            self._shed_this_second = 0
            self._second = now
        self._shed_this_second += 1
        waiting = max(self._shed_last_second, self._shed_this_second)
        return str(min(MAX_RETRY_AFTER_S, max(1, math.ceil(waiting * self.drain_gap_s))))

    @staticmethod
    def run(deadline: float | None, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a lookup thread, unless `deadline` passed while it waited
        (Expired)."""
        if deadline is not None and time.monotonic() >= deadline:
            raise Expired()
        return fn(*args)

    # Shortcut: the refusal answered ahead of the handler, with a body encoded once per
    # protocol and Retry-After value. It skips the header copy, the token check, the
    # exception, the JSON encoding of the error and the response object of the general
    # path (the handler's `ServiceState.admit`); under overload a refusal is the answer
    # sent most, so it must cost next to nothing. Measured: docs/http.md, "Overload".
    async def refuse_early(self, send: Send, error_body: ErrorBody) -> int:
        """Answer 503 `overloaded` on `send` (the caller found `shed_now` true) in the
        protocol's `error_body`; returns the status. The caller counts the request in
        the request metrics, as any answer."""
        headers, body = self.refusal(error_body)
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return 503

    def refusal(self, error_body: ErrorBody) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """(headers, body) of one 503 `overloaded` answer in the protocol's `error_body`,
        counted as a refusal answered early (the caller found `shed_now` true and sends
        it; hps/http/direct.py writes it to the connection itself)."""
        answer = self._refusal(error_body, self.count_shed())
        if self.on_early_answer is not None:
            self.on_early_answer()
        return answer

    def _refusal(self, error_body: ErrorBody, retry_after: str
                 ) -> tuple[list[tuple[bytes, bytes]], bytes]:
        key = (id(error_body), retry_after)
        answer = self._refusals.get(key)
        if answer is None:
            body = json.dumps(error_body("overloaded", SHED_MESSAGE),
                              separators=(",", ":")).encode()
            answer = self._refusals[key] = (
                [(b"content-type", b"application/json"),
                 (b"content-length", str(len(body)).encode()),
                 (b"retry-after", retry_after.encode())], body)
        return answer
