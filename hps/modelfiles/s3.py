"""Sparse model folders on S3 and S3-compatible stores, read with boto3.

URI forms (the forms HugeCTR and AWS accept) and what is taken from each:

    s3://bucket/prefix/table0                               bucket, prefix
    https://bucket.s3.<region>.amazonaws.com/prefix/table0  bucket, prefix, region
    https://s3.<region>.amazonaws.com/bucket/prefix/table0  bucket, prefix, region
    (also the older s3-<region> and region-less s3.amazonaws.com hosts, and .com.cn)

The region comes from the URL when it names one; else `SourceOptions.s3_region`, boto3's
chain (AWS_DEFAULT_REGION, the profile's region), AWS_REGION, else us-east-1. A bare s3:// URI
therefore needs no region; a bucket in another region is still found, through botocore's
region redirect (one extra round trip). The endpoint is `SourceOptions.s3_endpoint`, else
AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, else AWS's. The https forms keep their parsed
bucket, prefix and region when an endpoint override is set (the override only says where
to send the requests). Credentials come from boto3's default chain.

Reads: `size` is a HEAD; `read` is one ranged GET per `part_bytes` part, parts fetched in
parallel. A GET carries the ETag that `size` saw (If-Match), so an object replaced
between sizing and reading fails loudly instead of mixing two versions; a HEAD answered
without an ETag or a Content-Length (not an S3 server: a plain web server) is a
SourceError naming the header.

Errors: a missing bucket or object → SourceNotFoundError; no credentials, an unknown
access key, a bad signature, access denied → SourceAccessError; an endpoint that refuses
or does not answer → SourceUnreachableError after `connect_attempts` tries. Each message
names the full URI of the file, and what the endpoint did: its HTTP status, the time it
held the call over all its attempts. Whatever the endpoint answers, one call (a HEAD, a
part's GET, a listing) sends at most `request_limit()` requests, retries and redirects
included (s3_requests.py); a redirect S3 would not send (one naming no region) is not
followed. Not guaranteed: S3 answers 403, not 404, for a missing
object when the credentials lack s3:ListBucket, so that case reads as access denied.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from hps.errors import (
    MissingExtraError,
    SourceAccessError,
    SourceError,
    SourceNotFoundError,
    SourceUnreachableError,
)
from hps.modelfiles.s3_requests import (
    REGION_HEADER,
    Call,
    budgeted,
    count_request,
    note_answer,
)
from hps.modelfiles.source import SUPPORTED_FORMS, RemoteSource, SourceOptions, s3_endpoint

if TYPE_CHECKING:
    from botocore.client import BaseClient

DEFAULT_REGION = "us-east-1"

_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+$")
_AWS_SUFFIXES = (".amazonaws.com.cn", ".amazonaws.com")

_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_ACCESS_CODES = {
    "AccessDenied",
    "AllAccessDisabled",
    "AccountProblem",
    "ExpiredToken",
    "InvalidAccessKeyId",
    "InvalidToken",
    "InvalidSecurity",
    "SignatureDoesNotMatch",
    "TokenRefreshRequired",
    "403",
}


@dataclass(frozen=True)
class S3Location:
    """Where a model folder lives: bucket, key prefix ('' = bucket root), region or None."""

    bucket: str
    prefix: str
    region: str | None
    style: str  # 's3', 'virtual-hosted' or 'path': which URI form it was written in

    def key(self, name: str) -> str:
        """The object key of file `name` in the folder."""
        return f"{self.prefix}/{name}" if self.prefix else name


def _bad(uri: str, why: str) -> SourceError:
    return SourceError(f"malformed S3 URI {uri!r}: {why}; expected one of: {SUPPORTED_FORMS}")


def _region_of(labels: list[str], uri: str) -> str | None:
    """Region from the labels after the bucket: 's3.<region>', 's3-<region>', 's3'."""
    service, rest = labels[0], labels[1:]
    if service.startswith("s3-"):
        tail = service[3:]
        if tail == "external-1":
            return DEFAULT_REGION
        if not _REGION.match(tail):
            raise _bad(uri, f"'{service}' endpoints (accelerate, access points…) are not supported")
        return tail
    regions = [label for label in rest if _REGION.match(label)]
    others = [label for label in rest if label not in regions and label != "dualstack"]
    if others or len(regions) > 1:
        raise _bad(uri, f"cannot read a region from the host labels {'.'.join(labels)!r}")
    return regions[0] if regions else None


def parse_s3_uri(uri: str) -> S3Location:
    """Split an s3:// or https://…amazonaws.com URI; SourceError if it is not one."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise _bad(uri, "no bucket")
        return S3Location(parsed.netloc, parsed.path.strip("/"), None, "s3")
    host = (parsed.hostname or "").lower()
    suffix = next((s for s in _AWS_SUFFIXES if host.endswith(s)), None)
    if parsed.scheme not in ("http", "https") or suffix is None:
        raise _bad(uri, "not an s3:// or https://…amazonaws.com address")
    if parsed.query or parsed.fragment:
        raise _bad(uri, "a model folder URI takes no query or fragment")
    labels = host[: -len(suffix)].split(".")
    is_s3 = [i for i, label in enumerate(labels) if label == "s3" or label.startswith("s3-")]
    if not is_s3:
        raise _bad(uri, f"{host!r} is not an S3 endpoint")
    path = unquote(parsed.path)
    if is_s3[0] == 0:  # path style: s3.<region>.amazonaws.com/bucket/prefix
        region = _region_of(labels, uri)
        bucket, _, prefix = path.lstrip("/").partition("/")
        if not bucket:
            raise _bad(uri, "path-style address without a bucket in the path")
        return S3Location(bucket, prefix.strip("/"), region, "path")
    # virtual-hosted style: <bucket>.s3.<region>.amazonaws.com/prefix; bucket may hold dots
    first = is_s3[0]
    bucket = ".".join(labels[:first])
    region = _region_of(labels[first:], uri)
    return S3Location(bucket, path.strip("/"), region, "virtual-hosted")


def _import_boto3() -> Any:
    try:
        import boto3
        import botocore.config  # noqa: F401
        import botocore.exceptions  # noqa: F401
    except ImportError:
        raise MissingExtraError("boto3", "s3", "reading s3:// model URIs") from None
    return boto3


def _stop_connect_retries(
    connect_attempts: int, attempts: int, caught_exception: Exception | None = None, **_: Any
) -> float | None:
    """needs-retry hook: retry connection failures only `connect_attempts` times, quickly.

    botocore's retry modes treat a refused connection like a 503 (up to max_attempts, with
    backoff of up to seconds each), which makes a wrong endpoint look like a hang. This
    runs before botocore's own handler: it re-raises after `connect_attempts`, and asks
    for a short fixed delay before that. Any other outcome is left to botocore.
    """
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if not isinstance(caught_exception, BotoConnectionError):
        return None
    if attempts >= connect_attempts:
        raise caught_exception
    return 0.1 * attempts


class S3Source(RemoteSource):
    """One model folder on S3: `size` by HEAD, `read` by parallel ranged GETs.

    Attributes: `location` (bucket, prefix, region parsed from the URI), `region` (the
    region requests are signed for), `endpoint` (the override, or None for AWS), `client`.
    """

    def __init__(self, uri: str, options: SourceOptions | None = None) -> None:
        super().__init__(uri, options)
        self.location = parse_s3_uri(uri)
        boto3 = _import_boto3()
        import botocore.exceptions
        from botocore.config import Config

        opts = self.options
        try:
            session = boto3.session.Session()
        except botocore.exceptions.ProfileNotFound as exc:
            raise SourceAccessError(f"{uri}: {exc} (check AWS_PROFILE)") from None
        self.region: str = (
            self.location.region
            or opts.s3_region
            or session.region_name
            or os.environ.get("AWS_REGION")  # other AWS SDKs' variable; botocore ignores it
            or DEFAULT_REGION
        )
        self.endpoint = s3_endpoint(opts)
        style = opts.s3_addressing_style
        if style == "auto" and self.endpoint:
            style = "path"
        config = Config(
            region_name=self.region,
            connect_timeout=opts.connect_timeout,
            read_timeout=opts.read_timeout,
            retries={"mode": "standard", "total_max_attempts": opts.max_attempts},
            max_pool_connections=max(10, opts.max_concurrency),
            s3={"addressing_style": style},
        )
        self.client: BaseClient = session.client("s3", endpoint_url=self.endpoint, config=config)
        events = self.client.meta.events
        events.register_first("needs-retry.s3", note_answer)
        events.register_first(
            "needs-retry.s3", partial(_stop_connect_retries, opts.connect_attempts)
        )
        events.register("before-send.s3", count_request)
        self._on_close(self.client.close)
        self._etags: dict[str, str] = {}

    def request_limit(self) -> int:
        """The most requests one call sends: botocore's attempts of its request and of
        a region redirect's, and of the GET that names a HEAD's error, or the attempts
        of a part whose body breaks off."""
        return 2 * self.options.max_attempts + 2

    def _call(self, name: str) -> Any:
        """The budget of one call on file `name` (s3_requests.budgeted)."""
        return budgeted(self.describe(name), self._where(), self.request_limit())

    # -- the ModelSource contract ---------------------------------------------------------

    def size(self, name: str) -> int:
        key = self.location.key(name)
        with self._call(name) as call:
            try:
                head = self.client.head_object(Bucket=self.location.bucket, Key=key)
            except Exception as exc:
                # HEAD errors carry no code ('404', '403'): ask a GET for the precise one.
                raise self._error(name, self._diagnose(key, exc), call=call) from exc
        etag, length = head.get("ETag"), head.get("ContentLength")
        if etag is None or length is None:
            raise self._not_s3(name, "an ETag" if etag is None else "a Content-Length")
        with self._lock:
            self._etags[name] = etag
        return int(length)

    def names(self) -> list[str]:
        prefix = self.location.key("")
        found: list[str] = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.location.bucket, Prefix=prefix, Delimiter="/")
        page_iter = iter(pages)
        while True:  # each page is a call of its own
            with self._call("") as call:
                try:
                    page = next(page_iter, None)
                except Exception as exc:
                    raise self._error("", exc, call=call) from exc
            if page is None:
                break
            found += [obj["Key"][len(prefix) :] for obj in page.get("Contents", ())]
        return sorted(n for n in found if n)

    def _read_range(self, name: str, offset: int, length: int) -> bytes:
        from botocore.exceptions import (
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )

        args = {
            "Bucket": self.location.bucket,
            "Key": self.location.key(name),
            "Range": f"bytes={offset}-{offset + length - 1}",
        }
        with self._lock:
            etag = self._etags.get(name)
        if etag:
            args["IfMatch"] = etag
        # botocore retries the request itself; a body that breaks off or stalls once the
        # response has started is outside its reach, so that is retried here.
        with self._call(name) as call:
            for attempt in range(1, self.options.max_attempts + 1):
                try:
                    body = self.client.get_object(**args)["Body"]
                except Exception as exc:
                    raise self._error(name, exc, offset=offset, length=length,
                                      call=call) from exc
                try:
                    data: bytes = body.read()  # raises IncompleteReadError when cut short
                    return data
                except (ResponseStreamingError, IncompleteReadError, ReadTimeoutError) as exc:
                    if attempt == self.options.max_attempts:
                        raise self._error(name, exc, call=call) from exc
                finally:
                    body.close()
        raise AssertionError("unreachable")

    # -- errors ---------------------------------------------------------------------------

    def _diagnose(self, key: str, exc: Exception) -> Exception:
        from botocore.exceptions import ClientError

        precise: Exception = exc
        if isinstance(exc, ClientError) and _code(exc) in ("404", "403"):
            try:
                get = self.client.get_object
                get(Bucket=self.location.bucket, Key=key, Range="bytes=0-0")["Body"].close()
            except ClientError as answer:
                precise = answer
            except Exception:  # the HEAD's own error is still a good answer
                pass
        return precise

    def _not_s3(self, name: str, missing: str) -> SourceError:
        """The error of a HEAD answered without `missing`: S3 and the stores that speak
        its protocol always send both the ETag (what the GETs then require, so an object
        replaced during the load is not mixed with its successor) and the length (how
        the file is read in parts); a plain web server does not."""
        return SourceError(
            f"{self.describe(name)}: {self._where()} answered HEAD without {missing} "
            "header, which S3 always sends: is the endpoint an S3 server (s3_endpoint, "
            "AWS_ENDPOINT_URL)?")

    def _where(self) -> str:
        return f"endpoint {self.endpoint}" if self.endpoint else f"AWS S3 in {self.region}"

    def _error(self, name: str, exc: Exception, *, call: Call, offset: int = 0,
               length: int = 0) -> SourceError:
        """The SourceError subclass for a boto3/botocore failure on file `name`, in
        `call` (what it sent, for how long)."""
        from botocore import exceptions as bx

        uri = self.describe(name)
        bucket = self.location.bucket
        if isinstance(exc, bx.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            # an answer without S3's XML error body (a web server's HTML page, which
            # botocore parses to an empty code) is read by its status, as a HEAD's is
            code = _code(exc) or (str(status) if status else "")
            msg = exc.response.get("Error", {}).get("Message") or ""
            headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            if code == "NoSuchBucket":
                return SourceNotFoundError(f"{uri}: S3 bucket {bucket!r} does not exist")
            if code in _NOT_FOUND_CODES:
                return SourceNotFoundError(
                    f"{uri} does not exist (no object {self.location.key(name)!r} "
                    f"in bucket {bucket!r})"
                )
            if code in _ACCESS_CODES:
                hint = ""
                if code in ("AccessDenied", "403"):
                    hint = (
                        " (S3 also answers this for a missing object when the credentials "
                        "lack s3:ListBucket)"
                    )
                return SourceAccessError(f"{uri}: access denied by S3: {code}: {msg}{hint}")
            if code in ("PreconditionFailed", "412"):
                return SourceError(
                    f"{uri} changed while it was being read (its ETag no longer matches): "
                    "reload the model once the upload is complete"
                )
            if code == "InvalidRange":
                return SourceError(
                    f"{uri}: range of {length} bytes at offset {offset} lies past the end "
                    "of the object (file shorter than its size, or changed while loading?)"
                )
            region = headers.get(REGION_HEADER)
            if region or code == "AuthorizationHeaderMalformed":
                # S3 names the bucket's region where a request was signed for another
                in_region = f"is in region {region}" if region else "is in another region"
                return SourceError(
                    f"{uri}: bucket {bucket!r} {in_region}, not {self.region}: "
                    f"{self._where()} answered {_answer(status, code)}: name the region "
                    "in the URI or s3_region")
            if isinstance(status, int) and 300 <= status < 400:
                # S3 redirects only to name a bucket's region (above): any other redirect
                # is not followed, a request must not be sent to another host
                to = f" to {headers['location']}" if headers.get("location") else ""
                return SourceError(
                    f"{uri}: {self._where()} redirected the request (HTTP {status}{to}), "
                    "which S3 does not do and hps does not follow: point the endpoint at "
                    "the store itself")
            named = f" {code}" if code != str(status) else ""  # S3's own code, if any
            said = f": {msg}" if msg else ""
            return SourceError(f"{uri}: S3 error{named} (HTTP {status}){said}")
        if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            return SourceAccessError(
                f"{uri}: no AWS credentials found ({exc}): set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with an instance/task role"
            )
        if isinstance(exc, bx.CredentialRetrievalError):
            return SourceAccessError(f"{uri}: cannot obtain AWS credentials: {exc}")
        if isinstance(exc, bx.SSLError):
            return SourceError(f"{uri}: TLS error talking to {self._where()}: {exc}")
        if isinstance(exc, bx.ConnectionError):  # refused, DNS, connect timeout, proxy
            return SourceUnreachableError(
                f"{uri}: cannot connect to {self._where()} after {call.sent} attempt(s) "
                f"over {call.elapsed:.1f}s: {exc}")
        if isinstance(exc, bx.ReadTimeoutError):
            return SourceUnreachableError(
                f"{uri}: {self._where()} did not answer: {call.attempts()}, each given "
                f"{self.options.read_timeout:g}s (source_read_timeout)")
        if isinstance(exc, bx.BotoCoreError):
            return SourceError(f"{uri}: {type(exc).__name__}: {exc}")
        if isinstance(exc, SourceError):
            return exc
        return SourceError(f"{uri}: unexpected {type(exc).__name__}: {exc}")


def _code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _answer(status: Any, code: str) -> str:
    """'HTTP 301 PermanentRedirect', or 'HTTP 301' where the code is the status itself
    (botocore's code of an answer without an error body)."""
    return f"HTTP {status}" if code in ("", str(status)) else f"HTTP {status} {code}"
