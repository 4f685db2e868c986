"""The app factory: `create_app(server, ...)` → a FastAPI app serving that server.

    from hps.http import create_app
    server = HierarchicalParameterServer("ps.json", load=False)
    app = create_app(server, token=None, host="127.0.0.1")   # loads in the background
    uvicorn.run(app, host="127.0.0.1", port=8000)

The app does not own the server: whoever made it closes it (after the HTTP server
stopped, and once `app.state.hps.loader` is done).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hps.errors import HPSError
from hps.http.admin import build_admin_router
from hps.http.admission import TARGET_DELAY_S
from hps.http.docs_page import add_docs_page
from hps.http.errors import ApiError, ErrorBody, error_body, v2_error_body
from hps.http.gate import RequestGate, body_form
from hps.http.hot_routes import HotRoute, HotRoutes
from hps.http.kserve.infer import handle_infer
from hps.http.kserve.routes import build_v2_router
from hps.http.kserve.schemas import INFER_PATH, INFER_RE
from hps.http.lookup import LOOKUP_PATH, LOOKUP_RE, handle_lookup
from hps.http.metrics import Metrics, MetricsMiddleware
from hps.http.roots import default_roots, normalise_root
from hps.http.routes import allowed_methods, build_router, every_route, token_guard
from hps.http.state import DEFAULT_MAX_BODY_BYTES, ServiceState
from hps.runtime.compile_on_use import compile_events
from hps.server import HierarchicalParameterServer
from hps.server.loader import LoadProgress

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

log = logging.getLogger("hps.http")

_HTTP_KINDS = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}

# FastAPI ≥ 0.16x checks its native OpenTelemetry providers on every request (tens of µs
# on the lookup route); the service exports Prometheus metrics of its own instead.
_NO_OTEL: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})

DESCRIPTION = """\
Vectors of recommender embedding tables by key, from the hierarchical parameter server.

Lookups take the keys as raw little-endian int64 (`application/octet-stream`) or as JSON
`{"keys": [...]}`, and answer in the same form. Every error is JSON
`{"error": {"kind": ..., "message": ...}}` with a 4xx code for bad input.
"""


def create_app(
    server: HierarchicalParameterServer,
    *,
    token: str | None = None,
    host: str = "127.0.0.1",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    lookup_threads: int | None = None,
    on_ready: Callable[[], None] | None = None,
    on_failed: Callable[[str, str], None] | None = None,
    load_progress: Callable[[str], AbstractContextManager[LoadProgress]] | None = None,
    allow_roots: Sequence[str] | None = None,
    max_queued_lookups: int | None = None,
    queue_target_s: float = TARGET_DELAY_S,
    min_queued_lookups: int | None = None,
    config_file: str | None = None,
) -> FastAPI:
    """A FastAPI app that serves `server`.

    Models of `server.config` that are not loaded yet load in a background thread when
    the app starts (its lifespan), so `/healthz` answers at once and `/readyz` is 503
    until they are all in; `on_ready` is called once they are, `on_failed` with a model's
    name and what went wrong when one of them fails to load. `load_progress`: a model's
    name → a context whose LoadProgress hears each load of that model (beside /metrics).

    `token`: when set, every route but `/healthz`, `/readyz` and the docs needs
    `Authorization: Bearer <token>`. `host`: the address the server binds to; without a
    token, admin routes (reload) answer 403 unless it is a loopback address.
    `max_body_bytes`: bodies larger than this are refused with 413. `lookup_threads`:
    size of the thread pool lookups run on (the event loop never runs one).
    `allow_roots`: folders or URI prefixes models added over HTTP may be read from
    (default: the folders holding the configured models' folders; see `roots.py`).
    `max_queued_lookups`: lookups that may wait for or run on the lookup threads (default:
    16 per thread); past it a lookup is answered 503 with Retry-After
    (`ServiceState.admit`). `queue_target_s`: the queueing delay a lookup may meet; one
    that would wait longer is answered so too, once at least `min_queued_lookups` are in
    (default: 4 per thread, at least 8; 2 per thread, at least 4, while it sheds;
    hps/http/admission.py). `config_file`: the config file the server was started with,
    which a reload without sources reads again (hps/http/reload_block.py).
    """
    if token is not None and not token:
        raise ValueError("token must be a non-empty string or None")
    if lookup_threads is not None and lookup_threads < 0:
        raise ValueError("lookup_threads must be 0 (on the event loop) or more")
    state = ServiceState(server=server, metrics=Metrics(server), token=token, host=host,
                         max_body_bytes=max_body_bytes, lookup_threads=lookup_threads,
                         on_ready=on_ready, on_failed=on_failed,
                         load_progress=load_progress,
                         max_queued_lookups=max_queued_lookups,
                         queue_target_s=queue_target_s,
                         min_queued_lookups=min_queued_lookups,
                         config_file=config_file,
                         allowed_roots=[normalise_root(r) for r in (
                             default_roots(server.config) if allow_roots is None
                             else allow_roots)] + [normalise_root(r) for r in
                                                   server.config.http.allowed_sources])

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with compile_events(state.heard_compile):  # hps_compiles_total, by phase
            state.start_loading()
            try:
                yield
            finally:
                state.lookups.close()
                state.executor.shutdown(wait=True, cancel_futures=True)

    app = ServiceApp(title="hps", summary="Hierarchical parameter server for recommender "
                  "embeddings", description=DESCRIPTION, version=_version(),
                  lifespan=lifespan, docs_url=None, redoc_url=None, **_NO_OTEL)
    add_docs_page(app)  # Swagger UI from the package, not a CDN
    app.state.hps = state
    router = build_router(state)
    v2_router = build_v2_router(state, token_guard(state))
    app.include_router(router)
    app.include_router(v2_router)
    admin_router = build_admin_router(state)
    app.include_router(admin_router)
    _add_error_handlers(app, state)
    # every route, those of included routers among them (FastAPI keeps an included router
    # as one entry: the keys router's admin route once escaped the gate's guard so)
    app.gate = RequestGate(state, every_route(app))
    app.hot_routes = HotRoutes(state, [
        HotRoute.declared(router.routes, LOOKUP_PATH, LOOKUP_RE, handle_lookup, error_body),
        HotRoute.declared(v2_router.routes, INFER_PATH, INFER_RE, handle_infer, v2_error_body)])
    # every other answer, the gate's own among them: around the gate, not in FastAPI's stack
    app.counted = MetricsMiddleware(app.gated, state.metrics)
    return app


class ServiceApp(FastAPI):
    """FastAPI, with the hot routes answered by `hot_routes` ahead of its middleware stack
    (`HotRoutes.__call__` says what that skips and what it saves).

    Every other request is counted by `counted` (the request metrics), then passes the
    `gate` and goes through FastAPI as usual. Middleware added to the app
    (`add_middleware`) therefore sees neither the hot routes nor the gate's refusals: wrap
    the app itself (`Middleware(app)`) for something every request must pass through."""

    hot_routes: HotRoutes | None = None
    gate: RequestGate | None = None  # guards and bounds every other request's body
    counted: MetricsMiddleware | None = None  # counts every other request, around `gated`

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = self.hot_routes
        hit = hot.match(scope) if hot is not None else None
        if hit is None:
            await (self.gated if self.counted is None else self.counted)(scope, receive, send)
            return
        assert hot is not None
        scope["app"] = self
        await hot(scope, receive, send, *hit)

    async def gated(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI behind the gate."""
        if self.gate is None:
            await super().__call__(scope, receive, send)
        else:
            await self.gate(scope, receive, send, super().__call__)


def _version() -> str:
    from hps import __version__

    return __version__


def _body_for(request: Request) -> ErrorBody:
    """The error body of the protocol a path belongs to: KServe v2's under /v2."""
    return body_form(request.scope.get("path", ""))


def _undecodable_body(exc: StarletteHTTPException) -> str | None:
    """Why FastAPI could not decode a route's JSON body, when that is what `exc` says
    (else None). FastAPI answers JSON syntax errors itself (a validation error: 422
    bad_request) but any other failure of `json.loads` with a bare 400: bytes that are
    not UTF-8, nesting deeper than the parser's stack, an integer longer than Python
    converts (4,300 digits)."""
    cause = exc.__cause__
    if exc.status_code != 400 or not isinstance(cause, (ValueError, RecursionError)):
        return None
    if isinstance(cause, UnicodeDecodeError):
        why = f"it is not UTF-8 (byte {cause.start})"
    elif isinstance(cause, RecursionError):
        why = "it is nested too deeply"
    else:
        why = str(cause).split(";", 1)[0]  # not its advice to call sys.set_int_max_str_digits
    return f"the body is not a JSON document this route reads: {why}"


def _add_error_handlers(app: FastAPI, state: ServiceState) -> None:
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return state.error_response(request, exc, _body_for(request))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        undecodable = _undecodable_body(exc)
        if undecodable is not None:  # the kind a body that is not JSON already gets
            return state.answer(422, "bad_request", undecodable, body=_body_for(request))
        kind = _HTTP_KINDS.get(exc.status_code, "http_error")
        headers = dict(exc.headers) if exc.headers else None
        if exc.status_code == 405:  # every method the path has, not its first route's
            headers = {**(headers or {}), "Allow": allowed_methods(app, request.scope)}
        return state.answer(exc.status_code, kind, str(exc.detail), headers,
                            _body_for(request))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        parts = []
        for err in exc.errors()[:3]:
            where = ".".join(str(p) for p in err.get("loc", ())) or "request"
            parts.append(f"{where}: {err.get('msg', 'invalid')}")
        return state.answer(422, "bad_request", "; ".join(parts) or "invalid request",
                            body=_body_for(request))

    handlers: list[tuple[Any, Any]] = [
        (ApiError, on_error), (HPSError, on_error),
        (StarletteHTTPException, on_http), (RequestValidationError, on_validation),
        (OSError, on_error),  # a full disk (507): answered, not re-raised as a crash is
        (Exception, on_error),
    ]
    for cls, handler in handlers:
        app.add_exception_handler(cls, handler)
