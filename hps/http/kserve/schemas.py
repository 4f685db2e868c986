"""What the v2 protocol declares of an HPS model: its tensors, its one version, the JSON
schema of an inference request, and the metadata and configuration bodies.

    inputs   KEYS     INT64 [-1]   every table's keys, concatenated in table order (also
                                   accepted: INT32, UINT32, UINT64; see KEY_DTYPES)
             NUMKEYS  INT32 [-1]   keys per table, in table order
    output   OUTPUT0  FP32  [-1]   the vectors of all keys, rows concatenated

`InferRequest` is the JSON header of `POST …/infer` (pydantic: validated in pydantic-core,
no Python loop over a tensor's elements).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from hps.errors import UnknownModelError
from hps.http.schemas import (
    INT64_MIN,
    JSON,
    KEY_DTYPES,
    OCTET_STREAM,
    UINT64_MAX,
    inline_schema,
)

KEYS_INPUT, NUMKEYS_INPUT, OUTPUT = "KEYS", "NUMKEYS", "OUTPUT0"
#: the one version each model is served as
VERSION = "1"
PLATFORM = "hps"
HEADER_LENGTH = "inference-header-content-length"
INFER_PATH = "/v2/models/{model}/infer"
INFER_RE = re.compile(r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer$")
#: the input tensors: name → (datatype declared in the metadata, little-endian NumPy dtype)
INPUTS: dict[str, tuple[str, np.dtype[Any]]] = {
    KEYS_INPUT: ("INT64", np.dtype("<i8")), NUMKEYS_INPUT: ("INT32", np.dtype("<i4"))}
#: the datatypes each input is accepted in: KEYS in any key dtype of /v1's (int64 the
#: one declared; uint64 read as int64, 32-bit keys widened), NUMKEYS in INT32 only
DATATYPES: dict[str, dict[str, np.dtype[Any]]] = {
    KEYS_INPUT: {name.upper(): dtype for name, dtype in KEY_DTYPES.items()},
    NUMKEYS_INPUT: {"INT32": np.dtype("<i4")}}


def check_version(model: str, version: str | None) -> None:
    """UnknownModelError unless `version` is absent or the one served."""
    if version not in (None, "", VERSION):
        raise UnknownModelError(f"model {model!r} has no version {version!r} (served: "
                                f"{VERSION})")


# -- the request header (JSON) ------------------------------------------------------------

#: an element of a JSON tensor: an integer (no fraction, string or bool) in the int64 or
#: uint64 range (its own datatype's range is checked as the tensor is read)
Element = Annotated[int, Field(strict=True, ge=INT64_MIN, le=UINT64_MAX)]


class InferInput(BaseModel):
    """One input tensor: its data inline (JSON) or in the binary part of the body."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(json_schema_extra={"enum": [KEYS_INPUT, NUMKEYS_INPUT]})
    shape: list[Annotated[int, Field(strict=True, ge=0)]]
    datatype: str = Field(json_schema_extra={"enum": [name.upper() for name in KEY_DTYPES]})
    parameters: dict[str, Any] | None = None
    data: list[Element] | list[list[Element]] | None = None


class InferOutput(BaseModel):
    """An output asked for; `parameters.binary_data` asks for it in binary form."""

    model_config = ConfigDict(extra="forbid")

    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    """The JSON header of an inference request (KServe v2)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    parameters: dict[str, Any] | None = None
    # what the document says of the inputs: KEYS and NUMKEYS, once each (an empty list, or
    # one without either, is a 400 naming the missing input: parse.py). Checked by the
    # parser, whose messages say which input is wrong, so in the schema alone.
    inputs: list[InferInput] = Field(json_schema_extra={"minItems": 2, "maxItems": 2})
    outputs: list[InferOutput] | None = None


# -- what the metadata routes answer ------------------------------------------------------

def model_metadata(model: str) -> dict[str, Any]:
    """GET /v2/models/{model}: the tensors as Triton's HPS backend declared them."""
    return {
        "name": model, "versions": [VERSION], "platform": PLATFORM,
        "inputs": [{"name": KEYS_INPUT, "datatype": "INT64", "shape": [-1]},
                   {"name": NUMKEYS_INPUT, "datatype": "INT32", "shape": [-1]}],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1]}],
    }


def model_config(model: str) -> dict[str, Any]:
    """GET /v2/models/{model}/config: Triton's configuration of an HPS backend model."""
    return {
        "name": model, "backend": PLATFORM, "platform": PLATFORM, "max_batch_size": 0,
        "input": [{"name": KEYS_INPUT, "data_type": "TYPE_INT64", "dims": [-1]},
                  {"name": NUMKEYS_INPUT, "data_type": "TYPE_INT32", "dims": [-1]}],
        "output": [{"name": OUTPUT, "data_type": "TYPE_FP32", "dims": [-1]}],
    }


def _v2_error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "string"}}}}}}


#: the v2 routes' error answers (`{"error": "..."}`), each route's own besides 401 and 413
V2_ERRORS: dict[int | str, dict[str, Any]] = {
    401: _v2_error("A token is set and the request has none, or a wrong one."),
    404: _v2_error("Unknown model, or a version other than 1."),
    413: _v2_error("A body larger than the server's limit (--max-body-bytes)."),
    422: _v2_error("A parameter is not of the expected form."),
    503: _v2_error("The model is still loading."),
}
#: the infer route's error answers
INFER_ERRORS: dict[int | str, dict[str, Any]] = {
    **V2_ERRORS,
    400: _v2_error("Not a valid inference request (JSON, inputs, binary sizes)."),
    413: _v2_error("A body larger than the server's limit, or more keys than the model's "
                   "limits take."),
    415: _v2_error("A compressed body (Content-Encoding)."),
    503: _v2_error("The model is still loading, or more lookups wait than the server "
                   "takes (Retry-After says when to retry)."),
    504: _v2_error("The request's deadline (X-HPS-Deadline-Ms) passed before its answer "
                   "was ready."),
}

#: OpenAPI of the infer body: a JSON request, or JSON header + binary tensors
INFER_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": (
            "A KServe v2 inference request with inputs KEYS (INT64) and NUMKEYS (INT32). "
            "With the binary tensor data extension the body is the JSON header "
            "(Inference-Header-Content-Length bytes) followed by the inputs' raw bytes."),
        "content": {
            JSON: {"schema": inline_schema(InferRequest)},
            OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}},
        },
    },
}
