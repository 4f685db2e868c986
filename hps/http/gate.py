"""What every request of a route other than the hot ones passes before FastAPI reads any of
its body: its route's guard, then the body limit.

FastAPI reads and parses a route's body before it solves the route's dependencies, so a
guard written as a dependency runs after the body is in memory (an admin route without a
token once read a 256 MiB JSON body before answering 401). `RequestGate` sits ahead of
FastAPI (`app.ServiceApp`) and, for each request:

1. finds its route and that route's guard (`routes.guard_of`): the admin guard (the
   token or a loopback server, Host, Origin, JSON bodies: `state.check_admin`), else
   the token where one guards the route (`state.check_client`); on a loopback server
   without a token every route checks the Host (`state.check_own_host`);
2. reads the body, refusing (413) one beyond `--max-body-bytes` as soon as its declared
   length or the bytes received pass it, whatever the route and with or without a token;
3. hands FastAPI the request with its body replayed from memory.

The request metrics sit around the gate (`app.ServiceApp`), so what it answers itself
(401, 403, 413) and a body its client abandoned (499, `metrics.CLIENT_CLOSED`) are counted
like FastAPI's answers, under the route FastAPI would have chosen (`route_of`).

The hot routes (lookup, v2 infer) do the same in their handlers (token, then `read_body`)
and never come here. The routes keep their guards as dependencies too: they describe the
security scheme in the OpenAPI document, and a route is never open if the gate is bypassed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request
from starlette.routing import Match

from hps.http.bodies import read_body
from hps.http.errors import error_body, v2_error_body
from hps.http.guards import request_port
from hps.http.routes import ADMIN, TOKEN, guard_of, route_of

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

    from hps.http.errors import ErrorBody
    from hps.http.state import ServiceState

#: the request headers the guards read (ASGI gives names in lower case)
_GUARD_HEADERS = frozenset({b"host", b"origin", b"authorization", b"content-type",
                            b"content-length", b"transfer-encoding"})


def body_form(path: str) -> ErrorBody:
    """The error body of the protocol a path belongs to: KServe v2's under /v2."""
    return v2_error_body if path == "/v2" or path.startswith("/v2/") else error_body


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive channel that gives `body` whole once, then what `receive` gives (the
    client's disconnect)."""
    sent = False

    async def replayed() -> Any:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


class RequestGate:
    """The guard and body limit of every request FastAPI answers (see the module)."""

    def __init__(self, state: ServiceState, routes: list[Any]) -> None:
        """`routes`: every route of the app, those of included routers among them
        (`routes.every_route`)."""
        self.state = state
        self.routes = [(route, guard_of(route)) for route in routes]

    def guard(self, scope: Scope) -> str | None:
        """ADMIN, TOKEN or None: the guard of the route `scope` reaches (None: no route,
        or a route without one)."""
        for route, guard in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return guard
        return None

    def check(self, scope: Scope, headers: Mapping[str, str]) -> None:
        """Raise unless the request may reach its route (its body unread)."""
        guard = self.guard(scope)
        if guard == ADMIN:
            self.state.check_admin(headers, scope.get("scheme", "http"), request_port(scope))
        elif guard == TOKEN:
            self.state.check_client(headers)
        else:  # open routes (health, docs) and paths of no route: the Host rule alone
            self.state.check_own_host(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send,
                       app: Callable[[Scope, Receive, Send], Awaitable[None]] | ASGIApp
                       ) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1")
                   for k, v in scope["headers"] if k in _GUARD_HEADERS}
        try:
            self.check(scope, headers)
            body = await read_body(headers, receive, self.state.max_body_bytes)
        except ClientDisconnect:  # nobody to answer
            scope["route"] = route_of((route for route, _ in self.routes), scope)
            return
        except Exception as exc:
            scope["route"] = route_of((route for route, _ in self.routes), scope)
            response = self.state.error_response(Request(scope), exc,
                                                 body_form(scope.get("path", "")))
            if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
                # the rest of the body is never read: the connection cannot carry another
                response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        await app(scope, _replay(body, receive), send)
