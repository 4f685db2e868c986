"""S3 model sources over real HTTP against moto's ThreadedMotoServer."""

from __future__ import annotations

import contextlib
import gc
import json
import socket
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest

from hps.errors import (
    MissingExtraError,
    ModelFileError,
    SourceAccessError,
    SourceError,
    SourceNotFoundError,
    SourceUnreachableError,
)
from hps.modelfiles.formats.sparse_folder import SparseModelReader
from hps.modelfiles.s3 import S3Location, S3Source, parse_s3_uri
from hps.modelfiles.uri import SourceOptions, open_source
from tests.support.s3_server import S3Server

# -- URI parsing (no server) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bkt/prefix/table0", S3Location("bkt", "prefix/table0", None, "s3")),
        ("s3://bkt/prefix/table0/", S3Location("bkt", "prefix/table0", None, "s3")),
        ("s3://bkt", S3Location("bkt", "", None, "s3")),
        (
            "https://bkt.s3.eu-west-3.amazonaws.com/prefix/table0",
            S3Location("bkt", "prefix/table0", "eu-west-3", "virtual-hosted"),
        ),
        (
            "https://my.dotted.bkt.s3.us-gov-west-1.amazonaws.com/p/t",
            S3Location("my.dotted.bkt", "p/t", "us-gov-west-1", "virtual-hosted"),
        ),
        (
            "https://bkt.s3-ap-southeast-2.amazonaws.com/p/t",
            S3Location("bkt", "p/t", "ap-southeast-2", "virtual-hosted"),
        ),
        ("https://bkt.s3.amazonaws.com/p/t", S3Location("bkt", "p/t", None, "virtual-hosted")),
        (
            "https://bkt.s3.dualstack.eu-central-1.amazonaws.com/p",
            S3Location("bkt", "p", "eu-central-1", "virtual-hosted"),
        ),
        (
            "https://s3.eu-west-3.amazonaws.com/bkt/prefix/table0",
            S3Location("bkt", "prefix/table0", "eu-west-3", "path"),
        ),
        ("https://s3.amazonaws.com/bkt/t0", S3Location("bkt", "t0", None, "path")),
        (
            "https://s3.cn-north-1.amazonaws.com.cn/bkt/a%20b/t0",
            S3Location("bkt", "a b/t0", "cn-north-1", "path"),
        ),
    ],
)
def test_parse_s3_uri(uri: str, expected: S3Location) -> None:
    assert parse_s3_uri(uri) == expected


@pytest.mark.parametrize(
    "uri",
    [
        "s3:///no-bucket",
        "https://s3.eu-west-3.amazonaws.com/",
        "https://ec2.eu-west-3.amazonaws.com/bkt/x",
        "https://bkt.s3-accelerate.amazonaws.com/x",
        "https://bkt.s3.eu-west-3.amazonaws.com/x?versionId=3",
        "https://example.com/bkt/x",
    ],
)
def test_parse_s3_uri_rejects(uri: str) -> None:
    with pytest.raises(SourceError, match="s3://bucket/prefix"):
        parse_s3_uri(uri)


def test_location_key_joins_prefix() -> None:
    assert parse_s3_uri("s3://b/p/t0").key("key") == "p/t0/key"
    assert parse_s3_uri("s3://b").key("emb_vector") == "emb_vector"


def test_missing_boto3_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(MissingExtraError, match=r"hps-server\[s3\]") as info:
        open_source("s3://bkt/prefix/table0")
    assert info.value.extra == "s3"


# -- reading over HTTP -------------------------------------------------------------------


def _opts(server: S3Server, **kw: Any) -> SourceOptions:
    return SourceOptions(s3_endpoint=server.endpoint, **kw)


def _read_all(reader: SparseModelReader) -> tuple[np.ndarray, np.ndarray]:
    parts = list(reader.chunks())
    return np.concatenate([k for k, _ in parts]), np.concatenate([v for _, v in parts])


@pytest.mark.parametrize("form", ["s3", "virtual-hosted", "path"])
def test_all_uri_forms_read_the_model(
    s3_server: S3Server, model_arrays: tuple[np.ndarray, np.ndarray], form: str
) -> None:
    keys, vectors = model_arrays
    region = "eu-west-3"
    bucket = s3_server.new_bucket(region)
    s3_server.put_model(bucket, "prefix/table0", keys, vectors)
    uri = {
        "s3": f"s3://{bucket}/prefix/table0",
        # amazonaws.com hosts: parsed for bucket/key/region, sent to moto by the override
        "virtual-hosted": f"https://{bucket}.s3.{region}.amazonaws.com/prefix/table0",
        "path": f"https://s3.{region}.amazonaws.com/{bucket}/prefix/table0",
    }[form]
    with open_source(uri, _opts(s3_server, s3_region=region)) as source:
        assert isinstance(source, S3Source)
        assert source.location.bucket == bucket
        assert source.location.prefix == "prefix/table0"
        assert source.location.style == form
        assert source.location.region == (None if form == "s3" else region)
        assert source.region == region
        assert source.client.meta.region_name == region
        assert source.endpoint == s3_server.endpoint
        assert source.client.meta.endpoint_url == s3_server.endpoint
        reader = SparseModelReader(source, 8)
        assert reader.num_keys == keys.size
        got_keys, got_vectors = _read_all(reader)
    np.testing.assert_array_equal(got_keys, keys)
    np.testing.assert_array_equal(got_vectors, vectors)


def test_url_region_wins_over_option(s3_server: S3Server) -> None:
    uri = "https://bkt.s3.ap-south-1.amazonaws.com/p"
    with open_source(uri, _opts(s3_server, s3_region="eu-west-1")) as source:
        assert isinstance(source, S3Source)
        assert source.region == "ap-south-1"


def test_bare_s3_uri_needs_no_region(
    s3_server: S3Server,
    model_arrays: tuple[np.ndarray, np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, vectors = model_arrays
    bucket = s3_server.new_bucket()
    s3_server.put_model(bucket, "t0", keys, vectors)
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    monkeypatch.delenv("AWS_REGION", raising=False)
    with open_source(f"s3://{bucket}/t0", _opts(s3_server)) as source:
        assert isinstance(source, S3Source)
        assert source.region == "us-east-1"  # nothing in the chain: the fallback
        np.testing.assert_array_equal(SparseModelReader(source, 8).read_keys(0, 300), keys)
    monkeypatch.setenv("AWS_REGION", "ca-central-1")
    with open_source(f"s3://{bucket}/t0", _opts(s3_server)) as source:
        assert isinstance(source, S3Source)
        assert source.region == "ca-central-1"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-north-1")  # boto3's own chain first
    with open_source(f"s3://{bucket}/t0", _opts(s3_server)) as source:
        assert isinstance(source, S3Source)
        assert source.region == "eu-north-1"
        assert source.size("key") == keys.nbytes


def test_endpoint_from_environment(
    s3_server: S3Server,
    model_arrays: tuple[np.ndarray, np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, vectors = model_arrays
    bucket = s3_server.new_bucket()
    s3_server.put_model(bucket, "t0", keys, vectors)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # loses to the S3-specific one
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    with open_source(f"s3://{bucket}/t0") as source:
        assert isinstance(source, S3Source)
        assert source.endpoint == s3_server.endpoint
        assert source.size("key") == keys.nbytes
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    with open_source(f"s3://{bucket}/t0") as source:
        assert isinstance(source, S3Source)
        assert source.size("emb_vector") == vectors.nbytes
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the option wins
    with open_source(f"s3://{bucket}/t0", _opts(s3_server)) as source:
        assert source.size("key") == keys.nbytes


def test_chunked_read_of_a_model_many_chunks_large(s3_server: S3Server) -> None:
    rng = np.random.default_rng()
    n, dim = 40_000, 16  # 2.56 MB of vectors
    keys = rng.choice(np.int64(2**40), size=n, replace=False)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    bucket = s3_server.new_bucket()
    s3_server.put_model(bucket, "big/t0", keys, vectors)
    ranges: list[str] = []

    def record(params: dict[str, Any], **_: Any) -> None:
        ranges.append(params["headers"]["Range"])

    opts = _opts(s3_server, part_bytes=96 << 10, max_concurrency=4)
    with open_source(f"s3://{bucket}/big/t0", opts) as source:
        assert isinstance(source, S3Source)
        source.client.meta.events.register("before-call.s3.GetObject", record)
        reader = SparseModelReader(source, dim, chunk_bytes=256 << 10)
        chunks = list(reader.chunks())
    assert len(chunks) >= 8  # the model is several times the chunk size
    assert max(k.size for k, _ in chunks) * dim * 4 <= 256 << 10
    np.testing.assert_array_equal(np.concatenate([k for k, _ in chunks]), keys)
    np.testing.assert_array_equal(np.concatenate([v for _, v in chunks]), vectors)
    # every GET was a ranged GET no larger than a part, and the parts tile the files
    spans = [tuple(map(int, r.removeprefix("bytes=").split("-"))) for r in ranges]
    assert all(hi - lo + 1 <= 96 << 10 for lo, hi in spans)
    assert sum(hi - lo + 1 for lo, hi in spans) == keys.nbytes + vectors.nbytes


def test_read_returns_exact_bytes_or_raises(s3_server: S3Server) -> None:
    bucket = s3_server.new_bucket()
    payload = bytes(range(256)) * 40
    s3_server.client().put_object(Bucket=bucket, Key="t/blob", Body=payload)
    with open_source(f"s3://{bucket}/t", _opts(s3_server, part_bytes=1000)) as source:
        assert source.read("blob", 0, 0) == b""
        assert source.read("blob", 10, 5) == payload[10:15]
        data = source.read("blob", 123, 5000)  # six parts
        assert isinstance(data, bytes) and data == payload[123:5123]
        with pytest.raises(SourceError, match=rf"s3://{bucket}/t/blob: expected 100 bytes"):
            source.read("blob", len(payload) - 50, 100)  # runs past the end
        with pytest.raises(SourceError, match="past the end"):
            source.read("blob", len(payload) + 10, 100)


def test_object_replaced_between_size_and_read(s3_server: S3Server) -> None:
    bucket = s3_server.new_bucket()
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="t/emb_vector", Body=b"a" * 64)
    with open_source(f"s3://{bucket}/t", _opts(s3_server)) as source:
        assert source.size("emb_vector") == 64
        client.put_object(Bucket=bucket, Key="t/emb_vector", Body=b"b" * 64)
        with pytest.raises(SourceError, match="changed while it was being read"):
            source.read("emb_vector", 0, 64)


# -- errors --------------------------------------------------------------------------------


def test_missing_object(s3_server: S3Server, model_arrays: tuple[np.ndarray, np.ndarray]) -> None:
    keys, _ = model_arrays
    bucket = s3_server.new_bucket()
    s3_server.client().put_object(Bucket=bucket, Key="t0/key", Body=keys.tobytes())
    uri = f"s3://{bucket}/t0"
    with open_source(uri, _opts(s3_server)) as source:
        with pytest.raises(SourceNotFoundError) as info:
            source.size("emb_vector")
        assert f"{uri}/emb_vector does not exist" in str(info.value)
        assert not source.exists("emb_vector") and source.exists("key")
        with pytest.raises(SourceNotFoundError, match=f"{uri}/emb_vector"):
            source.read("emb_vector", 0, 8)
    with pytest.raises(ModelFileError, match="no 'emb_vector' file"):
        SparseModelReader(uri, 8, options=_opts(s3_server))


def test_missing_bucket(s3_server: S3Server) -> None:
    uri = "https://no-such-bucket-hps.s3.us-east-1.amazonaws.com/m/t0"
    with open_source(uri, _opts(s3_server)) as source:
        with pytest.raises(SourceNotFoundError) as info:
            source.size("key")
    assert str(info.value) == f"{uri}/key: S3 bucket 'no-such-bucket-hps' does not exist"


def test_truncated_emb_vector(
    s3_server: S3Server, model_arrays: tuple[np.ndarray, np.ndarray]
) -> None:
    keys, vectors = model_arrays
    bucket = s3_server.new_bucket()
    s3_server.put_model(bucket, "t0", keys, vectors)
    blob = vectors.astype("<f4").tobytes()
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="t0/emb_vector", Body=blob[:-6])  # mid-float
    with pytest.raises(ModelFileError, match="not a multiple of 4"):
        SparseModelReader(f"s3://{bucket}/t0", 8, options=_opts(s3_server))
    client.put_object(Bucket=bucket, Key="t0/emb_vector", Body=blob[: -8 * 4 * 3])  # 3 rows short
    with pytest.raises(ModelFileError, match=r"emb_vector is 9504 bytes but 300 keys"):
        SparseModelReader(f"s3://{bucket}/t0", 8, options=_opts(s3_server))


def test_key_vector_size_mismatch(
    s3_server: S3Server, model_arrays: tuple[np.ndarray, np.ndarray]
) -> None:
    keys, vectors = model_arrays
    bucket = s3_server.new_bucket()
    s3_server.put_model(bucket, "t0", keys, vectors)
    with pytest.raises(ModelFileError, match=r"width 16 .* holds 8 floats per key"):
        SparseModelReader(f"s3://{bucket}/t0", 16, options=_opts(s3_server))
    assert SparseModelReader(f"s3://{bucket}/t0", None, options=_opts(s3_server)).vec_size == 8


@pytest.fixture
def iam_users(s3_server: S3Server) -> dict[str, dict[str, str]]:
    """Two IAM users in moto: 'reader' may read S3, 'nobody' has no policy."""
    import boto3

    iam = boto3.client("iam", endpoint_url=s3_server.endpoint, region_name="us-east-1")
    users = {}
    for role in ("reader", "nobody"):
        name = f"hps-{role}-{time.monotonic_ns()}"
        iam.create_user(UserName=name)
        users[role] = iam.create_access_key(UserName=name)["AccessKey"]
        if role == "reader":
            policy = {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
            }
            iam.put_user_policy(UserName=name, PolicyName="read", PolicyDocument=json.dumps(policy))
    return users


@pytest.mark.parametrize(
    ("who", "code"),
    [
        ("unknown-key", "InvalidAccessKeyId"),
        ("wrong-secret", "SignatureDoesNotMatch"),
        ("nobody", "AccessDenied"),
    ],
)
def test_credential_errors(
    s3_server: S3Server,
    model_arrays: tuple[np.ndarray, np.ndarray],
    iam_users: dict[str, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
    who: str,
    code: str,
) -> None:
    keys, vectors = model_arrays
    bucket = s3_server.new_bucket()
    s3_server.put_model(bucket, "t0", keys, vectors)
    uri = f"s3://{bucket}/t0"
    creds = {
        "unknown-key": ("AKIAEXAMPLEUNKNOWN00", "whatever"),
        "wrong-secret": (iam_users["reader"]["AccessKeyId"], "not-the-secret"),
        "nobody": (iam_users["nobody"]["AccessKeyId"], iam_users["nobody"]["SecretAccessKey"]),
    }[who]
    reader_creds = (iam_users["reader"]["AccessKeyId"], iam_users["reader"]["SecretAccessKey"])
    with s3_server.enforced_auth():
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", creds[0])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", creds[1])
        with open_source(uri, _opts(s3_server)) as source:
            with pytest.raises(SourceAccessError) as info:
                source.size("key")
            assert str(info.value).startswith(f"{uri}/key: access denied by S3: {code}")
            with pytest.raises(SourceAccessError, match=code):
                source.read("emb_vector", 0, 32)
        # the same server, the same moment, a user allowed to read: auth is really on
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", reader_creds[0])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", reader_creds[1])
        with open_source(uri, _opts(s3_server)) as source:
            assert source.size("key") == keys.nbytes


def test_no_credentials(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    uri = "s3://any-bucket/t0"
    with open_source(uri, _opts(s3_server)) as source:
        with pytest.raises(SourceAccessError, match=rf"{uri}/key: no AWS credentials found"):
            source.size("key")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_unreachable_endpoint_fails_fast(s3_server: S3Server) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    uri = "s3://bkt/t0"
    sent: list[str] = []
    start = time.monotonic()
    with open_source(uri, SourceOptions(s3_endpoint=endpoint)) as source:
        assert isinstance(source, S3Source)
        source.client.meta.events.register("before-send.s3", lambda **kw: sent.append("x"))
        with pytest.raises(SourceUnreachableError) as info:
            source.size("key")
        assert len(sent) == 2  # connect_attempts, not botocore's max_attempts (5)
        with pytest.raises(SourceUnreachableError):
            source.read("key", 0, 8)
    elapsed = time.monotonic() - start
    assert f"{uri}/key: cannot connect to endpoint {endpoint} after 2 attempt(s)" in str(info.value)
    assert elapsed < 5, f"took {elapsed:.1f}s"


def test_closed_source_refuses_reads(s3_server: S3Server) -> None:
    source = open_source("s3://bkt/t0", _opts(s3_server))
    source.close()
    source.close()  # idempotent
    with pytest.raises(SourceError, match="closed"):
        source.read("key", 0, 8)


def test_profile_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(SourceAccessError, match="no-such-profile.*check AWS_PROFILE"):
        open_source("s3://bkt/t0")


def test_unclosed_source_gives_no_resource_warning(s3_server: S3Server) -> None:
    bucket = s3_server.new_bucket()
    s3_server.client().put_object(Bucket=bucket, Key="t/blob", Body=bytes(5000))
    source = open_source(f"s3://{bucket}/t", _opts(s3_server, part_bytes=1000))
    assert source.read("blob", 0, 5000) == bytes(5000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del source
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


class CuttingProxy:
    """A TCP proxy to the S3 server that breaks off the next `cuts` long responses mid-body."""

    def __init__(self, upstream: str, cut_after: int = 4000) -> None:
        parsed = upstream.removeprefix("http://").split(":")
        self.upstream = (parsed[0], int(parsed[1]))
        self.cut_after = cut_after
        self.cuts = 0
        self.cut_done = 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            self._spawn(self._pump, client, upstream, False)
            self._spawn(self._pump, upstream, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, is_response: bool) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if is_response:
                    with self.lock:
                        cut = self.cuts > 0 and sent + len(data) > self.cut_after
                        if cut:
                            self.cuts -= 1
                            self.cut_done += 1
                    if cut:
                        dst.sendall(data[: self.cut_after - sent])
                        break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def close(self) -> None:
        self.listener.close()


def test_response_cut_mid_body_is_retried(s3_server: S3Server) -> None:
    bucket = s3_server.new_bucket()
    payload = np.random.default_rng().bytes(300_000)
    s3_server.client().put_object(Bucket=bucket, Key="t/blob", Body=payload)
    proxy = CuttingProxy(s3_server.endpoint)
    try:
        opts = SourceOptions(s3_endpoint=proxy.endpoint, part_bytes=100_000, max_concurrency=1)
        with open_source(f"s3://{bucket}/t", opts) as source:
            assert source.size("blob") == len(payload)
            proxy.cuts = 2
            assert source.read("blob", 0, len(payload)) == payload
            assert proxy.cut_done == 2
            proxy.cuts = 100  # every response cut: the error says so after max_attempts
            with pytest.raises(SourceError, match=r"s3://.*/t/blob: .*(IncompleteRead|Stream)"):
                source.read("blob", 0, 100_000)
    finally:
        proxy.close()
