"""The KServe v2 protocol over gRPC, spoken by the real `tritonclient.grpc` (sync, asyncio
and streaming clients) to the service beside a live uvicorn server: exact vectors of both
tables, metadata, configuration, models added and removed at runtime, `hps serve
--grpc-port`."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from tests.http.conftest import DIMS, MODEL, Live, ModelFiles, start, wait_until, write_model
from tests.http.grpc_support import grpc_beside, raw_request, request_of
from tests.support.redis_servers import free_port


@pytest.fixture(scope="module")
def address(live: Live) -> Iterator[str]:
    with grpc_beside(live) as where:
        yield where


@pytest.fixture
def client(address: str) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(url=address)
    yield c
    c.close()


def inputs(keys: np.ndarray, numkeys: np.ndarray, shape: str = "flat",
           module: object = triton) -> list[triton.InferInput]:
    if shape == "row":  # [1, n], as batched clients send
        keys, numkeys = keys.reshape(1, -1), numkeys.reshape(1, -1)
    k = module.InferInput("KEYS", list(keys.shape), "INT64")  # type: ignore[attr-defined]
    k.set_data_from_numpy(keys.astype(np.int64))
    n = module.InferInput("NUMKEYS", list(numkeys.shape), "INT32")  # type: ignore[attr-defined]
    n.set_data_from_numpy(numkeys.astype(np.int32))
    return [k, n]


def test_health_metadata_and_config(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    meta = client.get_model_metadata(MODEL, as_json=True)
    assert meta["name"] == MODEL and meta["versions"] == ["1"] and meta["platform"] == "hps"
    assert meta["inputs"] == [{"name": "KEYS", "datatype": "INT64", "shape": ["-1"]},
                              {"name": "NUMKEYS", "datatype": "INT32", "shape": ["-1"]}]
    assert meta["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": ["-1"]}]
    config = client.get_model_config(MODEL).config
    assert config.name == MODEL and config.backend == "hps" and config.max_batch_size == 0
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        ("KEYS", model_config_pb2.TYPE_INT64, [-1]),
        ("NUMKEYS", model_config_pb2.TYPE_INT32, [-1])]
    assert [(o.name, o.data_type) for o in config.output] == [
        ("OUTPUT0", model_config_pb2.TYPE_FP32)]
    server = client.get_server_metadata()
    assert server.name == "hps" and "binary_tensor_data" in server.extensions


@pytest.mark.parametrize("shape", ["flat", "row"])
def test_infer_exact_vectors_of_both_tables(live: Live, client: triton.InferenceServerClient,
                                            rng: np.random.Generator, shape: str) -> None:
    keys, numkeys, expected = request_of(live, rng)
    result = client.infer(MODEL, inputs(keys, numkeys, shape),
                          outputs=[triton.InferRequestedOutput("OUTPUT0")], request_id="r-1")
    got = result.as_numpy("OUTPUT0")
    assert got.dtype == np.float32 and got.shape == (40 * DIMS[0] + 25 * DIMS[1],)
    np.testing.assert_array_equal(got, expected)
    response = result.get_response()
    assert response.model_name == MODEL and response.id == "r-1"
    assert response.model_version == "1"


def test_each_table_alone_and_nothing(live: Live, client: triton.InferenceServerClient,
                                      rng: np.random.Generator) -> None:
    for table in (0, 1):
        keys = live.model.sample_keys(rng, table, 100, unknown=5)
        counts = np.array([keys.size] if table == 0 else [0, keys.size])
        result = client.infer(MODEL, inputs(keys, counts), model_version="1")
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"),
                                      live.model.expected(table, keys).reshape(-1))
    empty = client.infer(MODEL, inputs(np.zeros(0, np.int64), np.array([0, 0])))
    assert empty.as_numpy("OUTPUT0").shape == (0,)


def test_asyncio_client(live: Live, address: str, rng: np.random.Generator) -> None:
    requests = [request_of(live, rng, (n, 7)) for n in (1, 5, 300)]

    async def run() -> None:
        async with triton_aio.InferenceServerClient(url=address) as c:
            assert await c.is_server_ready() and await c.is_model_ready(MODEL)
            assert (await c.get_model_metadata(MODEL)).name == MODEL
            results = await asyncio.gather(*[
                c.infer(MODEL, inputs(k, n, module=triton_aio)) for k, n, _ in requests])
            for result, (_, _, expected) in zip(results, requests, strict=True):
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)
            with pytest.raises(InferenceServerException, match="nope"):
                await c.get_model_metadata("nope")

    asyncio.run(run())


def test_stream_answers_in_order_and_survives_a_bad_request(
        live: Live, client: triton.InferenceServerClient, rng: np.random.Generator) -> None:
    answers: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        good = [request_of(live, rng, (n, 3)) for n in (4, 50, 9)]
        for i, (k, n, _) in enumerate(good[:2]):
            client.async_stream_infer(MODEL, inputs(k, n), request_id=f"s{i}")
        bad_keys = np.arange(10, dtype=np.int64)
        client.async_stream_infer(MODEL, inputs(bad_keys, np.array([4, 5])), request_id="bad")
        client.async_stream_infer(MODEL, inputs(*good[2][:2]), request_id="s2")
        got = [answers.get(timeout=30) for _ in range(4)]
    finally:
        client.stop_stream()
    for (result, error), (_, _, expected) in zip([got[0], got[1], got[3]], good, strict=True):
        assert error is None
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)  # type: ignore
    result, error = got[2]
    assert result is None and "adds up to 9" in str(error)


def test_models_added_and_removed_at_runtime_are_seen_at_once(tmp_path: Path) -> None:
    served = write_model(tmp_path / "models" / "m", seed=3)
    extra = write_model(tmp_path / "models" / "extra", seed=4)
    block = {**extra.config["models"][0], "model": "extra"}
    for live in start(served, allow_roots=[str(tmp_path / "models")]):
        with grpc_beside(live) as where:
            c = triton.InferenceServerClient(url=where)
            keys = extra.keys[1][:50]
            request = inputs(keys, np.array([0, keys.size]))
            with pytest.raises(InferenceServerException, match="extra"):
                c.infer("extra", request)
            assert live.client.post("/v1/models", json=block).status_code == 201
            assert c.is_model_ready("extra")
            np.testing.assert_array_equal(c.infer("extra", request).as_numpy("OUTPUT0"),
                                          extra.vectors[1][:50].reshape(-1))
            assert live.client.delete("/v1/models/extra").status_code == 200
            with pytest.raises(InferenceServerException, match="extra") as info:
                c.infer("extra", request)
            assert info.value.status() == "StatusCode.NOT_FOUND"
            c.close()


def _hps_serve(config: Path, port: int, grpc_port: int | None, log: Path,
               ) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "hps.tools.cli", "serve", str(config), "--port", str(port)]
    if grpc_port is not None:
        argv += ["--grpc-port", str(grpc_port)]
    with log.open("wb") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_hps_serve_grpc_port_and_the_config_key(model_files: ModelFiles,
                                                tmp_path: Path) -> None:
    config = tmp_path / "ps.json"
    config.write_text(json.dumps({**model_files.config,
                                  "http": {"grpc_port": free_port()}}))
    for grpc_port in (free_port(), None):  # the option, then the config's key
        where = f"127.0.0.1:{grpc_port or json.loads(config.read_text())['http']['grpc_port']}"
        proc = _hps_serve(config, free_port(), grpc_port, tmp_path / "serve.log")
        try:
            c = triton.InferenceServerClient(url=where)

            def ready(c: triton.InferenceServerClient = c) -> bool:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()
                try:
                    return c.is_server_ready()
                except InferenceServerException:
                    return False

            wait_until(ready, timeout=120)
            keys = model_files.keys[0][:20]
            np.testing.assert_array_equal(
                c.infer(MODEL, inputs(keys, np.array([20]))).as_numpy("OUTPUT0"),
                model_files.vectors[0][:20].reshape(-1))
            c.close()
        finally:
            proc.send_signal(signal.SIGTERM)  # stops HTTP and gRPC together
            assert proc.wait(timeout=30) == 0, (tmp_path / "serve.log").read_text()
        text = (tmp_path / "serve.log").read_text()
        assert f"gRPC on {where}" in text and "drained, every tier closed" in text, text


def test_hps_serve_refuses_a_taken_grpc_port(model_files: ModelFiles, tmp_path: Path) -> None:
    config = tmp_path / "ps.json"
    config.write_text(json.dumps(model_files.config))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        started = time.monotonic()
        proc = _hps_serve(config, free_port(), taken.getsockname()[1], tmp_path / "serve.log")
        assert proc.wait(timeout=60) == 1
    text = (tmp_path / "serve.log").read_text()
    assert "cannot serve gRPC" in text and "serving" not in text, text
    assert time.monotonic() - started < 60


def test_answers_written_as_bytes_are_the_messages_serialised(
        live: Live, address: str, rng: np.random.Generator) -> None:
    keys, numkeys, expected = request_of(live, rng)
    due = service_pb2.ModelInferResponse(
        model_name=MODEL, model_version="1", id="b-1",
        outputs=[service_pb2.ModelInferResponse.InferOutputTensor(
            name="OUTPUT0", datatype="FP32", shape=[expected.size])],
        raw_output_contents=[expected.astype("<f4").tobytes()])
    request = raw_request(MODEL, keys, numkeys, id="b-1").SerializeToString()
    with grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        assert infer(request, timeout=30) == due.SerializeToString()
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        answers = list(stream(iter([request, b"\xff", request]), timeout=30))
        assert answers[0] == answers[2] == service_pb2.ModelStreamInferResponse(
            infer_response=due).SerializeToString()
        error = service_pb2.ModelStreamInferResponse.FromString(answers[1])
        assert error.error_message.startswith("the request is not an inference.ModelInfer")
