"""Parsing an inference request body: the JSON header (`InferRequest`) and the inputs'
data, inline or in the binary part after the header, into an `InferCall`.

Keys cross as arrays (`np.frombuffer` on the binary part; pydantic-core validates JSON
data), never key by key. A binary-only header is parsed once per distinct header bytes:
later requests with the same header are read through its `BinaryLayout`. Every error is
a BadJSON or BadBody (400) naming what was wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from pydantic import ValidationError

from hps.http.bodies import parse_length, validation_message
from hps.http.errors import BadBody, BadJSON
from hps.http.kserve.schemas import (
    DATATYPES,
    INPUTS,
    KEYS_INPUT,
    NUMKEYS_INPUT,
    OUTPUT,
    InferInput,
    InferRequest,
)


class InferCall(NamedTuple):
    """A parsed inference request: the keys, keys per table, and the answer's form (a
    named tuple: made for every request, it costs half of a frozen dataclass)."""

    keys: np.ndarray  # [n], of a KEYS datatype (schemas.DATATYPES): the lookup widens it
    numkeys: np.ndarray  # int64 [tables given]
    binary_output: bool
    request_id: str | None
    timeout_us: int | None = None  # the request's `timeout` parameter (microseconds)


def parse_header_length(value: str | None, body_size: int) -> int | None:
    """The JSON header's length from `Inference-Header-Content-Length` (None: all JSON)."""
    if value is None:
        return None
    length = parse_length(value.strip())
    if length is None or length > body_size:
        raise BadBody(f"Inference-Header-Content-Length {value!r} is not a length within the "
                      f"body of {body_size} bytes")
    return length


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
    timeout_us: int | None = None

    def read(self, binary: memoryview) -> InferCall:
        """The request whose binary part is `binary` (`binary_size` bytes)."""
        dtype, count, offset = self.keys
        keys = np.frombuffer(binary, dtype=dtype, count=count, offset=offset)
        dtype, count, offset = self.numkeys
        numkeys = np.frombuffer(binary, dtype=dtype, count=count, offset=offset)
        return InferCall(keys, numkeys.astype(np.int64), self.binary_output, self.request_id,
                         self.timeout_us)


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
            raise BadJSON(f"unknown input {spec.name!r}: the inputs are {KEYS_INPUT} ("
                          f"{_names(KEYS_INPUT)}) and {NUMKEYS_INPUT} (INT32)")
        if spec.name in tensors:
            raise BadJSON(f"input {spec.name!r} is given twice")
        start = offset
        tensors[spec.name], offset = _tensor(spec, binary, offset)
        if spec.data is None:
            places[spec.name] = (tensors[spec.name].dtype, tensors[spec.name].size, start)
    if offset != len(binary):
        raise BadBody(f"{len(binary) - offset} bytes of binary data follow the inputs' "
                      "binary_data_size; expected none")
    missing = [name for name in INPUTS if name not in tensors]
    if missing:
        raise BadJSON(f"input {missing[0]!r} is missing: send {KEYS_INPUT} ("
                      f"{_names(KEYS_INPUT)}: every table's keys) and {NUMKEYS_INPUT} (INT32, "
                      "keys per table)")
    binary_output = _binary_output(request)
    timeout = _timeout(request)
    call = InferCall(tensors[KEYS_INPUT], tensors[NUMKEYS_INPUT].astype(np.int64),
                     binary_output, request.id, timeout)
    every_input_binary = len(places) == len(request.inputs)
    return call, (BinaryLayout(places[KEYS_INPUT], places[NUMKEYS_INPUT], offset,
                               binary_output, request.id, timeout)
                  if every_input_binary else None)


def _timeout(request: InferRequest) -> int | None:
    """The request's `timeout` parameter: microseconds it will wait (Triton's unit)."""
    value = (request.parameters or {}).get("timeout")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadJSON(f"parameter timeout {value!r} is not a whole number of microseconds")
    return value


def _names(name: str) -> str:
    """The datatypes input `name` is accepted in, for messages: "INT64, INT32, … or …"."""
    *others, last = DATATYPES[name]
    return f"{', '.join(others)} or {last}" if others else last


def _tensor(spec: InferInput, binary: memoryview, offset: int) -> tuple[np.ndarray, int]:
    """The flat array of one input, of its datatype's dtype, from its JSON data or the
    binary part at `offset`."""
    datatype = spec.datatype
    dtype = DATATYPES[spec.name].get(datatype)
    if dtype is None:
        raise BadJSON(f"input {spec.name!r} has datatype {datatype!r}; expected "
                      f"{_names(spec.name)}")
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
        values = np.array(spec.data, dtype=dtype)
    except OverflowError:  # a value outside the datatype's range
        info = np.iinfo(dtype)
        raise BadJSON(f"input {spec.name!r} is {datatype}: its values must lie in "
                      f"[{info.min}, {info.max}]") from None
    except ValueError:  # nested rows of different lengths
        raise BadJSON(f"input {spec.name!r}: nested data rows differ in length") from None
    if values.size != count:
        raise BadJSON(f"input {spec.name!r} has {values.size} elements; its shape "
                      f"{spec.shape} needs {count}")
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

