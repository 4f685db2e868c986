"""The infer route's answer, `POST /v2/models/{model}[/versions/{version}]/infer`:
`handle_infer` checks the request and reads its body within the model's limits, then
`infer_answer` parses, plans, looks up and encodes on the lookup thread pool (or the
event loop, `ServiceState.run_lookup`).

`handle_infer` is the route's `hot_routes.Handler`: every way the route is answered
(`hot_routes.HotRoutes`) goes through it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from hps.errors import BatchTooLargeError
from hps.http.bodies import declared_length, encode_json, json_answer, json_body_limit, read_body
from hps.http.errors import UnsupportedMediaType
from hps.http.kserve.encode import answer_head, binary_head, header_and_values
from hps.http.kserve.parse import parse_header_length, parse_infer
from hps.http.kserve.plan import fill_output, plan_infer
from hps.http.kserve.schemas import HEADER_LENGTH, check_version

if TYPE_CHECKING:
    from starlette.types import Receive

    from hps.http.hot_routes import Answer
    from hps.http.state import ServiceState
    from hps.server import LoadedModel


def infer_answer(state: ServiceState, model: str, body: bytes, header_length: int | None,
                 admitted: float) -> Answer:
    """Parse, look up, encode: the whole answer to one inference request; 504 before the
    lookup when the request's `timeout` parameter has passed since it was `admitted`
    (`time.monotonic()`)."""
    call = parse_infer(body, header_length)
    if call.timeout_us is not None:
        state.check_deadline(admitted + call.timeout_us / 1e6)
    server = state.server
    plan = plan_infer(server, model, call.keys, call.numkeys)
    if not call.binary_output:
        vectors = np.empty(plan.size, dtype=np.float32)
        fill_output(server, model, plan, call.keys, vectors)
        return json_answer(encode_json(answer_head(model, plan.size, call.request_id, vectors)))
    header, response_headers = binary_head(model, plan.size, call.request_id)
    data, values = header_and_values(header, plan.size)
    fill_output(server, model, plan, call.keys, values)
    if sys.byteorder != "little":  # the protocol's binary tensors are little-endian
        values.byteswap(inplace=True)
    return list(response_headers), (data,)


async def handle_infer(state: ServiceState, headers: Mapping[str, str], receive: Receive,
                       params: dict[str, str | None]) -> Answer:
    """The answer to `POST /v2/models/{model}[/versions/{version}]/infer`; counted in
    the model's statistics (`stats.py`) once the model is known to be served."""
    started = time.perf_counter_ns()
    state.check_client(headers)
    deadline = state.admit(headers)
    admitted = time.monotonic()
    model = params["model"] or ""
    check_version(model, params.get("version"))
    loaded = state.model(model)  # 404 or 503 before the body is read
    stats = state.metrics.infer_stats
    try:
        answer = await _read_and_answer(state, headers, receive, model, loaded, admitted,
                                        deadline)
    except Exception:
        stats.fail(model, time.perf_counter_ns() - started)
        raise
    stats.success(model, time.perf_counter_ns() - started)
    return answer


async def _read_and_answer(state: ServiceState, headers: Mapping[str, str], receive: Receive,
                           model: str, loaded: LoadedModel, admitted: float,
                           deadline: float | None) -> Answer:
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported: send "
                                   "the request uncompressed")
    # the JSON part makes a Python object per key when parsed: it is refused beyond what
    # the model's key limits can take, before parsing (from Content-Length when it is all
    # JSON); binary tensor data after it is bounded by the body limit only
    json_limit = 4096 + json_body_limit(sum(t.max_keys for t in loaded.tables))
    binary = HEADER_LENGTH in headers
    declared = declared_length(headers)
    if not binary and declared is not None and declared > json_limit:
        raise BatchTooLargeError(
            f"a JSON inference request of {declared:,} bytes is longer than model "
            f"{model!r}'s key limits take; send fewer keys, or binary tensor data")
    body = await read_body(headers, receive,
                           state.max_body_bytes if binary else min(state.max_body_bytes,
                                                                   json_limit))
    header_length = parse_header_length(headers.get(HEADER_LENGTH), len(body))
    if header_length is not None and header_length > json_limit:
        raise BatchTooLargeError(
            f"an inference header of {header_length:,} bytes is longer than model "
            f"{model!r}'s key limits take")
    return await state.run_lookup(infer_answer, state, model, body, header_length, admitted,
                                  deadline=deadline)
