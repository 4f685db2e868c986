"""Requests that are not HTTP: the connection's own answer, in the API's JSON form.

uvicorn's protocol parses each request (httptools, else h11) before the app sees any of
it. What it cannot parse (a request line or a header that is not HTTP/1.1, a chunk size
that is not hexadecimal, a Content-Length that is not a number or comes with
Transfer-Encoding, a path that is not ASCII) it answered with a plain-text 400 of its own,
and the lookup whose chunked body broke off saw a client gone: `/metrics` counted it as a
500. `framing_answers(base)` subclasses uvicorn's protocol so that such a request gets

- the JSON error body of its route's protocol (`{"error": {"kind": "bad_http", ...}}`,
  `{"error": message}` under /v2), status 400, `Connection: close` (the bytes after
  the fault cannot be read as a request);
- its place in order: answers still due to the requests before it on the connection go
  out first (pipelining);
- one count in `/metrics`: `hps_http_requests_total` under its route's template (where the
  request line and headers were read, else "unmatched") and code 400, and
  `hps_http_errors_total{kind="bad_http",code="400"}`. A request whose handler had
  started (its body broke off) is withdrawn from the handler, which sees a disconnect
  and counts nothing (`metrics.ANSWERED_BY_CONNECTION`).

A request whose answer had begun before its body broke off keeps that answer: the
connection is closed, nothing follows it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from hps.http.errors import BadHTTP
from hps.http.gate import body_form
from hps.http.metrics import ANSWERED_BY_CONNECTION, method_label
from hps.http.routes import every_route, route_of

if TYPE_CHECKING:
    import asyncio

    from starlette.types import Scope

    from hps.http.state import ServiceState

def _reason(exc: BaseException | None) -> str:
    """What the parser said was wrong, as printable ASCII (its own words)."""
    text = str(exc) if exc is not None else ""
    text = text.encode("ascii", "replace").decode("ascii")
    return "".join(c if c.isprintable() else "?" for c in text)[:200] or "unreadable"


def _route_label(app: Any, scope: Scope) -> str:
    """The route template a request of `scope` is counted under, as the metrics
    middleware counts it ("unmatched" when its line was not read or matches no route)."""
    route = scope.get("route")
    if route is None and "path" in scope and "method" in scope:
        route = route_of(every_route(app), scope)
    return getattr(route, "path", None) or "unmatched"


def framing_answers(base: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol `base` answering what it cannot parse as the module says."""
    parent: Any = base

    class FramingProtocol(parent):  # type: ignore[misc]
        _hps_refusal: bytes | None = None  # the 400 to send once the answers before it are

        def send_400_response(self, msg: str) -> None:
            # called by uvicorn inside its `except` of the parser's error: that is the reason
            if self._hps_refusal is not None:  # the parser stays failed: it says so again
                return
            reason = _reason(sys.exc_info()[1])
            cycle = self.cycle
            owner = cycle if cycle is not None and cycle.more_body else None  # its body broke
            if owner is not None and owner.response_started:
                self.transport.close()  # it was answered: nothing can follow that answer
                return
            scope = owner.scope if owner is not None else self._hps_head_scope()
            pipeline = getattr(self, "pipeline", None)  # httptools' queued requests
            # answers due before this one: queued requests (one of them is being answered),
            # or an earlier request being answered
            due = bool(pipeline) or (cycle is not None and cycle is not owner
                                     and not cycle.response_complete)
            if owner is not None:  # its handler (running or queued) never gets its body
                scope[ANSWERED_BY_CONNECTION] = True
                owner.disconnected = True
                owner.message_event.set()
                if pipeline:
                    for queued in list(pipeline):
                        if queued[0] is owner:
                            pipeline.remove(queued)
            self._hps_refusal = self._hps_refusal_bytes(scope, reason)
            if due:  # sent once they are (on_response_complete)
                self.transport.pause_reading()
            else:
                self._hps_refuse()

        def on_response_complete(self) -> None:
            queued = bool(getattr(self, "pipeline", None))  # uvicorn starts the next one
            super().on_response_complete()
            if self._hps_refusal and not queued:  # the last answer due before the 400
                self._hps_refuse()

        def _hps_refuse(self) -> None:
            refusal, self._hps_refusal = self._hps_refusal, b""  # b"": sent, never again
            if refusal and not self.transport.is_closing():
                self.transport.write(refusal)
            self.transport.close()

        def _hps_refusal_bytes(self, scope: Scope, reason: str) -> bytes:
            """The whole 400 answer to the request of `scope`, counted in the metrics."""
            path = scope.get("path")
            if path is None:  # the line was read, its headers were not (httptools)
                raw = bytes(getattr(self, "url", b"") or b"")
                path = raw.split(b"?", 1)[0].decode("latin-1")
            message = (f"the request is not HTTP/1.1 this server reads ({reason}); "
                       "the connection is closed")
            app = self.config.app
            state: ServiceState | None = getattr(getattr(app, "state", None), "hps", None)
            if state is None:
                import json

                body = json.dumps(body_form(path)(BadHTTP.kind, message)).encode()
            else:
                body = state.answer(BadHTTP.status, BadHTTP.kind, message,
                                    body=body_form(path)).body
                state.metrics.count_request(_route_label(app, scope), method_label(
                    scope.get("method") or self._hps_method()), BadHTTP.status)
            head = [b"HTTP/1.1 400 Bad Request\r\n"]
            for name, value in self.server_state.default_headers:
                head += (name, b": ", value, b"\r\n")
            head.append(b"content-type: application/json\r\ncontent-length: %d\r\n"
                        b"connection: close\r\n\r\n" % len(body))
            return b"".join(head) + body

        def _hps_head_scope(self) -> Scope:
            """The scope of the request whose head the parser refused: httptools' of the
            message begun (what its head said so far); none where it is a whole earlier
            request's (h11 makes one only of a whole head)."""
            scope = self.scope
            if not scope or (self.cycle is not None and scope is self.cycle.scope):
                return {}
            return scope  # type: ignore[no-any-return]

        def _hps_method(self) -> str:
            """The request's method as the parser read it ("" where it did not: httptools
            names a method of its own for a line it refused before the path)."""
            if not getattr(self, "url", b""):
                return ""
            try:
                return self.parser.get_method().decode("ascii")  # type: ignore[no-any-return]
            except Exception:  # h11 keeps no method before a whole head; httptools none yet
                return ""

    FramingProtocol.__name__ = f"Framing{parent.__name__}"
    return FramingProtocol

