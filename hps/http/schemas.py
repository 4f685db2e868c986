"""Request and response bodies of the HTTP API, and the OpenAPI text of the lookup route.

The JSON forms are pydantic models (validated in pydantic-core, with no Python loop over
keys). The binary form has no model: its request body is little-endian keys (int64, or
the dtype `X-HPS-Key-Dtype` declares: `KEY_DTYPES`) and its response body little-endian
float32 rows, described to OpenAPI by `LOOKUP_REQUEST_OPENAPI` and `LOOKUP_RESPONSES`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1

OCTET_STREAM = "application/octet-stream"
JSON = "application/json"

#: the dtypes binary keys may come in, little-endian, by name: /v1's `X-HPS-Key-Dtype`
#: values, and in upper case the datatypes of KServe v2's KEYS. int64 is the default;
#: uint64 keys are read as int64 (HugeCTR's `long long` keys), 32-bit ones widened.
KEY_DTYPES: dict[str, np.dtype[Any]] = {
    "int64": np.dtype("<i8"), "int32": np.dtype("<i4"), "uint32": np.dtype("<u4"),
    "uint64": np.dtype("<u8")}
#: request header of a binary lookup: the keys' dtype (a KEY_DTYPES name); its answer
#: carries it back, naming the dtype the keys were read as
KEY_DTYPE_HEADER = "X-HPS-Key-Dtype"

#: response headers of a binary lookup
KEYS_HEADER = "X-HPS-Keys"
WIDTH_HEADER = "X-HPS-Width"
MODEL_HEADER = "X-HPS-Model"
TABLE_HEADER = "X-HPS-Table"


#: a key in JSON: an integer (no fraction, no string, no bool) in the int64 range
Key = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]


class LookupRequest(BaseModel):
    """JSON lookup: the keys to look up, signed 64-bit integers."""

    model_config = ConfigDict(extra="forbid")

    keys: list[Key] = Field(
        description="Keys to look up (int64; JSON integers).", examples=[[1, 2, 3]])


class LookupResponse(BaseModel):
    """JSON lookup result: one vector per key, in the order of the keys."""

    model: str
    table: str = Field(description="The table's name (also when it was asked for by index).")
    width: int = Field(description="Vector width (the table's embedding_vecsize).")
    count: int = Field(description="Number of keys, and of vectors.")
    vectors: list[list[float]]


class ErrorDetail(BaseModel):
    kind: str = Field(description="What kind of error: bad_body, unknown_model, …")
    message: str = Field(description="What was wrong and what was expected.")
    # a version the load gate refused (422 load_gate) says which check, where, and by how much
    model: str | None = Field(None, description="load_gate: the model refused.")
    table: str | None = Field(None, description="load_gate: the table that failed a check.")
    check: str | None = Field(None, description="load_gate: the check that failed (width, "
                              "non_finite, encodable, duplicates, size, norm_ratio, "
                              "key_churn).")
    figure: float | int | str | None = Field(None, description="load_gate: what was found.")
    limit: float | int | str | None = Field(None, description="load_gate: what is allowed.")


class ErrorBody(BaseModel):
    """The body of every 4xx and 5xx answer."""

    error: ErrorDetail


class TableInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int
    name: str
    storage_name: str = Field(description="hps_et.<model>.<table>")
    dim: int
    default_value: float
    max_keys: int = Field(description="Most keys one lookup may ask for.")
    source: dict[str, Any] = Field(description="URI, key count, bytes, load time.")
    stats: dict[str, int] = Field(description="Lookups, keys, hits per tier, defaults.")
    tiers: dict[str, Any] = Field(description="Keys held per tier.")
    hit_rate: dict[str, float | None] = Field(
        description="Fraction of looked-up keys served by each tier (null before any lookup).")
    http_lookup: dict[str, Any] | None = Field(
        None, description="Which path answers lookups with host keys (HTTP, gRPC): `path` "
        "gpu, host or by_size, `reason`, the times measured at load per size (`sizes`, "
        "`gpu_us`, `host_us`, `paths`) and `answered` per path (docs/workers.md).")


class WorkerVersion(BaseModel):
    worker: int = Field(description="The worker's index (0: the leader).")
    version: int | None = Field(description="The version it serves (null: none).")


class ModelInfo(BaseModel):
    model: str
    ready: bool
    tables: list[TableInfo]
    # `hps serve --workers N` only (absent with one process): docs/workers.md
    version: int | None = Field(
        None, description="--workers N only: the version the server serves, named by the "
        "op of the run's op log that loaded it (the same number in every worker).")
    workers: list[WorkerVersion] | None = Field(
        None, description="--workers N only: the version each live worker that takes "
        "requests serves; one that differs from `version` makes /readyz 503.")


class ModelList(BaseModel):
    models: list[ModelInfo]
    loading: list[str] = Field(description="Models of the config not loaded yet.")
    failed: dict[str, str] = Field(description="Models whose load failed, with the error.")


class ReloadRequest(BaseModel):
    """Optional body of a reload: new source URIs, one per table (absolute paths or URIs),
    and what the load gate may let in for this reload alone."""

    model_config = ConfigDict(extra="forbid")

    sparse_files: list[str | dict[str, Any]] | None = Field(
        None, description="One entry per table: a path or URI, or an object with `path`, "
                          "`format` and the format's options (as in ps.json).")
    allow_empty: StrictBool = Field(
        False, description="Load a table of no keys (every lookup of it answers the "
                           "default vector); refused otherwise (422, check `size`).")
    allow_shrink: StrictBool = Field(
        False, description="Load a version holding fewer than validation.min_key_ratio "
                           "of the served keys (refused otherwise: 422, check `size`); "
                           "the key churn of the keys it lost only warns.")


class ReloadResponse(BaseModel):
    model: str
    seconds: float
    tables: list[dict[str, Any]] = Field(description="Each table's name and new source.")


class Health(BaseModel):
    status: str


class UpdateSourceState(BaseModel):
    source: str = Field(description="'kafka' or 'redis_stream'.")
    state: str = Field(description="'starting', 'running', 'down' (the source cannot be "
                       "read), 'retrying' (a tier cannot take the writes) or 'stopped'; "
                       "both failures are retried with backoff while lookups are served.")
    since: float = Field(description="When the state began, seconds since the epoch.")
    failing: dict[str, str] = Field(
        default_factory=dict, description="Tables whose updates cannot be read now (a "
        "stream key of another type, say), with why; the other tables' updates go on.")
    lagging: dict[str, int] = Field(
        default_factory=dict, description="Tables with update messages waiting, and how "
        "many.")


class WorkerVersionLag(BaseModel):
    worker: int = Field(description="The worker's index (0: the leader).")
    model: str
    version: int | None = Field(description="The version it serves (null: none).")
    server_version: int | None = Field(description="The version the server serves (null: "
                                       "none, the model was removed).")


class Readiness(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: str = Field(description="'ready', 'loading', 'failed', 'stalled' (a lookup "
                        "did not return within the lookup limit and still holds its "
                        "thread), or 'mixed_versions' (a worker serves another version "
                        "than the server's: `versions`).")
    loaded: list[str]
    loading: list[str]
    failed: list[str] = Field(description="Models whose load failed (the errors are in "
                              "GET /v1/models, which the token protects).")
    degraded: dict[str, Any] = Field(
        default_factory=dict,
        description="Tiers not serving as configured, by tier name: `available` (false "
        "while down) and `tables_pending` (tables a load could not write to it, filled in "
        "the background). Lookups are still answered whole (from the next tier).")
    updates: UpdateSourceState | None = Field(
        None, description="The online update source (update_source), absent without one. "
        "Its outage does not make the server unready: lookups go on from the tiers; "
        "counters and lag per table are in /metrics (hps_update_*).")
    versions: list[WorkerVersionLag] | None = Field(
        None, description="--workers N only, absent when none: each live worker that "
        "serves a version of a model other than the server's (status `mixed_versions`, "
        "503), e.g. one still applying a reload.")


def _error_response(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema with its `$defs` written in place: a schema put in the
    OpenAPI document by hand (`openapi_extra`) cannot refer to `#/$defs/...`, which would
    be read from the document's root and not be found."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)  # type: ignore[no-any-return]


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _error_response("A token is set and the request has none, or a wrong one."),
    413: _error_response("A body larger than the server's limit (--max-body-bytes)."),
    422: _error_response("A parameter is not of the expected form."),
}

def _any_case(names: Iterable[str]) -> str:
    """A pattern that matches exactly `names`, in any case (JSON Schema's patterns have
    no flags): what the server reads of a header of these names."""
    spelt = ("".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c)
                     for c in name) for name in names)
    return f"^({'|'.join(spelt)})$"


LOOKUP_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    400: _error_response(f"A binary body that is not a whole number of keys of its dtype "
                         f"({KEY_DTYPE_HEADER}; the message names both), an unknown dtype, "
                         "bad JSON, or too many keys."),
    404: _error_response("Unknown model or table."),
    413: _error_response("Body larger than the server's limit."),
    415: _error_response("Content type other than application/octet-stream or JSON."),
    503: _error_response("The model is still loading, or more lookups wait than the "
                         "server takes (kind overloaded; Retry-After says when to retry)."),
    504: _error_response("The request's deadline (X-HPS-Deadline-Ms) passed before its "
                         "answer was ready."),
}

#: OpenAPI of the lookup route's request body: the binary and the JSON form
LOOKUP_REQUEST_OPENAPI: dict[str, Any] = {
    "parameters": [{
        "name": KEY_DTYPE_HEADER,
        "in": "header",
        "required": False,
        "description": (
            "The dtype of a binary body's keys (little-endian): int64 (the default), "
            "int32, uint32 or uint64. uint64 keys are read as int64, as HugeCTR's `long "
            "long` keys were; 32-bit keys are widened; in any case. A body that is not a "
            "whole number of keys of that dtype is refused (400). JSON bodies are int64 "
            "whatever it says, but a value that is no dtype is refused (400) on both."),
        "schema": {"type": "string", "pattern": _any_case(KEY_DTYPES), "default": "int64"},
    }],
    "requestBody": {
        "required": True,
        "description": (
            "Either raw little-endian keys (int64, 8 bytes each, no header; another dtype "
            f"by {KEY_DTYPE_HEADER}), or JSON "
            '`{"keys": [...]}`. The answer has the same form as the request.'
        ),
        "content": {
            OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}},
            JSON: {"schema": inline_schema(LookupRequest)},
        },
    },
}

#: responses of the lookup route: 200 in both forms, and its errors
LOOKUP_RESPONSES: dict[int | str, dict[str, Any]] = {
    **LOOKUP_ERRORS,
    200: {
        "model": LookupResponse,
        "description": (
            "Vectors of the keys, in their order. Binary: raw little-endian float32 rows "
            f"(count × width × 4 bytes) with headers {KEYS_HEADER} (count), "
            f"{WIDTH_HEADER} (width) and {KEY_DTYPE_HEADER} (the dtype the keys were read "
            "as). JSON: a LookupResponse."
        ),
        "headers": {
            KEYS_HEADER: {"schema": {"type": "integer"}, "description": "Number of keys."},
            WIDTH_HEADER: {"schema": {"type": "integer"}, "description": "Vector width."},
            KEY_DTYPE_HEADER: {"schema": {"type": "string", "enum": list(KEY_DTYPES)},
                               "description": "The dtype the body's keys were read as."},
        },
        "content": {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}},
    },
}
