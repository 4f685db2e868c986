"""The KServe v2 statistics extension through the real tritonclient (gRPC and HTTP):
success and failure counts and cumulative ns per model, both protocols counted alike;
and the request metrics of both protocols, told apart by their `protocol` label."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.http.conftest import MODEL, Live, start, write_model
from tests.http.grpc_support import grpc_beside, request_of

INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Live, str]]:
    for live in start(write_model(tmp_path / "m", sizes=(300, 200))):
        with grpc_beside(live) as address:
            yield live, address


def _inputs(module: Any, keys: np.ndarray, numkeys: np.ndarray) -> list[Any]:
    k = module.InferInput("KEYS", [keys.size], "INT64")
    k.set_data_from_numpy(keys.astype(np.int64))
    n = module.InferInput("NUMKEYS", [numkeys.size], "INT32")
    n.set_data_from_numpy(numkeys.astype(np.int32))
    return [k, n]


def _success_fail(stats: dict[str, Any]) -> tuple[int, int, int, int]:
    (model,) = stats["model_stats"]
    assert model["name"] == MODEL and model["version"] == "1"
    s, f = model["inference_stats"]["success"], model["inference_stats"]["fail"]
    return (int(s.get("count", 0)), int(s.get("ns", 0)), int(f.get("count", 0)),
            int(f.get("ns", 0)))


def test_statistics_count_both_protocols(served: tuple[Live, str]) -> None:
    live, address = served
    rng = np.random.default_rng(3)
    grpc_client = triton_grpc.InferenceServerClient(url=address)
    http_client = triton_http.InferenceServerClient(url=live.url.removeprefix("http://"))
    try:
        assert "statistics" in grpc_client.get_server_metadata().extensions
        assert "statistics" in http_client.get_server_metadata()["extensions"]
        before = _success_fail(http_client.get_inference_statistics(MODEL))
        assert before == (0, 0, 0, 0)
        for _ in range(3):
            keys, numkeys, expected = request_of(live, rng)
            got = grpc_client.infer(MODEL, _inputs(triton_grpc, keys, numkeys))
            assert np.array_equal(got.as_numpy("OUTPUT0").reshape(-1), expected)
        for _ in range(2):
            keys, numkeys, expected = request_of(live, rng)
            got = http_client.infer(MODEL, _inputs(triton_http, keys, numkeys))
            assert np.array_equal(got.as_numpy("OUTPUT0").reshape(-1), expected)
        bad = np.array([1, 2, 3], dtype=np.int64)
        for client, module in ((grpc_client, triton_grpc), (http_client, triton_http)):
            with pytest.raises(InferenceServerException):  # NUMKEYS sums to 9, not 3
                client.infer(MODEL, _inputs(module, bad, np.array([4, 5], dtype=np.int32)))
        over_http = http_client.get_inference_statistics(MODEL)
        over_grpc = grpc_client.get_inference_statistics(MODEL, as_json=True)
        for stats in (over_http, over_grpc):
            success, success_ns, fail, fail_ns = _success_fail(stats)
            assert (success, fail) == (5, 2)
            assert success_ns > 0 and fail_ns > 0
        model = over_http["model_stats"][0]
        assert model["inference_count"] == model["execution_count"] == 5
        assert model["last_inference"] > 0
        # every served model, and an unknown one refused
        assert [m["name"] for m in http_client.get_inference_statistics()["model_stats"]] \
            == [MODEL]
        assert [m["name"] for m in grpc_client.get_inference_statistics(
            as_json=True)["model_stats"]] == [MODEL]
        for client in (http_client, grpc_client):
            with pytest.raises(InferenceServerException, match="nope"):
                client.get_inference_statistics("nope")
        # requests for an unknown model are in no model's figures
        with pytest.raises(InferenceServerException):
            grpc_client.infer("nope", _inputs(triton_grpc, bad, np.array([3], np.int32)))
        assert _success_fail(http_client.get_inference_statistics(MODEL))[::2] == (5, 2)
    finally:
        grpc_client.close()
        http_client.close()


def test_request_metrics_carry_the_protocol(served: tuple[Live, str]) -> None:
    live, address = served
    rng = np.random.default_rng(4)
    with triton_grpc.InferenceServerClient(url=address) as client:
        keys, numkeys, _ = request_of(live, rng)
        for _ in range(4):
            client.infer(MODEL, _inputs(triton_grpc, keys, numkeys))
        with pytest.raises(InferenceServerException):
            client.infer(MODEL, _inputs(triton_grpc, keys[:3], np.array([4, 5], np.int32)))
    assert live.metric("hps_http_requests_total", route=INFER, protocol="grpc",
                       code="200") == 4
    assert live.metric("hps_http_requests_total", route=INFER, protocol="grpc",
                       code="400") == 1
    assert live.metric("hps_http_request_duration_seconds_count", route=INFER,
                       protocol="grpc") == 5
    live.lookup_binary(0, live.model.keys[0][:5])
    assert live.metric("hps_http_requests_total", route="/v1/models/{model}/tables/{table}"
                       "/lookup", protocol="http", code="200") >= 1
