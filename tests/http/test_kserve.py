"""The KServe v2 / Triton protocol, spoken by the real `tritonclient` and by plain HTTP,
against uvicorn over a socket."""

from __future__ import annotations

import gc
import json
import struct
import weakref
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

import hps.http.kserve.plan as plans
from hps.http.kserve.encode import header_and_values
from tests.http.conftest import DIMS, MAX_KEYS, MODEL, Live

HEADER = "Inference-Header-Content-Length"
INFER = f"/v2/models/{MODEL}/infer"


def _client(live: Live) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=live.url.removeprefix("http://"))


@pytest.fixture
def client(live: Live) -> Iterator[triton.InferenceServerClient]:
    c = _client(live)
    yield c
    c.close()


def _request(rng: np.random.Generator, live: Live, counts: tuple[int, int] = (40, 25)
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """KEYS (known keys with repeats, and unknown ones), NUMKEYS, and the OUTPUT0 due."""
    parts = [live.model.sample_keys(rng, t, n - 3, unknown=3) for t, n in enumerate(counts)]
    expected = np.concatenate([live.model.expected(t, k).reshape(-1)
                               for t, k in enumerate(parts)])
    return np.concatenate(parts), np.array(counts, dtype=np.int32), expected


def _inputs(keys: np.ndarray, numkeys: np.ndarray, binary: bool,
            shape: str = "flat") -> list[triton.InferInput]:
    if shape == "row":  # [1, n], as batched clients send
        keys, numkeys = keys.reshape(1, -1), numkeys.reshape(1, -1)
    k = triton.InferInput("KEYS", list(keys.shape), "INT64")
    k.set_data_from_numpy(keys.astype(np.int64), binary_data=binary)
    n = triton.InferInput("NUMKEYS", list(numkeys.shape), "INT32")
    n.set_data_from_numpy(numkeys.astype(np.int32), binary_data=binary)
    return [k, n]


# -- tritonclient -------------------------------------------------------------------------

def test_health_metadata_and_config(live: Live,
                                    client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and not client.is_model_ready("nope")
    meta = client.get_model_metadata(MODEL)
    assert meta["name"] == MODEL and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "KEYS", "datatype": "INT64", "shape": [-1]},
                              {"name": "NUMKEYS", "datatype": "INT32", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1]}]
    assert client.get_model_metadata(MODEL, model_version="1") == meta
    config = client.get_model_config(MODEL)
    assert [i["name"] for i in config["input"]] == ["KEYS", "NUMKEYS"]
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    with pytest.raises(InferenceServerException, match="nope"):
        client.get_model_metadata("nope")
    with pytest.raises(InferenceServerException, match="version '2'"):
        client.get_model_metadata(MODEL, model_version="2")


@pytest.mark.parametrize("shape", ["flat", "row"])
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_splits_keys_over_the_tables(live: Live, client: triton.InferenceServerClient,
                                           rng: np.random.Generator, binary: bool,
                                           shape: str) -> None:
    keys, numkeys, expected = _request(rng, live)
    outputs = [triton.InferRequestedOutput("OUTPUT0", binary_data=binary)]
    result = client.infer(MODEL, _inputs(keys, numkeys, binary, shape), outputs=outputs,
                          request_id="r-1")
    got = result.as_numpy("OUTPUT0")
    assert got.dtype == np.float32 and got.shape == (40 * DIMS[0] + 25 * DIMS[1],)
    np.testing.assert_array_equal(got, expected)
    response = result.get_response()
    assert response["model_name"] == MODEL and response["id"] == "r-1"
    assert ("binary_data_size" in response["outputs"][0].get("parameters", {})) == binary


def test_infer_one_table_and_default_outputs(live: Live, client: triton.InferenceServerClient,
                                             rng: np.random.Generator) -> None:
    keys = live.model.sample_keys(rng, 0, 100, unknown=5)
    # no outputs named: tritonclient asks for every output in binary form
    result = client.infer(MODEL, _inputs(keys, np.array([keys.size]), binary=True),
                          model_version="1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"),
                                  live.model.expected(0, keys).reshape(-1))
    # the second table alone: NUMKEYS [0, n]
    keys = live.model.sample_keys(rng, 1, 30)
    result = client.infer(MODEL, _inputs(keys, np.array([0, keys.size]), binary=False))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"),
                                  live.model.expected(1, keys).reshape(-1))
    empty = client.infer(MODEL, _inputs(np.zeros(0, np.int64), np.array([0, 0]), True))
    assert empty.as_numpy("OUTPUT0").shape == (0,)


def test_tritonclient_sees_the_protocol_errors(live: Live,
                                               client: triton.InferenceServerClient) -> None:
    keys = np.arange(10, dtype=np.int64)
    with pytest.raises(InferenceServerException, match="adds up to 9") as info:
        client.infer(MODEL, _inputs(keys, np.array([4, 5]), True))
    assert info.value.status() == "400"
    with pytest.raises(InferenceServerException, match="nope") as info:
        client.infer("nope", _inputs(keys, np.array([10]), True))
    assert info.value.status() == "404"


# -- plain HTTP ---------------------------------------------------------------------------

def _binary_body(keys: np.ndarray, numkeys: np.ndarray, header: dict[str, Any] | None = None
                 ) -> tuple[bytes, dict[str, str]]:
    k, n = keys.astype("<i8").tobytes(), numkeys.astype("<i4").tobytes()
    head = header or {
        "inputs": [
            {"name": "KEYS", "shape": [keys.size], "datatype": "INT64",
             "parameters": {"binary_data_size": len(k)}},
            {"name": "NUMKEYS", "shape": [numkeys.size], "datatype": "INT32",
             "parameters": {"binary_data_size": len(n)}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}
    text = json.dumps(head).encode()
    return text + k + n, {HEADER: str(len(text))}


def test_plain_http_binary_and_json(live: Live, rng: np.random.Generator) -> None:
    keys, numkeys, expected = _request(rng, live)
    body, headers = _binary_body(keys, numkeys)
    answer = live.client.post(INFER, content=body, headers=headers)
    assert answer.status_code == 200, answer.text
    size = int(answer.headers[HEADER])
    head = json.loads(answer.content[:size])
    assert head["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32",
                                "shape": [expected.size],
                                "parameters": {"binary_data_size": expected.size * 4}}]
    np.testing.assert_array_equal(np.frombuffer(answer.content[size:], "<f4"), expected)

    request = {"id": "7", "inputs": [
        {"name": "KEYS", "shape": [keys.size], "datatype": "INT64", "data": keys.tolist()},
        {"name": "NUMKEYS", "shape": [1, 2], "datatype": "INT32", "data": [numkeys.tolist()]}]}
    answer = live.client.post(f"/v2/models/{MODEL}/versions/1/infer", json=request)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json" and HEADER not in answer.headers
    out = answer.json()
    assert out["id"] == "7" and out["model_version"] == "1"
    np.testing.assert_array_equal(np.asarray(out["outputs"][0]["data"], np.float32), expected)


def test_health_routes(live: Live) -> None:
    assert live.client.get("/v2/health/live").status_code == 200
    assert live.client.get("/v2/health/ready").status_code == 200
    ready = live.client.get(f"/v2/models/{MODEL}/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    missing = live.client.get("/v2/models/nope/ready")
    assert missing.status_code == 404 and "nope" in missing.json()["error"]


KEYS5 = {"name": "KEYS", "shape": [5], "datatype": "INT64", "data": [1, 2, 3, 4, 5]}
NUM5 = {"name": "NUMKEYS", "shape": [1], "datatype": "INT32", "data": [5]}

ERRORS: list[tuple[str, dict[str, Any], int, str]] = [
    # (id, request, status, a word the message must contain)
    ("no inputs", {"inputs": []}, 400, "missing"),
    ("KEYS missing", {"inputs": [NUM5]}, 400, "KEYS"),
    ("unknown input", {"inputs": [KEYS5, NUM5, {**NUM5, "name": "X"}]}, 400, "'X'"),
    ("input twice", {"inputs": [KEYS5, KEYS5, NUM5]}, 400, "twice"),
    ("KEYS as FP32", {"inputs": [{**KEYS5, "datatype": "FP32"}, NUM5]}, 400,
     "INT64, INT32, UINT32 or UINT64"),
    ("NUMKEYS as INT64", {"inputs": [KEYS5, {**NUM5, "datatype": "INT64"}]}, 400, "INT32"),
    ("shape disagrees", {"inputs": [{**KEYS5, "shape": [6]}, NUM5]}, 400, "needs 6"),
    ("float key", {"inputs": [{**KEYS5, "data": [1, 2, 3, 4, 5.5]}, NUM5]}, 400, "data"),
    ("string key", {"inputs": [{**KEYS5, "data": ["1", 2, 3, 4, 5]}, NUM5]}, 400, "data"),
    ("key above int64", {"inputs": [{**KEYS5, "data": [2**63, 2, 3, 4, 5]}, NUM5]}, 400,
     "INT64: its values must lie in"),
    ("key above uint64", {"inputs": [{**KEYS5, "datatype": "UINT64",
                                      "data": [2**64, 2, 3, 4, 5]}, NUM5]}, 400, "data"),
    ("ragged rows", {"inputs": [{**KEYS5, "shape": [2, 2], "data": [[1, 2], [3]]}, NUM5]},
     400, "length"),
    ("NUMKEYS beyond int32", {"inputs": [KEYS5, {**NUM5, "data": [2**40]}]}, 400,
     "INT32: its values must lie in"),
    ("NUMKEYS sum", {"inputs": [KEYS5, {**NUM5, "data": [4]}]}, 400, "adds up to 4"),
    ("negative NUMKEYS", {"inputs": [KEYS5, {**NUM5, "shape": [2], "data": [6, -1]}]}, 400,
     "negative"),
    ("more NUMKEYS than tables", {"inputs": [KEYS5, {**NUM5, "shape": [3],
                                                     "data": [5, 0, 0]}]}, 400, "2 tables"),
    ("no data", {"inputs": [{k: v for k, v in KEYS5.items() if k != "data"}, NUM5]}, 400,
     "neither"),
    ("shared memory", {"inputs": [{**KEYS5, "parameters": {"shared_memory_region": "r"}},
                                  NUM5]}, 400, "shared"),
    ("unknown output", {"inputs": [KEYS5, NUM5], "outputs": [{"name": "OUTPUT1"}]}, 400,
     "OUTPUT1"),
    ("classification", {"inputs": [KEYS5, NUM5], "outputs": [
        {"name": "OUTPUT0", "parameters": {"classification": 2}}]}, 400, "classification"),
    ("extra field", {"inputs": [KEYS5, NUM5], "model": "m"}, 400, "model"),
    ("too many keys", {"inputs": [
        {"name": "KEYS", "shape": [MAX_KEYS + 1], "datatype": "INT64",
         "data": list(range(MAX_KEYS + 1))},
        {**NUM5, "data": [MAX_KEYS + 1]}]}, 413, "exceed"),
]


@pytest.mark.parametrize(("case", "request_", "status", "word"), ERRORS,
                         ids=[e[0] for e in ERRORS])
def test_bad_requests_get_the_protocols_error(live: Live, case: str, request_: dict[str, Any],
                                              status: int, word: str) -> None:
    answer = live.client.post(INFER, json=request_)
    _v2_error(answer, status, word)


def _v2_error(answer: httpx.Response, status: int, word: str) -> None:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    body = answer.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    assert word in body["error"], body["error"]


def test_bad_binary_bodies(live: Live) -> None:
    keys, numkeys = np.arange(4, dtype=np.int64), np.array([4])
    body, headers = _binary_body(keys, numkeys)
    cases = [
        (body, {HEADER: "x"}, "Inference-Header-Content-Length"),
        # str.isdigit accepts a superscript two, int refuses it: a 400, not a 500
        (body, {HEADER: "\u00b2".encode("latin-1")}, "Inference-Header-Content-Length"),
        (body, {HEADER: "1\u00b2".encode("latin-1")}, "Inference-Header-Content-Length"),
        (body, {HEADER: str(len(body) + 1)}, "within the body"),
        (body + b"\0", headers, "1 bytes"),  # trailing bytes after the inputs
        (body[:-1], headers, "binary_data_size"),  # NUMKEYS cut short
        (b"{not json" + body[9:], headers, "not valid JSON"),
    ]
    for content, hdrs, word in cases:
        _v2_error(live.client.post(INFER, content=content, headers=hdrs), 400, word)
    head = json.loads(body[:int(headers[HEADER])])
    head["inputs"][0]["parameters"]["binary_data_size"] = 24  # 3 keys for a shape of 4
    bad, hdrs = _binary_body(keys, numkeys, head)
    _v2_error(live.client.post(INFER, content=bad, headers=hdrs), 400, "needs 32 bytes")
    gz = live.client.post(INFER, content=body, headers={**headers, "Content-Encoding": "gzip"})
    _v2_error(gz, 415, "uncompressed")
    _v2_error(live.client.post("/v2/models/nope/infer", content=body, headers=headers), 404,
              "nope")
    _v2_error(live.client.post(f"/v2/models/{MODEL}/versions/3/infer", content=body,
                               headers=headers), 404, "version '3'")
    _v2_error(live.client.get(INFER), 405, "Method Not Allowed")


def test_a_known_header_is_read_as_it_was_parsed(live: Live, rng: np.random.Generator
                                                ) -> None:
    """The server keeps the layout of a binary-only header it parsed: later requests with
    the same header bytes and other keys get their own vectors, and a binary part of
    another size gets the same 400 as a header never seen."""
    keys, numkeys, expected = _request(rng, live)
    body, headers = _binary_body(keys, numkeys)
    head = body[:int(headers[HEADER])]
    for _ in range(2):  # parsed, then known
        answer = live.client.post(INFER, content=body, headers=headers)
        assert answer.status_code == 200, answer.text
        np.testing.assert_array_equal(
            np.frombuffer(answer.content[int(answer.headers[HEADER]):], "<f4"), expected)
    other, _, other_expected = _request(rng, live)  # same shape: the same header bytes
    other_body, _ = _binary_body(other, numkeys)
    assert other_body[:len(head)] == head and not np.array_equal(other, keys)
    answer = live.client.post(INFER, content=other_body, headers=headers)
    assert answer.status_code == 200, answer.text
    np.testing.assert_array_equal(
        np.frombuffer(answer.content[int(answer.headers[HEADER]):], "<f4"), other_expected)
    _v2_error(live.client.post(INFER, content=body + b"\0", headers=headers), 400, "1 bytes")
    _v2_error(live.client.post(INFER, content=body[:-1], headers=headers), 400,
              "binary_data_size")


def test_plans_and_answer_heads_follow_each_request(live: Live, rng: np.random.Generator
                                                   ) -> None:
    """The server keeps the split of each NUMKEYS and the answer header of each request
    id it has answered: another split under the same header bytes, another id, or a
    known split with a wrong key count are each answered as if never seen; a replaced
    model version's splits go with it."""
    keys, numkeys, expected = _request(rng, live)  # 40 + 25 keys
    for request_id in ("a", "b", "a"):
        header = {"id": request_id, "inputs": [
            {"name": "KEYS", "shape": [keys.size], "datatype": "INT64",
             "parameters": {"binary_data_size": 8 * keys.size}},
            {"name": "NUMKEYS", "shape": [2], "datatype": "INT32",
             "parameters": {"binary_data_size": 8}}],
            "parameters": {"binary_data_output": True}}
        body, headers = _binary_body(keys, numkeys, header)
        answer = live.client.post(INFER, content=body, headers=headers)
        assert answer.status_code == 200, answer.text
        size = int(answer.headers[HEADER])
        assert json.loads(answer.content[:size])["id"] == request_id
        np.testing.assert_array_equal(np.frombuffer(answer.content[size:], "<f4"), expected)
    swapped, swapped_counts, swapped_expected = _request(rng, live, (25, 40))
    body, headers = _binary_body(swapped, swapped_counts)
    assert body[:int(headers[HEADER])] == _binary_body(keys, numkeys)[0][:int(headers[HEADER])]
    answer = live.client.post(INFER, content=body, headers=headers)
    assert answer.status_code == 200, answer.text
    np.testing.assert_array_equal(
        np.frombuffer(answer.content[int(answer.headers[HEADER]):], "<f4"), swapped_expected)
    body, headers = _binary_body(keys[:64], numkeys)  # a known split, one key short
    _v2_error(live.client.post(INFER, content=body, headers=headers), 400,
              "adds up to 65 keys but KEYS has 64")

    served = weakref.ref(live.server.model(MODEL))
    assert served() in plans._PLANS
    live.server.load_model(live.server.model(MODEL).config)  # a new version replaces it
    assert live.server.wait_retired(10)
    gc.collect()
    assert served() is None  # the plans held it weakly
    body, headers = _binary_body(keys, numkeys)
    answer = live.client.post(INFER, content=body, headers=headers)
    assert answer.status_code == 200, answer.text
    np.testing.assert_array_equal(
        np.frombuffer(answer.content[int(answer.headers[HEADER]):], "<f4"), expected)


def test_token_guards_v2_except_health(live_token: Live) -> None:
    body, headers = _binary_body(np.arange(3, dtype=np.int64), np.array([3]))
    _v2_error(live_token.client.post(INFER, content=body, headers=headers), 401, "Bearer")
    _v2_error(live_token.client.get(f"/v2/models/{MODEL}"), 401, "Bearer")
    assert live_token.client.get("/v2/health/live").status_code == 200
    assert live_token.client.get("/v2/health/ready").status_code == 200
    client = _client(live_token)
    try:
        result = client.infer(MODEL, _inputs(np.arange(3, dtype=np.int64), np.array([3]), True),
                              headers={"Authorization": "Bearer s3cret"})
        assert result.as_numpy("OUTPUT0").size == 3 * DIMS[0]
    finally:
        client.close()


def test_binary_layout_is_little_endian(live: Live) -> None:
    """The binary parts are raw little-endian, as the extension specifies."""
    key = int(live.model.keys[0][0])
    text = json.dumps({"inputs": [
        {"name": "KEYS", "shape": [1], "datatype": "INT64",
         "parameters": {"binary_data_size": 8}},
        {"name": "NUMKEYS", "shape": [1], "datatype": "INT32",
         "parameters": {"binary_data_size": 4}}]}).encode()
    body = text + struct.pack("<q", key) + struct.pack("<i", 1)
    answer = live.client.post(INFER, content=body, headers={HEADER: str(len(text)),
                                                            "Content-Type": "application/json"})
    # no output asked for in binary: the answer is JSON
    assert answer.status_code == 200 and HEADER not in answer.headers
    np.testing.assert_array_equal(np.asarray(answer.json()["outputs"][0]["data"], np.float32),
                                  live.model.vectors[0][0])


@pytest.mark.parametrize("header_size", [0, 1, 63, 64, 65, 300])
def test_binary_answer_is_one_buffer_with_its_values_on_a_cache_line(header_size: int) -> None:
    header = b"{" + b" " * header_size + b"}"
    data, values = header_and_values(header, 7)
    assert values.dtype == np.float32 and values.shape == (7,)
    assert values.ctypes.data % 64 == 0 and values.flags.c_contiguous
    values[:] = np.arange(7, dtype=np.float32)
    assert len(data) == len(header) + 28
    assert bytes(data[:len(header)]) == header
    assert bytes(data[len(header):]) == np.arange(7, dtype="<f4").tobytes()
