"""The routes of hot and missing keys and of warm-ups.

- `GET /v1/models/{model}/tables/{table}/keys?top=100&kind=hot|missing`: a table's
  heaviest keys from its sketch (hps/server/key_sketch.py), with estimated counts and
  their error bound;
- `GET /v1/models/{model}/tables/{table}/hot-set`: the hot keys, then the keys the GPU
  caches hold (`cached`, most recently used first), as little-endian int64
  (`application/octet-stream`, the form `warm_from` reads) or JSON (`format=json`);
- `POST /v1/models/{model}/prefetch` (admin): `{"table": t, "keys": [...]}` or
  `{"from": "hot-set"}` (every table's own hot keys, or one table's with `table`) warms
  the volatile tier and the GPU caches in the background: 202 with the jobs;
- `GET /v1/models/{model}/prefetch/{job}`: a job's status and counts;
- `POST /v1/models/{model}/hot-rows` (admin): `{}` or `{"table": t}` fills the hot copies
  of the model's tables sharded over GPUs (one table's with `table`) from their hot-key
  sketches now, as the server does in the background (hps/server/hot_fill.py); under
  `--workers N` every worker fills its own. 409 where no table asked for keeps copies.

The guards come from `routes.py` (`build_keys_router` takes them, so this module needs
nothing of it).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from hps.http.errors import ApiError
from hps.http.schemas import ERROR_RESPONSES, JSON, KEYS_HEADER, OCTET_STREAM, ErrorBody, Key
from hps.http.state import ServiceState
from hps.server.key_sketch import HOT_SLOTS
from hps.server.warm_up import MOST_CACHED_KEYS

#: the most keys a table's hot sketch tracks, so the most a `top` may ask for
MOST_KEYS = HOT_SLOTS * 3 // 4


class UnknownJob(ApiError):
    """No prefetch job of that id (for that model) is known."""

    status = 404
    kind = "unknown_job"


#: the rule of `PrefetchRequest._one_source` in its JSON schema, so the OpenAPI document
#: refuses what the server refuses: `keys` with a `table` (no `from`), or `from` (no `keys`)
_ONE_SOURCE = {"oneOf": [
    {"required": ["keys", "table"],
     "properties": {"keys": {"type": "array"}, "table": {"not": {"type": "null"}},
                    "from": {"type": "null"}}},
    {"required": ["from"],
     "properties": {"from": {"const": "hot-set"}, "keys": {"type": "null"}}},
]}


class PrefetchRequest(BaseModel):
    """What to prefetch: a table's keys, or the hot sets of the server's own sketches."""

    # strict: `false` is no table nor `top` (lax, it was 0), as the schema says
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True,
                              json_schema_extra=_ONE_SOURCE)

    table: str | int | None = Field(
        None, description="The table (name or index); required with `keys`; with `from`, "
        "null or absent: every table.")
    keys: list[Key] | None = Field(None, description="Keys to prefetch (int64).",
                                   examples=[[1, 2, 3]])
    source: Literal["hot-set"] | None = Field(
        None, alias="from", description='"hot-set": the hot keys of this server\'s own '
                                        "sketch (one table's, or every table's).")
    top: int = Field(MOST_KEYS, ge=1, le=MOST_KEYS,
                     description="With `from`: how many of the hot keys.")

    @model_validator(mode="after")
    def _one_source(self) -> PrefetchRequest:
        if (self.keys is None) == (self.source is None):
            raise ValueError('give either "keys" (with "table") or "from": "hot-set"')
        if self.keys is not None and self.table is None:
            raise ValueError('"keys" needs "table": the table they belong to')
        return self


class HotRowsRequest(BaseModel):
    """Which table's hot copies to fill (none: every table of the model that keeps some)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    table: str | int | None = Field(None, description="The table (name or index); null or "
                                    "absent: every table that keeps hot copies.")


class PrefetchJobs(BaseModel):
    model: str
    jobs: list[dict[str, Any]] = Field(description="Each table's job: `job` (its id), "
                                       "`status`, `keys`, and counts as it runs.")


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


_NOT_FOUND = _error("Unknown model or table.")
_LOADING = _error("The model is still loading.")


def build_keys_router(state: ServiceState, protected: list[Any], admin: list[Any]
                      ) -> APIRouter:
    """The routes above, bound to `state`; `protected` and `admin` are the dependencies
    of token-guarded and admin routes (routes.token_guard, routes.admin_guard)."""
    router = APIRouter()
    server = state.server

    @router.get("/v1/models/{model}/tables/{table}/keys", dependencies=protected,
                tags=["models"], summary="A table's hot or missing keys, with counts",
                responses={**ERROR_RESPONSES, 404: _NOT_FOUND, 503: _LOADING})
    async def table_keys(model: str, table: str,
                         top: int = Query(100, ge=1, le=MOST_KEYS),
                         kind: Literal["hot", "missing"] = "hot") -> dict[str, Any]:
        """The `top` heaviest keys of the table's `kind` sketch: `hot` (looked-up keys,
        sampled; with a GPU cache, the keys it missed) or `missing` (found in no tier).
        A key's true count lies in [count - error, count]; `share` is the listed keys'
        part of all counted."""
        state.model(model)
        found = server.top_keys(model, table, kind, top)
        total = found["total"]
        counts = found["counts"].tolist()
        error = found["error"]
        return {"model": model, "table": found["table"], "kind": kind,
                "source": found["source"], "sampling": found["sampling"], "total": total,
                "error": error,
                "share": min(1.0, sum(counts) / total) if total else None,
                "keys": [{"key": k, "count": c, "error": error}
                         for k, c in zip(found["keys"].tolist(), counts, strict=True)]}

    @router.get("/v1/models/{model}/tables/{table}/hot-set", dependencies=protected,
                tags=["models"], summary="A table's hot keys (int64, or JSON)",
                response_class=Response,
                responses={**ERROR_RESPONSES, 404: _NOT_FOUND, 503: _LOADING,
                           200: {"content": {OCTET_STREAM: {"schema": {
                               "type": "string", "format": "binary"}}, JSON: {}},
                               "description": "Little-endian int64 keys, heaviest first "
                                              "(X-HPS-Keys: their number), or "
                                              '{"keys": [...]} with format=json.'}})
    async def hot_set(model: str, table: str, top: int = Query(MOST_KEYS, ge=1, le=MOST_KEYS),
                      cached: int = Query(
                          MOST_CACHED_KEYS, ge=0, le=MOST_CACHED_KEYS,
                          description="At most this many keys the table's GPU caches hold "
                                      "follow the hot keys, most recently used first "
                                      "(0: the hot keys alone)."),
                      fmt: Literal["binary", "json"] = Query("binary", alias="format")
                      ) -> Response:
        """The hot keys of the table, heaviest first, then the keys its GPU caches hold:
        what `warm_from` reads and `POST .../prefetch` takes."""
        state.model(model)
        keys = await run_in_threadpool(server.hot_set, model, table, top, cached)
        if fmt == "json":
            return Response(json.dumps({"keys": keys.tolist()}).encode(), media_type=JSON)
        return Response(keys.astype("<i8").tobytes(), media_type=OCTET_STREAM,
                        headers={KEYS_HEADER: str(keys.size)})

    @router.post("/v1/models/{model}/prefetch", dependencies=admin, status_code=202,
                 response_model=PrefetchJobs, tags=["admin"],
                 summary="Warm the volatile tier and GPU caches with keys, in the background",
                 responses={**ERROR_RESPONSES, 404: _NOT_FOUND, 503: _LOADING,
                            403: _error("Admin routes need a token unless the server is "
                                        "bound to loopback."),
                            415: _error("A body that is not application/json."),
                            422: _error("Neither keys (with table) nor from, or both; "
                                        "keys that are not int64.")})
    async def prefetch(model: str, body: PrefetchRequest) -> dict[str, Any]:
        """Queue prefetch jobs and answer at once (202): their ids, to read with
        `GET /v1/models/{model}/prefetch/{job}`. Rows the persistent tier holds are
        copied to the volatile tier, and every row found goes into the GPU caches."""
        loaded = state.model(model)
        if body.keys is not None:
            jobs = [await run_in_threadpool(server.prefetch, model, body.table, body.keys)]
        else:
            tables = ([loaded.table(body.table).name] if body.table is not None
                      else [t.name for t in loaded.tables])
            jobs = []
            for name in tables:
                keys = server.top_keys(model, name, "hot", body.top)["keys"]
                jobs.append(server.prefetch(model, name, keys))
        return {"model": model, "jobs": [job.as_dict() for job in jobs]}

    @router.post("/v1/models/{model}/hot-rows", dependencies=admin, tags=["admin"],
                 summary="Fill the hot copies of tables sharded over GPUs now",
                 responses={**ERROR_RESPONSES, 404: _NOT_FOUND, 503: _LOADING,
                            403: _error("Admin routes need a token unless the server is "
                                        "bound to loopback."),
                            409: _error("No table asked for keeps hot copies here (not "
                                        "sharded over several GPUs, int8, gpu_hot_rows 0, "
                                        "or a server without GPUs).")})
    async def hot_rows(model: str, body: HotRowsRequest | None = None) -> dict[str, Any]:
        """Fill each device's hot copy of its peers' heaviest rows (docs/gpu-cache.md
        "Hot copies") from the table's hot-key sketch now, rather than at the next
        background fill: `tables`, each with the keys offered and what each device's
        copy holds (`held`). Under `--workers N`, every worker fills its own copies."""
        state.model(model)
        table = body.table if body is not None else None
        return await run_in_threadpool(server.fill_hot_rows, model, table)

    @router.get("/v1/models/{model}/prefetch/{job}", dependencies=protected,
                tags=["admin"], summary="A prefetch job's status and counts",
                responses={**ERROR_RESPONSES, 404: _error("Unknown model or job.")})
    async def prefetch_job(model: str, job: str) -> dict[str, Any]:
        found = server.prefetch_status(job)
        if found is None or found["model"] != model:
            raise UnknownJob(f"no prefetch job {job!r} of model {model!r} (jobs are kept "
                             "until a few hundred newer ones ran)")
        return found

    return router
