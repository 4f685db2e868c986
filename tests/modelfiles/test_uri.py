"""Model URIs: scheme dispatch, unsupported forms, local files, the remote-read machinery."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import numpy as np
import pytest

from hps.errors import SourceError, SourceNotFoundError
from hps.modelfiles.uri import (
    LocalSource,
    ModelSource,
    RemoteSource,
    SourceOptions,
    open_source,
    s3_endpoint,
    scheme_of,
)


@pytest.mark.parametrize(
    ("uri", "scheme"),
    [
        ("/models/m/t0", "local"),
        ("models/m/t0", "local"),
        ("file:///models/m/t0", "local"),
        ("s3://bkt/m/t0", "s3"),
        ("https://bkt.s3.eu-west-3.amazonaws.com/m/t0", "s3"),
        ("https://s3.eu-west-3.amazonaws.com/bkt/m/t0", "s3"),
        ("https://S3.EU-WEST-3.AMAZONAWS.COM/bkt/m/t0", "s3"),
        ("https://s3.cn-north-1.amazonaws.com.cn/bkt/m", "s3"),
        ("hdfs://nn:8020/m/t0", "hdfs"),
        ("viewfs://cluster/m/t0", "hdfs"),
        ("webhdfs://nn:9870/m/t0", "webhdfs"),
        ("swebhdfs://nn:9871/m/t0", "webhdfs"),
        ("https://minio.local:9000/bkt/m", "https"),
        ("gs://bkt/m", "gs"),
    ],
)
def test_scheme_of(uri: str, scheme: str) -> None:
    assert scheme_of(uri) == scheme


@pytest.mark.parametrize(
    "uri", ["gs://bkt/m/t0", "ftp://host/m/t0", "https://minio.local:9000/bkt/m/t0"]
)
def test_unsupported_scheme_names_the_supported_forms(uri: str) -> None:
    with pytest.raises(SourceError) as info:
        open_source(uri)
    message = str(info.value)
    assert f"unsupported model URI {uri!r}" in message
    for form in ("s3://bucket/prefix", "amazonaws.com", "hdfs://namenode:port/path", "webhdfs://"):
        assert form in message
    if uri.startswith("https"):
        assert "s3_endpoint" in message and "AWS_ENDPOINT_URL" in message


def test_open_source_types() -> None:
    assert isinstance(open_source("/m/t0"), LocalSource)
    with open_source("s3://bkt/m/t0", SourceOptions(s3_endpoint="http://127.0.0.1:1")) as s3:
        assert type(s3).__name__ == "S3Source"
    with open_source("webhdfs://nn:9870/m/t0") as web:
        assert type(web).__name__ == "WebHdfsSource"
    with open_source("hdfs://nn:8020/m/t0") as native:
        assert type(native).__name__ == "HdfsSource"


def test_s3_endpoint_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    assert s3_endpoint(None) is None
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://generic:9000")
    assert s3_endpoint(SourceOptions()) == "http://generic:9000"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3only:9000")
    assert s3_endpoint(SourceOptions()) == "http://s3only:9000"
    assert s3_endpoint(SourceOptions(s3_endpoint="http://option:9000")) == "http://option:9000"


@pytest.mark.parametrize(
    "bad",
    [
        {"part_bytes": 0},
        {"max_concurrency": 0},
        {"max_attempts": 0},
        {"connect_attempts": 0},
        {"connect_timeout": 0.0},
        {"read_timeout": -1.0},
    ],
)
def test_source_options_validation(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=f"SourceOptions.{next(iter(bad))}"):
        SourceOptions(**bad)  # type: ignore[arg-type]


# -- local ---------------------------------------------------------------------------------


def test_local_source(tmp_path: Path) -> None:
    (tmp_path / "key").write_bytes(bytes(range(64)))
    for uri in (str(tmp_path), f"file://{tmp_path}"):
        with open_source(uri) as source:
            assert source.size("key") == 64
            assert source.read("key", 8, 16) == bytes(range(8, 24))
            assert source.exists("key") and not source.exists("emb_vector")
            with pytest.raises(SourceNotFoundError, match="emb_vector"):
                source.size("emb_vector")
            with pytest.raises(SourceError, match="expected 16 bytes at offset 56, got 8"):
                source.read("key", 56, 16)
    with pytest.raises(SourceNotFoundError, match="model folder .* does not exist"):
        LocalSource(str(tmp_path / "nope")).size("key")


# -- the remote-read machinery -------------------------------------------------------------


class MemorySource(RemoteSource):
    """A RemoteSource over a dict, recording the ranges it was asked for."""

    def __init__(self, files: dict[str, bytes], options: SourceOptions) -> None:
        super().__init__("mem://folder", options)
        self.files = files
        self.calls: list[tuple[str, int, int, str]] = []
        self.short = False

    def size(self, name: str) -> int:
        if name not in self.files:
            raise SourceNotFoundError(f"{self.describe(name)} does not exist")
        return len(self.files[name])

    def _read_range(self, name: str, offset: int, length: int) -> bytes:
        self.calls.append((name, offset, length, threading.current_thread().name))
        data = self.files[name][offset : offset + length]
        return data[:-1] if self.short and offset > 0 else data


def test_remote_read_splits_into_parallel_parts() -> None:
    blob = np.random.default_rng().bytes(10_000)
    with MemorySource({"f": blob}, SourceOptions(part_bytes=1024, max_concurrency=3)) as src:
        assert src.read("f", 0, 1024) == blob[:1024]
        assert src.calls[-1][3] == threading.current_thread().name  # one part: no pool
        src.calls.clear()
        data = src.read("f", 100, 9_000)
        assert isinstance(data, bytes) and data == blob[100:9_100]
        spans = sorted((o, n) for _, o, n, _ in src.calls)
        assert spans == [(100 + i * 1024, min(1024, 9_000 - i * 1024)) for i in range(9)]
        assert all(t.startswith("hps-source") for *_, t in src.calls)
        assert src.read("f", 5, 0) == b""


def test_remote_read_checks_every_part() -> None:
    blob = bytes(5_000)
    with MemorySource({"f": blob}, SourceOptions(part_bytes=1000)) as src:
        src.short = True
        with pytest.raises(
            SourceError, match=r"mem://folder/f: expected 1000 bytes at offset 1000, got 999"
        ):
            src.read("f", 0, 5_000)
        with pytest.raises(SourceError, match="invalid range"):
            src.read("f", -1, 10)


def test_remote_close_and_garbage_collection() -> None:
    src = MemorySource({"f": bytes(4096)}, SourceOptions(part_bytes=1024))
    src.read("f", 0, 4096)
    pool = src._pool
    assert pool is not None
    src.close()
    with pytest.raises(SourceError, match="closed"):
        src.read("f", 0, 10)
    with pytest.raises(RuntimeError):
        pool.submit(print)  # shut down
    dropped = MemorySource({"f": bytes(4096)}, SourceOptions(part_bytes=1024))
    dropped.read("f", 0, 4096)
    pool = dropped._pool
    assert pool is not None
    del dropped
    gc.collect()
    with pytest.raises(RuntimeError):
        pool.submit(print)  # released by the finalizer


def test_model_source_is_a_context_manager(tmp_path: Path) -> None:
    with LocalSource(str(tmp_path)) as source:
        assert isinstance(source, ModelSource)
