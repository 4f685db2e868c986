"""Direct answers: uvicorn's httptools protocol answering the hot routes itself, inside
the `data_received` call that completes a request, without an ASGI task, when nothing
about the request needs one (`HotRoutes.answer_whole` says what that skips and what it
saves).

`direct_answers(base)` subclasses uvicorn's httptools protocol. A request is answered
directly when every one of these holds; otherwise it goes to uvicorn's ASGI cycle exactly
as before:

- it is a POST to a hot route, the app has no access log or concurrency limit to
  apply, and either its handlers run without waiting (`HotRoutes.answers_whole`:
  `lookup_threads` 0, in-memory tiers) or, with lookup threads, the admission rule sheds
  it (hps/http/admission.py): then its answer is the 503 the ASGI path would send
  (`HotRoutes.refuse_whole`), and its body is dropped as it comes;
- no earlier request of the connection is still being answered (pipelining keeps its
  order) and the connection is not holding back writes for a slow reader;
- it declares a Content-Length within the body limit and sends no
  `Expect: 100-continue`. Its body is kept as it comes (at most that length; the
  connection's body deadline applies between its parts, hps/http/connections.py) and the
  request is answered in the read that completes it.

The answer is the same: `HotRoutes.answer_whole` runs the route's handler and error
answer as the ASGI path does, and the request is counted in the metrics alike; the
response carries uvicorn's default headers (date, server) and closes the connection where
the request or HTTP/1.0 asks. The connection's timers and keep-alive are uvicorn's own
(its `on_response_complete` runs after each direct answer, as after an ASGI one).
"""

from __future__ import annotations

import re
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

from hps.http.bodies import declared_length
from hps.http.hot_routes import read_headers

if TYPE_CHECKING:
    import asyncio

    from hps.http.hot_routes import HotRoute, HotRoutes

#: what may not appear in a header value (uvicorn's own check of what an app sends)
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")


def _status_line(status: int) -> bytes:
    import http

    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}
_SERVER_ERROR = b"Internal Server Error"


class _Pending:
    """A request to be answered directly once its body is in; `refused`: with the 503 of
    a lookup the admission rule sheds (its body is dropped as it comes)."""

    __slots__ = ("route", "params", "headers", "body", "keep_alive", "refused")

    def __init__(self, route: HotRoute, params: dict[str, str | None],
                 headers: dict[str, str], keep_alive: bool, refused: bool) -> None:
        self.route = route
        self.params = params
        self.headers = headers
        self.body: list[bytes] = []
        self.keep_alive = keep_alive
        self.refused = refused


def direct_answers(base: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol `base`, answering the hot routes directly."""
    parent: Any = base

    class DirectProtocol(parent):  # type: ignore[misc]
        _hps_pending: _Pending | None = None  # a request to answer once its body is in

        def _hps_hot_routes(self) -> HotRoutes | None:
            """The app's HotRoutes when requests may be answered directly, else None."""
            hot = getattr(self.config.app, "hot_routes", None)
            if hot is None or self.access_log or self.limit_concurrency is not None:
                return None
            return hot  # type: ignore[no-any-return]

        def on_headers_complete(self) -> None:
            pending = self._hps_direct_request()
            if pending is None:
                super().on_headers_complete()
            else:
                self._hps_pending = pending

        def _hps_direct_request(self) -> _Pending | None:
            """The request as a `_Pending` when it may be answered directly."""
            cycle = self.cycle
            if (self.expect_100_continue or self.flow.write_paused or self.pipeline
                    or (cycle is not None and not cycle.response_complete)
                    or self.parser.get_method() != b"POST" or self.parser.should_upgrade()):
                return None
            hot = self._hps_hot_routes()
            if hot is None:
                return None
            # with lookup threads a lookup waits on one, in an ASGI task; only its refusal
            # is answered here (decided first: an admitted request pays nothing more)
            refused = not hot.answers_whole
            if refused and not hot.state.admission.shed_now():
                return None
            raw_path = self.url.split(b"?", 1)[0]
            path = raw_path.decode("ascii", "replace")
            if "%" in path:
                path = urllib.parse.unquote(path)
            hit = hot.match_path(path)
            if hit is None:
                return None
            headers = read_headers(self.headers)
            declared = declared_length(headers)
            if (declared is None or declared > hot.state.max_body_bytes
                    or "transfer-encoding" in headers):
                return None  # the ASGI path refuses or streams these
            version = self.parser.get_http_version()
            scope = self.scope
            scope["method"] = "POST"
            if version != "1.1":
                scope["http_version"] = version
            scope["path"] = self.root_path + path
            scope["raw_path"] = self.root_path.encode("ascii") + raw_path
            scope["query_string"] = self.url.partition(b"?")[2].split(b"#", 1)[0]
            return _Pending(hit[0], hit[1], headers,
                            version != "1.0" and self.parser.should_keep_alive(), refused)

        def on_body(self, body: bytes) -> None:
            pending = self._hps_pending
            if pending is None:
                super().on_body(body)
            elif not pending.refused:
                pending.body.append(body)

        def on_message_complete(self) -> None:
            pending = self._hps_pending
            if pending is None:
                super().on_message_complete()
                return
            self._hps_pending = None
            self._hps_answer(pending)

        def connection_lost(self, exc: Exception | None) -> None:
            pending, self._hps_pending = self._hps_pending, None
            if pending is not None:  # its body never came whole: counted as the ASGI path does
                self.config.app.hot_routes.count_abandoned(pending.route)
            super().connection_lost(exc)

        def _hps_answer(self, pending: _Pending) -> None:
            hot = self.config.app.hot_routes
            body = pending.body[0] if len(pending.body) == 1 else b"".join(pending.body)
            self.scope["app"] = self.config.app
            started = time.perf_counter()
            if pending.refused:
                status, headers, parts = hot.refuse_whole(pending.route)
            else:
                status, headers, parts = hot.answer_whole(pending.route, pending.params,
                                                          pending.headers, body, self.scope)
            keep_alive = pending.keep_alive
            head = [_STATUS_LINES[status]]
            for name, value in self.server_state.default_headers:
                head += (name, b": ", value, b"\r\n")
            for name, value in headers:
                if _BAD_VALUE.search(value) is not None:  # uvicorn refuses these too
                    status, parts, keep_alive = 500, (_SERVER_ERROR,), False
                    head[0] = _STATUS_LINES[500]
                    del head[1 + 4 * len(self.server_state.default_headers):]
                    head.append(b"content-type: text/plain; charset=utf-8\r\n"
                                b"content-length: %d\r\n" % len(_SERVER_ERROR))
                    break
                head += (name, b": ", value, b"\r\n")
            if not keep_alive:
                head.append(b"connection: close\r\n")
            head.append(b"\r\n")
            transport = self.transport
            if not transport.is_closing():  # (a client gone meanwhile: nobody to answer)
                transport.write(b"".join(head))
                for part in parts:
                    transport.write(part)
            hot.observe(pending.route, status, time.perf_counter() - started)
            if not keep_alive:
                transport.close()
            self.on_response_complete()

    DirectProtocol.__name__ = f"Direct{parent.__name__}"
    return DirectProtocol
