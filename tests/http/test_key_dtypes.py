"""Keys of every key dtype over the wire: /v1 binary lookups declaring theirs with
`X-HPS-Key-Dtype`, and KServe v2 KEYS of datatype INT64, INT32, UINT32 and UINT64 sent by
the real `tritonclient`, against uvicorn over a socket."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from hps.http.schemas import KEY_DTYPES
from tests.conftest import model_config, write_table
from tests.http.conftest import DEFAULT_VALUE, DIMS, MODEL, TABLE_NAMES, Live, ModelFiles, serving

#: keys at the edges of each dtype, held by both tables: int32's and uint32's extremes, and
#: negative keys, which uint64 clients send as their two's complement (2**64 - 3 for -3)
EDGE_KEYS = np.array([17, 42, -3, 2**31 - 1, -(2**31), 2**32 - 1, 2**40, -(2**62)], np.int64)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelFiles:
    folder = tmp_path_factory.mktemp("key-dtypes")
    rng = np.random.default_rng(5)
    keys, vectors, files = [], [], []
    for name, dim in zip(TABLE_NAMES, DIMS, strict=True):
        table_keys = np.concatenate([EDGE_KEYS, np.arange(1000, 1500, dtype=np.int64)])
        rows = rng.standard_normal((table_keys.size, dim), dtype=np.float32)
        write_table(folder / name, table_keys, rows)
        keys.append(table_keys)
        vectors.append(rows)
        files.append(str(folder / name))
    config = {
        "supportlonglong": True,
        "models": [model_config(files, DIMS, name=MODEL, embedding_table_names=TABLE_NAMES,
                                default_value_for_each_table=[DEFAULT_VALUE] * 2)],
        "volatile_db": {"type": "hash_map", "num_partitions": 4},
    }
    return ModelFiles(Path(folder), config, keys, vectors)


@pytest.fixture(scope="module")
def live(model: ModelFiles) -> Iterator[Live]:
    with serving(model) as running:
        yield running


def keys_of(dtype: str) -> np.ndarray:
    """Held keys and unknown ones that `dtype` can carry, as int64 (what they stand for)."""
    info = np.iinfo(KEY_DTYPES[dtype])
    held = EDGE_KEYS if dtype.endswith("64") else EDGE_KEYS[(EDGE_KEYS >= info.min)
                                                            & (EDGE_KEYS <= info.max)]
    return np.concatenate([held, [1000, 1499, 7, 900, 1000], held[::-1]]).astype(np.int64)


def wire(keys: np.ndarray, dtype: str) -> np.ndarray:
    """`keys` as a client of `dtype` sends them (uint64: the two's complement bits)."""
    if dtype == "uint64":
        return keys.view(np.uint64)
    return keys.astype(KEY_DTYPES[dtype])


# -- /v1 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(KEY_DTYPES))
def test_v1_binary_keys_of_a_declared_dtype(live: Live, dtype: str) -> None:
    keys = keys_of(dtype)
    assert dtype != "int32" or keys.size < 2 * EDGE_KEYS.size + 5  # some do not fit
    body = wire(keys, dtype).astype(KEY_DTYPES[dtype]).tobytes()
    for table, dim in enumerate(DIMS):
        answer = live.client.post(
            f"/v1/models/{MODEL}/tables/{table}/lookup", content=body,
            headers={"Content-Type": "application/octet-stream",
                     "X-HPS-Key-Dtype": dtype.upper() if table else dtype})
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-hps-keys"] == str(keys.size)
        assert answer.headers["x-hps-key-dtype"] == dtype  # as read, in lower case
        got = np.frombuffer(answer.content, "<f4").reshape(-1, dim)
        np.testing.assert_array_equal(got, live.model.expected(table, keys))


def test_v1_binary_keys_are_int64_without_the_header(live: Live) -> None:
    keys = keys_of("int64")
    answer = live.lookup_binary(0, keys)
    assert answer.status_code == 200
    assert answer.headers["x-hps-key-dtype"] == "int64"
    np.testing.assert_array_equal(np.frombuffer(answer.content, "<f4").reshape(-1, DIMS[0]),
                                  live.model.expected(0, keys))


def test_v1_int32_keys_sent_without_the_header_answer_how_they_were_read(live: Live) -> None:
    """Sixteen bytes of four int32 keys are two int64 keys: the answer says so, which is
    what a client checks (the README's binary example)."""
    answer = live.client.post(f"/v1/models/{MODEL}/tables/0/lookup",
                              content=np.array([17, 42, -3, 7], "<i4").tobytes(),
                              headers={"Content-Type": "application/octet-stream"})
    assert answer.status_code == 200
    assert (answer.headers["x-hps-key-dtype"], answer.headers["x-hps-keys"]) == ("int64", "2")
    assert len(answer.content) == 2 * DIMS[0] * 4


def test_openapi_declares_the_answers_key_dtype_header(live: Live) -> None:
    headers = live.client.get("/openapi.json").json()["paths"][
        "/v1/models/{model}/tables/{table}/lookup"]["post"]["responses"]["200"]["headers"]
    assert headers["X-HPS-Key-Dtype"]["schema"]["enum"] == list(KEY_DTYPES)


@pytest.mark.parametrize(("dtype", "size"), [(None, 12), ("int64", 20), ("int32", 6),
                                             ("uint32", 3), ("uint64", 9)])
def test_v1_a_body_of_no_whole_keys_is_a_400_naming_dtype_and_size(
        live: Live, dtype: str | None, size: int) -> None:
    headers = {"Content-Type": "application/octet-stream"}
    if dtype is not None:
        headers["X-HPS-Key-Dtype"] = dtype
    assert live.lookup_binary(0, EDGE_KEYS).status_code == 200
    before = live.metric("hps_lookups_total", model=MODEL, table=TABLE_NAMES[0])
    assert before > 0
    answer = live.client.post(f"/v1/models/{MODEL}/tables/0/lookup", content=b"\1" * size,
                              headers=headers)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["kind"] == "bad_body"
    assert f"{size} bytes" in error["message"], error
    assert f"{dtype or 'int64'} keys" in error["message"], error
    assert "X-HPS-Key-Dtype" in error["message"]
    assert live.metric("hps_lookups_total", model=MODEL, table=TABLE_NAMES[0]) == before


def test_v1_an_unknown_key_dtype_is_a_400_naming_the_dtypes(live: Live) -> None:
    answer = live.client.post(f"/v1/models/{MODEL}/tables/0/lookup", content=b"\0" * 8,
                              headers={"Content-Type": "application/octet-stream",
                                       "X-HPS-Key-Dtype": "float32"})
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "'float32'" in message and "int64, int32, uint32, uint64" in message


def test_v1_the_key_limit_counts_keys_of_the_declared_dtype(live: Live) -> None:
    limit = live.server.model(MODEL).tables[0].max_keys
    headers = {"Content-Type": "application/octet-stream", "X-HPS-Key-Dtype": "int32"}
    fits = live.client.post(f"/v1/models/{MODEL}/tables/0/lookup",
                            content=np.zeros(limit, "<i4").tobytes(), headers=headers)
    assert fits.status_code == 200 and fits.headers["x-hps-keys"] == str(limit)
    over = live.client.post(f"/v1/models/{MODEL}/tables/0/lookup",
                            content=np.zeros(limit + 1, "<i4").tobytes(), headers=headers)
    assert over.status_code == 413 and f"{limit + 1} keys" in over.json()["error"]["message"]


def test_openapi_declares_the_key_dtype_header(live: Live) -> None:
    route = live.client.get("/openapi.json").json()["paths"][
        "/v1/models/{model}/tables/{table}/lookup"]["post"]
    header = next(p for p in route["parameters"] if p["name"] == "X-HPS-Key-Dtype")
    assert header["in"] == "header" and header["schema"]["default"] == "int64"
    # the names, in any case (as the server reads them), and nothing else
    pattern = re.compile(header["schema"]["pattern"])
    for name in KEY_DTYPES:
        assert pattern.search(name) and pattern.search(name.upper())
    for other in ("int8", "float32", "int64 ", "int6", "xint64", ""):
        assert not pattern.search(other)


def test_a_dtype_header_that_names_no_dtype_is_refused_on_json_bodies_too(
        live: Live) -> None:
    """The document's pattern refuses it; the server ignored it on JSON bodies."""
    answer = live.client.post(f"/v1/models/{MODEL}/tables/0/lookup", json={"keys": [1]},
                              headers={"X-HPS-Key-Dtype": "float32"})
    assert answer.status_code == 400 and answer.json()["error"]["kind"] == "bad_body"
    fine = live.client.post(f"/v1/models/{MODEL}/tables/0/lookup", json={"keys": [1]},
                            headers={"X-HPS-Key-Dtype": "UINT32"})
    assert fine.status_code == 200  # JSON keys are int64 whatever a valid name says


# -- KServe v2, with tritonclient ----------------------------------------------------------

@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("dtype", list(KEY_DTYPES))
def test_kserve_keys_of_every_datatype(live: Live, dtype: str, binary: bool) -> None:
    keys = [keys_of(dtype), keys_of(dtype)[:7]]
    sent = wire(np.concatenate(keys), dtype)
    inputs = [triton.InferInput("KEYS", [sent.size], dtype.upper()),
              triton.InferInput("NUMKEYS", [2], "INT32")]
    inputs[0].set_data_from_numpy(sent, binary_data=binary)
    inputs[1].set_data_from_numpy(np.array([k.size for k in keys], np.int32),
                                  binary_data=binary)
    client = triton.InferenceServerClient(url=live.url.removeprefix("http://"))
    try:
        result = client.infer(MODEL, inputs, outputs=[
            triton.InferRequestedOutput("OUTPUT0", binary_data=binary)])
    finally:
        client.close()
    expected = np.concatenate([live.model.expected(t, k).reshape(-1)
                               for t, k in enumerate(keys)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)


@pytest.mark.parametrize(("datatype", "data", "word"), [
    ("UINT32", [5, -1], "UINT32: its values must lie in [0, 4294967295]"),
    ("INT32", [5, 2**31], "INT32: its values must lie in"),
    ("UINT64", [2**64 - 1, -3], "UINT64: its values must lie in"),
    ("FP32", [1, 2], "expected INT64, INT32, UINT32 or UINT64"),
])
def test_kserve_keys_outside_their_datatype_are_refused(live: Live, datatype: str,
                                                        data: list[int], word: str) -> None:
    request = {"inputs": [{"name": "KEYS", "shape": [2], "datatype": datatype, "data": data},
                          {"name": "NUMKEYS", "shape": [1], "datatype": "INT32",
                           "data": [2]}]}
    answer = live.client.post(f"/v2/models/{MODEL}/infer", json=request)
    assert answer.status_code == 400 and word in answer.json()["error"], answer.text


def test_tritonclient_sees_a_bad_key_datatype(live: Live) -> None:
    client = triton.InferenceServerClient(url=live.url.removeprefix("http://"))
    keys = triton.InferInput("KEYS", [2], "INT16")
    keys.set_data_from_numpy(np.array([1, 2], np.int16))
    count = triton.InferInput("NUMKEYS", [1], "INT32")
    count.set_data_from_numpy(np.array([2], np.int32))
    try:
        with pytest.raises(InferenceServerException, match="INT16") as info:
            client.infer(MODEL, [keys, count])
    finally:
        client.close()
    assert info.value.status() == "400"


# -- KServe v2 over gRPC, with tritonclient.grpc --------------------------------------------

@pytest.mark.parametrize("dtype", list(KEY_DTYPES))
def test_grpc_keys_of_every_datatype_raw_and_typed(live: Live, dtype: str) -> None:
    """Raw contents through tritonclient.grpc, twice (the second read through the layout
    the first left), and typed contents (`uint64_contents` …) through the bare stub."""
    import tritonclient.grpc as triton_grpc
    from tritonclient.grpc import service_pb2

    from hps.http.grpc.tensors import CONTENTS_FIELD
    from tests.http.grpc_support import grpc_beside, stub

    keys = [keys_of(dtype), keys_of(dtype)[:7]]
    sent = wire(np.concatenate(keys), dtype)
    expected = np.concatenate([live.model.expected(t, k).reshape(-1)
                               for t, k in enumerate(keys)])
    counts = np.array([k.size for k in keys], np.int32)
    with grpc_beside(live) as address:
        client = triton_grpc.InferenceServerClient(url=address)
        try:
            for _ in range(2):
                inputs = [triton_grpc.InferInput("KEYS", [sent.size], dtype.upper()),
                          triton_grpc.InferInput("NUMKEYS", [2], "INT32")]
                inputs[0].set_data_from_numpy(sent)
                inputs[1].set_data_from_numpy(counts)
                got = client.infer(MODEL, inputs).as_numpy("OUTPUT0")
                np.testing.assert_array_equal(got, expected)
        finally:
            client.close()
        tensor = service_pb2.ModelInferRequest.InferInputTensor
        key_tensor = tensor(name="KEYS", datatype=dtype.upper(), shape=[sent.size])
        getattr(key_tensor.contents, CONTENTS_FIELD[dtype.upper()]).extend(sent.tolist())
        count_tensor = tensor(name="NUMKEYS", datatype="INT32", shape=[2])
        count_tensor.contents.int_contents.extend(counts.tolist())
        channel, service = stub(address)
        try:
            answer = service.ModelInfer(service_pb2.ModelInferRequest(
                model_name=MODEL, inputs=[key_tensor, count_tensor]))
        finally:
            channel.close()
        np.testing.assert_array_equal(
            np.frombuffer(answer.raw_output_contents[0], "<f4"), expected)
