"""The gRPC paths of `hps bench http`: its client reads exact rows from the service, and
the floor answers messages of the same size (zeros) from a process of its own; the 1-key
comparison runs every path's client in a process of its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hps.tools.bench.grpc_one_key import GRPC, HTTP, HTTP_FLOOR, TRITONCLIENT, grpc_floor, one_key
from hps.tools.bench.grpc_paths import GrpcClient, bare_grpc_server, infer_request
from tests.http.conftest import MODEL, serving, write_model
from tests.http.grpc_support import grpc_beside
from tests.support.redis_servers import free_port


def test_client_reads_the_service_and_the_floor(tmp_path: Path) -> None:
    model_files = write_model(tmp_path / "model")
    keys = model_files.keys[0][:7]
    requests = [infer_request(MODEL, keys), infer_request(MODEL, keys[:1])]
    with serving(model_files) as live, grpc_beside(live) as where:
        client = GrpcClient(where, requests, 8)
        np.testing.assert_array_equal(client(0), model_files.vectors[0][:7])
        np.testing.assert_array_equal(client(1), model_files.vectors[0][:1])
        client.channel.close()
    pids: list[int] = []
    with bare_grpc_server(tmp_path, free_port(), 8, pids) as floor:
        client = GrpcClient(floor, requests, 8)
        for i, n in ((0, 7), (1, 1)):
            got = client(i)
            assert got.shape == (n, 8) and not got.any()
        client.channel.close()
    assert len(pids) == 1


def test_one_key_times_every_path_in_client_processes() -> None:
    got = one_key(["sync"], rounds=2, seconds=0.2, tritonclient=True, num_keys=1000, dim=8)
    paths = got["paths"]
    assert set(paths) == {HTTP, GRPC, HTTP_FLOOR, grpc_floor("sync"), TRITONCLIENT}
    for figures in paths.values():
        assert figures["calls"] > 0 and len(figures["round_p50_ms"]) == 2
        assert 0 < figures["p50_ms"] <= figures["p99_ms"]
    assert set(got["p50_ratios"]) == {f"{GRPC} / HTTP", f"{grpc_floor('sync')} / HTTP"}
