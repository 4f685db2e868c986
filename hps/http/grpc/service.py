"""`GRPCInferenceService` over one app's `ServiceState`: the HTTP v2 routes' answers as
gRPC messages, the same token (`authorization` metadata, `Bearer <token>`), the same
limits and rules, and the models of the server's registry as it is at each call (added,
removed and reloaded models are seen at once).

Errors map from their HTTP status (`hps/http/errors.py`, one table for both protocols):

    400 INVALID_ARGUMENT   401 UNAUTHENTICATED   403 PERMISSION_DENIED   404 NOT_FOUND
    413 RESOURCE_EXHAUSTED 422 INVALID_ARGUMENT  501 UNIMPLEMENTED       503 UNAVAILABLE

and only a bug is INTERNAL. Requests arrive as bytes and are parsed here (`handler`;
inference requests by `tensors.read_request`), so a message that is not the method's is
INVALID_ARGUMENT, where grpcio's own deserialisation would answer INTERNAL. A stream
(ModelStreamInfer) answers a bad request with `error_message` and goes on, as Triton does.
Lookups run on the gRPC worker thread that took the call: the server's lookups are
thread-safe, and a handoff would add a switch.
Answers to inference are written as bytes (`answers.py`).

Every call is counted in the request metrics with `protocol="grpc"` (route: the method's
path; code: the HTTP status its answer maps from, 200 when OK; a stream counts each of
its requests), and inference requests in the statistics extension (ModelStatistics,
`hps/http/kserve/stats.py`, shared with the HTTP route).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from hps.errors import LookupInputError, UnknownModelError
from hps.http.errors import kind_of, status_of
from hps.http.grpc.answers import answer_head
from hps.http.grpc.tensors import parse_message, read_request
from hps.http.kserve.encode import header_and_values
from hps.http.kserve.plan import fill_output, plan_infer
from hps.http.kserve.schemas import check_version, model_config, model_metadata

if TYPE_CHECKING:
    from hps.http.state import ServiceState

log = logging.getLogger("hps.grpc")

#: HTTP status → gRPC status code; anything else (a bug: 500) is INTERNAL
_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT, 422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED, 501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
SERVICE = "inference.GRPCInferenceService"


def _authorization(context: grpc.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


class InferenceService:
    """The v2 service of one `ServiceState` (one app: its server, token and limits)."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state
        # the HTTP status the call on this thread is answered with, for its metrics
        self.answered = threading.local()

    # -- errors -------------------------------------------------------------------------

    def _status(self, exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
        """The status code and message an error is answered with (counted by kind)."""
        status, kind = status_of(exc), kind_of(exc)
        self.answered.status = status
        self.state.metrics.errors.labels(kind, str(status)).inc()
        if kind == "internal":
            log.error("gRPC %s failed", method, exc_info=exc)
            return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
        return _CODES.get(status, grpc.StatusCode.INTERNAL), str(exc)

    def _abort(self, context: grpc.ServicerContext, exc: Exception, method: str) -> Any:
        code, message = self._status(exc, method)
        context.abort(code, message)  # raises: the call ends here

    # -- health and metadata ------------------------------------------------------------

    def ServerLive(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        # (--workers N: and every worker serves the server's versions, as /readyz says)
        return service_pb2.ServerReadyResponse(ready=self.state.ready() and
                                               not self.state.version_lags())

    def ModelReady(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        try:
            self.state.check_token(_authorization(context))
            check_version(request.name, request.version)
            try:
                self.state.model(request.name)
            except UnknownModelError:
                raise
            except Exception:  # loading or failed: "not ready"
                return service_pb2.ModelReadyResponse(ready=False)
            return service_pb2.ModelReadyResponse(
                ready=not self.state.version_lags(request.name))
        except Exception as exc:
            return self._abort(context, exc, "ModelReady")

    def ServerMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        try:
            self.state.check_token(_authorization(context))
        except Exception as exc:
            return self._abort(context, exc, "ServerMetadata")
        from hps import __version__

        return service_pb2.ServerMetadataResponse(
            name="hps", version=__version__,
            extensions=["binary_tensor_data", "model_configuration", "statistics"])

    def ModelMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        try:
            self._model(request.name, request.version, context)
        except Exception as exc:
            return self._abort(context, exc, "ModelMetadata")
        meta = model_metadata(request.name)
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]],
            outputs=[tensor(**t) for t in meta["outputs"]])

    def ModelConfig(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        try:
            self._model(request.name, request.version, context)
        except Exception as exc:
            return self._abort(context, exc, "ModelConfig")
        config = json_format.ParseDict(model_config(request.name),
                                       model_config_pb2.ModelConfig())
        return service_pb2.ModelConfigResponse(config=config)

    def ModelStatistics(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        try:
            self.state.check_token(_authorization(context))
            stats = self.state.metrics.infer_stats.model_stats(
                list(self.state.server.models), request.name, request.version)
        except Exception as exc:
            return self._abort(context, exc, "ModelStatistics")
        return json_format.ParseDict({"model_stats": stats},
                                     service_pb2.ModelStatisticsResponse())

    def _model(self, name: str, version: str, context: grpc.ServicerContext) -> None:
        self.state.check_token(_authorization(context))
        check_version(name, version)
        self.state.model(name)

    # -- inference ----------------------------------------------------------------------

    def ModelInfer(self, data: bytes, context: grpc.ServicerContext) -> Any:  # noqa: N802
        try:
            self.state.check_token(_authorization(context))
            return self._infer(data, stream=False)
        except Exception as exc:
            return self._abort(context, exc, "ModelInfer")

    def ModelStreamInfer(self, requests: Iterator[bytes],  # noqa: N802
                         context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            self.state.check_token(_authorization(context))
        except Exception as exc:
            self._abort(context, exc, "ModelStreamInfer")
        observe = self.state.metrics.observe_grpc
        for data in requests:
            started = time.perf_counter()
            self.answered.status = 200
            try:
                answer = self._infer(data, stream=True)
            except Exception as exc:  # answered on the stream, which goes on
                _, message = self._status(exc, "ModelStreamInfer")
                answer = service_pb2.ModelStreamInferResponse(
                    error_message=message).SerializeToString()
            observe(_STREAM_PATH, self.answered.status, time.perf_counter() - started)
            yield answer

    def _infer(self, data: bytes, stream: bool) -> bytes:
        """The serialised answer to one request (`data`, a serialised ModelInferRequest):
        a ModelInferResponse, or in a stream a ModelStreamInferResponse, with OUTPUT0 as
        raw little-endian float32. Counted in the model's statistics once the model is
        known to be served."""
        started = time.perf_counter_ns()
        reading = read_request(data)
        model = reading.model
        check_version(model, reading.version)
        self.state.model(model)  # NOT_FOUND or UNAVAILABLE before the inputs are read
        stats = self.state.metrics.infer_stats
        try:
            answer = self._answer(model, reading.inputs(), reading.request_id, stream)
        except Exception:
            stats.fail(model, time.perf_counter_ns() - started)
            raise
        stats.success(model, time.perf_counter_ns() - started)
        return answer

    def _answer(self, model: str, inputs: tuple[Any, Any], request_id: str,
                stream: bool) -> bytes:
        keys, numkeys = inputs
        server = self.state.server
        plan = plan_infer(server, model, keys, numkeys)
        data, values = header_and_values(answer_head(model, plan.size, request_id, stream),
                                         plan.size)
        fill_output(server, model, plan, keys, values)
        if sys.byteorder != "little":  # the protocol's raw tensors are little-endian
            values.byteswap(inplace=True)
        return bytes(data)  # (grpcio sends bytes only)


#: the unary methods: name → (request message, response message); ModelInfer reads its
#: request's bytes itself (`tensors.read_request`) and answers bytes
_UNARY = {
    "ServerLive": (service_pb2.ServerLiveRequest, service_pb2.ServerLiveResponse),
    "ServerReady": (service_pb2.ServerReadyRequest, service_pb2.ServerReadyResponse),
    "ModelReady": (service_pb2.ModelReadyRequest, service_pb2.ModelReadyResponse),
    "ServerMetadata": (service_pb2.ServerMetadataRequest, service_pb2.ServerMetadataResponse),
    "ModelMetadata": (service_pb2.ModelMetadataRequest, service_pb2.ModelMetadataResponse),
    "ModelConfig": (service_pb2.ModelConfigRequest, service_pb2.ModelConfigResponse),
    "ModelInfer": (bytes, bytes),
    "ModelStatistics": (service_pb2.ModelStatisticsRequest,
                        service_pb2.ModelStatisticsResponse),
}
_STREAM_PATH = f"/{SERVICE}/ModelStreamInfer"


def handler(service: InferenceService) -> grpc.GenericRpcHandler:
    """The methods of `service` as grpcio serves them, each request parsed here
    (`parse_message`) but ModelInfer's, which it reads itself (`read_request`); the
    methods of the proto not listed are UNIMPLEMENTED."""

    observe = service.state.metrics.observe_grpc

    def unary(name: str, message: Any) -> Callable[[bytes, grpc.ServicerContext], Any]:
        method = getattr(service, name)
        path = f"/{SERVICE}/{name}"

        def handle(data: bytes, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            service.answered.status = 200
            try:
                try:
                    request = data if message is bytes else parse_message(data, message)
                except LookupInputError as exc:
                    return service._abort(context, exc, name)
                return method(request, context)
            finally:  # an abort raises through here: its status was noted by _status
                observe(path, service.answered.status, time.perf_counter() - started)
        return handle

    methods = {name: grpc.unary_unary_rpc_method_handler(
        unary(name, request), response_serializer=(
            None if response is bytes else response.SerializeToString))
        for name, (request, response) in _UNARY.items()}
    methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        service.ModelStreamInfer)  # answers as bytes
    return grpc.method_handlers_generic_handler(SERVICE, methods)
