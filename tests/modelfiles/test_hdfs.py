"""HDFS model sources: URI parsing, WebHDFS against a local REST server, hdfs-native errors.

There is no namenode here. The WebHDFS route is exercised against `FakeWebHdfs`, a small
HTTP server in this file speaking the subset of the WebHDFS REST API the reader uses
(GETFILESTATUS; OPEN with offset/length answered by a 307 redirect to a "datanode" URL;
RemoteException JSON errors). The hdfs-native route is exercised only up to its
connection: a closed port must give SourceUnreachableError quickly.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

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
from hps.modelfiles.hdfs import HdfsLocation, HdfsSource, WebHdfsSource, parse_hdfs_uri
from hps.modelfiles.uri import SourceOptions, open_source

# -- a WebHDFS server --------------------------------------------------------------------


class FakeWebHdfs:
    """The WebHDFS REST subset: GETFILESTATUS, LISTSTATUS, OPEN (via a datanode redirect),
    errors."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {"/"}
        self.forbidden: set[str] = set()
        self.kerberos = False
        self.fail_next = 0  # answer this many requests with HTTP 500 first
        self.short_reads = False  # datanode sends fewer bytes than asked
        self.datanode_host = "127.0.0.1"  # where OPEN redirects to
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                fake.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def put(self, path: str, data: bytes) -> None:
        self.files[path] = data
        parent = path.rsplit("/", 1)[0]
        while parent:
            self.dirs.add(parent)
            parent = parent.rsplit("/", 1)[0]

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: bytes, **headers: str) -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            h.send_header(name, value)
        h.end_headers()
        h.wfile.write(body)

    def _remote(self, h: BaseHTTPRequestHandler, status: int, exc: str, msg: str) -> None:
        body = {"RemoteException": {"exception": exc, "javaClassName": f"x.{exc}", "message": msg}}
        self._send(h, status, json.dumps(body).encode(), **{"Content-Type": "application/json"})

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        url = urlparse(h.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        datanode = url.path.startswith("/datanode")
        path = url.path.removeprefix("/datanode").removeprefix("/webhdfs/v1")
        with self.lock:
            self.requests.append((("DN " if datanode else "NN ") + path, query))
            failing = self.fail_next > 0
            self.fail_next -= failing
        if failing:
            return self._remote(h, 500, "RetriableException", "try again")
        if not url.path.startswith(("/webhdfs/v1/", "/datanode/webhdfs/v1/")):
            return self._send(h, 404, b"not webhdfs")
        if self.kerberos:
            return self._send(h, 401, b"", **{"WWW-Authenticate": "Negotiate"})
        if path in self.forbidden:
            return self._remote(
                h, 403, "AccessControlException", f"Permission denied: user=hps, path={path}"
            )
        op = query.get("op")
        if path not in self.files and path not in self.dirs:
            return self._remote(h, 404, "FileNotFoundException", f"File does not exist: {path}")
        if op == "GETFILESTATUS":
            is_dir = path in self.dirs
            status = {
                "length": 0 if is_dir else len(self.files[path]),
                "type": "DIRECTORY" if is_dir else "FILE",
                "pathSuffix": "",
            }
            return self._send(h, 200, json.dumps({"FileStatus": status}).encode())
        if op == "LISTSTATUS" and path in self.dirs:
            entries = [
                {"pathSuffix": name.rsplit("/", 1)[1], "type": kind, "length": 0}
                for kind, names in (("FILE", self.files), ("DIRECTORY", self.dirs))
                for name in names
                if name.rsplit("/", 1)[0] == path and name != path
            ]
            body = json.dumps({"FileStatuses": {"FileStatus": entries}})
            return self._send(h, 200, body.encode())
        if op == "OPEN" and path in self.files:
            if not datanode:  # what a NameNode does: send the client to a DataNode
                location = f"http://{self.datanode_host}:{self.port}/datanode{h.path}"
                return self._send(h, 307, b"", Location=location)
            data = self.files[path]
            offset = int(query.get("offset", 0))
            length = int(query.get("length", len(data) - offset))
            chunk = data[offset : offset + length]
            if self.short_reads:
                chunk = chunk[: len(chunk) // 2]
            return self._send(h, 200, chunk, **{"Content-Type": "application/octet-stream"})
        return self._remote(h, 400, "IllegalArgumentException", f"bad op {op} for {path}")

    def ops(self, prefix: str = "") -> list[tuple[str, dict[str, str]]]:
        with self.lock:
            return [r for r in self.requests if r[0].startswith(prefix)]


@pytest.fixture
def webhdfs() -> Iterator[FakeWebHdfs]:
    fake = FakeWebHdfs()
    fake.thread.start()
    try:
        yield fake
    finally:
        fake.server.shutdown()
        fake.server.server_close()
        fake.thread.join(5)


def _put_model(fake: FakeWebHdfs, folder: str, keys: np.ndarray, vectors: np.ndarray) -> None:
    fake.put(f"{folder}/key", keys.astype("<i8").tobytes())
    fake.put(f"{folder}/emb_vector", vectors.astype("<f4").tobytes())


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- URI parsing -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("hdfs://nn:8020/models/m/t0", HdfsLocation("hdfs", "nn", 8020, "/models/m/t0")),
        ("hdfs://nn:8020/models/m/t0/", HdfsLocation("hdfs", "nn", 8020, "/models/m/t0")),
        ("hdfs://nameservice1/m/t0", HdfsLocation("hdfs", "nameservice1", None, "/m/t0")),
        ("hdfs:///m/t0", HdfsLocation("hdfs", "", None, "/m/t0")),
        ("viewfs://cluster/m//t0", HdfsLocation("viewfs", "cluster", None, "/m/t0")),
        ("webhdfs://nn:9870/m/t0", HdfsLocation("webhdfs", "nn", 9870, "/m/t0")),
        ("swebhdfs://nn/m/t0", HdfsLocation("swebhdfs", "nn", None, "/m/t0")),
    ],
)
def test_parse_hdfs_uri(uri: str, expected: HdfsLocation) -> None:
    assert parse_hdfs_uri(uri) == expected


def test_location_file_paths() -> None:
    loc = parse_hdfs_uri("hdfs://nn:8020/models/m/t0")
    assert loc.file("emb_vector") == "/models/m/t0/emb_vector"
    assert loc.authority == "nn:8020"


@pytest.mark.parametrize(
    "uri", ["hdfs://nn:80x0/m", "webhdfs:///m/t0", "hdfs://nn:8020/m?x=1", "gs://b/m"]
)
def test_parse_hdfs_uri_rejects(uri: str) -> None:
    with pytest.raises(SourceError, match="HDFS URI"):
        parse_hdfs_uri(uri)


def test_open_source_dispatch() -> None:
    with open_source("webhdfs://127.0.0.1:1/m/t0") as web:
        assert isinstance(web, WebHdfsSource)
        assert web.base_url == "http://127.0.0.1:1"
    with open_source("swebhdfs://nn/m/t0") as secure:
        assert isinstance(secure, WebHdfsSource)
        assert secure.base_url == "https://nn:9870"
    with open_source("hdfs://127.0.0.1:1/m/t0") as native:
        assert isinstance(native, HdfsSource)


def test_missing_hdfs_native_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hdfs_native", None)
    with pytest.raises(MissingExtraError, match=r"hps-server\[hdfs\]") as info:
        open_source("hdfs://nn:8020/m/t0")
    assert info.value.extra == "hdfs"
    with open_source("webhdfs://nn:9870/m/t0") as web:  # needs nothing beyond the stdlib
        assert isinstance(web, WebHdfsSource)


# -- hdfs-native ---------------------------------------------------------------------------


def test_hdfs_native_unreachable_namenode_fails_fast() -> None:
    uri = f"hdfs://127.0.0.1:{_closed_port()}/models/m/t0"
    start = time.monotonic()
    with open_source(uri) as source:
        with pytest.raises(SourceUnreachableError) as info:
            source.size("key")
        with pytest.raises(SourceUnreachableError):
            source.read("emb_vector", 0, 64)
        with pytest.raises(SourceUnreachableError):  # not disguised as a model-file error
            SparseModelReader(source, 8)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert message.startswith(f"{uri}/key: cannot reach namenode/datanode 127.0.0.1:")
    assert "after 2 attempt(s)" in message and "refused" in message.lower()
    assert elapsed < 5, f"took {elapsed:.1f}s"


# -- WebHDFS -------------------------------------------------------------------------------


def test_webhdfs_reads_the_model_in_parallel_parts(webhdfs: FakeWebHdfs) -> None:
    rng = np.random.default_rng()
    n, dim = 5_000, 16
    keys = rng.choice(np.int64(2**40), size=n, replace=False)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    _put_model(webhdfs, "/models/m/t0", keys, vectors)
    opts = SourceOptions(part_bytes=32 << 10, max_concurrency=4, hdfs_user="alice")
    uri = f"webhdfs://127.0.0.1:{webhdfs.port}/models/m/t0"
    with open_source(uri, opts) as source:
        reader = SparseModelReader(source, dim, chunk_bytes=64 << 10)
        chunks = list(reader.chunks())
    assert len(chunks) >= 5
    np.testing.assert_array_equal(np.concatenate([k for k, _ in chunks]), keys)
    np.testing.assert_array_equal(np.concatenate([v for _, v in chunks]), vectors)
    opens = webhdfs.ops("DN ")
    assert opens and all(q["op"] == "OPEN" for _, q in opens)
    assert all(int(q["length"]) <= 32 << 10 for _, q in opens)
    assert sum(int(q["length"]) for _, q in opens) == keys.nbytes + vectors.nbytes
    assert all(q.get("user.name") == "alice" for _, q in webhdfs.ops())
    stats = [p for p, q in webhdfs.ops("NN ") if q["op"] == "GETFILESTATUS"]
    assert sorted(stats) == ["NN /models/m/t0/emb_vector", "NN /models/m/t0/key"]


def test_webhdfs_parquet_folder_of_parts(webhdfs: FakeWebHdfs) -> None:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from hps.modelfiles.formats import open_model

    rng = np.random.default_rng()
    keys = rng.choice(np.int64(2**40), size=3000, replace=False)
    vectors = rng.standard_normal((3000, 8)).astype(np.float32)
    for i in range(3):
        part = slice(i * 1000, (i + 1) * 1000)
        column = pa.FixedSizeListArray.from_arrays(pa.array(vectors[part].reshape(-1)), 8)
        out = io.BytesIO()
        pq.write_table(pa.table({"key": keys[part], "vector": column}), out)
        webhdfs.put(f"/lake/items/part-{i}.parquet", out.getvalue())
    webhdfs.put("/lake/items/_SUCCESS", b"")
    webhdfs.put("/lake/items/sub/other.parquet", b"not a part of this table")
    with open_model(f"webhdfs://127.0.0.1:{webhdfs.port}/lake/items") as reader:
        assert (reader.format, reader.num_keys) == ("parquet", 3000)
        assert [name for name, _ in reader.files] == [f"part-{i}.parquet" for i in range(3)]
        chunks = list(reader.chunks(700))
    np.testing.assert_array_equal(np.concatenate([k for k, _ in chunks]), keys)
    np.testing.assert_array_equal(np.concatenate([v for _, v in chunks]), vectors)
    assert [p for p, q in webhdfs.ops("NN ") if q["op"] == "LISTSTATUS"] == ["NN /lake/items"]


def test_webhdfs_user_from_environment(
    webhdfs: FakeWebHdfs, monkeypatch: pytest.MonkeyPatch
) -> None:
    webhdfs.put("/t/key", b"\0" * 16)
    monkeypatch.setenv("HADOOP_USER_NAME", "bob")
    with open_source(f"webhdfs://127.0.0.1:{webhdfs.port}/t") as source:
        assert source.size("key") == 16
    monkeypatch.delenv("HADOOP_USER_NAME")
    with open_source(f"webhdfs://127.0.0.1:{webhdfs.port}/t") as source:
        assert source.read("key", 4, 8) == b"\0" * 8
    users = [q.get("user.name") for _, q in webhdfs.ops()]
    assert users == ["bob", None, None]  # OPEN: namenode, then datanode


def test_webhdfs_missing_file(webhdfs: FakeWebHdfs) -> None:
    webhdfs.put("/m/t0/key", b"\0" * 80)
    uri = f"webhdfs://127.0.0.1:{webhdfs.port}/m/t0"
    with open_source(uri) as source:
        with pytest.raises(SourceNotFoundError) as info:
            source.size("emb_vector")
        assert not source.exists("emb_vector") and source.exists("key")
        with pytest.raises(SourceNotFoundError):
            source.read("emb_vector", 0, 4)
    assert str(info.value) == (
        f"{uri}/emb_vector does not exist (FileNotFoundException)"
    )
    with pytest.raises(ModelFileError, match="no 'emb_vector' file"):
        SparseModelReader(uri, 10)


def test_webhdfs_access_denied(webhdfs: FakeWebHdfs) -> None:
    webhdfs.put("/m/t0/key", b"\0" * 8)
    webhdfs.forbidden.add("/m/t0/key")
    uri = f"webhdfs://127.0.0.1:{webhdfs.port}/m/t0"
    with open_source(uri) as source:
        with pytest.raises(
            SourceAccessError,
            match=rf"{uri}/key: access denied by HDFS \(AccessControlException\)",
        ):
            source.size("key")
    webhdfs.forbidden.clear()
    webhdfs.kerberos = True
    with open_source(uri) as source:
        with pytest.raises(SourceAccessError, match="for Kerberos use hdfs://"):
            source.size("key")


def test_webhdfs_directory_and_truncation(webhdfs: FakeWebHdfs) -> None:
    keys = np.arange(10, dtype=np.int64)
    vectors = np.ones((10, 4), np.float32)
    _put_model(webhdfs, "/m/t0", keys, vectors)
    webhdfs.put("/m/t0/emb_vector", vectors.tobytes()[:-4])
    uri = f"webhdfs://127.0.0.1:{webhdfs.port}/m"
    with open_source(uri) as source:
        with pytest.raises(SourceError, match="/m/t0 is a directory"):
            source.size("t0")
    with pytest.raises(ModelFileError, match="emb_vector is 156 bytes but 10 keys"):
        SparseModelReader(f"{uri}/t0", 4)
    with pytest.raises(ModelFileError, match="holds 4 floats per key"):
        webhdfs.put("/m/t0/emb_vector", vectors.tobytes())
        SparseModelReader(f"{uri}/t0", 2)


def test_webhdfs_short_read_is_an_error(webhdfs: FakeWebHdfs) -> None:
    webhdfs.put("/t/blob", bytes(range(200)))
    webhdfs.short_reads = True
    with open_source(f"webhdfs://127.0.0.1:{webhdfs.port}/t") as source:
        with pytest.raises(SourceError, match="/t/blob: expected 100 bytes at offset 10, got 50"):
            source.read("blob", 10, 100)


def test_webhdfs_retries_server_errors(webhdfs: FakeWebHdfs) -> None:
    webhdfs.put("/t/blob", bytes(range(200)))
    webhdfs.fail_next = 2
    with open_source(f"webhdfs://127.0.0.1:{webhdfs.port}/t") as source:
        assert source.read("blob", 0, 200) == bytes(range(200))
    webhdfs.fail_next = 100
    with open_source(f"webhdfs://127.0.0.1:{webhdfs.port}/t", SourceOptions(max_attempts=3)) as s:
        with pytest.raises(SourceError, match="WebHDFS failed 3 times, last: HTTP 500"):
            s.size("blob")


def test_webhdfs_unreachable_fails_fast() -> None:
    uri = f"webhdfs://127.0.0.1:{_closed_port()}/m/t0"
    start = time.monotonic()
    with open_source(uri) as source:
        with pytest.raises(SourceUnreachableError) as info:
            source.size("key")
    assert time.monotonic() - start < 3
    assert str(info.value).startswith(f"{uri}/key: cannot connect to WebHDFS at 127.0.0.1:")
    assert "after 2 attempt(s)" in str(info.value)


def test_webhdfs_endpoint_that_is_not_webhdfs(webhdfs: FakeWebHdfs) -> None:
    with open_source(f"webhdfs://127.0.0.1:{webhdfs.port}/m/t0") as source:
        webhdfs.files["/m/t0/key"] = b""
        source.base_url += "/elsewhere"  # requests miss the /webhdfs/v1 tree: a plain 404
        with pytest.raises(SourceError, match="without a WebHDFS RemoteException") as info:
            source.size("key")
    assert not isinstance(info.value, SourceNotFoundError)


def test_webhdfs_errors_never_carry_what_the_server_wrote(webhdfs: FakeWebHdfs) -> None:
    """A RemoteException's message is the remote host's text: errors name only its Java
    exception class, so a reload's error answer cannot relay what a server wrote."""
    webhdfs.put("/m/t0/key", b"\0" * 8)
    webhdfs.forbidden.add("/m/t0/key")
    with open_source(f"webhdfs://127.0.0.1:{webhdfs.port}/m/t0") as source:
        with pytest.raises(SourceAccessError) as info:
            source.size("key")
    assert "AccessControlException" in str(info.value)
    assert "Permission denied" not in str(info.value) and "user=hps" not in str(info.value)


def test_webhdfs_redirects_only_to_allowed_hosts(webhdfs: FakeWebHdfs) -> None:
    """OPEN redirects to a DataNode: followed to the namenode's own host or a host in
    redirect_hosts, refused elsewhere (a server must not fetch what a redirect names)."""
    keys = np.arange(10, dtype=np.int64)
    _put_model(webhdfs, "/m/t0", keys, np.ones((10, 2), np.float32))
    uri = f"webhdfs://127.0.0.1:{webhdfs.port}/m/t0"
    webhdfs.datanode_host = "127.0.0.2"  # another host (of the loopback net)
    with open_source(uri) as source:
        with pytest.raises(SourceError, match="neither its own nor in source_redirect_hosts"
                           ) as info:
            source.read("key", 0, 80)
    assert "127.0.0.2" not in str(info.value)
    assert webhdfs.ops("DN") == []  # nothing was fetched from the other host
    allowed = SourceOptions(redirect_hosts=frozenset({"127.0.0.2"}))
    with open_source(uri, allowed) as source:  # followed: the fake listens on 127.0.0.1
        with pytest.raises(SourceUnreachableError, match="127.0.0.2"):  # only
            source.read("key", 0, 80)
