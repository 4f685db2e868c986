"""The KServe v2 / Triton inference protocol, as Triton's HPS backend served it.

One v2 model per HPS model, version "1", declared as the HPS backend declared it:

    inputs   KEYS     INT64 [-1]   every table's keys, concatenated in table order
             NUMKEYS  INT32 [-1]   keys per table, in table order (fewer entries than
                                   tables: the tables left out get no keys)
    output   OUTPUT0  FP32  [-1]   the vectors of all keys, rows concatenated in the
                                   same order (Σ NUMKEYS[i] × width[i] floats)

Routes (the KServe v2 protocol Triton speaks): `GET /v2`, `/v2/health/live`, `/v2/health/ready`,
`/v2/models/{model}[/versions/1]` (metadata), `…/ready`, `…/config` (Triton's model
configuration extension) and `POST …/infer`. Tensors come as JSON (`"data"`, flat or
nested, row-major) or through the binary tensor data extension: the body is the JSON
header (`Inference-Header-Content-Length` bytes) followed by each input's raw
little-endian bytes (`"parameters": {"binary_data_size": n}`), and an output asked for
with `"binary_data": true` (or the request parameter `binary_data_output`) is answered
the same way. `tritonclient.http.InferenceServerClient` works as it is.

Errors answer `{"error": "<message>"}` (the protocol's form) with the status of
`errors.status_of`: 400 for a malformed request, 404 for an unknown model or version,
413 for too many keys or too large a body, 401 without the token, 503 while loading.
Health routes are open; every other route needs the token when one is set.

Infer is a `fastpath.FastRoute`: it answers before FastAPI's router, and parsing, lookups
and encoding run on the lookup thread pool. Keys cross as arrays (`np.frombuffer` on the
binary part; pydantic-core validates JSON data), never key by key. A binary-only header
is parsed once per distinct header bytes: later requests with the same header are read
through its `BinaryLayout`.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hps.errors import BatchTooLargeError, LookupInputError, UnknownModelError
from hps.http.errors import BadBody, BadJSON, UnsupportedMediaType, v2_error_body
from hps.http.fastpath import FastRoute, respond
from hps.http.lookup import encode_json, json_body_limit, read_body, validation_message
from hps.http.schemas import INT64_MAX, INT64_MIN, JSON, OCTET_STREAM
from hps.runtime.raw_memory import address_of

if TYPE_CHECKING:
    from starlette.types import Receive

    from hps.http.fastpath import Answer
    from hps.http.state import ServiceState
    from hps.server import HierarchicalParameterServer, LoadedModel

KEYS_INPUT, NUMKEYS_INPUT, OUTPUT = "KEYS", "NUMKEYS", "OUTPUT0"
#: the one version each model is served as
VERSION = "1"
PLATFORM = "hps"
HEADER_LENGTH = "inference-header-content-length"
INFER_PATH = "/v2/models/{model}/infer"
INFER_VERSION_PATH = "/v2/models/{model}/versions/{version}/infer"
INFER_RE = re.compile(r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer$")
#: the input tensors: name → (datatype, little-endian NumPy dtype)
INPUTS: dict[str, tuple[str, np.dtype[Any]]] = {
    KEYS_INPUT: ("INT64", np.dtype("<i8")), NUMKEYS_INPUT: ("INT32", np.dtype("<i4"))}
INT32_MAX = 2**31 - 1
#: bytes of a cache line: where a binary answer's vectors start (`header_and_values`)
_LINE = 64


# -- the request header (JSON) ------------------------------------------------------------

#: an element of a JSON tensor: an integer (no fraction, string or bool) in the int64 range
Element = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]


class InferInput(BaseModel):
    """One input tensor: its data inline (JSON) or in the binary part of the body."""

    model_config = ConfigDict(extra="forbid")

    name: str
    shape: list[Annotated[int, Field(strict=True, ge=0)]]
    datatype: str
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
    inputs: list[InferInput]
    outputs: list[InferOutput] | None = None


class InferCall(NamedTuple):
    """A parsed inference request: the keys, keys per table, and the answer's form (a
    named tuple: made for every request, it costs half of a frozen dataclass)."""

    keys: np.ndarray  # int64 [n]
    numkeys: np.ndarray  # int64 [tables given]
    binary_output: bool
    request_id: str | None


def parse_header_length(value: str | None, body_size: int) -> int | None:
    """The JSON header's length from `Inference-Header-Content-Length` (None: all JSON)."""
    if value is None:
        return None
    if not value.strip().isdigit() or int(value) > body_size:
        raise BadBody(f"Inference-Header-Content-Length {value!r} is not a length within the "
                      f"body of {body_size} bytes")
    return int(value)


@dataclass(frozen=True)
class BinaryLayout:
    """What an inference header whose inputs are all binary says: each input's name,
    dtype, element count and offset in the binary part, the binary part's size, and the
    answer's form. The same header bytes always say the same: `parse_infer` keeps the
    layouts of recent headers (`_LAYOUTS`) and reads a request whose header it knows
    without parsing it again (clients send one header for every request of a shape)."""

    keys: tuple[np.dtype[Any], int, int]  # KEYS' dtype, element count and offset
    numkeys: tuple[np.dtype[Any], int, int]  # NUMKEYS' alike
    binary_size: int
    binary_output: bool
    request_id: str | None

    def read(self, binary: memoryview) -> InferCall:
        """The request whose binary part is `binary` (`binary_size` bytes)."""
        dtype, count, offset = self.keys
        keys = np.frombuffer(binary, dtype=dtype, count=count, offset=offset)
        dtype, count, offset = self.numkeys
        numkeys = np.frombuffer(binary, dtype=dtype, count=count, offset=offset)
        return InferCall(keys, numkeys.astype(np.int64), self.binary_output, self.request_id)


#: layouts of recent binary-only headers by their bytes; parsing one (pydantic) was the
#: largest part of a binary v2 request's own work after the lookup. Bounded: emptied
#: when full (a client sending a new request id each time gains nothing, loses nothing).
_LAYOUTS: dict[bytes, BinaryLayout] = {}
_LAYOUTS_MAX = 256
#: longer headers are not kept (a binary-only header of a few inputs is far shorter)
_LAYOUT_HEADER_MAX = 4096


def parse_infer(body: bytes, header_length: int | None) -> InferCall:
    """An inference request body → InferCall; BadJSON/BadBody naming what was wrong."""
    if header_length is None:
        return _parse(body, memoryview(b""))[0]
    head = body[:header_length]  # a small copy
    binary = memoryview(body)[header_length:]
    layout = _LAYOUTS.get(head)
    if layout is not None and len(binary) == layout.binary_size:
        return layout.read(binary)
    call, layout = _parse(head, binary)  # (a known header with a binary part of another
    if layout is not None and header_length <= _LAYOUT_HEADER_MAX:  # size raises here)
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[head] = layout
    return call


def _parse(head: bytes, binary: memoryview) -> tuple[InferCall, BinaryLayout | None]:
    """The request of JSON header `head` and binary part `binary`, and its layout when
    every input is binary."""
    try:
        request = InferRequest.model_validate_json(head)
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise BadJSON(f"the inference header is not valid JSON: "
                          f"{validation_message(exc)}") from None
        raise BadJSON(f"not a KServe v2 inference request: {validation_message(exc)}") from None
    tensors: dict[str, np.ndarray] = {}
    places: dict[str, tuple[np.dtype[Any], int, int]] = {}
    offset = 0
    for spec in request.inputs:
        if spec.name not in INPUTS:
            raise BadJSON(f"unknown input {spec.name!r}: the inputs are {KEYS_INPUT} (INT64) "
                          f"and {NUMKEYS_INPUT} (INT32)")
        if spec.name in tensors:
            raise BadJSON(f"input {spec.name!r} is given twice")
        start = offset
        tensors[spec.name], offset = _tensor(spec, binary, offset)
        if spec.data is None:
            places[spec.name] = (INPUTS[spec.name][1], tensors[spec.name].size, start)
    if offset != len(binary):
        raise BadBody(f"{len(binary) - offset} bytes of binary data follow the inputs' "
                      "binary_data_size; expected none")
    missing = [name for name in INPUTS if name not in tensors]
    if missing:
        raise BadJSON(f"input {missing[0]!r} is missing: send {KEYS_INPUT} (INT64, every "
                      f"table's keys) and {NUMKEYS_INPUT} (INT32, keys per table)")
    binary_output = _binary_output(request)
    call = InferCall(tensors[KEYS_INPUT], tensors[NUMKEYS_INPUT].astype(np.int64),
                     binary_output, request.id)
    every_input_binary = len(places) == len(request.inputs)
    return call, (BinaryLayout(places[KEYS_INPUT], places[NUMKEYS_INPUT], offset,
                               binary_output, request.id) if every_input_binary else None)


def _tensor(spec: InferInput, binary: memoryview, offset: int) -> tuple[np.ndarray, int]:
    """The flat array of one input, from its JSON data or the binary part at `offset`."""
    datatype, dtype = INPUTS[spec.name]
    if spec.datatype != datatype:
        raise BadJSON(f"input {spec.name!r} has datatype {spec.datatype!r}; expected "
                      f"{datatype}")
    params = spec.parameters or {}
    if "shared_memory_region" in params:
        raise BadJSON("shared-memory inputs are not supported: send the data in the body")
    count = math.prod(spec.shape)  # exact (no int64 wrap-around); 1 for a scalar
    size = params.get("binary_data_size")
    if size is not None:
        if spec.data is not None:
            raise BadJSON(f"input {spec.name!r} has both data and binary_data_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 \
                or offset + size > len(binary):
            raise BadBody(f"input {spec.name!r}: binary_data_size {size!r} does not fit the "
                          f"{len(binary) - offset} bytes of binary data left")
        itemsize = dtype.itemsize
        if size != count * itemsize:
            raise BadBody(f"input {spec.name!r} of shape {spec.shape} needs "
                          f"{count * itemsize} bytes of {datatype}; binary_data_size is {size}")
        return np.frombuffer(binary, dtype=dtype, count=count, offset=offset), offset + size
    if spec.data is None:
        raise BadJSON(f"input {spec.name!r} has neither data nor binary_data_size")
    try:
        values = np.array(spec.data, dtype=np.int64)
    except ValueError:  # nested rows of different lengths
        raise BadJSON(f"input {spec.name!r}: nested data rows differ in length") from None
    if values.size != count:
        raise BadJSON(f"input {spec.name!r} has {values.size} elements; its shape "
                      f"{spec.shape} needs {count}")
    if dtype == "<i4" and values.size and (values.min() < -INT32_MAX - 1
                                           or values.max() > INT32_MAX):
        raise BadJSON(f"input {spec.name!r} is INT32: its values must fit 32 bits")
    return values.reshape(-1), offset


def _binary_output(request: InferRequest) -> bool:
    """Whether OUTPUT0 is answered in binary form; BadJSON for outputs we do not have."""
    default = bool((request.parameters or {}).get("binary_data_output", False))
    if not request.outputs:
        return default
    binary = default
    for out in request.outputs:
        if out.name != OUTPUT:
            raise BadJSON(f"unknown output {out.name!r}: the output is {OUTPUT} (FP32)")
        params = out.parameters or {}
        if "shared_memory_region" in params or "classification" in params:
            raise BadJSON(f"output {OUTPUT}: shared memory and classification are not "
                          "supported")
        binary = bool(params.get("binary_data", default))
    return binary


# -- the inference (on the lookup thread pool) --------------------------------------------

@dataclass(frozen=True)
class InferPlan:
    """Where each table's keys and vectors lie in KEYS and OUTPUT0, counts checked."""

    counts: list[int]  # keys per table, in table order
    starts: list[int]  # each table's first key in KEYS (and the end)
    offsets: list[int]  # each table's first float in OUTPUT0 (and its size)
    dims: list[int]  # each table's width

    @property
    def size(self) -> int:
        """OUTPUT0's number of floats."""
        return self.offsets[-1]


#: the plans of each served model version by NUMKEYS: clients send the same counts with
#: every request of a shape, and a plan depends on nothing else. Weak: a retired version's
#: plans go with it. Bounded per version as `_LAYOUTS` is.
_PLANS: weakref.WeakKeyDictionary[LoadedModel, dict[tuple[int, ...], InferPlan]] = (
    weakref.WeakKeyDictionary())
_PLANS_MAX = 256


def plan_infer(server: HierarchicalParameterServer, model: str, keys: np.ndarray,
               numkeys: np.ndarray) -> InferPlan:
    """The split of `keys` by `numkeys` over the model's tables in order. Checks every
    count before any lookup (LookupInputError, BatchTooLargeError), so bad input changes
    nothing."""
    loaded = server.model(model)
    counts = tuple(numkeys.tolist())  # one entry per table: plain ints beat ufuncs here
    plans = _PLANS.get(loaded)
    plan = plans.get(counts) if plans is not None else None
    if plan is None:
        plan = _plan(loaded, model, counts)
        if plans is None:
            plans = _PLANS.setdefault(loaded, {})
        if len(plans) >= _PLANS_MAX:
            plans.clear()
        plans[counts] = plan
    if plan.starts[-1] != keys.size:
        raise LookupInputError(f"NUMKEYS adds up to {plan.starts[-1]} keys but KEYS has "
                               f"{keys.size}")
    return plan


def _plan(loaded: LoadedModel, model: str, counts: tuple[int, ...]) -> InferPlan:
    """The plan of `counts` keys per table, each count checked against its table."""
    tables = loaded.tables
    if len(counts) > len(tables):
        raise LookupInputError(f"NUMKEYS has {len(counts)} entries but model {model!r} has "
                               f"{len(tables)} tables")
    if any(c < 0 for c in counts):
        raise LookupInputError("NUMKEYS must not be negative")
    used = tables[:len(counts)]
    for table, count in zip(used, counts, strict=True):
        if count > table.max_keys:
            raise BatchTooLargeError(
                f"{count} keys exceed the limit of {table.max_keys} for table "
                f"{table.name!r} (max_batch_size × maxnum_catfeature_query_per_table_per_sample)")
    dims = [t.dim for t in used]
    return InferPlan(list(counts), list(itertools.accumulate(counts, initial=0)),
                     list(itertools.accumulate(map(operator.mul, counts, dims), initial=0)),
                     dims)


def fill_output(server: HierarchicalParameterServer, model: str, plan: InferPlan,
                keys: np.ndarray, out: np.ndarray) -> None:
    """Write OUTPUT0 into `out` (float32 [plan.size], C-contiguous): each table's vectors
    looked up in place, a lookup per table over an array of keys."""
    if len(plan.counts) == 1:  # one table (the common case): no slices to make
        server.lookup_into(model, 0, keys, out.reshape(plan.counts[0], plan.dims[0]))
        return
    for i, count in enumerate(plan.counts):
        if count:
            rows = out[plan.offsets[i]:plan.offsets[i + 1]].reshape(count, plan.dims[i])
            server.lookup_into(model, i, keys[plan.starts[i]:plan.starts[i + 1]], rows)


def infer_vectors(server: HierarchicalParameterServer, model: str, keys: np.ndarray,
                  numkeys: np.ndarray) -> np.ndarray:
    """OUTPUT0: the vectors of `keys` split by `numkeys` over the model's tables in order,
    as one float32 array of Σ numkeys[i] × width[i] values (checked as `plan_infer`)."""
    plan = plan_infer(server, model, keys, numkeys)
    out = np.empty(plan.size, dtype=np.float32)
    fill_output(server, model, plan, keys, out)
    return out


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


def infer_answer(server: HierarchicalParameterServer, model: str, body: bytes,
                 header_length: int | None) -> Answer:
    """Parse, look up, encode: the whole answer to one inference request."""
    call = parse_infer(body, header_length)
    plan = plan_infer(server, model, call.keys, call.numkeys)
    if not call.binary_output:
        vectors = np.empty(plan.size, dtype=np.float32)
        fill_output(server, model, plan, call.keys, vectors)
        payload = encode_json(_answer_head(model, plan.size, call.request_id, vectors))
        return [(b"content-type", JSON.encode()),
                (b"content-length", str(len(payload)).encode())], (payload,)
    key = (model, plan.size, call.request_id)
    known = _BINARY_HEADS.get(key)
    if known is None:
        known = _binary_head(encode_json(_answer_head(model, plan.size, call.request_id)),
                             plan.size)
        if len(_BINARY_HEADS) >= _BINARY_HEADS_MAX:
            _BINARY_HEADS.clear()
        _BINARY_HEADS[key] = known
    header, response_headers = known
    data, values = header_and_values(header, plan.size)
    fill_output(server, model, plan, call.keys, values)
    if sys.byteorder != "little":  # the protocol's binary tensors are little-endian
        values.byteswap(inplace=True)
    return list(response_headers), (data,)


def _answer_head(model: str, floats: int, request_id: str | None,
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


def _binary_head(header: bytes, floats: int
                 ) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
    """(`header`, the response headers of an answer of `header` and `floats` values)."""
    return header, ((b"content-type", OCTET_STREAM.encode()),
                    (b"content-length", str(len(header) + 4 * floats).encode()),
                    (HEADER_LENGTH.encode(), str(len(header)).encode()))


# -- the routes ---------------------------------------------------------------------------

def check_version(model: str, version: str | None) -> None:
    """UnknownModelError unless `version` is absent or the one served."""
    if version not in (None, "", VERSION):
        raise UnknownModelError(f"model {model!r} has no version {version!r} (served: "
                                f"{VERSION})")


async def handle_infer(state: ServiceState, headers: Mapping[str, str], receive: Receive,
                       params: dict[str, str | None]) -> Answer:
    """The answer to `POST /v2/models/{model}[/versions/{version}]/infer`."""
    state.check_token(headers.get("authorization"))
    model = params["model"] or ""
    check_version(model, params.get("version"))
    loaded = state.model(model)  # 404 or 503 before the body is read
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported: send "
                                   "the request uncompressed")
    # the JSON part makes a Python object per key when parsed: it is refused beyond what
    # the model's key limits can take, before parsing (from Content-Length when it is all
    # JSON); binary tensor data after it is bounded by the body limit only
    json_limit = 4096 + json_body_limit(sum(t.max_keys for t in loaded.tables))
    binary = HEADER_LENGTH in headers
    declared = headers.get("content-length", "")
    if not binary and declared.isascii() and declared.isdigit() and int(declared) > json_limit:
        raise BatchTooLargeError(
            f"a JSON inference request of {int(declared):,} bytes is longer than model "
            f"{model!r}'s key limits take; send fewer keys, or binary tensor data")
    body = await read_body(headers, receive,
                           state.max_body_bytes if binary else min(state.max_body_bytes,
                                                                   json_limit))
    header_length = parse_header_length(headers.get(HEADER_LENGTH), len(body))
    if header_length is not None and header_length > json_limit:
        raise BatchTooLargeError(
            f"an inference header of {header_length:,} bytes is longer than model "
            f"{model!r}'s key limits take")
    return await state.run_lookup(infer_answer, state.server, model, body, header_length)


def v2_error(state: ServiceState, request: Request, exc: Exception) -> Response:
    """An error in the protocol's form, `{"error": message}`."""
    return state.error_response(request, exc, v2_error_body)


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


def build_v2_router(state: ServiceState, protected: list[Any]) -> APIRouter:
    """The v2 routes of one app; `protected` are the token's dependencies."""
    router = APIRouter(prefix="/v2", tags=["kserve-v2"])

    def not_ready(message: str) -> Response:
        # the protocol's "false" is a 4xx; 400 as Triton answers
        return state.answer(400, "not_ready", message, body=v2_error_body)

    @router.get("", dependencies=protected, summary="Server metadata")
    async def server_metadata() -> dict[str, Any]:
        from hps import __version__

        return {"name": "hps", "version": __version__,
                "extensions": ["binary_tensor_data", "model_configuration"]}

    @router.get("/health/live", summary="Alive (answers while models load)")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @router.get("/health/ready", summary="Ready: every model of the config is loaded",
                responses={400: {"description": "Not every model is loaded."}})
    async def ready() -> Any:
        if state.ready():
            return {"ready": True}
        return not_ready(f"models not loaded yet: {', '.join(state.pending()) or '-'}"
                         + (f"; failed: {', '.join(sorted(state.failed))}"
                            if state.failed else ""))

    async def metadata(model: str, version: str | None = None) -> dict[str, Any]:
        check_version(model, version)
        state.model(model)
        return model_metadata(model)

    async def model_ready(model: str, version: str | None = None) -> Any:
        check_version(model, version)
        try:
            state.model(model)
        except UnknownModelError:
            raise
        except Exception as exc:  # loading or failed: "not ready", the reason in the body
            return not_ready(str(exc))
        return {"name": model, "ready": True}

    async def config(model: str, version: str | None = None) -> dict[str, Any]:
        check_version(model, version)
        state.model(model)
        return model_config(model)

    async def infer(request: Request, model: str, version: str | None = None) -> Response:
        """Inference: KEYS (INT64) and NUMKEYS (INT32) → OUTPUT0 (FP32), JSON or binary."""
        return await respond(handle_infer, state, request,
                             {"model": model, "version": version})

    for base in ("/models/{model}", "/models/{model}/versions/{version}"):
        router.add_api_route(base, metadata, methods=["GET"], dependencies=protected,
                             summary="Model metadata: KEYS, NUMKEYS → OUTPUT0")
        router.add_api_route(base + "/ready", model_ready, methods=["GET"],
                             dependencies=protected, summary="Model ready (200) or not (400)")
        router.add_api_route(base + "/config", config, methods=["GET"],
                             dependencies=protected, summary="Triton model configuration")
        router.add_api_route(base + "/infer", infer, methods=["POST"], dependencies=protected,
                             summary="Inference (JSON or binary tensor data)",
                             response_class=Response, openapi_extra=INFER_OPENAPI)
    return router


def infer_fast_route(app_routes: list[Any], state: ServiceState) -> FastRoute:
    """The FastRoute of infer, labelled in metrics as its FastAPI declaration."""
    declared = next(r for r in app_routes if getattr(r, "path", None) == INFER_PATH)
    return FastRoute(INFER_RE, declared, handle_infer, v2_error)


#: OpenAPI of the infer body: a JSON request, or JSON header + binary tensors
INFER_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": (
            "A KServe v2 inference request with inputs KEYS (INT64) and NUMKEYS (INT32). "
            "With the binary tensor data extension the body is the JSON header "
            "(Inference-Header-Content-Length bytes) followed by the inputs' raw bytes."),
        "content": {
            JSON: {"schema": InferRequest.model_json_schema()},
            OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}},
        },
    },
}
