"""What the gRPC tests share: the v2 gRPC service started beside a live HTTP server (the
same app state), requests built by hand, and the expected OUTPUT0 of a request."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from hps.http.grpc import GrpcServer
from tests.http.conftest import Live


@contextlib.contextmanager
def grpc_beside(live: Live) -> Iterator[str]:
    """The gRPC service of `live`'s app on a free loopback port; yields host:port."""
    server = GrpcServer(live.app.state.hps, "127.0.0.1", 0)
    try:
        yield server.start()
    finally:
        server.stop(0).wait()


def request_of(live: Live, rng: np.random.Generator, counts: tuple[int, ...] = (40, 25)
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """KEYS (known keys with repeats, and unknown ones), NUMKEYS, and the OUTPUT0 due."""
    parts = [live.model.sample_keys(rng, t, n - 3, unknown=3) if n >= 3 else
             live.model.sample_keys(rng, t, n) for t, n in enumerate(counts)]
    expected = np.concatenate([live.model.expected(t, k).reshape(-1)
                               for t, k in enumerate(parts)])
    return np.concatenate(parts), np.array(counts, dtype=np.int32), expected


def raw_request(model: str, keys: np.ndarray, numkeys: np.ndarray, **fields: Any) -> Any:
    """A ModelInferRequest with KEYS and NUMKEYS in raw_input_contents."""
    tensor = service_pb2.ModelInferRequest.InferInputTensor
    return service_pb2.ModelInferRequest(
        model_name=model, inputs=[tensor(name="KEYS", datatype="INT64", shape=[keys.size]),
                                  tensor(name="NUMKEYS", datatype="INT32",
                                         shape=[numkeys.size])],
        raw_input_contents=[keys.astype("<i8").tobytes(), numkeys.astype("<i4").tobytes()],
        **fields)


def stub(address: str) -> tuple[grpc.Channel, service_pb2_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)
