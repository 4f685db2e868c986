"""The app factory: `create_app(server, ...)` → a FastAPI app serving that server.

    from hps.http import create_app
    server = HierarchicalParameterServer("ps.json", load=False)
    app = create_app(server, token=None, host="127.0.0.1")   # loads in the background
    uvicorn.run(app, host="127.0.0.1", port=8000)

The app does not own the server: whoever made it closes it (after the HTTP server
stopped, and once `app.state.hps.loader` is done).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hps.errors import HPSError
from hps.http.errors import ApiError, error_body, kind_of, status_of
from hps.http.metrics import Metrics, MetricsMiddleware
from hps.http.routes import build_router
from hps.http.state import DEFAULT_MAX_BODY_BYTES, ServiceState
from hps.server import HierarchicalParameterServer

log = logging.getLogger("hps.http")

_HTTP_KINDS = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}

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
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """A FastAPI app that serves `server`.

    Models of `server.config` that are not loaded yet load in a background thread when
    the app starts (its lifespan), so `/healthz` answers at once and `/readyz` is 503
    until they are all in; `on_ready` is called once they are.

    `token`: when set, every route but `/healthz`, `/readyz` and the docs needs
    `Authorization: Bearer <token>`. `host`: the address the server binds to; without a
    token, admin routes (reload) answer 403 unless it is a loopback address.
    `max_body_bytes`: bodies larger than this are refused with 413.
    """
    if token is not None and not token:
        raise ValueError("token must be a non-empty string or None")
    state = ServiceState(server=server, metrics=Metrics(server), token=token, host=host,
                         max_body_bytes=max_body_bytes, on_ready=on_ready)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start_loading()
        yield

    app = FastAPI(title="hps", summary="Hierarchical parameter server for recommender "
                  "embeddings", description=DESCRIPTION, version=_version(),
                  lifespan=lifespan)
    app.state.hps = state
    app.include_router(build_router(state))
    _add_error_handlers(app, state)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    return app


def _version() -> str:
    from hps import __version__

    return __version__


def _answer(state: ServiceState, status: int, kind: str, message: str,
            headers: dict[str, str] | None = None) -> JSONResponse:
    state.metrics.errors.labels(kind, str(status)).inc()
    return JSONResponse(error_body(kind, message), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI, state: ServiceState) -> None:
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        status = status_of(exc)
        if status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, exc)
        headers = exc.headers if isinstance(exc, ApiError) else None
        return _answer(state, status, kind_of(exc), str(exc), headers)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = _HTTP_KINDS.get(exc.status_code, "http_error")
        return _answer(state, exc.status_code, kind, str(exc.detail),
                       dict(exc.headers) if exc.headers else None)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        parts = []
        for err in exc.errors()[:3]:
            where = ".".join(str(p) for p in err.get("loc", ())) or "request"
            parts.append(f"{where}: {err.get('msg', 'invalid')}")
        return _answer(state, 422, "bad_request", "; ".join(parts) or "invalid request")

    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _answer(state, 500, "internal", f"internal error: {type(exc).__name__}")

    handlers: list[tuple[Any, Any]] = [
        (ApiError, on_error), (HPSError, on_error),
        (StarletteHTTPException, on_http), (RequestValidationError, on_validation),
        (Exception, on_bug),
    ]
    for cls, handler in handlers:
        app.add_exception_handler(cls, handler)
