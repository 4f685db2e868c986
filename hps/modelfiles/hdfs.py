"""Sparse model folders on HDFS: hdfs-native (no JVM) and WebHDFS (HTTP REST).

    hdfs://namenode:port/path     HdfsSource over the HDFS RPC protocol, via the
    hdfs:///path                  `hdfs-native` package (Rust; no JVM, no libhdfs).
    viewfs://cluster/path         Without a port, or without a host, the name service
                                  and fs.defaultFS come from HADOOP_CONF_DIR (HA setups).
    webhdfs://namenode:port/path  WebHdfsSource over the WebHDFS REST API (stdlib HTTP):
    swebhdfs://namenode:port/path GETFILESTATUS for sizes, OPEN&offset=&length= for ranges
                                  (following the NameNode's redirect to a DataNode).
                                  Default port 9870 (Hadoop 3). Simple auth only: the
                                  user is SourceOptions.hdfs_user or HADOOP_USER_NAME.

Errors: a missing file → SourceNotFoundError; an AccessControlException, a refused
SASL/Kerberos handshake or an HTTP 401/403 → SourceAccessError; a namenode or datanode
that refuses or does not answer → SourceUnreachableError after `connect_attempts` tries.
Every message names the full URI of the file. WebHDFS with Kerberos (SPNEGO) is not
supported: use hdfs://, which hdfs-native authenticates with Kerberos.
"""

from __future__ import annotations

import http.client
import json
import os
import posixpath
import re
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, urlencode, urljoin, urlparse

from hps.errors import (
    MissingExtraError,
    SourceAccessError,
    SourceError,
    SourceNotFoundError,
    SourceUnreachableError,
)
from hps.modelfiles.source import SUPPORTED_FORMS, RemoteSource, SourceOptions
from hps.runtime.backoff import Backoff

if TYPE_CHECKING:
    from hdfs_native import Client

T = TypeVar("T")

WEBHDFS_DEFAULT_PORT = 9870
WEBHDFS_PREFIX = "/webhdfs/v1"
_MAX_REDIRECTS = 5
_JAVA_NAME = re.compile(r"[A-Za-z_$][A-Za-z0-9_$.]{0,120}")

_CONNECT_ERROR_WORDS = (
    "connection refused",
    "connection reset",
    "timed out",
    "no route to host",
    "network is unreachable",
    "failed to lookup address",
    "name or service not known",
    "broken pipe",
    "rpc listener disconnected",  # accepted, then dropped: not a namenode RPC port?
)
_ACCESS_WORDS = (
    "AccessControlException",
    "AuthorizationException",
    "InvalidToken",
    "SaslException",
    "SASLError",
    "GSSAPIError",
    "NoSASLMechanism",
)


@dataclass(frozen=True)
class HdfsLocation:
    """Where a model folder lives on HDFS."""

    scheme: str  # hdfs, viewfs, webhdfs or swebhdfs
    host: str  # '' = fs.defaultFS from the Hadoop config (hdfs:///path)
    port: int | None
    path: str  # absolute, no trailing slash

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}" if self.port else self.host

    def file(self, name: str) -> str:
        """Absolute path of file `name` in the folder."""
        return posixpath.join(self.path, name)


def parse_hdfs_uri(uri: str) -> HdfsLocation:
    """Split an hdfs://, viewfs://, webhdfs:// or swebhdfs:// URI; SourceError if malformed."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("hdfs", "viewfs", "webhdfs", "swebhdfs"):
        raise SourceError(f"not an HDFS URI {uri!r}; expected one of: {SUPPORTED_FORMS}")
    try:
        port = parsed.port
    except ValueError:
        raise SourceError(f"malformed HDFS URI {uri!r}: bad port") from None
    if parsed.query or parsed.fragment:
        raise SourceError(f"malformed HDFS URI {uri!r}: a model folder URI takes no query")
    host = parsed.hostname or ""
    if parsed.scheme.endswith("webhdfs") and not host:
        raise SourceError(f"malformed WebHDFS URI {uri!r}: no namenode host")
    path = posixpath.normpath("/" + parsed.path.lstrip("/"))
    return HdfsLocation(parsed.scheme, host, port, path.rstrip("/") or "/")


def _is_connect_error(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, socket.timeout, socket.gaierror)):
        return True
    text = str(exc).lower()
    return isinstance(exc, OSError) and any(w in text for w in _CONNECT_ERROR_WORDS)


# -- hdfs-native ----------------------------------------------------------------------------


def _import_hdfs_native() -> Any:
    try:
        import hdfs_native
    except ImportError:
        raise MissingExtraError("hdfs-native", "hdfs", "reading hdfs:// model URIs") from None
    return hdfs_native


class HdfsSource(RemoteSource):
    """One model folder on HDFS through hdfs-native's RPC client.

    hdfs-native retries a namenode it cannot reach with its failover loop; that loop is
    bounded here by `connect_attempts` (dfs.client.failover.max.attempts) with a short
    sleep, so a dead namenode is reported in well under a second when it refuses, and
    after hdfs-native's own connect timeout when it does not answer at all.
    """

    def __init__(self, uri: str, options: SourceOptions | None = None) -> None:
        super().__init__(uri, options)
        self.location = parse_hdfs_uri(uri)
        if self.location.scheme not in ("hdfs", "viewfs"):
            raise SourceError(f"{uri!r} is not an hdfs:// or viewfs:// URI")
        hdfs_native = _import_hdfs_native()
        opts = self.options
        config = {
            "dfs.client.failover.max.attempts": str(opts.connect_attempts - 1),
            "dfs.client.failover.sleep.base.millis": "100",
            "dfs.client.failover.sleep.max.millis": "1000",
            **(opts.hdfs_config or {}),
        }
        url = f"{self.location.scheme}://{self.location.authority}" if self.location.host else None
        try:
            self.client: Client = hdfs_native.Client(url, config)
        except Exception as exc:
            raise SourceError(f"{uri}: cannot set up the HDFS client: {exc}") from exc

    def _call(self, name: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except SourceError:
            raise
        except Exception as exc:
            raise self._error(name, exc) from exc

    def size(self, name: str) -> int:
        path = self.location.file(name)
        status = self._call(name, lambda: self.client.get_file_info(path))
        if status.isdir:
            raise SourceError(f"{self.describe(name)} is a directory, not a file")
        return int(status.length)

    def names(self) -> list[str]:
        statuses = self._call("", lambda: list(self.client.list_status(self.location.path)))
        return sorted(posixpath.basename(s.path) for s in statuses if not s.isdir)

    def _read_range(self, name: str, offset: int, length: int) -> bytes:
        # One reader per range: readers are not shared between the pool's threads (their
        # thread safety is not documented); opening one costs one getBlockLocations RPC.
        path = self.location.file(name)
        reader = self._call(name, lambda: self.client.read(path))
        end = len(reader)
        if offset + length > end:
            raise SourceError(
                f"{self.describe(name)}: expected {length} bytes at offset {offset}, but the "
                f"file is {end} bytes (file shorter than its size, or changed while loading?)"
            )
        return bytes(self._call(name, lambda: reader.read_range(offset, length)))

    def _error(self, name: str, exc: BaseException) -> SourceError:
        uri = self.describe(name)
        if isinstance(exc, FileNotFoundError):
            return SourceNotFoundError(f"{uri} does not exist")
        if isinstance(exc, IsADirectoryError):
            return SourceError(f"{uri} is a directory, not a file")
        text = str(exc)
        if isinstance(exc, PermissionError) or any(w in text for w in _ACCESS_WORDS):
            return SourceAccessError(f"{uri}: access denied by HDFS: {text}")
        if _is_connect_error(exc):
            where = self.location.authority or "the fs.defaultFS namenode"
            return SourceUnreachableError(
                f"{uri}: cannot reach namenode/datanode {where} after "
                f"{self.options.connect_attempts} attempt(s): {text}"
            )
        return SourceError(f"{uri}: HDFS error: {type(exc).__name__}: {text}")


# -- WebHDFS --------------------------------------------------------------------------------


class _Transient(Exception):
    """A failure worth retrying: 5xx, a read timeout, a response cut short."""


class _Unreachable(Exception):
    """A connection that could not be opened."""


class WebHdfsSource(RemoteSource):
    """One model folder on HDFS through the WebHDFS REST API (no dependency but stdlib)."""

    def __init__(self, uri: str, options: SourceOptions | None = None) -> None:
        super().__init__(uri, options)
        self.location = parse_hdfs_uri(uri)
        if self.location.scheme not in ("webhdfs", "swebhdfs"):
            raise SourceError(f"{uri!r} is not a webhdfs:// or swebhdfs:// URI")
        self.secure = self.location.scheme == "swebhdfs"
        port = self.location.port or WEBHDFS_DEFAULT_PORT
        self.base_url = f"{'https' if self.secure else 'http'}://{self.location.host}:{port}"
        self.user = self.options.hdfs_user or os.environ.get("HADOOP_USER_NAME") or None

    def _url(self, name: str, op: str, **params: int) -> str:
        query: dict[str, str | int] = {"op": op, **params}
        if self.user:
            query["user.name"] = self.user
        where = self.location.file(name) if name else self.location.path  # '' = the folder
        path = quote(WEBHDFS_PREFIX + where, safe="/")
        return f"{self.base_url}{path}?{urlencode(query)}"

    def size(self, name: str) -> int:
        body = self._request(name, self._url(name, "GETFILESTATUS"))
        try:
            status = json.loads(body)["FileStatus"]
            kind, length = status.get("type"), int(status["length"])
        except (ValueError, KeyError, TypeError) as exc:
            raise SourceError(
                f"{self.describe(name)}: GETFILESTATUS answered something that is not "
                f"WebHDFS FileStatus JSON ({exc})"
            ) from None
        if kind == "DIRECTORY":
            raise SourceError(f"{self.describe(name)} is a directory, not a file")
        return length

    def names(self) -> list[str]:
        body = self._request("", self._url("", "LISTSTATUS"))
        try:
            statuses = json.loads(body)["FileStatuses"]["FileStatus"]
            return sorted(s["pathSuffix"] for s in statuses if s.get("type") == "FILE")
        except (ValueError, KeyError, TypeError) as exc:
            raise SourceError(
                f"{self.uri}: LISTSTATUS answered something that is not WebHDFS "
                f"FileStatuses JSON ({exc})"
            ) from None

    def _read_range(self, name: str, offset: int, length: int) -> bytes:
        return self._request(name, self._url(name, "OPEN", offset=offset, length=length))

    # -- HTTP -------------------------------------------------------------------------------

    def _request(self, name: str, url: str) -> bytes:
        """GET `url` (following redirects) with retries; the body, or a SourceError."""
        opts = self.options
        # a refused connection is retried soon and few times (a dead host is reported
        # fast); a 5xx or a broken response with longer waits
        connect_waits = Backoff(0.1, 1.0, jitter=0.0, attempts=opts.connect_attempts).delays()
        transient_waits = Backoff(0.1, 5.0, jitter=0.0, attempts=opts.max_attempts).delays()
        while True:
            try:
                return self._get(name, url)
            except _Unreachable as exc:
                delay = next(connect_waits, None)
                if delay is None:
                    raise SourceUnreachableError(
                        f"{self.describe(name)}: cannot connect to WebHDFS at {exc.args[0]} "
                        f"after {opts.connect_attempts} attempt(s): {exc.args[1]}"
                    ) from None
                time.sleep(delay)
            except _Transient as exc:
                delay = next(transient_waits, None)
                if delay is None:
                    raise SourceError(
                        f"{self.describe(name)}: WebHDFS failed {opts.max_attempts} times, "
                        f"last: {exc}"
                    ) from None
                time.sleep(delay)

    def _connection(self, url: str) -> http.client.HTTPConnection:
        parsed = urlparse(url)
        host, port = parsed.hostname or "", parsed.port
        timeout = self.options.connect_timeout
        conn: http.client.HTTPConnection
        if parsed.scheme == "https":
            conn = http.client.HTTPSConnection(
                host, port, timeout=timeout, context=ssl.create_default_context()
            )
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.connect()
        except (OSError, ssl.SSLError) as exc:
            conn.close()
            if isinstance(exc, ssl.SSLError):
                raise SourceError(f"{url}: TLS error: {exc}") from None
            raise _Unreachable(f"{host}:{port}", exc) from None
        # the connect timeout was for opening; a started response may take longer
        assert conn.sock is not None
        conn.sock.settimeout(self.options.read_timeout)
        return conn

    def _get(self, name: str, url: str) -> bytes:
        for _ in range(_MAX_REDIRECTS + 1):
            parsed = urlparse(url)
            target = parsed.path + (f"?{parsed.query}" if parsed.query else "")
            conn = self._connection(url)
            try:
                conn.request("GET", target, headers={"Accept": "*/*"})
                resp = conn.getresponse()
                if resp.status in (301, 302, 303, 307, 308):
                    location = resp.getheader("Location")
                    resp.read()
                    if not location:
                        raise SourceError(f"{url}: redirect without a Location header")
                    url = self._redirect_target(name, urljoin(url, location))
                    continue
                body = resp.read()
                if resp.status == 200:
                    return body
                raise self._http_error(name, resp.status, body)
            except (http.client.IncompleteRead, socket.timeout, ConnectionError) as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from None
            except http.client.HTTPException as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from None
            finally:
                conn.close()
        raise SourceError(f"{self.describe(name)}: more than {_MAX_REDIRECTS} redirects")

    def _redirect_target(self, name: str, url: str) -> str:
        """`url` when a redirect may go there: http(s) to the URI's own host or one of
        `redirect_hosts` (a redirect elsewhere would make the server fetch what a
        WebHDFS answer names: a request forgery)."""
        target = urlparse(url)
        own = (urlparse(self.base_url).hostname or "").lower()
        host = (target.hostname or "").lower()
        if target.scheme not in ("http", "https") or (
                host != own and host not in self.options.redirect_hosts):
            raise SourceError(  # (the target is not named: it is what the host wrote)
                f"{self.describe(name)}: WebHDFS redirected the read to a host that is "
                "neither its own nor in source_redirect_hosts")
        return url

    def _http_error(self, name: str, status: int, body: bytes) -> Exception:
        uri = self.describe(name)
        exception, _ = _remote_exception(body)
        detail = exception or f"HTTP {status}"
        if exception == "FileNotFoundException" or (status == 404 and exception):
            return SourceNotFoundError(f"{uri} does not exist ({detail})")
        if status == 404:
            return SourceError(
                f"{uri}: {self.base_url} answered HTTP 404 without a WebHDFS RemoteException:"
                " is it the namenode's WebHDFS HTTP port (9870 by default)?"
            )
        if status == 401:
            return SourceAccessError(
                f"{uri}: WebHDFS asks for authentication ({detail}); the WebHDFS route "
                "supports simple auth only (hdfs_user / HADOOP_USER_NAME): for Kerberos "
                "use hdfs://"
            )
        if status == 403 or exception in ("AccessControlException", "SecurityException"):
            return SourceAccessError(f"{uri}: access denied by HDFS ({detail})")
        if status >= 500 and exception not in ("IllegalArgumentException",):
            return _Transient(f"HTTP {status} {detail}")
        return SourceError(f"{uri}: WebHDFS error ({detail})")


def _remote_exception(body: bytes) -> tuple[str, str]:
    """(exception, '') of a WebHDFS RemoteException JSON body, or ('', '').

    The server's own message is not passed on: error messages reach HTTP clients of a
    reload, and must never carry what a remote host wrote. The exception's Java class
    name is kept when it is one.
    """
    try:
        remote = json.loads(body)["RemoteException"]
        exception = str(remote.get("exception", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "", ""
    return (exception if _JAVA_NAME.fullmatch(exception) else ""), ""
