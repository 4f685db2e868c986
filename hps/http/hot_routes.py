"""The hot routes (`POST /v1/…/lookup`, `POST /v2/models/{model}/infer`) and the three
ways a request of one is answered, all through the route's one handler.

A hot route is a `HotRoute`: its path pattern, the route as FastAPI declares it (what
OpenAPI describes and metrics label the request with), its `Handler`, and its protocol's
error body. A handler reads the body from an ASGI receive channel and returns (response
headers, body parts), raising for bad input: the token, the limits, the media type, the
lookup and the answer's encoding are the handler's, the same on every path. `HotRoutes`
answers a request of a hot route:

- `HotRoutes.respond`, the general path: FastAPI's middleware, router and dependencies,
  then the route's declaration (`routes.py`, `kserve/routes.py`) calls the handler; its
  errors go to the app's exception handlers (`app.py`);
- `HotRoutes.__call__`, ahead of FastAPI: `app.ServiceApp` hands it every request that
  `match` finds;
- `HotRoutes.answer_whole`, without an ASGI task: uvicorn's protocol hands it a request
  whose whole body is in (`direct.py`).

Both shortcuts answer a handler's error with `error_answer` (the same body, status and
count as the app's exception handlers give) and count the request with `observe`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from hps.http.bodies import Answer
from hps.http.metrics import ANSWERED_BY_CONNECTION, CLIENT_CLOSED

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from hps.http.errors import ErrorBody
    from hps.http.state import ServiceState

Handler = Callable[["ServiceState", Mapping[str, str], "Receive", dict[str, str | None]],
                   Coroutine[Any, Any, Answer]]

#: the request headers the handlers read (ASGI gives names in lower case)
READ_HEADERS = frozenset({b"content-type", b"content-length", b"authorization", b"host",
                          b"content-encoding", b"inference-header-content-length",
                          b"x-hps-deadline-ms", b"x-hps-key-dtype"})


@dataclass(frozen=True)
class HotRoute:
    """One POST route answered ahead of FastAPI."""

    pattern: re.Pattern[str]  # matched against the path; its groups go to the handler
    route: Any  # the route as FastAPI declares it: what metrics label the request with
    handle: Handler
    error_body: ErrorBody  # the protocol's error body

    @classmethod
    def declared(cls, routes: Iterable[Any], path: str, pattern: re.Pattern[str],
                 handle: Handler, error_body: ErrorBody) -> HotRoute:
        """The hot route of the route among `routes` (a router's) declared at `path`."""
        return cls(pattern, next(r for r in routes if getattr(r, "path", None) == path),
                   handle, error_body)


def read_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The headers the handlers read of raw (lower-case name, value) pairs."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k in READ_HEADERS}


def _whole_receive(body: bytes) -> Receive:
    """An ASGI receive channel that gives `body` whole, at once."""
    message = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict[str, Any]:
        return message

    return receive


async def _send_answer(send: Send, headers: list[tuple[bytes, bytes]],
                       parts: Sequence[bytes | memoryview]) -> None:
    """A 200 answer; the body parts go out as they are (no join of large buffers)."""
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    last = len(parts) - 1
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part, "more_body": i < last})


class HotRoutes:
    """The hot routes of one app, and their answers: `respond` (the general path),
    `__call__` and `answer_whole` (its shortcuts)."""

    def __init__(self, state: ServiceState, routes: Sequence[HotRoute]) -> None:
        self.state = state
        self.routes = tuple(routes)
        self.answered_directly = 0  # requests `answer_whole` took
        self.refused_directly = 0  # refusals `refuse_whole` took

    def match(self, scope: Scope) -> tuple[HotRoute, dict[str, str | None]] | None:
        """(route, path parameters) of a request of a hot route, else None."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        return self.match_path(path)

    def match_path(self, path: str) -> tuple[HotRoute, dict[str, str | None]] | None:
        """(route, path parameters) of a POST to `path` (below the root path), else None."""
        for route in self.routes:
            match = route.pattern.match(path)
            if match is not None:  # ASGI paths come percent-decoded: the names as sent
                return route, match.groupdict()
        return None

    @staticmethod
    async def respond(handle: Handler, state: ServiceState, request: Request,
                      params: dict[str, str | None]) -> Response:
        """The general path: a handler's answer as a starlette Response, for a hot route
        as FastAPI declares it (reached when the shortcuts are bypassed)."""
        headers, parts = await handle(state, request.headers, request.receive, params)
        response = Response(b"".join(parts))
        response.raw_headers = headers
        return response

    # Shortcut: skips FastAPI's middleware (error, telemetry and body-limit layers, the
    # metrics middleware), router, dependency solving and request models, each a measurable
    # share of a request whose work is a short compiled lookup. With the lock-free request
    # metrics and the one-buffer v2 answer it took a v2 request's server CPU from 406 to
    # 385 µs with 8 clients and 517 to 468 µs alone (2-core machine, `hps bench http`;
    # v1 within the runs' spread): docs/benchmarks.md, "HTTP".
    async def __call__(self, scope: Scope, receive: Receive, send: Send, route: HotRoute,
                       params: dict[str, str | None]) -> None:
        """Answer one request of `route` (as `match` found it) and count it."""
        started = time.perf_counter()
        scope["route"] = route.route
        status = 500  # what the request is counted as when no answer went out
        try:
            if self.state.admission.shed_now():  # before a header is read: admission.py
                status = await self.state.admission.refuse_early(send, route.error_body)
                return
            headers, parts = await route.handle(self.state, read_headers(scope["headers"]),
                                                receive, params)
            status = 200
            await _send_answer(send, headers, parts)
        except ClientDisconnect:  # nobody to answer (or the connection answered: it
            status = CLIENT_CLOSED  # counted that, ANSWERED_BY_CONNECTION)
        except Exception as exc:
            if status == 200:  # the answer had started: nothing more can be said
                raise
            response = self.error_answer(route, scope, exc)
            status = response.status_code
            await response(scope, receive, send)
        finally:
            if ANSWERED_BY_CONNECTION not in scope:
                self.observe(route, status, time.perf_counter() - started)

    @property
    def answers_whole(self) -> bool:
        """Whether `answer_whole` may be used: the handlers never wait on a thread (no
        lookup thread pool, `lookup_threads` 0), so they finish without a task."""
        return self.state.lookup_threads == 0

    # Shortcut: skips uvicorn's ASGI cycle (an `asyncio.Event`, a task, the proxy-headers
    # middleware, the app's `__call__` chain, two `send` calls that re-check every header,
    # a turn of the event loop). On the 2-core machine a bare ASGI app on uvicorn costs its
    # server 143-151 µs a 256 KB request (one client's p50 214-237 µs) where a plain uvloop
    # protocol costs 85-88 µs (p50 163-174 µs); with it the server's CPU per request, one
    # client, went from 299 to 275 µs (v1) and 311 to 279 µs (v2): docs/benchmarks.md,
    # "HTTP".
    def answer_whole(self, route: HotRoute, params: dict[str, str | None],
                     headers: Mapping[str, str], body: bytes, scope: Scope
                     ) -> tuple[int, list[tuple[bytes, bytes]], Sequence[bytes | memoryview]]:
        """(status, headers, body parts) of a request of `route` whose whole `body` is in,
        answered without waiting (only where `answers_whole`). The caller counts it
        (`observe`)."""
        scope["route"] = route.route
        self.answered_directly += 1
        try:
            handling = route.handle(self.state, headers, _whole_receive(body), params)
            try:
                handling.send(None)
            except StopIteration as done:
                answer_headers, parts = done.value
                return 200, answer_headers, parts
            handling.close()
            raise RuntimeError(f"{route.route.path} waited outside a task")
        except Exception as exc:
            response = self.error_answer(route, scope, exc)
            return response.status_code, response.raw_headers, (response.body,)

    # Shortcut: a refusal under overload costs the event loop's time that the admitted
    # lookups need, and clients that ignore Retry-After send thousands a second. Answered
    # by the connection itself (hps/http/direct.py) it skips uvicorn's ASGI cycle, which
    # was most of what a refusal cost once its body was encoded up front.
    def refuse_whole(self, route: HotRoute
                     ) -> tuple[int, list[tuple[bytes, bytes]], Sequence[bytes]]:
        """(status, headers, body parts) of a refusal of a request of `route` (the caller
        found `state.admission.shed_now()` true): the bytes `__call__` sends. The caller
        counts it (`observe`)."""
        self.refused_directly += 1
        headers, body = self.state.admission.refusal(route.error_body)
        return 503, headers, (body,)

    def error_answer(self, route: HotRoute, scope: Scope, exc: Exception) -> JSONResponse:
        """The answer to an error of `route`'s handler, in its protocol's form."""
        return self.state.error_response(Request(scope), exc, route.error_body)

    def observe(self, route: HotRoute, status: int, seconds: float) -> None:
        """Count one request of `route` answered with `status` after `seconds`."""
        self.state.metrics.observe_request(route.route.path, "POST", status, seconds)

    def count_abandoned(self, route: HotRoute) -> None:
        """Count one request of `route` that its client left before its body was whole
        (answered to no one: CLIENT_CLOSED), where its time is not known."""
        self.state.metrics.count_request(route.route.path, "POST", CLIENT_CLOSED)
