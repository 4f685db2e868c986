"""The model-source base types: a folder of files read in byte ranges, and its options.

A `ModelSource` is one folder (one table): it answers the size of a file in it and
ranged reads of that file. The loader only ever reads in ranges, so a source never needs
to hold a whole file in memory. `RemoteSource` is the base of the network sources
(hps.modelfiles.s3, hps.modelfiles.hdfs): it splits a large read into parts of
`SourceOptions.part_bytes` fetched in parallel and checks every part's length.
`hps.modelfiles.uri.open_source` picks the source for a URI; this module imports nothing
else from hps.modelfiles, so the sources it dispatches to can import it without a circle.

Sources hold connections and threads: use them as context managers or call `close()`;
a source that is garbage collected unclosed releases them too.
"""

from __future__ import annotations

import os
import stat
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, TypeVar

from hps.errors import SourceError, SourceNotFoundError

C = TypeVar("C", bound="Closing")


class Closing:
    """Something that holds connections, threads or files until `close()`; a `with`
    block closes it on the way out, error or not."""

    def close(self) -> None:  # noqa: B027 - optional hook: local sources hold nothing
        """Release connections, threads and files (a no-op where none are held)."""

    def __enter__(self: C) -> C:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def file_size(info: os.stat_result, where: str) -> int:
    """The size of the file `info` describes; SourceError when `where` is a folder or
    anything else but a plain file (a folder's size is that of its entry table, not of
    model data: read as a key file it would give a count of keys of nothing)."""
    if stat.S_ISREG(info.st_mode):
        return info.st_size
    what = "a folder" if stat.S_ISDIR(info.st_mode) else "not a plain file"
    raise SourceError(f"{where!r} is {what}, not a model file")


class ModelSource(Closing, ABC):
    """A folder of model files that can be sized and read in byte ranges."""

    def __init__(self, uri: str) -> None:
        self.uri = uri

    @abstractmethod
    def size(self, name: str) -> int:
        """Size in bytes of file `name` in the folder; SourceNotFoundError if absent."""

    @abstractmethod
    def read(self, name: str, offset: int, length: int) -> bytes:
        """Exactly `length` bytes of `name` from `offset`; SourceError if fewer come."""

    def exists(self, name: str) -> bool:
        """Whether file `name` exists in the folder."""
        try:
            self.size(name)
        except SourceNotFoundError:
            return False
        return True

    def names(self) -> list[str]:
        """Names of the files directly in the folder, sorted; SourceError if it cannot list.

        Only folders of part files (a Parquet dataset) need this; sources that cannot
        list say so here.
        """
        raise SourceError(f"{self.uri}: this source cannot list its files")

    def describe(self, name: str) -> str:
        """The URI of one file, for messages."""
        return f"{self.uri.rstrip('/')}/{name}"



#: parts a remote read is split into, fetched in parallel
DEFAULT_PART_BYTES = 8 << 20


@dataclass(frozen=True)
class SourceOptions:
    """Settings for remote sources. Every field has a default that suits AWS S3 and HDFS.

    S3:
      s3_endpoint     endpoint URL override (MinIO, Ceph, LocalStack…); when None the
                      environment's AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL, then AWS.
      s3_region       region when the URI names none (s3://); else boto3's chain
                      (AWS_DEFAULT_REGION, the profile's region), AWS_REGION, else
                      us-east-1. A region in an https://…amazonaws.com URI always wins.
      s3_addressing_style  'auto': path-style with an endpoint override (what MinIO
                      needs), botocore's choice against AWS; or 'path' / 'virtual'.
    HDFS:
      hdfs_user       user name for WebHDFS (`user.name`, simple auth); None →
                      HADOOP_USER_NAME, else none sent.
      hdfs_config     extra Hadoop keys for hdfs-native (they override its defaults and
                      those read from HADOOP_CONF_DIR).
    All remote sources:
      part_bytes      a read larger than this is split into parts fetched in parallel
      max_concurrency parallel part requests per source
      connect_timeout seconds to open a connection; a dead host fails after this
      read_timeout    seconds a started response may stall
      max_attempts    attempts per request for transient failures (throttling, 5xx,
                      read timeouts, broken streams), with exponential backoff
      connect_attempts attempts per request when the host refuses or does not answer a
                      connection: kept small so an unreachable endpoint is reported fast
      redirect_hosts  hosts a WebHDFS redirect may send a read to besides the URI's own
                      (its DataNodes); a redirect anywhere else is refused
    """

    s3_endpoint: str | None = None
    s3_region: str | None = None
    s3_addressing_style: Literal["auto", "path", "virtual"] = "auto"
    hdfs_user: str | None = None
    hdfs_config: Mapping[str, str] | None = None
    part_bytes: int = DEFAULT_PART_BYTES
    max_concurrency: int = 8
    connect_timeout: float = 3.0
    read_timeout: float = 60.0
    max_attempts: int = 5
    connect_attempts: int = 2
    redirect_hosts: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for name in ("part_bytes", "max_concurrency", "max_attempts", "connect_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"SourceOptions.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("connect_timeout", "read_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SourceOptions.{name} must be > 0, got {getattr(self, name)}")


def check_length(source: ModelSource, name: str, offset: int, length: int, data: bytes) -> bytes:
    """`data` if it is exactly `length` bytes, else a SourceError naming the file."""
    if len(data) != length:
        raise SourceError(
            f"{source.describe(name)}: expected {length} bytes at offset {offset}, "
            f"got {len(data)} (file shorter than its size, or changed while loading?)"
        )
    return data


class RemoteSource(ModelSource):
    """A source over the network: parallel ranged reads, resources released on close.

    Subclasses implement `size` and `_read_range` (one request for one range, may be
    retried inside); `read` splits a large range into `options.part_bytes` parts fetched
    by a thread pool, and checks every part's length. Subclasses register what they must
    release with `_on_close` (a callable that must not refer to the source itself).
    """

    def __init__(self, uri: str, options: SourceOptions | None = None) -> None:
        super().__init__(uri)
        self.options = options or SourceOptions()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._finalizers: list[weakref.finalize[[], object]] = []
        self._closed = False

    def _on_close(self, release: Callable[[], object]) -> None:
        self._finalizers.append(weakref.finalize(self, release))

    @abstractmethod
    def _read_range(self, name: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of `name`, in one request (length >= 1)."""

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise SourceError(f"{self.uri}: the source is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.options.max_concurrency, thread_name_prefix="hps-source"
                )
                pool = self._pool
                self._on_close(lambda: pool.shutdown(wait=False, cancel_futures=True))
            return self._pool

    def read(self, name: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise SourceError(
                f"{self.describe(name)}: invalid range offset={offset} length={length}"
            )
        if self._closed:
            raise SourceError(f"{self.uri}: the source is closed")
        if length == 0:
            return b""
        part = self.options.part_bytes
        if length <= part:
            return check_length(self, name, offset, length, self._read_range(name, offset, length))
        starts = range(offset, offset + length, part)
        sizes = [min(part, offset + length - s) for s in starts]
        # map() yields in order, re-raises the first failure and cancels the parts not
        # yet started, so a failure costs at most the parts already in flight.
        results = self._executor().map(
            lambda s_n: check_length(self, name, s_n[0], s_n[1], self._read_range(name, *s_n)),
            zip(starts, sizes, strict=True),
        )
        return b"".join(results)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._pool = None
        for finalizer in self._finalizers:
            finalizer()
        self._finalizers.clear()


def s3_endpoint(options: SourceOptions | None = None) -> str | None:
    """The S3 endpoint override: the option, else AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL."""
    if options is not None and options.s3_endpoint:
        return options.s3_endpoint
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


SUPPORTED_FORMS = (
    "a local path or file:///path, s3://bucket/prefix, "
    "https://bucket.s3.<region>.amazonaws.com/prefix, "
    "https://s3.<region>.amazonaws.com/bucket/prefix, hdfs://namenode:port/path, "
    "viewfs://cluster/path, webhdfs://namenode:port/path or swebhdfs://namenode:port/path"
)
