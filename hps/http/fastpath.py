"""`FastPath`: answers the lookup routes ahead of FastAPI and its middleware stack.

The hot routes (`POST /v1/…/lookup`, `POST /v2/models/{model}/infer`) skip FastAPI's
middleware (error, telemetry and body-limit layers, the metrics middleware), router,
dependency solving and request models: each is a `FastRoute` whose handler reads the body
from the ASGI channel and returns (headers, body parts). `app.ServiceApp` hands a request
to `FastPath` when `match` finds its route; FastPath answers errors in the route's
protocol and counts the request in the metrics itself. The routes are still declared to
FastAPI (`routes.py`, `kserve.py`) so that OpenAPI describes them and metrics label them;
a declaration answers through the same handler if the fast path is ever bypassed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from hps.http.state import ServiceState

#: what a handler answers: the response headers and the body, in one or more parts
Answer = tuple[list[tuple[bytes, bytes]], Sequence[bytes | memoryview]]
Handler = Callable[["ServiceState", Mapping[str, str], "Receive", dict[str, str | None]],
                   Coroutine[Any, Any, Answer]]
ErrorAnswer = Callable[["ServiceState", Request, Exception], Response]

#: the request headers the handlers read (ASGI gives names in lower case)
READ_HEADERS = frozenset({b"content-type", b"content-length", b"authorization",
                          b"content-encoding", b"inference-header-content-length"})


@dataclass(frozen=True)
class FastRoute:
    """One POST route answered by the fast path."""

    pattern: re.Pattern[str]  # matched against the path; its groups go to the handler
    route: Any  # the route as FastAPI declares it: what metrics label the request with
    handle: Handler
    on_error: ErrorAnswer  # the protocol's error answer


def request_headers(scope: Scope) -> dict[str, str]:
    """The request headers the handlers read, names in lower case."""
    return read_headers(scope["headers"])


def read_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The headers the handlers read of raw (lower-case name, value) pairs."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k in READ_HEADERS}


def _whole_receive(body: bytes) -> Receive:
    """An ASGI receive channel that gives `body` whole, at once."""
    message = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict[str, Any]:
        return message

    return receive


async def send_answer(send: Send, headers: list[tuple[bytes, bytes]],
                      parts: Sequence[bytes | memoryview]) -> None:
    """A 200 answer; the body parts go out as they are (no join of large buffers)."""
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    last = len(parts) - 1
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part, "more_body": i < last})


class FastPath:
    """Answers the `FastRoute`s; `ServiceApp` passes everything else to FastAPI."""

    def __init__(self, state: ServiceState, routes: Sequence[FastRoute]) -> None:
        self.state = state
        self.routes = tuple(routes)
        self.answered_directly = 0  # requests `answer` took (hps/http/direct.py)

    def match(self, scope: Scope) -> tuple[FastRoute, dict[str, str | None]] | None:
        """(route, path parameters) of a request the fast path answers, else None."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        return self.match_path(path)

    def match_path(self, path: str) -> tuple[FastRoute, dict[str, str | None]] | None:
        """(route, path parameters) of a POST to `path` (below the root path), else None."""
        for route in self.routes:
            match = route.pattern.match(path)
            if match is not None:  # ASGI paths come percent-decoded: the names as sent
                return route, match.groupdict()
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send, route: FastRoute,
                       params: dict[str, str | None]) -> None:
        """Answer one request of `route` (as `match` found it) and count it."""
        started = time.perf_counter()
        scope["route"] = route.route
        status = 500  # what the request is counted as when no answer went out
        try:
            headers, parts = await route.handle(self.state, request_headers(scope), receive,
                                                params)
            status = 200
            await send_answer(send, headers, parts)
        except ClientDisconnect:
            pass  # nobody to answer
        except Exception as exc:
            if status == 200:  # the answer had started: nothing more can be said
                raise
            response = route.on_error(self.state, Request(scope), exc)
            status = response.status_code
            await response(scope, receive, send)
        finally:
            self.observe(route, status, time.perf_counter() - started)

    def answer(self, route: FastRoute, params: dict[str, str | None],
               headers: Mapping[str, str], body: bytes, scope: Scope
               ) -> tuple[int, list[tuple[bytes, bytes]], Sequence[bytes | memoryview]]:
        """(status, headers, body parts) of a request of `route` whose whole `body` is in,
        answered without waiting (hps/http/direct.py: only where `lookup_threads` is 0,
        so the handler never waits on a thread). The caller counts it (`observe`)."""
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
            response = route.on_error(self.state, Request(scope), exc)
            return response.status_code, response.raw_headers, (response.body,)

    def observe(self, route: FastRoute, status: int, seconds: float) -> None:
        """Count one request of `route` answered with `status` after `seconds`."""
        self.state.metrics.observe_request(route.route.path, "POST", status, seconds)


async def respond(handle: Handler, state: ServiceState, request: Request,
                  params: dict[str, str | None]) -> Response:
    """A handler's answer as a starlette Response (for a route as FastAPI declares it)."""
    headers, parts = await handle(state, request.headers, request.receive, params)
    response = Response(b"".join(parts))
    response.raw_headers = headers
    return response
