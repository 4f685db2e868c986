"""Model URIs → readers of the files in a sparse model folder.

A `ModelSource` is one folder (one table): it answers the size of a file in it and
ranged reads of that file. The loader only ever reads in ranges, so a source never needs
to hold a whole file in memory. `open_source` picks the reader by scheme (the classes'
modules are hps.modelfiles'):

    /path/to/table0, file:///path        local files                    LocalSource
                                         (inside `confined(roots, ...)`: ConfinedSource,
                                         opened beneath an allowed root)
    s3://bucket/prefix/table0            S3 (and S3-compatible stores)  s3.S3Source
    https://bucket.s3.<region>.amazonaws.com/prefix/table0
    https://s3.<region>.amazonaws.com/bucket/prefix/table0
    hdfs://namenode:port/path            HDFS over its RPC protocol     hdfs.HdfsSource
    viewfs://cluster/path                  (hdfs-native, no JVM)
    webhdfs://namenode:port/path         HDFS over WebHDFS REST         hdfs.WebHdfsSource
    swebhdfs://namenode:port/path          (the same over HTTPS)

Remote sources split a large read into parts of `SourceOptions.part_bytes` fetched in
parallel, retry transient failures, and map every failure to one `SourceError` subclass
that names the URI: `SourceNotFoundError` (no such file, object or bucket),
`SourceAccessError` (no credentials, access denied) or `SourceUnreachableError` (host or
endpoint cannot be reached; reported fast: short connect timeout, few connect retries).
A missing optional dependency raises `MissingExtraError` naming the extra ('s3', 'hdfs').

Sources hold connections and threads: use them as context managers or call `close()`;
a source that is garbage collected unclosed releases them too.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

from hps.errors import SourceError, SourceNotFoundError
from hps.modelfiles.confined import ConfinedSource, current_roots

# The base types live in hps.modelfiles.source (s3.py and hdfs.py import only that module);
# they are re-exported here, where callers have always found them.
from hps.modelfiles.source import (
    DEFAULT_PART_BYTES,
    SUPPORTED_FORMS,
    ModelSource,
    RemoteSource,
    SourceOptions,
    check_length,
    file_size,
    s3_endpoint,
)

__all__ = [
    "DEFAULT_PART_BYTES",
    "SUPPORTED_FORMS",
    "LocalSource",
    "ModelSource",
    "RemoteSource",
    "SourceOptions",
    "check_length",
    "local_path",
    "open_source",
    "s3_endpoint",
    "scheme_of",
]


def local_path(uri: str) -> str:
    """The path of a local source's URI (a path, or file:///path); SourceError for a
    file URI naming a host, or a NUL byte."""
    path = uri
    if uri.startswith("file://"):
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):  # file://relative/x: a host, no path
            raise SourceError(
                f"{uri!r}: a file URI names an absolute path (file:///path); here "
                f"{parsed.netloc!r} stands where the path's root belongs")
        path = parsed.path
    if "\x00" in path:
        raise SourceError(f"{uri!r}: a path holds no NUL byte")
    return path


class LocalSource(ModelSource):
    """A folder on the local file system (trusted: links are followed wherever they lead;
    what a request names is read by hps.modelfiles.confined.ConfinedSource instead)."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.path = local_path(uri)

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def size(self, name: str) -> int:
        try:
            info = os.stat(self._file(name))
        except FileNotFoundError:
            if not os.path.isdir(self.path):
                raise SourceNotFoundError(f"model folder {self.path!r} does not exist") from None
            raise SourceNotFoundError(f"{self._file(name)!r} does not exist") from None
        except NotADirectoryError:
            raise SourceError(f"{self.path!r} is a file, not a model folder") from None
        except OSError as exc:
            raise SourceError(f"cannot read {self._file(name)!r}: {exc.strerror}") from exc
        return file_size(info, self._file(name))

    def names(self) -> list[str]:
        try:
            with os.scandir(self.path) as entries:
                return sorted(e.name for e in entries if e.is_file())
        except FileNotFoundError:
            raise SourceNotFoundError(f"model folder {self.path!r} does not exist") from None
        except NotADirectoryError:
            raise SourceError(f"{self.path!r} is a file, not a folder") from None
        except OSError as exc:
            raise SourceError(f"cannot list {self.path!r}: {exc.strerror}") from exc

    def read(self, name: str, offset: int, length: int) -> bytes:
        try:
            with open(self._file(name), "rb") as f:
                f.seek(offset)
                data = f.read(length)
        except FileNotFoundError:
            raise SourceNotFoundError(f"{self._file(name)!r} does not exist") from None
        except OSError as exc:
            raise SourceError(f"cannot read {self._file(name)!r}: {exc.strerror}") from exc
        if len(data) != length:
            raise SourceError(
                f"{self._file(name)!r}: expected {length} bytes at offset {offset}, "
                f"got {len(data)} (file changed while loading?)"
            )
        return data


def scheme_of(uri: str) -> str:
    """'local', 's3', 'hdfs', 'webhdfs' (https S3 addresses count as 's3'), else the scheme."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return "local"
    if parsed.scheme == "s3":
        return "s3"
    host = (parsed.hostname or "").lower()
    if parsed.scheme in ("http", "https") and (
        host.endswith(".amazonaws.com") or host.endswith(".amazonaws.com.cn")
    ):
        return "s3"
    if parsed.scheme in ("hdfs", "viewfs"):
        return "hdfs"
    if parsed.scheme in ("webhdfs", "swebhdfs"):
        return "webhdfs"
    return parsed.scheme


def open_source(uri: str, options: SourceOptions | None = None) -> ModelSource:
    """A reader for the model folder at `uri`.

    Raises SourceError for an unsupported scheme (naming the supported forms) or a
    malformed URI, MissingExtraError when the reader's package is not installed. Opening
    does not contact the host: errors about the host or the files come from `size`/`read`.
    """
    scheme = scheme_of(uri)
    if scheme == "local":
        roots = current_roots()
        if roots is not None:
            return ConfinedSource(uri, local_path(uri), roots)
        return LocalSource(uri)
    if scheme == "s3":
        from hps.modelfiles.s3 import S3Source

        return S3Source(uri, options)
    if scheme == "hdfs":
        from hps.modelfiles.hdfs import HdfsSource

        return HdfsSource(uri, options)
    if scheme == "webhdfs":
        from hps.modelfiles.hdfs import WebHdfsSource

        return WebHdfsSource(uri, options)
    hint = ""
    if scheme in ("http", "https"):
        hint = (
            " (for an S3-compatible store that is not AWS, write s3://bucket/prefix and set"
            " the endpoint: SourceOptions.s3_endpoint, ps config 's3_endpoint' or"
            " AWS_ENDPOINT_URL)"
        )
    raise SourceError(
        f"unsupported model URI {uri!r}: scheme {scheme!r} is not one of the supported "
        f"forms: {SUPPORTED_FORMS}{hint}"
    )
