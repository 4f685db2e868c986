"""Reading a `ModelInferRequest`: inputs KEYS (INT64) and NUMKEYS (INT32) from
`raw_input_contents` (one entry per input, in the inputs' order) or from each input's
typed `contents` (`int64_contents`, `int_contents`), and the outputs asked for.

The names, datatypes and byte order are the HTTP v2 route's (`kserve/schemas.py`), and
the counts are checked by the same plan (`kserve/plan.py`). Raw inputs cross as arrays
(`np.frombuffer`), typed contents as one conversion of the repeated field, never key by
key. Every error is a LookupInputError naming what was wrong (INVALID_ARGUMENT).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hps.errors import LookupInputError
from hps.http.kserve.schemas import INPUTS, KEYS_INPUT, NUMKEYS_INPUT, OUTPUT

#: the `contents` field each input's values go in when not raw
CONTENTS_FIELD = {KEYS_INPUT: "int64_contents", NUMKEYS_INPUT: "int_contents"}


def read_inputs(request: Any) -> tuple[np.ndarray, np.ndarray]:
    """(KEYS as int64 [n], NUMKEYS as int64 [tables given]) of a ModelInferRequest."""
    inputs = request.inputs
    raw = request.raw_input_contents
    if raw and len(raw) != len(inputs):
        raise LookupInputError(
            f"{len(raw)} raw_input_contents for {len(inputs)} inputs: send one per input, in "
            "the inputs' order, or none (typed contents)")
    tensors: dict[str, np.ndarray] = {}
    for i, spec in enumerate(inputs):
        name = spec.name
        if name not in INPUTS:
            raise LookupInputError(f"unknown input {name!r}: the inputs are {KEYS_INPUT} "
                                   f"(INT64) and {NUMKEYS_INPUT} (INT32)")
        if name in tensors:
            raise LookupInputError(f"input {name!r} is given twice")
        tensors[name] = _tensor(spec, raw[i] if raw else None)
    for name in INPUTS:
        if name not in tensors:
            raise LookupInputError(f"input {name!r} is missing: send {KEYS_INPUT} (INT64, "
                                   f"every table's keys) and {NUMKEYS_INPUT} (INT32, keys "
                                   "per table)")
    _check_outputs(request)
    return tensors[KEYS_INPUT], tensors[NUMKEYS_INPUT].astype(np.int64)


def _tensor(spec: Any, raw: bytes | None) -> np.ndarray:
    """The flat array of one input, from its raw bytes or its typed contents."""
    name = spec.name
    datatype, dtype = INPUTS[name]
    if spec.datatype != datatype:
        raise LookupInputError(f"input {name!r} has datatype {spec.datatype!r}; expected "
                               f"{datatype}")
    if "shared_memory_region" in spec.parameters:
        raise LookupInputError("shared-memory inputs are not supported: send the data in "
                               "the request")
    if any(d < 0 for d in spec.shape):
        raise LookupInputError(f"input {name!r} has shape {list(spec.shape)}: dimensions "
                               "must not be negative")
    count = math.prod(spec.shape)  # exact; 1 for a scalar
    given = [f.name for f, _ in spec.contents.ListFields()]
    if raw is not None:
        if given:
            raise LookupInputError(f"input {name!r} has both contents and "
                                   "raw_input_contents")
        if len(raw) != count * dtype.itemsize:
            raise LookupInputError(
                f"input {name!r} of shape {list(spec.shape)} needs {count * dtype.itemsize} "
                f"bytes of {datatype}; its raw_input_contents has {len(raw)}")
        return np.frombuffer(raw, dtype=dtype)
    field = CONTENTS_FIELD[name]
    if any(g != field for g in given):
        raise LookupInputError(f"input {name!r} is {datatype}: its values go in "
                               f"contents.{field}, not contents.{given[0]}")
    values = np.asarray(getattr(spec.contents, field), dtype=np.int64)
    if values.size != count:
        raise LookupInputError(f"input {name!r} has {values.size} elements; its shape "
                               f"{list(spec.shape)} needs {count}")
    return values  # (int_contents is int32 on the wire: NUMKEYS cannot overflow here)


def _check_outputs(request: Any) -> None:
    """LookupInputError for an output we do not have or a form we do not serve."""
    for out in request.outputs:
        if out.name != OUTPUT:
            raise LookupInputError(f"unknown output {out.name!r}: the output is {OUTPUT} "
                                   "(FP32)")
        if "shared_memory_region" in out.parameters or "classification" in out.parameters:
            raise LookupInputError(f"output {OUTPUT}: shared memory and classification are "
                                   "not supported")
