"""Model URIs → readers of the files in a sparse model folder.

A `ModelSource` is one folder (one table): it answers the size of a file in it and
ranged reads of that file. The loader only ever reads in ranges, so a source never needs
to hold a whole file in memory. `open_source` picks the reader by scheme:

    /path/to/table0, file:///path        local files
    s3://bucket/prefix/table0            S3 (and S3-compatible stores)
    https://bucket.s3.<region>.amazonaws.com/prefix/table0
    https://s3.<region>.amazonaws.com/bucket/prefix/table0
    hdfs://namenode:port/path            HDFS
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from urllib.parse import urlparse

from hps.errors import SourceError, SourceNotFoundError


class ModelSource(ABC):
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

    def describe(self, name: str) -> str:
        """The URI of one file, for messages."""
        return f"{self.uri.rstrip('/')}/{name}"


class LocalSource(ModelSource):
    """A folder on the local file system."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.path = uri[len("file://") :] if uri.startswith("file://") else uri

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def size(self, name: str) -> int:
        try:
            return os.stat(self._file(name)).st_size
        except FileNotFoundError:
            if not os.path.isdir(self.path):
                raise SourceNotFoundError(f"model folder {self.path!r} does not exist") from None
            raise SourceNotFoundError(f"{self._file(name)!r} does not exist") from None
        except OSError as exc:
            raise SourceError(f"cannot read {self._file(name)!r}: {exc.strerror}") from exc

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


@dataclass(frozen=True)
class SourceOptions:
    """Settings for remote sources (S3 endpoint override and the like)."""

    s3_endpoint: str | None = None


def scheme_of(uri: str) -> str:
    """'local', 's3', 'hdfs' (https S3 addresses count as 's3')."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return "local"
    if parsed.scheme == "s3":
        return "s3"
    if parsed.scheme in ("http", "https") and parsed.netloc.endswith(".amazonaws.com"):
        return "s3"
    if parsed.scheme in ("hdfs", "viewfs"):
        return "hdfs"
    return parsed.scheme


def open_source(uri: str, options: SourceOptions | None = None) -> ModelSource:
    """A reader for the model folder at `uri`; SourceError for an unsupported scheme."""
    scheme = scheme_of(uri)
    if scheme == "local":
        return LocalSource(uri)
    raise SourceError(
        f"unsupported model URI {uri!r}: expected a local path"
        " (S3 and HDFS readers are not installed in this build)"
    )
