"""Encoding an inference answer: OUTPUT0 as JSON data, or as binary tensor data after
the JSON header in one buffer the lookups write into.

A binary answer is `Inference-Header-Content-Length` bytes of JSON header
(`"parameters": {"binary_data_size": n}` on OUTPUT0), then OUTPUT0's little-endian
float32 values. Its header and response headers depend only on (model, OUTPUT0's size,
request id): each is made once (`binary_head`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hps.http.bodies import encode_json
from hps.http.kserve.schemas import HEADER_LENGTH, OUTPUT, VERSION
from hps.http.schemas import OCTET_STREAM
from hps.runtime.raw_memory import address_of

#: bytes of a cache line: where a binary answer's vectors start (`header_and_values`)
_LINE = 64


def answer_head(model: str, floats: int, request_id: str | None,
                vectors: np.ndarray | None = None) -> dict[str, Any]:
    """The answer's JSON: OUTPUT0's `vectors` as JSON data, or (None) as binary data."""
    output: dict[str, Any] = {"name": OUTPUT, "datatype": "FP32", "shape": [floats]}
    head: dict[str, Any] = {"model_name": model, "model_version": VERSION}
    if request_id is not None:
        head["id"] = request_id
    head["outputs"] = [output]
    if vectors is None:
        output["parameters"] = {"binary_data_size": 4 * floats}
    else:
        output["data"] = vectors
    return head


#: the JSON header and response headers of binary answers by (model, OUTPUT0's floats,
#: request id): they say nothing else, and every request of a shape has the same ones
_BINARY_HEADS: dict[tuple[str, int, str | None],
                    tuple[bytes, tuple[tuple[bytes, bytes], ...]]] = {}
_BINARY_HEADS_MAX = 256


def binary_head(model: str, floats: int, request_id: str | None
                ) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
    """(the JSON header, the response headers) of a binary answer of `floats` values."""
    key = (model, floats, request_id)
    known = _BINARY_HEADS.get(key)
    if known is None:
        header = encode_json(answer_head(model, floats, request_id))
        known = header, ((b"content-type", OCTET_STREAM.encode()),
                         (b"content-length", str(len(header) + 4 * floats).encode()),
                         (HEADER_LENGTH.encode(), str(len(header)).encode()))
        if len(_BINARY_HEADS) >= _BINARY_HEADS_MAX:
            _BINARY_HEADS.clear()
        _BINARY_HEADS[key] = known
    return known


def header_and_values(header: bytes, floats: int) -> tuple[memoryview, np.ndarray]:
    """One buffer of `header` followed by room for `floats` float32 values, the values'
    start on a cache line: (the buffer's bytes, the values as an array to fill).

    An answer sent as one body part goes out in one write: sent as two, the small JSON
    header went out as a TCP segment of its own before the vectors, which cost a v2
    request about 50 µs on the 2-core machine (one client, server-side timing)."""
    size = len(header) + 4 * floats
    raw = np.empty(size + _LINE - 1, np.uint8)
    pad = -(address_of(raw) + len(header)) % _LINE
    memoryview(raw)[pad:pad + len(header)] = header  # (a memoryview copies fastest)
    values = raw[pad + len(header):pad + size].view(np.float32)
    return raw[pad:pad + size].data, values
