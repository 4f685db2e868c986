"""gRPC from `hps serve --workers 2 --grpc-port P`, spoken by the real `tritonclient.grpc`:
every worker answers on the one port with exact vectors, a model added over HTTP is seen
over gRPC by every worker, the request metrics are summed over the workers, SIGTERM
drains and gives the port back; and the port's holding itself (`reserve_port`,
`share_port`)."""

from __future__ import annotations

import copy
import queue
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from hps.errors import BindError
from hps.http.grpc import GrpcServer
from hps.http.grpc.server import reserve_port, share_port
from hps.runtime.run_dir import PREFIX
from tests.http.conftest import MODEL, Live, ModelFiles, metric_value, wait_until, write_model
from tests.http.test_workers import Served, start, stop, write_run
from tests.support.redis_servers import free_port

ROOT = Path(__file__).resolve().parents[2]
INFER = "/inference.GRPCInferenceService/ModelInfer"


@dataclass
class Workers(Served):
    """`hps serve --workers 2 --grpc-port P` in a process of its own, its output read."""

    grpc_port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def own_infers(self) -> dict[int, float]:
        """Each worker's own count of ModelInfer calls answered OK (its metrics file)."""
        folder = self.shm / f"{PREFIX}{self.proc.pid}" / "metrics"
        return {int(p.stem): metric_value(p.read_text(), "hps_http_requests_total",
                                          route=INFER, code="200", protocol="grpc")
                for p in folder.glob("*.prom")}

    def stop(self) -> int:
        return stop(self)


def start_workers(model: ModelFiles, folder: Path, grpc_port: int, *,
                  wait: bool = True) -> Workers:
    """`model` served from a run in `folder` with gRPC on `grpc_port`; with `wait`, once
    every worker serves it (stopped again if that never comes)."""
    served = start(*write_run(folder, model.config), "--grpc-port", str(grpc_port))
    workers = Workers(**vars(served), grpc_port=grpc_port)
    if wait:
        try:
            workers.wait_for("every model is loaded in every worker")
        except BaseException:
            workers.stop()
            raise
    return workers


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelFiles:
    return write_model(tmp_path_factory.mktemp("grpc-workers") / "model")


@pytest.fixture(scope="module")
def workers(model: ModelFiles, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Workers]:
    server = start_workers(model, tmp_path_factory.mktemp("grpc-workers-run"), free_port())
    try:
        yield server
    finally:
        server.stop()


def _inputs(keys: np.ndarray, numkeys: np.ndarray) -> list[triton.InferInput]:
    k = triton.InferInput("KEYS", [keys.size], "INT64")
    k.set_data_from_numpy(keys.astype(np.int64))
    n = triton.InferInput("NUMKEYS", [numkeys.size], "INT32")
    n.set_data_from_numpy(numkeys.astype(np.int32))
    return [k, n]


def _fresh_client(workers: Workers) -> triton.InferenceServerClient:
    """A client on a connection of its own (no channel shared in this process): the
    kernel hands each new connection to one of the workers."""
    return triton.InferenceServerClient(
        workers.address, channel_args=[("grpc.use_local_subchannel_pool", 1)])


def _infer_exact(workers: Workers, model: ModelFiles, name: str, rng: np.random.Generator,
                 clients: int) -> None:
    """`clients` fresh clients each infer known and unknown keys of both tables of
    model `name` and get every row exact."""
    for _ in range(clients):
        parts = [model.sample_keys(rng, 0, 17, unknown=3), model.sample_keys(rng, 1, 9)]
        want = np.concatenate([model.expected(t, k).reshape(-1) for t, k in enumerate(parts)])
        client = _fresh_client(workers)
        try:
            assert client.is_model_ready(name)
            got = client.infer(name, _inputs(np.concatenate(parts), np.array([20, 9])))
            np.testing.assert_array_equal(got.as_numpy("OUTPUT0"), want)
        finally:
            client.close()


def test_every_worker_answers_grpc_and_sees_models_added_over_http(
        workers: Workers, model: ModelFiles) -> None:
    rng = np.random.default_rng(3)
    # 32 connections: all on one worker has odds of 2^-31
    _infer_exact(workers, model, MODEL, rng, clients=32)
    wait_until(lambda: len(workers.own_infers()) == 2
               and all(n > 0 for n in workers.own_infers().values()), timeout=15)
    assert any("over gRPC on" in line and "every worker" in line for line in workers.seen)

    # the request metrics, summed over the workers whichever answers /metrics
    def summed() -> float:
        return metric_value(httpx.get(f"{workers.url}/metrics").text,
                            "hps_http_requests_total", route=INFER, code="200",
                            protocol="grpc")

    wait_until(lambda: summed() >= 32 and sum(workers.own_infers().values()) >= 32,
               timeout=15)

    # a model added over HTTP answers over gRPC from every worker
    before = workers.own_infers()
    block = {**copy.deepcopy(model.config["models"][0]), "model": "m2"}
    added = httpx.post(f"{workers.url}/v1/models", json=block, timeout=60)
    assert added.status_code == 201, added.text
    _infer_exact(workers, model, "m2", rng, clients=32)
    wait_until(lambda: all(workers.own_infers()[i] > before[i] for i in before), timeout=15)

    # a stream on one worker
    answers: queue.Queue[tuple[object, object]] = queue.Queue()
    client = _fresh_client(workers)
    keys = model.keys[0][:5]
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer("m2", _inputs(keys, np.array([5])))
    result, error = answers.get(timeout=30)
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"),  # type: ignore[attr-defined]
                                  model.vectors[0][:5].reshape(-1))
    client.stop_stream()
    client.close()

    # removed over HTTP: NOT_FOUND from every connection
    assert httpx.delete(f"{workers.url}/v1/models/m2", timeout=60).status_code == 200
    for _ in range(8):
        client = _fresh_client(workers)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("m2", _inputs(keys, np.array([5])))
        assert caught.value.status() == "StatusCode.NOT_FOUND" and "m2" in str(caught.value)
        client.close()


def test_sigterm_drains_every_worker_and_gives_the_grpc_port_back(
        model: ModelFiles, tmp_path: Path) -> None:
    server = start_workers(model, tmp_path, free_port())
    try:
        _infer_exact(server, model, MODEL, np.random.default_rng(5), clients=2)
    finally:
        code = server.stop()
    assert code == 0, "".join(server.seen)
    with socket.socket() as sock:  # nothing holds the port any more
        sock.bind(("127.0.0.1", server.grpc_port))


def test_a_taken_grpc_port_stops_the_start(model: ModelFiles, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = start_workers(model, tmp_path, taken.getsockname()[1], wait=False)
        assert server.proc.wait(timeout=60) != 0
        server.wait_for("in use")
    assert any("gRPC" in line for line in server.seen), server.seen
    assert not list((tmp_path / "shm").iterdir())  # no run folder left


def test_a_reserved_port_is_bound_only_by_servers_that_share_it(live: Live) -> None:
    held = reserve_port("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        with pytest.raises(BindError, match="in use"):
            GrpcServer(live.app.state.hps, "127.0.0.1", port)  # not shared: refused
        with pytest.raises(BindError, match="in use"):
            reserve_port("127.0.0.1", port)  # a second supervisor
        share_port(port)
        first = GrpcServer(live.app.state.hps, "127.0.0.1", port)
        second = GrpcServer(live.app.state.hps, "127.0.0.1", port)  # binds beside it
        with first as address, second:
            for _ in range(8):  # fresh connections, on either server
                client = triton.InferenceServerClient(
                    address, channel_args=[("grpc.use_local_subchannel_pool", 1)])
                assert client.is_model_ready(MODEL)
                got = client.infer(MODEL, _inputs(live.model.keys[0][:3], np.array([3])))
                np.testing.assert_array_equal(got.as_numpy("OUTPUT0"),
                                              live.model.vectors[0][:3].reshape(-1))
                client.close()
    finally:
        held.close()
