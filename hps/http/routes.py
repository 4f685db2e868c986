"""The routes: model listing, reload, health, metrics, and the lookup route's declaration
(hot and missing keys and warm-ups: `keys_routes.py`, included here).

The lookup route's handler lives in `lookup.py` (a hot route: `hot_routes.HotRoutes`
answers it ahead of FastAPI's router); it is declared here so that OpenAPI describes it,
with both body forms, and metrics label it.
Model listing and reload call the tiers and load files, so they run in the threadpool.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.routing import Match

from hps.config import ModelConfig
from hps.errors import ConfigError
from hps.http.guards import request_port
from hps.http.hot_routes import HotRoutes
from hps.http.keys_routes import build_keys_router
from hps.http.lookup import LOOKUP_PATH, handle_lookup
from hps.http.roots import check_absolute, check_sources
from hps.http.schemas import (
    ERROR_RESPONSES,
    JSON,
    LOOKUP_REQUEST_OPENAPI,
    LOOKUP_RESPONSES,
    ErrorBody,
    Health,
    ModelInfo,
    ModelList,
    Readiness,
    ReloadRequest,
    ReloadResponse,
)
from hps.http.state import ServiceState
from hps.http.workers_versions import VersionLag, lags_message
from hps.modelfiles.confined import confined
from hps.modelfiles.formats.spec import TableSpec
from hps.server import LoadedModel

_bearer = HTTPBearer(auto_error=False, description="The server's token (--token / HPS_TOKEN).")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


# -- model info ---------------------------------------------------------------------------

def _hit_rates(stats: dict[str, int]) -> dict[str, float | None]:
    keys = stats.get("keys", 0)
    names = {"volatile": "volatile_hits", "persistent": "persistent_hits",
             "default": "defaults"}
    return {tier: (stats.get(key, 0) / keys if keys else None) for tier, key in names.items()}


def model_infos(state: ServiceState) -> list[dict[str, Any]]:
    """The server's `describe()` with per-tier hit rates added (calls the tiers: run in a
    thread); under `--workers N` (`state.versions`), each model's `version` and each
    worker's (`workers`)."""
    models = state.server.describe()
    versions = state.versions
    for m in models:
        m["ready"] = True
        for t in m["tables"]:
            t["hit_rate"] = _hit_rates(t["stats"])
        if versions is not None:
            m.update(versions.of_model(m["model"]))
    return models


# -- the router ---------------------------------------------------------------------------

#: the guards of a route (`guard_of`), which `gate.RequestGate` applies before any body
ADMIN, TOKEN = "admin", "token"


def token_guard(state: ServiceState) -> list[Any]:
    """The dependencies of a route the token protects (none when no token is set)."""

    async def require_token(request: Request, credentials: Credentials) -> None:
        # `credentials` only documents the scheme in OpenAPI; the check reads the header
        state.check_token(request.headers.get("authorization"))

    require_token.hps_guard = TOKEN  # type: ignore[attr-defined]
    return [Depends(require_token)] if state.token is not None else []


def admin_guard(state: ServiceState) -> list[Any]:
    """The dependencies of an admin route: the token, or without one a loopback server.

    Only a server with a token declares the bearer scheme in OpenAPI: without one, no
    Authorization is read (a loopback server serves the route, any other refuses it:
    403 forbidden), so the document asks for none."""

    async def require_admin(request: Request) -> None:
        state.check_admin(request.headers, request.url.scheme, request_port(request.scope))

    require_admin.hps_guard = ADMIN  # type: ignore[attr-defined]
    return [*token_guard(state), Depends(require_admin)]


def guard_of(route: Any) -> str | None:
    """ADMIN, TOKEN or None: the strictest guard among a route's dependencies."""
    guards = {getattr(d.dependency, "hps_guard", None)
              for d in getattr(route, "dependencies", ())}
    return ADMIN if ADMIN in guards else TOKEN if TOKEN in guards else None


def build_router(state: ServiceState) -> APIRouter:
    """All routes of one app, bound to its state (the v2 protocol's: `kserve/routes.py`;
    adding and removing models: `admin.py`)."""
    protected = token_guard(state)
    router = APIRouter()
    server = state.server

    @router.get("/healthz", response_model=Health, tags=["health"],
                summary="Alive (answers while models load)",
                responses={413: ERROR_RESPONSES[413]})
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    # load balancers and `curl -I` probe with HEAD (one operation in the docs: GET's)
    @router.head("/healthz", include_in_schema=False)
    async def healthz_head() -> Response:
        return Response(media_type=JSON)

    @router.get("/readyz", response_model=Readiness, tags=["health"],
                summary="Ready: every model of the config is loaded",
                responses={503: {"model": Readiness, "description": "Not every model is "
                                 "loaded (yet, or a load failed), or (--workers N) a worker "
                                 "serves another version than the server's."},
                           413: ERROR_RESPONSES[413]})
    async def readyz() -> Response:
        # one snapshot of the models for the whole answer: a workers' server computes
        # them anew on each read (hps/http/workers_ops.py), and an answer that read them
        # four times said loaded [] and loading [] at once (tests/http/
        # test_workers_leader_kill.py, killing the leader mid-op)
        loaded = sorted(server.models)
        pending, failed, all_loaded = state.readiness(loaded)
        held = state.lookups.held  # lookups given up on whose threads have not returned
        lags = state.version_lags()  # workers on another version than the server's
        ready = all_loaded and not held and not lags
        status = "ready" if ready else ("failed" if failed else
                                        "stalled" if held else
                                        "mixed_versions" if lags and not pending else
                                        "loading")
        body: dict[str, Any] = {"status": status, "loaded": loaded,
                                "loading": pending, "failed": failed,
                                "degraded": server.degraded()}
        updates = _update_state(server)
        if updates is not None:
            body["updates"] = updates
        if lags:
            body["versions"] = [lag.as_dict() for lag in lags]
        if not ready:
            body["error"] = {"kind": "not_ready", "message": _not_ready(
                pending, failed, held, lags)}
        return Response(json.dumps(body).encode(), status_code=200 if ready else 503,
                        media_type=JSON)

    @router.get("/metrics", dependencies=protected, tags=["health"],
                summary="Prometheus metrics", response_class=Response,
                responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                 "description": "Prometheus text format."},
                           401: ERROR_RESPONSES[401], 413: ERROR_RESPONSES[413]})
    async def metrics() -> Response:
        data = await run_in_threadpool(generate_latest, state.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    # exclude_unset: the workers' `version` and `workers` are absent with one process
    @router.get("/v1/models", response_model=ModelList, dependencies=protected,
                response_model_exclude_unset=True,
                tags=["models"], summary="Loaded models: tables, widths, sources, tiers",
                responses={401: ERROR_RESPONSES[401], 413: ERROR_RESPONSES[413]})
    async def list_models() -> dict[str, Any]:
        models = await run_in_threadpool(model_infos, state)
        return {"models": models, "loading": state.pending(), "failed": dict(state.failed)}

    @router.get("/v1/models/{model}", response_model=ModelInfo, dependencies=protected,
                response_model_exclude_unset=True,
                tags=["models"], summary="One model: tables, widths, sources, tiers",
                responses={**ERROR_RESPONSES,
                           404: {"model": ErrorBody, "description": "Unknown model."},
                           503: {"model": ErrorBody, "description": "Still loading."}})
    async def get_model(model: str) -> dict[str, Any]:
        state.model(model)
        for info in await run_in_threadpool(model_infos, state):
            if info["model"] == model:
                return info
        state.model(model)  # unloaded meanwhile: the same error as above
        raise AssertionError("unreachable")  # pragma: no cover

    @router.post(LOOKUP_PATH, dependencies=protected, tags=["lookup"],
                 summary="Vectors of keys (binary or JSON)", response_class=Response,
                 responses=LOOKUP_RESPONSES, openapi_extra=LOOKUP_REQUEST_OPENAPI)
    async def lookup(model: str, table: str, request: Request) -> Response:
        """Look up keys in a table (by name or index).

        Binary: send little-endian int64 keys as `application/octet-stream`; the answer is
        little-endian float32 rows (`X-HPS-Keys` × `X-HPS-Width` floats). JSON: send
        `{"keys": [...]}`; the answer is `{"vectors": [[...]], ...}`.
        """
        return await HotRoutes.respond(handle_lookup, state, request,
                                       {"model": model, "table": table})

    @router.post("/v1/models/{model}/reload", response_model=ReloadResponse,
                 dependencies=admin_guard(state), tags=["admin"],
                 summary="Re-read a model's files (optionally from new URIs), swap atomically",
                 responses={**ERROR_RESPONSES,
                            403: {"model": ErrorBody, "description": "Admin routes need a "
                                  "token unless the server is bound to loopback; a Host "
                                  "among the server's names; sources under the allowed "
                                  "roots."},
                            415: {"model": ErrorBody, "description": "A body that is not "
                                  "application/json."},
                            404: {"model": ErrorBody, "description": "Unknown model or "
                                  "missing files."},
                            422: {"model": ErrorBody, "description": "Bad sparse_files, "
                                  "files that are not a valid model, a source (S3, HDFS) "
                                  "that could not be read, or a version the load gate "
                                  "refused (kind load_gate: the error names the table, "
                                  "check, figure and limit; check size: a table of no "
                                  "keys, or far smaller than the served one)."},
                            507: {"model": ErrorBody, "description": "The disk of the "
                                  "persistent tier is full: the message names the file "
                                  "and the bytes not written; the old version serves "
                                  "on."}})
    async def reload(model: str, body: ReloadRequest | None = None) -> dict[str, Any]:
        """Re-read the model's sparse files and swap the new version in atomically.

        Without a body, the model's block of the config file the server was started
        with is read again (a fix to it is what loads). With `{"sparse_files": [...]}`
        the model is read from those URIs (one per table; absolute paths or URIs) and
        later reloads keep them. Lookups see the old version
        until the new one is complete; a failed reload leaves the old version serving.
        The load gate refuses a table of no keys, or one far smaller than the served
        version (422, check `size`), unless `allow_empty` / `allow_shrink` say otherwise
        for this reload; the version served before the one served now always loads.
        """
        config = state.model_config(model)
        roots = None  # the config's own files are trusted; what a request names is not
        if body is not None and body.sparse_files is not None:
            config = _with_sources(config, body.sparse_files)
            check_sources(config.sparse_files, state.allowed_roots)
            roots = state.allowed_roots
        load = functools.partial(state.load, allow_empty=body is not None and body.allow_empty,
                                 allow_shrink=body is not None and body.allow_shrink)
        return load_summary(await run_in_threadpool(confined, roots, load, config))

    router.include_router(build_keys_router(state, protected, admin_guard(state)))
    return router


def every_route(app: Any) -> list[Any]:
    """Every route of an app made by `create_app`, those of the routers it includes
    among them (FastAPI keeps an included router as one entry; none is included under
    a prefix, so their routes' paths are the app's)."""

    def flat(routes: Any) -> Any:
        for route in routes:
            inner = getattr(route, "original_router", None)
            if inner is not None:
                yield from flat(inner.routes)
            elif getattr(route, "path", None):
                yield route

    return list(flat(getattr(getattr(app, "router", None), "routes", ())))


def route_of(routes: Iterable[Any], scope: Any) -> Any | None:
    """The route among `routes` a request of `scope` is counted under, as FastAPI's router
    finds it: the one it matches in full, else the first it matches but for its method
    (answered 405), else None."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route
        if match is Match.PARTIAL and partial is None:
            partial = route
    return partial


def allowed_methods(app: Any, scope: Any) -> str:
    """The `Allow` header of a 405 to the request of `scope`: the methods of every route
    at its path. (Starlette's names only the first route's: `GET` at
    /v1/models/{model}, whose DELETE is another route.)"""
    methods: set[str] = set()
    for route in every_route(app):
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


def load_summary(loaded: LoadedModel) -> dict[str, Any]:
    """What a load answers: the model, the seconds it took, each table's source."""
    return {
        "model": loaded.config.model,
        "seconds": sum(t.source.load_seconds for t in loaded.tables),
        "tables": [{"index": t.index, "name": t.name, "dim": t.dim,
                    "source": t.source.as_dict()} for t in loaded.tables],
    }


def _with_sources(config: ModelConfig, files: list[str | dict[str, Any]]) -> ModelConfig:
    """`config` reading its tables from `files`; ConfigError if they do not fit."""
    if len(files) != config.num_tables:
        raise ConfigError(f"sparse_files has {len(files)} entries but model "
                          f"{config.model!r} has {config.num_tables} tables")
    specs = [_table_spec(i, f) for i, f in enumerate(files)]
    check_absolute(specs)
    entries = [f if isinstance(f, str) else spec for f, spec in zip(files, specs, strict=True)]
    return config.model_copy(update={"sparse_files": entries})


def _table_spec(index: int, entry: str | dict[str, Any]) -> TableSpec:
    """A sparse_files entry of a request as a TableSpec; unknown keys are refused, and
    so is an empty path, in either form (ConfigError: a 422, not the 500 "" was)."""
    if not isinstance(entry, str):
        unknown = sorted(set(entry) - set(TableSpec.field_names()))
        if unknown:
            raise ConfigError(f"sparse_files[{index}]: unknown key(s) {', '.join(unknown)} "
                              f"(known: {', '.join(TableSpec.field_names())})")
    try:
        return TableSpec(entry) if isinstance(entry, str) else TableSpec(**entry)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"sparse_files[{index}]: {exc}") from None


def _not_ready(pending: list[str], failed: list[str], held: int,
               lags: list[VersionLag] | None = None) -> str:
    """Why /readyz answers 503, naming only the lists that have models in them."""
    parts = []
    if pending:
        parts.append(f"still loading: {', '.join(pending)}")
    if failed:
        parts.append(f"failed to load: {', '.join(failed)} (why: GET /v1/models)")
    if lags:
        parts.append(f"not every worker serves the server's version: {lags_message(lags)}")
    if held:
        return (f"{held} lookup(s) did not return within the lookup limit and still hold "
                "their threads" + (": " + "; ".join(parts) if parts else ""))
    if lags and not pending and not failed:
        return parts[0]
    return "models not served yet: " + ("; ".join(parts) or "starting")


def _update_state(server: Any) -> dict[str, Any] | None:
    """The update source's state for /readyz (details are in /metrics, which is guarded)."""
    status = server.update_status()
    if status is None:
        return None
    tables = status.get("tables", {})
    return {"source": status["source"], "state": status["state"],
            "since": status["state_since"],
            # tables whose source cannot be read (the others' updates go on), and tables
            # with messages waiting (how many)
            "failing": {k: t["failing"] for k, t in tables.items() if t.get("failing")},
            "lagging": {k: t["lag_messages"] for k, t in tables.items()
                        if t.get("lag_messages")}}
