"""The KServe v2 / Triton protocol over gRPC (`GRPCInferenceService`), beside the HTTP
service and over the same state: `GrpcServer(state, host, port)` serves one app's models,
token and limits to `tritonclient.grpc` (what `hps serve --grpc-port` runs). Needs the
`grpc` extra: `pip install 'hps-server[grpc]'`.

The messages and the service's stubs are those `tritonclient[grpc]` ships, generated
from Triton's `grpc_service.proto`: one descriptor pool holds one definition of
`inference.*`, so the server and a client in the same process (tests, notebooks) share
it, where a second generated copy would clash with it on import.
"""

from __future__ import annotations

try:
    import grpc  # noqa: F401
    from tritonclient.grpc import service_pb2  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    from hps.errors import MissingExtraError

    raise MissingExtraError(exc.name or "grpcio", "grpc", "the gRPC service") from None

from hps.http.grpc.server import GrpcServer

__all__ = ["GrpcServer"]
