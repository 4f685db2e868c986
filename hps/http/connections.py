"""Slow and idle clients: per-connection deadlines and a bound on connections.

uvicorn times out idle keep-alive connections but not a client that sends half a request
header and waits (slowloris): such connections held a descriptor each until the process
ran out of them and stopped answering everyone. `guarded_protocol(settings)` returns
uvicorn's HTTP protocol class (httptools when installed, else h11) with:

- a header deadline: a request's headers must be complete `header_timeout` seconds after
  the connection opened, or after the previous response;
- a body deadline: while a request body is coming, each part must follow the previous
  one within `body_timeout` seconds;
- the keep-alive timeout (uvicorn's own, `keep_alive_timeout`);
- a bound of `max_connections`: when a connection beyond it arrives, the connection that
  has waited longest on its client (for headers, a body, or the next request) is closed
  to make room; connections whose request the server is working on are never closed for
  it. When all are busy, the newcomer is closed.

A client that closes its sending side after a whole request (half-close) is answered,
then its connection closed (`eof_received`).

A connection closed for any of these is aborted (its descriptor freed at once) and
counted in `ConnectionGuard.closed` by reason; the log says so once a minute.

At shutdown (SIGTERM, SIGINT) every connection drains: a request in flight is answered
with `Connection: close`; an idle kept-alive connection stays open DRAIN_IDLE_SECONDS, so
a request a client sent on it meanwhile is answered (with `Connection: close`) rather
than met with a reset, then it is closed ("drained").
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hps.config import HttpConfig
from hps.http.direct import direct_answers
from hps.http.framing import framing_answers
from hps.runtime.throttled_log import ThrottledLog

log = logging.getLogger("hps.http")

#: seconds an idle kept-alive connection stays open once the server drains
DRAIN_IDLE_SECONDS = 2.0


@dataclass
class ConnectionGuard:
    """The shared state of one server's connections (used on its event loop only)."""

    max_connections: int
    header_timeout: float
    body_timeout: float
    #: connections closed by reason: "header_timeout", "body_timeout", "evicted", "full"
    closed: dict[str, int] = field(default_factory=dict)
    open: int = 0
    draining: bool = False  # the server shuts down: every answer says Connection: close
    #: called once a connection is gone (a worker's board hears of it at once:
    #: accept_share.py)
    on_gone: Callable[[], None] | None = None
    _waiting: OrderedDict[Any, None] = field(default_factory=OrderedDict)
    _log: ThrottledLog = field(default_factory=lambda: ThrottledLog(log))

    def admit(self, conn: Any) -> bool:
        """Count a new connection; make room by closing the longest-waiting ones.
        False when every other connection is busy (the caller closes itself)."""
        self.open += 1
        while self.open > self.max_connections and self._waiting:
            victim, _ = self._waiting.popitem(last=False)
            victim.hps_close("evicted")
        if self.open > self.max_connections:
            return False
        return True

    def waiting(self, conn: Any) -> None:
        """`conn` waits on its client from now (the newest such)."""
        self._waiting.pop(conn, None)
        self._waiting[conn] = None

    def busy(self, conn: Any) -> None:
        """The server works on `conn`'s request: it is not to be evicted."""
        self._waiting.pop(conn, None)

    def gone(self, conn: Any, reason: str | None) -> None:
        """`conn` closed (by us for `reason`, or by its client when None)."""
        self._waiting.pop(conn, None)
        self.open -= 1
        if self.on_gone is not None:
            self.on_gone()
        if reason is not None:
            self.closed[reason] = self.closed.get(reason, 0) + 1
            self._log.warning(reason, "closing slow or surplus HTTP connections (%s; %d "
                              "so far, %d open, limit %d)", reason.replace("_", " "),
                              self.closed[reason], self.open, self.max_connections)


def uvicorn_options(http: HttpConfig) -> dict[str, Any]:
    """The uvicorn.Config settings that apply `http`'s timeouts and connection bound
    (a fresh `ConnectionGuard`, reachable as the protocol class's `guard`), and the
    headers of every answer."""
    guard = ConnectionGuard(http.max_connections, http.header_timeout, http.body_timeout)
    return {"http": guarded_protocol(guard), "timeout_keep_alive": http.keep_alive_timeout,
            # on every answer, the direct ones too (direct.py writes uvicorn's headers):
            # a browser never reads an answer as another type than it says
            "headers": [("X-Content-Type-Options", "nosniff")]}


def protocol_base() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class: httptools when installed, else h11 (its "auto")."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:  # pragma: no cover - depends on the environment
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def guarded_protocol(guard: ConnectionGuard,
                     base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """`base` (uvicorn's HTTP protocol) with the deadlines and the bound of `guard`,
    answering what is not HTTP in JSON (hps/http/framing.py); the httptools protocol also
    answers the hot routes directly (hps/http/direct.py)."""
    parent: Any = framing_answers(base or protocol_base())
    if getattr(parent, "on_headers_complete", None) is not None:  # httptools' callbacks
        parent = direct_answers(parent)

    class GuardedProtocol(parent):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._hps_timer: asyncio.TimerHandle | None = None
            self._hps_due: tuple[float, str] | None = None  # the deadline armed, its reason
            self._hps_cycle: Any = None
            self._hps_closed: str | None = None
            self._hps_counted = False
            super().connection_made(transport)
            self._hps_counted = True
            if not guard.admit(self):
                self.hps_close("full")
                return
            self._await_request()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._hps_closed is not None:
                return
            if self._hps_refusal is not None:  # refused (framing.py): answered, not read
                self._disarm()
                guard.busy(self)
                return
            # a request answered directly (hps/http/direct.py) whose body is coming
            request: Any = getattr(self, "_hps_pending", None)
            if request is None:
                request = self.cycle
                if request is None or request.response_complete:
                    return  # still waiting for a request's headers: the deadline stands
            if request is not self.cycle or getattr(request, "more_body", False):
                # a body is coming: part by part
                if request is not self._hps_cycle or self._hps_timer is not None:
                    self._hps_cycle = request
                    guard.waiting(self)
                    self._arm(guard.body_timeout, "body_timeout")
            else:  # the request is in: the server works on it
                self._hps_cycle = request
                self._disarm()
                guard.busy(self)

        def shutdown(self) -> None:
            """Drain (see the module): answer what is in flight or on its way, then close."""
            guard.draining = True
            pending: Any = getattr(self, "_hps_pending", None)
            if pending is not None:  # a direct answer whose body is coming
                pending.keep_alive = False
            elif self.cycle is None or self.cycle.response_complete:
                self._arm(DRAIN_IDLE_SECONDS, "drained")
            else:
                super().shutdown()

        def eof_received(self) -> bool | None:
            """The client closed its side (`shutdown(SHUT_WR)` after its request): keep
            writing while a whole request of it is still to be answered, then close.

            uvicorn returned None here: asyncio then closed the transport, the handler
            saw a disconnect and its answer was dropped (every route whose handler
            waits once, /v1/models and /metrics among them). A request whose body had
            not all come can never complete: that connection still closes at once."""
            if self._hps_closed is not None:
                return None
            if self._hps_refusal:  # a 400 waits for earlier answers (framing.py)
                return True
            cycle = self.cycle
            if (getattr(self, "_hps_pending", None) is not None or cycle is None
                    or cycle.response_complete or cycle.more_body):
                return None  # nothing to answer, or a body that never completes
            cycle.keep_alive = False  # the newest request: answered with Connection: close
            return True

        def on_headers_complete(self) -> None:  # httptools' callback (h11 has none)
            super().on_headers_complete()
            if guard.draining:  # a request that came during the drain: the last one
                pending: Any = getattr(self, "_hps_pending", None)
                if pending is not None:
                    pending.keep_alive = False
                elif self.cycle is not None:
                    self.cycle.keep_alive = False

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._hps_closed is None and not self.transport.is_closing():
                self._await_request()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm(cancel=True)
            if self._hps_counted and self._hps_closed is None:
                self._hps_closed = "client"
                guard.gone(self, None)
            super().connection_lost(exc)

        def hps_close(self, reason: str) -> None:
            """Abort the connection (its descriptor is freed at once)."""
            if self._hps_closed is not None:
                return
            self._hps_closed = reason
            self._disarm(cancel=True)
            guard.gone(self, reason)
            self.transport.abort()

        def _await_request(self) -> None:
            guard.waiting(self)
            self._arm(guard.header_timeout, "header_timeout")

        # A deadline is armed and disarmed with every request, so it is an attribute
        # (`_hps_due`), and the connection's one timer is made only when none is pending
        # that fires no later; a timer that finds its deadline moved on arms again for the
        # rest (`_hps_expire`). A timer made and cancelled per request (uvloop: a libuv
        # handle opened and closed) cost 2.9-5.8 us a request against 0.2-0.4 us so.
        def _arm(self, seconds: float, reason: str) -> None:
            due = self.loop.time() + seconds
            self._hps_due = (due, reason)
            timer = self._hps_timer
            if timer is not None:
                if timer.when() <= due:
                    return  # it fires first, and arms again for the rest
                timer.cancel()
            self._hps_timer = self.loop.call_at(due, self._hps_expire)

        def _disarm(self, cancel: bool = False) -> None:
            self._hps_due = None
            if cancel and self._hps_timer is not None:  # the connection is gone
                self._hps_timer.cancel()
                self._hps_timer = None

        def _hps_expire(self) -> None:
            self._hps_timer = None
            due = self._hps_due
            if due is None:
                return
            if due[0] > self.loop.time():
                self._hps_timer = self.loop.call_at(due[0], self._hps_expire)
            else:
                self.hps_close(due[1])

    GuardedProtocol.__name__ = f"Guarded{parent.__name__}"
    GuardedProtocol.guard = guard
    return GuardedProtocol
