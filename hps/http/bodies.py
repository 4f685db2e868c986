"""Bodies of the hot routes (v1 lookup, v2 infer): reading a request body within its
limit, what a JSON body may cost, and answers in JSON.

- `parse_length`: a length header's value, the one way every length header is read;
- `declared_length`: the Content-Length a request declares, read the one way every limit
  reads it (the body limit, a table's or model's key limit, the direct answer's check);
- `read_body`: the whole body from the ASGI receive channel, 413 beyond the limit;
- `json_body_limit`: the largest JSON body worth parsing for so many keys;
- `encode_json`, `json_answer`: an answer as JSON, NumPy arrays written whole (orjson
  when installed), never element by element in Python;
- `validation_message`: a pydantic validation error as one line of a 400's message.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from hps.http.errors import BodyTooLarge
from hps.http.schemas import JSON

if TYPE_CHECKING:
    from starlette.types import Receive

#: what a hot route's handler answers: the response headers and the body, in one or more
#: parts (`hot_routes.Handler`)
Answer = tuple[list[tuple[bytes, bytes]], Sequence[bytes | memoryview]]

_JSON_TYPE = JSON.encode()


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:  # pragma: no cover - depends on the environment
        return None


#: orjson writes float32 arrays directly, several times faster than json + tolist()
orjson = _optional("orjson")


# -- request bodies -----------------------------------------------------------------------

def parse_length(value: str) -> int | None:
    """A length a header gives, as plain ASCII decimal digits; None for anything else
    (`str.isdigit` alone accepts '²', which `int` refuses, and '١', which it reads)."""
    return int(value) if value.isascii() and value.isdigit() else None


def declared_length(headers: Mapping[str, str]) -> int | None:
    """The body length the request's Content-Length declares; None without one, or when it
    is not plain decimal digits (such a body is bounded as it is read)."""
    return parse_length(headers.get("content-length", ""))


async def read_body(headers: Mapping[str, str], receive: Receive, limit: int) -> bytes:
    """The whole body, refusing (413) one larger than `limit` before reading it all."""
    declared = declared_length(headers)
    if declared is not None and declared > limit:
        raise BodyTooLarge(f"body of {declared:,} bytes exceeds the limit of {limit:,}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body exceeds the limit of {limit:,} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


#: bytes a JSON body may spend per key: 20 digits, a sign, a comma and a space, rounded up
JSON_BYTES_PER_KEY = 24


def json_body_limit(max_keys: int) -> int:
    """The largest JSON lookup body worth parsing for a table of `max_keys` keys a lookup.

    Parsing makes a Python object per key (about 200 times the bytes of the body): a
    body is refused before parsing when it is larger than `max_keys` keys can be written
    in, so a parse is bounded by the table's own limit, not by the body limit."""
    return 256 + JSON_BYTES_PER_KEY * max_keys


def validation_message(exc: ValidationError) -> str:
    """The first few errors of a pydantic validation, one line."""
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    more = f" (and {exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
    return "; ".join(parts) + more


# -- answers ------------------------------------------------------------------------------

def json_answer(payload: bytes) -> Answer:
    """(response headers, body parts) of a JSON answer whose body is `payload`."""
    return [(b"content-type", _JSON_TYPE),
            (b"content-length", str(len(payload)).encode())], (payload,)


def encode_json(payload: dict[str, Any]) -> bytes:
    """`payload` as JSON bytes; NumPy arrays in it (C-contiguous) become (nested) lists,
    their non-finite values null."""
    if orjson is not None:
        return bytes(orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY))
    return encode_json_stdlib(payload)


def encode_json_stdlib(payload: dict[str, Any]) -> bytes:
    """`encode_json` without orjson: `.tolist()` and the json module."""
    return json.dumps(payload, separators=(",", ":"), default=_array_cells).encode()


def _array_cells(value: Any) -> Any:
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{type(value).__name__} is not JSON serialisable")
    finite = np.isfinite(value)
    if finite.all():
        return value.tolist()
    cells = value.astype(object)  # JSON has no NaN/inf: write null, as orjson does
    cells[~finite] = None
    return cells.tolist()
