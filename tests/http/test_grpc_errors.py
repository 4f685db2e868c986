"""Bad input over gRPC: every error kind with its status code and a message naming what
was wrong, the token, the limits, and a bounded fuzz of malformed messages; nothing a
client sends is answered UNKNOWN or INTERNAL, and nothing it sends changes an answer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from hps.http import create_app
from hps.http.serve import ServerThread
from hps.server import HierarchicalParameterServer
from tests.http.conftest import MAX_KEYS, MODEL, Live, ModelFiles, serving, wait_until
from tests.http.grpc_support import grpc_beside, raw_request, request_of, stub

OK = grpc.StatusCode.OK
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
Tensor = service_pb2.ModelInferRequest.InferInputTensor


@pytest.fixture(scope="module")
def infer(live: Live) -> Iterator[grpc.UnaryUnaryMultiCallable]:
    with grpc_beside(live) as where:
        channel, s = stub(where)
        yield s.ModelInfer
        channel.close()


def _code(call: grpc.UnaryUnaryMultiCallable, request: object,
          **kw: object) -> tuple[grpc.StatusCode, str]:
    try:
        call(request, timeout=30, **kw)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()  # type: ignore[attr-defined]
    return OK, ""


def _keys(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def _contents(keys: list[int], numkeys: list[int], **overrides: object) -> object:
    """KEYS and NUMKEYS as typed contents."""
    k = Tensor(name="KEYS", datatype="INT64", shape=[len(keys)])
    k.contents.int64_contents.extend(keys)
    n = Tensor(name="NUMKEYS", datatype="INT32", shape=[len(numkeys)])
    n.contents.int_contents.extend(numkeys)
    return service_pb2.ModelInferRequest(model_name=MODEL, inputs=[k, n], **overrides)


def test_typed_contents_answer_as_raw_ones(live: Live, infer: grpc.UnaryUnaryMultiCallable,
                                           rng: np.random.Generator) -> None:
    keys, numkeys, expected = request_of(live, rng)
    answer = infer(_contents(keys.tolist(), numkeys.tolist()), timeout=30)
    assert [o.name for o in answer.outputs] == ["OUTPUT0"]
    assert list(answer.outputs[0].shape) == [expected.size]
    np.testing.assert_array_equal(np.frombuffer(answer.raw_output_contents[0], "<f4"),
                                  expected)


def _cases() -> dict[str, tuple[object, grpc.StatusCode, str]]:
    k, n = _keys(10), np.array([10], np.int32)
    good = raw_request(MODEL, k, n)

    def edited(**fields: object) -> object:
        request = service_pb2.ModelInferRequest()
        request.CopyFrom(good)  # type: ignore[arg-type]
        for name, value in fields.items():
            if name == "inputs":
                del request.inputs[:]
                request.inputs.extend(value)  # type: ignore[arg-type]
            elif name == "raw":
                del request.raw_input_contents[:]
                request.raw_input_contents.extend(value)  # type: ignore[arg-type]
            elif name == "outputs":
                request.outputs.extend(value)  # type: ignore[arg-type]
            else:
                setattr(request, name, value)
        return request

    keys_t = Tensor(name="KEYS", datatype="INT64", shape=[10])
    num_t = Tensor(name="NUMKEYS", datatype="INT32", shape=[1])
    return {
        "unknown model": (raw_request("nope", k, n), NOT_FOUND, "'nope'"),
        "unknown version": (edited(model_version="2"), NOT_FOUND, "version '2'"),
        "counts do not add up": (raw_request(MODEL, k, np.array([4, 5])), INVALID,
                                 "adds up to 9"),
        "more counts than tables": (raw_request(MODEL, k, np.array([5, 5, 0])), INVALID,
                                    "3 entries"),
        "negative count": (raw_request(MODEL, k, np.array([12, -2])), INVALID, "negative"),
        "too many keys": (raw_request(MODEL, _keys(MAX_KEYS + 1), np.array([MAX_KEYS + 1])),
                          EXHAUSTED, "exceed the limit"),
        "unknown input": (edited(inputs=[keys_t, Tensor(name="X", datatype="INT32",
                                                        shape=[1])]), INVALID, "'X'"),
        "input twice": (edited(inputs=[keys_t, keys_t]), INVALID, "twice"),
        "missing input": (edited(inputs=[keys_t], raw=[k.tobytes()]), INVALID,
                          "'NUMKEYS' is missing"),
        "wrong datatype": (edited(inputs=[Tensor(name="KEYS", datatype="FP32", shape=[10]),
                                          num_t]), INVALID, "datatype 'FP32'"),
        "keys of another width": (edited(inputs=[Tensor(name="KEYS", datatype="INT32",
                                                        shape=[10]), num_t]), INVALID,
                                  "needs 40 bytes of INT32"),
        "raw size off": (edited(raw=[k.tobytes()[:-8], n.tobytes()]), INVALID, "needs 80"),
        "raw count off": (edited(raw=[k.tobytes()]), INVALID, "1 raw_input_contents"),
        "negative shape": (edited(inputs=[Tensor(name="KEYS", datatype="INT64",
                                                 shape=[-10]), num_t]), INVALID, "negative"),
        "raw and contents": (_both(k, n), INVALID, "both contents"),
        "wrong contents field": (_wrong_field(), INVALID, "int64_contents"),
        "contents count off": (_shape_off(), INVALID, "3 elements"),
        "unknown output": (edited(outputs=[
            service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="OUT9")]), INVALID,
            "'OUT9'"),
    }


def _both(k: np.ndarray, n: np.ndarray) -> object:
    request = raw_request(MODEL, k, n)
    request.inputs[0].contents.int64_contents.extend(k.tolist())
    return request


def _shape_off() -> object:
    request = _contents([1, 2, 3], [3])
    request.inputs[0].shape[:] = [4]
    return request


def _wrong_field() -> object:
    request = _contents([1, 2], [2])
    request.inputs[0].contents.ClearField("int64_contents")
    request.inputs[0].contents.fp32_contents.extend([1.0, 2.0])
    return request


@pytest.mark.parametrize("case", list(_cases()))
def test_each_bad_request_gets_its_code_and_names_the_fault(
        infer: grpc.UnaryUnaryMultiCallable, case: str) -> None:
    request, want, words = _cases()[case]
    code, message = _code(infer, request)
    assert code == want and words in message, (code, message)


def test_not_a_message_is_invalid_argument(live: Live) -> None:
    with grpc_beside(live) as where, grpc.insecure_channel(where) as channel:
        for method in ("ModelInfer", "ModelMetadata", "ModelReady"):
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
            code, message = _code(call, b"\xff\xff\xff\xff\x0f")
            assert code == INVALID and "not an inference" in message, (method, code, message)


def test_token_and_body_limit(model_files: ModelFiles, rng: np.random.Generator) -> None:
    with serving(model_files, token="s3cret", max_body_bytes=1 << 16) as live, \
            grpc_beside(live) as where:
        client = triton.InferenceServerClient(url=where)
        keys = model_files.keys[0][:10]
        k = triton.InferInput("KEYS", [10], "INT64")
        k.set_data_from_numpy(keys)
        n = triton.InferInput("NUMKEYS", [1], "INT32")
        n.set_data_from_numpy(np.array([10], np.int32))
        assert client.is_server_live()  # health needs no token, as over HTTP
        for headers, words in ((None, "Bearer"), ({"authorization": "Bearer nope"}, "wrong")):
            for call in (lambda h=headers: client.infer(MODEL, [k, n], headers=h),
                         lambda h=headers: client.get_model_metadata(MODEL, headers=h)):
                with pytest.raises(InferenceServerException, match=words) as info:
                    call()
                assert info.value.status() == "StatusCode.UNAUTHENTICATED"
        good = {"authorization": "Bearer s3cret"}
        np.testing.assert_array_equal(
            client.infer(MODEL, [k, n], headers=good).as_numpy("OUTPUT0"),
            model_files.vectors[0][:10].reshape(-1))
        big = triton.InferInput("KEYS", [10_000], "INT64")  # 80 kB > the 64 KiB limit
        big.set_data_from_numpy(np.arange(10_000, dtype=np.int64))
        count = triton.InferInput("NUMKEYS", [1], "INT32")
        count.set_data_from_numpy(np.array([10_000], np.int32))
        with pytest.raises(InferenceServerException) as info:
            client.infer(MODEL, [big, count], headers=good)
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        client.close()


def _fuzzed(rng: np.random.Generator) -> object:
    """A request built from random parts: names, datatypes, shapes, raw or typed data
    of random sizes, outputs, model names and versions."""
    names = ["KEYS", "NUMKEYS", "KEYS", "NUMKEYS", "X", ""]
    datatypes = ["INT64", "INT32", "FP32", "BYTES", "int64", ""]
    inputs, raw = [], []
    use_raw = rng.random() < 0.5
    for _ in range(rng.integers(0, 4)):
        t = Tensor(name=str(rng.choice(names)), datatype=str(rng.choice(datatypes)),
                   shape=rng.integers(-2, 6, size=rng.integers(0, 3)).tolist())
        size = int(rng.integers(0, 6))
        values = rng.integers(-(2**31), 2**31, size=size)
        if use_raw:
            raw.append(values.astype("<i8" if rng.random() < 0.5 else "<i4").tobytes()
                       [:int(rng.integers(0, 8 * size + 1))])
        else:
            field = rng.choice(["int64_contents", "int_contents", "fp32_contents"])
            getattr(t.contents, field).extend(
                values.astype(np.float32 if field == "fp32_contents" else np.int64).tolist())
        if rng.random() < 0.1:
            t.parameters["shared_memory_region"].string_param = "r"
        inputs.append(t)
    if use_raw and rng.random() < 0.2:
        raw.append(b"\0" * int(rng.integers(0, 9)))
    outputs = [service_pb2.ModelInferRequest.InferRequestedOutputTensor(
        name=str(rng.choice(["OUTPUT0", "OUTPUT1"])))
        for _ in range(rng.integers(0, 2))]
    return service_pb2.ModelInferRequest(
        model_name=str(rng.choice([MODEL, MODEL, "nope", ""])),
        model_version=str(rng.choice(["", "1", "2"])), inputs=inputs,
        raw_input_contents=raw, outputs=outputs)


def test_bounded_fuzz_of_malformed_messages(live: Live, infer: grpc.UnaryUnaryMultiCallable,
                                            rng: np.random.Generator) -> None:
    keys, numkeys, expected = request_of(live, rng)
    seen: dict[grpc.StatusCode, int] = {}
    for i in range(400):
        code, message = _code(infer, _fuzzed(rng))
        assert code in (OK, INVALID, NOT_FOUND, EXHAUSTED), (code, message)
        assert code == OK or message, code
        seen[code] = seen.get(code, 0) + 1
        if i % 100 == 0:  # bad input changed nothing
            answer = infer(raw_request(MODEL, keys, numkeys), timeout=30)
            np.testing.assert_array_equal(
                np.frombuffer(answer.raw_output_contents[0], "<f4"), expected)
    assert seen.get(INVALID, 0) > 100, seen
    with grpc_beside(live) as where, grpc.insecure_channel(where) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for _ in range(200):  # bytes that may or may not parse as a message
            good = raw_request(MODEL, keys, numkeys).SerializeToString()
            cut = bytearray(good[:int(rng.integers(0, len(good)))])
            if cut and rng.random() < 0.5:
                cut[int(rng.integers(0, len(cut)))] = int(rng.integers(0, 256))
            code, message = _code(call, bytes(cut))
            assert code in (OK, INVALID, NOT_FOUND, EXHAUSTED), (code, message)


def test_the_config_key_is_checked(model_files: ModelFiles) -> None:
    from hps.config import load_config
    from hps.errors import ConfigError

    assert load_config(model_files.config).http.grpc_port is None  # off by default
    assert load_config({**model_files.config, "http": {"grpc_port": 8001}}).http.grpc_port \
        == 8001
    for bad in (70000, -1, "x"):
        with pytest.raises(ConfigError, match="grpc_port"):
            load_config({**model_files.config, "http": {"grpc_port": bad}})


def test_a_model_that_failed_to_load_is_unavailable_and_not_ready(
        model_files: ModelFiles, tmp_path: Path) -> None:
    broken = {**model_files.config["models"][0], "model": "broken",
              "sparse_files": [str(tmp_path / "absent0"), str(tmp_path / "absent1")]}
    files = ModelFiles(model_files.dir, {**model_files.config,
                                         "models": [*model_files.config["models"], broken]},
                       model_files.keys, model_files.vectors)
    server = HierarchicalParameterServer(files.config, load=False)
    app = create_app(server)
    thread = ServerThread(app)
    thread.start()
    try:
        wait_until(lambda: "broken" in app.state.hps.failed or "broken" in server.models)
        live = Live(thread.url, None, app, server, files)  # type: ignore[arg-type]
        with grpc_beside(live) as where:
            client = triton.InferenceServerClient(url=where)
            assert not client.is_model_ready("broken") and not client.is_server_ready()
            keys = np.arange(3, dtype=np.int64)
            channel, s = stub(where)
            code, message = _code(s.ModelInfer, raw_request("broken", keys, np.array([3])))
            assert code == grpc.StatusCode.UNAVAILABLE and "failed to load" in message
            channel.close()
            client.close()
    finally:
        thread.stop()
        server.close()
