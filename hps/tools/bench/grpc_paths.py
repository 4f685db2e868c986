"""The gRPC paths of `hps bench http`: `GrpcClient`, the client of `hps serve --grpc-port`
that `hps bench http` times, and the floor, a bare grpcio server answering the same bytes.

The client sends ModelInfer requests serialised before timing (KEYS and NUMKEYS in
`raw_input_contents`, as `tritonclient.grpc` sends them) over its own channel (one
HTTP/2 connection per client thread) and decodes each answer into float32 rows
(`ModelInferResponse.FromString` + `np.frombuffer`). The floor (`bare_grpc_server`)
parses each request and answers a ModelInferResponse of the same size, made once per
key count: grpcio and the message, no lookup, no token, no registry. The service cannot
be faster than this. It comes in server forms (`--variant`): `sync` (grpcio's
thread-pool server, 16 threads, as `GrpcServer`), `sync-<N>` (N threads),
`sync-latency` (`grpc.optimization_target` latency) and `aio` (grpc.aio on its own
event loop); `grpc_one_key.py` times them beside HTTP.

    python -m hps.tools.bench.grpc_paths --port 8001 --dim 64 --variant sync
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def infer_request(model: str, keys: np.ndarray) -> bytes:
    """A serialised ModelInferRequest of one table's `keys`."""
    tensor = service_pb2.ModelInferRequest.InferInputTensor
    return service_pb2.ModelInferRequest(
        model_name=model,
        inputs=[tensor(name="KEYS", datatype="INT64", shape=[keys.size]),
                tensor(name="NUMKEYS", datatype="INT32", shape=[1])],
        raw_input_contents=[keys.astype("<i8").tobytes(),
                            np.array([keys.size], "<i4").tobytes()]).SerializeToString()


class GrpcClient:
    """One channel sending prepared requests; answers decoded to float32 [keys, dim]."""

    def __init__(self, address: str, requests: list[bytes], dim: int) -> None:
        self.channel = grpc.insecure_channel(address)
        self.call = self.channel.unary_unary(METHOD)  # bytes in, bytes out
        self.requests = requests
        self.dim = dim

    def start_round(self) -> None:
        """Nothing to renew: an HTTP/2 connection stays open between rounds."""

    def __call__(self, i: int) -> np.ndarray:
        answer = service_pb2.ModelInferResponse.FromString(
            self.call(self.requests[i], timeout=60))
        return np.frombuffer(answer.raw_output_contents[0], "<f4").reshape(-1, self.dim)


@contextlib.contextmanager
def bare_grpc_server(folder: Path, port: int, dim: int, pids: list[int],
                     variant: str = "sync") -> Iterator[str]:
    """The floor (`variant`) in a subprocess; yields host:port once it answers. Its id
    goes to `pids`."""
    log = open(folder / f"bare_grpc_{variant}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "hps.tools.bench.grpc_paths", "--port",
                             str(port), "--dim", str(dim), "--variant", variant],
                            stdout=log, stderr=subprocess.STDOUT)
    pids.append(proc.pid)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


def _floor(port: int, dim: int, variant: str = "sync") -> None:
    answers: dict[int, bytes] = {}

    def infer(data: bytes, context: grpc.ServicerContext) -> bytes:
        keys = len(service_pb2.ModelInferRequest.FromString(data).raw_input_contents[0]) // 8
        answer = answers.get(keys)
        if answer is None:
            answer = answers[keys] = service_pb2.ModelInferResponse(
                model_name="bench", model_version="1",
                outputs=[service_pb2.ModelInferResponse.InferOutputTensor(
                    name="OUTPUT0", datatype="FP32", shape=[keys * dim])],
                raw_output_contents=[bytes(4 * keys * dim)]).SerializeToString()
        return answer

    if variant == "aio":
        asyncio.run(_aio_floor(port, infer))
        return
    threads = int(variant.split("-")[1]) if variant[5:].isdigit() else 16
    options: list[tuple[str, Any]] = [("grpc.so_reuseport", 0)]
    if variant == "sync-latency":
        options.append(("grpc.optimization_target", "latency"))
    server = grpc.server(ThreadPoolExecutor(threads), options=options)
    server.add_generic_rpc_handlers((_floor_handler(infer),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop(0)


def _floor_handler(infer: Callable[..., Any]) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)})


async def _aio_floor(port: int, infer: Callable[[bytes, Any], bytes]) -> None:
    async def answer(data: bytes, context: Any) -> bytes:
        return infer(data, context)

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((_floor_handler(answer),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the bare grpcio floor of hps bench http")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--variant", default="sync", help="the floor's server form")
    args = parser.parse_args(argv)
    _floor(args.port, args.dim, args.variant)


if __name__ == "__main__":
    main()
