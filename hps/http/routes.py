"""The routes: lookups (binary and JSON), model listing, reload, health, metrics.

Lookups run in starlette's threadpool: the server's lookup path is NumPy and tier I/O
and must not block the event loop. Keys and vectors cross HTTP as whole arrays
(`np.frombuffer` in, a memoryview of the float32 rows out; JSON through pydantic-core
and `.tolist()`), never key by key.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from hps.config import ModelConfig
from hps.errors import ConfigError
from hps.http.errors import BadBody, BadJSON, BodyTooLarge, Forbidden, UnsupportedMediaType
from hps.http.errors import Unauthorized as UnauthorizedError
from hps.http.schemas import (
    ERROR_RESPONSES,
    JSON,
    KEYS_HEADER,
    LOOKUP_REQUEST_OPENAPI,
    LOOKUP_RESPONSES,
    MODEL_HEADER,
    OCTET_STREAM,
    TABLE_HEADER,
    WIDTH_HEADER,
    ErrorBody,
    Health,
    LookupRequest,
    ModelInfo,
    ModelList,
    Readiness,
    ReloadRequest,
    ReloadResponse,
)
from hps.http.state import ServiceState
from hps.server import HierarchicalParameterServer, LoadedTable


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:  # pragma: no cover - depends on the environment
        return None


#: orjson writes float32 arrays directly, several times faster than json + tolist()
orjson = _optional("orjson")

LOOKUP_PATH = "/v1/models/{model}/tables/{table}/lookup"

_bearer = HTTPBearer(auto_error=False, description="The server's token (--token / HPS_TOKEN).")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


# -- bodies -------------------------------------------------------------------------------

def media_type_of(request: Request) -> str:
    """The body's media type, lower-case, without parameters; 415 unless one we read."""
    raw = request.headers.get("content-type", "")
    media = raw.split(";", 1)[0].strip().lower()
    if media not in (OCTET_STREAM, JSON):
        got = f"{raw!r}" if raw else "no Content-Type"
        raise UnsupportedMediaType(
            f"lookup bodies are {OCTET_STREAM} (little-endian int64 keys) or {JSON} "
            f'({{"keys": [...]}}); got {got}')
    return media


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) one larger than `limit` before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"body of {int(declared):,} bytes exceeds the limit of {limit:,}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body exceeds the limit of {limit:,} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    more = f" (and {exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
    return "; ".join(parts) + more


def parse_json_keys(body: bytes) -> np.ndarray:
    """int64 keys of a JSON body `{"keys": [...]}`; BadJSON naming what was wrong."""
    try:
        request = LookupRequest.model_validate_json(body)
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise BadJSON(f"body is not valid JSON: {_validation_message(exc)}") from None
        raise BadJSON(
            'expected {"keys": [int64, ...]}: ' + _validation_message(exc)) from None
    return np.array(request.keys, dtype=np.int64)


def parse_binary_keys(body: bytes) -> np.ndarray:
    """int64 keys of a binary body (little-endian, 8 bytes each; no copy)."""
    if len(body) % 8:
        raise BadBody(
            f"binary body of {len(body)} bytes is not a whole number of keys: expected "
            "little-endian int64 keys, 8 bytes each")
    return np.frombuffer(body, dtype="<i8")


def encode_json(payload: dict[str, Any], vectors: np.ndarray) -> bytes:
    """`payload` with "vectors" added, as JSON bytes; non-finite values become null."""
    if orjson is not None:
        return bytes(orjson.dumps({**payload, "vectors": np.ascontiguousarray(vectors)},
                                  option=orjson.OPT_SERIALIZE_NUMPY))
    return encode_json_stdlib(payload, vectors)


def encode_json_stdlib(payload: dict[str, Any], vectors: np.ndarray) -> bytes:
    """`encode_json` without orjson: `.tolist()` and the json module."""
    finite = np.isfinite(vectors)
    if finite.all():
        rows = vectors.tolist()
    else:  # JSON has no NaN/inf: write null, as orjson does
        cells = vectors.astype(object)
        cells[~finite] = None
        rows = cells.tolist()
    return json.dumps({**payload, "vectors": rows}, separators=(",", ":")).encode()


# -- lookups ------------------------------------------------------------------------------

def lookup_binary(server: HierarchicalParameterServer, model: str, table: LoadedTable,
                  body: bytes) -> tuple[memoryview, int, int]:
    """(raw little-endian float32 rows, key count, width) of a binary body."""
    keys = parse_binary_keys(body)
    vectors = np.ascontiguousarray(server.lookup(model, table.index, keys), dtype="<f4")
    return vectors.reshape(-1).data.cast("B"), keys.size, vectors.shape[1]


def lookup_json(server: HierarchicalParameterServer, model: str, table: LoadedTable,
                body: bytes) -> bytes:
    """The JSON answer to a JSON body."""
    keys = parse_json_keys(body)
    vectors = server.lookup(model, table.index, keys)
    payload = {"model": model, "table": table.name, "width": int(vectors.shape[1]),
               "count": int(keys.size)}
    return encode_json(payload, vectors)


# -- model info ---------------------------------------------------------------------------

def _hit_rates(stats: dict[str, int]) -> dict[str, float | None]:
    keys = stats.get("keys", 0)
    names = {"volatile": "volatile_hits", "persistent": "persistent_hits",
             "default": "defaults"}
    return {tier: (stats.get(key, 0) / keys if keys else None) for tier, key in names.items()}


def model_infos(server: HierarchicalParameterServer) -> list[dict[str, Any]]:
    """`server.describe()` with per-tier hit rates added (calls the tiers: run in a thread)."""
    models = server.describe()
    for m in models:
        m["ready"] = True
        for t in m["tables"]:
            t["hit_rate"] = _hit_rates(t["stats"])
    return models


# -- the router ---------------------------------------------------------------------------

def build_router(state: ServiceState) -> APIRouter:
    """All routes of one app, bound to its state."""

    async def require_token(credentials: Credentials) -> None:
        if state.token is None:
            return
        if credentials is None or not state.token_matches(credentials.credentials):
            raise UnauthorizedError(
                "this server needs 'Authorization: Bearer <token>' (its --token / HPS_TOKEN)"
                if credentials is None else "wrong token",
                headers={"WWW-Authenticate": "Bearer"})

    async def require_admin(credentials: Credentials) -> None:
        if state.token is None and not state.admin_open:
            raise Forbidden(
                f"admin routes are refused on a server bound to {state.host} without a "
                "token: start it with --token (or HPS_TOKEN), or bind it to 127.0.0.1")
        await require_token(credentials)

    protected = [Depends(require_token)] if state.token is not None else []
    router = APIRouter()
    limit = state.max_body_bytes
    server = state.server

    @router.get("/healthz", response_model=Health, tags=["health"],
                summary="Alive (answers while models load)")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/readyz", response_model=Readiness, tags=["health"],
                summary="Ready: every model of the config is loaded",
                responses={503: {"model": Readiness, "description": "Not every model is "
                                 "loaded (yet, or a load failed)."}})
    async def readyz() -> Response:
        loaded = sorted(server.models)
        ready = state.ready()
        status = "ready" if ready else ("failed" if state.failed else "loading")
        body: dict[str, Any] = {"status": status, "loaded": loaded,
                                "loading": state.pending(), "failed": dict(state.failed)}
        if not ready:
            body["error"] = {"kind": "not_ready", "message":
                             f"models not served yet: {', '.join(state.pending()) or '-'}"
                             + (f"; failed: {', '.join(state.failed)}" if state.failed else "")}
        return Response(json.dumps(body).encode(), status_code=200 if ready else 503,
                        media_type=JSON)

    @router.get("/metrics", dependencies=protected, tags=["health"],
                summary="Prometheus metrics", response_class=Response,
                responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                 "description": "Prometheus text format."},
                           401: ERROR_RESPONSES[401]})
    async def metrics() -> Response:
        data = await run_in_threadpool(generate_latest, state.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models", response_model=ModelList, dependencies=protected,
                tags=["models"], summary="Loaded models: tables, widths, sources, tiers",
                responses={401: ERROR_RESPONSES[401]})
    async def list_models() -> dict[str, Any]:
        models = await run_in_threadpool(model_infos, server)
        return {"models": models, "loading": state.pending(), "failed": dict(state.failed)}

    @router.get("/v1/models/{model}", response_model=ModelInfo, dependencies=protected,
                tags=["models"], summary="One model: tables, widths, sources, tiers",
                responses={**ERROR_RESPONSES,
                           404: {"model": ErrorBody, "description": "Unknown model."},
                           503: {"model": ErrorBody, "description": "Still loading."}})
    async def get_model(model: str) -> dict[str, Any]:
        state.model(model)
        for info in await run_in_threadpool(model_infos, server):
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
        media = media_type_of(request)
        loaded_table = state.model(model).table(table)
        body = await read_body(request, limit)
        if media == OCTET_STREAM:
            data, count, width = await run_in_threadpool(
                lookup_binary, server, model, loaded_table, body)
            return Response(data, media_type=OCTET_STREAM, headers={
                KEYS_HEADER: str(count), WIDTH_HEADER: str(width),
                MODEL_HEADER: model, TABLE_HEADER: loaded_table.name})
        payload = await run_in_threadpool(lookup_json, server, model, loaded_table, body)
        return Response(payload, media_type=JSON)

    @router.post("/v1/models/{model}/reload", response_model=ReloadResponse,
                 dependencies=[*protected, Depends(require_admin)], tags=["admin"],
                 summary="Re-read a model's files (optionally from new URIs), swap atomically",
                 responses={**ERROR_RESPONSES,
                            403: {"model": ErrorBody, "description": "Admin routes need a "
                                  "token unless the server is bound to loopback."},
                            404: {"model": ErrorBody, "description": "Unknown model or "
                                  "missing files."},
                            422: {"model": ErrorBody, "description": "Bad sparse_files, or "
                                  "the files are not a valid model."}})
    async def reload(model: str, body: ReloadRequest | None = None) -> dict[str, Any]:
        """Re-read the model's sparse files and swap the new version in atomically.

        With `{"sparse_files": [...]}` the model is read from those URIs (one per table;
        absolute paths or URIs) and later reloads keep them. Lookups see the old version
        until the new one is complete; a failed reload leaves the old version serving.
        """
        config = state.model_config(model)
        if body is not None and body.sparse_files is not None:
            config = _with_sources(config, body.sparse_files)
        loaded = await run_in_threadpool(state.load, config)
        return {
            "model": model,
            "seconds": sum(t.source.load_seconds for t in loaded.tables),
            "tables": [{"index": t.index, "name": t.name, "dim": t.dim,
                        "source": t.source.as_dict()} for t in loaded.tables],
        }

    return router


def _with_sources(config: ModelConfig, files: list[str]) -> ModelConfig:
    """`config` reading its tables from `files`; ConfigError if they do not fit."""
    if len(files) != config.num_tables:
        raise ConfigError(f"sparse_files has {len(files)} entries but model "
                          f"{config.model!r} has {config.num_tables} tables")
    relative = [f for f in files if "://" not in f and not os.path.isabs(f)]
    if relative:
        raise ConfigError(f"sparse_files must be absolute paths or URIs, got {relative}")
    return config.model_copy(update={"sparse_files": list(files)})
