"""The lookup route, `POST /v1/models/{model}/tables/{table}/lookup`: the hot path.

Bodies: little-endian int64 keys (`application/octet-stream`; int32, uint32 or uint64
keys with `X-HPS-Key-Dtype`) → raw little-endian float32 rows with
`X-HPS-Keys`/`X-HPS-Width` headers, and `X-HPS-Key-Dtype` naming the dtype the keys were
read as (a client that forgot its header sees `int64` and half its key count); or JSON
`{"keys": [...]}` → JSON `{"vectors": [[...]], ...}`. Keys and vectors cross as whole
arrays (`np.frombuffer` in, a memoryview of the rows out; JSON through pydantic-core and
orjson or `.tolist()`), never key by key.

The lookup itself runs through `ServiceState.run_lookup`: on the app's lookup thread pool
(`ServiceState.executor`), or on the event loop when every tier is in process memory
(`lookup_threads` 0). Measured on 2 cores, a dedicated `ThreadPoolExecutor` reached
through `loop.run_in_executor` costs about a third of anyio's `to_thread` (starlette's
`run_in_threadpool`) per call under concurrency, which on this route is a large share of
the whole request.

`handle_lookup` is the route's `hot_routes.Handler`: every way the route is answered
(`hot_routes.HotRoutes`) goes through it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from hps.errors import BatchTooLargeError
from hps.http.bodies import (
    JSON_BYTES_PER_KEY,
    declared_length,
    encode_json,
    json_answer,
    json_body_limit,
    read_body,
    validation_message,
)
from hps.http.errors import BadBody, BadJSON, UnsupportedMediaType
from hps.http.schemas import (
    JSON,
    KEY_DTYPE_HEADER,
    KEY_DTYPES,
    KEYS_HEADER,
    MODEL_HEADER,
    OCTET_STREAM,
    TABLE_HEADER,
    WIDTH_HEADER,
    LookupRequest,
)

if TYPE_CHECKING:
    from starlette.types import Receive

    from hps.http.hot_routes import Answer
    from hps.http.state import ServiceState
    from hps.server import HierarchicalParameterServer, LoadedTable

LOOKUP_PATH = "/v1/models/{model}/tables/{table}/lookup"
_KEYS, _WIDTH = KEYS_HEADER.lower().encode(), WIDTH_HEADER.lower().encode()
_MODEL, _TABLE = MODEL_HEADER.lower().encode(), TABLE_HEADER.lower().encode()
_KEY_DTYPE = KEY_DTYPE_HEADER.lower()
_KEY_DTYPE_OUT = _KEY_DTYPE.encode()
_INT64 = KEY_DTYPES["int64"]
_DTYPE_NAMES = {dtype: name.encode() for name, dtype in KEY_DTYPES.items()}
LOOKUP_RE = re.compile(r"^/v1/models/(?P<model>[^/]+)/tables/(?P<table>[^/]+)/lookup$")


# -- the request's keys -------------------------------------------------------------------

def media_type_of(headers: Mapping[str, str]) -> str:
    """The body's media type, lower-case, without parameters; 415 unless one we read."""
    raw = headers.get("content-type", "")
    media = raw.split(";", 1)[0].strip().lower()
    if media not in (OCTET_STREAM, JSON):
        got = f"{raw!r}" if raw else "no Content-Type"
        raise UnsupportedMediaType(
            f"lookup bodies are {OCTET_STREAM} (little-endian int64 keys) or {JSON} "
            f'({{"keys": [...]}}); got {got}')
    return media


def parse_json_keys(body: bytes) -> np.ndarray:
    """int64 keys of a JSON body `{"keys": [...]}`; BadJSON naming what was wrong."""
    try:
        request = LookupRequest.model_validate_json(body)
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise BadJSON(f"body is not valid JSON: {validation_message(exc)}") from None
        raise BadJSON('expected {"keys": [int64, ...]}: ' + validation_message(exc)) from None
    return np.array(request.keys, dtype=np.int64)


def key_dtype_of(headers: Mapping[str, str]) -> np.dtype[Any]:
    """The dtype of a binary body's keys: `X-HPS-Key-Dtype` (int64 without it); BadBody
    naming the dtypes there are for any other value."""
    name = headers.get(_KEY_DTYPE)
    if name is None:
        return _INT64
    dtype = KEY_DTYPES.get(name.strip().lower())
    if dtype is None:
        raise BadBody(f"{KEY_DTYPE_HEADER} {name!r} is not a key dtype: send one of "
                      f"{', '.join(KEY_DTYPES)} (int64 without the header)")
    return dtype


def parse_binary_keys(body: bytes, dtype: np.dtype[Any] = _INT64) -> np.ndarray:
    """The keys of a binary body, little-endian `dtype` (no copy); BadBody naming the
    dtype and the body's size when it is not a whole number of such keys."""
    if len(body) % dtype.itemsize:
        name = next(n for n, d in KEY_DTYPES.items() if d == dtype)
        raise BadBody(
            f"binary body of {len(body)} bytes is not a whole number of {name} keys "
            f"({dtype.itemsize} bytes each, little-endian); declare the keys' dtype with "
            f"{KEY_DTYPE_HEADER}: {', '.join(KEY_DTYPES)} (int64 without it)")
    return np.frombuffer(body, dtype=dtype)


# -- the lookups (run on the lookup thread pool) ------------------------------------------

def lookup_binary(server: HierarchicalParameterServer, model: str, table: LoadedTable,
                  body: bytes, dtype: np.dtype[Any] = _INT64) -> tuple[memoryview, int, int]:
    """(raw little-endian float32 rows, key count, width) of a binary body of `dtype`
    keys."""
    keys = parse_binary_keys(body, dtype)
    vectors = np.ascontiguousarray(server.lookup_http(model, table.index, keys), dtype="<f4")
    return vectors.reshape(-1).data.cast("B"), keys.size, vectors.shape[1]


def lookup_json(server: HierarchicalParameterServer, model: str, table: LoadedTable,
                body: bytes) -> bytes:
    """The JSON answer to a JSON body."""
    keys = parse_json_keys(body)
    vectors = server.lookup_http(model, table.index, keys)
    return encode_json({"model": model, "table": table.name, "width": int(vectors.shape[1]),
                        "count": int(keys.size), "vectors": np.ascontiguousarray(vectors)})


def _refuse_early(headers: Mapping[str, str], table: LoadedTable, media: str,
                  dtype: np.dtype[Any]) -> None:
    """BatchTooLargeError, before a byte of the body is read, when its declared length
    is more than the table's key limit can take."""
    size = declared_length(headers)
    if size is None:
        return
    if media == OCTET_STREAM and size // dtype.itemsize > table.max_keys:
        raise BatchTooLargeError(
            f"{size // dtype.itemsize} keys exceed the limit of {table.max_keys} for table "
            f"{table.name!r} (max_batch_size × maxnum_catfeature_query_per_table_per_sample)")
    if media == JSON and size > json_body_limit(table.max_keys):
        raise BatchTooLargeError(
            f"a JSON body of {size:,} bytes is longer than {table.max_keys} keys (the limit "
            f"of table {table.name!r}) take at {JSON_BYTES_PER_KEY} bytes each; send fewer "
            "keys, or the binary form")


async def handle_lookup(state: ServiceState, headers: Mapping[str, str], receive: Receive,
                        params: dict[str, str | None]) -> Answer:
    """The answer to one lookup: (response headers, body parts); raises for bad input.

    `headers` are the request's, with lower-case names; `receive` is the ASGI receive
    channel the body is read from; `params` holds the path's `model` and `table`.
    """
    model, table = params["model"] or "", params["table"] or ""
    state.check_client(headers)
    deadline = state.admit(headers)
    media = media_type_of(headers)
    loaded_table = state.model(model).table(table)
    dtype = key_dtype_of(headers)  # one that is no dtype is refused on either form
    if media != OCTET_STREAM:
        dtype = _INT64  # a JSON body's keys are int64 whatever the header says
    _refuse_early(headers, loaded_table, media, dtype)
    limit = state.max_body_bytes
    if media == JSON:  # a chunked body has no length to refuse early: bound the read
        limit = min(limit, json_body_limit(loaded_table.max_keys))
    body = await read_body(headers, receive, limit)
    started = time.perf_counter()
    if media == OCTET_STREAM:
        data, count, width = await state.run_lookup(
            lookup_binary, state.server, model, loaded_table, body, dtype, deadline=deadline)
        state.metrics.observe_lookup(model, loaded_table.name, time.perf_counter() - started)
        return [
            (b"content-type", OCTET_STREAM.encode()),
            (b"content-length", str(len(data)).encode()),
            (_KEYS, str(count).encode()), (_WIDTH, str(width).encode()),
            (_KEY_DTYPE_OUT, _DTYPE_NAMES[dtype]),
            (_MODEL, model.encode()), (_TABLE, loaded_table.name.encode()),
        ], (data,)
    payload = await state.run_lookup(lookup_json, state.server, model, loaded_table, body,
                                     deadline=deadline)
    state.metrics.observe_lookup(model, loaded_table.name, time.perf_counter() - started)
    return json_answer(payload)
